"""Print the multiaddr to bootstrap from, read from another node's ``status.json`` (argument 1), once that
node is up: the file exists, names addresses with a peer id, was rewritten recently (a live node rewrites
it every heartbeat) and the node is not leaving. A non-loopback IPv4 address is preferred.

Used by the image's entrypoint for ``LOCOSWARM_BOOTSTRAP_FROM`` (see docker/compose.yaml). Waits at most
``LOCOSWARM_BOOTSTRAP_WAIT`` seconds (default 300); exit code 1 when it gives up.
"""

from __future__ import annotations

import json
import os
import sys
import time

FRESH_S = 60.0


def pick(addrs: list[str]) -> str | None:
    usable = [a for a in addrs if "/p2p/" in a and "/p2p-circuit" not in a]
    remote = [a for a in usable if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    for group in (remote, usable):
        if group:
            return sorted(group, key=lambda a: "/ip6/" in a)[0]
    return None


def read(path: str) -> tuple[dict, float]:
    try:
        with open(path) as fh:
            return json.load(fh), time.time() - os.stat(path).st_mtime
    except (OSError, ValueError):
        return {}, float("inf")


def main() -> int:
    path = sys.argv[1]
    wait = float(os.environ.get("LOCOSWARM_BOOTSTRAP_WAIT", "300"))
    deadline = time.monotonic() + wait
    said = False
    while True:
        status, age = read(path)
        addr = pick(status.get("addrs") or [])
        if addr and age < FRESH_S and status.get("state") not in ("leaving", "stopped"):
            print(f"bootstrapping from {addr} (from {path})", file=sys.stderr)
            print(addr)
            return 0
        if time.monotonic() > deadline:
            print(f"locoswarm: error: LOCOSWARM_BOOTSTRAP_FROM={path}: no live node's status there after {wait:.0f} s "
                  f"(is that node running, and its state dir mounted here?)", file=sys.stderr)
            return 1
        if not said:
            print(f"waiting for the bootstrap node's status at {path}", file=sys.stderr)
            said = True
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
