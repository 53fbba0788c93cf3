"""Reachability: whether other peers can dial this node (public) or it can only dial out (outbound only).

Most volunteers sit behind a home router: they can open connections, nobody can open one to them. A node
learns which it is by a **dial-back check**: it asks up to ``CHECKERS`` connected peers, over
``locoswarm.reach.v1``, to open a plain TCP connection to the port it listens on, at the address the peer's
libp2p connection from it comes from (the router's address behind NAT). Only that address is dialled, never
one the requester names, so nobody can turn checkers against a third host; a checker dials each requester at
most once per ``CHECK_EVERY_S`` and runs at most ``MAX_CONCURRENT_CHECKS`` dials at once. The node believes the
majority of the answers it got (a tie is public: rounds then fail fast where it was wrong, and the check is
repeated). libp2p's own AutoNAT in the bundled p2pd reports its verdict nowhere a client can read, so it is not
used.

An outbound-only node runs its DHT in client mode (peers never add it to their routing tables, so nobody
wastes dials or lookups on it), reduces no part of a round (``locoswarm.node.transport.groups.form_groups``
gives every group a public member, and outbound-only members send their parts to the public reducers and read
the results on the same streams), and serves no state (downloaders skip it). It is still a full member of
rounds and a full contributor of tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from locoswarm.node.status import ReachabilityStatus
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.swarm.wire import open_stream, serve
from locoswarm.protocol import swarm_pb2

log = logging.getLogger("locoswarm.reachability")

REACH_HANDLER = "locoswarm.reach.v1"
CHECKERS = 3                 # peers asked at once
DIAL_TIMEOUT_S = 3.0         # a checker's TCP connect to the requester
ASK_TIMEOUT_S = 10.0         # the requester's wait for one checker's answer
CHECK_EVERY_S = 30.0         # a checker dials one requester at most this often
MAX_CONCURRENT_CHECKS = 4    # dial-backs a checker runs at once (more are refused, not queued)
MAX_TRACKED = 1024           # requesters whose last check time a checker remembers
RECHECK_S = 300.0            # how often a running node repeats its check (a router may change)
FIRST_CHECK_S = 20.0         # an unchecked node (a swarm's first) asks its first peers this long after its start

#: The states a node reports (heartbeats, status, metrics).
PUBLIC, RELAYED, OUTBOUND_ONLY, UNKNOWN = "public", "relayed", "outbound-only", "unknown"
STATES = (PUBLIC, RELAYED, OUTBOUND_ONLY, UNKNOWN)
#: What ``--reachability`` accepts: check (auto) or take the user's word.
MODES = ("auto", PUBLIC, OUTBOUND_ONLY)


@dataclass
class Verdict:
    """What the checkers said: how many reached this node, how many could not, how many gave no answer."""

    reachable: int = 0
    unreachable: int = 0
    no_answer: int = 0
    observed: list[str] = field(default_factory=list)  # the addresses the checkers dialled

    @property
    def answered(self) -> int:
        return self.reachable + self.unreachable

    @property
    def state(self) -> str:
        if not self.answered:
            return UNKNOWN
        return PUBLIC if self.reachable >= self.unreachable else OUTBOUND_ONLY


class Reachability:
    """This node's reachability as it knows it: the state, where it comes from (declared by the user, checked by
    peers, or assumed), and the last check's counts. Thread-safe enough for its use: the network thread writes
    whole values, the heartbeat and status threads read them."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"reachability mode {mode!r}; one of {', '.join(MODES)}")
        self.mode = mode
        self.state = {"auto": UNKNOWN, PUBLIC: PUBLIC, OUTBOUND_ONLY: OUTBOUND_ONLY}[mode]
        self.source = "declared" if mode != "auto" else "unchecked"
        self.verdict = Verdict()
        self.checked_at: float | None = None
        self.relay: str | None = None       # the relay's peer id, where this node is reachable through one
        self.checks_served = 0              # dial-backs this node ran for others
        self._told = False

    @property
    def outbound_only(self) -> bool:
        """Whether peers must never be asked to dial this node (it reduces no part and serves no state)."""
        return self.state == OUTBOUND_ONLY

    def dht_client_mode(self, has_bootstrap: bool) -> bool:
        """Whether the DHT starts in client mode: a declared outbound-only node, and under ``auto`` any node that
        joins through peers until its check shows it public (a first node, with nobody to join, is the swarm's
        entry point: peers dial it by definition)."""
        if self.mode == OUTBOUND_ONLY:
            return True
        return self.mode == "auto" and has_bootstrap

    def take(self, verdict: Verdict) -> None:
        """The result of a check. A declared mode keeps its state (a disagreeing check is logged); a check nobody
        answered changes nothing (the last answered one stands)."""
        if not verdict.answered:
            if not self.verdict.answered:
                self.verdict = verdict
            return
        self.verdict = verdict
        self.checked_at = time.time()
        if self.mode == "auto":
            self.state, self.source = verdict.state, "checked"
        elif verdict.state != self.state:
            log.warning("reachability is declared %s, but %d of %d peers that checked could%s dial this node",
                        self.state, verdict.reachable, verdict.answered, "" if verdict.reachable else " not")

    def assume(self, state: str, why: str) -> None:
        """A state without a check (e.g. the first node of a swarm, which others join by dialling it)."""
        if self.mode == "auto" and self.source != "checked":
            self.state, self.source = state, why

    def advice(self, port: int) -> str | None:
        """The one line a user behind NAT is told (once): what it means and how to become public."""
        if self.state != OUTBOUND_ONLY or self._told:
            return None
        self._told = True
        why = ("declared with --reachability outbound-only" if self.source == "declared" else
               f"{self.verdict.unreachable} of {self.verdict.answered} peers that checked could not dial it")
        return (f"outbound only ({why}): this node trains and averages through public peers, but reduces no part "
                f"and serves no state. To make it public, forward TCP port {port} on your router to this machine "
                f"and start with --port {port} --announce /ip4/<your public IP>/tcp/{port}")

    def status(self) -> ReachabilityStatus:
        """What ``status.json``, the control API and the metrics show under ``reachability``."""
        return ReachabilityStatus(state=self.state, mode=self.mode, source=self.source, relay=self.relay,
                                  checked_at=self.checked_at, reachable=self.verdict.reachable,
                                  unreachable=self.verdict.unreachable, no_answer=self.verdict.no_answer,
                                  checks_served=self.checks_served)


# ---- the checker side ----------------------------------------------------------------------------------------


def tcp_target(maddr: str) -> tuple[str, int] | None:
    """``(ip, port)`` of a ``/ip4|ip6/<ip>/tcp/<port>`` multiaddr (None for anything else: a relayed circuit,
    a DNS name, QUIC)."""
    parts = [p for p in str(maddr).split("/") if p]
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or "p2p-circuit" in parts:
        return None
    try:
        ip = ipaddress.ip_address(parts[1])
        port = int(parts[3])
    except ValueError:
        return None
    return (str(ip), port) if 0 < port < 65536 else None


async def dial(host: str, port: int, timeout: float = DIAL_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` (closed at once, nothing sent)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


class ReachServer:
    """Answers peers' dial-back requests (``locoswarm.reach.v1``): a TCP connect to the address their libp2p
    connection comes from, at the port they listen on."""

    def __init__(self, runtime: NetworkRuntime, reachability: Reachability) -> None:
        self.runtime = runtime
        self.reachability = reachability
        self._last: OrderedDict[str, float] = OrderedDict()
        self._running = 0
        self._server = runtime.call(serve(runtime.p2p, REACH_HANDLER, self._handle, swarm_pb2.ReachRequest,
                                          max_request_bytes=256, idle_timeout=ASK_TIMEOUT_S, max_streams_per_peer=1,
                                          max_streams=2 * MAX_CONCURRENT_CHECKS), timeout=30)

    async def _observed(self, remote: str) -> list[str]:
        """The addresses of this node's connections with ``remote`` (where its packets come from)."""
        out: list[str] = []
        with contextlib.suppress(Exception):
            for info in await self.runtime.p2p.list_peers():
                if str(info.peer_id) == remote:
                    out.extend(str(a) for a in info.addrs)
        return out

    async def _handle(self, remote: str, requests: AsyncIterator[swarm_pb2.ReachRequest]
                      ) -> AsyncIterator[swarm_pb2.ReachReply]:
        req = await anext(aiter(requests), None)  # one request per stream
        if req is None:
            return
        now = time.monotonic()
        last = self._last.get(remote)
        if last is not None and now - last < CHECK_EVERY_S:
            yield swarm_pb2.ReachReply(error=f"checked {now - last:.0f} s ago; at most one check per "
                                             f"{CHECK_EVERY_S:g} s")
            return
        if self._running >= MAX_CONCURRENT_CHECKS:
            yield swarm_pb2.ReachReply(error="busy: too many checks at once")
            return
        if not 0 < req.port < 65536:
            yield swarm_pb2.ReachReply(error=f"port {req.port} is out of range 1-65535")
            return
        self._last[remote] = now
        self._last.move_to_end(remote)
        while len(self._last) > MAX_TRACKED:
            self._last.popitem(last=False)
        targets = [t for t in map(tcp_target, await self._observed(remote)) if t is not None]
        if not targets:
            yield swarm_pb2.ReachReply(error="no direct TCP connection with you to take the address from")
            return
        host = targets[0][0]
        self._running += 1
        try:
            ok = await dial(host, int(req.port))
        finally:
            self._running -= 1
        self.reachability.checks_served += 1
        yield swarm_pb2.ReachReply(reachable=ok, observed=f"{host}:{req.port}")


# ---- the requester side --------------------------------------------------------------------------------------


async def _ask(runtime: NetworkRuntime, peer: str, port: int) -> swarm_pb2.ReachReply | None:
    try:
        async with open_stream(runtime.p2p, peer, REACH_HANDLER, swarm_pb2.ReachRequest(port=port),
                               swarm_pb2.ReachReply, max_reply_bytes=1024, idle_timeout=ASK_TIMEOUT_S) as replies:
            async for reply in replies:
                return reply
    except Exception as exc:  # a peer without the handler (an older node), gone, refusing, too slow
        log.debug("reachability check by %s: %s", peer[:12], exc)
    return None


async def check(runtime: NetworkRuntime, peers: Sequence[str], port: int) -> Verdict:
    """Ask up to ``CHECKERS`` of ``peers`` (in order) to dial this node back at ``port``."""
    asked = [p for p in dict.fromkeys(peers) if p != runtime.peer_id][:CHECKERS]
    replies = await asyncio.gather(*(_ask(runtime, p, port) for p in asked))
    verdict = Verdict()
    for reply in replies:
        if reply is None or reply.error:
            verdict.no_answer += 1
        elif reply.reachable:
            verdict.reachable += 1
            verdict.observed.append(reply.observed)
        else:
            verdict.unreachable += 1
            verdict.observed.append(reply.observed)
    return verdict


async def keep_checking(runtime: NetworkRuntime, reachability: Reachability, peers: Callable[[], list[str]],
                        port: int, *, on_change: Callable[[], None] | None = None, first_after: float = FIRST_CHECK_S,
                        every: float = RECHECK_S) -> None:
    """Repeat the check through live ``peers`` (a few, at random): ``first_after`` seconds from now, then every
    ``every`` seconds. A node that starts a swarm is checked once peers have joined it; a router that changes
    (a port forward added, a new address) is noticed. ``on_change`` runs when the state changed."""
    await asyncio.sleep(first_after)
    while True:
        candidates = [p for p in peers() if p != runtime.peer_id]
        if candidates:
            random.shuffle(candidates)
            before = reachability.state
            with contextlib.suppress(Exception):
                reachability.take(await check(runtime, candidates, port))
            if reachability.state != before:
                log.warning("reachability: now %s (was %s): %d of %d peers that checked could dial port %d",
                            reachability.state, before, reachability.verdict.reachable,
                            reachability.verdict.answered, port)
                if on_change is not None:
                    with contextlib.suppress(Exception):
                        on_change()
        await asyncio.sleep(every if candidates else min(every, first_after))


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The peer ids of ``/…/p2p/<id>`` multiaddrs (bootstrap addresses), order kept."""
    out = []
    for addr in maddrs:
        parts = [p for p in str(addr).split("/") if p]
        if "p2p" in parts and parts.index("p2p") + 1 < len(parts):
            out.append(parts[parts.index("p2p") + 1])
    return list(dict.fromkeys(out))


__all__ = [
    "MODES",
    "OUTBOUND_ONLY",
    "PUBLIC",
    "REACH_HANDLER",
    "RELAYED",
    "STATES",
    "UNKNOWN",
    "ReachServer",
    "Reachability",
    "Verdict",
    "check",
    "dial",
    "keep_checking",
    "peer_ids_of",
    "tcp_target",
]
