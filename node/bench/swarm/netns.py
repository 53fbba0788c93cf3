"""Network namespaces, veth pairs, a bridge and link shaping for the swarm benchmark.

Topology (one per benchmark run, every name carries the bench's pid so parallel runs never collide)::

    hub namespace  lsb<pid>h:  bridge br0 ── veth h<i> ──┐
                                                          │ (veth pair)
    node namespace lsb<pid>n<i>:                eth0 ─────┘  10.77.0.<11+i>/24, lo

Each node lives in its own namespace and reaches the others only through the bridge, so every byte
a node sends or receives crosses its own veth pair, where it is shaped:

- upload cap: a TBF qdisc on the egress of the node-side veth (``eth0`` in the node's namespace);
- download cap: a TBF qdisc on the egress of the hub-side veth (towards the node);
- random loss: an iptables ``statistic`` rule dropping packets arriving on ``eth0`` (so each
  direction of every path sees the loss once).

The kernel here has no netem, so latency is not done here but by :mod:`locoswarm.node.bench.swarm.proxy`.

Cleanup is guaranteed by construction: every qdisc, veth and iptables rule lives inside a namespace
this module created, and :meth:`Topology.close` deletes those namespaces (deleting a namespace
deletes its interfaces, their qdiscs and its netfilter tables). ``close`` is idempotent and never
raises; :func:`remove_stale` deletes namespaces of earlier runs whose process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from locoswarm.node.errors import UserError

PREFIX = "lsb"  # locoswarm swarm bench
SUBNET = "10.77.0"
PREFIX_LEN = 24
FIRST_HOST = 11  # node i gets SUBNET.(FIRST_HOST + i)
MAX_NODES = 32
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)[hn]\d*$")


class NetnsError(RuntimeError):
    """An ``ip``/``tc``/``iptables`` command failed (the message holds the command and its stderr)."""


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def bench_namespaces(pid: int | None = None) -> list[str]:
    """Namespaces made by a swarm bench (of process ``pid`` when given)."""
    out = []
    for name in list_namespaces():
        m = _NAME_RE.match(name)
        if m and (pid is None or int(m.group(1)) == pid):
            out.append(name)
    return out


def remove_stale() -> list[str]:
    """Delete namespaces left by swarm benches whose process no longer exists (e.g. SIGKILLed)."""
    removed = []
    for name in bench_namespaces():
        pid = int(_NAME_RE.match(name).group(1))  # type: ignore[union-attr]
        if not os.path.exists(f"/proc/{pid}"):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def check_possible(*, loss: bool = False) -> None:
    """Raise :class:`UserError` (one line) when this process cannot create network namespaces (or, with
    ``loss``, drop packets at random: that needs ``iptables``, which a fresh Debian lacks)."""
    if os.geteuid() != 0:
        raise UserError("bench swarm needs root: it creates network namespaces, veth pairs and tc qdiscs; "
                        "run it as root (e.g. sudo locoswarm bench swarm ...)")
    for tool in ("ip", "tc"):
        if _which(tool) is None:
            raise UserError(f"bench swarm needs the '{tool}' command (iproute2); install it")
    if loss and _which("iptables") is None:
        raise UserError("bench swarm --loss needs the 'iptables' command (it drops packets with a statistic "
                        "rule); install iptables, or run without --loss")
    probe = f"{PREFIX}{os.getpid()}probe"
    proc = _run(["ip", "netns", "add", probe], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    if proc.returncode != 0:
        raise UserError(f"bench swarm cannot create a network namespace ('ip netns add' said: "
                        f"{proc.stderr.strip()[:200]}); run it as root on Linux with namespaces enabled")


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")


@dataclass(frozen=True)
class Shaping:
    """How every link is shaped: rates in bit/s (None = uncapped) and a packet loss probability."""

    upload_bps: float | None = None
    download_bps: float | None = None
    loss: float = 0.0

    @property
    def shaped(self) -> bool:
        return self.upload_bps is not None or self.download_bps is not None or self.loss > 0


def tbf_args(rate_bps: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``rate_bps``: a burst of 10 ms of traffic (at least four
    full frames, so the bucket works at any kernel HZ) and a queue of at most 100 ms."""
    rate = max(1, int(rate_bps))
    burst = max(4 * 1514, int(rate / 8 / 100))
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "100ms"]


@dataclass
class Topology:
    """The namespaces of one benchmark run; use as a context manager (``close`` on exit)."""

    nodes: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    created: list[str] = field(default_factory=list)
    shaping: Shaping = field(default_factory=Shaping)

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}h"

    def ns(self, i: int) -> str:
        """The namespace of node ``i``."""
        return f"{PREFIX}{self.tag}n{i}"

    @staticmethod
    def address(i: int) -> str:
        """The IPv4 address of node ``i`` (no prefix length)."""
        return f"{SUBNET}.{FIRST_HOST + i}"

    def _hub_dev(self, i: int) -> str:
        return f"h{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it in node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def __enter__(self) -> Topology:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the hub with its bridge and one namespace per node, wired and up (unshaped)."""
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in 1..{MAX_NODES}")
        try:
            self._add_ns(self.hub)
            hub = ["ip", "-n", self.hub]
            _run([*hub, "link", "add", "br0", "type", "bridge"])
            _run([*hub, "link", "set", "br0", "up"])
            _run([*hub, "link", "set", "lo", "up"])
            for i in range(self.nodes):
                ns = self.ns(i)
                self._add_ns(ns)
                # temporary names in the root namespace: unique per run (pid) and at most 15 characters
                a, b = f"{PREFIX}{self.tag}a{i}"[:15], f"{PREFIX}{self.tag}b{i}"[:15]
                _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
                try:
                    _run(["ip", "link", "set", a, "netns", ns])
                    _run(["ip", "link", "set", b, "netns", self.hub])
                except NetnsError:
                    _run(["ip", "link", "del", a], check=False)
                    raise
                node = ["ip", "-n", ns]
                _run([*node, "link", "set", a, "name", "eth0"])
                _run([*node, "addr", "add", f"{self.address(i)}/{PREFIX_LEN}", "dev", "eth0"])
                _run([*node, "link", "set", "eth0", "up"])
                _run([*node, "link", "set", "lo", "up"])
                _run([*hub, "link", "set", b, "name", self._hub_dev(i)])
                _run([*hub, "link", "set", self._hub_dev(i), "master", "br0"])
                _run([*hub, "link", "set", self._hub_dev(i), "up"])
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)

    def shape(self, shaping: Shaping) -> None:
        """Apply ``shaping`` to every node's link (replacing what was there)."""
        self.unshape()
        for i in range(self.nodes):
            if shaping.upload_bps is not None:
                _run(["tc", "-n", self.ns(i), "qdisc", "replace", "dev", "eth0", "root",
                      *tbf_args(shaping.upload_bps)])
            if shaping.download_bps is not None:
                _run(["tc", "-n", self.hub, "qdisc", "replace", "dev", self._hub_dev(i), "root",
                      *tbf_args(shaping.download_bps)])
            if shaping.loss > 0:
                _run([*self.exec_prefix(i), "iptables", "-w", "-A", "INPUT", "-i", "eth0", "-m", "statistic",
                      "--mode", "random", "--probability", f"{shaping.loss:.6f}", "-j", "DROP"])
        self.shaping = shaping

    def unshape(self) -> None:
        """Remove every qdisc and loss rule of this run (links at full veth speed)."""
        for i in range(self.nodes):
            _run(["tc", "-n", self.ns(i), "qdisc", "del", "dev", "eth0", "root"], check=False)
            _run(["tc", "-n", self.hub, "qdisc", "del", "dev", self._hub_dev(i), "root"], check=False)
            if self.shaping.loss > 0:
                _run([*self.exec_prefix(i), "iptables", "-w", "-F", "INPUT"], check=False)
        self.shaping = Shaping()

    def describe(self) -> dict:
        """What is installed now, from the kernel (qdiscs and loss rules per node), for the report."""
        out = {}
        for i in range(self.nodes):
            up = _run(["tc", "-n", self.ns(i), "qdisc", "show", "dev", "eth0"], check=False).stdout.strip()
            down = _run(["tc", "-n", self.hub, "qdisc", "show", "dev", self._hub_dev(i)], check=False).stdout.strip()
            out[self.ns(i)] = {"upload_qdisc": up, "download_qdisc": down}
        return out

    def close(self) -> None:
        """Delete every namespace this run created (and with them all veths, qdiscs and rules)."""
        for name in reversed(self.created):
            with contextlib.suppress(Exception):
                _run(["ip", "netns", "del", name], check=False)
        # the hub side of a veth dies with its peer; a half-made pair left in the root namespace:
        for i in range(self.nodes):
            for temp in (f"{PREFIX}{self.tag}a{i}"[:15], f"{PREFIX}{self.tag}b{i}"[:15]):
                if os.path.exists(f"/sys/class/net/{temp}"):
                    _run(["ip", "link", "del", temp], check=False)
        self.created.clear()
