"""The averaging protocol's pure rules: grouping with exclusions, corroborated versions, and one
reducer session (screening, refusals, partial reduction) driven on an event loop without a network."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.payload import chunk_bounds, decode_chunks, encode_chunks
from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.swarm.averaging import (
    FLOOD_REFUSALS,
    StreamFloods,
    idle_reducers,
    plausible_version,
)
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.exchange import Exchange, Reduction, group_hash
from locoswarm.node.swarm.judging import (
    SPREAD_BAN_OTHER_PHI,
    SPREAD_WINDOW,
    UNLINED_HARM,
    PartJudge,
    PartRefused,
    PartResult,
    SourcePauses,
)
from locoswarm.node.swarm.matchmaking import (
    NO_SHOW_ROUNDS,
    STATED_WINDOW_SPREAD,
    MatchView,
    NoShows,
    agreed_window,
    awaited,
    match_entry,
    peer_tag,
)
from locoswarm.node.swarm.offences import (
    FOLLOWED_EVIDENCE,
    FOLLOWED_OFFENCES,
    FOLLOWED_SHARE,
    FOLLOWED_SPREAD,
    FOLLOWED_VOTERS,
    SPREAD_BAN,
    OffenceBook,
    majority_excluded,
)
from locoswarm.node.swarm.reputation import EveryNth, Reputation
from locoswarm.node.swarm.versions import RoundClaims
from locoswarm.node.transport.groups import PROBE_EVERY, consensus_members, form_groups, is_probe_round, kept_apart
from locoswarm.node.transport.reduce import PartContribution
from locoswarm.protocol import swarm_pb2
from tests.stand_ins import catch_up, exchange

PEERS = [f"Qm{c}" for c in "abcdefghij"]


@pytest.mark.parametrize(("n", "size"), [(2, 2), (4, 2), (5, 2), (7, 3), (10, 4), (10, 10), (8, 3)])
def test_groups_without_exclusions_are_balanced_partitions(n: int, size: int) -> None:
    groups = form_groups(PEERS[:n], 1, 7, size)
    assert sorted(itertools.chain(*groups)) == sorted(PEERS[:n])
    assert max(map(len, groups)) <= size and max(map(len, groups)) - min(map(len, groups)) <= 1
    assert groups == form_groups(list(reversed(PEERS[:n])), 1, 7, size)  # order of arrival is irrelevant


def test_a_consensus_round_averages_the_members_at_the_version_most_of_them_hold() -> None:
    """Two members behind (joiners one version late) sit out, whatever the order; a tie goes to the newer version;
    a lone liar's claim takes nothing over; a member with no claim counts as version -1."""
    a, b, c, d = PEERS[:4]
    assert consensus_members([a, b, c, d], {a: 5, b: 5, c: 4, d: 5}) == [a, b, d]
    assert consensus_members([d, c, b, a], {a: 4, b: 4, c: 5, d: 5}) == [d, c]  # tie: the newer
    assert consensus_members([a, b, c], {a: 7, b: 7, c: 10**9}) == [a, b]
    assert consensus_members([a, b, c], {a: 3, b: 3}) == [a, b]
    assert consensus_members([a], {a: 0}) == [a]


def test_a_behind_member_sits_out_an_in_process_consensus_round_and_the_others_move_no_bytes() -> None:
    from locoswarm.node.core.transport import NOT_AT_CONSENSUS_VERSION, AverageRequest
    from locoswarm.node.transport.inprocess import InProcessHub

    codec = get_codec("fp32")
    hub = InProcessHub(codec, 4, robust=RobustSection())
    same, stale = torch.ones(8), torch.zeros(8)
    handles = []
    for w, (state, version) in enumerate([(same, 3), (same, 3), (stale, 2), (same, 3)]):
        handles.append(hub.transport(w).start_average(AverageRequest(
            fragment=4, round=9, chunks=encode_chunks(codec, state), numel=8, weight=1.0, version=version,
            codec="fp32", digest=bytes([version]))))
    hub.flush()
    results = [h.result(timeout=1) for h in handles]
    assert not results[2].ok and NOT_AT_CONSENSUS_VERSION in results[2].error
    for r in (results[0], results[1], results[3]):
        assert r.ok and r.average is None and r.group_size == 3 and r.bytes_sent == 0


def test_each_in_process_members_own_part_carries_the_others_contributions_to_it_not_in_a_pair() -> None:
    """``PartOrigin.shares``: a member's own part names every other member's contribution to that range, decoded
    (what the outer loop judges alone when the round is refused); the other parts and a pair's carry none."""
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.transport.inprocess import InProcessHub

    codec = get_codec("fp32", 64)
    for n in (3, 2):
        hub = InProcessHub(codec, n, robust=RobustSection())
        deltas = [torch.randn(8 * 1024, generator=torch.Generator().manual_seed(w)) for w in range(n)]
        handles = [hub.transport(w).start_average(AverageRequest(
            fragment=0, round=1, chunks=encode_chunks(codec, d), numel=8 * 1024, weight=1.0, version=1, codec="fp32"))
            for w, d in enumerate(deltas)]
        hub.flush()
        for w, h in enumerate(handles):
            res = h.result(timeout=1)
            assert res.ok and res.group_size == n
            own = [p for p in res.parts if p.reducer == f"w{w:06d}"]
            assert len(own) == 1 and all(not p.shares for p in res.parts if p is not own[0])
            if n == 2:
                assert not own[0].shares
                continue
            a, b = own[0].start, own[0].end
            assert sorted(s.member for s in own[0].shares) == sorted(f"w{k:06d}" for k in range(n) if k != w)
            for share in own[0].shares:
                assert torch.equal(share.values, deltas[int(share.member[1:])][a:b]) and share.same_lineage


def test_the_swarm_reducers_own_part_names_each_accepted_members_contribution_decoded() -> None:
    """``Exchange.member_shares``: the contributions this node's session reduced, decoded over its part's
    range, each with whether it came from this node's phi; not its own, not a refused one; none in a pair (unless
    another member of the round excludes the partner), for a round of phi itself or of low-rank coefficients, or
    while the reduction has not finished."""
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.exchange import Reduced

    codec, numel = get_codec("fp32", 64), 8 * 1024
    bounds = chunk_bounds(numel, 64)
    part = range(4, 8)
    lo, hi = bounds[part.start][0], bounds[part.stop - 1][1]
    deltas = {m: torch.randn(numel, generator=torch.Generator().manual_seed(k))
              for k, m in enumerate(["QmMe", "QmB", "QmC", "QmBad"])}
    encoded = {m: encode_chunks(codec, d) for m, d in deltas.items()}

    async def session(members: list[str], finished: bool = True, accused: tuple[str, ...] = ()) -> SimpleNamespace:
        done = asyncio.get_running_loop().create_future()
        if finished:
            done.set_result(Reduced({}, 3.0, [], {"QmBad": ("bad_weight", "too heavy", False)}))
        return SimpleNamespace(members=members, part=part, done=done, lineages={"QmMe": 7, "QmB": 7, "QmC": 9},
                               accused=frozenset(accused),
                               contributions={m: (PartContribution(m, 1.0, {c: encoded[m][c] for c in part}), [])
                                              for m in members})

    shares_of = exchange(codec, peer_id="QmMe").member_shares
    req = AverageRequest(fragment=0, round=1, chunks=encoded["QmMe"], numel=numel, weight=1.0, version=1,
                         lineage=7)
    group = asyncio.run(session(["QmMe", "QmB", "QmC", "QmBad"]))
    shares = shares_of(group, req, codec, bounds)
    assert [(s.member, s.same_lineage) for s in shares] == [("QmB", True), ("QmC", False)]
    for share in shares:
        assert torch.equal(share.values, deltas[share.member][lo:hi])
    pair = asyncio.run(session(["QmMe", "QmB"]))
    assert shares_of(pair, req, codec, bounds) == ()
    accused_pair = asyncio.run(session(["QmMe", "QmB"], accused=("QmB",)))  # another member of the round excludes it
    assert [s.member for s in shares_of(accused_pair, req, codec, bounds)] == ["QmB"]
    running = asyncio.run(session(["QmMe", "QmB", "QmC"], finished=False))
    assert shares_of(running, req, codec, bounds) == ()
    assert shares_of(group, replace(req, digest=b"phi"), codec, bounds) == ()
    assert shares_of(group, replace(req, basis=b"ranks"), codec, bounds) == ()


def test_holders_are_asked_in_an_order_of_the_downloader_own() -> None:
    """Rendezvous order: a permutation, stable per downloader and fragment, different between downloaders (so
    that two nodes catching up at once do not both start with the first holder listed)."""
    from locoswarm.node.swarm.catchup import holder_order

    holders = PEERS[:4]
    orders = {own: holder_order(own, 0, holders) for own in PEERS[4:]}
    assert all(sorted(o) == sorted(holders) for o in orders.values())
    assert holder_order(PEERS[4], 0, list(reversed(holders))) == orders[PEERS[4]]
    assert len({o[0] for o in orders.values()}) >= 2, orders


@pytest.mark.parametrize("round_", range(12))
def test_a_banned_peer_never_shares_a_group_with_who_bans_it(round_: int) -> None:
    members = PEERS[:5]
    banned = "Qmc"
    excluded = {p: [banned] for p in members if p != banned}
    groups = form_groups(members, 0, round_, 5, excluded)
    assert sorted(itertools.chain(*groups)) == sorted(members)
    assert [banned] in groups                      # everyone bans it: it is alone
    assert sorted(p for p in members if p != banned) in groups   # the honest four still average together


@pytest.mark.parametrize("round_", range(12))
def test_a_doubted_peer_never_shares_a_group_with_its_doubter_and_a_liars_doubts_split_no_honest_pair(
        round_: int) -> None:
    """Placement keeps a member apart from the peers it mutes for their standing drift (``kept_apart``), as from
    those it bans: 2 honest members doubting 2 drifters average only with each other; drifters that doubt the
    honest members back keep only themselves apart."""
    h1, h2, d1, d2 = PEERS[:4]
    doubted = {h1: [d1, d2], h2: [d1, d2], d1: [h1, h2], d2: [h1, h2]}
    for size in (2, 4):
        groups = form_groups([h1, h2, d1, d2], 0, round_, size, kept_apart({}, doubted))
        assert sorted([h1, h2]) in groups, groups
        assert not any({h1, h2} & set(g) and {d1, d2} & set(g) for g in groups), groups
    apart = kept_apart({h1: [d1]}, {h1: [d1, d2], h2: [d2]})
    assert apart == {h1: [d1, d2], h2: [d2]}


@pytest.mark.parametrize("round_", range(12))
def test_a_peer_that_bans_everyone_isolates_only_itself(round_: int) -> None:
    members = PEERS[:4]
    liar = "Qmb"
    groups = form_groups(members, 0, round_, 4, {liar: [p for p in members if p != liar]})
    assert [liar] in groups and sorted(p for p in members if p != liar) in groups


@pytest.mark.parametrize("size", [2, 8])
def test_members_whose_bans_disagree_still_average_together(size: int) -> None:
    """Two honest members, two colluding liars: one honest member banned both liars, the other only one
    so far. Every round the honest pair shares a group (with one order of placement only, the second
    liar was often placed with the slower honest member first and the other was left alone)."""
    honest0, honest1, liar0, liar1 = "QmH0", "QmH1", "QmL0", "QmL1"
    excluded = {honest0: [liar0], honest1: [liar0, liar1]}
    for round_ in range(60):
        groups = form_groups([honest0, honest1, liar0, liar1], 1, round_, size, excluded)
        assert [honest0, honest1] in groups, (round_, groups)
        assert sorted(itertools.chain(*groups)) == sorted([honest0, honest1, liar0, liar1])


def test_where_someone_must_be_alone_it_is_a_member_another_one_excludes() -> None:
    """Two honest members and a colluder: honest0 bans the colluder, honest1 does not yet. One of honest0 and the
    colluder must be alone; a coin toss left honest0 alone in about half the rounds, and honest1 averaged with the
    colluder. An accusation against honest0 by the colluder brings back only the coin toss."""
    honest0, honest1, colluder = "QmH0", "QmH1", "QmC"
    members = [honest0, honest1, colluder]
    for round_ in range(40):
        assert [colluder] in form_groups(members, 0, round_, 8, {honest0: [colluder]}), round_
    counter = {honest0: 0, colluder: 0}
    for round_ in range(200):
        groups = form_groups(members, 0, round_, 8, {honest0: [colluder], colluder: [honest0]})
        counter[next(g[0] for g in groups if len(g) == 1)] += 1
    assert min(counter.values()) > 50, counter


@pytest.mark.parametrize("round_", range(20))
def test_a_peer_most_members_ban_is_left_alone_not_given_its_partners_company(round_: int) -> None:
    """Four honest members banned one of two colluders: the other colluder (banned by nobody yet) stays in the
    honest members' group, where their reducers keep judging it, instead of keeping the banned one company out
    of their reach. A single liar's exclusion of an honest member shuns nobody."""
    honest = ["QmH0", "QmH1", "QmH2", "QmH3"]
    banned, partner = "QmF0", "QmF1"
    members = [*honest, banned, partner]
    groups = form_groups(members, 0, round_, 8, {h: [banned] for h in honest})
    if is_probe_round(0, round_):  # the one that does not exclude it judges it itself
        assert sorted([banned, partner]) in groups and honest in groups, groups
    else:
        assert [banned] in groups and sorted([*honest, partner]) in groups, groups
    groups = form_groups(["QmH0", "QmH1", "QmH2", "QmL"], 0, round_, 8, {"QmL": ["QmH0"]})
    assert ["QmH0"] not in groups and not any({"QmH0", "QmL"} <= set(g) for g in groups), groups


def test_a_member_that_has_not_judged_a_shunned_peer_meets_it_in_probe_rounds_only() -> None:
    """3 honest + 1: two honest members banned the flipper, the third has no evidence of its own and two voters
    are too few to follow. Left alone in every round, the flipper was never met by the third again (robustness
    bench: banned by 2 of 3 for 180 s). In a probe round the third is grouped with it (and judges it); in other
    rounds it averages with the honest pair and the flipper is alone. Once all three exclude it, no probe gives it
    company. Probes come in about one round in PROBE_EVERY, at most 4 * PROBE_EVERY rounds apart over these 200
    rounds of each fragment (numbered as swarm-clock steps 8 apart)."""
    honest0, honest1, third, flipper = "QmH0", "QmH1", "QmH2", "QmX"
    members = [honest0, honest1, third, flipper]
    excluded = {honest0: [flipper], honest1: [flipper]}
    for fragment in range(2):
        probes = []
        for round_ in range(fragment * 4, 1600, 8):
            groups = form_groups(members, fragment, round_, 4, excluded)
            if is_probe_round(fragment, round_):
                probes.append(round_)
                assert sorted([third, flipper]) in groups and [honest0, honest1] in groups, groups
            else:
                assert [flipper] in groups and [honest0, honest1, third] in groups, groups
            everyone = form_groups(members, fragment, round_, 4, {**excluded, third: [flipper]})
            assert [flipper] in everyone and [honest0, honest1, third] in everyone, everyone
        assert 200 / PROBE_EVERY / 2 < len(probes) < 200 / PROBE_EVERY * 2, probes
        assert max(b - a for a, b in itertools.pairwise([-8, *probes])) <= 4 * PROBE_EVERY * 8, probes


def test_the_placement_is_the_same_on_every_member_whatever_order_it_saw() -> None:
    members = PEERS[:7]
    excluded = {"Qma": ["Qmb"], "Qmc": ["Qmb", "Qmd"], "Qmb": ["Qme"]}
    for round_ in range(20):
        assert form_groups(members, 0, round_, 8, excluded) == form_groups(members[::-1], 0, round_, 8, excluded)


def test_exclusions_never_put_a_conflicting_pair_together() -> None:
    members = PEERS[:8]
    excluded = {"Qma": ["Qmb", "Qmc"], "Qmd": ["Qma"], "Qmh": ["Qmg"]}
    for round_ in range(40):
        for group in form_groups(members, 2, round_, 2, excluded):
            for peer, banned in excluded.items():
                assert not (peer in group and set(banned) & set(group)), (round_, group)


def test_a_live_peer_that_keeps_missing_rounds_is_no_longer_waited_for() -> None:
    shows = NoShows()
    live = {"Qma", "Qmb", "Qmc"}
    for _ in range(NO_SHOW_ROUNDS - 1):
        shows.record(live, {"Qma", "Qmb"}, live)
        assert shows.skipped() == set()  # one missed round is bad luck
    shows.record(live, {"Qma", "Qmb"}, live)
    assert shows.skipped() == {"Qmc"}
    shows.record(live, {"Qma", "Qmb", "Qmc"}, live)  # it came to a round: waited for again
    assert shows.skipped() == set()
    for _ in range(NO_SHOW_ROUNDS):
        shows.record(live, {"Qma"}, live)
    assert shows.skipped() == {"Qmb", "Qmc"}
    shows.record({"Qma", "Qmb"}, {"Qma"}, {"Qma", "Qmb"})  # Qmc left the swarm: forgotten
    assert shows.skipped() == {"Qmb"}
    shows.record(set(), {"Qma"}, {"Qma", "Qmb"})  # a round that waited for nobody (all skipped or banned)
    assert shows.skipped() == {"Qmb"}


def test_a_match_view_explains_which_members_another_view_may_have_had() -> None:
    view = MatchView(["QmAAAAAAa", "QmBBBBBBb"], {"QmAAAAAAa", "QmBBBBBBb", "QmCCCCCCc", "QmDDDDDDd"},
                     first=100.0, window_end=103.0, decided=101.5, cut="grace")
    line = view.explain({"QmAAAAAAa": 100.0, "QmBBBBBBb": 100.4, "QmCCCCCCc": 101.0, "QmEEEEEEe": 104.0})
    assert "formed [AAAAAa BBBBBb] (grace, 1.50 s after the first arrival)" in line
    assert "arrived late [EEEEEe+1.0s]" in line and "in time but unseen then [CCCCCc]" in line
    assert "never [DDDDDd]" in line
    # without a DHT read: what kept a lone member waiting
    alone = MatchView(["QmAAAAAAa"], {"QmAAAAAAa", "QmCCCCCCc"}, first=100.0, window_end=113.0, decided=113.0,
                      cut="window")
    assert alone.summary() == ("closed 13.0 s after the first arrival (window), window 13.0 s; members 1, "
                               "awaited in vain [CCCCCc]")


def test_members_wait_for_whom_any_trusted_member_expects() -> None:
    """A joiner that does not see honest1's heartbeat yet (or skips it as a no-show) still waits for it
    when honest0's entry expects it, so both close the round on one member list; a banned member's list,
    and a peer the list does not name, are not waited for."""
    from locoswarm.node.core.transport import AverageRequest

    req = AverageRequest(fragment=0, round=40, chunks=[], weight=1.0, numel=0, codec="fp4", version=3)
    honest0, honest1, joiner, liar = "QmH0", "QmH1", "QmJ", "QmL"
    entries = {honest0: match_entry(honest0, req, 10.0, expected={honest0, honest1, joiner}),
               joiner: match_entry(joiner, req, 10.1, expected={honest0, joiner}),
               liar: match_entry(liar, req, 10.2, expected={"QmMadeUp"})}
    assert list(entries[honest0].expected) == sorted([peer_tag(honest1), peer_tag(joiner)])  # not itself
    joiner_waits = awaited({honest0, joiner}, entries, trusted={honest0, joiner})
    assert joiner_waits == {peer_tag(p) for p in (honest0, honest1, joiner)}
    assert not {peer_tag(p) for p in entries} >= joiner_waits      # honest1 has not entered yet
    entries[honest1] = match_entry(honest1, req, 10.3, expected={honest0})
    assert {peer_tag(p) for p in entries} >= awaited({honest0, joiner}, entries, trusted={honest0, joiner})
    # the liar is live and not banned: its made-up peer is waited for (until the window ends); banned: not
    assert peer_tag("QmMadeUp") in awaited({joiner}, entries, trusted={honest0, joiner, liar})
    assert peer_tag("QmMadeUp") not in awaited({joiner}, entries, trusted={honest0, joiner})


def test_plausible_version_needs_a_second_claimant() -> None:
    assert plausible_version({}) == -1
    assert plausible_version({"a": 5}) == 5
    assert plausible_version({"a": 5, "liar": 1005}) == 5           # heartbeats: two others disagree
    assert plausible_version({"me": 5, "liar": 1005}, own="me") == 1005  # a pair cannot outvote
    assert plausible_version({"me": 5, "b": 6, "liar": 1005}, own="me") == 6
    assert plausible_version({"me": 5, "b": 1005, "c": 1005}, own="me") == 1005


# ---- one reducer session ----------------------------------------------------------------------------

CODEC = get_codec("fp4", 64)


class _RecordingBook(OffenceBook):
    """An offence book that also lists each refusal as ``("peer:kind", offence)``."""

    def __init__(self, reputation: Reputation | None = None) -> None:
        super().__init__("QmMe", reputation, RoundClaims())
        self.calls: list[tuple[str, bool]] = []

    def refuse(self, peer: str, kind: str, detail: str, *, offence: bool = True, conclusive: bool = False,
               forgivable: bool = True) -> None:
        self.calls.append((f"{peer}:{kind}", offence))
        super().refuse(peer, kind, detail, offence=offence, conclusive=conclusive, forgivable=forgivable)


def _part_judge(reputation: Reputation | None = None, *, book: OffenceBook | None = None,
                robust: RobustSection | None = None, pauses: SourcePauses | None = None, **kwargs) -> PartJudge:
    """Node QmMe's judge as ``SwarmTransport`` builds it, on ``reputation``."""
    book = book if book is not None else OffenceBook("QmMe", reputation, RoundClaims())
    return PartJudge("QmMe", reputation, book, robust or RobustSection(),
                     pauses if pauses is not None else SourcePauses(), **kwargs)
NUMEL = 3000


def _contribution(sender: str, values: torch.Tensor, weight: float = 100.0) -> PartContribution:
    return PartContribution(sender, weight, dict(enumerate(encode_chunks(CODEC, values))))


def _session(members: list[str], settings: RobustSection | None = None) -> Reduction:
    bounds = chunk_bounds(NUMEL, CODEC.block_size)
    sizes = {c: b - a for c, (a, b) in enumerate(bounds)}
    return Reduction((0, 1, b"h"), members[0], CODEC, members, range(len(bounds)), sizes,
                     settings or RobustSection(), consensus=False)


COMMON = torch.randn(NUMEL, generator=torch.Generator().manual_seed(12345))


def _honest(seed: int) -> torch.Tensor:
    """An honest member's progress: the swarm's common direction plus its own noise (they agree, as the
    pseudo-gradients of members training one model do: agreement about +0.3 on the tiny presets)."""
    return (COMMON + torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))) * 0.01


def _reduced(session: Reduction) -> torch.Tensor:
    res = session.done.result()
    return decode_chunks(CODEC, [res.chunks[c] for c in sorted(res.chunks)], NUMEL)


def test_a_poisoned_contribution_is_dropped_and_the_round_completes() -> None:
    async def run() -> None:
        members = ["me", "h1", "h2", "bad"]
        s = _session(members)
        s.add(_contribution("me", _honest(0)), [])
        s.add(_contribution("h1", _honest(1)), [])
        s.add(_contribution("h2", _honest(2)), [])
        assert not s.done.done()
        s.add(_contribution("bad", torch.full((NUMEL,), 1e30), weight=1e30), [])
        res = s.done.result()
        assert "bad" in res.refused and set(res.refused) == {"bad"}
        avg = _reduced(s)
        assert bool(torch.isfinite(avg).all())
        assert float(avg.norm()) < 2 * float(_honest(0).norm())
    asyncio.run(run())


def test_the_side_vector_is_summed_over_the_accepted_members() -> None:
    async def run() -> None:
        s = _session(["me", "h1", "bad"])
        s.n_extras = 2
        s.add(_contribution("me", _honest(0), weight=10.0), [0.5, 0.0])
        s.add(_contribution("h1", _honest(1), weight=90.0), [0.0, 0.25])
        s.add(_contribution("bad", torch.full((NUMEL,), 1e30)), [100.0, 100.0])  # refused: its R is not summed
        res = s.done.result()
        assert set(res.refused) == {"bad"}
        assert res.extras == [0.5, 0.25]  # CoCoDC sums R over the group (a weighted mean: 0.05, 0.225)
    asyncio.run(run())


def test_a_member_that_never_sends_is_dropped_by_the_partial_reduction() -> None:
    async def run() -> None:
        s = _session(["me", "h1", "silent"])
        s.add(_contribution("me", _honest(0)), [])
        s.add(_contribution("h1", _honest(1)), [])
        assert not s.done.done()
        s.reduce_partial()
        res = s.done.result()
        assert "silent" in s.dropped and res.total_weight == pytest.approx(200.0)
        s.add(_contribution("silent", _honest(2)), [])   # too late: ignored, the result stands
        assert s.done.result() is res
    asyncio.run(run())


def test_a_session_with_only_its_own_part_fails_rather_than_averaging_alone() -> None:
    async def run() -> None:
        s = _session(["me", "other"])
        s.add(_contribution("me", _honest(0)), [])
        s.drop("other", "it formed another group")
        with pytest.raises(RuntimeError, match="no other member"):
            s.done.result()
    asyncio.run(run())


def test_claimed_weight_is_bounded_by_max_weight() -> None:
    async def run() -> None:
        s = _session(["me", "h1", "greedy"])
        s.add(_contribution("me", _honest(0)), [])
        s.add(_contribution("h1", _honest(1)), [])
        big = _contribution("greedy", _honest(2), weight=390.0)
        big.max_weight = 150.0
        s.add(big, [])
        res = s.done.result()
        assert res.total_weight <= 100 + 100 + 150 + 1e-6 and not res.refused
    asyncio.run(run())


def test_a_norm_far_above_the_groups_has_no_pull_and_is_not_refused() -> None:
    """20x the group's norm: an honest member's carry can be that far off, so it is not refused (its round does
    not fail, nobody blames it) but it has no pull; the part is the others' mean."""
    async def run() -> tuple:
        s = _session(["me", "h1", "big"])
        s.add(_contribution("me", _honest(0)), [])
        s.add(_contribution("h1", _honest(1)), [])
        s.add(_contribution("big", _honest(2) * 20), [])
        return s.done.result(), _reduced(s)
    res, avg = asyncio.run(run())
    assert not res.refused
    honest_mean = (_honest(0) + _honest(1)) / 2
    assert float((avg - honest_mean).norm()) < 0.3 * float(honest_mean.norm())  # fp4: a quantization apart


def test_the_wire_seam_is_the_identity_and_an_installed_tamper_rewrites_the_reduced_part_it_streams() -> None:
    """``locoswarm.node.swarm.tamper``: a node rewrites nothing; the hostile-node benchmark installs a ``Tamper``
    whose hooks see each value just before it leaves, here a reducer's part (``badreduce``'s seam), never a
    consensus round's unless the hook chooses; installing the identity again restores the honest part."""
    from locoswarm.node.bench.hostile import BadReduceAttack
    from locoswarm.node.swarm import tamper

    assert type(tamper.installed()) is tamper.Tamper

    def reduced(consensus: bool) -> torch.Tensor:
        async def run() -> torch.Tensor:
            s = _session(["me", "h1"])
            s.consensus = consensus
            s.add(_contribution("me", _honest(0)), [])
            s.add(_contribution("h1", _honest(1)), [])
            return _reduced(s)
        return asyncio.run(run())

    honest, consensus = reduced(False), reduced(True)
    try:
        tamper.install(BadReduceAttack(period=1.0))
        turned = reduced(False)
        assert torch.allclose(turned, -3.0 * honest, atol=0.05 * float(honest.abs().max()))
        assert torch.equal(reduced(True), consensus)  # rounds of phi itself: left alone by this attack
    finally:
        tamper.install(tamper.Tamper())
    assert torch.equal(reduced(False), honest)
    req = SimpleNamespace(fragment=0)
    seam = tamper.installed()
    assert seam.contribution("QmR", req, range(1), [(0, 1)], CODEC) is req and seam.sender("QmR", "QmMe") == "QmMe"


# ---- one exchange, driven without a network ----------------------------------------------------------

def _header(**fields) -> swarm_pb2.AverageRequest:
    return swarm_pb2.AverageRequest(header=swarm_pb2.AverageHeader(**fields))


async def _served(node: Exchange, remote: str, messages: list[swarm_pb2.AverageRequest]) -> list:
    """What ``node`` answers on a stream from ``remote`` (its authenticated peer id) that carries ``messages``."""
    async def requests():
        for msg in messages:
            yield msg
    return [reply async for reply in node.serve_part(remote, requests())]


def _pair_round(group: list[str], partner: str, idle: frozenset[str], *, partner_version: int) -> tuple:
    """A round of fragment 2 (round 9) for ``exchange`` "QmMe" in a pair with ``partner``: this node's request (its
    honest progress, version 4), its encoded chunks, and the partner's stream (header and chunks, its own honest
    progress) as the partner would send it for a group hash naming ``idle``."""
    from locoswarm.node.core.transport import AverageRequest

    mine, theirs = encode_chunks(CODEC, _honest(0)), encode_chunks(CODEC, _honest(1))
    req = AverageRequest(fragment=2, round=9, chunks=mine, numel=NUMEL, weight=100.0, version=4, lineage=7)
    header = _header(fingerprint="swarm", fragment=2, round=9, group_hash=group_hash(group, idle),
                     sender=partner, weight=100.0, version=partner_version, n_chunks=len(theirs), lineage=7)
    chunks = [swarm_pb2.AverageRequest(chunk=swarm_pb2.Chunk(index=c, data=d)) for c, d in enumerate(theirs)]
    return req, mine, header, chunks


def test_an_exchange_reduces_the_whole_fragment_with_an_outbound_only_partner_and_serves_it_the_same_average():
    """``Exchange.run`` with ``Exchange.serve_part`` on a real exchange: a partner that peers cannot dial reduces no
    part and is sent no stream, so this node reduces every chunk; the partner's contribution streams in, its
    reply is the very average this node applies, its header's version claim counts toward the round's, and the
    bytes are counted for it."""
    node = exchange(CODEC, fingerprint="swarm")
    group, outbound = ["QmMe", "QmOut"], frozenset({"QmOut"})
    req, mine, header, chunks = _pair_round(group, "QmOut", outbound, partner_version=5)

    async def run() -> tuple:
        round_ = asyncio.create_task(node.run(req, group, {"QmMe": 4}, idle=outbound, unreachable=outbound))
        await asyncio.sleep(0)  # its session is open now
        busy = node.exchanging()
        replies = await _served(node, "QmOut", [header, *chunks])
        return busy, replies, await round_
    busy, replies, result = asyncio.run(run())
    assert busy and not node.exchanging()
    assert result.ok, result.error
    assert result.group_size == 2 and result.total_weight == 200.0 and result.max_version == 5 and result.kin == 1.0
    assert [(p.reducer, p.start, p.end) for p in result.parts] == [("QmMe", 0, NUMEL)]
    assert replies[0].header.ok and replies[0].header.version == 4 and replies[0].header.n_chunks == len(mine)
    assert tuple(r.chunk.data for r in replies[1:]) == result.encoded.chunks  # the partner gets what we apply

    async def reduced_alone() -> torch.Tensor:  # the same two contributions, reduced by a session of their own
        alone = _session(group)
        alone.add(_contribution("QmMe", _honest(0)), [])
        alone.add(_contribution("QmOut", _honest(1)), [])
        return _reduced(alone)
    assert torch.equal(result.average, asyncio.run(reduced_alone()))
    assert result.bytes_sent > 0 and result.bytes_received > sum(len(c.chunk.data) for c in chunks)


def test_a_partner_most_of_the_round_mutes_has_no_pull_in_this_nodes_part_and_still_gets_the_average() -> None:
    """``Exchange.run`` with ``muted``: a partner that most of the round mutes for its standing drift (idle, and here
    nobody streams to it) whose progress agrees with ours, so this reducer's own measure would give it full pull.
    The round merges, the average is this node's own contribution alone (its weight alone), the partner is still
    served that average, and its contribution is still judged."""
    node = exchange(CODEC, fingerprint="swarm")
    group, muted = ["QmDrift", "QmMe"], frozenset({"QmDrift"})
    req, mine, header, chunks = _pair_round(group, "QmDrift", muted, partner_version=4)

    async def run(mutes: frozenset[str]) -> tuple:
        round_ = asyncio.create_task(node.run(req, group, {"QmMe": 4}, idle=muted, unreachable=muted, muted=mutes))
        await asyncio.sleep(0)
        replies = await _served(node, "QmDrift", [header, *chunks])
        return replies, await round_
    replies, result = asyncio.run(run(muted))
    assert result.ok, result.error
    assert result.total_weight == 100.0 and torch.equal(result.average, decode_chunks(CODEC, mine, NUMEL))
    assert replies[0].header.ok and tuple(r.chunk.data for r in replies[1:]) == result.encoded.chunks
    # the same round without the round's mute: the partner's agreeing progress has its full pull
    node = exchange(CODEC, fingerprint="swarm")
    _, plain = asyncio.run(run(frozenset()))
    assert plain.ok and plain.total_weight == 200.0


def test_an_exchange_refuses_a_forged_sender_at_once_and_a_stream_for_a_round_it_skipped_without_blame() -> None:
    """``Exchange.serve_part``: a header from another swarm, and a stream for a round this node takes no part in
    (``Exchange.not_in_round``), are refused without an offence; a header naming another sender than the
    stream's authenticated peer id is an offence."""
    from locoswarm.node.core.transport import NOT_IN_ROUND
    from locoswarm.node.swarm.wire import WireError

    book = _RecordingBook()
    node = exchange(CODEC, fingerprint="swarm", book=book)
    node.not_in_round(3, 11)

    async def run() -> None:
        with pytest.raises(WireError, match="fingerprint mismatch"):
            await _served(node, "QmOther", [_header(fingerprint="another", fragment=3, round=11, sender="QmOther",
                                                    weight=1.0, n_chunks=1)])
        with pytest.raises(WireError, match=NOT_IN_ROUND):
            await _served(node, "QmLate", [_header(fingerprint="swarm", fragment=3, round=11, sender="QmLate",
                                                   weight=1.0, n_chunks=1)])
        with pytest.raises(WireError, match="sender"):
            await _served(node, "QmLiar", [_header(fingerprint="swarm", fragment=3, round=12, sender="QmHonest",
                                                   weight=1.0, n_chunks=1)])
    asyncio.run(run())
    assert book.calls == [("QmOther:fingerprint", False), ("QmLate:not_in_round", False),
                          ("QmLiar:forged_sender", True)]


def test_a_stream_flood_becomes_offences_while_bursts_and_a_full_server_do_not() -> None:
    """``StreamFloods``: every ``FLOOD_REFUSALS``-th stream refused while its peer holds its own cap is an offence;
    a short burst over the cap and refusals because the server is full of others' streams are none."""
    open_now: dict[str, int] = {"QmFlood": 8, "QmBurst": 8, "QmLate": 1}  # each peer's open streams, cap 8
    floods = StreamFloods(8)
    refusals = {"QmFlood": 3 * FLOOD_REFUSALS,
                "QmBurst": 3,  # an honest member's short burst over its cap
                "QmLate": 3 * FLOOD_REFUSALS}  # refused because the server is full of others' streams
    counted = {p: sum(floods.offence(p, open_now[p]) for _ in range(n)) for p, n in refusals.items()}
    assert counted == {"QmFlood": 3, "QmBurst": 0, "QmLate": 0}


def test_every_nth_refusal_is_an_offence_and_the_tracked_peers_are_bounded() -> None:
    counter = EveryNth(3, limit=2)
    assert [counter.offence("a") for _ in range(6)] == [False, False, True, False, False, True]
    counter.offence("b")
    counter.offence("c")  # beyond the limit: "a", the least recently counted, is forgotten
    assert [counter.offence("a") for _ in range(3)] == [False, False, True]


def test_a_harmful_part_is_an_offence_at_once_within_one_lineage_and_only_when_it_recurs_across_lineages():
    """The effect check's blame (``reject_part``): within one lineage each harmful part is an offence of its
    reducer; averaged from other phis (a join) every UNLINED_HARM-th is one, the others are refusals only."""
    from locoswarm.node.core.transport import PartOrigin

    book = _RecordingBook()
    judge, refusals = _part_judge(book=book), book.calls
    for _ in range(2):
        judge.harmful_part(PartOrigin("QmSame", 0, 8, one_lineage=True), "harm")
    judge.harmful_part(PartOrigin("QmMe", 0, 8, one_lineage=True), "harm")  # never ours
    assert refusals == [("QmSame:bad_effect", True)] * 2
    refusals.clear()
    for _ in range(2 * UNLINED_HARM):
        judge.harmful_part(PartOrigin("QmJoin", 0, 8, one_lineage=False), "harm")
    assert len(refusals) == 2 * UNLINED_HARM
    assert [i for i, (_, offence) in enumerate(refusals) if offence] == [UNLINED_HARM - 1, 2 * UNLINED_HARM - 1]


def test_a_member_whose_contribution_alone_is_harmful_is_blamed_like_a_reducer_of_a_harmful_part():
    """``reject_member``: a member whose own contribution to this node's part is harmful alone commits an offence
    within one lineage, from another phi every UNLINED_HARM-th; this node never blames itself; either way it
    serves no catch-up for a while; and the offence counts toward following the round's majority in a ban."""
    from locoswarm.node.core.transport import MemberShare

    book, pauses = _RecordingBook(), SourcePauses()
    judge, refusals, values = _part_judge(book=book, pauses=pauses), book.calls, torch.zeros(8)
    judge.harmful_member(MemberShare("QmFlip", values), "harm")
    judge.harmful_member(MemberShare("QmMe", values), "harm")
    assert refusals == [("QmFlip:harmful_contribution", True)]
    assert pauses.paused("QmFlip") and not pauses.paused("QmMe")
    refusals.clear()
    for _ in range(UNLINED_HARM):
        judge.harmful_member(MemberShare("QmJoin", values, same_lineage=False), "harm")
    assert [offence for _, offence in refusals] == [False] * (UNLINED_HARM - 1) + [True]
    assert "harmful_contribution" in FOLLOWED_OFFENCES


# ---- a reducer's part, as its member judges it ----------------------------------------------------

def _consensus_parts(own: torch.Tensor, partner: torch.Tensor, codec) -> tuple:
    """A pair's consensus round on the outer state ``own``: the request, and the reduced chunks of the
    second half (the momenta, which the partner reduces), as an honest reducer makes them."""
    from locoswarm.node.core.consensus import state_digest
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.exchange import check_reduced_part

    req = AverageRequest(fragment=3, round=40, chunks=encode_chunks(codec, own), numel=own.numel(), weight=1.0,
                         version=7, codec="fp32", digest=state_digest(own))
    bounds = chunk_bounds(own.numel(), codec.block_size)
    second = list(range(len(bounds) // 2, len(bounds)))
    mean = (own + partner) / 2
    chunks = {c: codec.encode(mean[bounds[c][0]:bounds[c][1]]) for c in second}
    own_norm = float(decode_chunks(codec, req.chunks, req.numel).norm())
    return check_reduced_part, req, chunks, bounds, own_norm


def test_an_honest_consensus_part_of_momenta_is_accepted_when_our_momentum_is_near_zero():
    """A node that just joined holds a momentum near 0; its partner's is a trained one. The mean of the
    momenta is far from ours next to our momentum, but small next to the state: the loaded 4-node gossip
    run banned such honest reducers ("reduced part norm 2.74 exceeds 2.2") and its pairs fell apart."""
    codec = get_codec("fp32")
    g = torch.Generator().manual_seed(0)
    n = 2 * 65536
    phi = torch.randn(n, generator=g) * 0.5
    own = torch.cat([phi, torch.randn(n, generator=g) * 1e-4])
    partner = torch.cat([phi + 0.01 * torch.randn(n, generator=g), 0.02 * torch.randn(n, generator=g)])
    check, req, chunks, bounds, own_norm = _consensus_parts(own, partner, codec)
    assert check(codec, req, chunks, bounds, own_norm) is None
    # A reducer moving our momenta by more than half of the state's share is refused.
    check, req, bad, bounds, own_norm = _consensus_parts(own, torch.cat([phi, 10.0 * phi]), codec)
    reason = check(codec, req, bad, bounds, own_norm)
    assert reason is not None and "exceeds" in reason
    # Non-finite is refused whatever its size.
    bad = dict(chunks)
    c = next(iter(bad))
    bad[c] = torch.full((bounds[c][1] - bounds[c][0],), float("nan")).numpy().tobytes()  # fp32 bytes
    assert "non-finite" in check(codec, req, bad, bounds, own_norm)


def test_a_peer_whose_state_was_refused_is_no_catch_up_source_even_as_a_group_member() -> None:
    """A liar that averaged honestly in our last group but serves NaN states: after one refused download
    it is neither a holder of the group's version nor of the heartbeats' (no ban needed for that)."""
    from locoswarm.node.swarm.reputation import Reputation
    from locoswarm.node.swarm.versions import Belief

    rep = Reputation(threshold=3)
    stub = catch_up(peer_id="QmMe", reputation=rep, recent={0: (12, ["QmMe", "QmHonest", "QmLiar"])},
                           view=SimpleNamespace(outbound_peers=set,
                                                latest_versions=lambda f: Belief(11, b"", ["QmLiar", "QmOther"])),
                           pauses=SourcePauses(), round_claims=RoundClaims(),
                           dial_failures=DialFailures(), deviations=DeviationMemory())
    assert stub.newest(0) == Belief(12, b"", ["QmHonest", "QmLiar"])
    rep.refuse("QmLiar", "bad_state", "phi at 0 has 9 non-finite value(s)")
    assert not rep.is_banned("QmLiar")
    assert stub.newest(0) == Belief(12, b"", ["QmHonest"])
    stub.recent = {0: (11, ["QmMe", "QmLiar"])}
    assert stub.newest(0) == Belief(11, b"", ["QmOther"])


def test_catch_ups_go_to_the_holders_whose_rounds_back_the_version() -> None:
    """A holder whose last round named a version two below the one believed (a liar claiming +2 while the honest
    members hold it too) serves a state of its own making: it is not asked while a holder whose rounds back the
    version is (``RoundClaims.backs``), nor at all where that round is recent (``RoundClaims.refutes``: two
    colluding liars were the only holders); where it is older (a node behind meets the others in no round), or
    nothing was named, it may be, after holders whose rounds named the version (``RoundClaims.proves``)."""
    from locoswarm.node.swarm.versions import NAMED_RECENT_S, Belief

    holders = ["QmHonest", "QmLiar", "QmQuiet"]
    stub = catch_up(peer_id="QmMe", reputation=None, recent={}, round_claims=RoundClaims(),
                           view=SimpleNamespace(latest_versions=lambda fragment: Belief(12, b"d", list(holders)),
                                                outbound_peers=set),
                           pauses=SourcePauses(), dial_failures=DialFailures(),
                           deviations=DeviationMemory())
    stub.round_claims.record(0, "QmHonest", 11)
    stub.round_claims.record(0, "QmLiar", 10)
    assert stub.newest(0) == Belief(12, b"d", ["QmHonest"])  # QmQuiet, never met, comes after
    holders.remove("QmHonest")
    assert stub.newest(0) == Belief(12, b"d", ["QmQuiet"])
    holders.remove("QmQuiet")
    assert stub.newest(0) == Belief(12, b"d", [])  # no catch-up now
    stub.round_claims.record(0, "QmLiar", 10, now=time.monotonic() - NAMED_RECENT_S)  # what it named long ago
    assert stub.newest(0) == Belief(12, b"d", ["QmLiar"])


def test_a_peer_whose_parts_this_node_judged_against_it_serves_no_catch_up_until_it_is_cleared() -> None:
    """Two drifting colluders ran ahead of two honest nodes by merging between themselves, and an honest node
    caught up from one of them again and again, each phi a little worse. A peer whose judged contributions or
    reduced parts lean against this node (``Reputation.suspects``) is no catch-up source, before any ban; one
    judgement is not enough, nor a single bad score among good ones, and good scores clear the suspicion."""
    from locoswarm.node.swarm.catchup import SUSPECT_SOURCE
    from locoswarm.node.swarm.reputation import Reputation
    from locoswarm.node.swarm.versions import Belief

    rep = Reputation(threshold=3)
    stub = catch_up(peer_id="QmMe", reputation=rep, recent={0: (12, ["QmMe", "QmHonest", "QmDrifter"])},
                           view=SimpleNamespace(outbound_peers=set,
                                                latest_versions=lambda f: Belief(11, b"", ["QmDrifter", "QmOther"])),
                           pauses=SourcePauses(), round_claims=RoundClaims(),
                           dial_failures=DialFailures(), deviations=DeviationMemory())
    judge = dict(window=3, ban_below=-0.5, good_from=0.0)
    assert set(SUSPECT_SOURCE) >= {"direction", "reduction", "reduction_other_phi"}
    rep.judge("QmDrifter", "reduction_other_phi", -0.3, **judge)
    assert stub.newest(0) == Belief(12, b"", ["QmHonest", "QmDrifter"])  # one score: no evidence
    rep.judge("QmDrifter", "reduction_other_phi", -0.35, **judge)
    assert not rep.is_banned("QmDrifter")
    assert stub.newest(0) == Belief(12, b"", ["QmHonest"])
    stub.recent = {0: (11, ["QmMe", "QmDrifter"])}
    assert stub.newest(0) == Belief(11, b"", ["QmOther"])
    for _ in range(3):
        rep.judge("QmDrifter", "direction", 0.4, **judge)
    assert stub.newest(0) == Belief(11, b"", ["QmDrifter", "QmOther"])  # cleared by good scores
    rep.judge("QmHonest", "direction", 0.3, **judge)
    rep.judge("QmHonest", "reduction", -0.05, **judge)  # one bad score among good ones
    assert stub.may_serve("QmHonest")


def test_a_peer_this_node_failed_to_dial_lately_serves_no_catch_up() -> None:
    """A cut pair (bench swarm --cut 2-3): a node asked the peer it could not reach for state, twice, and waited for
    each dial to fail. A peer its dials failed to lately is no catch-up source; once a stream opened, it is again."""
    stub = catch_up(reputation=None, pauses=SourcePauses(), view=SimpleNamespace(outbound_peers=set),
                           dial_failures=DialFailures(),
                           deviations=DeviationMemory())
    assert stub.may_serve("QmCut")
    stub.dial_failures.failed("QmCut")
    assert not stub.may_serve("QmCut") and stub.may_serve("QmOther")
    stub.dial_failures.reached("QmCut")
    assert stub.may_serve("QmCut")


def test_with_a_drift_ceiling_a_peer_muted_round_after_round_serves_no_catch_up() -> None:
    """A drifter's phi carries the drift it spread (2 + 2 drift runs: catch-ups from the drifters 2-24% worse than
    the node's own, again and again): with a ceiling, a peer muted round after round serves no state, also once its
    published doubt lapsed. Without one (the default), nothing changes."""
    from locoswarm.node.core.persistence import DRIFT_ROUNDS, SUSTAINED_MUTES

    for ceiling, refused in ((0.75, True), (1.0, False)):
        stub = catch_up(reputation=None, pauses=SourcePauses(), view=SimpleNamespace(outbound_peers=set),
                               dial_failures=DialFailures(),
                               deviations=DeviationMemory(ceiling=ceiling))
        for _ in range(DRIFT_ROUNDS + SUSTAINED_MUTES):
            stub.deviations.standing_drift(["QmDrifter", "QmHonest"], [0.95, 0.3], now=0.0)
        assert stub.deviations.apart() == [], "the doubt lapsed (stamped at 0, long ago)"
        assert stub.may_serve("QmDrifter") is not refused
        assert stub.may_serve("QmHonest")


def test_during_an_alarm_a_peer_muted_round_after_round_is_excluded_as_a_banned_one_and_serves_no_state() -> None:
    """Without an honest majority the senders' median is the drifters': an alarm of the effect check (this node's loss
    climbing through rounds that each passed) caps the bound, and a drifter muted round after round is then listed
    with the banned peers (``OffenceBook.shunned``: what the match entries name as excluded, so every member places
    the round alike) and serves no catch-up, with no offence counted. The honest partner is neither; once the alarm
    lapses, the drifter is no longer shunned."""
    from locoswarm.node.core.persistence import ALARM_S, DRIFT_ROUNDS, SUSTAINED_MUTES

    rep = Reputation(threshold=3)
    rep.refuse("QmBanned", "direction", "mean -0.3 over its last 2", conclusive=True)
    deviations = DeviationMemory()
    book = OffenceBook("QmMe", rep, RoundClaims())
    catch = catch_up(reputation=rep, deviations=deviations)
    senders, levels = ["QmHonest", "QmD1", "QmD2"], [0.45, 0.9, 0.9]
    for _ in range(DRIFT_ROUNDS + 1):
        deviations.standing_drift(senders, levels)
    assert book.shunned(deviations.shunned()) == ["QmBanned"] and catch.may_serve("QmD1")
    deviations.alarm()  # what ``SwarmTransport.alarm`` does, besides a log line
    for _ in range(SUSTAINED_MUTES):
        deviations.standing_drift(senders, levels)
    assert book.shunned(deviations.shunned()) == ["QmBanned", "QmD1", "QmD2"]
    assert not catch.may_serve("QmD1") and catch.may_serve("QmHonest")
    assert not rep.is_banned("QmD1") and rep.banned() == ["QmBanned"]  # shunned, not banned
    assert deviations.shunned(now=time.monotonic() + ALARM_S + 1) == []


def test_a_catch_up_from_a_peer_this_node_muted_lately_is_marked_doubted() -> None:
    """A snapshot says whether this node muted its source lately for its standing drift (the outer loop's effect
    check then allows it only ``DOUBTED_SLACK`` worse): its phi carries the drift that was muted."""
    from locoswarm.node.core.persistence import DOUBT_S, DRIFT_ROUNDS
    from locoswarm.node.core.transport import FragmentSnapshot
    from locoswarm.node.swarm.versions import Belief

    for ceiling in (0.75, 1.0):
        memory = DeviationMemory(ceiling=ceiling)
        for _ in range(DRIFT_ROUNDS + 1):   # with honest partners the median mutes it, without them the ceiling
            memory.standing_drift(["QmDrifter", "QmHonest", "QmOther"], [0.95, 0.3, 0.35])
        for source, doubted in (("QmDrifter", True), ("QmHonest", False)):
            def served(fragment: int, holders: list[str], version: int, digest: bytes, source: str = source):
                return FragmentSnapshot(fragment, version, torch.zeros(4), torch.zeros(4), source=source)
            met = RoundClaims()  # both met in rounds: only the muting makes a doubt here
            for peer in ("QmDrifter", "QmHonest"):
                met.record(0, peer, 3)
            # the heartbeats name both holders of v3; the stand-in state source answers as ``source`` whoever is
            # asked (with a ceiling, ``may_serve`` leaves the drifter out of the holders): the marking is the test
            view = SimpleNamespace(kin=lambda peer, fragment: peer == "QmHonest", outbound_peers=set,
                                   latest_versions=lambda fragment: Belief(3, b"", ["QmDrifter", "QmHonest"]))
            stub = catch_up(peer_id="QmSelf", deviations=memory, states=SimpleNamespace(fetch=served),
                            round_claims=met, view=view)
            snapshot = stub.fetch(0)
            assert snapshot.doubted is doubted, (ceiling, source)
            assert snapshot.kin is (source == "QmHonest")  # FragmentSnapshot.kin: as the daemon's view says
        assert not memory.muted_lately("QmDrifter", now=time.monotonic() + 2 * DOUBT_S), "the doubt lapses"


def test_a_suspicion_that_nothing_renews_lapses_and_the_suspect_serves_catch_ups_again() -> None:
    """A node on a lineage of its own meets a suspected holder in no round, so no score would ever clear the
    suspicion: once the newest of its scores is older than ``SUSPECT_SOURCE_S`` the peer may serve a catch-up
    again (a CI run held an honest node 140 versions behind the others for 120 s). A suspect still judged in
    this node's rounds stays suspected: each score renews it."""
    from locoswarm.node.swarm.catchup import SUSPECT_SOURCE, SUSPECT_SOURCE_S
    from locoswarm.node.swarm.reputation import Reputation

    now = [1000.0]
    rep = Reputation(threshold=3, now=lambda: now[0])
    stub = catch_up(reputation=rep, pauses=SourcePauses(), view=SimpleNamespace(outbound_peers=set),
                           dial_failures=DialFailures(), deviations=DeviationMemory())
    judge = dict(window=8, ban_below=-0.9, good_from=0.0)
    for _ in range(2):
        rep.judge("QmSuspect", "direction", -0.4, **judge)
    assert rep.suspects("QmSuspect", SUSPECT_SOURCE) and not rep.is_banned("QmSuspect")
    assert not stub.may_serve("QmSuspect")
    now[0] += 0.9 * SUSPECT_SOURCE_S
    rep.judge("QmSuspect", "reduction", -0.2, **judge)  # judged again: renewed
    now[0] += 0.9 * SUSPECT_SOURCE_S
    assert not stub.may_serve("QmSuspect")
    now[0] += 0.2 * SUSPECT_SOURCE_S
    assert stub.may_serve("QmSuspect")
    assert rep.suspects("QmSuspect", SUSPECT_SOURCE)  # without a bound on age (following bans) it still counts


def test_a_state_that_measured_worse_pauses_its_source_shortly_a_malformed_one_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An honest swarm's phi moves every round: a holder whose phi measured worse than ours is asked again
    after WORSE_SOURCE_S (a node that refused the others' phi while a bad average had set them back would
    otherwise stay on a lineage of its own), one that served a malformed state only after REFUSED_SOURCE_S."""
    import locoswarm.node.swarm.catchup as catchup
    from locoswarm.node.core.transport import FragmentSnapshot

    now = [1000.0]
    monkeypatch.setattr(catchup.time, "monotonic", lambda: now[0])
    stub = catch_up(reputation=None, pauses=SourcePauses(), view=SimpleNamespace(outbound_peers=set),
                           dial_failures=DialFailures(),
                           deviations=DeviationMemory())
    source = lambda peer: stub.may_serve(peer)  # noqa: E731

    def served(peer: str) -> FragmentSnapshot:
        return FragmentSnapshot(0, 7, torch.zeros(3), torch.zeros(3), source=peer)

    stub.reject_snapshot(served("QmWorse"), "effect: worse", offence=False)
    stub.reject_snapshot(served("QmBroken"), "phi is not finite", offence=True)
    assert not source("QmWorse") and not source("QmBroken") and source("QmOther")
    now[0] += catchup.WORSE_SOURCE_S + 0.1
    assert source("QmWorse") and not source("QmBroken")
    now[0] += catchup.REFUSED_SOURCE_S
    assert source("QmBroken")


def test_a_reducer_whose_part_this_node_refused_serves_it_no_catch_up_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reduced part refused as pointing against this node's progress (where it is evidence), or for its effect,
    pauses its reducer as a catch-up source for TURNED_SOURCE_S (2 + 2 drift: an honest node caught up from a
    drifter seconds after refusing its parts, each phi worse); a pair's part, which is no evidence, does not; nor
    does an honest part; the pause ends by itself."""
    import locoswarm.node.swarm.judging as judging
    from locoswarm.node.core.transport import PartOrigin

    now = [1000.0]
    monkeypatch.setattr(judging.time, "monotonic", lambda: now[0])
    pauses = SourcePauses()  # shared by the catch-up's rule and the judge, as ``SwarmTransport`` builds them
    stub = catch_up(peer_id="QmMe", reputation=None, pauses=pauses,
                           view=SimpleNamespace(outbound_peers=set),
                           dial_failures=DialFailures(),
                           deviations=DeviationMemory())
    judge = _part_judge(pauses=pauses)
    source = lambda peer: stub.may_serve(peer)  # noqa: E731
    check = judge.reduced_direction
    check("QmHonest", 0.4, same_lineage=True)
    with pytest.raises(PartRefused):
        check("QmTurned", -0.2, same_lineage=True)
    with pytest.raises(PartRefused):
        check("QmPartner", -0.6, same_lineage=True, evidence=False)
    judge.harmful_part(PartOrigin("QmHarm", 0, 8, one_lineage=True), "harm")
    assert source("QmHonest") and source("QmPartner")
    assert not source("QmTurned") and not source("QmHarm")
    now[0] += judging.TURNED_SOURCE_S + 0.1
    assert source("QmTurned") and source("QmHarm")


def test_a_download_whose_source_was_banned_while_it_ran_is_discarded() -> None:
    """A catch-up started before its source's ban lands after it: its snapshot is not handed to the outer loop
    (2 + 2 drift: an honest node adopted a drifter's phi, 36% worse, one second after banning it); a download
    from a source still trusted, or one that failed, is handed over as before."""
    import concurrent.futures

    from locoswarm.node.core.transport import FragmentSnapshot
    from locoswarm.node.swarm.catchup import _BackgroundFetch

    rep = Reputation(threshold=1)
    stub = catch_up(reputation=rep, pauses=SourcePauses(), view=SimpleNamespace(outbound_peers=set),
                           dial_failures=DialFailures(), deviations=DeviationMemory())

    def landed(snapshot: FragmentSnapshot | None) -> _BackgroundFetch:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(snapshot)
        return _BackgroundFetch(future, stub.may_serve)

    def served(peer: str) -> FragmentSnapshot:
        return FragmentSnapshot(0, 9, torch.zeros(3), torch.zeros(3), source=peer)

    drifter, honest = landed(served("QmDrifter")), landed(served("QmHonest"))
    rep.refuse("QmDrifter", "direction", "mean -0.3 over its last 2", conclusive=True)
    assert rep.is_banned("QmDrifter")
    assert drifter.done() and drifter.result() is None
    assert honest.result() is not None and honest.result().source == "QmHonest"
    assert landed(None).result() is None


def test_the_matchmaking_window_is_at_least_three_swarm_steps_and_bounded() -> None:
    """Members reach a slot up to a step or two apart: with 4.9 s steps a fixed 5 s window merged no round. A step
    is the shorter of the swarm's measured one and this node's compute: a swarm slowed by its waits for failed
    rounds does not lengthen the windows that made it wait."""
    from locoswarm.node.config import MAX_WINDOW_S
    from locoswarm.node.swarm.lone import LonePolicy
    from locoswarm.node.swarm.matchmaking import WINDOW_STEPS, Matchmaker
    from locoswarm.node.swarm.standing import StandingMembers
    from locoswarm.node.swarm.versions import RoundClaims
    from locoswarm.node.swarm.view import SwarmView

    class Paced(SwarmView):
        def __init__(self, step: float, compute: float) -> None:
            self.step, self.compute = step, compute

        def step_time(self) -> float:
            return self.step

        def compute_step_time(self) -> float:
            return self.compute

    for step, compute, expected in [(0.0, 0.0, 5.0), (float("nan"), 0.0, 5.0), (0.26, 0.26, 5.0),
                                    (4.9, 4.9, WINDOW_STEPS * 4.9), (4.9, 0.0, WINDOW_STEPS * 4.9),
                                    (0.0, 4.9, WINDOW_STEPS * 4.9), (1e6, 1e6, MAX_WINDOW_S),
                                    (3.3, 0.14, 5.0),   # stalled swarm, fast compute: no longer window
                                    (0.14, 3.3, 5.0)]:  # a slow node in a fast swarm: the swarm's window
        view = Paced(step, compute)
        matchmaker = Matchmaker(None, "QmA", swarm_key="swarm", subkey="QmA", matchmaking_timeout=5.0, view=view,
                                lone=LonePolicy(view), deviations=DeviationMemory(), dial_failures=DialFailures(),
                                book=OffenceBook("QmA", None, RoundClaims()),
                                standing=StandingMembers(True))
        assert matchmaker.window() == pytest.approx(expected), step


def test_the_node_warns_once_when_a_fragments_rounds_come_faster_than_the_window(caplog) -> None:
    """h = 8 at 0.05 s per step: a round every 0.4 s against a 3 s window (the multi-process runs whose nodes
    failed rounds several times a second). The warning names the setting and a value that fits; h = 120 fits."""
    import logging

    from locoswarm.node.daemon import RoundPeriodWarning

    for h, warned in ((8, True), (120, False)):
        caplog.clear()
        warning = RoundPeriodWarning()
        with caplog.at_level(logging.WARNING, logger="locoswarm"):
            assert warning.check(h, 0.05, 3.0) is warned
            assert not warning.check(h, 0.05, 3.0)
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == int(warned), lines
        if warned:
            assert "[outer] h = 8" in lines[0] and "every 0.40 s" in lines[0] and "h >= 120" in lines[0], lines[0]


def test_members_close_the_round_on_the_longest_trusted_window() -> None:
    from locoswarm.node.config import MAX_WINDOW_S
    from locoswarm.node.core.transport import AverageRequest

    req = AverageRequest(fragment=0, round=40, chunks=[], weight=1.0, numel=0, codec="fp4", version=3)
    entries = {"QmA": match_entry("QmA", req, 10.0, window=18.0), "QmB": match_entry("QmB", req, 10.5, window=21.0),
               "QmL": match_entry("QmL", req, 11.0, window=1e9)}
    assert agreed_window(18.0, entries, trusted={"QmA", "QmB"}) == 21.0      # the liar's is not trusted
    assert agreed_window(18.0, entries, trusted={"QmA", "QmB", "QmL"}) == MAX_WINDOW_S  # trusted: capped
    entries["QmB"].window = float("nan")
    assert agreed_window(18.0, entries, trusted={"QmA", "QmB"}) == 18.0
    # a member stating the longest window allowed holds a round of 3 s windows open for 8x that, not a minute
    assert STATED_WINDOW_SPREAD == 8.0
    assert agreed_window(3.0, entries, trusted={"QmA", "QmL"}) == 24.0
    assert agreed_window(3.0, {"QmA": entries["QmA"]}, trusted={"QmA"}) == 18.0  # a 6x slower member: its own


def _closed_lists(arrivals: dict[str, float], windows: dict[str, float]) -> dict[str, list[str]]:
    """Each member's list as ``_matchmake`` closes it on its window (no member expected in full, no grace), every
    member reading every entry stored by then."""
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.matchmaking import closed_before

    req = AverageRequest(fragment=0, round=8, chunks=[], weight=1.0, numel=0, codec="fp4", version=1)
    entries = {p: match_entry(p, req, a, window=windows[p]) for p, a in arrivals.items()}
    lists = {}
    for me, mine in entries.items():
        now = mine.arrival
        while True:
            seen = {p: e for p, e in entries.items() if e.arrival <= now}
            closed = closed_before(seen, me)
            open_ = {p: e for p, e in seen.items() if p not in closed}
            window = agreed_window(mine.window, open_, set(open_))
            end = min(max(e.arrival, mine.arrival - window) for e in open_.values()) + window
            if now >= end:
                break
            now = min([end] + [e.arrival for e in entries.values() if e.arrival > now])
        lists[me] = sorted(p for p, e in entries.items() if e.arrival <= end and p not in closed)
    return lists


def test_a_late_member_drops_the_members_whose_windows_closed_before_it_came() -> None:
    """Two members arrive together and close their 3 s window without the two that come 6 s later; those still
    count the early pair's entries in time (a window starts no earlier than one window before its own arrival),
    and without ``closed_before`` they reduced for the pair and waited for its parts in every round. With it the
    late pair forms the round without them, as the early pair did."""
    arrivals = {"QmO2": 100.0, "QmO3": 100.2, "QmP0": 106.0, "QmP1": 106.1}
    lists = _closed_lists(arrivals, dict.fromkeys(arrivals, 3.0))
    assert lists["QmO2"] == lists["QmO3"] == ["QmO2", "QmO3"]
    assert lists["QmP0"] == lists["QmP1"] == ["QmP0", "QmP1"]
    # a member that closed after this one came is kept; so is every member that came after this one
    lists = _closed_lists({"QmA": 100.0, "QmB": 102.9, "QmC": 104.0}, {"QmA": 3.0, "QmB": 3.0, "QmC": 3.0})
    assert lists["QmA"] == lists["QmB"] == ["QmA", "QmB"] and lists["QmC"] == ["QmC"]
    # a longer window of an entry in time grows the early member's window: the late one is then in it
    lists = _closed_lists({"QmA": 100.0, "QmB": 101.0, "QmC": 104.0}, {"QmA": 3.0, "QmB": 5.0, "QmC": 3.0})
    assert lists["QmA"] == lists["QmB"] == lists["QmC"] == ["QmA", "QmB", "QmC"]


def test_members_that_close_on_their_windows_agree_on_who_is_in_the_round() -> None:
    """Whatever the arrivals and windows, a member keeps another exactly when the other keeps it: the property
    whose lack made a late member wait for parts that never came. (Arrivals, windows and the grace cut of real
    rounds vary more; this is the rule on the entries themselves.)"""
    import random

    rng = random.Random(7)
    for trial in range(300):
        names = [f"Qm{i}" for i in range(rng.randint(2, 6))]
        arrivals = {p: rng.uniform(0.0, 12.0) for p in names}
        windows = {p: rng.choice([2.0, 3.0, 5.0]) for p in names}
        lists = _closed_lists(arrivals, windows)
        for a, b in itertools.combinations(names, 2):
            assert (b in lists[a]) == (a in lists[b]), (trial, arrivals, windows, lists)
            if b in lists[a]:  # and members of one round hold one list (else their groups differ)
                assert lists[a] == lists[b], (trial, arrivals, windows, lists)


def test_a_node_steps_alone_only_after_it_has_seen_no_peer_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view emptied for a moment (a heartbeat read that failed) is not solitude: a solo outer step then, at
    the version the peers step together, would leave equal versions with different phi. A node that never saw
    a peer is alone at once (a swarm of one trains from its first round)."""
    import locoswarm.node.swarm.lone as lone

    clock = [100.0]
    monkeypatch.setattr(lone.time, "monotonic", lambda: clock[0])
    view: list[str] = []
    policy = lone.LonePolicy(SimpleNamespace(live_peers=lambda: list(view), serving_peers=list, joining_peers=list))
    assert policy.alone(), "never saw a peer: a swarm of one"
    view.append("QmPeer")
    assert not policy.alone()
    view.clear()
    clock[0] += lone.ALONE_S / 2
    assert not policy.alone(), "the peer vanished a moment ago"
    clock[0] += lone.ALONE_S
    assert policy.alone(), "no peer for ALONE_S: alone"


def test_a_lone_node_takes_no_solo_step_while_a_peer_joins_for_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Solo steps while a joiner downloads the state leave it a lineage behind (at 5 Mbit/s the swarm then spent
    a minute downloading states back and forth); a heartbeat that never gets state stops it only for a while."""
    import locoswarm.node.swarm.lone as lone

    clock = [100.0]
    monkeypatch.setattr(lone.time, "monotonic", lambda: clock[0])
    joining: list[str] = []
    serving: list[str] = []
    policy = lone.LonePolicy(SimpleNamespace(live_peers=lambda: [], joining_peers=lambda: list(joining),
                                             serving_peers=lambda: list(serving)))
    assert policy.alone()
    joining.append("QmJoiner")
    assert not policy.alone(), "a peer is downloading the state: no solo step"
    clock[0] += lone.JOIN_WAIT_S / 2
    assert not policy.alone()
    clock[0] += lone.JOIN_WAIT_S
    assert policy.alone(), "joining for longer than JOIN_WAIT_S: it no longer holds the node back"
    joining[:] = [f"QmFlood{i}" for i in range(2 * lone.MAX_JOINERS)]
    assert not policy.alone() and policy.joiners_tracked() == lone.MAX_JOINERS
    joining.clear()
    assert policy.alone() and policy.joiners_tracked() == 0, "peers that stopped joining are forgotten"
    # a download this node serves holds it back as long as it lasts (a big state on a slow link takes minutes)
    serving.append("QmDownloader")
    clock[0] += 10 * lone.JOIN_WAIT_S
    assert not policy.alone(), "a download served now: no solo step, however long it takes"
    serving.clear()
    assert policy.alone(), "the download ended: solo steps again"


def test_a_peer_every_other_member_excludes_is_dropped_from_the_round_whoever_saw_its_entry() -> None:
    """Three honest members ban X; X still enters the round. Whether a member read X's entry before it closed
    its window or not, every member forms the round without it; X's own exclusions drop nobody, and a peer
    only some members exclude stays (grouping keeps it apart from those)."""
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.matchmaking import shunned_dropped

    req = AverageRequest(fragment=0, round=8, chunks=[], weight=1.0, numel=0, codec="fp4", version=1)
    honest = {p: match_entry(p, req, 1.0, excluded=["QmX"]) for p in ("QmA", "QmB", "QmC")}
    x = match_entry("QmX", req, 1.5, excluded=["QmA", "QmB", "QmC"])
    assert shunned_dropped(["QmA", "QmB", "QmC", "QmX"], {**honest, "QmX": x}) == ["QmA", "QmB", "QmC"]
    assert shunned_dropped(["QmA", "QmB", "QmC"], honest) == ["QmA", "QmB", "QmC"]
    partial = {**honest, "QmB": match_entry("QmB", req, 1.0)}
    assert shunned_dropped(["QmA", "QmB", "QmC", "QmX"], {**partial, "QmX": x}) == ["QmA", "QmB", "QmC", "QmX"]


def test_a_reduced_part_that_points_against_our_own_progress_is_refused_and_counted() -> None:
    """A member checks each reducer's part against its own contribution to it: an honest mean includes ours
    and agrees with it; a part a reducer negated does not (REDUCED_AGREEMENT), and three such parts ban it."""
    from locoswarm.node.core.payload import chunk_bounds, encode_chunks
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.judging import REDUCED_AGREEMENT, REDUCED_WINDOW, part_geometry
    from locoswarm.node.swarm.reputation import Reputation

    own, other = _honest(0), _honest(1)
    req = AverageRequest(fragment=0, round=4, chunks=encode_chunks(CODEC, own), numel=NUMEL, weight=1.0, version=1)
    bounds = chunk_bounds(NUMEL, CODEC.block_size)
    part = range(len(bounds))
    honest_part = dict(enumerate(encode_chunks(CODEC, (own + other) / 2)))
    turned = dict(enumerate(encode_chunks(CODEC, -3.0 * (own + other) / 2)))
    def agreement(chunks: dict[int, bytes]) -> float:
        return part_geometry(CODEC, req, {c: chunks[c] for c in part}, bounds).agreement

    assert agreement(honest_part) > 0.5
    assert agreement(turned) < REDUCED_AGREEMENT
    rep = Reputation()
    judge = _part_judge(rep)
    for _ in range(REDUCED_WINDOW):
        judge.reduction("QmBad", agreement(turned))
        judge.reduction("QmGood", agreement(honest_part))
    assert rep.is_banned("QmBad") and not rep.is_banned("QmGood")


def _spread_round(seed: int, members: int, drift: float = 0.0, pattern_seed: int = 99):
    """One round's reduced part and this member's (member 0's) contribution to it: the mean of ``members`` honest
    contributions, plus ``drift`` times its rms in a fixed sign pattern (the bench's ``reducedrift``)."""
    from locoswarm.node.core.transport import AverageRequest

    contributions = [_honest(1000 * seed + m) for m in range(members)]
    mean = sum(contributions) / members
    pattern = torch.randint(0, 2, (NUMEL,), generator=torch.Generator().manual_seed(pattern_seed)) * 2.0 - 1
    reduced = mean + drift * float(mean.norm()) / NUMEL ** 0.5 * pattern
    req = AverageRequest(fragment=0, round=seed, chunks=encode_chunks(CODEC, contributions[0]), numel=NUMEL,
                         weight=1.0, version=1)
    return req, dict(enumerate(encode_chunks(CODEC, reduced)))


def test_a_reducer_whose_parts_spread_far_more_than_our_own_is_refused_and_banned_an_honest_one_never() -> None:
    """A reducer that adds a fixed pattern (twice its part's rms) keeps its part's agreement with ours positive, so
    the direction check passes it; but its part spreads away from our contribution about three times as far as
    the part we reduced ourselves from the same members, and the evidence bans it within SPREAD_WINDOW rounds. A
    part beyond SPREAD_REFUSE (a larger pattern) is refused at once. Honest reducers' parts (the same mixing, other
    draws) never are, over many rounds, and nothing judged in a pair is evidence."""
    from locoswarm.node.swarm.judging import REDUCED_AGREEMENT, SPREAD_REFUSE, part_geometry, spread_ratio

    def part(reducer: str, seed: int, drift: float = 0.0) -> PartResult:
        req, chunks = _spread_round(seed, 4, drift)
        return PartResult(reducer, chunks, 4.0, [], part_geometry(CODEC, req, chunks, chunk_bounds(NUMEL, 64)))

    def transport(pauses: SourcePauses | None = None) -> PartJudge:
        return _part_judge(Reputation(), pauses=pauses)

    def judge(t: PartJudge, r: int, *others: PartResult, view=None) -> str | None:
        try:
            t.spreads(part("QmMe", 3 * r), list(others), view)
        except PartRefused as exc:
            return str(exc)
        return None

    honest = transport()
    for r in range(40):  # honest reducers of other parts: the same mixing as ours, never refused or banned
        assert judge(honest, r, part("QmB", 3 * r + 1), part("QmC", 3 * r + 2)) is None
    assert not honest.reputation.is_banned("QmB") and not honest.reputation.is_banned("QmC")

    drifted = part("QmD", 1, drift=2.0)
    assert drifted.geometry.agreement > REDUCED_AGREEMENT  # what the direction check alone lets through
    assert 2.0 < spread_ratio(drifted.geometry, part("QmMe", 3).geometry) < SPREAD_REFUSE
    hostile_pauses = SourcePauses()
    hostile = transport(hostile_pauses)
    for r in range(SPREAD_WINDOW):
        refused = judge(hostile, r, part("QmB", 3 * r + 1), part("QmD", 3 * r + 2, 2.0))
        if hostile.reputation.is_banned("QmD"):
            assert refused is not None and "QmD" in refused  # the part of the banning judgement is not applied
            break
        assert refused is None
    assert hostile.reputation.is_banned("QmD") and not hostile.reputation.is_banned("QmB")
    assert hostile_pauses.paused("QmD")

    # the same parts from a reducer that names another phi (an honest joiner mixes its own contribution from that
    # phi in): judged against SPREAD_BAN_OTHER_PHI, not banned at this spread; much louder ones are
    other_phi = transport()
    for r in range(2 * SPREAD_WINDOW):
        joiner = part("QmD", 3 * r + 2, 2.0)._replace(same_lineage=False)
        assert judge(other_phi, r, part("QmB", 3 * r + 1), joiner) is None
    assert not other_phi.reputation.is_banned("QmD")
    for r in range(2 * SPREAD_WINDOW, 3 * SPREAD_WINDOW):
        if judge(other_phi, r, part("QmD", 3 * r + 2, 8.0)._replace(same_lineage=False)) and \
                other_phi.reputation.is_banned("QmD"):
            break
    assert other_phi.reputation.is_banned("QmD")

    louder = transport()
    refused = judge(louder, 0, part("QmB", 1), part("QmD", 2, 4.0))
    assert refused is not None and "QmD" in refused and f"at most {SPREAD_REFUSE:g}x" in refused
    assert not louder.reputation.is_banned("QmD")  # one part is no ban

    # a round where another member's contribution to our own part had no pull (a flipper that may have turned
    # QmD's part): no evidence against QmD, however many such rounds; a part beyond SPREAD_REFUSE is still refused
    disputed_pauses = SourcePauses()
    disputed = transport(disputed_pauses)
    for r in range(3 * SPREAD_WINDOW):
        own = part("QmMe", 3 * r)._replace(disputed=frozenset({"QmX"}))
        disputed.spreads(own, [part("QmD", 3 * r + 2, 2.0)], None)
    assert not disputed.reputation.is_banned("QmD")
    with pytest.raises(PartRefused, match="no evidence against the reducer"):
        disputed.spreads(part("QmMe", 0)._replace(disputed=frozenset({"QmX"})), [part("QmD", 2, 4.0)], None)
    assert not disputed.reputation.is_banned("QmD") and disputed_pauses.paused("QmD")
    self_disputed = transport()  # the disputed member is the reducer itself: its parts are evidence as before
    for r in range(2 * SPREAD_WINDOW):
        own = part("QmMe", 3 * r)._replace(disputed=frozenset({"QmD"}))
        with contextlib.suppress(PartRefused):
            self_disputed.spreads(own, [part("QmD", 3 * r + 2, 2.0)], None)
    assert self_disputed.reputation.is_banned("QmD")

    in_pair, pair = transport(), SimpleNamespace(judges_reduced_part=lambda reducer: False)
    for r in range(2 * SPREAD_WINDOW):
        assert judge(in_pair, r, part("QmD", 3 * r + 2, 4.0), view=pair) is None
    assert not in_pair.reputation.is_banned("QmD")
    alone = transport()  # no reference: our own part holds only our own contribution
    for r in range(2 * SPREAD_WINDOW):
        alone.spreads(PartResult("QmMe", {}, 1.0, [], None), [part("QmD", r, 4.0)], None)
    assert not alone.reputation.is_banned("QmD")


def _persistence_rounds(rounds: int, nudge: float, seed: int = 0):
    """Rounds of four members (this node, QmB, QmC, QmD) whose contributions are a common direction, a bias of each
    member's own data (the same every round: why honest residuals persist) and minibatch noise; each member reduces
    two of eight chunks honestly, the pair turning each round as the swarm's parts do (``reducer_parts``), except that
    QmD adds ``nudge`` times its part's rms in a fixed sign pattern (the bench's ``reducenudge`` at 0.8). Yields
    (request, parts) per round, this node's own part first."""
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.judging import part_geometry
    from locoswarm.node.transport.reduce import reducer_parts

    numel, members = 8 * 1024, ["QmMe", "QmB", "QmC", "QmD"]
    gen = torch.Generator().manual_seed(seed)
    common, bias = torch.randn(numel, generator=gen), [0.8 * torch.randn(numel, generator=gen) for _ in members]
    pattern = torch.randint(0, 2, (numel,), generator=gen) * 2.0 - 1
    bounds = chunk_bounds(numel, 64)
    for r in range(rounds):
        contributions = [0.01 * (common + b + torch.randn(numel, generator=gen)) for b in bias]
        mean = sum(contributions) / len(members)
        req = AverageRequest(fragment=0, round=r, chunks=encode_chunks(CODEC, contributions[0]), numel=numel,
                             weight=1.0, version=1)
        parts = []
        for reducer, part in zip(members, reducer_parts(len(bounds), members, round_=r), strict=True):
            lo, hi = bounds[part.start][0], bounds[part.stop - 1][1]
            values = mean.clone()
            if reducer == "QmD":
                values[lo:hi] += nudge * float(values[lo:hi].norm()) / (hi - lo) ** 0.5 * pattern[lo:hi]
            encoded = encode_chunks(CODEC, values)
            chunks = {c: encoded[c] for c in part}
            parts.append(PartResult(reducer, chunks, 4.0, [], part_geometry(CODEC, req, chunks, bounds)))
        yield req, parts


def test_a_part_refused_for_its_direction_is_judged_for_its_spread_before_the_round_fails() -> None:
    """A reducer whose parts point against ours from another phi (refused, no blame: honest reducers of another
    lineage do that too) was refused round after round and never banned, its spread never judged (3 + 1
    ``reducedrift``, 151 refusals, +31%). ``PartJudge.parts`` judges every part's spread first, then fails the round
    with the direction refusal; a part whose spread is far beyond an honest one's bans its reducer in a few rounds,
    and an honest part refused for its direction alone bans nobody."""
    from locoswarm.node.core.payload import chunk_bounds
    from locoswarm.node.swarm.judging import part_geometry
    from locoswarm.node.swarm.reputation import Reputation

    def part(reducer: str, seed: int, drift: float = 0.0, refused: str = "") -> PartResult:
        req, chunks = _spread_round(seed, 4, drift)
        return PartResult(reducer, chunks, 4.0, [], part_geometry(CODEC, req, chunks, chunk_bounds(NUMEL, 64)),
                           same_lineage=False, refused=refused)

    stub = _part_judge(Reputation())
    against = "peer {} sent a reduced part that points against this node's own progress (agreement -0.14)"

    def judge(r: int, *others: PartResult) -> str:
        req, _ = _spread_round(3 * r, 4)
        with pytest.raises(PartRefused) as refused:
            stub.parts(req, [part("QmMe", 3 * r), *others], None)
        return str(refused.value)

    for r in range(3 * SPREAD_WINDOW):  # an honest part refused for its direction: the round fails, nobody banned
        assert judge(r, part("QmH", 3 * r + 1, refused=against.format("QmH"))) == against.format("QmH")
    assert not stub.reputation.is_banned("QmH")
    reasons = []
    for r in range(3 * SPREAD_WINDOW, 4 * SPREAD_WINDOW):  # a pattern added, refused for its direction as well
        reasons.append(judge(r, part("QmH", 3 * r + 1), part("QmD", 3 * r + 2, 6.0, refused=against.format("QmD"))))
        if stub.reputation.is_banned("QmD"):
            break
    assert stub.reputation.is_banned("QmD") and not stub.reputation.is_banned("QmH"), reasons
    assert all("QmD" in why for why in reasons)


def test_a_reducer_that_adds_a_small_fixed_pattern_is_banned_for_its_persistence_an_honest_one_never() -> None:
    """``reducenudge`` (0.8x its part's rms in a fixed pattern) stays inside the spread bounds, but its part's
    residual (orthogonal to our contribution) persists round after round more than the honest reducers' (whose
    persistence is their members' data, the same for our own part): it is banned within a few rounds. Honest reducers
    whose members' data differ persistently are never banned over many rounds, nor is anyone judged in a pair."""
    from locoswarm.node.swarm.judging import spread_ratio

    def transport(pauses: SourcePauses | None = None) -> PartJudge:
        return _part_judge(Reputation(), pauses=pauses)

    honest = transport()
    for req, parts in _persistence_rounds(60, nudge=0.0):
        honest.persistence(req, parts, None)
    assert honest.part_drift.reference() is not None  # it judged: the reducers' median is known
    assert not any(honest.reputation.is_banned(p) for p in ("QmB", "QmC", "QmD"))

    hostile_pauses = SourcePauses()
    hostile, ratios = transport(hostile_pauses), []
    for req, parts in _persistence_rounds(30, nudge=0.8, seed=1):
        ratios.append(spread_ratio(parts[3].geometry, parts[0].geometry))
        hostile.persistence(req, parts, None)
        if hostile.reputation.is_banned("QmD"):
            break
    assert hostile.reputation.is_banned("QmD") and len(ratios) <= 12, len(ratios)
    assert hostile_pauses.paused("QmD")
    assert not hostile.reputation.is_banned("QmB") and not hostile.reputation.is_banned("QmC")
    assert sorted(ratios)[len(ratios) // 2] < SPREAD_BAN  # what the spread check alone lets through

    in_pair, pair = transport(), SimpleNamespace(judges_reduced_part=lambda reducer: False)
    for req, parts in _persistence_rounds(30, nudge=0.8, seed=2):
        in_pair.persistence(req, parts, pair)
    assert not in_pair.reputation.is_banned("QmD")
    # low-rank payloads: chunks are coefficients on a basis that moves every round, not one coordinate per chunk
    low_rank = transport()
    for req, parts in _persistence_rounds(30, nudge=0.8, seed=1):
        low_rank.persistence(replace(req, basis=b"ranks+hash"), parts, None)
    assert not low_rank.reputation.is_banned("QmD") and low_rank.part_drift.reference() is None


def test_a_turned_reduced_part_is_never_applied_and_its_reducer_is_banned_whatever_lineage_it_names() -> None:
    """A reducer that turns every part is refused each time; within one lineage REDUCED_WINDOW parts averaging below
    REDUCED_AGREEMENT ban it, and naming another phi (its own claim) does not save it: there REDUCED_WINDOW parts
    averaging below UNLINED_TURNED ban it; above that (an honest reducer of another lineage) never. An honest part
    (agreement above REDUCED_AGREEMENT) passes either way."""
    from locoswarm.node.swarm.judging import REDUCED_AGREEMENT, REDUCED_WINDOW, UNLINED_TURNED
    from locoswarm.node.swarm.reputation import Reputation

    rep = Reputation()
    book = OffenceBook("QmMe", rep, RoundClaims())
    check = _part_judge(rep, book=book).reduced_direction
    for same in (True, False):
        check("QmHonest", REDUCED_AGREEMENT + 0.06, same_lineage=same)  # -0.04: the honest minimum measured
    for _ in range(10 * REDUCED_WINDOW):  # another phi's honest reducer: refused, never an offence
        with pytest.raises(PartRefused, match="points against"):
            check("QmElsewhere", UNLINED_TURNED + 0.15, same_lineage=False)
    assert not rep.is_banned("QmElsewhere")
    turned = 0
    while not rep.is_banned("QmOther") and turned < 10 * REDUCED_WINDOW:
        with pytest.raises(PartRefused, match="points against"):
            check("QmOther", -0.8, same_lineage=False)
        turned += 1
    assert turned == REDUCED_WINDOW
    for _ in range(REDUCED_WINDOW):
        with pytest.raises(PartRefused, match="points against"):
            check("QmSame", -0.5, same_lineage=True)
    assert rep.is_banned("QmSame") and not rep.is_banned("QmHonest")


def test_a_flipper_is_banned_for_its_direction_whatever_lineage_it_names_an_honest_member_of_another_phi_never():
    """Contributions from another phi are judged too, with OTHER_LINEAGE_MARGIN added to their agreement: a flipper
    whose own rounds fail (so its phi is never ours) is banned after one window of its contributions, and one that
    alternates its claim is judged on both kinds together; an honest member of another lineage at the lowest mean
    measured (-0.06) is not, and neither is one that alternates lineages just above the bound of each."""
    from locoswarm.node.config import RobustSection
    from locoswarm.node.swarm.judging import OTHER_LINEAGE_MARGIN
    from locoswarm.node.swarm.reputation import Reputation

    r = RobustSection()
    rep = Reputation()
    judge = _part_judge(rep, robust=r).contribution
    judged = 0
    while not rep.is_banned("QmFlip") and judged < r.agreement_window:
        judge("QmFlip", -0.25, 4.0, same_lineage=False)  # the median a flipper from another phi measured
        judged += 1
    assert rep.is_banned("QmFlip") and 2 <= judged <= r.agreement_window
    for _ in range(50):
        judge("QmBehind", -0.06, 1.0, same_lineage=False)
        judge("QmBoth", r.agreement_ban + 0.01, 1.0, same_lineage=True)
        judge("QmBoth", r.agreement_ban - OTHER_LINEAGE_MARGIN + 0.01, 1.0, same_lineage=False)
    assert not rep.is_banned("QmBehind") and not rep.is_banned("QmBoth")
    for k in range(r.agreement_window):
        judge("QmSwitch", -0.25, 4.0, same_lineage=k % 2 == 0)
    assert rep.is_banned("QmSwitch")
    judge("QmLight", -0.9, 0.1, same_lineage=False)  # a joiner's step or two: not judged at all
    assert "QmLight" not in rep.snapshot()["peers"]


def test_a_member_most_of_the_round_excludes_is_banned_here_only_on_evidence_of_our_own() -> None:
    """Four honest members and two colluders: once three honest members exclude both colluders, the fourth sees
    a strict majority of the others against each (the partner's vote for its colluder does not save it). With
    two honest members and two colluders that exclude the other honest one, the colluders are a majority too:
    only this node's own judgements tell the cases apart (``Reputation.suspects``)."""
    honest = ["h1", "h2", "h3", "h4"]
    excluded = {"h1": ["f1", "f2"], "h2": ["f1", "f2"], "h3": ["f1", "f2"], "h4": [], "f1": [], "f2": []}
    members = [*honest, "f1", "f2"]
    assert sorted(majority_excluded(members, excluded, "h4", banned=[])) == ["f1", "f2"]
    assert majority_excluded(members, {**excluded, "h3": []}, "h4", banned=[]) == []  # 2 of 4: no majority
    # a peer banned here neither votes nor is judged again
    assert majority_excluded(members, excluded, "h4", banned=["f1"]) == ["f2"]
    # two honest, two colluders that exclude h1: a majority against h1 as h2 sees it
    liars = {"h1": [], "h2": [], "f1": ["h1"], "f2": ["h1"]}
    assert majority_excluded(["h1", "h2", "f1", "f2"], liars, "h2", banned=[]) == ["h1"]
    # fewer than two voters: nothing
    assert majority_excluded(["h1", "f1"], {"h1": ["f1"]}, "h2", banned=[]) == []
    # more than two thirds of at least three voters: what a node follows without evidence of its own. Three
    # honest voters out of four ban each colluder; two colluders framing an honest member hold 2 of 4.
    strict = {"share": FOLLOWED_SHARE, "min_voters": FOLLOWED_VOTERS}
    assert sorted(majority_excluded(members, excluded, "h4", banned=[], **strict)) == ["f1", "f2"]
    framing = {"h1": [], "h2": [], "h3": [], "h4": [], "f1": ["h1"], "f2": ["h1"]}
    assert majority_excluded(members, framing, "h4", banned=[]) == []
    # three honest and two colluders: 2 of 3 voters against h1 is a strict majority, not more than two thirds
    three = ["h1", "h2", "h3", "f1", "f2"]
    assert majority_excluded(three, framing, "h3", banned=[]) == ["h1"]
    assert majority_excluded(three, framing, "h3", banned=[], **strict) == []
    # two honest and two colluders: two voters are too few, however unanimous
    assert majority_excluded(["h1", "h2", "f1", "f2"], liars, "h2", banned=[], **strict) == []

    rep = Reputation(threshold=3)
    kw = {"window": 4, "ban_below": -0.1, "good_from": 0.1}
    for s in (0.2, 0.05, -0.1, 0.3):       # an honest member: judged good on balance
        rep.judge("h1", "direction", s, **kw)
    for s in (-0.05, 0.02, -0.3):          # a flipper seen mostly outvoted: little evidence, against it
        rep.judge("f1", "direction", s, **kw)
    for s in (-0.3, -0.4):                 # an honest reducer whose part colluders turned: not its own doing
        rep.judge("h3", "reduction", s, window=3, ban_below=-0.5, good_from=0.0)
    rep.judge("once", "direction", -0.5, **kw)
    assert not rep.suspects("h1", FOLLOWED_EVIDENCE)
    assert rep.suspects("f1", FOLLOWED_EVIDENCE)
    assert not rep.suspects("h3", FOLLOWED_EVIDENCE)
    assert not rep.suspects("once", ("direction",))      # one judgement is not evidence
    assert not rep.suspects("stranger", ("direction",))  # none at all


def test_a_node_that_never_met_two_colluders_follows_an_overwhelming_majority_but_no_framing() -> None:
    """Four honest members and two colluders, the fourth honest node without a judgement of its own: three of its
    four voters exclude each colluder, so it bans both (the others' exclusions keep them out of its groups, so it
    would never gather evidence). The same two colluders excluding an honest member ban nobody here, and with two
    honest members and two colluders the colluders' votes ban nobody without this node's own evidence."""
    rep = Reputation(threshold=3)
    stub = OffenceBook("h4", rep, RoundClaims())
    members = ["h1", "h2", "h3", "h4", "f1", "f2"]
    framing = {"h1": [], "h2": [], "h3": [], "h4": [], "f1": ["h1"], "f2": ["h1"]}
    stub.follow_majority_bans(members, framing, banned=[])
    assert rep.banned() == []
    stub.follow_majority_bans(["h1", "h2", "f1", "f2"], {"f1": ["h1"], "f2": ["h1"]}, banned=[])
    assert rep.banned() == []
    excluded = {"h1": ["f1", "f2"], "h2": ["f1", "f2"], "h3": ["f1", "f2"], "h4": [], "f1": [], "f2": []}
    stub.follow_majority_bans(members, excluded, banned=[])
    assert rep.banned() == ["f1", "f2"]
    assert all("majority_ban" in line for line in stub.refusals)


def test_a_node_that_caught_a_state_liar_once_follows_the_others_ban_of_it() -> None:
    """Three honest members and a state liar (``replayliar``): two honest nodes banned it for its lies
    (``RoundClaims.lies``), and the others' exclusions then keep it out of the third node's groups, so that node
    sees none of the rounds that would prove its next lies. One lie found here within ``CAUGHT_S`` is this node's
    own evidence for following the majority; without one, or once it has aged out, their exclusions ban nobody."""
    from locoswarm.node.swarm.versions import CAUGHT_S

    for lied in (False, True):
        rep, claims = Reputation(threshold=3), RoundClaims()
        stub = OffenceBook("h3", rep, claims)
        if lied:  # claimed v12 while its rounds, before and after the claim was seen, named v10
            claims.record(0, "liar", 10)
            claims.doubted(0, "liar", 12)
            time.sleep(0.002)
            claims.record(0, "liar", 10)
            assert claims.doubted(0, "liar", 12) and claims.lied("liar") and not claims.lied("h1")
            assert not claims.lied("liar", now=time.monotonic() + CAUGHT_S)
        excluded = {"h1": ["liar"], "h2": ["liar"], "h3": [], "liar": []}
        stub.follow_majority_bans(["h1", "h2", "h3", "liar"], excluded, banned=[])
        assert rep.banned() == (["liar"] if lied else []), lied
    # the liar's votes against an honest member ban nobody: no lie of that member's was found here
    stub.follow_majority_bans(["h1", "h2", "h3", "liar"], {"liar": ["h1"]}, banned=[])
    assert rep.banned() == ["liar"]


def test_a_node_one_offence_short_follows_the_majority_and_a_reduced_part_or_one_offence_is_no_evidence() -> None:
    """Three honest members and one attacker refused for its weight claims: two nodes banned it at their third
    offence, and placement then keeps it out of the third node's groups, where it stays at two. The other two
    excluding it are a majority of its voters (too few to follow without evidence), and its own two offences of
    what the attacker itself sent make the ban. Two colluders before two honest nodes are a majority too: they
    frame an honest member in vain where this node counted only one such offence of it, or refused its reduced
    parts (which colluders can turn), or where the offences were before its last ban ended."""
    clock = [0.0]
    rep = Reputation(threshold=3, cooldown_s=60.0, window_s=600.0, now=lambda: clock[0])
    stub = OffenceBook("h3", rep, RoundClaims())
    members = ["h1", "h2", "h3", "a"]
    excluded = {"h1": ["a"], "h2": ["a"], "h3": [], "a": []}
    rep.refuse("a", "bad_weight", "token weight 40 is more than 10x its bound 4")
    stub.follow_majority_bans(members, excluded, banned=[])
    assert rep.banned() == []                                  # one offence: not enough
    rep.refuse("a", "bad_weight", "token weight 40 is more than 10x its bound 4")
    stub.follow_majority_bans(members, {**excluded, "h2": []}, banned=[])
    assert rep.banned() == []                                  # 1 of 2 voters: no majority
    stub.follow_majority_bans(members, excluded, banned=[])
    assert rep.banned() == ["a"]
    assert "after 2 offences" in stub.refusals[-1]

    framed = {"h1": [], "h2": [], "f1": ["h1"], "f2": ["h1"]}
    four = ["h1", "h2", "f1", "f2"]
    rep3 = Reputation(threshold=3, cooldown_s=60.0, window_s=600.0, now=lambda: clock[0])
    stub = OffenceBook("h2", rep3, RoundClaims())
    rep3.refuse("h1", "bad_contribution", "norm 4x the reference (an honest joiner's first delta)")
    rep3.refuse("h1", "bad_reduction", "reduced part points against its own contribution")
    stub.follow_majority_bans(four, framed, banned=[])
    assert rep3.banned() == []                                 # a reduced part is no evidence, one offence too few
    rep3.refuse("h1", "clock", "claims a clock 9 steps ahead", offence=False)
    stub.follow_majority_bans(four, framed, banned=[])
    assert rep3.banned() == []
    assert rep3.offences("h1", FOLLOWED_OFFENCES) == 1 and rep3.offences("h1", ("bad_reduction",)) == 1
    rep3.refuse("h1", "replay", "2 of 2 chunks seen in round 40")
    stub.follow_majority_bans(four, framed, banned=[])
    assert rep3.banned() == ["h1"]                             # two of its own: the majority makes the ban
    # offences that earned a ban are spent: after it ends, the colluders' votes need two new ones
    rep4 = Reputation(threshold=3, cooldown_s=60.0, window_s=600.0, now=lambda: clock[0])
    stub = OffenceBook("h2", rep4, RoundClaims())
    for _ in range(3):
        rep4.refuse("f1", "bad_weight", "token weight 40 is more than 10x its bound 4")
    assert rep4.banned() == ["f1"]
    clock[0] += 61.0
    assert rep4.offences("f1", FOLLOWED_OFFENCES) == 0
    stub.follow_majority_bans(four, {"h1": ["f1"], "f2": ["f1"], "h2": [], "f1": []}, banned=[])
    assert rep4.banned() == []
    clock[0] += 600.0                                          # and offences leave the window
    rep4.refuse("f1", "replay", "2 of 2 chunks seen in round 40")
    rep4.refuse("f1", "replay", "2 of 2 chunks seen in round 41")
    assert rep4.offences("f1", FOLLOWED_OFFENCES) == 2
    clock[0] += 601.0
    assert rep4.offences("f1", FOLLOWED_OFFENCES) == 0


def test_a_node_whose_parts_of_a_reducer_spread_far_follows_the_others_ban_and_honest_spreads_frame_nobody() -> None:
    """3 + 1 with a reducer that adds a fixed pattern to its part (``reducedrift``): two honest nodes banned it, and
    placement then puts the third with it in pairs, where two excluding voters are too few to follow without
    evidence. Two of its parts judged here at 4.0x and 3.4x (of another phi: far from the 4x ban over four) are that
    evidence. Parts spreading as honest ones do (1.2x to 2.2x) are none: two colluders excluding an honest reducer
    before two honest nodes ban nobody; one part is never enough."""
    def judge(rep: Reputation, peer: str, ratios: tuple[float, ...], kind: str = "reduction_spread_other_phi") -> None:
        bound = SPREAD_BAN_OTHER_PHI if kind.endswith("other_phi") else SPREAD_BAN
        for r in ratios:  # as PartJudge.spreads records them
            rep.judge(peer, kind, -math.log(r), window=SPREAD_WINDOW, ban_below=-math.log(bound),
                      good_from=-math.log(SPREAD_BAN) / 2, accumulate=True)

    def stub_for(rep: Reputation, me: str) -> OffenceBook:
        return OffenceBook(me, rep, RoundClaims())

    assert set(FOLLOWED_SPREAD) == {"reduction_spread", "reduction_spread_other_phi"}
    members, excluded = ["h1", "h2", "h3", "a"], {"h1": ["a"], "h2": ["a"], "h3": [], "a": []}
    rep = Reputation(threshold=3)
    stub = stub_for(rep, "h3")
    judge(rep, "a", (4.0,))
    stub.follow_majority_bans(members, excluded, banned=[])
    assert rep.banned() == []                                  # one part: not evidence
    judge(rep, "a", (3.4,))
    assert rep.banned() == []                                  # not banned by its own spreads yet
    stub.follow_majority_bans(members, {**excluded, "h2": []}, banned=[])
    assert rep.banned() == []                                  # 1 of 2 voters: no majority
    stub.follow_majority_bans(members, excluded, banned=[])
    assert rep.banned() == ["a"] and "spread more than 2.5x" in stub.refusals[-1]

    # honest spreads, of either lineage, with colluders excluding that reducer before two honest nodes: no ban
    for ratios, kind in (((1.2, 2.2, 1.9), "reduction_spread"), ((2.2, 2.4), "reduction_spread_other_phi")):
        rep = Reputation(threshold=3)
        judge(rep, "h1", ratios, kind)
        stub_for(rep, "h2").follow_majority_bans( ["h1", "h2", "f1", "f2"],
                                             {"h1": [], "h2": [], "f1": ["h1"], "f2": ["h1"]}, banned=[])
        assert rep.banned() == [], ratios


def test_a_member_most_of_the_round_doubts_reduces_no_part_and_no_minority_takes_an_honest_part() -> None:
    """Muted by the honest reducers, a drifter still reduced its own part with its own contribution at full pull
    (3 + 1: +6.9% at equal progress). A member more than 2/3 of at least 3 others doubt reduces nothing; colluders
    doubting honest members never reach that, and a group is never left without a reducer."""
    h1, h2, h3, h4, d1, d2 = "QmH1", "QmH2", "QmH3", "QmH4", "QmD1", "QmD2"
    # 3 + 1: every honest member doubts the drifter
    members = [h1, h2, h3, d1]
    assert idle_reducers(members, {h: [d1] for h in (h1, h2, h3)}, members) == {d1}
    # ... two of three honest members are not enough (2/3 is not more than 2/3)
    assert idle_reducers(members, {h1: [d1], h2: [d1]}, members) == frozenset()
    # 4 + 2: all four honest members doubt both drifters, in whichever group they are
    members = [h1, h2, h3, h4, d1, d2]
    honest_doubts = {h: [d1, d2] for h in (h1, h2, h3, h4)}
    assert idle_reducers(members, honest_doubts, [h1, d1, d2]) == {d1, d2}, "the honest member reduces it all"
    assert idle_reducers(members, honest_doubts, [h2, h3]) == frozenset()
    # ... and the colluders doubting every honest member take nobody's part
    both = {**honest_doubts, d1: [h1, h2, h3, h4], d2: [h1, h2, h3, h4]}
    assert idle_reducers(members, both, [h1, d1, d2]) == {d1, d2}
    # 2 + 2, no honest majority: colluders doubting both honest members are 2 of 3 voters, not enough
    members = [h1, h2, d1, d2]
    assert idle_reducers(members, {d1: [h1, h2], d2: [h1, h2]}, members) == frozenset()
    # a group where everybody is doubted keeps every reducer; too few voters idle nobody
    members = [h1, h2, h3, d1, d2]
    every = {m: [x for x in members if x != m] for m in members}
    assert idle_reducers(members, every, [d1, d2]) == frozenset()
    assert idle_reducers([h1, d1], {h1: [d1]}, [h1, d1]) == frozenset()
    assert idle_reducers([h1, h2, d1], {h1: [d1], h2: [d1]}, [h1, h2, d1]) == frozenset(), "2 voters: too few"
    # the group's name says who is idle, so members that disagree fail fast instead of exchanging wrong parts
    assert group_hash([h1, d1]) != group_hash([h1, d1], {d1}) and group_hash([d1, h1]) == group_hash([h1, d1])


def test_a_match_entry_carries_whom_its_author_doubts_bounded() -> None:
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.matchmaking import MAX_EXCLUDED

    req = AverageRequest(fragment=0, round=8, chunks=[], weight=1.0, numel=0, codec="fp4", version=1)
    assert list(match_entry("QmA", req, 1.0, doubted=["QmZ", "QmY"]).doubted) == ["QmY", "QmZ"]
    many = [f"Qm{i:04d}" for i in range(MAX_EXCLUDED + 5)]
    assert len(match_entry("QmA", req, 1.0, doubted=many).doubted) == MAX_EXCLUDED


def test_behind_the_others_names_the_member_whose_version_every_other_member_has_left() -> None:
    from locoswarm.node.swarm.exchange import behind_the_others

    assert behind_the_others("QmJoiner", {"QmJoiner": 3, "QmA": 5, "QmB": 4})
    assert not behind_the_others("QmJoiner", {"QmJoiner": 3, "QmA": 5, "QmB": 3})  # an honest partner at 3
    assert not behind_the_others("QmA", {"QmJoiner": 3, "QmA": 5, "QmB": 4})
    assert not behind_the_others("QmAlone", {"QmAlone": 3})  # nobody else's claim known
    assert not behind_the_others("QmUnknown", {"QmA": 5})


def test_a_stale_senders_contributions_are_no_evidence_a_few_times_a_minute_then_judged_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A contribution from a sender whose version every other member of the round has left (a joiner whose snapshot
    went stale while it downloaded: honest ones measured -0.25 to +0.06 in 5 Mbit/s NAT runs, and one was banned)
    is not judged, STALE_GRACE times per STALE_GRACE_S; a flipper that stays the stale one is judged again after
    that and banned as before, and the grace comes back once the window has passed."""
    import locoswarm.node.swarm.judging as judging
    from locoswarm.node.config import RobustSection
    from locoswarm.node.swarm.reputation import Reputation

    now = [100.0]
    r = RobustSection()
    rep = Reputation()
    judge = _part_judge(rep, robust=r, now=lambda: now[0]).contribution
    for _ in range(judging.STALE_GRACE):
        judge("QmJoiner", -0.31, 1.0, same_lineage=False, stale=True)  # the banned joiner's scores
    assert not rep.is_banned("QmJoiner") and rep.offences("QmJoiner", ("direction",)) == 0
    # kept as this node's own view for following a majority's ban (a flipper the others banned at once)
    assert rep.suspects("QmJoiner", FOLLOWED_EVIDENCE)
    assert "direction" not in rep.snapshot()["peers"]["QmJoiner"]["scores"]
    now[0] += judging.STALE_GRACE_S + 1
    for _ in range(judging.STALE_GRACE):
        judge("QmJoiner", -0.31, 1.0, same_lineage=False, stale=True)
    assert not rep.is_banned("QmJoiner")
    judged = 0
    while not rep.is_banned("QmFlip") and judged < 3 * r.agreement_window:
        judge("QmFlip", -0.25, 4.0, same_lineage=False, stale=True)
        judged += 1
    assert rep.is_banned("QmFlip") and judged <= judging.STALE_GRACE + r.agreement_window


def test_a_stale_node_does_not_judge_a_part_of_the_groups_phi_against_its_own_stale_progress(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this node's version is below every other member's of the round, a reduced part of another phi that
    points against its own progress is applied (the round merges, and a catch-up under way lands at the group's
    state), is no evidence against the reducer and does not pause it as a catch-up source: pausing the only holders
    a NATed node could reach discarded every catch-up it started (three in 60 s). A part of the node's own lineage,
    or one while it is not stale, is refused and judged as before."""
    import locoswarm.node.swarm.judging as judging

    now = [1000.0]
    monkeypatch.setattr(judging.time, "monotonic", lambda: now[0])
    pauses = SourcePauses()  # shared by the catch-up's rule and the judge, as ``SwarmTransport`` builds them
    stub = catch_up(peer_id="QmMe", reputation=None, pauses=pauses,
                           view=SimpleNamespace(outbound_peers=set),
                           dial_failures=DialFailures(), deviations=DeviationMemory())
    rep = Reputation()
    judge = _part_judge(rep, pauses=pauses)

    def judged() -> list[str]:  # the reducers whose parts' direction was evidence here
        return sorted(p for p, r in rep.snapshot()["peers"].items()
                      if {"reduction", "reduction_other_phi"} & set(r["scores"]))
    source = lambda peer: stub.may_serve(peer)  # noqa: E731
    check = judge.reduced_direction
    check("QmAhead", -0.63, same_lineage=False, stale=True)  # applied: the round merges
    assert source("QmAhead") and judged() == []
    with pytest.raises(PartRefused):
        check("QmSameLineage", -0.63, same_lineage=True, stale=True)
    with pytest.raises(PartRefused):
        check("QmNotStale", -0.63, same_lineage=False, stale=False)
    assert judged() == ["QmNotStale", "QmSameLineage"]
    assert not source("QmSameLineage") and not source("QmNotStale")


def test_an_allowance_grants_n_uses_per_window_per_peer_and_forgets_the_oldest_peers() -> None:
    from locoswarm.node.swarm.reputation import Allowance

    now = [0.0]
    a = Allowance(2, 10.0, limit=2, now=lambda: now[0])
    assert a.take("p") and a.take("p") and not a.take("p")
    assert a.take("q")
    now[0] = 10.5
    assert a.take("p")  # the first two uses left the window
    a.take("r")  # a third peer: the least recently seen ("q") is forgotten
    assert a.take("q") and a.take("q") and not a.take("q")


def test_a_node_is_stale_only_where_the_swarms_corroborated_version_is_ahead_too() -> None:
    """An outbound-only node learns its round's versions from the reducers' replies, one at a time: a lone reducer
    claiming a version ahead must not make it skip the direction check of that reducer's part. It is stale only
    where every member it knows is ahead and so is the version two holders' heartbeats corroborate."""
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.versions import Belief

    believed = [5]
    swarm = SimpleNamespace(latest_versions=lambda fragment: Belief(believed[0]))
    view = SimpleNamespace(versions={"QmMe": 3, "QmReducer": 5})
    req = AverageRequest(fragment=0, round=100, chunks={}, numel=8, weight=1.0, version=3)
    stale = exchange(CODEC, peer_id="QmMe", view=swarm).stale_here
    assert stale(req, 5, view)
    believed[0] = 3  # nobody corroborates the reducer's claim: a liar ahead of the swarm
    assert not stale(req, 5, view)
    believed[0] = 5
    assert not stale(req, 3, view)  # the reducer is not ahead of this node
    assert not stale(req, 5, SimpleNamespace(versions={"QmMe": 3, "QmReducer": 5, "QmPartner": 3}))
    assert not stale(req, 5, None)


def test_the_share_of_a_rounds_members_of_this_nodes_phi_says_whether_it_is_in_step() -> None:
    """``kin_share`` (``AverageResult.kin``): the members that sent from this node's phi, itself included, over all
    whose lineage is known; 1.0 where none is (a fragment is in step where more than half are)."""
    from locoswarm.node.swarm.exchange import kin_share

    assert kin_share({}, 7) == 1.0
    assert kin_share({"me": 7, "a": 7, "b": 7}, 7) == 1.0
    assert kin_share({"me": 7, "a": 7, "b": 7, "c": 7, "liar1": 9, "liar2": 9}, 7) == pytest.approx(4 / 6)
    assert kin_share({"me": 7, "a": 7, "liar1": 9, "liar2": 9}, 7) == 0.5
    assert kin_share({"me": 7, "joiner": 3}, 7) == 0.5
