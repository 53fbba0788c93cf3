"""Fragment averaging over libp2p streams: the swarm's implementation of ``Transport``.

A round of fragment ``p`` started at swarm step ``r``:

1. **Matchmaking** through the DHT (``locoswarm.node.swarm.matchmaking``): the members agree on the round's member
   list. Members are sorted, shuffled by a seed derived from (p, r) and cut into balanced groups of at most
   ``network.group_size`` (``locoswarm.node.transport.groups``): random groups that change from round to round
   (2 = pairwise gossip; as large as the swarm = all-reduce). A member lists the peers it bans in its entry;
   grouping never puts two peers in one group when one of them excludes the other, so every member computes the
   same groups and a banned peer ends up alone. A node with no live peer at all is a swarm of one: its round
   "averages" its own contribution (``locoswarm.node.swarm.lone``).
2. **Exchange** (``locoswarm.node.swarm.exchange``): reduce-scatter then all-gather of the exact codec chunks
   (``locoswarm.node.transport.reduce``): member ``i`` streams its chunks of part ``j`` to member ``j`` (a member
   that most of the round doubts for its standing drift reduces no part: ``idle_reducers``; nor does one peers
   cannot dial, to which nobody opens a stream: ``unreachable_idle``, ``locoswarm.node.swarm.reachability``),
   which screens every member's part (finite, weight within bounds, norm against the group's) and combines the
   accepted ones with the swarm's robust aggregator, re-encodes the result and streams it back to each member.
3. **Atomicity**: a member applies a result only when it holds every reduced part, each checked
   (sizes, finite, norm next to its own contribution). A reducer that misses a member's part past
   ``exchange.PARTIAL_AFTER`` of the round timeout reduces without it; a reducer that refuses or fails answers an
   error, never a partial part, so nobody applies a partial average; the caller keeps its local progress.

Nothing from the network is trusted: a banned peer's stream (in a closed swarm, a stranger's) is refused before
anything of it is read (``SwarmTransport._refuse_banned``), and the exchange binds every other stream to the
authenticated peer id of its other end and checks everything it carries (``locoswarm.node.swarm.exchange``).
Offences go to ``locoswarm.node.swarm.reputation``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from locoswarm.node.config import RobustSection, longest_round_s
from locoswarm.node.core.codecs import Codec
from locoswarm.node.core.persistence import ALARM_CEILING, ALARM_S, DeviationMemory
from locoswarm.node.core.transport import (
    BASIS_MISMATCH,
    EXCLUDED_BY_ALL,
    GROUP_MISMATCH,
    LATE_FOR_ROUND,
    NO_PEER_IN_GROUP,
    NOT_AT_CONSENSUS_VERSION,
    AverageHandle,
    AverageRequest,
    AverageResult,
    FetchHandle,
    FragmentSnapshot,
    MemberShare,
    PartOrigin,
    Transport,
)
from locoswarm.node.swarm import tamper
from locoswarm.node.swarm.catchup import CatchUp
from locoswarm.node.swarm.counters import ByteCounters
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.exchange import AVERAGE_HANDLER, Exchange
from locoswarm.node.swarm.judging import PartJudge, SourcePauses
from locoswarm.node.swarm.lone import LonePolicy
from locoswarm.node.swarm.matchmaking import SHUNNED_CUT, Matchmaker, ScheduleHint, own_subkey
from locoswarm.node.swarm.offences import (
    FOLLOWED_SHARE,
    FOLLOWED_VOTERS,
    OffenceBook,
)
from locoswarm.node.swarm.reputation import EveryNth, Reputation
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.swarm.standing import StandingMembers
from locoswarm.node.swarm.versions import RoundClaims, absurd_version, plausible_version
from locoswarm.node.swarm.view import StateSource, SwarmView
from locoswarm.node.swarm.wire import serve
from locoswarm.node.transport.groups import (
    consensus_members,
    form_groups,
    group_basis,
    kept_apart,
    majority_shunned,
    route_around,
)
from locoswarm.protocol import swarm_pb2

if TYPE_CHECKING:  # pragma: no cover
    from locoswarm.node.swarm.admission import Admission
    from locoswarm.node.swarm.reachability import Reachability

log = logging.getLogger("locoswarm.averaging")

FLOOD_REFUSALS = 32          # streams a peer opens over its own cap that make one offence (a flood)
MAX_TRACKED_FLOODERS = 4096  # peers whose over-cap streams are counted at once


class StreamFloods:
    """Which of the averaging handler's refused streams are offences. Alone a refused stream may be an honest peer's
    burst, or the server being full because of someone else, so it is none; but every ``every``-th stream a peer
    opens while it already holds its own ``cap`` is one: no honest member gets near that (it opens a few streams per
    round), a flooder gets banned within seconds. At most ``limit`` peers are tracked (``EveryNth``)."""

    def __init__(self, cap: int, *, every: int = FLOOD_REFUSALS, limit: int = MAX_TRACKED_FLOODERS) -> None:
        self.cap = cap
        self._over_cap = EveryNth(every, limit)

    def offence(self, peer: str, open_streams: int) -> bool:
        """Whether refusing a stream of ``peer``, which holds ``open_streams`` open already, is an offence; only
        refusals at or over its cap are counted towards one."""
        return open_streams >= self.cap and self._over_cap.offence(peer)


async def agree_on_basis(req: AverageRequest, tags: list[bytes]) -> AverageRequest | None:
    """The request as the group sends it: as it is when the members' low-rank basis tags (from their match
    entries, in member order) agree, else re-encoded on the seeded basis of the round at the leader's
    ranks (``group_basis``; off the network loop: it projects the whole fragment). None: it cannot."""
    leader = group_basis(tags)
    if leader is None:
        return req
    if req.reencode is None:
        return None
    return await asyncio.get_running_loop().run_in_executor(None, req.reencode, leader)


def idle_reducers(members: list[str], doubted: Mapping[str, Iterable[str]], group: list[str]) -> frozenset[str]:
    """The members of ``group`` that reduce no part this round: those that more than ``FOLLOWED_SHARE`` of at
    least ``FOLLOWED_VOTERS`` of the round's other ``members`` doubt (mute for their standing drift,
    ``DeviationMemory.doubted``); none where that is the whole group.

    Muted by the honest reducers, a drifter still reduced its own part, with its own contribution at full pull:
    3 + 1 (robustness bench, d5dd674) ended 6.9% above clean at equal progress although every honest node muted
    it in nearly every round. Idle, it still contributes, with no pull in any part (``Reduction.round_mutes``),
    and receives the group's average. Every member
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


def apart_by_trust(own: str, members: Sequence[str], apart: Mapping[str, Iterable[str]],
                   kept_out: Collection[str] = ()) -> bool:
    """Whether ``own`` is apart from the round's others over trust: an exclusion of the round (``apart``: each
    member's bans, and the doubts that keep members apart) involves it (it bans or shuns another member, or another
    member bans or shuns it), or it keeps a live peer out of its rounds (``kept_out``: such a peer is no member, as
    its exclusion drops it from the member list before groups are cut). Where ``own`` is then alone in its group,
    its round failed over a trust decision, not for want of peers, and the failure is a refusal
    (``AverageResult.refused``): the outer loop folds the progress such rounds carried into phi rather than drop it.
    So is a round whose every other member excludes it (``EXCLUDED_BY_ALL``).
    Why: in a 2 + 2 drift run both honest nodes, alarmed, shunned the drifters and each other and were alone in every
    round for a minute; each dropped its progress every 4 rounds and trained for nothing (+36% at equal progress,
    robustness bench, 537b541)."""
    if kept_out:
        return True
    mine = set(apart.get(own, ()))
    return any(m != own and (m in mine or own in set(apart.get(m, ()))) for m in members)


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


class SwarmTransport(Transport):
    """Averaging with peers found in the DHT (see module docstring): a round's course from its member list to its
    group's average, the stream caps and bans of the averaging handler, and the ``Transport`` face the outer loop
    calls. It delegates who is in a round to its ``Matchmaker`` (``matchmaking``), the exchange of the group's
    parts and the serving of other members' parts to its ``Exchange`` (``exchange``), the judgement of what members
    send to its ``PartJudge`` (``judging``), the counting of refusals and the bans it follows to its
    ``OffenceBook`` (``offences``), catch-ups to its ``CatchUp`` (``catchup``) and a lone node's solo steps to its
    ``LonePolicy`` (``lone``).

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
        self.book = OffenceBook(self.peer_id, reputation, self.round_claims)
        self.lone = LonePolicy(self.view)  # when this node is a swarm of one and steps alone
        self.pauses = SourcePauses()  # peers not asked for state for a while (``CatchUp.may_serve``)
        # what this node's reductions saw of each sender's deviations (``locoswarm.node.core.persistence``)
        self.deviations = DeviationMemory(ceiling=self.robust.drift_ceiling)
        # what members send a round, judged by what it would do (``locoswarm.node.swarm.judging``)
        self.judge = PartJudge(self.peer_id, reputation, self.book, self.robust, self.pauses)
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
        stream_timeout = longest_round_s(matchmaking_timeout, round_timeout)
        # each round's exchange of parts, and the serving of the others' (``locoswarm.node.swarm.exchange``)
        self.exchange = Exchange(
            runtime.p2p, self.peer_id, fingerprint=fingerprint, codec=codec, round_timeout=round_timeout,
            stream_timeout=stream_timeout, robust=self.robust, view=self.view, matching=self.matchmaker,
            judge=self.judge, book=self.book, deviations=self.deviations, round_claims=self.round_claims,
            dial_failures=self.dial_failures, counters=self.counters, plausible=self._plausible)
        self._floods = StreamFloods(self.robust.max_streams_per_peer)  # which refused streams are offences
        self._server = runtime.call(serve(
            runtime.p2p, AVERAGE_HANDLER, self.exchange.serve_part, swarm_pb2.AverageRequest,
            max_request_bytes=self.exchange.max_message_bytes(), idle_timeout=stream_timeout,
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
        """A stream refused by the caps: always counted as a refusal, an offence only where ``StreamFloods`` finds
        it part of a flood."""
        self._offence(peer, "streams", why, offence=self._floods.offence(peer, self._server.open_streams(peer)))

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
        banned = self.book.shunned(self.deviations.shunned())
        matched = self.matchmaker.standing_round(req, banned) or await self.matchmaker.matchmake(req, banned)
        timing["matched"] = time.monotonic() - started
        if matched is None:
            self.exchange.not_in_round(req.fragment, req.round)
            view = self.matchmaker.view_of(req.fragment, req.round)
            if view is not None and view.cut.endswith(SHUNNED_CUT):
                return AverageResult.failed(EXCLUDED_BY_ALL, own_weight=req.weight, refused=True)  # apart_by_trust
            return AverageResult.failed(LATE_FOR_ROUND, own_weight=req.weight)
        members, versions, excluded, bases, doubted, declared_outbound, undialable = matched
        if req.digest:  # a consensus round: only the members at the round's common version (consensus_members)
            members = consensus_members(members, versions)
            if self.peer_id not in members:
                self.exchange.not_in_round(req.fragment, req.round)
                self.matchmaker.take_digests(req.fragment, req.round)
                return AverageResult.failed(f"{NOT_AT_CONSENSUS_VERSION}: its members hold another version than "
                                            f"this node's {req.version}; it catches up instead", own_weight=req.weight)
        self.book.follow_majority_bans(members, excluded, banned)
        trusted_apart = kept_apart(excluded, doubted) if self.deviations.keeps_apart else excluded
        outbound, apart = route_around(members, declared_outbound, undialable, trusted_apart)
        group = next(g for g in form_groups(members, req.fragment, req.round, self.group_size, apart, outbound)
                     if self.peer_id in g)
        if len(group) < 2:
            self.exchange.not_in_round(req.fragment, req.round)
            if len(members) == 1 and not req.digest and self.lone.alone():
                return self.lone.solo(req, self.exchange.codec_for(req.codec))
            if len(members) > 1 and outbound >= set(members):
                await self.matchmaker.explain(req, "outbound-only members alone")  # the public ones: late, or never
                return AverageResult.failed(f"{NO_PEER_IN_GROUP}: every member of the round is outbound only "
                                            "(behind NAT): none can open a stream to another", own_weight=req.weight)
            # alone over a trust decision: an exclusion in the round involves this node, or it keeps a live peer out
            # (one every member excludes is dropped from the member list before the groups are cut)
            refused = apart_by_trust(self.peer_id, members, trusted_apart, kept_out=set(banned) & self.lone.live())
            view = self.matchmaker.view_of(req.fragment, req.round)
            why = f" ({view.summary()})" if view is not None else ""
            return AverageResult.failed(NO_PEER_IN_GROUP + why, own_weight=req.weight, refused=refused)
        agreed = await agree_on_basis(req, [bases.get(p, b"") for p in group])
        if agreed is None:
            self.exchange.not_in_round(req.fragment, req.round)
            return AverageResult.failed(f"{BASIS_MISMATCH}: cannot re-encode on the group's basis",
                                        own_weight=req.weight)
        if agreed is not req:
            log.info("fragment %d round %d: the group's low-rank bases differ; re-encoded on the round's seeded "
                     "basis", req.fragment, req.round)
        req = agreed
        max_version = self._plausible({p: versions.get(p, req.version) for p in group})
        digests = self.matchmaker.take_digests(req.fragment, req.round)
        if req.digest and all(digests.get(p) == req.digest for p in group):
            self.exchange.not_in_round(req.fragment, req.round)  # nobody will send us a part of it
            return AverageResult(ok=True, average=None, group_size=len(group), own_weight=req.weight,
                                 total_weight=req.weight * len(group), max_version=max_version)
        claims = {p: versions[p] for p in group if p in versions}
        accused = [p for p in group if p != self.peer_id
                   and any(p in excluded.get(m, ()) for m in members if m not in (p, self.peer_id))]
        muted = idle_reducers(members, doubted, group)
        if muted:
            log.info("fragment %d round %d: %s reduce no part and have no pull: most of the round mutes them for "
                     "their standing drift", req.fragment, req.round, ", ".join(p[:12] for p in sorted(muted)))
        idle = unreachable_idle(group, muted, outbound)
        result = await self.exchange.run(req, group, claims, accused, idle, idle & outbound, muted)
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

    def standing_rounds(self) -> int:
        """Rounds that took a standing member list instead of matchmaking (``locoswarm.node.swarm.standing``)."""
        return self.matchmaker.standing.used

    def exchanging(self) -> bool:
        """Whether a round of this node is exchanging its parts now (``Exchange.exchanging``)."""
        return self.exchange.exchanging()

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


