"""The exchange of a round's parts (``locoswarm.node.swarm.averaging``, step 2): reduce-scatter, then all-gather, of
the exact codec chunks over libp2p streams.

Once ``SwarmTransport`` has the round's group (matchmaking, groups, low-rank basis), ``Exchange.run`` opens this
node's ``Reduction`` of the part it reduces (``reducer_parts``, ``locoswarm.node.transport.reduce``), streams its
chunks of every other part to that part's reducer and checks the reduced part each reducer streams back (sizes,
finite, norm next to its own contribution: ``check_reduced_part``; direction, spread and persistence: the
``PartJudge``). Other members' chunks of this node's part arrive on the ``AVERAGE_HANDLER`` streams, served by
``Exchange.serve_part``: the reduction screens every member's part and combines the accepted ones with the swarm's
robust aggregator, and the reduced part streams back to each member. A member applies a result only when it holds
every reduced part; a reducer that misses a member's part past ``PARTIAL_AFTER`` of the round timeout reduces
without it; one that refuses or fails answers an error, never a partial part.

Nothing from the network is trusted: every stream is bound to the authenticated libp2p peer id of the
other end (the header's ``sender`` must be it); a reducer accepts parts only from the members of the
group it formed for that (fragment, round), only after it formed it, and each message is bounded by the
codec's chunk size (``locoswarm.node.swarm.wire``); a refused contribution is dropped from the round (its sender
gets the reason) and the round completes for the others. A payload seen in an earlier round is refused as a replay
(``locoswarm.node.swarm.replay``). Offences go to the node's ``OffenceBook`` (``locoswarm.node.swarm.offences``).
Bytes sent and received are counted in the node's ``ByteCounters`` (``locoswarm.node.swarm.counters``), per peer and
per fragment.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import CODECS, Codec, get_codec
from locoswarm.node.core.payload import chunk_bounds, chunk_elems, decode_chunks
from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.core.robust import make_aggregator
from locoswarm.node.core.transport import (
    GROUP_MISMATCH,
    NOT_IN_ROUND,
    AverageRequest,
    AverageResult,
    EncodedAverage,
    MemberShare,
    PartOrigin,
)
from locoswarm.node.swarm import tamper
from locoswarm.node.swarm.counters import ByteCounters
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.judging import PartJudge, PartRefused, PartResult, part_geometry
from locoswarm.node.swarm.matchmaking import MAX_BASIS_TAG, MAX_EXPECTED, MAX_VIEWS, MatchView
from locoswarm.node.swarm.offences import OffenceBook
from locoswarm.node.swarm.replay import ReplayMemory
from locoswarm.node.swarm.replay import conclusive as replay_conclusive
from locoswarm.node.swarm.versions import RoundClaims
from locoswarm.node.swarm.view import SwarmView
from locoswarm.node.swarm.wire import DialError, PeerRefused, RequestStream, WireError, open_stream
from locoswarm.node.transport.reduce import PartContribution, combine_part, reducer_parts, screen_part
from locoswarm.protocol import swarm_pb2

if TYPE_CHECKING:  # pragma: no cover
    from hivemind.p2p import P2P

log = logging.getLogger("locoswarm.averaging")

AVERAGE_HANDLER = "locoswarm.average.v2"
# A reducer that misses some member's part this far into the round reduces with the parts it has (its own
# among them): a member that entered matchmaking but never sends cannot hold the round hostage.
PARTIAL_AFTER = 0.6
MAX_EXTRAS = 1024            # floats of a header's small side vector (CoCoDC's R: one per fragment)
MAX_REFUSED_ROUNDS = 64      # rounds for which streams refused before the group formed are remembered
# A stream to a reducer not open after this long when its round ends: the dial hangs (a firewall dropping the
# packets), counted as a dial failure. Opening a stream on a connection takes a round trip, a new connection a
# few, well under a second even on a 5 Mbit/s link full of parts.
DIAL_PATIENCE_S = 5.0
MAX_HEADER_BYTES = 64 * 1024
# A reduced part far larger than the member's own share is a reducer's offence. Honest parts can be
# several times larger (a member that just caught up made little progress of its own, its partners a
# whole round's): the bound is for absurd parts only, since an offence leads to a ban; the outer loop's
# guard (16x the whole contribution) still refuses, without blame, results merely too large to trust.
REDUCED_RATIO = 1000.0
CONSENSUS_RATIO = 0.5     # a consensus part may move our outer state by at most this share of it


class Matching(Protocol):
    """What the exchange asks of this node's matchmaking (``matchmaking.Matchmaker``): how long a round's window
    stays open, and how this node formed a round's member list."""

    def window(self) -> float:
        """Seconds a round's matchmaking stays open after its first arrival."""
        ...

    def view_of(self, fragment: int, round_: int) -> MatchView | None:
        """How this node formed the round's member list (None: it kept no view of it)."""
        ...


class RoundRefused(RuntimeError):
    """A peer broke the protocol (an offence); ``kind`` names it for the reputation table."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


def behind_the_others(member: str, versions: Mapping[str, int]) -> bool:
    """Whether ``member``'s claimed version is below every other member's that ``versions`` holds (at least one):
    it holds a phi the rest of its round has left (``STALE_GRACE``)."""
    mine = versions.get(member)
    others = [v for m, v in versions.items() if m != member]
    return mine is not None and bool(others) and all(v > mine for v in others)


def group_hash(members: list[str], idle: Iterable[str] = ()) -> bytes:
    """The group's name in every stream of its exchange: its members, and which of them reduce no part."""
    text = ",".join(sorted(members))
    idle = sorted(idle)
    if idle:
        text += "|idle:" + ",".join(idle)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def check_reduced_part(codec: Codec, req: AverageRequest, chunks: dict[int, bytes],
                       bounds: list[tuple[int, int]], own_norm: float) -> str | None:
    """Why a reducer's part cannot be an honest result (None if it can): not finite, or larger than the
    group's contributions can make it. Our own chunks of the part are the reference: an honest (clipped)
    mean of this part is within a few times the median contribution, of which ours is one; the part's
    share of our whole contribution (``own_norm``) keeps a tiny own part from making honest results look
    absurd. A consensus round (``req.digest``) averages outer states: the part may move our state by at
    most half its size, or half the part's share of the whole state (phi and momentum are one vector,
    so in a pair one member reduces the momenta: ours may be near 0 after a join while the partner's is
    not; judged by our own momentum alone, honest partners were banned and the gossip swarm fell apart)."""
    numel = max(1, req.numel)
    part_numel = sum(bounds[c][1] - bounds[c][0] for c in chunks)
    diff_sq = own_sq = 0.0
    for c, data in chunks.items():
        values = codec.decode(data, bounds[c][1] - bounds[c][0])
        if not bool(torch.isfinite(values).all()):
            return f"reduced chunk {c} has non-finite values"
        own = codec.decode(req.chunks[c], bounds[c][1] - bounds[c][0])
        ref = own if req.digest else torch.zeros_like(own)  # consensus rounds: deviation from our state
        diff_sq += _norm(values - ref) ** 2
        own_sq += _norm(own) ** 2
    share = own_norm * math.sqrt(part_numel / numel)
    if own_sq == 0 and share == 0:
        return None  # no progress of our own to judge by (finite was checked)
    if req.digest:  # as the outer loop's guard on a consensus shift: at most half of the state
        limit = CONSENSUS_RATIO * max(math.sqrt(own_sq), share, 1e-6)
    else:
        limit = REDUCED_RATIO * max(math.sqrt(own_sq), share, 1e-6)
    if math.sqrt(diff_sq) > limit:
        return f"reduced part norm {math.sqrt(diff_sq):.3g} exceeds {limit:.3g}"
    return None


def _finite(values: Iterable[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.to(torch.float64)))


def _nonzero(codec: Codec, data: bytes, numel: int) -> bool:
    """Whether a chunk decodes to anything but zeros (a chunk of no progress is the same every round)."""
    values = codec.decode(data, numel)
    return bool(values.numel()) and bool((values != 0).any())


def _nonzero_chunks(codec: Codec, chunks: Mapping[int, bytes], sizes: Mapping[int, int]) -> list[bytes]:
    return [data for c, data in sorted(chunks.items()) if _nonzero(codec, data, sizes[c])]


@dataclass
class Reduced:
    chunks: dict[int, bytes]
    total_weight: float
    extras: list[float]
    # sender -> (kind, detail, conclusive): why it was dropped (every refusal is an offence; a conclusive one
    # bans at once, see Reputation)
    refused: dict[str, tuple[str, str, bool]]
    # sender -> (agreement, its weight over the reducer's own): the direction judgement of each accepted
    # contribution (``locoswarm.node.core.robust``), for the reputation's agreement evidence
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the reducer was outvoted on some contribution (``PartOrigin.contested``)
    contested: bool = False


class Reduction:
    """This member's part of one group round: members' contributions in, one reduced part out.

    Created only by this node's own round (``Exchange.run``), so peers cannot create
    sessions; it lives until the round's end plus a round timeout. Contributions are exact-size codec
    bytes of this part (checked as they stream in); the reduction screens and combines them with the
    swarm's robust aggregator (``locoswarm.node.transport.reduce``)."""

    def __init__(self, key: tuple[int, int, bytes], own: str, codec: Codec, members: list[str], part: range,
                 sizes: dict[int, int], settings: RobustSection, consensus: bool, basis: bytes = b"",
                 memory: DeviationMemory | None = None, accused: Iterable[str] = (),
                 round_mutes: Iterable[str] = ()) -> None:
        self.key = key
        # members that another member of the round excludes: their disagreement with our own is evidence
        self.accused = frozenset(accused)
        # Members that most of the round mutes for their standing drift: no pull in this part, whatever this
        # reducer's own memory says. Why: idle, a drifter reduced no part, yet in a group with a member whose own
        # measure did not mute it (split data: one honest node of three muted it 8 times, the others about 300)
        # its contribution had full pull there, and it merged 42-65 such pair rounds a minute; 3 + 1 split data
        # ended +11.0% above clean at equal progress (robustness bench, 4af63e7).
        self.round_mutes = frozenset(round_mutes)
        self.memory = memory
        self.basis = basis  # the low-rank basis tag every contribution must carry (b"": a block codec)
        self.own = own
        self.codec = codec
        self.members = list(members)
        self.part = part
        self.sizes = sizes
        self.settings = settings
        self.consensus = consensus
        self.n_extras = 0
        self.contributions: dict[str, tuple[PartContribution, list[float]]] = {}
        self.dropped: dict[str, str] = {}     # members that will not contribute, and why
        self.done: asyncio.Future[Reduced] = asyncio.get_running_loop().create_future()
        self.done.add_done_callback(_retrieve)
        self.replies = 0
        self._replied = asyncio.Condition()
        # The outer version each member's header claimed (ours included): a round that skipped the DHT
        # (standing members) learns its members' versions only here.
        self.versions: dict[str, int] = {}
        self.lineages: dict[str, int] = {}  # each member's phi crc (its header's; ours included)

    def judges_reduced_part(self, reducer: str) -> bool:
        """Whether ``reducer``'s reduced part in this round is evidence of its intent
        (``PartJudge.reduced_direction``): not in a pair, unless another member of the round excludes
        the reducer (the rule for contributions is ``Agreement.evidence_where``)."""
        return len(self.members) > 2 or reducer in self.accused

    async def replied(self) -> None:
        """A reply stream of this part has finished."""
        async with self._replied:
            self.replies += 1
            self._replied.notify_all()

    async def all_replied(self, count: int) -> None:
        async with self._replied:
            await self._replied.wait_for(lambda: self.replies >= count)

    def expected_replies(self) -> int:
        """Reply streams this part serves: members whose contribution entered (or may enter) it."""
        refused = self.done.result().refused if self.done.done() and not self.done.exception() else {}
        return sum(1 for m in self.members if m != self.own and m not in self.dropped and m not in refused)

    def has(self, sender: str) -> bool:
        return sender in self.contributions or sender in self.dropped

    def claim_version(self, member: str, version: int, lineage: int = 0) -> None:
        """``member``'s header (its authenticated stream) claims ``version`` of the fragment, from phi ``lineage``."""
        if member in self.members:
            self.versions[member] = version
            self.lineages[member] = lineage

    def add(self, contribution: PartContribution, extras: list[float]) -> None:
        if self.done.done() or self.has(contribution.sender):
            return
        self.contributions[contribution.sender] = (contribution, extras)
        self._maybe_reduce()

    def drop(self, member: str, reason: str) -> None:
        """``member`` will not contribute (it formed another group, refused, or never came)."""
        if not self.done.done() and member in self.members and not self.has(member):
            self.dropped[member] = reason
            self._maybe_reduce()

    def reduce_partial(self) -> None:
        """The round is well under way: reduce with the parts that are in (this node's among them)."""
        if self.done.done() or self.own not in self.contributions:
            return
        for m in self.members:
            if not self.has(m):
                self.dropped[m] = "its part did not arrive in time"
        self._maybe_reduce()

    def _maybe_reduce(self) -> None:
        if self.done.done() or not all(self.has(m) for m in self.members):
            return
        if self.own not in self.contributions:
            self.fail("this node's own contribution is missing")
            return
        if len(self.contributions) < 2:
            self.fail("no other member's part arrived: " + "; ".join(
                f"{p[:12]}: {why}" for p, why in sorted(self.dropped.items())))
            return
        try:
            reduced = self._reduce()
            reduced.chunks = tamper.installed().reduced(self.key[0], self.key[1], reduced.chunks, self.codec,
                                                        self.sizes, consensus=self.consensus)
            self.done.set_result(reduced)
        except Exception as exc:  # a bug, never a peer's doing: contributions were checked on arrival
            log.warning("reduction failed: %r", exc)
            self.fail(f"reduction failed: {type(exc).__name__}: {exc}")

    def _reduce(self) -> Reduced:
        senders = sorted(self.contributions)
        cons = [self.contributions[s][0] for s in senders]
        trusted = senders.index(self.own)
        centers = None
        if self.consensus:  # rounds of phi itself: judge deviations from this node's phi
            own = cons[trusted].chunks
            centers = {c: self.codec.decode(own[c], self.sizes[c]) for c in self.part}
        screening = screen_part(self.codec, cons, self.sizes, self.settings, trusted=trusted, centers=centers,
                                memory=self.memory, fragment=self.key[0],
                                round_mutes=self.round_mutes)
        reduced = combine_part(self.codec, cons, screening, self.sizes, make_aggregator(self.settings),
                               centers=centers)
        total = screening.total_weight
        # The side vector (CoCoDC's R) is summed over the accepted members, as CoCoDC all-reduces it.
        extras = [0.0] * self.n_extras
        for i, pull in zip(screening.accepted, screening.pulls, strict=True):
            if pull <= 0:
                continue  # no pull in the average: none in the side vector either
            for k, x in enumerate(self.contributions[senders[i]][1]):
                extras[k] += x
        refused = {r.sender: (r.kind, r.detail, r.conclusive) for r in screening.refusals}
        for i, why in zip(screening.accepted, screening.muted, strict=True):
            if why:
                log.info("fragment %d round %d: %s has no pull: %s", self.key[0], self.key[1], senders[i][:12], why)
        own_weight = cons[trusted].weight
        # Evidence for the agreement ban: none where this reducer is outvoted (``Agreement.evidence``).
        evidence = [None if a is None else a.evidence_where(accused=senders[i] in self.accused)
                    for i, a in zip(screening.accepted, screening.scores, strict=True)]
        scores = {senders[i]: (score, cons[i].weight / own_weight if own_weight > 0 else 1.0)
                  for i, score in zip(screening.accepted, evidence, strict=True) if score is not None}
        contested = any(a is not None and a.others >= 2 and a.outvoted for a in screening.scores)
        return Reduced(reduced, total, extras, refused, scores, contested)

    def fail(self, error: str) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(error))


def _retrieve(future: asyncio.Future) -> None:
    """Mark a failure as seen (nobody may be waiting on a session that failed)."""
    if not future.cancelled():
        future.exception()


def kin_share(lineages: Mapping[str, int], own: int) -> float:
    """The share of a round's members (``lineages``: each one's phi crc, this node's included) that sent from this
    node's phi ``own`` (``AverageResult.kin``); 1.0 where none is known."""
    return sum(v == own for v in lineages.values()) / len(lineages) if lineages else 1.0


class Exchange:
    """This node's side of its rounds' exchanges (module docstring): the live ``Reduction`` of each round it takes
    part in, the payloads it has seen (a replay is refused), and the streams that serve other members' parts.

    Args:
        p2p: the node's libp2p replica (``NetworkRuntime.p2p``): streams to the reducers are opened on it.
        peer_id: this node's.
        fingerprint: the swarm's; a header carrying another one is refused.
        codec: the swarm's payload codec (a round may name another: ``codec_for``).
        round_timeout: ``[network] round_timeout``: the exchange's bound, and how long a session outlives it.
        stream_timeout: the longest a stream may be idle (``longest_round_s``).
        robust: the ``[robust]`` settings (screening and the aggregator).
        view: the swarm as this node sees it (``SwarmView``: the weight a sender's throughput allows, the swarm's
            version belief).
        matching: the rounds' windows, and the member lists that explain a group mismatch (the node's
            ``Matchmaker``).
        judge: judges each contribution this node reduces and each reduced part it receives.
        book: where every refusal of a peer is counted.
        deviations: what this node's reductions saw of each sender's deviations.
        round_claims: what members' round headers name of their versions.
        dial_failures: peers whose streams this node could not open lately.
        counters: the node's byte counters.
        plausible: the group's corroborated version of members' claims (``SwarmTransport._plausible``: a claim far
            above the swarm clock's bound is an offence of its member).
    """

    def __init__(self, p2p: P2P, peer_id: str, *, fingerprint: str, codec: Codec, round_timeout: float,
                 stream_timeout: float, robust: RobustSection, view: SwarmView, matching: Matching,
                 judge: PartJudge, book: OffenceBook, deviations: DeviationMemory, round_claims: RoundClaims,
                 dial_failures: DialFailures, counters: ByteCounters,
                 plausible: Callable[[dict[str, int]], int]) -> None:
        self.p2p = p2p
        self.peer_id = peer_id
        self.fingerprint = fingerprint
        self.codec = codec
        self.round_timeout = round_timeout
        self.robust = robust
        self.view = view
        self.matching = matching
        self.judge = judge
        self.book = book
        self.deviations = deviations
        self.round_claims = round_claims
        self.dial_failures = dial_failures
        self.counters = counters
        self._plausible = plausible
        self._sessions: dict[tuple[int, int, bytes], Reduction] = {}
        self._exchanges = 0  # this node's rounds whose exchange is in flight (``exchanging``)
        self._view_changed: asyncio.Event | None = None
        self._skipped: dict[tuple[int, int], float] = {}
        # (fragment, round) -> peers whose stream for it was refused before this node formed its group
        self._refused_early: OrderedDict[tuple[int, int], set[str]] = OrderedDict()
        self.replays = ReplayMemory()  # chunks this node has seen, by round (``locoswarm.node.swarm.replay``)
        self._explained: set[tuple[int, int]] = set()  # rounds whose refused members were explained in the log
        # Messages are bounded by the largest chunk any round may carry (consensus rounds: fp32).
        elems = chunk_elems(codec.block_size)
        self._max_chunk_msg = max(codec.encoded_size(elems), 4 * elems) + 1024
        self._stream_timeout = stream_timeout

    def max_message_bytes(self) -> int:
        """The largest message of an averaging stream, either way: a chunk of the widest codec, or a header."""
        return max(self._max_chunk_msg, MAX_HEADER_BYTES)

    def exchanging(self) -> bool:
        """Whether a round of this node is exchanging its parts now (state downloads it serves wait for it)."""
        return self._exchanges > 0

    async def run(self, req: AverageRequest, group: list[str], claims: dict[str, int],
                  accused: Iterable[str] = (), idle: frozenset[str] = frozenset(),
                  unreachable: frozenset[str] = frozenset(), muted: frozenset[str] = frozenset()) -> AverageResult:
        """The group's average of ``req``; its ``max_version`` is the plausible version of the members'
        ``claims`` (from their match entries) as their headers in this exchange updated them. ``accused``: group
        members that another member of the round excludes (``Reduction.accused``); ``idle``: members that reduce
        no part (``averaging.idle_reducers``); ``unreachable``: idle members nobody can dial
        (``averaging.unreachable_idle``), to which nobody opens a stream; ``muted``: members most of the round
        mutes for their standing drift (``averaging.idle_reducers``), which have no pull in this node's part
        either (``Reduction.round_mutes``)."""
        self._exchanges += 1
        try:
            return await self._exchange_parts(req, group, claims, accused, idle, unreachable, muted)
        finally:
            self._exchanges -= 1

    async def _exchange_parts(self, req: AverageRequest, group: list[str], claims: dict[str, int],
                              accused: Iterable[str] = (), idle: frozenset[str] = frozenset(),
                              unreachable: frozenset[str] = frozenset(),
                              muted: frozenset[str] = frozenset()) -> AverageResult:
        ghash = group_hash(group, idle)
        n = len(group)
        me = group.index(self.peer_id)
        codec = self.codec_for(req.codec)
        bounds = chunk_bounds(req.numel, codec.block_size)
        parts = reducer_parts(len(bounds), group, idle, req.round)
        sizes = {c: bounds[c][1] - bounds[c][0] for c in parts[me]}
        key = (req.fragment, req.round, ghash)
        session = Reduction(key, self.peer_id, codec, group, parts[me], sizes, self.robust,
                             consensus=bool(req.digest), basis=req.basis, memory=self.deviations, accused=accused,
                             round_mutes=muted)
        extras = [float(x) for x in req.extras.tolist()]
        session.n_extras = len(extras)
        self._sessions[key] = session
        self._view_ready()
        loop = asyncio.get_running_loop()
        partial = loop.call_later(PARTIAL_AFTER * self.round_timeout, session.reduce_partial)
        # An idle member's part is empty, like a part of a payload with fewer chunks than members: its session
        # still answers every member's stream (headers carry the members' versions), with no chunks.
        session.add(PartContribution(self.peer_id, req.weight, {c: req.chunks[c] for c in parts[me]}), extras)
        session.claim_version(self.peer_id, req.version, req.lineage)
        self._remember_payload(req, enumerate(req.chunks), averaged=False)
        for peer in self._refused_early.pop((req.fragment, req.round), ()):
            session.drop(peer, "its stream was refused")

        async def own_part() -> PartResult:
            if self.peer_id in unreachable:  # an empty part nobody streams to: nothing to wait for
                return PartResult(self.peer_id, {}, req.weight, extras, None)
            reduced = await session.done
            if reduced.total_weight <= 0:
                raise RuntimeError("every contribution to this node's part was refused")
            # our part is the reference of the others' spread only where it mixes others' contributions in
            mixed = not req.digest and reduced.total_weight > req.weight * (1 + 1e-6)
            geometry = part_geometry(codec, req, reduced.chunks, bounds) if mixed else None
            disputed = frozenset(p for p, (score, _) in reduced.scores.items()
                                 if p != self.peer_id and score <= self.robust.agreement_floor)
            return PartResult(self.peer_id, reduced.chunks, reduced.total_weight, reduced.extras, geometry,
                               len(session.dropped), disputed=disputed)

        own_norm = _norm(decode_chunks(codec, req.chunks, req.numel)) if req.numel else 0.0
        tasks = [own_part()] + [self._send_part(group[j], req, ghash, parts[j], bounds, extras, own_norm)
                                for j in range(n) if j != me and group[j] not in unreachable]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), self.round_timeout)
            self.judge.parts(req, results, self._local_view(req.fragment, req.round))
        except Exception as exc:
            session.fail(str(exc) or type(exc).__name__)
            sent, received = self.counters.by_round.pop((req.fragment, req.round), (0, 0))
            res = AverageResult.failed(f"{type(exc).__name__}: {exc}", own_weight=req.weight,
                                       refused=isinstance(exc, PartRefused))
            res.bytes_sent, res.bytes_received = sent, received
            return res
        finally:
            partial.cancel()
            loop.call_later(self.round_timeout, self._end_session, key)
        reduced: dict[int, bytes] = {}
        total_weight, avg_extras = 0.0, extras
        for r in results:
            reduced.update(r.chunks)
            total_weight, avg_extras = r.total_weight, r.extras
        if len(reduced) != len(bounds):
            return AverageResult.failed("incomplete group result", own_weight=req.weight)
        self._remember_payload(req, reduced.items(), averaged=True)
        average = decode_chunks(codec, [reduced[c] for c in range(len(bounds))], req.numel)
        kin = kin_share(session.lineages, req.lineage)
        one_lineage = kin == 1.0
        shares = self.member_shares(session, req, codec, bounds)
        contested = bool(shares) and session.done.result().contested
        origins = [PartOrigin(group[j], bounds[parts[j].start][0], bounds[parts[j].stop - 1][1], one_lineage,
                              shares if j == me else (), contested and j == me)
                   for j in range(n) if len(parts[j])]
        # Our reduced part may still be streaming to the others: wait (briefly) so the round's byte
        # count is complete; the result itself is already final.
        if self.peer_id not in unreachable:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(session.all_replied(session.expected_replies()), timeout=5.0)
        sent, received = self.counters.by_round.pop((req.fragment, req.round), (0, 0))
        return AverageResult(
            ok=True, average=average, extras=torch.tensor(avg_extras, dtype=torch.float32), group_size=n,
            encoded=EncodedAverage(codec.name, req.numel, tuple(reduced[c] for c in range(len(bounds)))),
            total_weight=total_weight, own_weight=req.weight, bytes_sent=sent, bytes_received=received,
            basis=req.basis, max_version=self._plausible({**claims, **session.versions}),
            parts=origins, missing=sum(r.missing for r in results), kin=kin)

    def member_shares(self, session: Reduction, req: AverageRequest, codec: Codec,
                      bounds: list[tuple[int, int]]) -> tuple[MemberShare, ...]:
        """Each other member's contribution to this node's own part, decoded (``PartOrigin.shares``), for the
        outer loop's judgement of each alone: those the screening took (muted ones included: it is what they
        sent). None in a pair (with the alpha merge an honest partner's contribution may point against ours,
        ``PartJudge.reduced_direction``) unless another member of the round excludes the partner (the rule for
        direction evidence, ``Agreement.evidence_where``), for rounds of phi itself (``req.digest``) and for
        low-rank coefficients (``req.basis``)."""
        if req.digest or req.basis or not len(session.part):
            return ()
        if len(session.members) < 3 and not any(m in session.accused for m in session.members if m != self.peer_id):
            return ()
        if not session.done.done() or session.done.cancelled() or session.done.exception() is not None:
            return ()
        refused = session.done.result().refused
        shares = []
        for member, (contribution, _) in sorted(session.contributions.items()):
            if member == self.peer_id or member in refused:
                continue
            values = torch.cat([codec.decode(contribution.chunks[c], bounds[c][1] - bounds[c][0])
                                for c in session.part])
            shares.append(MemberShare(member, values, session.lineages.get(member) == req.lineage))
        return tuple(shares)

    def _end_session(self, key: tuple[int, int, bytes]) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            session.fail("expired")

    async def _send_part(self, peer: str, req: AverageRequest, ghash: bytes, part: range,
                         bounds: list[tuple[int, int]], extras: list[float], own_norm: float):
        """Stream our chunks of ``part`` to its reducer ``peer``; return its reduced part, checked."""
        seam = tamper.installed()
        codec = self.codec_for(req.codec)
        req = seam.contribution(peer, req, part, bounds, codec)
        header = swarm_pb2.AverageRequest(header=swarm_pb2.AverageHeader(
            fingerprint=self.fingerprint, fragment=req.fragment, round=req.round, group_hash=ghash,
            sender=seam.sender(peer, self.peer_id), weight=req.weight, version=req.version, extras=extras,
            n_chunks=len(part), codec=req.codec, basis=req.basis, lineage=req.lineage))

        async def requests() -> AsyncIterator[swarm_pb2.AverageRequest]:
            self.counters.sent(peer, req.fragment, req.round, header.ByteSize())
            yield header
            for c in part:
                msg = swarm_pb2.AverageRequest(chunk=swarm_pb2.Chunk(index=c, data=req.chunks[c]))
                self.counters.sent(peer, req.fragment, req.round, msg.ByteSize())
                yield msg

        chunks: dict[int, bytes] = {}
        stream = open_stream(self.p2p, peer, AVERAGE_HANDLER, requests(), swarm_pb2.AverageReply,
                             max_reply_bytes=max(self._max_chunk_msg, MAX_HEADER_BYTES),
                             idle_timeout=self._stream_timeout)
        opening = time.monotonic()
        try:
            async with stream:
                first = await anext(stream, None)
                self.dial_failures.reached(peer)  # the stream opened (whatever its answer)
                if first is None:
                    raise RuntimeError(f"peer {peer[:12]} closed the stream without an answer")
                self.counters.received(peer, req.fragment, req.round, first.ByteSize())
                if not first.HasField("header") or not first.header.ok:
                    raise RuntimeError(f"peer {peer[:12]} refused: {first.header.error[:200] or 'bad reply'}")
                h = first.header
                if not (math.isfinite(h.total_weight) and h.total_weight > 0) or len(h.extras) != len(extras) \
                        or not _finite(h.extras) or h.n_chunks != len(part):
                    raise RoundRefused("bad_reduction", "malformed reduce header")
                view = self._local_view(req.fragment, req.round)
                if view is not None and peer not in view.versions:  # nobody streamed to us (outbound only)
                    view.claim_version(peer, int(h.version), int(h.lineage))
                self.round_claims.record(req.fragment, peer, int(h.version))
                async for msg in stream:
                    self.counters.received(peer, req.fragment, req.round, msg.ByteSize())
                    c = msg.chunk.index
                    if not msg.HasField("chunk") or c not in part or c in chunks:
                        raise RoundRefused("bad_reduction", f"unexpected reduced chunk {c}")
                    if len(msg.chunk.data) != codec.encoded_size(bounds[c][1] - bounds[c][0]):
                        raise RoundRefused("bad_reduction", f"reduced chunk {c} has a wrong size")
                    chunks[c] = msg.chunk.data
        except PeerRefused as exc:
            raise RuntimeError(f"peer {peer[:12]} refused: {exc}") from None
        except DialError as exc:  # no connection to it: the next rounds keep this pair apart (``dial_failures``)
            self._dial_failed(peer, str(exc))
            self.book.refuse(peer, "wire", str(exc), offence=False)
            raise RuntimeError(f"peer {peer[:12]}: {exc}") from None
        except asyncio.CancelledError:  # the round ended first: a dial that hangs (packets dropped) is no answer
            if not stream.opened and time.monotonic() - opening >= DIAL_PATIENCE_S:
                self._dial_failed(peer, f"no stream opened in {time.monotonic() - opening:.0f} s")
            raise
        except WireError as exc:
            self.book.refuse(peer, "wire", str(exc), offence=False)
            raise RuntimeError(f"peer {peer[:12]}: {exc}") from None
        except RoundRefused as exc:
            self.book.refuse(peer, exc.kind, str(exc))
            raise PartRefused(f"peer {peer[:12]}: {exc}") from None
        if set(chunks) != set(part):
            raise RuntimeError(f"peer {peer[:12]} sent {len(chunks)} of {len(part)} reduced chunks")
        reason = check_reduced_part(codec, req, chunks, bounds, own_norm)
        if reason:
            # a consensus part far from our phi may be an honest member's of another lineage: refused, no blame
            self.book.refuse(peer, "bad_reduction", reason, offence=not req.digest)
            raise PartRefused(f"peer {peer[:12]} sent a bad reduced part: {reason}")
        geometry = None if req.digest else part_geometry(codec, req, chunks, bounds)
        refused = ""
        if geometry is not None:
            view = self._local_view(req.fragment, req.round)
            try:
                self.judge.reduced_direction(peer, geometry.agreement, same_lineage=int(h.lineage) == req.lineage,
                                             evidence=view is None or view.judges_reduced_part(peer),
                                             stale=self.stale_here(req, int(h.version), view))
            except PartRefused as exc:  # raised once the others' parts arrived and every spread was judged
                refused = str(exc)
        if not refused:
            self._remember_payload(req, chunks.items(), averaged=True)
        seam.returned(peer, req, chunks)
        return PartResult(peer, chunks, h.total_weight, list(h.extras), geometry, min(h.missing, MAX_EXPECTED),
                           same_lineage=int(h.lineage) == req.lineage, refused=refused)

    def stale_here(self, req: AverageRequest, reducer_version: int, view: Reduction | None) -> bool:
        """Whether this node is the stale member of ``req``'s round (``STALE_GRACE``): the reducer's version and every
        other member's this node knows are above its own, and so is the swarm's version that the heartbeats of two
        holders corroborate. A lone reducer's claim is not enough: an outbound-only node learns its round's versions
        only from the reducers' replies, and a hostile reducer claiming a version ahead would otherwise have its
        turned parts go unjudged there."""
        return (view is not None and reducer_version > req.version and behind_the_others(self.peer_id, view.versions)
                and self.view.latest_versions(req.fragment).version > req.version)

    def _dial_failed(self, peer: str, why: str) -> None:
        if self.dial_failures.failed(peer):
            log.info("cannot dial %s (%s): rounds keep this node out of its groups for %.0f s", peer[:12], why,
                     self.dial_failures.ttl_s)

    def codec_for(self, name: str) -> Codec:
        """The codec a round's request names (``AverageRequest.codec``; empty: the swarm's)."""
        return get_codec(name, self.codec.block_size) if name and name != self.codec.name else self.codec

    # ---- group disagreement: fail fast, never wait for a contribution that cannot come ----------
    def not_in_round(self, fragment: int, round_: int) -> None:
        """Remember that this node takes no part in a round, so contributions to it fail at once."""
        self._skipped[(fragment, round_)] = time.monotonic()
        for key in [k for k, t in self._skipped.items() if t < time.monotonic() - 300]:
            del self._skipped[key]
        self._view_ready()

    def _local_view(self, fragment: int, round_: int) -> Reduction | None:
        for (f, r, _), sess in self._sessions.items():
            if f == fragment and r == round_:
                return sess
        return None

    def _view_ready(self) -> None:
        """Wake the streams waiting for this node to form (or skip) a round."""
        if self._view_changed is not None:
            self._view_changed.set()
        self._view_changed = asyncio.Event()

    async def _await_view(self, fragment: int, round_: int, timeout: float) -> Reduction | None:
        """This node's session for the round, once it formed its group (None: not in it, or too late).
        Waiting costs one open stream, which the stream caps bound."""
        deadline = time.monotonic() + timeout
        while True:
            if (fragment, round_) in self._skipped:
                return None
            view = self._local_view(fragment, round_)
            if view is not None:
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._view_changed is None:
                self._view_changed = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._view_changed.wait(), left)

    # ---- serving our part -----------------------------------------------------------------------
    async def serve_part(self, remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.AverageReply]:
        """One member's part, streamed in from ``remote`` (the authenticated peer id of the stream).

        Every refusal is a ``WireError``: the stream server sends its one line to the peer."""
        first = await anext(requests, None)
        if first is None or not first.HasField("header"):
            raise WireError("expected a header first")
        self.counters.received_unmatched(remote, first.ByteSize())
        h = first.header  # (a banned peer's stream never gets here: see ``SwarmTransport._refuse_banned``)
        if h.fingerprint != self.fingerprint:
            text = f"swarm fingerprint mismatch: peer has {h.fingerprint[:40]}, this node {self.fingerprint}"
            self.book.refuse(remote, "fingerprint", text, offence=False)
            raise WireError(text)
        if h.sender != remote:
            self.book.refuse(remote, "forged_sender", f"header names sender {h.sender[:20]!r}", conclusive=True)
            self._drop_from_round(remote, h.fragment, h.round)
            raise WireError("refused: the header's sender is not the stream's authenticated peer id")
        if not (math.isfinite(h.weight) and h.weight > 0) or len(h.extras) > MAX_EXTRAS or not _finite(h.extras) \
                or (h.codec and h.codec not in CODECS) or len(h.basis) > MAX_BASIS_TAG:
            self.book.refuse(remote, "bad_header", "weight, extras, codec or basis tag out of bounds")
            self._drop_from_round(remote, h.fragment, h.round)
            raise WireError("refused: header fields out of bounds")
        session = await self._await_view(h.fragment, h.round, 2 * self.matching.window() + 2.0)
        if session is None:
            self.book.refuse(remote, "not_in_round", f"fragment {h.fragment} round {h.round}", offence=False)
            raise WireError(f"{NOT_IN_ROUND} (it arrived after the window or had no group)")
        session = self.check_membership(session, remote, h)
        self.counters.received(remote, h.fragment, h.round, first.ByteSize())
        chunks = await self._read_part(session, remote, h, requests)
        self._refuse_replay(session, remote, chunks)
        own = self._sessions_own_weight(session)
        max_weight = self.view.max_weight(remote, own) if own > 0 else math.inf
        session.add(PartContribution(remote, float(h.weight), chunks, max_weight=max_weight), list(h.extras))
        session.claim_version(remote, int(h.version), int(h.lineage))
        self.round_claims.record(int(h.fragment), remote, int(h.version))
        try:
            result = await asyncio.wait_for(asyncio.shield(session.done), self.round_timeout)
        except Exception as exc:
            raise WireError(f"round failed at reducer: {exc or type(exc).__name__}") from None
        if remote in result.refused:
            kind, detail, conclusive = result.refused[remote]
            self.book.refuse(remote, kind, detail, conclusive=conclusive)
            raise WireError(f"contribution refused: {detail}")
        if remote in result.scores:
            self.judge.contribution(remote, *result.scores[remote],
                                  same_lineage=session.lineages.get(remote) == session.lineages.get(self.peer_id),
                                  stale=behind_the_others(remote, session.versions))
        header = swarm_pb2.AverageReply(header=swarm_pb2.ReduceHeader(
            ok=True, total_weight=result.total_weight, extras=result.extras, n_chunks=len(result.chunks),
            lineage=session.lineages.get(self.peer_id, 0), version=session.versions.get(self.peer_id, 0),
            missing=len(session.dropped)))
        self.counters.sent(remote, h.fragment, h.round, header.ByteSize())
        yield header
        for c in sorted(result.chunks):
            msg = swarm_pb2.AverageReply(chunk=swarm_pb2.Chunk(index=c, data=result.chunks[c]))
            self.counters.sent(remote, h.fragment, h.round, msg.ByteSize())
            yield msg
        await session.replied()

    def _refuse_replay(self, session: Reduction, remote: str, chunks: dict[int, bytes]) -> None:
        """Refuse (an offence) a contribution whose payload was seen in an earlier round; else remember it
        (``locoswarm.node.swarm.replay``). Consensus rounds carry phi, which members may hold alike."""
        if session.consensus:
            return
        fragment, round_ = session.key[0], session.key[1]
        payload = _nonzero_chunks(session.codec, chunks, session.sizes)
        seen = self.replays.replayed(fragment, round_, payload)
        if payload and 2 * len(seen) >= len(payload):
            detail = (f"{len(seen)} of its {len(payload)} chunks for fragment {fragment} round {round_} were seen "
                      f"in round {seen[0].round} of fragment {seen[0].fragment}"
                      f"{' (averages: conclusive)' if replay_conclusive(seen) else ''}")
            self.book.refuse(remote, "replay", detail, conclusive=replay_conclusive(seen))
            session.drop(remote, "it replayed an earlier round's payload")
            raise WireError(f"refused: replayed payload ({detail})")
        self.replays.remember(fragment, round_, payload)

    def _remember_payload(self, req: AverageRequest, chunks: Iterable[tuple[int, bytes]], *, averaged: bool) -> None:
        """Chunks this node sent or received in ``req``'s round (``averaged``: reduced parts): a later replay of
        them is refused."""
        if not req.digest:
            codec = self.codec_for(req.codec)
            bounds = chunk_bounds(req.numel, codec.block_size)
            self.replays.remember(req.fragment, req.round, [
                data for c, data in chunks if _nonzero(codec, data, bounds[c][1] - bounds[c][0])], averaged=averaged)


    def _drop_from_round(self, remote: str, fragment: int, round_: int) -> None:
        """``remote``'s stream for a round was refused, so its part will not come: a reducer that has it
        in its group stops waiting for it now (or when it forms the group) instead of until the partial
        reduction, which would stall the honest members' round on every offence."""
        view = self._local_view(fragment, round_)
        if view is not None:
            view.drop(remote, "its stream was refused")  # a no-op for a non-member
            return
        refused = self._refused_early.setdefault((fragment, round_), set())
        if len(refused) < MAX_REFUSED_ROUNDS:
            refused.add(remote)
        self._refused_early.move_to_end((fragment, round_))
        while len(self._refused_early) > MAX_REFUSED_ROUNDS:  # made-up rounds cannot grow it
            self._refused_early.popitem(last=False)

    @staticmethod
    def _sessions_own_weight(session: Reduction) -> float:
        own = session.contributions.get(session.own)
        return own[0].weight if own is not None else 0.0

    def _explain_refused_member(self, session: Reduction, remote: str) -> None:
        """Log, once per round, why a peer is not in the group this node formed (its side of a mismatch: the
        refused member logs the other side, ``Matchmaker.explain``)."""
        fragment, round_ = session.key[0], session.key[1]
        if (fragment, round_) in self._explained:
            return
        self._explained.add((fragment, round_))
        while len(self._explained) > MAX_VIEWS:
            self._explained.pop()
        view = self.matching.view_of(fragment, round_)
        how = "no view kept" if view is None else f"its member list {sorted(p[-6:] for p in view.members)} ({view.cut})"
        log.info("group mismatch: fragment %d round %d: refused %s: this node's group %s, from %s", fragment, round_,
                 remote[-6:], sorted(p[-6:] for p in session.members), how)

    def check_membership(self, session: Reduction, remote: str, h: swarm_pb2.AverageHeader) -> Reduction:
        """``session``, if ``remote``'s stream with header ``h`` may contribute to it: the sender must be a member of
        the group this node formed for the round, once, with a header that matches the round; else the refusal is
        counted and ``WireError`` raised."""
        if session.key[2] != bytes(h.group_hash):
            if remote in session.members:  # it formed another group: its part will not come
                session.drop(remote, "it formed another group")
                raise WireError(f"{GROUP_MISMATCH}: this reducer formed another group for the round")
            self.book.refuse(remote, "non_member", "a group this node did not form", offence=False)
            self._explain_refused_member(session, remote)
            raise WireError(f"{GROUP_MISMATCH}: you are not in this reducer's group for the round")
        if remote not in session.members:  # it knows our group's hash but is not in it
            self.book.refuse(remote, "non_member", f"not in the group of fragment {h.fragment} round {h.round}")
            raise WireError("refused: you are not a member of this group")
        if remote in session.dropped:  # reduced without it (too late), or it failed already
            raise WireError(f"refused: the reducer no longer takes your part ({session.dropped[remote]})")
        if session.has(remote):
            self.book.refuse(remote, "duplicate", "a second contribution to one part")
            raise WireError("refused: duplicate contribution")
        expected_codec = session.codec.name
        # A low-rank payload on another basis (or at other ranks) is coefficients of other vectors: every
        # member derives the group's basis from the same entries, so a mismatch is not an honest one.
        if (h.codec or self.codec.name) != expected_codec or h.n_chunks != len(session.part) \
                or len(h.extras) != session.n_extras or bytes(h.basis) != session.basis:
            self.book.refuse(remote, "bad_header", "codec, chunk count, extras or basis do not match the round")
            session.drop(remote, "its header did not match the round")
            raise WireError("refused: header does not match the round (codec, chunk count, extras or basis)")
        return session

    async def _read_part(self, session: Reduction, remote: str, h: swarm_pb2.AverageHeader,
                         requests: RequestStream) -> dict[int, bytes]:
        """The member's chunks of our part, each checked as it arrives (index, exact size): never more
        than the part's exact codec size is held."""
        chunks: dict[int, bytes] = {}
        try:
            async for msg in requests:
                self.counters.received(remote, h.fragment, h.round, msg.ByteSize())
                c = msg.chunk.index
                if not msg.HasField("chunk") or c not in session.part or c in chunks:
                    raise RoundRefused("bad_part", f"unexpected chunk {c}")
                if len(msg.chunk.data) != session.codec.encoded_size(session.sizes[c]):
                    raise RoundRefused("bad_part", f"chunk {c} has {len(msg.chunk.data)} bytes, expected "
                                                   f"{session.codec.encoded_size(session.sizes[c])}")
                chunks[c] = msg.chunk.data
        except RoundRefused as exc:
            self.book.refuse(remote, exc.kind, str(exc))
            session.drop(remote, str(exc))
            raise WireError(f"refused: {exc}") from None
        except WireError as exc:
            session.drop(remote, f"its stream failed: {exc}")
            raise
        if len(chunks) != len(session.part):
            session.drop(remote, f"sent {len(chunks)} of {len(session.part)} chunks")
            raise WireError(f"expected {len(session.part)} chunks, got {len(chunks)}")
        return chunks
