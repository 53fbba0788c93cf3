"""Fragment averaging over libp2p streams: the swarm's implementation of ``Transport``.

A round of fragment ``p`` started at swarm step ``r``:

1. **Matchmaking** through the DHT (``locoswarm.node.swarm.matchmaking``): the members agree on the round's member
   list. Members are sorted, shuffled by a seed derived from (p, r) and cut into balanced groups of at most
   ``network.group_size`` (``locoswarm.node.transport.groups``): random groups that change from round to round
   (2 = pairwise gossip; as large as the swarm = all-reduce). A member lists the peers it bans in its entry;
   grouping never puts two peers in one group when one of them excludes the other, so every member computes the
   same groups and a banned peer ends up alone. A node with no live peer at all is a swarm of one: its round
   "averages" its own contribution (``locoswarm.node.swarm.lone``).
2. **Exchange**: reduce-scatter then all-gather of the exact codec chunks (``locoswarm.node.transport.reduce``):
   member ``i`` streams its chunks of part ``j`` to member ``j`` (a member that most of the round doubts for its
   standing drift reduces no part: ``idle_reducers``; nor does one peers cannot dial, to which nobody opens a
   stream: ``unreachable_idle``, ``locoswarm.node.swarm.reachability``), which screens every member's part
   (finite, weight within bounds, norm against the group's) and combines the accepted ones with the
   swarm's robust aggregator, re-encodes the result and streams it back to each member.
3. **Atomicity**: a member applies a result only when it holds every reduced part, each checked
   (sizes, finite, norm next to its own contribution). A reducer that misses a member's part past
   ``PARTIAL_AFTER`` of the round timeout reduces without it; a reducer that refuses or fails answers an
   error, never a partial part, so nobody applies a partial average; the caller keeps its local progress.

Nothing from the network is trusted: every stream is bound to the authenticated libp2p peer id of the
other end (the header's ``sender`` must be it); a reducer accepts parts only from the members of the
group it formed for that (fragment, round), only after it formed it, and each message is bounded by the
codec's chunk size (``locoswarm.node.swarm.wire``); a refused contribution is dropped from the round (its sender
gets the reason) and the round completes for the others. Offences go to ``locoswarm.node.swarm.reputation``.
Bytes sent and received are counted here, per peer and per fragment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from locoswarm.node.config import RobustSection, longest_round_s
from locoswarm.node.core.codecs import CODECS, Codec
from locoswarm.node.core.payload import chunk_bounds, chunk_elems, decode_chunks
from locoswarm.node.core.persistence import ALARM_CEILING, ALARM_S, DeviationMemory
from locoswarm.node.core.robust import make_aggregator
from locoswarm.node.core.transport import (
    BASIS_MISMATCH,
    EXCLUDED_BY_ALL,
    GROUP_MISMATCH,
    LATE_FOR_ROUND,
    NO_PEER_IN_GROUP,
    NOT_AT_CONSENSUS_VERSION,
    NOT_IN_ROUND,
    AverageHandle,
    AverageRequest,
    AverageResult,
    EncodedAverage,
    FetchHandle,
    FragmentSnapshot,
    MemberShare,
    PartOrigin,
    Transport,
)
from locoswarm.node.swarm import tamper
from locoswarm.node.swarm.catchup import CatchUp
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.judging import (
    SPREAD_BAN,
    PartJudge,
    PartRefused,
    PartResult,
    SourcePauses,
    part_geometry,
)
from locoswarm.node.swarm.lone import LonePolicy
from locoswarm.node.swarm.matchmaking import (
    MAX_BASIS_TAG,
    MAX_EXPECTED,
    MAX_VIEWS,
    SHUNNED_CUT,
    Matchmaker,
    ScheduleHint,
    own_subkey,
)
from locoswarm.node.swarm.offences import (
    FOLLOWED_SHARE,
    FOLLOWED_VOTERS,
    OffenceBook,
)
from locoswarm.node.swarm.replay import ReplayMemory
from locoswarm.node.swarm.replay import conclusive as replay_conclusive
from locoswarm.node.swarm.reputation import EveryNth, Reputation
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.swarm.standing import StandingMembers
from locoswarm.node.swarm.versions import RoundClaims, absurd_version, plausible_version
from locoswarm.node.swarm.view import StateSource, SwarmView
from locoswarm.node.swarm.wire import DialError, PeerRefused, RequestStream, WireError, open_stream, serve
from locoswarm.node.transport.groups import (
    consensus_members,
    form_groups,
    group_basis,
    kept_apart,
    majority_shunned,
    route_around,
)
from locoswarm.node.transport.reduce import PartContribution, combine_part, reducer_parts, screen_part
from locoswarm.protocol import swarm_pb2

if TYPE_CHECKING:  # pragma: no cover
    from locoswarm.node.swarm.admission import Admission
    from locoswarm.node.swarm.reachability import Reachability

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
FLOOD_REFUSALS = 32          # streams a peer opens over its own cap that make one offence (a flood)
MAX_TRACKED_FLOODERS = 4096  # peers whose over-cap streams are counted at once
# A reduced part far larger than the member's own share is a reducer's offence. Honest parts can be
# several times larger (a member that just caught up made little progress of its own, its partners a
# whole round's): the bound is for absurd parts only, since an offence leads to a ban; the outer loop's
# guard (16x the whole contribution) still refuses, without blame, results merely too large to trust.
REDUCED_RATIO = 1000.0
CONSENSUS_RATIO = 0.5     # a consensus part may move our outer state by at most this share of it









class RoundRefused(RuntimeError):
    """A peer broke the protocol (an offence); ``kind`` names it for the reputation table."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


@dataclass
class ByteCounters:
    """Bytes on the wire (serialized protocol messages), per peer and per fragment."""

    sent_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_by_fragment: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    received_by_fragment: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    by_round: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def sent(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.sent_by_peer[peer] += n
        self.sent_by_fragment[fragment] += n
        self.by_round[(fragment, round_)][0] += n

    def received(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.received_by_peer[peer] += n
        self.received_by_fragment[fragment] += n
        self.by_round[(fragment, round_)][1] += n

    def received_unmatched(self, peer: str, n: int) -> None:
        """Bytes of a message not (yet) tied to one of this node's rounds: per peer only, so that made-up
        (fragment, round) pairs never grow the per-round table."""
        self.received_by_peer[peer] += n

    @property
    def total_sent(self) -> int:
        return sum(self.sent_by_peer.values())

    @property
    def total_received(self) -> int:
        return sum(self.received_by_peer.values())


def behind_the_others(member: str, versions: Mapping[str, int]) -> bool:
    """Whether ``member``'s claimed version is below every other member's that ``versions`` holds (at least one):
    it holds a phi the rest of its round has left (``STALE_GRACE``)."""
    mine = versions.get(member)
    others = [v for m, v in versions.items() if m != member]
    return mine is not None and bool(others) and all(v > mine for v in others)


def idle_reducers(members: list[str], doubted: Mapping[str, Iterable[str]], group: list[str]) -> frozenset[str]:
    """The members of ``group`` that reduce no part this round: those that more than ``FOLLOWED_SHARE`` of at
    least ``FOLLOWED_VOTERS`` of the round's other ``members`` doubt (mute for their standing drift,
    ``DeviationMemory.doubted``); none where that is the whole group.

    Muted by the honest reducers, a drifter still reduced its own part, with its own contribution at full pull:
    3 + 1 (robustness bench, d5dd674) ended 6.9% above clean at equal progress although every honest node muted
    it in nearly every round. Idle, it still contributes (muted) and receives the group's average. Every member
    computes this from the same entries (the ``group_hash`` names the idle ones, so members that disagree fail
    the round at once rather than exchange wrong parts), and no minority reaches the share against an honest
    member (``FOLLOWED_SHARE``), so colluders cannot take honest members' parts: at worst, voting against each
    other, they leave the parts as they were."""
    shunned = majority_shunned(members, doubted, min_voters=FOLLOWED_VOTERS, share=FOLLOWED_SHARE)
    idle = frozenset(p for p in group if p in shunned)
    return idle if len(idle) < len(group) else frozenset()


def unreachable_idle(group: list[str], idle: frozenset[str], outbound: Iterable[str]) -> frozenset[str]:
    """``idle`` with the group's outbound-only members (``locoswarm.node.swarm.reachability``): nobody can open a
    stream to them, so they reduce no part. Where that would idle the whole group, the members peers can dial
    reduce even if the round mutes them (a drifter's part beats a round nobody can reach). ``form_groups`` never
    makes a group of outbound-only members alone; for one, nothing changes."""
    unreachable = frozenset(outbound) & set(group)
    if not unreachable or len(unreachable) == len(group):
        return idle
    both = idle | unreachable
    return both if len(both) < len(group) else unreachable


def apart_by_trust(own: str, members: Sequence[str], apart: Mapping[str, Iterable[str]]) -> bool:
    """Whether an exclusion of the round (``apart``: each member's bans, and the doubts that keep members apart)
    involves ``own``: it bans or shuns another member, or another member bans or shuns it. Where ``own`` is then
    alone in its group, its round failed over a trust decision, not for want of peers, and the failure is a refusal
    (``AverageResult.refused``): the outer loop folds the progress such rounds carried into phi rather than drop it.
    So is a round this node is alone in because it keeps a live peer out (``SwarmTransport._average_timed``), and
    one whose every other member excludes it (``EXCLUDED_BY_ALL``).
    Why: in a 2 + 2 drift run both honest nodes, alarmed, shunned the drifters and each other and were alone in every
    round for a minute; each dropped its progress every 4 rounds and trained for nothing (+36% at equal progress,
    robustness bench, 537b541)."""
    mine = set(apart.get(own, ()))
    return any(m != own and (m in mine or own in set(apart.get(m, ()))) for m in members)


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
class _Reduced:
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


class _Reduction:
    """This member's part of one group round: members' contributions in, one reduced part out.

    Created only by this node's own round (``SwarmTransport._exchange``), so peers cannot create
    sessions; it lives until the round's end plus a round timeout. Contributions are exact-size codec
    bytes of this part (checked as they stream in); the reduction screens and combines them with the
    swarm's robust aggregator (``locoswarm.node.transport.reduce``)."""

    def __init__(self, key: tuple[int, int, bytes], own: str, codec: Codec, members: list[str], part: range,
                 sizes: dict[int, int], settings: RobustSection, consensus: bool, basis: bytes = b"",
                 memory: DeviationMemory | None = None, accused: Iterable[str] = ()) -> None:
        self.key = key
        # members that another member of the round excludes: their disagreement with our own is evidence
        self.accused = frozenset(accused)
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
        self.done: asyncio.Future[_Reduced] = asyncio.get_running_loop().create_future()
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

    def _reduce(self) -> _Reduced:
        senders = sorted(self.contributions)
        cons = [self.contributions[s][0] for s in senders]
        trusted = senders.index(self.own)
        centers = None
        if self.consensus:  # rounds of phi itself: judge deviations from this node's phi
            own = cons[trusted].chunks
            centers = {c: self.codec.decode(own[c], self.sizes[c]) for c in self.part}
        screening = screen_part(self.codec, cons, self.sizes, self.settings, trusted=trusted, centers=centers,
                                memory=self.memory, fragment=self.key[0])
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
        return _Reduced(reduced, total, extras, refused, scores, contested)

    def fail(self, error: str) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(error))


def _retrieve(future: asyncio.Future) -> None:
    """Mark a failure as seen (nobody may be waiting on a session that failed)."""
    if not future.cancelled():
        future.exception()


class _Handle(AverageHandle):
    def __init__(self, future, timeout: float) -> None:
        self._future = future
        self._timeout = timeout

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> AverageResult:
        try:
            return self._future.result(timeout if timeout is not None else self._timeout)
        except Exception as exc:
            self._future.cancel()
            return AverageResult.failed(f"{type(exc).__name__}: {exc}")

    def cancel(self) -> None:
        self._future.cancel()

    def wait(self, timeout: float) -> bool:
        concurrent.futures.wait([self._future], timeout=max(0.0, timeout))
        return self._future.done()


def kin_share(lineages: Mapping[str, int], own: int) -> float:
    """The share of a round's members (``lineages``: each one's phi crc, this node's included) that sent from this
    node's phi ``own`` (``AverageResult.kin``); 1.0 where none is known."""
    return sum(v == own for v in lineages.values()) / len(lineages) if lineages else 1.0


class SwarmTransport(Transport):
    """Averaging with peers found in the DHT (see module docstring): the exchange of a round's parts, serving
    other members' parts, and the ``Transport`` face the outer loop calls. It delegates who is in a round to its
    ``Matchmaker`` (``matchmaking``), the judgement of what members send to its ``PartJudge`` (``judging``), the
    counting of refusals and the bans it follows to its ``OffenceBook`` (``offences``), catch-ups to its
    ``CatchUp`` (``catchup``) and a lone node's solo steps to its ``LonePolicy`` (``lone``).

    Args:
        runtime: the node's network thread (DHT + P2P replica).
        swarm_key: prefix of this swarm's DHT keys (contains the fingerprint).
        fingerprint: refused when a peer's header carries another one.
        codec: the swarm's payload codec.
        group_size, matchmaking_timeout, round_timeout: from ``[network]``.
        view: the swarm as this node sees it (``locoswarm.node.swarm.view.SwarmView``): its live peers (matchmaking
            closes as soon as they are all in) and those that keep pace (once they are in, stragglers get only
            ``straggler_grace()`` seconds, the wait the overlap hides, before the round starts without them); the
            swarm's step time (the matchmaking window is at least ``WINDOW_STEPS`` of them, at most
            ``MAX_WINDOW_S``); whether the members count this node in yet (a joining node waits until every peer
            has had the time to see its heartbeat: members that disagree on whether it is live form different
            groups); the version to believe and its holders, and the most versions a fragment can hold at the
            swarm's clock (claims above it are not believed, far above it are offences); the most tokens a peer
            can claim (its heartbeat throughput); peers joining and those it serves a download (a lone node takes
            no solo outer steps meanwhile: ``lone.LonePolicy``); outbound-only peers; and whether a holder is kin
            (``FragmentSnapshot.kin``).
        states: where catch-ups download a fragment's state or replay its steps
            (``locoswarm.node.swarm.view.StateSource``; the daemon's ``StateClient``).
        admission: a closed swarm's rule (``locoswarm.node.swarm.admission``; None: an open swarm): match entries
            without a valid certificate are ignored, and streams from peers that are not live members refused.
        certificate: this node's, carried in its match entries (a closed swarm).
        robust: the ``[robust]`` settings (screening and the aggregator; stream caps).
        reputation: where offences are counted and bans looked up (``locoswarm.node.swarm.reputation``); None:
            nothing is counted and nobody is banned.
        subkey: this node's owner subkey for its match entries (default: built from the DHT's identity).
        standing_members: a merged round's member list stands for the fragment's next round while this
            node's view of the swarm is unchanged: that round skips the DHT (``locoswarm.node.swarm.standing``).
        counters: the node's byte counters, shared with its state client (default: its own).
    """

    def __init__(self, runtime: NetworkRuntime, *, swarm_key: str, fingerprint: str, codec: Codec,
                 group_size: int, matchmaking_timeout: float, round_timeout: float,
                 view: SwarmView | None = None, states: StateSource | None = None,
                 robust: RobustSection | None = None,
                 reputation: Reputation | None = None,
                 subkey: str | None = None, standing_members: bool = True,
                 admission: Admission | None = None, certificate: bytes = b"",
                 reachability: Reachability | None = None,
                 counters: ByteCounters | None = None) -> None:
        self.runtime = runtime
        self.view = view if view is not None else SwarmView()
        self.states = states if states is not None else StateSource()
        self.reachability = reachability
        self.admission = admission
        self.peer_id = runtime.peer_id
        self.swarm_key = swarm_key
        self.fingerprint = fingerprint
        self.codec = codec
        self.group_size = group_size
        self.round_timeout = round_timeout
        self.robust = robust or RobustSection()
        self.reputation = reputation
        # the node's counters, shared with its state client: one tally of the node's bytes
        self.counters = counters if counters is not None else ByteCounters()
        self.dial_failures = DialFailures()
        # what members' round headers name of their versions, held against their heartbeats (``versions``, rule 5)
        self.round_claims = RoundClaims()
        # every refusal of a peer, and the bans this node follows from the others' exclusions
        self.book = OffenceBook(self.peer_id, reputation, self.round_claims, spread_ban=SPREAD_BAN)
        self._sessions: dict[tuple[int, int, bytes], _Reduction] = {}
        self._exchanges = 0  # this node's rounds whose exchange is in flight (``exchanging``)
        self._view_changed: asyncio.Event | None = None
        self._skipped: dict[tuple[int, int], float] = {}
        # (fragment, round) -> peers whose stream for it was refused before this node formed its group
        self._refused_early: OrderedDict[tuple[int, int], set[str]] = OrderedDict()
        self.lone = LonePolicy(self.view)  # when this node is a swarm of one and steps alone
        self.pauses = SourcePauses()  # peers not asked for state for a while (``CatchUp.may_serve``)
        # what this node's reductions saw of each sender's deviations (``locoswarm.node.core.persistence``)
        self.deviations = DeviationMemory(ceiling=self.robust.drift_ceiling)
        # what members send a round, judged by what it would do (``locoswarm.node.swarm.judging``)
        self.judge = PartJudge(self.peer_id, reputation, self.book, self.robust, self.pauses)
        self.replays = ReplayMemory()  # chunks this node has seen, by round (``locoswarm.node.swarm.replay``)
        # which version to catch up to, from whom (``locoswarm.node.swarm.catchup``)
        self.catch_up = CatchUp(self.peer_id, view=self.view, states=self.states, reputation=reputation,
                                book=self.book, round_claims=self.round_claims, pauses=self.pauses,
                                dial_failures=self.dial_failures, deviations=self.deviations)
        # who is in each round (``locoswarm.node.swarm.matchmaking``)
        self.matchmaker = Matchmaker(
            runtime.dht, self.peer_id, swarm_key=swarm_key, subkey=subkey or own_subkey(runtime.dht, self.peer_id),
            matchmaking_timeout=matchmaking_timeout, view=self.view, lone=self.lone, deviations=self.deviations,
            dial_failures=self.dial_failures, book=self.book, standing=StandingMembers(standing_members),
            admission=admission, certificate=certificate, reachability=reachability)
        self._explained: set[tuple[int, int]] = set()  # rounds whose refused members were explained in the log
        # Messages are bounded by the largest chunk any round may carry (consensus rounds: fp32).
        elems = chunk_elems(codec.block_size)
        self._max_chunk_msg = max(codec.encoded_size(elems), 4 * elems) + 1024
        self._stream_timeout = longest_round_s(matchmaking_timeout, round_timeout)
        self._over_cap = EveryNth(FLOOD_REFUSALS, MAX_TRACKED_FLOODERS)  # streams refused over a peer's own cap
        self._server = runtime.call(serve(
            runtime.p2p, AVERAGE_HANDLER, self._serve_part, swarm_pb2.AverageRequest,
            max_request_bytes=max(self._max_chunk_msg, MAX_HEADER_BYTES), idle_timeout=self._stream_timeout,
            max_streams_per_peer=self.robust.max_streams_per_peer, max_streams=64 + 4 * group_size,
            on_refused=self._stream_refused, gatekeeper=self._refuse_banned), timeout=30)
        tamper.installed().attached(self)

    @property
    def refusals(self) -> Sequence[str]:
        """The last few refusals of peers, newest last (the offence book's; for the status)."""
        return self.book.refusals

    def _offence(self, peer: str, kind: str, detail: str, *, offence: bool = True, conclusive: bool = False,
                 forgivable: bool = True) -> None:
        """Count a refusal of ``peer`` in the offence book (``OffenceBook.refuse``)."""
        self.book.refuse(peer, kind, detail, offence=offence, conclusive=conclusive, forgivable=forgivable)

    def _stream_refused(self, peer: str, why: str) -> None:
        """A stream refused by the caps. Alone it may be an honest peer's burst, or the server being full
        because of someone else, so it is no offence; but every ``FLOOD_REFUSALS``-th stream a peer opens
        while it already holds its own cap is one: no honest member gets near that (it opens a few streams
        per round), a flooder gets banned within seconds."""
        offence = False
        if self._server.open_streams(peer) >= self.robust.max_streams_per_peer:
            offence = self._over_cap.offence(peer)
        self._offence(peer, "streams", why, offence=offence)

    def _plausible(self, claims: dict[str, int]) -> int:
        """The group's corroborated version of members' ``claims`` within the swarm clock's bound
        (``locoswarm.node.swarm.versions``); a claim far above the bound is an offence of its member."""
        bound = self.view.version_bound()
        if bound is not None:
            for peer, version in claims.items():
                if peer != self.peer_id and absurd_version(version, bound):
                    self._offence(peer, "version_lie", f"claims version {version} in a round; the swarm clock "
                                                       f"allows {bound}")
        return plausible_version(claims, own=self.peer_id, bound=bound)

    def _banned(self, peer: str) -> bool:
        return self.reputation is not None and self.reputation.is_banned(peer)

    @property
    def schedule_hint(self) -> ScheduleHint | None:
        """The newest slot where this node's adaptive-schedule state differed from the slot leader's
        (``matchmaking.leader_schedule``), for the node to adopt between inner steps."""
        return self.matchmaker.schedule_hint

    def window(self) -> float:
        """Seconds a round's matchmaking stays open after its first arrival (``Matchmaker.window``)."""
        return self.matchmaker.window()

    def outbound_only(self) -> bool:
        """Whether peers cannot dial this node (``Matchmaker.outbound_only``): it reduces no part."""
        return self.matchmaker.outbound_only()

    def streams_served(self) -> int:
        """Averaging streams peers opened to this node since its start (it reduced their parts)."""
        return self._server.served

    def undialable(self) -> int:
        """How many peers this node's stream opens failed to lately (its match entries keep it apart from them)."""
        return len(self.dial_failures.peers())

    def _refuse_banned(self, peer: str) -> str | None:
        """The stream server's first question: a banned peer's stream is refused before anything of it is
        read (counted, no new offence); in a closed swarm, so is a peer that is not a live member."""
        if self.admission is not None and peer not in set(self.view.live_peers()):
            self.admission.stranger(peer)
            self._offence(peer, "stranger", "stream from a peer that is not a member of this closed swarm",
                          offence=False)
            return "refused: this is a closed swarm, and your peer id is not a member of it"
        if not self.book.banned(peer):
            return None
        self._offence(peer, "banned", "stream from a banned peer", offence=False)
        return "refused: this node bans your peer id for now"

    # ---- Transport ------------------------------------------------------------------------------
    def start_average(self, request: AverageRequest) -> AverageHandle:
        budget = 2 * self.window() + self.round_timeout + 5.0  # the agreed window may be another member's
        future = self.runtime.submit(asyncio.wait_for(self._average(request), budget))
        return _Handle(future, budget)

    def latest_version(self, fragment: int) -> int:
        return self.catch_up.newest(fragment).version

    def fetch_fragment(self, fragment: int, have: int | None = None) -> FragmentSnapshot | None:
        return self.catch_up.fetch(fragment, have)

    def start_fetch(self, fragment: int, have: int | None = None) -> FetchHandle:
        return self.catch_up.start(fragment, have)

    def reject_replay(self, snapshot: FragmentSnapshot, reason: str) -> None:
        self.catch_up.reject_replay(snapshot, reason)

    def reject_snapshot(self, snapshot: FragmentSnapshot, reason: str, *, offence: bool = True,
                        conclusive: bool = False) -> None:
        self.catch_up.reject_snapshot(snapshot, reason, offence=offence, conclusive=conclusive)

    def close(self) -> None:
        async def stop() -> None:
            self.matchmaker.close()
            await self._server.stop()

        with contextlib.suppress(Exception):
            self.runtime.call(stop(), timeout=5)
        self.catch_up.close()

    # ---- one round ------------------------------------------------------------------------------
    async def _average(self, req: AverageRequest) -> AverageResult:
        started = time.monotonic()
        timing: dict[str, float] = {}
        result = await self._average_timed(req, timing, started)
        result.round_s = time.monotonic() - started
        result.matchmaking_s = timing.get("matched", result.round_s)
        return result

    async def _average_timed(self, req: AverageRequest, timing: dict[str, float], started: float) -> AverageResult:
        """One round; ``timing["matched"]``: seconds from ``started`` until its member list was decided."""
        if not self.view.in_rounds():
            return AverageResult.failed("joining: peers have not all seen this node's heartbeat yet",
                                        own_weight=req.weight)
        banned = self._shunned()
        matched = self.matchmaker.standing_round(req, banned) or await self.matchmaker.matchmake(req, banned)
        timing["matched"] = time.monotonic() - started
        if matched is None:
            self._not_in_round(req.fragment, req.round)
            view = self.matchmaker.view_of(req.fragment, req.round)
            if view is not None and view.cut.endswith(SHUNNED_CUT):
                return AverageResult.failed(EXCLUDED_BY_ALL, own_weight=req.weight, refused=True)  # apart_by_trust
            return AverageResult.failed(LATE_FOR_ROUND, own_weight=req.weight)
        members, versions, excluded, bases, doubted, declared_outbound, undialable = matched
        if req.digest:  # a consensus round: only the members at the round's common version (consensus_members)
            members = consensus_members(members, versions)
            if self.peer_id not in members:
                self._not_in_round(req.fragment, req.round)
                self.matchmaker.take_digests(req.fragment, req.round)
                return AverageResult.failed(f"{NOT_AT_CONSENSUS_VERSION}: its members hold another version than "
                                            f"this node's {req.version}; it catches up instead", own_weight=req.weight)
        self.book.follow_majority_bans(members, excluded, banned)
        trusted_apart = kept_apart(excluded, doubted) if self.deviations.keeps_apart else excluded
        outbound, apart = route_around(members, declared_outbound, undialable, trusted_apart)
        group = next(g for g in form_groups(members, req.fragment, req.round, self.group_size, apart, outbound)
                     if self.peer_id in g)
        if len(group) < 2:
            self._not_in_round(req.fragment, req.round)
            if len(members) == 1 and not req.digest and self.lone.alone():
                return self.lone.solo(req, self._codec(req.codec))
            if len(members) > 1 and outbound >= set(members):
                await self.matchmaker.explain(req, "outbound-only members alone")  # the public ones: late, or never
                return AverageResult.failed(f"{NO_PEER_IN_GROUP}: every member of the round is outbound only "
                                            "(behind NAT): none can open a stream to another", own_weight=req.weight)
            # alone over a trust decision: an exclusion in the round involves this node, or it keeps a live peer out
            # (one every member excludes is dropped from the member list before the groups are cut)
            refused = apart_by_trust(self.peer_id, members, trusted_apart) or bool(set(banned) & self.lone.live())
            view = self.matchmaker.view_of(req.fragment, req.round)
            why = f" ({view.summary()})" if view is not None else ""
            return AverageResult.failed(NO_PEER_IN_GROUP + why, own_weight=req.weight, refused=refused)
        agreed = await self._agree_on_basis(req, [bases.get(p, b"") for p in group])
        if agreed is None:
            self._not_in_round(req.fragment, req.round)
            return AverageResult.failed(f"{BASIS_MISMATCH}: cannot re-encode on the group's basis",
                                        own_weight=req.weight)
        if agreed is not req:
            log.info("fragment %d round %d: the group's low-rank bases differ; re-encoded on the round's seeded "
                     "basis", req.fragment, req.round)
        req = agreed
        max_version = self._plausible({p: versions.get(p, req.version) for p in group})
        digests = self.matchmaker.take_digests(req.fragment, req.round)
        if req.digest and all(digests.get(p) == req.digest for p in group):
            self._not_in_round(req.fragment, req.round)  # nobody will send us a part of it
            return AverageResult(ok=True, average=None, group_size=len(group), own_weight=req.weight,
                                 total_weight=req.weight * len(group), max_version=max_version)
        claims = {p: versions[p] for p in group if p in versions}
        accused = [p for p in group if p != self.peer_id
                   and any(p in excluded.get(m, ()) for m in members if m not in (p, self.peer_id))]
        idle = idle_reducers(members, doubted, group)
        if idle:
            log.info("fragment %d round %d: %s reduce no part: most of the round mutes them for their standing drift",
                     req.fragment, req.round, ", ".join(p[:12] for p in sorted(idle)))
        idle = unreachable_idle(group, idle, outbound)
        result = await self._exchange(req, group, claims, accused, idle, idle & outbound)
        if result.ok:
            max_version = result.max_version
        result.max_version = max_version
        if not result.ok and GROUP_MISMATCH in (result.error or ""):
            await self.matchmaker.explain(req)
        # A round some reducer completed without a member (partial reduction) merged, but its members' lists
        # differed: standing on it kept them different for good. A member that failed alone ("no peer in group",
        # its window closed before the others came) matchmade, the others stood on the list that held it and
        # waited for its part until the partial reduction in every round, and so came too late for its window
        # again (a 2 + 2 NAT test: 40 rounds in a row). Such a round's next one matchmakes.
        if result.ok and not result.missing:
            self.matchmaker.standing.record(req.fragment, req.round, members, excluded, banned, doubted,
                                 doubted.get(self.peer_id, ()),  # what our entry said, as the others hold it
                                 declared_outbound, undialable, own=self.peer_id)
        if result.ok:
            self.catch_up.merged(req.fragment, max_version + 1, group)
        return result

    @staticmethod
    async def _agree_on_basis(req: AverageRequest, tags: list[bytes]) -> AverageRequest | None:
        """The request as the group sends it: as it is when the members' low-rank basis tags (from their match
        entries, in member order) agree, else re-encoded on the seeded basis of the round at the leader's
        ranks (``group_basis``; off the network loop: it projects the whole fragment). None: it cannot."""
        leader = group_basis(tags)
        if leader is None:
            return req
        if req.reencode is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(None, req.reencode, leader)

    def standing_rounds(self) -> int:
        """Rounds that took a standing member list instead of matchmaking (``locoswarm.node.swarm.standing``)."""
        return self.matchmaker.standing.used

    def exchanging(self) -> bool:
        """Whether a round of this node is exchanging its parts now (state downloads it serves wait for it)."""
        return self._exchanges > 0

    async def _exchange(self, req: AverageRequest, group: list[str], claims: dict[str, int],
                        accused: Iterable[str] = (), idle: frozenset[str] = frozenset(),
                        unreachable: frozenset[str] = frozenset()) -> AverageResult:
        """The group's average of ``req``; its ``max_version`` is the plausible version of the members'
        ``claims`` (from their match entries) as their headers in this exchange updated them. ``accused``: group
        members that another member of the round excludes (``_Reduction.accused``); ``idle``: members that reduce
        no part (``idle_reducers``); ``unreachable``: idle members nobody can dial (``unreachable_idle``), to which
        nobody opens a stream."""
        self._exchanges += 1
        try:
            return await self._exchange_parts(req, group, claims, accused, idle, unreachable)
        finally:
            self._exchanges -= 1

    async def _exchange_parts(self, req: AverageRequest, group: list[str], claims: dict[str, int],
                              accused: Iterable[str] = (), idle: frozenset[str] = frozenset(),
                              unreachable: frozenset[str] = frozenset()) -> AverageResult:
        ghash = group_hash(group, idle)
        n = len(group)
        me = group.index(self.peer_id)
        codec = self._codec(req.codec)
        bounds = chunk_bounds(req.numel, codec.block_size)
        parts = reducer_parts(len(bounds), group, idle)
        sizes = {c: bounds[c][1] - bounds[c][0] for c in parts[me]}
        key = (req.fragment, req.round, ghash)
        session = _Reduction(key, self.peer_id, codec, group, parts[me], sizes, self.robust,
                             consensus=bool(req.digest), basis=req.basis, memory=self.deviations, accused=accused)
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
        shares = self._member_shares(session, req, codec, bounds)
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

    def _member_shares(self, session: _Reduction, req: AverageRequest, codec: Codec,
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
        codec = self._codec(req.codec)
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
        stream = open_stream(self.runtime.p2p, peer, AVERAGE_HANDLER, requests(), swarm_pb2.AverageReply,
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
            self._offence(peer, "wire", str(exc), offence=False)
            raise RuntimeError(f"peer {peer[:12]}: {exc}") from None
        except asyncio.CancelledError:  # the round ended first: a dial that hangs (packets dropped) is no answer
            if not stream.opened and time.monotonic() - opening >= DIAL_PATIENCE_S:
                self._dial_failed(peer, f"no stream opened in {time.monotonic() - opening:.0f} s")
            raise
        except WireError as exc:
            self._offence(peer, "wire", str(exc), offence=False)
            raise RuntimeError(f"peer {peer[:12]}: {exc}") from None
        except RoundRefused as exc:
            self._offence(peer, exc.kind, str(exc))
            raise PartRefused(f"peer {peer[:12]}: {exc}") from None
        if set(chunks) != set(part):
            raise RuntimeError(f"peer {peer[:12]} sent {len(chunks)} of {len(part)} reduced chunks")
        reason = check_reduced_part(codec, req, chunks, bounds, own_norm)
        if reason:
            # a consensus part far from our phi may be an honest member's of another lineage: refused, no blame
            self._offence(peer, "bad_reduction", reason, offence=not req.digest)
            raise PartRefused(f"peer {peer[:12]} sent a bad reduced part: {reason}")
        geometry = None if req.digest else part_geometry(codec, req, chunks, bounds)
        refused = ""
        if geometry is not None:
            view = self._local_view(req.fragment, req.round)
            try:
                self.judge.reduced_direction(peer, geometry.agreement, same_lineage=int(h.lineage) == req.lineage,
                                             evidence=view is None or view.judges_reduced_part(peer),
                                             stale=self._stale_here(req, int(h.version), view))
            except PartRefused as exc:  # raised once the others' parts arrived and every spread was judged
                refused = str(exc)
        if not refused:
            self._remember_payload(req, chunks.items(), averaged=True)
        seam.returned(peer, req, chunks)
        return PartResult(peer, chunks, h.total_weight, list(h.extras), geometry, min(h.missing, MAX_EXPECTED),
                           same_lineage=int(h.lineage) == req.lineage, refused=refused)

    def _stale_here(self, req: AverageRequest, reducer_version: int, view: _Reduction | None) -> bool:
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

    def _codec(self, name: str) -> Codec:
        from locoswarm.node.core.codecs import get_codec

        return get_codec(name, self.codec.block_size) if name and name != self.codec.name else self.codec

    # ---- group disagreement: fail fast, never wait for a contribution that cannot come ----------
    def _not_in_round(self, fragment: int, round_: int) -> None:
        """Remember that this node takes no part in a round, so contributions to it fail at once."""
        self._skipped[(fragment, round_)] = time.monotonic()
        for key in [k for k, t in self._skipped.items() if t < time.monotonic() - 300]:
            del self._skipped[key]
        self._view_ready()

    def _local_view(self, fragment: int, round_: int) -> _Reduction | None:
        for (f, r, _), sess in self._sessions.items():
            if f == fragment and r == round_:
                return sess
        return None

    def _view_ready(self) -> None:
        """Wake the streams waiting for this node to form (or skip) a round."""
        if self._view_changed is not None:
            self._view_changed.set()
        self._view_changed = asyncio.Event()

    async def _await_view(self, fragment: int, round_: int, timeout: float) -> _Reduction | None:
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
    async def _serve_part(self, remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.AverageReply]:
        """One member's part, streamed in from ``remote`` (the authenticated peer id of the stream).

        Every refusal is a ``WireError``: the stream server sends its one line to the peer."""
        first = await anext(requests, None)
        if first is None or not first.HasField("header"):
            raise WireError("expected a header first")
        self.counters.received_unmatched(remote, first.ByteSize())
        h = first.header  # (a banned peer's stream never gets here: see ``_refuse_banned``)
        if h.fingerprint != self.fingerprint:
            text = f"swarm fingerprint mismatch: peer has {h.fingerprint[:40]}, this node {self.fingerprint}"
            self._offence(remote, "fingerprint", text, offence=False)
            raise WireError(text)
        if h.sender != remote:
            self._offence(remote, "forged_sender", f"header names sender {h.sender[:20]!r}", conclusive=True)
            self._drop_from_round(remote, h.fragment, h.round)
            raise WireError("refused: the header's sender is not the stream's authenticated peer id")
        if not (math.isfinite(h.weight) and h.weight > 0) or len(h.extras) > MAX_EXTRAS or not _finite(h.extras) \
                or (h.codec and h.codec not in CODECS) or len(h.basis) > MAX_BASIS_TAG:
            self._offence(remote, "bad_header", "weight, extras, codec or basis tag out of bounds")
            self._drop_from_round(remote, h.fragment, h.round)
            raise WireError("refused: header fields out of bounds")
        session = await self._await_view(h.fragment, h.round, 2 * self.window() + 2.0)
        if session is None:
            self._offence(remote, "not_in_round", f"fragment {h.fragment} round {h.round}", offence=False)
            raise WireError(f"{NOT_IN_ROUND} (it arrived after the window or had no group)")
        session = self._check_membership(session, remote, h)
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
            self._offence(remote, kind, detail, conclusive=conclusive)
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

    def _refuse_replay(self, session: _Reduction, remote: str, chunks: dict[int, bytes]) -> None:
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
            self._offence(remote, "replay", detail, conclusive=replay_conclusive(seen))
            session.drop(remote, "it replayed an earlier round's payload")
            raise WireError(f"refused: replayed payload ({detail})")
        self.replays.remember(fragment, round_, payload)

    def _remember_payload(self, req: AverageRequest, chunks: Iterable[tuple[int, bytes]], *, averaged: bool) -> None:
        """Chunks this node sent or received in ``req``'s round (``averaged``: reduced parts): a later replay of
        them is refused."""
        if not req.digest:
            codec = self._codec(req.codec)
            bounds = chunk_bounds(req.numel, codec.block_size)
            self.replays.remember(req.fragment, req.round, [
                data for c, data in chunks if _nonzero(codec, data, bounds[c][1] - bounds[c][0])], averaged=averaged)

    def reject_part(self, result: AverageResult, part: PartOrigin, reason: str) -> None:
        """The outer loop refused ``result`` for ``part``'s effect on its held-out loss (``PartJudge.harmful_part``)."""
        self.judge.harmful_part(part, reason)

    def reject_member(self, result: AverageResult, share: MemberShare, reason: str) -> None:
        """The outer loop refused ``result``, and ``share`` is harmful alone (``PartJudge.harmful_member``)."""
        self.judge.harmful_member(share, reason)

    def alarm(self, reason: str) -> None:
        """The outer loop's effect check saw this node's loss climb through rounds that each passed: for ``ALARM_S``
        the standing-drift bound is at most ``ALARM_CEILING``; a sender that this bound alone mutes round after round
        is kept out of this node's rounds (``DeviationMemory.alarm``, ``shunned``), and any sender muted round
        after round serves it no state meanwhile (``DeviationMemory.drifting``)."""
        if not self.deviations.alarmed():
            log.info("alarm: %s: for %.0f s a sender whose difference from this node's own progress persists above "
                     "%.2f has no pull here, and one muted round after round is kept out of its rounds",
                     reason, ALARM_S, ALARM_CEILING)
        self.deviations.alarm()

    def _shunned(self) -> list[str]:
        """Whom this node keeps out of its rounds and names as excluded in its match entries: the peers it bans, and
        during an alarm the senders only the alarm's bound mutes round after round (no offence counted). A round
        treats them all as banned here, so the others' exclusions of a shunned peer make this node no ban of it
        (``OffenceBook.follow_majority_bans``) until the alarm lapses."""
        banned = self.reputation.banned() if self.reputation is not None else []
        return sorted(set(banned) | set(self.deviations.shunned()))

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
    def _sessions_own_weight(session: _Reduction) -> float:
        own = session.contributions.get(session.own)
        return own[0].weight if own is not None else 0.0

    def _explain_refused_member(self, session: _Reduction, remote: str) -> None:
        """Log, once per round, why a peer is not in the group this node formed (its side of a mismatch: the
        refused member logs the other side, ``Matchmaker.explain``)."""
        fragment, round_ = session.key[0], session.key[1]
        if (fragment, round_) in self._explained:
            return
        self._explained.add((fragment, round_))
        while len(self._explained) > MAX_VIEWS:
            self._explained.pop()
        view = self.matchmaker.view_of(fragment, round_)
        how = "no view kept" if view is None else f"its member list {sorted(p[-6:] for p in view.members)} ({view.cut})"
        log.info("group mismatch: fragment %d round %d: refused %s: this node's group %s, from %s", fragment, round_,
                 remote[-6:], sorted(p[-6:] for p in session.members), how)

    def _check_membership(self, session: _Reduction, remote: str, h: swarm_pb2.AverageHeader) -> _Reduction:
        """The stream's sender must be a member of the group this node formed for the round, once."""
        if session.key[2] != bytes(h.group_hash):
            if remote in session.members:  # it formed another group: its part will not come
                session.drop(remote, "it formed another group")
                raise WireError(f"{GROUP_MISMATCH}: this reducer formed another group for the round")
            self._offence(remote, "non_member", "a group this node did not form", offence=False)
            self._explain_refused_member(session, remote)
            raise WireError(f"{GROUP_MISMATCH}: you are not in this reducer's group for the round")
        if remote not in session.members:  # it knows our group's hash but is not in it
            self._offence(remote, "non_member", f"not in the group of fragment {h.fragment} round {h.round}")
            raise WireError("refused: you are not a member of this group")
        if remote in session.dropped:  # reduced without it (too late), or it failed already
            raise WireError(f"refused: the reducer no longer takes your part ({session.dropped[remote]})")
        if session.has(remote):
            self._offence(remote, "duplicate", "a second contribution to one part")
            raise WireError("refused: duplicate contribution")
        expected_codec = session.codec.name
        # A low-rank payload on another basis (or at other ranks) is coefficients of other vectors: every
        # member derives the group's basis from the same entries, so a mismatch is not an honest one.
        if (h.codec or self.codec.name) != expected_codec or h.n_chunks != len(session.part) \
                or len(h.extras) != session.n_extras or bytes(h.basis) != session.basis:
            self._offence(remote, "bad_header", "codec, chunk count, extras or basis do not match the round")
            session.drop(remote, "its header did not match the round")
            raise WireError("refused: header does not match the round (codec, chunk count, extras or basis)")
        return session

    async def _read_part(self, session: _Reduction, remote: str, h: swarm_pb2.AverageHeader,
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
            self._offence(remote, exc.kind, str(exc))
            session.drop(remote, str(exc))
            raise WireError(f"refused: {exc}") from None
        except WireError as exc:
            session.drop(remote, f"its stream failed: {exc}")
            raise
        if len(chunks) != len(session.part):
            session.drop(remote, f"sent {len(chunks)} of {len(session.part)} chunks")
            raise WireError(f"expected {len(session.part)} chunks, got {len(chunks)}")
        return chunks
