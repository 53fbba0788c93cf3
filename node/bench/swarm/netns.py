"""Network namespaces, veth pairs, a bridge and link shaping for the swarm benchmark.

Topology (one per benchmark run, every name carries the bench's pid so parallel runs never collide)::

    hub namespace  lsb<pid>h:  bridge br0 ── veth h<i> ──┐
                                                          │ (veth pair)
    node namespace lsb<pid>n<i>:                eth0 ─────┘  10.77.0.<11+i>/24, lo

With ``nat=K`` the last K nodes (never node 0, the bootstrap) each sit behind a router of their own::

    hub namespace    lsb<pid>h:   bridge br0 ── veth h<i> ──┐
    router namespace lsb<pid>r<i>:                 eth0 ───┘  10.77.0.<11+i>/24 (the node's public address)
                                                   lan0 ───┐  10.78.<i>.1/24
    node namespace   lsb<pid>n<i>:                 eth0 ───┘  10.78.<i>.2/24, default route via .1

The router masquerades what leaves through ``eth0`` and lets in only replies (conntrack ESTABLISHED,
RELATED): a new inbound connection, to the router's address or the node's private one, is dropped
(no port forward), as behind a home router. A NATed node reaches the others only by dialing out.

Each node lives in its own namespace and reaches the others only through the bridge, so every byte
a node sends or receives crosses its own veth pair to the bridge, where it is shaped (for a NATed node
that pair is its router's):

- upload cap: a TBF qdisc on the egress of the node-side veth (``eth0`` in the node's namespace, or in
  its router's);
- download cap: a TBF qdisc on the egress of the hub-side veth (towards the node);
- random loss: an iptables ``statistic`` rule dropping packets arriving on that ``eth0`` (so each
  direction of every path sees the loss once; in a router in ``mangle PREROUTING``, which forwarded
  packets cross, in a public node in ``INPUT``).

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
PRIVATE_NET = "10.78"  # a NATed node i: PRIVATE_NET.i.0/24, its router .1, the node .2
MAX_NODES = 32
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)[hnr]\d*$")  # hub, node i, router i


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


def check_possible(*, loss: bool = False, nat: bool = False, cut: bool = False) -> None:
    """Raise :class:`UserError` (one line) when this process cannot create network namespaces (or, with
    ``loss``, drop packets at random: that needs ``iptables``, which a fresh Debian lacks; or, with ``nat``,
    put nodes behind masquerading routers: ``iptables`` with the kernel's NAT and conntrack; or, with ``cut``,
    drop every packet between two nodes: ``iptables`` with its raw table)."""
    if os.geteuid() != 0:
        raise UserError("bench swarm needs root: it creates network namespaces, veth pairs and tc qdiscs; "
                        "run it as root (e.g. sudo locoswarm bench swarm ...)")
    for tool in ("ip", "tc"):
        if _which(tool) is None:
            raise UserError(f"bench swarm needs the '{tool}' command (iproute2); install it")
    if loss and _which("iptables") is None:
        raise UserError("bench swarm --loss needs the 'iptables' command (it drops packets with a statistic "
                        "rule); install iptables, or run without --loss")
    if nat and _which("iptables") is None:
        raise UserError("bench swarm --nat needs the 'iptables' command (each NATed node's router masquerades "
                        "and drops inbound connections); install iptables, or run without --nat")
    if cut and _which("iptables") is None:
        raise UserError("bench swarm --cut needs the 'iptables' command (it drops the packets between the two "
                        "nodes of a pair); install iptables, or run without --cut")
    if nat and _which("sysctl") is None:
        raise UserError("bench swarm --nat needs the 'sysctl' command (procps: a router forwards with "
                        "net.ipv4.ip_forward=1); install procps, or run without --nat")
    probe = f"{PREFIX}{os.getpid()}probe"
    proc = _run(["ip", "netns", "add", probe], check=False)
    try:
        probes = [["-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE"],
                  ["-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]]
        if loss:  # a router's loss rule (forwarded packets never reach INPUT)
            probes.append(["-t", "mangle", "-A", "PREROUTING", "-i", "lo", "-m", "statistic", "--mode", "random",
                           "--probability", "0.5", "-j", "DROP"])
        if proc.returncode == 0 and cut:
            got = _run(["ip", "netns", "exec", probe, "iptables", "-w", *cut_rules("192.0.2.1")[0]], check=False)
            if got.returncode != 0:
                raise UserError(f"bench swarm --cut cannot add 'iptables {' '.join(cut_rules('192.0.2.1')[0])}' "
                                f"({(got.stderr or got.stdout).strip()[:160]}); this kernel lacks iptables' raw "
                                f"table: run without --cut")
        if proc.returncode == 0 and nat:
            for rule in probes:
                got = _run(["ip", "netns", "exec", probe, "iptables", "-w", *rule], check=False)
                if got.returncode != 0:
                    raise UserError(f"bench swarm --nat cannot add a router's rule 'iptables {' '.join(rule)}' "
                                    f"({(got.stderr or got.stdout).strip()[:160]}); this kernel lacks NAT, "
                                    f"conntrack or mangle: run without --nat")
    finally:
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


def natted_nodes(nodes: int, nat: int) -> list[int]:
    """The indices of the nodes behind NAT: the last ``nat`` of ``nodes`` (node 0, the bootstrap, never is)."""
    if not 0 <= nat < max(1, nodes):
        raise ValueError(f"nat must be in 0..{max(0, nodes - 1)} (node 0 stays public), not {nat}")
    return list(range(nodes - nat, nodes)) if nat else []


def public_address(i: int) -> str:
    """The address node ``i`` has on the bridge's subnet: its own, or its router's when it is NATed."""
    return f"{SUBNET}.{FIRST_HOST + i}"


def private_address(i: int) -> str:
    """The address a NATed node ``i`` has behind its router (the router is ``.1`` of the same /24)."""
    return f"{PRIVATE_NET}.{i}.2"


def router_address(i: int) -> str:
    """The inner address of NATed node ``i``'s router: the node's default gateway."""
    return f"{PRIVATE_NET}.{i}.1"


def router_rules(outer: str = "eth0", inner: str = "lan0") -> list[list[str]]:
    """The ``iptables`` arguments of a NATed node's router, in order: masquerade what leaves through ``outer``;
    forward replies and whatever comes from ``inner``, drop every other forwarded packet (no port forward);
    accept on ``outer`` only replies to the router itself."""
    return [
        ["-t", "nat", "-A", "POSTROUTING", "-o", outer, "-j", "MASQUERADE"],
        ["-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-A", "FORWARD", "-i", inner, "-j", "ACCEPT"],
        ["-A", "FORWARD", "-j", "DROP"],
        ["-A", "INPUT", "-i", outer, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-A", "INPUT", "-i", outer, "-j", "DROP"],
    ]


def cut_rules(other: str) -> list[list[str]]:
    """The ``iptables`` arguments that drop every packet to and from ``other`` in a node's link namespace (its own,
    or its router's): in the raw table, which neither the loss rule (filter or mangle) nor NAT touches; PREROUTING
    sees what arrives and what a NATed node sends through its router, OUTPUT what a public node sends."""
    return [["-t", "raw", "-A", "PREROUTING", "-s", other, "-j", "DROP"],
            ["-t", "raw", "-A", "PREROUTING", "-d", other, "-j", "DROP"],
            ["-t", "raw", "-A", "OUTPUT", "-d", other, "-j", "DROP"]]


@dataclass
class Topology:
    """The namespaces of one benchmark run; use as a context manager (``close`` on exit).

    ``nat``: how many nodes (the last ones) sit behind a router namespace of their own (see the module
    docstring); 0 to ``nodes - 1``, node 0 stays public."""

    nodes: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    created: list[str] = field(default_factory=list)
    shaping: Shaping = field(default_factory=Shaping)
    nat: int = 0
    # pairs of nodes that cannot connect at all (a firewall between two particular peers): every packet between
    # their addresses is dropped in the raw table of both link namespaces (``cut_rules``)
    cuts: tuple[tuple[int, int], ...] = ()

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}h"

    def ns(self, i: int) -> str:
        """The namespace of node ``i``."""
        return f"{PREFIX}{self.tag}n{i}"

    def router(self, i: int) -> str:
        """The namespace of NATed node ``i``'s router."""
        return f"{PREFIX}{self.tag}r{i}"

    def natted(self, i: int) -> bool:
        """Whether node ``i`` sits behind NAT (its own router)."""
        return self.nat > 0 and self.nodes - self.nat <= i < self.nodes

    def link_ns(self, i: int) -> str:
        """The namespace holding the node-side end (``eth0``) of node ``i``'s veth pair to the bridge: its
        own, or its router's."""
        return self.router(i) if self.natted(i) else self.ns(i)

    def address(self, i: int) -> str:
        """The IPv4 address node ``i`` itself has and listens on (no prefix length): its private address
        behind its router when it is NATed, else its address on the bridge's subnet."""
        return private_address(i) if self.natted(i) else public_address(i)

    @staticmethod
    def public_address(i: int) -> str:
        """The address node ``i`` is seen with on the bridge's subnet (its router's when it is NATed)."""
        return public_address(i)

    def _hub_dev(self, i: int) -> str:
        return f"h{i}"

    def _temps(self, i: int) -> tuple[str, ...]:
        """The temporary veth names of node ``i`` in the root namespace: unique per run (pid), at most 15
        characters; ``a``/``b``: the pair to the bridge, ``c``/``d``: a NATed node's pair to its router."""
        return tuple(f"{PREFIX}{self.tag}{x}{i}"[:15] for x in "abcd")

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it in node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def __enter__(self) -> Topology:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the hub with its bridge, one namespace per node and a router per NATed node, wired and up
        (unshaped)."""
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in 1..{MAX_NODES}")
        natted_nodes(self.nodes, self.nat)  # raises on a bad count
        try:
            self._add_ns(self.hub)
            hub = ["ip", "-n", self.hub]
            _run([*hub, "link", "add", "br0", "type", "bridge"])
            _run([*hub, "link", "set", "br0", "up"])
            _run([*hub, "link", "set", "lo", "up"])
            for i in range(self.nodes):
                self._add_ns(self.ns(i))
                if self.natted(i):
                    self._add_ns(self.router(i))
                a, b, c, d = self._temps(i)
                # the pair to the bridge: eth0 in the node's namespace (or its router's), h<i> in the hub
                self._veth(a, self.link_ns(i), "eth0", b, self.hub, self._hub_dev(i))
                _run(["ip", "-n", self.link_ns(i), "addr", "add", f"{public_address(i)}/{PREFIX_LEN}", "dev", "eth0"])
                _run([*hub, "link", "set", self._hub_dev(i), "master", "br0"])
                _run([*hub, "link", "set", self._hub_dev(i), "up"])
                _run(["ip", "-n", self.link_ns(i), "link", "set", "eth0", "up"])
                _run(["ip", "-n", self.link_ns(i), "link", "set", "lo", "up"])
                if self.natted(i):
                    self._wire_router(i, c, d)
            for a, b in sorted(self._cut_pairs()):
                for rule in cut_rules(public_address(b)):
                    _run(["ip", "netns", "exec", self.link_ns(a), "iptables", "-w", *rule])
        except BaseException:
            self.close()
            raise

    def _veth(self, a: str, ns_a: str, name_a: str, b: str, ns_b: str, name_b: str) -> None:
        """A veth pair made in the root namespace as ``a``/``b``, moved to ``ns_a``/``ns_b`` and renamed."""
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        try:
            _run(["ip", "link", "set", a, "netns", ns_a])
            _run(["ip", "link", "set", b, "netns", ns_b])
        except NetnsError:
            _run(["ip", "link", "del", a], check=False)
            raise
        _run(["ip", "-n", ns_a, "link", "set", a, "name", name_a])
        _run(["ip", "-n", ns_b, "link", "set", b, "name", name_b])

    def _wire_router(self, i: int, c: str, d: str) -> None:
        """NATed node ``i``: the pair node eth0 -- router lan0 on its private subnet, the node's default
        route via the router, forwarding and the router's rules."""
        node, router = ["ip", "-n", self.ns(i)], ["ip", "-n", self.router(i)]
        self._veth(c, self.ns(i), "eth0", d, self.router(i), "lan0")
        _run([*node, "addr", "add", f"{private_address(i)}/24", "dev", "eth0"])
        _run([*router, "addr", "add", f"{router_address(i)}/24", "dev", "lan0"])
        _run([*node, "link", "set", "eth0", "up"])
        _run([*node, "link", "set", "lo", "up"])
        _run([*router, "link", "set", "lan0", "up"])
        _run([*node, "route", "add", "default", "via", router_address(i)])
        _run(["ip", "netns", "exec", self.router(i), "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        for rule in router_rules():
            _run(["ip", "netns", "exec", self.router(i), "iptables", "-w", *rule])

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)

    def _loss_chain(self, i: int) -> list[str]:
        """The iptables table and chain of node ``i``'s loss rule: in a router the packets arriving on eth0
        are mostly forwarded ones, which INPUT never sees, so there it is mangle PREROUTING."""
        return ["-t", "mangle", "PREROUTING"] if self.natted(i) else ["INPUT"]

    def shape(self, shaping: Shaping) -> None:
        """Apply ``shaping`` to every node's link to the bridge (replacing what was there)."""
        self.unshape()
        for i in range(self.nodes):
            link = self.link_ns(i)
            if shaping.upload_bps is not None:
                _run(["tc", "-n", link, "qdisc", "replace", "dev", "eth0", "root", *tbf_args(shaping.upload_bps)])
            if shaping.download_bps is not None:
                _run(["tc", "-n", self.hub, "qdisc", "replace", "dev", self._hub_dev(i), "root",
                      *tbf_args(shaping.download_bps)])
            if shaping.loss > 0:
                *table, chain = self._loss_chain(i)
                _run(["ip", "netns", "exec", link, "iptables", "-w", *table, "-A", chain, "-i", "eth0", "-m",
                      "statistic", "--mode", "random", "--probability", f"{shaping.loss:.6f}", "-j", "DROP"])
        self.shaping = shaping

    def unshape(self) -> None:
        """Remove every qdisc and loss rule of this run (links at full veth speed; a router's NAT rules stay)."""
        for i in range(self.nodes):
            link = self.link_ns(i)
            _run(["tc", "-n", link, "qdisc", "del", "dev", "eth0", "root"], check=False)
            _run(["tc", "-n", self.hub, "qdisc", "del", "dev", self._hub_dev(i), "root"], check=False)
            if self.shaping.loss > 0:
                *table, chain = self._loss_chain(i)
                _run(["ip", "netns", "exec", link, "iptables", "-w", *table, "-F", chain], check=False)
        self.shaping = Shaping()

    def describe(self) -> dict:
        """What is installed now, from the kernel (qdiscs per node), and whether each node is behind NAT,
        for the report."""
        out = {}
        for i in range(self.nodes):
            up = _run(["tc", "-n", self.link_ns(i), "qdisc", "show", "dev", "eth0"], check=False).stdout.strip()
            down = _run(["tc", "-n", self.hub, "qdisc", "show", "dev", self._hub_dev(i)], check=False).stdout.strip()
            out[self.ns(i)] = {"upload_qdisc": up, "download_qdisc": down, "behind_nat": self.natted(i),
                               "address": self.address(i), "public_address": public_address(i),
                               "router": self.router(i) if self.natted(i) else None,
                               "cut_from": sorted(b for a, b in self._cut_pairs() if a == i)}
        return out

    def _cut_pairs(self) -> set[tuple[int, int]]:
        return {(a, b) for i, j in self.cuts for a, b in ((i, j), (j, i))}

    def close(self) -> None:
        """Delete every namespace this run created (and with them all veths, qdiscs and rules)."""
        for name in reversed(self.created):
            with contextlib.suppress(Exception):
                _run(["ip", "netns", "del", name], check=False)
        # the hub side of a veth dies with its peer; a half-made pair left in the root namespace:
        for i in range(self.nodes):
            for temp in self._temps(i):
                if os.path.exists(f"/sys/class/net/{temp}"):
                    _run(["ip", "link", "del", temp], check=False)
        self.created.clear()
