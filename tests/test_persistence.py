"""Persistent deviations (locoswarm.node.core.persistence): a drift that repeats its pattern loses its radius."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.payload import chunk_bounds, decode_chunks, encode_chunks
from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.core.robust import make_aggregator
from locoswarm.node.transport.reduce import PartContribution, combine_part, screen_part

M = 4096
CODEC = get_codec("fp32", 1024)
BOUNDS = chunk_bounds(M, CODEC.block_size)
SIZES = {c: hi - lo for c, (lo, hi) in enumerate(BOUNDS)}


def round_rows(step: int, pattern: torch.Tensor | None, honest: int = 3) -> list[torch.Tensor]:
    """One round: honest progress (a shared direction plus fresh noise each round); the last row adds
    ``pattern`` (a drift: the same every round) when given."""
    gen = torch.Generator().manual_seed(100 + step)
    base = torch.randn(M, generator=gen)
    rows = [base + 0.5 * torch.randn(M, generator=gen) for _ in range(honest)]
    if pattern is not None:
        rows.append(base + 0.5 * torch.randn(M, generator=gen) + pattern)
    return rows


def reduce(rows: list[torch.Tensor], settings: RobustSection, memory: DeviationMemory | None):
    cons = [PartContribution(f"p{i}", 1.0, dict(enumerate(encode_chunks(CODEC, r)))) for i, r in enumerate(rows)]
    screening = screen_part(CODEC, cons, SIZES, settings, trusted=0, memory=memory, fragment=3)
    reduced = combine_part(CODEC, cons, screening, SIZES, make_aggregator(settings))
    return screening, decode_chunks(CODEC, [reduced[c] for c in sorted(reduced)], M)


def pattern_drift(settings: RobustSection, memory: DeviationMemory | None, rounds: int = 12) -> float:
    """The averages' summed component along the drift's pattern, over ``rounds`` rounds (what it accumulates)."""
    pattern = 1.0 * (torch.randint(0, 2, (M,), generator=torch.Generator().manual_seed(7)).float() * 2 - 1)
    unit = pattern / pattern.norm()
    total = 0.0
    for step in range(rounds):
        honest = round_rows(step, None)
        _, clean = reduce(honest, settings, None)
        _, attacked = reduce(round_rows(step, pattern), settings, memory)
        total += float((attacked - clean) @ unit)
    return total


def drifting_rounds(rounds: int) -> list:
    """The screenings of ``rounds`` rounds of three honest members (the first is the reducer) and a drift."""
    memory = DeviationMemory()
    pattern = torch.randn(M, generator=torch.Generator().manual_seed(1))
    return [reduce(round_rows(step, pattern), RobustSection(), memory)[0] for step in range(rounds)]


def test_a_fixed_pattern_is_persistent_and_noise_is_not() -> None:
    history = [sc.persistence for sc in drifting_rounds(6)]
    assert history[0] == [0.0] * 4  # nothing remembered yet
    for p in history[2:]:
        assert p[3] > 0.7, p  # the drift's deviation points the same way every round
        # honest rows deviate a little persistently too: the drift pulls the group's centre its way every round
        assert all(abs(x) < 0.3 for x in p[:3]), p


def test_a_persistent_drift_loses_its_radius_and_the_reducer_its_own_never() -> None:
    scales = [sc.scales for sc in drifting_rounds(5)]
    assert scales[0][3] < 1.0 and scales[-1][3] < 0.25 * scales[0][3], scales
    assert all(s[0] == 1.0 for s in scales)  # the reducer's own row (trusted) is never shrunk for persistence


def test_what_a_drift_accumulates_over_rounds_is_cut_by_the_memory() -> None:
    without = pattern_drift(RobustSection(), None)
    with_memory = pattern_drift(RobustSection(), DeviationMemory())
    off = pattern_drift(dataclasses.replace(RobustSection(), persistence_clip=False), DeviationMemory())
    assert without > 0 and abs(off - without) < 1e-6 * max(1.0, abs(without))
    # about half is left: the first round (nothing remembered yet) and the coordinate-wise median's own shift
    # toward the drift (19% of it with no radius at all for the drift) are not the memory's to take
    assert with_memory < 0.55 * without, (with_memory, without)


def test_honest_rows_keep_their_pull_with_the_memory() -> None:
    """Without a drift the memory changes the average by little: honest noise is not persistent."""
    memory = DeviationMemory()
    for step in range(8):
        rows = round_rows(step, None, honest=4)
        _, plain = reduce(rows, RobustSection(), None)
        screening, judged = reduce(rows, RobustSection(), memory)
        assert all(abs(p) < 0.15 for p in screening.persistence), screening.persistence
        assert float((judged - plain).norm()) < 0.1 * float(plain.norm())


def test_the_memory_is_bounded() -> None:
    memory = DeviationMemory(max_entries=5)
    for step in range(3):
        reduce(round_rows(step, None), RobustSection(), memory)
    assert len(memory) == 5


def test_the_shrink_is_relative_to_the_groups_median_persistence() -> None:
    """Only persistence above the group's median costs radius; the reducer's own never; a pair's two members (whose
    deviations from their mean are opposite, so equally persistent) keep their radius even at persistence 1."""
    from locoswarm.node.core.robust import persistence_shrink

    assert persistence_shrink([0.5, 0.5, 0.5, 0.9], trusted=0) == [1.0, 1.0, 1.0, pytest.approx(0.2)]
    assert persistence_shrink([0.95, 0.5, 0.5, 0.5], trusted=0) == [1.0, 1.0, 1.0, 1.0]
    assert persistence_shrink([1.0, 1.0], trusted=0) == [1.0, 1.0]
    assert persistence_shrink([1.0, 1.0 + 1e-9], trusted=None) == [1.0, 1.0]
    assert persistence_shrink([-0.2, -0.1, 0.6], trusted=None) == [1.0, 1.0, pytest.approx(0.4)]


def test_two_drifters_that_are_their_groups_median_lose_their_pull_by_their_standing_drift() -> None:
    """Two colluders add one pattern every round. In a group of three with them they are the coordinate-wise median,
    so their deviation from the centre is small; their difference from the reducer's own is not, and it persists
    round after round where honest members' differences (their own data plus fresh noise) persist much less. After
    a few rounds each has no pull in this reducer's parts in any group, and the honest ones always keep theirs."""
    gen = torch.Generator().manual_seed(5)
    bias = {name: 0.3 * torch.randn(M, generator=gen) for name in ("r", "h1", "h2", "h3", "d1", "d2")}
    pattern = torch.randint(0, 2, (M,), generator=gen).float() * 2 - 1
    unit = pattern / pattern.norm()
    groups = [("h1", "d1"), ("d1", "d2"), ("h2", "h3"), ("h3", "d2"), ("d2", "d1"), ("h1", "h2")]
    memory, settings = DeviationMemory(), RobustSection()
    late_drift = []
    for step in range(24):
        names = ["r", *groups[step % len(groups)]]
        base = torch.randn(M, generator=gen)
        rows = [base + 0.5 * torch.randn(M, generator=gen) + bias[n] + (pattern if n[0] == "d" else 0.0)
                for n in names]
        cons = [PartContribution(n, 1.0, dict(enumerate(encode_chunks(CODEC, x))))
                for n, x in zip(names, rows, strict=True)]
        screening = screen_part(CODEC, cons, SIZES, settings, trusted=0, memory=memory, fragment=3)
        muted = {names[i] for i, why in zip(screening.accepted, screening.muted, strict=True)
                 if why and "persists" in why}
        assert not muted & {"h1", "h2", "h3"}, (step, screening.muted)
        if step >= 14:  # every sender judged in DRIFT_ROUNDS rounds: the reference stands
            assert muted == {n for n in names if n[0] == "d"}, (step, screening.muted)
            if set(names) == {"r", "d1", "d2"}:
                reduced = combine_part(CODEC, cons, screening, SIZES, make_aggregator(settings))
                average = decode_chunks(CODEC, [reduced[c] for c in sorted(reduced)], M)
                late_drift.append(float((average - rows[0]) @ unit))
    assert late_drift and all(abs(d) < 1e-3 for d in late_drift)  # the group's average is the reducer's own


def test_doubted_senders_are_the_muted_ones_and_leave_only_well_below_the_bound() -> None:
    """What a reducer publishes as doubted (the round's idle reducers follow it) must not flip with a sender that
    hovers at the bound: it enters when muted and leaves only below half the margin."""
    from locoswarm.node.core.persistence import DRIFT_MARGIN, DRIFT_ROUNDS

    memory = DeviationMemory()
    senders = ["a", "b", "c", "x"]
    for _ in range(DRIFT_ROUNDS):
        why = memory.standing_drift(senders, [0.3, 0.3, 0.3, 0.95])
    assert why[3] is not None and why[:3] == [None] * 3
    assert memory.doubted() == ["x"]
    # x falls to just under the mute bound: no longer muted, still doubted
    level = 0.3 + DRIFT_MARGIN * 0.8
    while True:
        why = memory.standing_drift(senders, [0.3, 0.3, 0.3, level])
        if why[3] is None:
            break
    assert memory.doubted() == ["x"], "inside the hysteresis band it stays doubted"
    for _ in range(30):
        memory.standing_drift(senders, [0.3, 0.3, 0.3, 0.3])
    assert memory.doubted() == []
    memory.standing_drift(senders, [0.3, 0.3, 0.3, None])  # not measured: no change either way
    assert memory.doubted() == []


def test_without_an_honest_majority_a_ceiling_mutes_a_shared_pattern_and_never_the_honest_sender() -> None:
    """2 honest members (the reducer and h) and 2 drifters sharing one pattern: of the three senders judged, the
    median is a drifter's, so the median's bound alone mutes nobody. With a ceiling (``[robust] drift_ceiling``)
    both drifters are muted once judged, never h, and, muted round after round, kept apart (``apart``)."""
    from locoswarm.node.core.persistence import DRIFT_ROUNDS, SUSTAINED_MUTES

    def run(ceiling: float) -> tuple[DeviationMemory, set[str]]:
        gen = torch.Generator().manual_seed(11)
        bias = {name: 0.3 * torch.randn(M, generator=gen) for name in ("r", "h", "d1", "d2")}
        pattern = torch.randint(0, 2, (M,), generator=gen).float() * 2 - 1
        memory, settings = DeviationMemory(ceiling=ceiling), RobustSection()
        names = ["r", "h", "d1", "d2"]
        late: set[str] = set()
        for step in range(DRIFT_ROUNDS + SUSTAINED_MUTES + 2):
            base = torch.randn(M, generator=gen)
            rows = [base + 0.5 * torch.randn(M, generator=gen) + bias[n] + (pattern if n[0] == "d" else 0.0)
                    for n in names]
            cons = [PartContribution(n, 1.0, dict(enumerate(encode_chunks(CODEC, x))))
                    for n, x in zip(names, rows, strict=True)]
            screening = screen_part(CODEC, cons, SIZES, settings, trusted=0, memory=memory, fragment=0)
            muted = {names[i] for i, why in zip(screening.accepted, screening.muted, strict=True)
                     if why and "persists" in why}
            assert "h" not in muted, (step, screening.muted)
            if step > DRIFT_ROUNDS:
                late |= muted
        return memory, late

    memory, late = run(0.75)
    assert late == {"d1", "d2"}
    assert memory.apart() == ["d1", "d2"] and memory.drifting("d1") and not memory.drifting("h")
    memory, late = run(1.0)  # off (the default): the median is the drifters', nobody is muted or kept apart
    assert late == set() and memory.apart() == [] and not memory.drifting("d1")


def test_only_a_sender_muted_round_after_round_is_kept_apart_and_its_doubt_lapses() -> None:
    """Kept apart (and no state source) is a drift: muted in SUSTAINED_MUTES of its last SUSTAINED_OF judged rounds.
    A sender muted now and then (an honest member after an attack disturbed its rounds) never is. Kept apart, the
    two meet in no round, so the published doubt lapses DOUBT_S after the last mute; the record stays (no state
    source), and one more round together keeps it apart again at once."""
    from locoswarm.node.core.persistence import DOUBT_S, DRIFT_ROUNDS, SUSTAINED_MUTES, SUSTAINED_OF

    memory = DeviationMemory(ceiling=0.75)
    t = 0.0
    for _ in range(DRIFT_ROUNDS - 1):
        memory.standing_drift(["x"], [0.95], now=t)
    for _ in range(SUSTAINED_MUTES - 1):
        assert memory.standing_drift(["x"], [0.95], now=t)[0] is not None, "a pair: the ceiling alone mutes"
    assert memory.apart(now=t) == [], "muted, not yet round after round"
    assert memory.muted_lately("x", now=t + 0.5 * DOUBT_S) and not memory.muted_lately("x", now=t + 1.1 * DOUBT_S)
    assert not memory.muted_lately("nobody", now=t)
    memory.standing_drift(["x"], [0.95], now=t)
    assert memory.apart(now=t) == ["x"] and memory.drifting("x")
    assert memory.apart(now=t + 0.5 * DOUBT_S) == ["x"]
    assert memory.apart(now=t + 1.1 * DOUBT_S) == [] and memory.drifting("x")
    assert memory.standing_drift(["x"], [0.9], now=t + 2 * DOUBT_S)[0] is not None
    assert memory.apart(now=t + 2 * DOUBT_S) == ["x"], "one more round together: kept apart again at once"
    # a sender at the bound now and then: muted in at most one round of three, never kept apart
    other = DeviationMemory(ceiling=0.75)
    for i in range(DRIFT_ROUNDS + 3 * SUSTAINED_OF):
        other.standing_drift(["y"], [0.95 if i % 3 == 0 else 0.6], now=t)
        assert other.apart(now=t) == [] and not other.drifting("y")


def test_an_alarm_caps_the_bound_for_a_while_and_shuns_only_a_sender_muted_round_after_round() -> None:
    """No honest majority: the reducer judges its partner h and two drifters d1, d2 whose standing drift sets the
    senders' median, so nobody is muted. An alarm (the effect check saw the loss climb through rounds that each
    passed) caps the bound at ALARM_CEILING for ALARM_S: the drifters are muted from then on, never h, and once muted
    round after round they are shunned (kept out of this node's rounds) until the alarm lapses. Nobody is shunned
    whom the median mutes (an honest majority), nor with a configured ceiling: both keep drifters out by the
    published doubts already (``idle_reducers``, ``apart``)."""
    from locoswarm.node.core.persistence import ALARM_CEILING, ALARM_S, DRIFT_ROUNDS, SUSTAINED_MUTES

    senders, levels = ["h", "d1", "d2"], [0.45, 0.9, 0.9]
    assert levels[0] < ALARM_CEILING < levels[1]
    memory = DeviationMemory()
    t = 100.0
    for _ in range(DRIFT_ROUNDS + 2):
        assert memory.standing_drift(senders, levels, now=t) == [None] * 3, "the median is the drifters'"
    assert not memory.alarmed(now=t) and memory.shunned(now=t) == []
    memory.alarm(now=t)
    for i in range(SUSTAINED_MUTES):
        why = memory.standing_drift(senders, levels, now=t + i)
        assert why[0] is None and why[1] and why[2] and "alarm" in why[1], why
        assert memory.shunned(now=t + i) == ([] if i < SUSTAINED_MUTES - 1 else ["d1", "d2"])
    assert memory.drifting("d1", now=t + 10) and not memory.drifting("h", now=t + 10)
    later = t + ALARM_S + 1
    assert not memory.alarmed(now=later) and memory.shunned(now=later) == [] and not memory.drifting("d1", now=later)
    assert memory.standing_drift(senders, levels, now=later) == [None] * 3, "the median's bound again"
    # with an honest majority the senders' median mutes the drifter already (its published doubts idle it): an
    # alarm shuns nobody, so the members' exclusions do not change with each alarm
    majority = DeviationMemory()
    for i in range(DRIFT_ROUNDS + SUSTAINED_MUTES):
        majority.standing_drift(["h1", "h2", "h3", "d"], [0.4, 0.45, 0.4, 0.9], now=t + i)
        if i == DRIFT_ROUNDS:
            majority.alarm(now=t + i)
    assert majority.drifting("d", now=t + 10) and majority.shunned(now=t + 10) == []
    configured = DeviationMemory(ceiling=0.75)
    configured.alarm(now=t)
    for i in range(DRIFT_ROUNDS + SUSTAINED_MUTES):
        configured.standing_drift(senders, levels, now=t + i)
    assert configured.shunned(now=t + 10) == [] and configured.apart(now=t + 10) == ["d1", "d2"]
