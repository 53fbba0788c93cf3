"""Which outer version of a fragment to believe, and whom to take it from.

A node catches up when peers hold a newer version of a fragment than it does, and a joiner downloads the
newest. A hostile peer can claim any version, and two colluders can corroborate each other. What a claim
must pass before a node acts on it:

1. **The swarm clock.** A fragment's version counts the outer steps applied to it, at most one per send slot
   of the fragment, and the slots are fixed by the swarm clock (``locoswarm.node.core.schedule``): at clock
   ``t`` no honest node holds more than :func:`version_bound` of them. The clock itself is the median of the
   live peers' validated clocks (``locoswarm.node.swarm.clock``), which a minority of liars cannot move. A
   claim above the bound is not believed; one far above it (:func:`absurd_version`) is an offence, since an
   honest node restarted from an old checkpoint may be somewhat ahead of a younger swarm's clock but never
   by a multiple of it.
2. **Corroboration.** The newest version that at least two claimants hold or exceed (one suffices when it
   is the only other peer: a pair cannot outvote a liar, and the effect check stands behind it).
3. **The majority's digest.** Heartbeats announce each fragment's phi and momentum digest
   (:func:`state_digest`). Of the holders of the chosen version, only those announcing the digest most of
   them announce are asked, and a download must match it: liars that hold the same version as the honest
   majority cannot serve another state under it.
4. **The effect check** (``locoswarm.node.core.judge``): a downloaded phi may not do worse on the node's
   own held-out batch than the phi it holds. What passes 1-3 but lies (colluders within the bound) is
   refused there, and its sources are blamed.
5. **What the claimant says in rounds** (:class:`RoundClaims`). Every contribution and reduced part a member
   streams names its version of the fragment, on its own authenticated stream. An honest member's version
   never falls below what its heartbeat claimed earlier: versions only grow, except where a member two or more
   versions ahead of its group takes the group's (``OuterLoop._follow_group``), and then it left the claimed
   version itself. A member whose rounds, after its heartbeat claimed version V, still name V - 2 or less was caught
   claiming a state it does not hold. For ``CAUGHT_S`` its claims above the version its rounds name, plus one,
   are not believed. A liar that claims a version it lacks and serves a state of its own making under it (a
   forged replay or a download whose digest it announces itself) passes 1-4 when that state is merely slower
   than the honest one. One node that took it then corroborated it for all the others, and the honest swarm
   followed the liar (robustness bench, ``replayliar``: 119 catch-ups from it in 180 s, +8.4%). Where the
   honest members do hold the version it claims, the claim stands, but a node downloads from the holders whose
   rounds back that version (``RoundClaims.backs``) where there are any: a download serves the holder's newest
   state, and a liar's newest is the one it made up. A holder whose round named two or more below that version
   within ``NAMED_RECENT_S`` is not asked at all (``RoundClaims.refutes``): two colluders corroborate each
   other's claims and may be its only holders. Holders never met in a round come after those whose rounds
   named the version (``RoundClaims.proves``): liars that just joined have no rounds to contradict them.
   A contradicted claim is not yet a lie: an honest member that follows its group claimed a version it held.
   But it held it, so its rounds named that version (or the one before) shortly before it dropped. A
   contradicted claim that none of the claimant's rounds backed, from ``LIE_MARGIN_S`` before the claim was first
   seen (dated from its heartbeat's publication, at most two heartbeat intervals before it was read) until it was
   contradicted, is a lie (``RoundClaims.lies``); ``LIES_BAN`` of them within ``CAUGHT_S``, over
   all fragments but ``LIES_IN_ONE`` in one of them, ban the claimant (``RoundClaims.liar``). A liar that claims two
   versions ahead of what it holds tells a new lie with each outer step of each fragment; an honest member drops
   that way only where its group is two versions behind, once per fragment, and then claims what it holds: it
   would have to do so unseen twice in one fragment, and a third time, within two minutes. Counted per fragment
   only, a replay liar of a 4 + 2 run was banned 9-17 s after its first forged claim (robustness bench, 13a8383).

A claim newer than the belief that nobody corroborates (``Belief.unconfirmed``) is not believed, but it is
not ignored either: the transport *probes* it now and then (one download from its claimant, judged by the
effect check like any other). A node that is a round ahead of the others gets followed; a lone liar within
the bound serves what it claims, and the effect check convicts it. Verify, don't trust, and never act on a
claim alone.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from locoswarm.node.core.state import state_digest  # the digest heartbeats announce

VERSION_SLACK = 2       # versions above the clock's count of send slots still believed (clocks differ by a step)
VERSION_ABSURD = 256    # a claim this far above twice the bound is a lie, not a restart: an offence
# A round that names a version this far below a heartbeat claim seen before it contradicts the claim (module
# docstring, 5): one less is a heartbeat published between the round's send and its stream.
CONTRADICTED_BY = 2
CAUGHT_S = 120.0        # how long a member caught contradicting its claims has them capped at its rounds' version + 1
# A contradicted claim is a lie (module docstring, 5) where no round of the member named the claimed version or the
# one before it since LIE_MARGIN_S before the claim was first seen (a heartbeat read late, published every 2 s by
# default, names a version its rounds did name just before); LIES_BAN lies within CAUGHT_S, LIES_IN_ONE of them in
# one fragment, ban.
LIE_MARGIN_S = 30.0
LIES_BAN = 3
LIES_IN_ONE = 2
NAMED_KEPT = 16          # the rounds' versions kept per (fragment, member) to tell a lie from a drop
# A holder whose round named 2 or more below the version to catch up to within this long holds a state of its own
# making there (``RoundClaims.refutes``); an older round says nothing of what it holds now (a node behind meets the
# others in no round, so what they named last can be far behind what they hold by now).
NAMED_RECENT_S = 15.0
MAX_ROUND_CLAIMS = 4096  # (fragment, member) pairs remembered


def version_bound(clock: int, h: int, sends_per_h: int = 1) -> int:
    """The most outer versions any fragment can hold at swarm clock ``clock``: one per send slot, at most
    ``sends_per_h`` slots of one fragment per ``h`` steps (1 on the fixed schedule; the adaptive one may pick
    a fragment in every slot), plus ``VERSION_SLACK``."""
    return max(0, int(clock)) * max(1, int(sends_per_h)) // max(1, int(h)) + 1 + VERSION_SLACK


def absurd_version(version: int, bound: int) -> bool:
    """Whether a claim of ``version`` is far beyond ``bound`` (module docstring, 1)."""
    return version > 2 * bound + VERSION_ABSURD


@dataclass(frozen=True)
class Claim:
    version: int
    digest: bytes = b""


@dataclass
class Belief:
    """The version to believe and the holders to take it from (``holders`` announce ``digest``); the claims
    newer than it that nobody corroborates, within the bound (peer -> claim: probed, module docstring)."""

    version: int = -1
    digest: bytes = b""
    holders: list[str] = field(default_factory=list)
    unconfirmed: dict[str, Claim] = field(default_factory=dict)


def believe(claims: Mapping[str, Claim], *, bound: int | None = None) -> Belief:
    """The newest corroborated version among ``claims`` (peer -> claim) at or below ``bound``, and the holders of
    it that announce the digest most of its holders announce (module docstring, 1-3)."""
    kept = {p: c for p, c in claims.items() if bound is None or c.version <= bound}
    if not kept:
        return Belief()
    versions = sorted((c.version for c in kept.values()), reverse=True)
    version = versions[0] if len(kept) < 2 else versions[1]
    holders = [p for p, c in kept.items() if c.version == version]
    counts = Counter(kept[p].digest for p in holders)
    # the most holders; ties broken by the digest's bytes, so every node picks the same one
    digest = max(counts, key=lambda d: (counts[d], d))
    return Belief(version, digest, sorted(p for p in holders if kept[p].digest == digest),
                  {p: c for p, c in kept.items() if c.version > version})


def plausible_version(claims: Mapping[str, int], own: str | None = None, *, bound: int | None = None) -> int:
    """The newest version that is corroborated: claimed (or exceeded) by at least two peers, one of
    which may be this node (``own``), at or below ``bound``. With a single other claimant its claim stands:
    a pair cannot outvote a liar, and the snapshot guards bound what a liar can do. -1 without claims."""
    kept = {p: v for p, v in claims.items() if bound is None or v <= bound}
    if not kept:
        return -1
    values = sorted(kept.values(), reverse=True)
    if sum(1 for p in kept if p != own) < 2:
        return values[0]
    return values[1]


__all__ = ["LIES_BAN", "LIES_IN_ONE", "Belief", "Claim", "RoundClaims", "absurd_version", "believe",
           "plausible_version", "state_digest", "version_bound"]


class RoundClaims:
    """The version each member's rounds named last, per fragment, held against its heartbeat claims (module
    docstring, 5). ``record`` is called with what an authenticated stream's header says, ``doubted`` with each
    heartbeat claim as the node reads it (the first read of a claim is when it was seen)."""

    def __init__(self, max_pairs: int = MAX_ROUND_CLAIMS) -> None:
        self._named: OrderedDict[tuple[int, str], deque[tuple[int, float]]] = OrderedDict()  # newest last
        self._claimed: OrderedDict[tuple[int, str], tuple[int, float]] = OrderedDict()
        self._caught: dict[tuple[int, str], float] = {}
        self._lies: dict[tuple[int, str], dict[int, float]] = {}  # claim -> when it was found a lie
        self.max_pairs = max_pairs

    def record(self, fragment: int, member: str, version: int, now: float | None = None) -> None:
        key = (fragment, member)
        self._named.setdefault(key, deque(maxlen=NAMED_KEPT)).append(
            (int(version), time.monotonic() if now is None else now))
        self._keep(self._named, key)

    def _keep(self, table: OrderedDict[tuple[int, str], Any], key: tuple[int, str]) -> None:
        """``key`` as the newest of ``table``, which keeps ``max_pairs`` (the oldest go first)."""
        table.move_to_end(key)
        while len(table) > self.max_pairs:
            old, _ = table.popitem(last=False)
            self._caught.pop(old, None)
            self._lies.pop(old, None)

    def doubted(self, fragment: int, member: str, claim: int, now: float | None = None,
                published: float | None = None) -> bool:
        """Whether ``member``'s heartbeat claim of version ``claim`` of ``fragment`` is contradicted by a round it
        named a version in after the claim was first seen, or it was caught so lately and claims more than its
        rounds' version + 1.

        ``published``: when the heartbeat says it was published (on the clock of ``now``; the caller bounds how
        far back), taken as the time the claim was seen where it is earlier than ``now``. Why: a liar two versions
        ahead of its state tells the truth two outer steps later, and with heartbeats read every 2 s its rounds
        had often reached the claim before this node read it: a 3 + 1 replay liar took 28-37 rounds to its three
        lies (robustness bench, 816bea5 and da2dc71). A heartbeat dated ahead of ``now`` is seen ``now``, so
        dating it late gains a liar nothing over being read late."""
        now = time.monotonic() if now is None else now
        key = (fragment, member)
        if self._claimed.get(key, (None, 0.0))[0] != claim:
            self._claimed[key] = (int(claim), now if published is None else min(now, published))
        self._keep(self._claimed, key)
        seen = self._claimed[key][1]
        named = self._named.get(key)
        if not named:
            return False
        # contradicted by the first round after the claim was seen that named two or more below it, even where a
        # later round named more (a liar's next outer step: asked only then, its claim looked backed)
        contradicting = [t for v, t in named if t > seen and v <= claim - CONTRADICTED_BY]
        if contradicting:
            self._caught[key] = max(self._caught.get(key, -math.inf), contradicting[-1])
            if not any(v >= claim - 1 and seen - LIE_MARGIN_S <= t <= contradicting[0] for v, t in named):
                lies = self._lies.setdefault(key, {})
                for old in [c for c, t in lies.items() if now - t >= CAUGHT_S]:
                    del lies[old]
                lies.setdefault(int(claim), now)
        caught = now - self._caught.get(key, -math.inf) < CAUGHT_S
        return caught and claim > named[-1][0] + 1

    def lies(self, fragment: int, member: str, now: float | None = None) -> int:
        """How many of ``member``'s claims of ``fragment`` were found lies within ``CAUGHT_S`` (module docstring,
        5): claims its rounds contradicted and never backed."""
        now = time.monotonic() if now is None else now
        return sum(1 for t in self._lies.get((fragment, member), {}).values() if now - t < CAUGHT_S)

    def liar(self, member: str, now: float | None = None) -> dict[int, int]:
        """``member``'s lies within ``CAUGHT_S`` per fragment (:meth:`lies`) where they ban it: ``LIES_BAN`` in
        all, ``LIES_IN_ONE`` of them in one fragment (module docstring, 5); else an empty dict."""
        now = time.monotonic() if now is None else now
        counts = {f: n for (f, m) in self._lies if m == member and (n := self.lies(f, member, now))}
        if sum(counts.values()) >= LIES_BAN and max(counts.values()) >= LIES_IN_ONE:
            return dict(sorted(counts.items()))
        return {}

    def lied(self, member: str, now: float | None = None) -> bool:
        """Whether any claim of ``member``'s was found a lie within ``CAUGHT_S``: this node's own evidence for
        following the others' ban of it (``OffenceBook.follow_majority_bans``)."""
        now = time.monotonic() if now is None else now
        return any(member == m and any(now - t < CAUGHT_S for t in lies.values())
                   for (_, m), lies in self._lies.items())

    def refutes(self, fragment: int, member: str, version: int, now: float | None = None) -> bool:
        """Whether ``member``'s round of the last ``NAMED_RECENT_S`` named ``version`` - 2 or less: it does not
        hold ``version`` (or did not until a moment ago), whatever its heartbeat says."""
        named = self._named.get((fragment, member))
        recent = bool(named) and (time.monotonic() if now is None else now) - named[-1][1] < NAMED_RECENT_S
        return recent and not self.backs(fragment, member, version)

    def proves(self, fragment: int, member: str, version: int) -> bool:
        """Whether ``member``'s rounds of ``fragment`` named ``version`` or the one before it last: seen to hold it,
        not merely never contradicted (:meth:`backs`)."""
        named = self._named.get((fragment, member))
        return bool(named) and named[-1][0] >= version - 1

    def backs(self, fragment: int, member: str, version: int) -> bool:
        """Whether what ``member``'s rounds named last of ``fragment`` backs its holding ``version``: at least the
        version before it (a round since merged), or nothing named yet."""
        return (fragment, member) not in self._named or self.proves(fragment, member, version)

    def caught(self, now: float | None = None) -> list[tuple[int, str]]:
        """The (fragment, member) pairs caught within ``CAUGHT_S`` (for status displays and tests)."""
        now = time.monotonic() if now is None else now
        return sorted(k for k, t in self._caught.items() if now - t < CAUGHT_S)
