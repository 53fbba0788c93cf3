"""Matchmaking: who is in a fragment's round, agreed through the DHT (``locoswarm.node.swarm.averaging``, step 1).

Each member stores a signed ``MatchEntry`` under the round's key (under its owner subkey, see
``locoswarm.node.swarm.records``: nobody can enter a round in another peer's name) and polls it until every peer it
expects (live, not banned, not a no-show) and every peer the other members' entries say they expect (``awaited``) has
arrived, or the round's window (``Matchmaker.window``, ``agreed_window``) closes. A round whose fragment's last merged
round left its member list standing, in a swarm that has not changed since, skips the DHT
(``locoswarm.node.swarm.standing``). Under the adaptive schedule all members of a send slot meet under one key
whatever fragment they picked; a member whose pick or schedule state differs from the slot leader's (smallest peer
id) is told the leader's state to adopt (``leader_schedule``).

The ``Matchmaker`` returns the member list and what the entries said (``Matched``); how the members are then cut into
groups (``locoswarm.node.transport.groups``) and exchange their parts is ``SwarmTransport``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from hivemind.utils import get_dht_time

from locoswarm.node.config import MAX_WINDOW_S
from locoswarm.node.core.schedule import ScheduleState
from locoswarm.node.core.transport import AverageRequest
from locoswarm.node.swarm.records import dht_identity, owner_subkey, subkey_peer
from locoswarm.protocol import swarm_pb2

if TYPE_CHECKING:  # pragma: no cover
    from locoswarm.node.core.persistence import DeviationMemory
    from locoswarm.node.swarm.admission import Admission
    from locoswarm.node.swarm.dial_failures import DialFailures
    from locoswarm.node.swarm.lone import LonePolicy
    from locoswarm.node.swarm.offences import OffenceBook
    from locoswarm.node.swarm.reachability import Reachability
    from locoswarm.node.swarm.standing import StandingMembers
    from locoswarm.node.swarm.view import SwarmView

log = logging.getLogger("locoswarm.averaging")  # one logger for a round's story

MAX_EXCLUDED = 32            # banned peers one match entry may list (keeps the record far below 8 KiB)
MAX_EXPECTED = 64            # awaited peers one match entry may name (4-byte tags: 256 bytes)
MAX_BASIS_TAG = 4096         # bytes of a low-rank basis tag (2 per matrix of a fragment + a hash)
# The matchmaking window is at least this many of the swarm's inner steps (capped): members reach a slot up to
# a few steps apart in wall time (their swarm clocks differ by a step or two), and with a 26M-parameter model on
# a small machine (5-6 s per step) a fixed 5 s window merged 0 of 17 rounds, unshaped; 3 steps merged 5 of 13.
WINDOW_STEPS = 4.0
# A member's stated window counts in a round at most this many times this node's own (and never above
# MAX_WINDOW_S): honest members' windows follow their step times, and volunteers' hardware differs by about 5x
# (issue 30: a node 5x slower than the median must still merge its rounds), so 8x keeps every honest spread
# measured, while a member that states the longest window allowed can no longer hold every round of its group
# open for a minute where the group's own windows are seconds (``docs/security.md``, liveness).
STATED_WINDOW_SPREAD = 8.0
NO_SHOW_ROUNDS = 2           # rounds in a row a live peer missed after which matchmaking stops waiting for it
MAX_VIEWS = 64               # rounds whose matchmaking view is kept to explain a group mismatch
ENTRY_TTL_S = 300.0          # how long a round's match entries stay in the DHT
SHUNNED_CUT = "; this node dropped: every other member excludes it"


@dataclass
class MatchView:
    """How this node formed a round's member list (kept to explain a group mismatch afterwards)."""

    members: list[str]
    expected: set[str]
    first: float           # the first arrival (DHT time): the window opened then
    window_end: float      # entries that arrived after this are not members
    decided: float         # DHT time at which this node stopped waiting
    cut: str               # why it stopped: "all expected", "grace" or "window" (+ SHUNNED_CUT)

    def summary(self) -> str:
        """One line, from this view alone (no DHT read): why and when this node closed the round, and whom it
        waited for in vain (a lone member's failure says what kept it waiting)."""
        absent = sorted(p[-6:] for p in self.expected - set(self.members))
        return (f"closed {self.decided - self.first:.1f} s after the first arrival ({self.cut}), "
                f"window {self.window_end - self.first:.1f} s; members {len(self.members)}, "
                f"awaited in vain [{' '.join(absent)}]")

    def explain(self, entries: Mapping[str, float]) -> str:
        """One line: this view next to ``entries`` (peer -> arrival) the round's key holds now."""
        def ids(peers: Iterable[str]) -> str:
            return "[" + " ".join(sorted(p[-6:] for p in peers)) + "]"
        late = [p for p, a in entries.items() if p not in self.members and a > self.window_end]
        unseen = [p for p, a in entries.items() if p not in self.members and a <= self.window_end]
        missing = self.expected - set(entries)
        late_by = "[" + " ".join(f"{p[-6:]}+{entries[p] - self.window_end:.1f}s" for p in sorted(late)) + "]"
        return (f"formed {ids(self.members)} ({self.cut}, {self.decided - self.first:.2f} s after the first "
                f"arrival); since then arrived late {late_by}, in time but unseen then {ids(unseen)}, "
                f"never {ids(missing)}")


class NoShows:
    """Live peers that keep missing rounds. A peer that heartbeats but has not entered the last
    ``NO_SHOW_ROUNDS`` rounds this node was in at all (a clock far from the swarm's, a broken or hostile
    node) is no longer waited for: without this every round would wait the whole matchmaking window for
    it. It is still a member of any round it does enter in time, and entering a round, even too late,
    clears its record (``Matchmaker._record_no_shows``): a straggler is waited for again."""

    def __init__(self, rounds: int = NO_SHOW_ROUNDS) -> None:
        self.rounds = rounds
        self._missed: dict[str, int] = {}

    def skipped(self) -> set[str]:
        """The peers not waited for now."""
        return {p for p, n in self._missed.items() if n >= self.rounds}

    def record(self, expected: set[str], members: set[str], live: set[str]) -> None:
        """One round closed: ``expected`` peers were waited for (or skipped), ``members`` came."""
        for peer in expected - members:
            self._missed[peer] = self._missed.get(peer, 0) + 1
        for peer in [p for p in self._missed if p in members or p not in live]:
            del self._missed[peer]  # it came, or it left the swarm: bounded by the live peers


class Matched(NamedTuple):
    """A round's member list and what their match entries said (a standing round: what the last merged one's did)."""

    members: list[str]
    versions: dict[str, int]          # the outer versions claimed (a standing round knows only its own)
    excluded: dict[str, list[str]]    # each member's bans
    bases: dict[str, bytes]           # each member's low-rank basis tag
    doubted: dict[str, list[str]]     # whom each member mutes for their standing drift
    outbound: frozenset[str] = frozenset()  # members peers cannot dial (``locoswarm.node.swarm.reachability``)
    undialable: Mapping[str, list[str]] = {}  # whom each member's dials failed to lately (``dial_failures``)


@dataclass(frozen=True)
class ScheduleHint:
    """The adaptive schedule's state to adopt: ``leader`` picked ``fragment`` from ``state`` at ``round``."""

    round: int
    fragment: int
    state: ScheduleState
    leader: str


def match_entry(peer_id: str, req: AverageRequest, arrival: float,
                excluded: Iterable[str] = (), expected: Iterable[str] = (),
                window: float = 0.0, certificate: bytes = b"", doubted: Iterable[str] = (),
                outbound_only: bool = False, undialable: Iterable[str] = ()) -> swarm_pb2.MatchEntry:
    """This member's record in a round's matchmaking key."""
    entry = swarm_pb2.MatchEntry(peer_id=peer_id, arrival=arrival, weight=req.weight, version=req.version,
                                 digest=req.digest, fragment=req.fragment, basis=req.basis, window=window,
                                 certificate=certificate, outbound_only=outbound_only)
    entry.excluded.extend(sorted(excluded)[:MAX_EXCLUDED])
    entry.doubted.extend(sorted(doubted)[:MAX_EXCLUDED])
    entry.undialable.extend(sorted(undialable)[:MAX_EXCLUDED])
    entry.expected.extend(sorted(peer_tag(p) for p in expected if p != peer_id)[:MAX_EXPECTED])
    if req.schedule is not None:
        entry.scheduled = True
        entry.last_send.extend(-1 if t is None else t for t in req.schedule.last_send)
        entry.shared_r.extend(req.schedule.shared_r or ())
    return entry


def peer_tag(peer: str) -> int:
    """A peer id in 4 bytes, for the awaited lists of match entries (a round's key holds every member's
    entry, and DHT values must stay small)."""
    return int.from_bytes(hashlib.blake2b(peer.encode(), digest_size=4).digest(), "big")


def awaited(own: set[str], entries: Mapping[str, swarm_pb2.MatchEntry], trusted: set[str]) -> set[int]:
    """Whom this node waits for before it closes a round early, as peer tags: the peers it expects itself,
    and every peer that a ``trusted`` member that entered the round expects (a live peer not banned here:
    a banned liar's list counts for nothing, and a live liar's costs at most the window, as entering
    every other round already could).

    Each member used to wait only for its own expectation, which differs between members: a joiner does
    not see every heartbeat yet, a member skips a peer it counts as a no-show or bans, the others do not.
    It closed the window early, before an entry the others waited for, and the round failed for all of
    them ("group mismatch", "in time but unseen then": 4-node robustness bench, two state liars)."""
    wanted = {peer_tag(p) for p in own}
    for peer, entry in entries.items():
        if peer in trusted:
            wanted.update(list(entry.expected)[:MAX_EXPECTED])
    return wanted


def agreed_window(own: float, entries: Mapping[str, swarm_pb2.MatchEntry], trusted: set[str]) -> float:
    """The round's window: the longest of ours and the trusted entries' (finite, at most ``MAX_WINDOW_S`` and at
    most ``STATED_WINDOW_SPREAD`` times ours). Each member's own window follows its view of the swarm's step time,
    and those differ by a second or two; members that closed on their own windows formed different member lists
    ("window" on one, "all expected" on another, 18-21 s after the first arrival, small preset)."""
    window = own
    cap = max(own, min(MAX_WINDOW_S, STATED_WINDOW_SPREAD * own))
    for peer, entry in entries.items():
        if peer in trusted and math.isfinite(entry.window):
            window = max(window, min(entry.window, cap))
    return window


def window_ends(entries: Mapping[str, swarm_pb2.MatchEntry]) -> dict[str, float]:
    """For each member of ``entries``, the latest moment at which it can have closed its matchmaking window, as
    ``Matchmaker.matchmake`` closes it on that member, computed from the entries this node holds: its first
    arrival among the members whose windows were still open when it came (``closed_before``), clamped to no
    earlier than one window before its own arrival, plus the longest window of the entries that arrived by then
    (that window grows as entries arrive, so it is taken to its fixed point). Every entry counts, trusted or not:
    a member that trusts more entries than this node waits at most as long, so the bound stays an upper one. A
    member keeps no entry that arrived after its end; it may have closed earlier (the grace cut)."""
    order = sorted(entries, key=lambda p: (entries[p].arrival, p))
    arrivals = [(entries[p].arrival, p) for p in order]
    ends: dict[str, float] = {}
    for peer in order:  # members that came earlier first: whether they were still open depends on their ends
        own = entries[peer]
        # those that came earlier and closed before it came count for nothing on it (``closed_before``)
        counted = [(a, p) for a, p in arrivals if a >= own.arrival or ends[p] >= own.arrival]
        window = own.window
        while True:
            first = min(max(a, own.arrival - window) for a, p in counted if a <= own.arrival)
            seen = {p: entries[p] for a, p in counted if a <= first + window}
            grown = agreed_window(own.window, seen, set(seen))
            if grown <= window:
                break
            window = grown
        ends[peer] = first + window
    return ends


def closed_before(entries: Mapping[str, swarm_pb2.MatchEntry], own: str) -> set[str]:
    """The members of ``entries`` that came before ``own`` and whose windows closed before ``own``'s entry arrived
    (``window_ends``): they formed the round without it, so it forms the round without them, and its own window
    starts from the first of the others' arrivals.

    A late member's window starts no earlier than one window before its arrival, so it kept every entry of that
    span, also those of members that closed their windows long before it came, and its window started from
    theirs: it closed at once, without the members that came just after it. Its member list then held peers whose
    lists did not hold it: it reduced for them and waited for their parts until the partial reduction (6 s a
    round), while they failed their rounds alone, and each such round made it later still (a 2 + 2 NAT test: one
    outbound-only node failed 40 rounds in a row). A member's arrival is its own word: a member that claims an
    early one is only dropped itself."""
    arrival = entries[own].arrival
    ends = window_ends(entries)
    return {p for p, e in entries.items() if p != own and e.arrival < arrival and ends[p] < arrival}


def shunned_dropped(members: list[str], entries: Mapping[str, swarm_pb2.MatchEntry]) -> list[str]:
    """``members`` without those that every other member's entry excludes (a peer the whole round bans).

    Such a peer ends up alone anyway, but it still enters rounds, and no member waits for it: a member that
    closed its window before the peer's entry arrived formed the round without it, one that read the key a
    moment later with it, and the two shuffled different lists into different groups ("group mismatch", every
    round after three honest nodes had banned a hostile one). Dropped by every member, it cannot split them.
    A peer's own exclusions cannot drop anyone the others do not ban, so a liar cannot push out an honest member."""
    out = list(members)
    for peer in members:
        others = [m for m in members if m != peer]
        if others and all(peer in entries[m].excluded for m in others if m in entries):
            out.remove(peer)
    return out


def own_subkey(dht: Any, peer_id: str) -> str:
    """This node's owner subkey for its match entries, from its DHT's identity key."""
    identity = dht_identity(dht)
    if identity is None:
        raise RuntimeError("the DHT has no identity key to sign match entries with (start it with "
                           "locoswarm.node.swarm.dht.start_dht)")
    return owner_subkey(peer_id, identity)


def leader_schedule(own: str, req: AverageRequest, me: swarm_pb2.MatchEntry,
                    entries: Mapping[str, swarm_pb2.MatchEntry]) -> ScheduleHint | None:
    """The adaptive schedule's state ``own`` should adopt: members of a slot must pick the same fragment from the
    same schedule state, and when they do not, the state of the member with the smallest peer id wins (one rule,
    so all converge on one state). None: ``own`` leads, or agrees with the leader. Raises ``ValueError`` where the
    leader's entry holds a malformed state (its offence)."""
    leader = entries[min(entries)]
    if not leader.scheduled or leader.peer_id == own:
        return None
    if (leader.fragment, list(leader.last_send), list(leader.shared_r)) == \
            (me.fragment, list(me.last_send), list(me.shared_r)):
        return None
    n = len(me.last_send)
    if len(leader.last_send) != n or len(leader.shared_r) not in (0, n) or \
            not all(math.isfinite(x) for x in leader.shared_r):
        raise ValueError("malformed schedule state in its match entry")
    state = ScheduleState(tuple(None if t < 0 else int(t) for t in leader.last_send),
                          tuple(leader.shared_r) if len(leader.shared_r) else None)
    return ScheduleHint(req.round, int(leader.fragment), state, leader.peer_id)


class Matchmaker:
    """A node's side of matchmaking (module docstring): its match entries, the rounds' member lists, and what it
    remembers of them (no-shows, standing lists, the views that explain a group mismatch, members' digests).

    Args:
        dht: the node's DHT replica (``NetworkRuntime.dht``); entries are stored under ``subkey``.
        peer_id: this node's.
        swarm_key: prefix of this swarm's DHT keys.
        subkey: this node's owner subkey (``own_subkey``).
        matchmaking_timeout: ``[network] matchmaking_timeout``, the shortest window.
        view: the swarm as this node sees it (``locoswarm.node.swarm.view.SwarmView``: its pace peers, straggler
            grace and step time).
        lone: whom this node counts live (``locoswarm.node.swarm.lone.LonePolicy``).
        deviations: whom this node mutes for their standing drift (named ``doubted`` in its entries).
        dial_failures: peers this node could not dial lately (named ``undialable``).
        book: where a malformed entry's offence is counted.
        standing: the standing member lists (``locoswarm.node.swarm.standing``).
        admission: a closed swarm's rule (None: open): entries without a valid certificate are ignored.
        certificate: this node's, carried in its entries.
        reachability: whether peers can dial this node (None: they can).
    """

    def __init__(self, dht: Any, peer_id: str, *, swarm_key: str, subkey: str, matchmaking_timeout: float,
                 view: SwarmView, lone: LonePolicy, deviations: DeviationMemory, dial_failures: DialFailures,
                 book: OffenceBook, standing: StandingMembers, admission: Admission | None = None,
                 certificate: bytes = b"", reachability: Reachability | None = None) -> None:
        self.dht = dht
        self.peer_id = peer_id
        self.swarm_key = swarm_key
        self.subkey = subkey
        self.matchmaking_timeout = matchmaking_timeout
        self.view = view
        self.lone = lone
        self.deviations = deviations
        self.dial_failures = dial_failures
        self.book = book
        self.standing = standing
        self.admission = admission
        self.certificate = certificate
        self.reachability = reachability
        self.no_shows = NoShows()
        # The newest slot where this node's adaptive-schedule state differed from the slot leader's.
        self.schedule_hint: ScheduleHint | None = None
        self._views: OrderedDict[tuple[int, int], MatchView] = OrderedDict()
        self._digests: dict[tuple[int, int], dict[str, bytes]] = {}  # members' state digests (consensus rounds)
        self._tasks: set[asyncio.Task] = set()

    def view_of(self, fragment: int, round_: int) -> MatchView | None:
        """How this node formed the round's member list (None: it kept no view of it)."""
        return self._views.get((fragment, round_))

    def take_digests(self, fragment: int, round_: int) -> dict[str, bytes]:
        """The state digests the round's members' entries named (read once; empty for a standing round)."""
        return self._digests.pop((fragment, round_), {})

    def close(self) -> None:
        """Cancel the background stores and no-show counts (call on the network loop)."""
        for task in list(self._tasks):
            task.cancel()

    def _keep_view(self, fragment: int, round_: int, view: MatchView) -> None:
        self._views[(fragment, round_)] = view
        while len(self._views) > MAX_VIEWS:
            self._views.popitem(last=False)

    def outbound_only(self) -> bool:
        """Whether peers cannot dial this node (``locoswarm.node.swarm.reachability``): its match entries say so,
        and it reduces no part."""
        return self.reachability is not None and self.reachability.outbound_only

    def window(self) -> float:
        """Seconds a round's matchmaking stays open after its first arrival: ``matchmaking_timeout``, or
        ``WINDOW_STEPS`` of the swarm's inner steps where those are longer (at most ``MAX_WINDOW_S``).

        A step here is the shorter of the swarm's measured one and this node's compute per step. The measured
        step includes the waits for rounds, and the window fed on it: rounds that failed after the whole window
        stalled training, the swarm's step rate fell, and the next windows grew (a 2 + 2 robustness run: after two
        joins, windows of 3, 6 and 9.5 s in a row, rounds failing alone after 13-18 s, training near a stop for a
        minute). A swarm whose steps are slow to compute still gets its long windows; a fast node in it takes the
        slow members' longer windows from their entries (``agreed_window``)."""
        steps = [s for s in (self.view.step_time(), self.view.compute_step_time()) if s > 0 and math.isfinite(s)]
        if not steps:
            return self.matchmaking_timeout
        return max(self.matchmaking_timeout, min(WINDOW_STEPS * min(steps), MAX_WINDOW_S))

    def standing_round(self, req: AverageRequest, banned: list[str]) -> Matched | None:
        """The round's members without the DHT, where the fragment's last merged round left them standing
        and this node's view of the swarm has not changed since (``locoswarm.node.swarm.standing``); None:
        matchmake. Its match entry is still stored, in the background, for members that matchmake."""
        if not self.standing.enabled or req.digest or req.schedule is not None or req.basis:
            self.standing.forget(req.fragment)
            return None
        live = self.lone.live()
        # No-shows count here: a live peer outside the list declines it even when matchmaking would not wait for
        # it. Otherwise a member that missed two rounds (a ban taking effect at different moments on different
        # nodes) stayed a no-show for good: the others kept their standing list without it, never matchmade, so
        # never saw it enter a round again, and every round it formed through the DHT failed ("you are not in
        # this reducer's group", a bench run's 90 failed rounds of one honest node after a ban).
        expected = (live - set(banned)) | {self.peer_id}
        if (set(self.view.pace_peers()) | {self.peer_id}) & expected != expected:
            self.standing.forget(req.fragment)  # someone falls behind: matchmaking gives it only the grace
            return None
        # (a member of the list missing from ``live`` does not decline it: see the module's docstring)
        doubted = self.deviations.apart()
        undialable = self.dial_failures.peers()
        standing = self.standing.take(req.fragment, req.round, expected, banned, doubted, own=self.peer_id,
                                      own_outbound=self.outbound_only(), own_undialable=undialable)
        if standing is None:
            return None
        now = get_dht_time()
        me = match_entry(self.peer_id, req, now, banned, expected, self.window(), self.certificate, doubted,
                         self.outbound_only(), undialable)
        key = self.match_key(req.fragment, req.round)
        self._background(self._store_quietly(key, me.SerializeToString(), now + ENTRY_TTL_S))
        members = list(standing.members)
        self._keep_view(req.fragment, req.round, MatchView(members, expected, now, now, now, "standing"))
        excluded = {p: list(standing.excluded.get(p, ())) for p in members}
        # Only our own version is known here: the members' come with their headers (``Exchange.run``). Taking
        # ours for theirs kept a member a version behind for good with the same phi (its "group version"
        # was its own, so it never learnt it was behind; a CI run: survivors never agreed on phi).
        return Matched(members, {self.peer_id: req.version}, excluded, {p: b"" for p in members},
                       {p: list(standing.doubted.get(p, ())) for p in members}, standing.outbound,
                       {p: list(standing.undialable.get(p, ())) for p in members})

    async def _store_quietly(self, key: str, value: bytes, expiration: float) -> None:
        """Store an entry; a failure is left for the round's own store to meet."""
        with contextlib.suppress(Exception):
            await self.dht.store(key, value, expiration_time=expiration, subkey=self.subkey, return_future=True)

    def match_key(self, fragment: int, round_: int, slot_wide: bool = False) -> str:
        """The DHT key of a round's entries (``slot_wide``: the adaptive schedule's slot)."""
        if slot_wide:  # adaptive schedule: every member of the slot meets here, whichever fragment it picked
            return f"{self.swarm_key}/match/slot/{round_}"
        return f"{self.swarm_key}/match/{fragment}/{round_}"

    async def read_entries(self, key: str) -> dict[str, swarm_pb2.MatchEntry]:
        """The round's entries, each published by the peer it names (signed under its owner subkey)."""
        found = await self.dht.get(key, latest=True, return_future=True)
        entries: dict[str, swarm_pb2.MatchEntry] = {}
        if found is None or not isinstance(found.value, dict):
            return entries
        for subkey, item in found.value.items():
            peer = subkey_peer(subkey)
            if peer is None or not isinstance(item.value, bytes):
                continue
            try:
                entry = swarm_pb2.MatchEntry.FromString(item.value)
            except Exception:
                continue
            if entry.peer_id != peer or not math.isfinite(entry.arrival):
                continue
            if self.admission is not None and peer != self.peer_id and not self.admission.admits(
                    peer, bytes(entry.certificate)):
                continue  # a stranger in a closed swarm's round: not a member, whatever it writes
            entries[peer] = entry
        return entries

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the network loop without waiting for it (a reference is kept until it ends)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record_no_shows(self, key: str, awaited: set[str], live: set[str], window_end: float) -> None:
        """Once the round's window would have closed for anyone waiting, count who entered it at all.

        A peer that entered late (after this node closed the window early) is a straggler, not a no-show:
        counting it as one stopped the others from waiting for it, so it was late to every later round too
        and stayed out of the swarm (robustness bench, 'state': an honest node isolated for the whole run,
        eval loss +35%). Only a peer that never enters the rounds (a clock far off, a broken node) is skipped."""
        with contextlib.suppress(Exception):
            await asyncio.sleep(max(0.0, window_end - get_dht_time()) + 0.3)
            entries = await asyncio.wait_for(self.read_entries(key), 5.0)
            self.no_shows.record(awaited, set(entries) | {self.peer_id}, live)

    async def explain(self, req: AverageRequest, failure: str = "group mismatch") -> None:
        """Log, after a round failed with ``failure``, how this node's member list for it differs from what the
        round's key holds now (members' views differ: the dominant failure of rounds on slow links, see issue 10;
        a round of outbound-only members alone: where the public members were)."""
        view = self._views.get((req.fragment, req.round))
        if view is None:
            return
        with contextlib.suppress(Exception):
            key = self.match_key(req.fragment, req.round, slot_wide=req.schedule is not None)
            entries = await asyncio.wait_for(self.read_entries(key), 5.0)
            log.info("%s: fragment %d round %d: %s", failure, req.fragment, req.round,
                     view.explain({p: e.arrival for p, e in entries.items()}))

    async def matchmake(self, req: AverageRequest, banned: list[str]) -> Matched | None:
        """The round's members through the DHT (module docstring); None: this node is not one of them.
        ``banned``: whom this node keeps out of its rounds (its entry names them as excluded)."""
        key = self.match_key(req.fragment, req.round, slot_wide=req.schedule is not None)
        live = self.lone.live()
        not_banned = live - set(banned)
        own_expected = (not_banned - self.no_shows.skipped()) | {self.peer_id}
        own_window = self.window()
        me = match_entry(self.peer_id, req, get_dht_time(), banned, own_expected, own_window, self.certificate,
                         self.deviations.apart(), self.outbound_only(), self.dial_failures.peers())
        await self.dht.store(key, me.SerializeToString(), expiration_time=get_dht_time() + ENTRY_TTL_S,
                             subkey=self.subkey, return_future=True)
        core = (set(self.view.pace_peers()) | {self.peer_id}) & own_expected
        trusted = not_banned | {self.peer_id}
        grace = self.view.straggler_grace()
        grace = min(self.matchmaking_timeout if grace is None else grace, own_window)
        read: dict[str, swarm_pb2.MatchEntry] = {}
        while True:
            read.update(await self.read_entries(key))
            read.setdefault(self.peer_id, me)
            # members that closed their windows before this node came are not waited for, nor counted in its
            # window: they came (nobody waits for them) and formed the round without it (``closed_before``)
            closed = closed_before(read, self.peer_id)
            entries = {p: e for p, e in read.items() if p not in closed}
            wanted = awaited(own_expected, entries, trusted)
            timeout = agreed_window(own_window, entries, trusted)
            arrived = {peer_tag(p) for p in read} >= wanted
            # An entry's arrival is the peer's word: no earlier than the round's window before ours, so that nobody
            # can close the window for everyone by claiming an arrival in the past. The round's window, not our
            # own: a member with a shorter one otherwise started its window later than the others and kept a
            # member they had closed without (a grown window is every member's, ``agreed_window``).
            first = min(max(e.arrival, me.arrival - timeout) for e in entries.values())
            window_end = first + timeout
            now = get_dht_time()
            if arrived or now >= window_end:
                cut = "all expected" if arrived else "window"
                break
            if set(read) >= core and now >= first + grace:
                window_end = now  # stragglers are not waited for beyond the grace
                cut = "grace"
                break
            await asyncio.sleep(0.02 if set(read) >= core else 0.05)
        if not arrived:
            await asyncio.sleep(0.3)  # let stores that raced the deadline land, then read once more
            read.update(await self.read_entries(key))
            closed = closed_before(read, self.peer_id)
            entries = {p: e for p, e in read.items() if p not in closed}
        if closed:
            cut += f", without {len(closed)} that closed before this node came"
        self._background(self._record_no_shows(key, not_banned, live, first + timeout))
        if req.schedule is not None:
            try:
                hint = leader_schedule(self.peer_id, req, me, entries)
            except ValueError as e:
                self.book.refuse(min(entries), "bad_header", str(e))
            else:
                self.schedule_hint = hint or self.schedule_hint
            entries = {p: e for p, e in entries.items() if e.fragment == req.fragment}
        in_time = sorted(p for p, e in entries.items() if e.arrival <= window_end)
        members = shunned_dropped(in_time, entries)
        if self.peer_id in in_time and self.peer_id not in members:
            cut += SHUNNED_CUT
        expected = own_expected | {p for p in live | set(entries) if peer_tag(p) in wanted}
        self._keep_view(req.fragment, req.round, MatchView(members, expected, first, window_end, now, cut))
        if self.peer_id not in members:
            return None
        self._digests[(req.fragment, req.round)] = {p: bytes(entries[p].digest) for p in members}
        excluded = {p: list(entries[p].excluded)[:MAX_EXCLUDED] for p in members}
        bases = {p: bytes(entries[p].basis)[:MAX_BASIS_TAG] for p in members}
        doubted = {p: list(entries[p].doubted)[:MAX_EXCLUDED] for p in members}
        outbound = frozenset(p for p in members if entries[p].outbound_only)
        undialable = {p: list(entries[p].undialable)[:MAX_EXCLUDED] for p in members}
        return Matched(members, {p: int(entries[p].version) for p in members}, excluded, bases, doubted, outbound,
                       undialable)
