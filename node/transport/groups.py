"""Group formation: how the members of one round are split into averaging groups.

One rule for every transport (the swarm's matchmaking and the in-process hub of the simulator), so that
what the simulator measures is what the network runs.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from fractions import Fraction

PLACEMENT_TRIES = 32  # orders tried when bans conflict (members are few: cheap)
# One round in PROBE_EVERY of each fragment (drawn from the round's seed, the same on every member) gives a member
# that most of the others exclude the company of those that do not (``form_groups``), so that they judge it
# themselves. Why: left alone in every round, it was never met again by the one honest node that had not yet met
# it, and with only two other voters (3 honest + 1) their exclusions are no evidence that node follows
# (``locoswarm.node.swarm.offences.FOLLOWED_VOTERS``): a flipper was banned by 2 of 3 honest nodes for the whole
# 180 s window (robustness bench, 376bfaf). Rarer probes cost the prober less (a round with the suspect instead of
# with the others) but leave the ban later: in a pair the prober judges the suspect's contribution against its own
# (``Agreement.evidence_where``) and needs two such scores (``reputation.MIN_EVIDENCE``). Drawn by a hash, not by the
# round's number: a fragment's round numbers are swarm-clock steps some multiple of H apart, so a residue would
# probe in every round or in none.
PROBE_EVERY = 3


def form_groups(members: list[str], fragment: int, round_: int, group_size: int,
                excluded: Mapping[str, Iterable[str]] | None = None,
                outbound: Collection[str] = ()) -> list[list[str]]:
    """Balanced random groups, the same on every member that saw the same entries.

    ``outbound``: members peers cannot dial (behind NAT, ``locoswarm.node.swarm.reachability``). Every group
    gets a member that is not among them, where the round has any: all streams of a round go from a member to a
    reducer, and outbound-only members reduce no part, so two of them never need a connection with each other.
    Where the round has fewer dialable members than groups of ``group_size`` would need, groups are fewer and
    larger (a NAT-heavy swarm's public members reduce more parts) rather than some left with nobody to reduce;
    where it has none, every member is alone (its round fails at once instead of waiting on dials that cannot
    succeed).

    Groups have at most ``group_size`` members (3 members in pairs: 2 + 1, the lone one's round fails).
    Merging the lone member into a pair was tried: a group of 3 then waits for a member that formed no
    group of its own view (a joiner, an attacker) until the partial reduction, and an adversarial test
    run saw the honest pair stall for ~20 s per round that way; so the split stays at most group_size.

    ``excluded`` maps a member to the peers it bans: two peers of which one excludes the other are never
    in one group. Members are placed in shuffled order, each in the smallest group (of the balanced
    number) that has room and no conflict, else in a new group. Where bans conflict, that greedy pass is
    tried over ``PLACEMENT_TRIES`` orders drawn from the round's seed, and the placement that leaves the
    fewest members alone (their round fails), then makes the fewest groups, wins (the first on a tie): so
    a peer everyone bans ends up alone, a peer that bans everyone isolates only itself, and members whose
    bans disagree (one honest node banned a liar, the other not yet) still average together. With a
    single order, the liar banned by one honest member was often placed next to the other honest member
    first, and the first was left alone every such round (robustness bench, two colluding state liars:
    rounds failed by the dozen and the honest nodes ended 13-23% above the clean run). A member that most of
    the others exclude is left alone rather than given company (``majority_shunned``): among placements with the
    fewest others alone, the one that puts the fewest other members in a group with it wins. No member is
    placed last on purpose: a ban may be a liar's (a Sybil banning an honest node would then isolate it).
    Where someone must be alone, it is rather a member another member of the round excludes than one nobody
    does: with 2 honest members and 2 colluders, once one honest node had banned both colluders and the other
    only one, a round that held the first honest node, the second and the unbanned colluder left either the
    first honest node or the colluder alone, at random, so the second honest node averaged with the colluder
    in about half such rounds (robustness bench, `ipm x2`: its eval rose 26% for a while). A colluder can
    accuse an honest member too, which brings back only that coin toss.

    Except in a probe round (``is_probe_round``, one in ``PROBE_EVERY``): there a shunned member that has no
    conflict with some other member of the round is placed as any other member is, so it shares a group with (some of)
    those that do not exclude it, and they judge it by what it sends rather than by the others' word. A colluding
    partner that nobody excludes yet keeps it company in such rounds, out of the honest groups for that round.
    """
    seed = int.from_bytes(hashlib.blake2b(f"{fragment}:{round_}".encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    order = sorted(members)
    rng.shuffle(order)
    n_groups = max(1, -(-len(order) // group_size))
    unreachable = frozenset(outbound) & set(order)
    anchors = len(order) - len(unreachable)
    if unreachable and not anchors:
        return [[p] for p in sorted(order)]  # nobody to open a stream to: no group (each member's round fails)
    if unreachable:
        n_groups = min(n_groups, anchors)
        order = _dialable_first(order, unreachable)  # striped or placed first: one of them in every group
    if not excluded or not any(excluded.values()):
        return [sorted(order[g::n_groups]) for g in range(n_groups)]
    conflicts: dict[str, set[str]] = defaultdict(set)
    present = set(order)
    for peer, banned in excluded.items():
        for other in banned:
            if other in present and other != peer:
                conflicts[peer].add(other)
                conflicts[other].add(peer)
    capacity = -(-len(order) // n_groups)
    shunned = majority_shunned(order, excluded)
    if is_probe_round(fragment, round_):
        shunned = {p for p in shunned if all(p in conflicts[q] for q in present if q != p)}
    accused = {other for peer, banned in excluded.items() if peer in present for other in banned}
    best: list[list[str]] | None = None
    best_score = (len(order) + 1,) * 4
    for attempt in range(PLACEMENT_TRIES):
        if attempt:
            rng.shuffle(order)
            order = _dialable_first(order, unreachable)
        groups = _place(order, n_groups, capacity, conflicts, unreachable)
        alone = [g[0] for g in groups if len(g) == 1 and g[0] not in shunned]
        score = (len(alone), sum(1 for p in alone if p not in accused),
                 sum(1 for g in groups if shunned & set(g) for p in g if p not in shunned), len(groups))
        if score < best_score:
            best, best_score = groups, score
        if score[0] == 0 and score[2] == 0 and score[3] <= n_groups:
            break  # nothing can beat it
    assert best is not None
    return best


def is_probe_round(fragment: int, round_: int) -> bool:
    """Whether ``form_groups`` gives the round's shunned members company (``PROBE_EVERY``): a hash of the fragment
    and round, not a residue of the round's number (``PROBE_EVERY`` says why)."""
    digest = hashlib.blake2b(f"probe:{fragment}:{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % PROBE_EVERY == 0


def consensus_members(members: Sequence[str], versions: Mapping[str, int]) -> list[str]:
    """The members a consensus round (of outer states) averages: those at the version most of them hold (the
    newest of equally common ones). A member at another version is on the swarm's lineage at another point, or
    on another lineage; the mean of its phi and theirs is nobody's state, and a member behind catches up by a
    download anyway. Two joiners one version behind, behind NAT, once sent their whole stale state (4.5 MB each)
    into a consensus round at 5 Mbit/s: the two public reducers' links were full for 30 s, every node's training
    waited, and the NATed nodes refused the mean as pointing against their own progress. Members at the version
    are usually bit-equal, so the round then moves no bytes at all. A liar needs as many members at one claimed
    version as the honest ones have to take the round over, and what it takes is consensus rounds, not state."""
    counts: dict[int, int] = defaultdict(int)
    for peer in members:
        counts[versions.get(peer, -1)] += 1
    version = max(counts, key=lambda v: (counts[v], v))
    return [p for p in members if versions.get(p, -1) == version]


def majority_shunned(members: Sequence[str], excluded: Mapping[str, Iterable[str]], *,
                     ignore: Iterable[str] = (), min_voters: int = 1, share: Fraction = Fraction(1, 2)) -> set[str]:
    """The members that more than ``share`` (a strict majority by default) of the round's other members exclude,
    counting as voters only members not in ``ignore`` (and at least ``min_voters`` of them). A minority's
    exclusions shun nobody, so a liar cannot isolate an honest member.

    Placement leaves such a member alone rather than give it company: a colluder never bans its partner, and once
    the honest members banned one of two, the other was placed with it in every round to spare it a lone (failed)
    round, out of every honest member's groups, so no honest reducer judged it again and it went unbanned for
    minutes (robustness bench, 4 honest + 2 flippers). The swarm also bans such a member on its own evidence
    (``locoswarm.node.swarm.offences.majority_excluded``)."""
    skip = set(ignore)
    sets = {p: set(excluded.get(p, ())) for p in members}
    out = set()
    for peer in members:
        if peer in skip:
            continue
        voters = [m for m in members if m not in skip and m != peer]
        if len(voters) >= max(1, min_voters) and sum(1 for v in voters if peer in sets[v]) > share * len(voters):
            out.add(peer)
    return out


def _dialable_first(order: list[str], unreachable: frozenset[str]) -> list[str]:
    """``order`` with the members peers can dial first (each part's order kept)."""
    return [p for p in order if p not in unreachable] + [p for p in order if p in unreachable]


def _place(order: list[str], n_groups: int, capacity: int, conflicts: Mapping[str, set[str]],
           unreachable: frozenset[str] = frozenset()) -> list[list[str]]:
    """One greedy pass: each member, in ``order``, into the smallest of the groups with room and no conflict; an
    ``unreachable`` member only into a group that holds a dialable one (else alone)."""
    groups: list[list[str]] = [[] for _ in range(n_groups)]
    for peer in order:
        fits = [g for g in groups if len(g) < capacity and not conflicts.get(peer, set()) & set(g)
                and (peer not in unreachable or any(q not in unreachable for q in g))]
        if fits:
            min(fits, key=len).append(peer)
        else:
            groups.append([peer])
    return [sorted(g) for g in groups if g]


def kept_apart(excluded: Mapping[str, Iterable[str]], doubted: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """Whom each member must not share a group with: the peers it bans and the peers it mutes for their standing
    drift (``locoswarm.node.core.persistence.DeviationMemory.doubted``), for :func:`form_groups`.

    Why the doubted too: a reducer's mute keeps a drifter out of the parts it reduces, not out of the drifter's own
    part, which carries the pattern back in every round they share. With 2 honest nodes and 2 drifters each honest
    node muted both drifters in nearly every round of a group with them, and still went from 2.8 to 6.2 held-out
    loss within 15 s of such pair rounds, each round's step small enough to pass the effect check (robustness
    bench). A doubt separates only the doubter from the doubted, as a ban does, so colluders doubting honest
    members only keep themselves apart; it bans nobody and is not counted as a vote to ban."""
    out = {p: list(v) for p, v in excluded.items()}
    for peer, peers in doubted.items():
        out.setdefault(peer, []).extend(q for q in peers if q not in out[peer])
    return out


def route_around(members: Sequence[str], outbound: Collection[str], undialable: Mapping[str, Iterable[str]],
                 apart: Mapping[str, Iterable[str]]) -> tuple[frozenset[str], dict[str, list[str]]]:
    """The round's outbound-only members and whom each member must not share a group with, given the peers each
    member's dials failed to lately (``undialable``, ``locoswarm.node.swarm.dial_failures``).

    A member that a strict majority of the round's other members cannot dial is taken as outbound only: it
    reduces no part and nobody opens a stream to it, so it still averages (it dials out). Every other pair named
    is kept apart, added to ``apart`` (bans and doubts), as a ban keeps a pair apart; a pair with an outbound-only
    member needs no such care unless it is the outbound-only member that failed to dial (it must reach its
    reducers). Every member computes the same from the same entries."""
    present = set(members)
    named = {p: set(undialable.get(p, ())) & present - {p} for p in members}
    taken = (set(outbound) & present) | majority_shunned(members, named)
    return frozenset(taken), kept_apart(apart, {p: sorted(named[p] - taken) for p in members if named[p] - taken})


def group_basis(tags: Sequence[bytes]) -> bytes | None:
    """The basis a group's low-rank payloads must be projected on (``AverageRequest.basis``), given its members'
    tags in member order (sorted peer ids): None when they all agree (each member sends what it encoded), else
    the leader's (the first member's) tag, whose ranks every member re-encodes at, on the seeded basis of the
    round (``AverageRequest.reencode``). Every member computes the same answer from the same entries."""
    return None if all(t == tags[0] for t in tags) else tags[0]


__all__ = ["form_groups", "group_basis", "kept_apart", "majority_shunned", "route_around"]
