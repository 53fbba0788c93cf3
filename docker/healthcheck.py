"""HEALTHCHECK of the locoswarm image: healthy while the node's control API answers and the node is
starting or training (exit 0), unhealthy otherwise (exit 1). Prints one line, which ``docker inspect``
shows under State.Health.

Where the API listens: ``--control-host`` / ``--control-port`` on PID 1's command line (docker/init.py
or docker's own init, followed by the node's arguments), else ``LOCOSWARM_CONTROL`` (HOST:PORT), else
``LOCOSWARM_CONTROL_PORT`` on 127.0.0.1 (the image sets 7615). It imports grpc and the generated stubs
only, not torch: one check costs a fraction of a CPU second.
"""

from __future__ import annotations

import os
import sys


def node_flags() -> dict[str, str]:
    """``--control-host`` and ``--control-port`` as given on PID 1's command line (``--flag V`` or ``--flag=V``)."""
    try:
        with open("/proc/1/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return {}
    found = {}
    for i, arg in enumerate(argv):
        for flag in ("--control-host", "--control-port"):
            if arg == flag and i + 1 < len(argv):
                found[flag] = argv[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg.split("=", 1)[1]
    return found


def main() -> int:
    from locoswarm.node.control import (
        DEFAULT_CONTROL_HOST,
        DEFAULT_CONTROL_PORT,
        ENV_CONTROL,
        ENV_CONTROL_PORT,
        parse_hostport,
    )
    from locoswarm.node.control.cli import ControlClient
    from locoswarm.node.errors import UserError

    flags = node_flags()
    port = flags.get("--control-port") or os.environ.get(ENV_CONTROL_PORT, "").strip() or str(DEFAULT_CONTROL_PORT)
    if port == "0":
        print("the control API is off (port 0): nothing to check")
        return 0
    host = flags.get("--control-host") or DEFAULT_CONTROL_HOST
    if host in ("0.0.0.0", "::", "[::]"):  # listening everywhere: ask on loopback
        host = DEFAULT_CONTROL_HOST
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    where = os.environ.get(ENV_CONTROL) if not flags and os.environ.get(ENV_CONTROL) else f"{host}:{port}"
    try:
        client = ControlClient(*parse_hostport(where))
        try:
            st = client.status()
        finally:
            client.close()
    except (UserError, ValueError) as exc:
        print(exc)
        return 1
    print(f"{st.state}: step {st.inner_step}, clock {st.clock}, {len(st.peers)} peer(s), {st.syncs_ok} round(s) ok; "
          f"control API {where}")
    return 0 if st.state in ("starting", "training") else 1


if __name__ == "__main__":
    sys.exit(main())
