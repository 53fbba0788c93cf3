"""Robust aggregation (locoswarm.node.core.robust, locoswarm.node.transport.reduce): screening and every aggregator."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from torch.testing import assert_close

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.payload import chunk_bounds, decode_chunks, encode_chunks
from locoswarm.node.core.robust import (
    NORM_ABSURD,
    ClippedMean,
    ContributionStats,
    Median,
    TrimmedMean,
    agreement_scores,
    make_aggregator,
    median_rows,
    pull_factor,
    screen,
)
from locoswarm.node.transport.reduce import (
    ROUND_MUTES,
    PartContribution,
    combine_part,
    reduce_group,
    screen_part,
)

S = RobustSection()


def stats(sender: str, weight: float, norms: list[float], finite: bool = True, max_weight: float = math.inf):
    return ContributionStats(sender, weight, torch.tensor(norms, dtype=torch.float64), finite, max_weight)


def pulled(sc) -> list[int]:
    """The screened contributions that have pull (accepted and not muted for their norm)."""
    return [i for i, f in zip(sc.accepted, sc.factors, strict=True) if f > 0]


def honest(n: int, m: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(m, generator=gen)
    return [base + 0.3 * torch.randn(m, generator=gen) for _ in range(n)]


# ---- screening ----

def test_honest_group_is_accepted_unchanged() -> None:
    sc = screen([stats(f"p{i}", 100.0, [1.0 + 0.1 * i, 2.0]) for i in range(4)], S)
    assert sc.accepted == [0, 1, 2, 3]
    assert sc.weights == [100.0, 100.0, 100.0, 100.0]
    assert not sc.refusals and not sc.clamped


def test_a_claim_above_the_groups_median_buys_no_pull() -> None:
    """weight_factor 1 (the default): whatever a member claims above the lower median, it enters with the
    median; a lighter member (a joiner, a slower node) keeps its lighter weight. With a trusted member, its
    own claim is a floor of the reference (joiners do not cap a whole round's honest claim)."""
    sc = screen([stats("a", 100.0, [1.0]), stats("b", 120.0, [1.0]), stats("c", 30.0, [1.0]),
                 stats("x", 400.0, [1.0])], S)
    assert sc.weights == [100.0, 100.0, 30.0, 100.0] and sc.clamped == ["b", "x"]
    # two colluders claiming 4x next to two honest members: the lower median is an honest claim
    sc = screen([stats("me", 100.0, [1.0]), stats("h", 100.0, [1.0]), stats("x", 400.0, [1.0]),
                 stats("y", 400.0, [1.0])], S, trusted=0)
    assert sc.weights == [100.0, 100.0, 100.0, 100.0]
    # two joiners (2 tokens each) next to the reducer's whole round: the reducer's claim is the reference
    sc = screen([stats("me", 100.0, [1.0]), stats("j1", 2.0, [0.1]), stats("j2", 2.0, [0.1]),
                 stats("h", 100.0, [1.0])], S, trusted=0)
    assert sc.weights == [100.0, 2.0, 2.0, 100.0]


@pytest.mark.parametrize(("weight", "finite", "norm", "kind", "conclusive"), [
    (100.0, False, 1.0, "bad_contribution", True),          # nan/inf values: nothing honest sends them
    (100.0, True, 1e30, "bad_contribution", True),          # absurd norm: neither
    (1e30, True, 1.0, "bad_weight", False),                 # absurd token weight (a bound from heartbeats)
    (float("nan"), True, 1.0, "bad_weight", False),
    (-5.0, True, 1.0, "bad_weight", False),
    (0.0, True, 1.0, "bad_weight", False),
])
def test_a_bad_member_is_refused_and_the_rest_accepted(weight, finite, norm, kind, conclusive) -> None:
    group = [stats("a", 100.0, [1.0]), stats("b", 110.0, [1.2]), stats("x", weight, [norm], finite=finite)]
    sc = screen(group, S)
    assert sc.accepted == [0, 1]
    assert [(r.sender, r.kind, r.conclusive) for r in sc.refusals] == [("x", kind, conclusive)]
    # b's 110 enters at the median claim where x's weight is one of the claims (refused later, for its norm)
    assert sc.total_weight == (200.0 if kind == "bad_contribution" and finite else 210.0)


def test_weights_are_clamped_to_a_multiple_of_the_median() -> None:
    sc = screen([stats("a", 100.0, [1.0]), stats("b", 100.0, [1.0]), stats("x", 900.0, [1.0])], S)
    assert sc.accepted == [0, 1, 2]
    assert sc.weights == [100.0, 100.0, S.weight_factor * 100.0]
    assert sc.clamped == ["x"]


def test_a_senders_own_cap_clamps_its_weight() -> None:
    generous = RobustSection(weight_factor=4.0)
    sc = screen([stats("a", 100.0, [1.0]), stats("b", 100.0, [1.0]), stats("x", 300.0, [1.0], max_weight=150.0)],
                generous)
    assert sc.weights == [100.0, 100.0, 150.0]


def test_a_claim_far_above_a_young_reference_is_clamped_not_refused_within_the_senders_bound() -> None:
    # The reducer just joined and claims 2 tokens; the honest peer claims a whole round of 4000. Its bound
    # (from its throughput over a whole carry) allows that: clamped to the pair's cap, no offence.
    sc = screen([stats("me", 2.0, [1.0]), stats("peer", 4000.0, [1.0], max_weight=50_000.0)], S, trusted=0)
    assert sc.accepted == [0, 1] and not sc.refusals
    assert sc.weights == [2.0, S.weight_factor * 2.0]
    # Past WEIGHT_ABSURD times its own bound it is refused, whatever the reference.
    sc = screen([stats("me", 1e6, [1.0]), stats("peer", 101 * 50_000.0, [1.0], max_weight=50_000.0)], S, trusted=0)
    assert [(r.sender, r.kind) for r in sc.refusals] == [("peer", "bad_weight")]


def test_norm_just_below_the_reject_factor_has_pull_just_above_none() -> None:
    ok = screen([stats("a", 1, [1.0]), stats("b", 1, [1.0]), stats("x", 1, [S.reject_factor * 0.99])], S)
    bad = screen([stats("a", 1, [1.0]), stats("b", 1, [1.0]), stats("x", 1, [S.reject_factor * 1.01])], S)
    assert pulled(ok) == [0, 1, 2]
    assert pulled(bad) == [0, 1] and not bad.refusals


def test_trusted_member_is_never_refused_and_is_the_reference_of_a_pair() -> None:
    # In a pair the reducer's own contribution is the reference: the other's 20x norm has no pull ...
    sc = screen([stats("me", 100.0, [1.0]), stats("x", 100.0, [20.0])], S, trusted=0)
    assert pulled(sc) == [0] and sc.muted[1]
    # ... even when the other one is tiny (no lower median to hide behind), and the reducer itself is
    # kept however odd its own values are.
    sc = screen([stats("me", 100.0, [50.0]), stats("x", 100.0, [1.0])], S, trusted=0)
    assert sc.accepted == [0, 1]
    sc = screen([stats("me", 100.0, [1.0], finite=False), stats("x", 100.0, [1.0])], S, trusted=0)
    assert 0 in sc.accepted


def test_a_contribution_of_more_tokens_may_be_larger_in_proportion() -> None:
    """A reducer that just caught up made 2 steps of its own; its partner brings a whole round (8 steps,
    within the clamp of weight_factor times the reference). The partner's 20x norm is 5x per token:
    accepted. The same norm for the same tokens as the reducer's is still refused, and a claim of more
    tokens buys at most the clamp's factor."""
    generous = RobustSection(weight_factor=4.0)
    assert pulled(screen([stats("me", 2.0, [1.0]), stats("x", 8.0, [20.0])], generous, trusted=0)) == [0, 1]
    assert pulled(screen([stats("me", 2.0, [1.0]), stats("x", 2.0, [20.0])], generous, trusted=0)) == [0]
    # the default clamp (the median) still lets a claim of more tokens through the norm limit, up to its bound
    assert pulled(screen([stats("me", 2.0, [1.0]), stats("x", 8.0, [20.0])], S, trusted=0)) == [0, 1]
    assert pulled(screen([stats("me", 2.0, [1.0]), stats("x", 8.0, [20.0], max_weight=2.0)], S, trusted=0)) == [0]


def test_a_large_norm_has_no_pull_an_absurd_one_is_refused() -> None:
    """A pair: a partner far larger than the reducer may be honest (the reducer made little progress): no pull,
    not refused; a norm beyond NORM_ABSURD times the reference is refused, conclusively."""
    large = screen([stats("me", 1.0, [1.0]), stats("x", 1.0, [20.0])], S, trusted=0)
    absurd = screen([stats("me", 1.0, [1.0]), stats("x", 1.0, [1e30])], S, trusted=0)
    assert large.accepted == [0, 1] and not large.refusals and large.factors == [1.0, 0.0] and large.muted[1]
    assert [(r.kind, r.conclusive) for r in absurd.refusals] == [("bad_contribution", True)]
    assert 1e3 * S.reject_factor < NORM_ABSURD  # honest progress differences stay far below it


def test_a_pair_without_a_trusted_side_is_not_judged() -> None:
    sc = screen([stats("a", 100.0, [1.0]), stats("b", 100.0, [20.0])], S)
    assert sc.accepted == [0, 1]


def test_a_lone_change_where_everyone_else_changed_nothing_has_no_pull() -> None:
    sc = screen([stats("a", 1, [0.0]), stats("b", 1, [0.0]), stats("x", 1, [3.0])], S)
    assert pulled(sc) == [0, 1]


# ---- aggregators ----

def test_clipped_mean_equals_the_weighted_mean_for_honest_rows() -> None:
    rows = torch.stack(honest(4))
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert_close(ClippedMean().combine(rows, w, median_rows(rows), torch.ones(4)), (w / w.sum()) @ rows)


def test_clipped_mean_scales_deviations_from_the_centre() -> None:
    centre = torch.randn(100)
    rows = torch.stack([centre + 0.01, centre - 0.01, centre + 3.0])
    out = ClippedMean().combine(rows, torch.ones(3), centre, torch.tensor([1.0, 1.0, 0.01]))
    assert_close(out, centre + 0.01, atol=1e-6, rtol=0)
    # the plain mean ignores the scales
    assert_close(make_aggregator(RobustSection(aggregator="mean")).combine(rows, torch.ones(3), centre,
                                                                           torch.tensor([1.0, 1.0, 0.01])),
                 rows.mean(0))


def test_rows_without_pull_are_left_out() -> None:
    rows = torch.stack([torch.ones(5), 3 * torch.ones(5), -100 * torch.ones(5)])
    out = ClippedMean().combine(rows, torch.tensor([1.0, 1.0, 0.0]), torch.zeros(5))
    assert_close(out, 2 * torch.ones(5))


def test_median_rows_is_the_midpoint_for_an_even_count() -> None:
    rows = torch.tensor([[1.0, 5.0], [3.0, -1.0], [2.0, 0.0], [100.0, 2.0]])
    assert_close(median_rows(rows), torch.tensor([2.5, 1.0]))
    assert_close(median_rows(rows[:3]), torch.tensor([2.0, 0.0]))


def test_trimmed_mean_drops_extremes_per_coordinate() -> None:
    rows = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [1000.0, -1000.0]])
    out = TrimmedMean(0.25).combine(rows, torch.ones(5), torch.zeros(2))
    # n = 5: one value dropped from each side per coordinate
    assert_close(out, torch.tensor([3.0, 20.0]))
    assert TrimmedMean(0.25).trim_count(2) == 0 and TrimmedMean(0.25).trim_count(3) == 1


def test_weighted_median_by_hand() -> None:
    rows = torch.tensor([[1.0], [2.0], [100.0]])
    c = torch.zeros(1)
    assert float(Median().combine(rows, torch.tensor([1.0, 1.0, 1.0]), c)) == 2.0
    # the heavy member decides alone once it holds more than half of the weight
    assert float(Median().combine(rows, torch.tensor([1.0, 1.0, 5.0]), c)) == 100.0
    assert float(Median().combine(rows, torch.tensor([3.0, 1.0, 1.0]), c)) == 1.0


@pytest.mark.parametrize("name", ["clipped_mean", "trimmed_mean", "median", "mean"])
def test_every_aggregator_recovers_identical_rows(name: str) -> None:
    x = torch.randn(257)
    rows = torch.stack([x, x, x, x])
    out = make_aggregator(RobustSection(aggregator=name)).combine(rows, torch.tensor([1.0, 2.0, 3.0, 4.0]), x,
                                                                 torch.ones(4))
    assert_close(out, x)


# ---- direction: agreement and pull ----

def test_pull_rises_linearly_from_the_floor_to_full() -> None:
    assert pull_factor(None, S) == 1.0
    assert pull_factor(S.agreement_floor, S) == 0.0 and pull_factor(-1.0, S) == 0.0
    assert pull_factor(S.agreement_full, S) == 1.0 and pull_factor(0.9, S) == 1.0
    assert pull_factor(0.5 * (S.agreement_floor + S.agreement_full), S) == pytest.approx(0.5)


def test_agreement_is_the_larger_cosine_with_the_others_median_and_the_reducers_own() -> None:
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(2000, generator=gen)
    own, h = common + torch.randn(2000, generator=gen), common + torch.randn(2000, generator=gen)
    rows = torch.stack([own, h, -5 * h])
    scores = agreement_scores(lambda k: rows, 1, trusted=0)
    assert scores[0] is None                       # the reducer's own is not judged
    assert scores[1].score > 0.3 and scores[2].score < -0.3     # the honest member agrees, its flip does not
    assert scores[1].evidence == scores[1].score and scores[2].evidence == scores[2].score
    # no row changes nothing: a zero row has no direction to judge
    assert agreement_scores(lambda k: torch.stack([own, torch.zeros(2000)]), 1, trusted=0)[1] is None


def test_two_colluders_that_outvote_the_reducer_keep_their_pull_but_earn_no_good_evidence() -> None:
    """Grouped with two flippers, an honest reducer sees each agree with the other (the median of the others
    leans on its partner): the larger cosine keeps their pull, as the reducer may be the odd one out, but it is
    no evidence of good intent; in a group with an honest majority the same flips are evidence against them."""
    gen = torch.Generator().manual_seed(1)
    common = torch.randn(2000, generator=gen)
    own, h, f = (common + torch.randn(2000, generator=gen) for _ in range(3))
    colluders = agreement_scores(lambda k: torch.stack([own, -2.5 * h, -2.5 * f]), 1, trusted=0)
    for a in colluders[1:]:
        assert a.with_own < -0.3 and a.with_others > 0.3 and a.score > 0.3
        assert a.evidence is None
    honest_majority = agreement_scores(lambda k: torch.stack([own, h, -2.5 * f]), 1, trusted=0)
    assert honest_majority[1].evidence > 0.3 and honest_majority[2].evidence < -0.3
    # once another member of the round excludes them, their disagreement with the reducer's own counts
    for a in colluders[1:]:
        assert a.outvoted and a.evidence_where(accused=True) == a.with_own < -0.3
        assert a.evidence_where(accused=False) is None
    # an accused honest member that agrees with the reducer is judged as it pulls, not by a colluder's median
    framed = agreement_scores(lambda k: torch.stack([own, h, -2.5 * f]), 1, trusted=0)[1]
    assert not framed.outvoted and framed.evidence_where(accused=True) == framed.score > 0.3


def test_in_a_pair_a_disagreement_weighs_nothing_and_is_no_evidence_against_either() -> None:
    """Two members: the reducer's own contribution is the only other one, so a member pointing against it has
    no pull (as in any group) but is no evidence for a ban, however far apart: the reducer may be the odd one.
    A third member makes it evidence again."""
    gen = torch.Generator().manual_seed(2)
    common = torch.randn(2000, generator=gen)
    own, h, third = (common + torch.randn(2000, generator=gen) for _ in range(3))
    pair = agreement_scores(lambda k: torch.stack([own, -2.5 * h]), 1, trusted=0)[1]
    assert pair.score < -0.3 and pull_factor(pair.score, S) == 0.0
    assert pair.others == 1 and pair.evidence is None
    agreeing = agreement_scores(lambda k: torch.stack([own, h]), 1, trusted=0)[1]
    assert agreeing.score > 0.3 and agreeing.evidence is None
    trio = agreement_scores(lambda k: torch.stack([own, -2.5 * h, third]), 1, trusted=0)[1]
    assert trio.others == 2 and trio.evidence is not None and trio.evidence < -0.3
    # unless another member of the round already excludes the sender: then its disagreement counts in a pair
    assert pair.evidence_where(accused=True) == pair.score and pair.evidence_where(accused=False) is None
    assert trio.evidence_where(accused=False) == trio.evidence == trio.evidence_where(accused=True)


def _part(codec, xs, weights):
    numel = xs[0].numel()
    bounds = chunk_bounds(numel, codec.block_size)
    sizes = {c: b - a for c, (a, b) in enumerate(bounds)}
    cons = [PartContribution(f"p{i}", w, dict(enumerate(encode_chunks(codec, x)))) for i, (x, w) in
            enumerate(zip(xs, weights, strict=True))]
    return sizes, cons


def _reduce(codec, xs, weights, *, trusted=0, settings=S):
    sizes, cons = _part(codec, xs, weights)
    sc = screen_part(codec, cons, sizes, settings, trusted=trusted)
    reduced = combine_part(codec, cons, sc, sizes, make_aggregator(settings))
    return sc, decode_chunks(codec, [reduced[c] for c in sorted(reduced)], xs[0].numel())


def _members(n: int, m: int = 20_000, noise: float = 1.5, seed: int = 0) -> list[torch.Tensor]:
    """Honest pseudo-gradients: a common direction plus each member's own noise (agreement about 0.3, as on
    the tiny presets)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(m, generator=gen)
    return [common + noise * torch.randn(m, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("attack", ["flip", "ipm", "flip_x2"])
def test_a_direction_attack_inside_every_norm_bound_has_no_pull(attack: str) -> None:
    """A member that sends its own progress negated and scaled (inside the reject factor), a small negative
    multiple of the honest mean (IPM), or two colluders doing the same: no pull, and the part is the honest
    members' mean (only fp32 rounding apart), although no contribution is refused."""
    codec = get_codec("fp32", 64)
    xs = _members(4 if attack == "flip_x2" else 3)
    if attack == "flip":
        bad = [-5.0 * xs[-1]]
    elif attack == "ipm":
        bad = [-0.5 * sum(xs) / len(xs)]
    else:
        bad = [-5.0 * xs[-1], -5.0 * xs[-2]]
    sc, avg = _reduce(codec, [*xs, *bad], [100.0] * (len(xs) + len(bad)))
    assert not sc.refusals and len(sc.accepted) == len(xs) + len(bad)
    assert sc.factors[-len(bad):] == [0.0] * len(bad)
    assert all(f == 1.0 for f in sc.factors[:len(xs)])
    assert_close(avg, sum(xs) / len(xs), atol=1e-4, rtol=1e-4)


def test_two_colluders_sending_one_vector_do_not_turn_an_honest_member_into_the_outlier() -> None:
    """No honest majority: the reducer, one honest member and two colluders with identical vectors, which are
    then the median of every other set of three. The reducer's own contribution (trusted) keeps the honest
    member's agreement up; the colluders' flip has no pull."""
    codec = get_codec("fp32", 64)
    own, h = _members(2)
    v = -2.0 * (own + h)
    sc, avg = _reduce(codec, [own, h, v, v.clone()], [100.0] * 4)
    assert sc.factors == [1.0, 1.0, 0.0, 0.0]
    assert_close(avg, (own + h) / 2, atol=1e-4, rtol=1e-4)


def test_a_drift_that_agrees_is_clipped_to_the_groups_radius() -> None:
    """A member that adds a large fixed pattern to its honest progress agrees in direction (its pull stays) but
    its deviation from the centre is scaled down to clip_factor times the median deviation: it moves the
    part by at most its weight share times that radius."""
    codec = get_codec("fp32", 64)
    xs = _members(3)
    pattern = torch.sign(torch.randn(20_000, generator=torch.Generator().manual_seed(9)))
    drift = xs[0] + 5.0 * pattern * float(xs[0].norm()) / 20_000 ** 0.5  # a pattern 5x its own norm
    sc, avg = _reduce(codec, [*xs, drift], [1.0] * 4)
    assert sc.factors[-1] > 0 and sc.scales[-1] < 1.0 and sc.scales[:3] == [1.0, 1.0, 1.0]
    rows = torch.stack([*xs, drift])
    centre = median_rows(rows)
    deviations = sorted(float((x - centre).norm()) for x in rows)
    radius = S.clip_factor * 0.5 * (deviations[1] + deviations[2])
    # the drifter's deviation entered at the radius: its displacement of the mean is a quarter of it
    clipped_drift = centre + (drift - centre) * radius / float((drift - centre).norm())
    assert_close(avg, (sum(xs) + clipped_drift) / 4, atol=1e-4, rtol=1e-4)
    unclipped = float(((sum(xs) + drift) / 4 - sum(xs) / 3).norm())
    assert float((avg - sum(xs) / 3).norm()) < 0.6 * unclipped


def test_a_member_most_of_the_round_mutes_has_no_pull_in_a_pair_whose_reducer_would_give_it_some() -> None:
    """A drifter that most of the round mutes for its standing drift (``round_mutes``) in a pair with a reducer
    whose own measure gives it full pull (its progress agrees): no pull there, the part is the reducer's own
    contribution, and it is still judged (its agreement score is kept as evidence). The reducer's own contribution
    is never muted so, and a consensus round (phi itself) ignores it."""
    codec = get_codec("fp32", 64)
    own, drifter = _members(2)
    sizes, cons = _part(codec, [own, drifter], [100.0, 100.0])
    plain = screen_part(codec, cons, sizes, S, trusted=0)
    assert plain.factors == [1.0, 1.0] and plain.muted == [None, None]
    sc = screen_part(codec, cons, sizes, S, trusted=0, round_mutes={"p1", "p0"})
    assert sc.factors == [1.0, 0.0] and sc.muted == [None, ROUND_MUTES] and sc.scores[1] is not None
    reduced = combine_part(codec, cons, sc, sizes, make_aggregator(S))
    assert_close(decode_chunks(codec, [reduced[c] for c in sorted(reduced)], own.numel()), own)
    centers = {c: own[a:b] for c, (a, b) in enumerate(chunk_bounds(own.numel(), 64))}
    consensus = screen_part(codec, cons, sizes, S, trusted=0, centers=centers, round_mutes={"p1"})
    assert consensus.muted[1] != ROUND_MUTES


# ---- parts: the passes over codec bytes ----


@pytest.mark.parametrize("codec_name", ["fp32", "fp4"])
def test_a_poisoned_member_is_dropped_and_the_part_is_the_honest_mean(codec_name: str) -> None:
    codec = get_codec(codec_name, 64)
    xs = honest(3, m=40_000)
    sizes, cons = _part(codec, [*xs, torch.full((40_000,), 1e30)], [1.0, 1.0, 1.0, 1.0])
    sc = screen_part(codec, cons, sizes, S, trusted=0)
    assert sc.accepted == [0, 1, 2] and sc.refusals[0].sender == "p3"
    reduced = combine_part(codec, cons, sc, sizes, make_aggregator(S))
    avg = decode_chunks(codec, [reduced[c] for c in sorted(reduced)], 40_000)
    honest_mean = sum(decode_chunks(codec, [c.chunks[k] for k in sorted(c.chunks)], 40_000) for c in cons[:3]) / 3
    rel = float(torch.linalg.vector_norm(avg - honest_mean) / torch.linalg.vector_norm(honest_mean))
    assert rel < (1e-6 if codec_name == "fp32" else 0.3)


def test_nan_in_one_chunk_refuses_the_whole_contribution() -> None:
    codec = get_codec("fp32", 64)
    xs = honest(3, m=40_000)
    sizes, cons = _part(codec, xs, [1.0, 1.0, 1.0])
    last = max(cons[2].chunks)
    data = bytearray(cons[2].chunks[last])
    data[8:12] = struct.pack("<f", float("nan"))   # one value of the last chunk (the codec never encodes nan)
    cons[2].chunks = {**cons[2].chunks, last: bytes(data)}
    sc = screen_part(codec, cons, sizes, S)
    assert sc.accepted == [0, 1]


def test_consensus_drift_within_tolerance_is_never_clipped_but_a_wild_phi_has_no_pull() -> None:
    codec = get_codec("fp32", 64)
    phi = torch.randn(20_000)
    drifted = phi + 0.01 * phi.norm() / math.sqrt(20_000) * torch.randn(20_000)   # ~1% of |phi|
    wild = phi * 2.0  # 100% of |phi| away: beyond reject_factor x consensus_tolerance (80%)
    sizes, cons = _part(codec, [phi, drifted, wild], [1.0, 1.0, 1.0])
    centers = {c: phi[a:b] for c, (a, b) in enumerate(chunk_bounds(20_000, 64))}
    sc = screen_part(codec, cons, sizes, S, trusted=0, centers=centers)
    assert pulled(sc) == [0, 1] and sc.muted[2] and not sc.refusals
    reduced = combine_part(codec, cons, sc, sizes, make_aggregator(S), centers=centers)
    avg = decode_chunks(codec, [reduced[c] for c in sorted(reduced)], 20_000)
    assert_close(avg, (phi + drifted) / 2, atol=1e-5, rtol=0)


def test_reduce_group_reports_the_weight_each_member_entered_with() -> None:
    codec = get_codec("fp32", 64)
    xs = honest(3, m=50_000)
    payloads = [encode_chunks(codec, x) for x in [*xs, torch.full((50_000,), 1e30)]]
    reduced, _, _, entered = reduce_group(codec, payloads, [10.0, 10.0, 10.0, 10.0], 50_000, S, make_aggregator(S))
    assert entered == [10.0, 10.0, 10.0, 0.0]
    avg = decode_chunks(codec, reduced, 50_000)
    assert_close(avg, sum(xs) / 3, atol=1e-5, rtol=1e-5)


def test_the_node_bounds_a_peers_claim_by_a_whole_carry_not_by_its_own_young_claim(tmp_path) -> None:
    from types import SimpleNamespace

    from locoswarm.node.config import config_from_dict
    from locoswarm.node.daemon import MIN_CARRY_ALLOWANCE, Node, NodeOptions

    cfg = config_from_dict({"inner": {"batch_size": 4, "seq_len": 32}, "outer": {"h": 10, "max_carry": 4}})
    node = Node(cfg, NodeOptions(state_dir=tmp_path))
    node.tokens_per_s = 1000.0
    whole_carry = 4 * 32 * 10 * (max(4, MIN_CARRY_ALLOWANCE) + 1)
    slack = cfg.robust.weight_factor
    # No heartbeat yet: the slack over a whole carry, however little this node claims itself.
    assert node.max_weight("peer", 2.0) == slack * whole_carry
    # A peer twice as fast may claim twice as much; one slower is not held below our own bound.
    node.peer_table["fast"] = SimpleNamespace(tokens_per_s=2000.0)
    node.peer_table["slow"] = SimpleNamespace(tokens_per_s=10.0)
    assert node.max_weight("fast", 2.0) == 2 * slack * whole_carry
    assert node.max_weight("slow", 2.0) == slack * whole_carry
    # Our own claim above a whole carry (many failed rounds) raises the bound with it.
    assert node.max_weight("peer", 10 * whole_carry) == slack * 10 * whole_carry
    # A claim of a normal round against our young one passes screening (clamped), a 1e30 one does not.
    round_tokens = 4 * 32 * 10
    ok = screen([stats("me", 2.0, [1.0]), stats("peer", round_tokens, [1.0], max_weight=node.max_weight("peer", 2.0))],
                S, trusted=0)
    bad = screen([stats("me", 2.0, [1.0]), stats("peer", 1e30, [1.0], max_weight=node.max_weight("peer", 2.0))],
                 S, trusted=0)
    assert not ok.refusals and [r.kind for r in bad.refusals] == ["bad_weight"]
