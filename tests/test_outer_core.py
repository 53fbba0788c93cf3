"""The outer-loop core: outer optimizer, merge rules, schedules, payloads, group reduction and
the OuterLoop driven through the in-process hub (the way node/sim/simulator.py drives it)."""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from locoswarm.node.config import ModelSection, OuterSection, RobustSection
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.merge import (
    eager_outer_gradient,
    merge_alpha,
    merge_compensate,
    merge_rebase,
    merge_replace,
)
from locoswarm.node.core.outer_loop import OuterLoop
from locoswarm.node.core.outer_optimizer import NesterovOuterOptimizer
from locoswarm.node.core.payload import (
    CHUNK_TARGET_ELEMS,
    MIN_CHUNK_ELEMS,
    MIN_CHUNKS,
    chunk_bounds,
    chunk_elems,
    decode_chunks,
    encode_chunks,
    encode_with_feedback,
    payload_size,
)
from locoswarm.node.core.robust import make_aggregator
from locoswarm.node.core.schedule import AdaptiveSchedule, FixedSchedule, ScheduleView
from locoswarm.node.core.state import state_digest
from locoswarm.node.core.transport import (
    AverageHandle,
    AverageRequest,
    AverageResult,
    FetchHandle,
    FragmentSnapshot,
    Transport,
)
from locoswarm.node.model import build_model
from locoswarm.node.partition import partition
from locoswarm.node.transport.inprocess import HEADER_BYTES, InProcessHub
from locoswarm.node.transport.reduce import part_ranges, reducer_parts
from locoswarm.node.transport.reduce import reduce_group as _reduce_group

VOCAB = 257
CHUNK = chunk_elems(64)  # elements per chunk with 64-element blocks



def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ==================================================================================================
# 1. Outer optimizer
# ==================================================================================================


@pytest.mark.parametrize(("eta", "mu"), [(0.7, 0.9), (1.0, 0.5), (0.3, 0.99)])
def test_outer_step_matches_torch_sgd_nesterov(eta: float, mu: float) -> None:
    gen = torch.Generator().manual_seed(0)
    phi = torch.randn(257, generator=gen)
    buf = torch.zeros_like(phi)
    ref = torch.nn.Parameter(phi.clone())
    sgd = torch.optim.SGD([ref], lr=eta, momentum=mu, nesterov=True)
    opt = NesterovOuterOptimizer(eta, mu)
    phi_ptr, buf_ptr = phi.data_ptr(), buf.data_ptr()
    for _ in range(6):
        delta = torch.randn(257, generator=gen)
        opt.step(phi, buf, delta)
        ref.grad = delta.clone()
        sgd.step()
        assert_close(phi, ref.detach(), atol=1e-6, rtol=0)
        assert_close(buf, sgd.state[ref]["momentum_buffer"], atol=1e-6, rtol=0)
    assert (phi.data_ptr(), buf.data_ptr()) == (phi_ptr, buf_ptr)  # in place


def test_outer_step_first_step_by_hand() -> None:
    # b = 0.9*0 + d = d ; phi = phi - 0.5*(d + 0.9*d) = [1, 2] - 0.95*[2, -4] = [-0.9, 5.8]
    phi, buf = _t(1, 2), _t(0, 0)
    NesterovOuterOptimizer(0.5, 0.9).step(phi, buf, _t(2, -4))
    assert_close(buf, _t(2, -4))
    assert_close(phi, _t(-0.9, 5.8))


# ==================================================================================================
# 2. Merge rules against hand-computed examples
# ==================================================================================================

THETA = _t(1, 2, -1)
PHI = _t(3, 0, 1)


def test_merge_replace_returns_copy_of_phi() -> None:
    out = merge_replace(THETA, PHI)
    assert torch.equal(out, _t(3, 0, 1))
    out += 1
    assert torch.equal(PHI, _t(3, 0, 1))  # not an alias of phi


@pytest.mark.parametrize(("alpha", "expected"), [
    (0.5, (2.0, 1.0, 0.0)),    # 0.5*[1,2,-1] + 0.5*[3,0,1]
    (0.0, (3.0, 0.0, 1.0)),    # alpha = 0 is replace
    (0.25, (2.5, 0.5, 0.5)),   # 0.25*[1,2,-1] + 0.75*[3,0,1] = [0.25+2.25, 0.5, -0.25+0.75]
    (1.0, (1.0, 2.0, -1.0)),   # alpha = 1 keeps theta
])
def test_merge_alpha(alpha: float, expected: tuple[float, ...]) -> None:
    assert_close(merge_alpha(THETA, PHI, alpha), _t(*expected))


def test_merge_rebase_keeps_local_progress_on_new_phi() -> None:
    snapshot = _t(2, 2, 0)  # progress since send: snapshot - theta = [1, 0, 1]
    assert_close(merge_rebase(THETA, PHI, snapshot), _t(2, 0, 0))  # [3,0,1] - [1,0,1]


# Two tensors: elements [0, 2) and [2, 4). snapshot s = 1 everywhere.
#   tensor 1: g = s - theta = [1, 2], D = phi - s = [2, 1], g*g*D = [2, 4]
#             |g| = sqrt5, |g*g*D| = sqrt20 = 2 sqrt5 -> lambda_1 = 0.2 * sqrt5 / (2 sqrt5) = 0.1
#             g_hat = [1, 2] + 0.1*[2, 4] = [1.2, 2.4]
#   tensor 2: g = [3, 0], D = [1, 5], g*g*D = [9, 0], |g| = 3, |g*g*D| = 9 -> lambda_2 = 0.2*3/9 = 1/15
#             g_hat = [3 + 9/15, 0] = [3.6, 0]
#   theta = s - g = [0, -1, -2, 1], phi = s + D = [3, 2, 2, 6]
#   theta_new = phi - g_hat = [1.8, -0.4, -1.6, 6]
C_SNAP = _t(1, 1, 1, 1)
C_THETA = _t(0, -1, -2, 1)
C_PHI = _t(3, 2, 2, 6)
C_BOUNDS = [(0, 2), (2, 4)]


def test_merge_compensate_hand_example() -> None:
    out = merge_compensate(C_THETA, C_PHI, C_SNAP, 0.2, C_BOUNDS)
    assert_close(out, _t(1.8, -0.4, -1.6, 6.0))
    # inputs untouched (pure)
    assert torch.equal(C_THETA, _t(0, -1, -2, 1)) and torch.equal(C_PHI, _t(3, 2, 2, 6))


def test_merge_compensate_lambda_per_tensor_and_correction_norm() -> None:
    lambda0 = 0.2
    out = merge_compensate(C_THETA, C_PHI, C_SNAP, lambda0, C_BOUNDS)
    g = C_SNAP - C_THETA
    d = C_PHI - C_SNAP
    correction = (C_PHI - out) - g  # g_hat - g = lambda_i * g*g*D
    ggd = g * g * d
    # lambda_i read back from the correction: 0.1 on tensor 1, 1/15 on tensor 2 (where g*g*D != 0)
    assert_close(correction[0:2] / ggd[0:2], _t(0.1, 0.1))
    assert_close(correction[2:3] / ggd[2:3], _t(1 / 15))
    assert correction[3] == 0
    for a, b in C_BOUNDS:
        lam = lambda0 * torch.linalg.vector_norm(g[a:b]) / torch.linalg.vector_norm(ggd[a:b])
        assert_close(correction[a:b], lam * ggd[a:b])
        assert_close(torch.linalg.vector_norm(correction[a:b]), lambda0 * torch.linalg.vector_norm(g[a:b]))


def test_merge_compensate_lambda0_zero_is_rebase() -> None:
    out = merge_compensate(C_THETA, C_PHI, C_SNAP, 0.0, C_BOUNDS)
    assert_close(out, _t(2, 0, -1, 6))  # phi - g = [3-1, 2-2, 2-3, 6-0]
    assert_close(out, merge_rebase(C_THETA, C_PHI, C_SNAP))


def test_merge_compensate_without_local_progress_is_replace() -> None:
    out = merge_compensate(C_SNAP.clone(), C_PHI, C_SNAP, 0.2, C_BOUNDS)  # g = 0
    assert torch.isfinite(out).all()
    assert_close(out, C_PHI)


def test_eager_outer_gradient_first_round_is_own_share() -> None:
    g = eager_outer_gradient(None, None, 0.0, 0.0, _t(2, 4), 0.5)
    assert_close(g, _t(1, 2))


def test_eager_outer_gradient_later_round() -> None:
    # [3, 1] - 0.25*[2, -2] + 0.5*[2, 4] = [3 - 0.5 + 1, 1 + 0.5 + 2] = [3.5, 3.5]
    g = eager_outer_gradient(_t(3, 1), _t(2, -2), 0.25, 0.25, _t(2, 4), 0.5)
    assert_close(g, _t(3.5, 3.5))


# ==================================================================================================
# 3. Schedules
# ==================================================================================================


def _due_steps(schedule: FixedSchedule, last: int) -> dict[int, list[int]]:
    return {t: d for t in range(0, last + 1) if (d := schedule.due(t))}


def test_fixed_schedule_single_fragment_syncs_every_h() -> None:
    assert _due_steps(FixedSchedule(100, 1), 400) == {100: [0], 200: [0], 300: [0], 400: [0]}


def test_fixed_schedule_four_fragments_every_quarter_h() -> None:
    due = _due_steps(FixedSchedule(100, 4), 400)
    assert sorted(due) == list(range(25, 401, 25))
    assert all(len(d) == 1 for d in due.values())
    for p in range(4):
        steps = [t for t, d in due.items() if p in d]
        assert len(steps) == 4 and all(b - a == 100 for a, b in itertools.pairwise(steps))


@pytest.mark.parametrize(("h", "f"), [(1, 1), (10, 1), (10, 3), (7, 7), (50, 2), (30, 4)])
def test_fixed_schedule_even_offsets_never_two_at_once(h: int, f: int) -> None:
    due = _due_steps(FixedSchedule(h, f), 3 * h)
    assert all(len(d) == 1 for d in due.values())
    for p in range(f):
        steps = [t for t, d in due.items() if p in d]
        assert len(steps) == 3 and all(b - a == h for a, b in itertools.pairwise(steps))
    sends = sorted(due)
    gaps = [b - a for a, b in itertools.pairwise(sends)]
    assert all(math.floor(h / f) <= gap <= math.ceil(h / f) for gap in gaps)


def test_fixed_schedule_rejects_more_fragments_than_h() -> None:
    with pytest.raises(ValueError):
        FixedSchedule(3, 4)


def test_adaptive_schedule_sends_only_every_h_over_n() -> None:
    sched = AdaptiveSchedule(h=100, n_fragments=4, sends_per_h=10)
    view = ScheduleView(last_send=[None] * 4)
    sending = [t for t in range(1, 201) if sched.due(t, view)]
    assert sending == list(range(10, 201, 10))
    assert all(len(sched.due(t, view)) == 1 for t in sending)
    default = AdaptiveSchedule(h=100, n_fragments=4)  # sends_per_h = 0 means F
    assert [t for t in range(1, 101) if default.due(t, view)] == [25, 50, 75, 100]


def test_adaptive_schedule_stale_fragment_first_most_stale_first() -> None:
    sched = AdaptiveSchedule(h=100, n_fragments=3)
    # staleness at 250: 50, 130, 110 -> fragments 1 and 2 are stale; 1 is the most stale,
    # picked even though R favours fragment 0.
    view = ScheduleView(last_send=[200, 120, 140], shared_r=_t(5.0, 0.0, 0.0))
    assert sched.pick(250, view) == 1
    view.in_flight = {1}
    assert sched.pick(250, view) == 2


def test_adaptive_schedule_never_sent_before_r() -> None:
    sched = AdaptiveSchedule(h=100, n_fragments=3)
    view = ScheduleView(last_send=[30, None, 40], shared_r=_t(9.0, 0.0, 0.0))
    assert sched.pick(50, view) == 1


def test_adaptive_schedule_largest_shared_r_otherwise() -> None:
    sched = AdaptiveSchedule(h=100, n_fragments=3)
    view = ScheduleView(last_send=[30, 10, 40], shared_r=_t(0.1, 0.5, 0.3))
    assert sched.pick(50, view) == 1
    view.in_flight = {1}
    assert sched.pick(50, view) == 2
    view.in_flight = {0, 1, 2}
    assert sched.pick(50, view) is None
    assert sched.due(50, view) == []


def test_adaptive_schedule_pick_is_a_function_of_the_view() -> None:
    rng = random.Random(0)
    for _ in range(200):
        f = rng.randint(1, 6)
        h = rng.randint(f, 40)
        step = rng.randint(1, 200)
        last = [None if rng.random() < 0.2 else rng.randint(0, step) for _ in range(f)]
        flight = {p for p in range(f) if rng.random() < 0.3}
        r = torch.rand(f, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        a = AdaptiveSchedule(h, f).pick(step, ScheduleView(list(last), set(flight), r.clone()))
        b = AdaptiveSchedule(h, f).pick(step, ScheduleView(list(last), set(flight), r.clone()))
        assert a == b
        assert (a is None) == (len(flight) == f)
        assert a is None or a not in flight


# ==================================================================================================
# 4. Payload
# ==================================================================================================


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65535, 65536, 65537, 200_001])
@pytest.mark.parametrize("block", [1, 48, 64, 1000])
def test_chunk_bounds_cover_numel_block_aligned(numel: int, block: int) -> None:
    bounds = chunk_bounds(numel, block)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a_end == b_start for (_, a_end), (b_start, _) in itertools.pairwise(bounds))
    assert all(a % block == 0 for a, _ in bounds)
    assert all(b - a == chunk_elems(block, numel) for a, b in bounds[:-1])
    assert chunk_elems(block, numel) % block == 0 and chunk_elems(block, numel) <= max(block, CHUNK_TARGET_ELEMS)
    if numel:
        assert all(b > a for a, b in bounds)


@pytest.mark.parametrize("numel", [20_000, 55_000, 300_000, 2_000_000])
def test_a_payload_has_enough_chunks_for_every_member_of_a_group_to_reduce_a_share(numel: int) -> None:
    """Small payloads are cut finer (at least MIN_CHUNKS chunks where chunks of MIN_CHUNK_ELEMS allow it), so
    that in a group of up to MIN_CHUNKS members every one reduces part of every fragment; large ones keep
    chunks of CHUNK_TARGET_ELEMS."""
    bounds = chunk_bounds(numel, 64)
    assert len(bounds) >= min(MIN_CHUNKS, numel // MIN_CHUNK_ELEMS)
    assert all(b - a >= MIN_CHUNK_ELEMS for a, b in bounds[:-1])
    assert all(b - a <= CHUNK_TARGET_ELEMS for a, b in bounds)
    if numel >= MIN_CHUNKS * CHUNK_TARGET_ELEMS:
        assert all(b - a == CHUNK_TARGET_ELEMS for a, b in bounds[:-1])


@pytest.mark.parametrize("codec_name", ["int8", "fp4", "fp32"])
@pytest.mark.parametrize("block", [48, 64])
def test_chunked_round_trip_equals_whole_tensor_codec(codec_name: str, block: int) -> None:
    codec = get_codec(codec_name, block)
    x = torch.randn(150_001, generator=torch.Generator().manual_seed(1))
    x[70_000:70_100] *= 50  # blocks with very different scales
    chunks = encode_chunks(codec, x)
    assert len(chunks) == len(chunk_bounds(x.numel(), block)) > 1
    assert payload_size(codec, x.numel()) == sum(len(c) for c in chunks)
    assert torch.equal(decode_chunks(codec, chunks, x.numel()), codec.decode(codec.encode(x), x.numel()))
    with pytest.raises(ValueError):
        decode_chunks(codec, chunks[:-1], x.numel())


def test_encode_with_feedback_updates_residual() -> None:
    codec = get_codec("fp4", 64)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(70_000, generator=gen)
    residual = 0.1 * torch.randn(70_000, generator=gen)
    before = residual.clone()
    chunks, decoded = encode_with_feedback(codec, x, residual)
    assert torch.equal(decoded, decode_chunks(codec, chunks, x.numel()))
    assert_close(residual, (x + before) - decoded, atol=1e-6, rtol=0)
    assert residual.abs().max() > 0
    # no residual: plain encoding
    chunks, decoded = encode_with_feedback(codec, x, None)
    assert torch.equal(decoded, codec.decode(codec.encode(x), x.numel()))


def test_error_feedback_telescopes_over_rounds() -> None:
    codec = get_codec("fp4", 64)
    gen = torch.Generator().manual_seed(3)
    residual = torch.zeros(5000)
    sent, true = torch.zeros(5000), torch.zeros(5000)
    for _ in range(8):
        x = torch.randn(5000, generator=gen)
        _, decoded = encode_with_feedback(codec, x, residual)
        sent += decoded
        true += x
    assert_close(sent + residual, true, atol=1e-4, rtol=0)


# ==================================================================================================
# 5. Group reduction
# ==================================================================================================


@pytest.mark.parametrize(("n_chunks", "n_members"), [(0, 2), (1, 3), (4, 2), (5, 3), (7, 4), (3, 5)])
def test_part_ranges_partition_chunk_indices(n_chunks: int, n_members: int) -> None:
    parts = part_ranges(n_chunks, n_members)
    assert len(parts) == n_members
    assert [c for r in parts for c in r] == list(range(n_chunks))
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("n_chunks", "members", "idle"), [(7, "abcd", "d"), (7, "abcd", "bd"), (2, "abc", "a"),
                                                          (5, "abc", "abc"), (6, "ab", "")])
@pytest.mark.parametrize("round_", [0, 1, 5])
def test_reducer_parts_leave_idle_members_no_part_and_cover_every_chunk(n_chunks: int, members: str,
                                                                          idle: str, round_: int) -> None:
    parts = reducer_parts(n_chunks, list(members), set(idle), round_)
    assert sorted(c for r in parts for c in r) == list(range(n_chunks)), "every chunk reduced once"
    if set(idle) == set(members):
        assert sorted(map(tuple, parts)) == sorted(map(tuple, part_ranges(n_chunks, len(members)))), \
            "nobody idle where everybody would be"
    else:
        assert all(not parts[j] for j, m in enumerate(members) if m in idle)
        busy = [len(parts[j]) for j, m in enumerate(members) if m not in idle]
        assert sorted(busy) == sorted(len(r) for r in part_ranges(n_chunks, len(busy)))


@pytest.mark.parametrize(("n_chunks", "members", "idle"), [(12, "abc", ""), (7, "abcd", "c"), (10, "abcde", "")])
def test_over_consecutive_rounds_every_reducer_covers_every_chunk(n_chunks: int, members: str, idle: str) -> None:
    """Parts turn each round, so that no reducer is judged for one range's nature (``reducer_parts``)."""
    reducing = [m for m in members if m not in idle]
    for start in (0, 7):
        covered = {m: [] for m in members}
        for round_ in range(start, start + len(reducing)):
            for m, part in zip(members, reducer_parts(n_chunks, list(members), set(idle), round_), strict=True):
                covered[m].extend(part)
        for m in members:
            assert sorted(covered[m]) == ([] if m in idle else list(range(n_chunks))), m
    assert reducer_parts(n_chunks, list(members), set(idle), 3) != reducer_parts(n_chunks, list(members), set(idle), 4)


def reduce_group(codec, payloads, weights, numel, aggregator: str = "clipped_mean"):
    """The group reduction under the default robust settings (honest inputs: nothing is clipped)."""
    settings = RobustSection(aggregator=aggregator, agreement_floor=-1.0, agreement_full=-1.0, weight_factor=1e6)
    reduced, sent, received, _ = _reduce_group(codec, payloads, weights, numel, settings, make_aggregator(settings))
    return reduced, sent, received


def _payloads(codec, n: int, numel: int, seed: int = 0) -> tuple[list[torch.Tensor], list[list[bytes]]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=gen) * (i + 1) for i in range(n)]
    return xs, [encode_chunks(codec, x) for x in xs]


def test_reduce_group_fp32_is_weighted_mean() -> None:
    codec = get_codec("fp32", 64)
    numel = 4 * CHUNK + 123  # 5 chunks over 3 reducers
    xs, payloads = _payloads(codec, 3, numel)
    weights = [1.0, 2.0, 5.0]
    reduced, _, _ = reduce_group(codec, payloads, weights, numel)
    expected = (1 * xs[0] + 2 * xs[1] + 5 * xs[2]) / 8
    assert_close(decode_chunks(codec, reduced, numel), expected, atol=1e-6, rtol=1e-6)


def test_reduce_group_fp4_within_codec_tolerance() -> None:
    codec = get_codec("fp4", 64)
    numel = 2 * CHUNK + 999
    xs, payloads = _payloads(codec, 3, numel)
    weights = [3.0, 1.0, 1.0]
    avg = decode_chunks(codec, reduce_group(codec, payloads, weights, numel)[0], numel)
    expected = (3 * xs[0] + xs[1] + xs[2]) / 5
    rel = float(torch.linalg.vector_norm(avg - expected) / torch.linalg.vector_norm(expected))
    assert rel < 0.35
    # what was averaged is each member's decoded contribution; the reduced result is one more fp4 rounding
    mean_decoded = sum(w * decode_chunks(codec, p, numel) for w, p in zip(weights, payloads, strict=True)) / 5
    rel_dec = float(torch.linalg.vector_norm(avg - mean_decoded) / torch.linalg.vector_norm(mean_decoded))
    assert rel_dec < 0.3


@pytest.mark.parametrize(("codec_name", "n", "numel"), [
    ("fp32", 3, 4 * CHUNK + 123), ("fp4", 3, 6 * CHUNK + 17), ("int8", 4, 3 * CHUNK), ("fp4", 2, 100),
])
def test_reduce_group_bytes_follow_reduce_scatter_all_gather(codec_name: str, n: int, numel: int) -> None:
    codec = get_codec(codec_name, 64)
    _, payloads = _payloads(codec, n, numel)
    reduced, sent, received = reduce_group(codec, payloads, [1.0] * n, numel)
    parts = part_ranges(len(reduced), n)
    for i in range(n):
        own_part = set(parts[i])
        to_reducers = sum(len(payloads[i][c]) for c in range(len(reduced)) if c not in own_part)
        gathered_out = (n - 1) * sum(len(reduced[c]) for c in own_part)
        assert sent[i] == to_reducers + gathered_out
        from_members = sum(len(payloads[k][c]) for c in own_part for k in range(n) if k != i)
        gathered_in = sum(len(reduced[c]) for c in range(len(reduced)) if c not in own_part)
        assert received[i] == from_members + gathered_in
    assert sum(sent) == sum(received)


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_group_fp32_each_member_sends_2_n_minus_1_over_n_payloads(n: int) -> None:
    codec = get_codec("fp32", 64)
    numel = 8 * CHUNK  # divides evenly among 2 or 4 reducers
    _, payloads = _payloads(codec, n, numel)
    _, sent, received = reduce_group(codec, payloads, [1.0] * n, numel)
    payload = 4 * numel
    assert sent == [2 * (n - 1) * payload // n] * n
    assert received == sent
    if n == 2:
        assert sent == [payload, payload]


# ==================================================================================================
# 6. OuterLoop through the in-process hub
# ==================================================================================================


@pytest.fixture(scope="module")
def base_model() -> torch.nn.Module:
    return build_model(ModelSection(), VOCAB)


class _FailedHandle(AverageHandle):
    refused = False  # failed because this node refused what a peer sent (``AverageResult.refused``)

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> AverageResult:
        return AverageResult.failed("scripted drop", refused=self.refused)


class _RefusedHandle(_FailedHandle):
    refused = True


class RecordingTransport(Transport):
    """Delegates to the hub, records every request and handle; drops the rounds in ``drop_rounds``."""

    def __init__(self, inner: Transport, drop_rounds: set[int] | None = None) -> None:
        self.inner = inner
        self.drop_rounds = drop_rounds or set()
        self.calls: list[tuple[AverageRequest, AverageHandle]] = []

    hold = False  # new rounds' handles are held (unfinished until released, or until waited for)
    refuses = False  # the dropped rounds fail as refused by this node (a reduced part against its progress)

    def start_average(self, request: AverageRequest) -> AverageHandle:
        failed = _RefusedHandle() if self.refuses else _FailedHandle()
        handle = failed if request.round in self.drop_rounds else self.inner.start_average(request)
        if self.hold:
            handle = _HeldHandle(handle)
        self.calls.append((request, handle))
        return handle

    def latest_version(self, fragment: int) -> int:
        return self.inner.latest_version(fragment)

    def fetch_fragment(self, fragment: int):
        return self.inner.fetch_fragment(fragment)

    held: list[_HeldFetch] | None = None  # a list: downloads are held (they finish on release())
    # A catch-up replays the steps ``replay_from`` logged instead of taking its state (``tamper``: an exponent bit
    # of the first step's first value flipped); ``fetched`` records (fragment, have) of each catch-up; ``rejected``
    # the reasons given to ``reject_replay``.
    replay_from: OuterLoop | None = None
    tamper = False

    def start_fetch(self, fragment: int, have: int | None = None) -> FetchHandle:
        self.fetched = [*getattr(self, "fetched", []), (fragment, have)]
        if self.replay_from is not None and have is not None:
            if self.held is None:
                return FetchHandle(self._replay(fragment, have))
            self.held.append(_HeldFetch(self._replay(fragment, have)))  # the steps as they are when asked
            return self.held[-1]
        if self.held is None:
            return super().start_fetch(fragment, have)
        self.held.append(_HeldFetch(self.inner.fetch_fragment(fragment)))  # the state as it is when asked
        return self.held[-1]


    def _replay(self, fragment: int, have: int) -> FragmentSnapshot:
        """The holder's logged steps since ``have``, checked against the digests logged with them (as
        ``CatchUp._replay`` does)."""
        snap = self.replay_from.snapshot(fragment)
        steps = [s for s in snap.steps if s.version > have]
        assert len(steps) == snap.version - have, (snap.version, have, [s.version for s in snap.steps])
        assert steps[-1].after == state_digest(snap.phi, snap.momentum)
        claimed = {have: steps[0].before, **{s.version: s.after for s in steps}}
        if self.tamper:
            chunks = steps[0].average.chunks
            steps[0] = replace(steps[0], average=replace(steps[0].average, chunks=(
                chunks[0][:3] + bytes([chunks[0][3] ^ 0x20]) + chunks[0][4:], *chunks[1:])))  # an exponent bit

        def verify(version: int, phi: torch.Tensor, momentum: torch.Tensor) -> bool:
            return state_digest(phi, momentum) == claimed[version]

        return FragmentSnapshot(fragment, snap.version, torch.zeros(0), torch.zeros(0), source="w0", base=have,
                                steps=tuple(steps), verify=verify)

    def reject_replay(self, snapshot: FragmentSnapshot, reason: str) -> None:
        self.rejected = [*getattr(self, "rejected", []), reason]


class _HeldHandle(AverageHandle):
    """A round still running on the network: done once released; ``result()`` is the node waiting for it."""

    def __init__(self, inner: AverageHandle) -> None:
        self.inner = inner
        self.released = False
        self.waited = False

    def done(self) -> bool:
        return self.released and self.inner.done()

    def result(self, timeout: float | None = None) -> AverageResult:
        self.waited = self.waited or not self.released
        return self.inner.result(timeout)


class _HeldFetch(FetchHandle):
    """A download that takes a while: it finishes when the test says so."""

    released = False

    def done(self) -> bool:
        return self.released


# The outer-loop mechanics tested here average random, unrelated changes (and the quadratics' workers pull
# toward minima of their own): the reducers' direction judgement and median weight cap are
# locoswarm.node.core.robust's business (tests/test_robust.py), so these hubs average plainly, token-weighted,
# unclipped.
PLAIN = RobustSection(aggregator="mean", agreement_floor=-1.0, agreement_full=-1.0, weight_factor=1e6)


def _outer(**kw) -> OuterSection:
    cfg = {"method": "replace", "h": 2, "fragments": 1, "tau": 0, "codec": "fp32", "error_feedback": False,
           "lr": 0.7, "momentum": 0.9, "schedule": "fixed", "consensus_every": 0}
    cfg.update(kw)
    return OuterSection(**cfg)


class Swarm:
    """n workers with identical init, driven in lock-step like the simulator."""

    def __init__(self, base: torch.nn.Module, n: int, outer: OuterSection, *, drop_prob: float = 0.0,
                 seed: int = 0, drops: dict[int, set[int]] | None = None,
                 expected_group_size: int | None = None, group_size: int | None = None) -> None:
        self.hub = InProcessHub(get_codec(outer.codec, outer.block_size), group_size or n, seed=seed,
                                drop_prob=drop_prob, robust=PLAIN)
        self.fragments = partition(base, outer.fragments)
        self.models = [copy.deepcopy(base) for _ in range(n)]
        self.transports = [RecordingTransport(self.hub.transport(i), (drops or {}).get(i)) for i in range(n)]
        self.loops = [OuterLoop(m, self.fragments, outer, tr, expected_group_size=expected_group_size or n)
                      for m, tr in zip(self.models, self.transports, strict=True)]
        for i, loop in enumerate(self.loops):
            self.hub.register_state(i, loop.version, loop.snapshot)
        self.gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]

    def train(self, tokens: list[float] | None = None, scale: float = 1e-3) -> None:
        """Mimic one inner step on every worker: a different small change of every parameter."""
        for i, (model, loop) in enumerate(zip(self.models, self.loops, strict=True)):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=self.gens[i]), alpha=scale)
            loop.add_tokens(10.0 if tokens is None else tokens[i])

    def sync(self, t: int) -> list[list]:
        """The core's calls at swarm step ``t`` as the simulator makes them (the daemon's ``advance``, split
        around the hub's flush)."""
        events: list[list] = [[] for _ in self.loops]
        for i, loop in enumerate(self.loops):
            events[i] += loop.advance_sends(t - 1, t, 0.0)
        self.hub.flush()
        for i, loop in enumerate(self.loops):
            events[i] += loop.collect(t)
        return events

    def step(self, t: int, tokens: list[float] | None = None) -> list[list]:
        self.train(tokens)
        return self.sync(t)

    def phi(self, i: int, p: int = 0) -> torch.Tensor:
        return self.loops[i].states[p].phi.clone()

    def theta(self, i: int, p: int = 0) -> torch.Tensor:
        return self.loops[i].states[p].theta()


def _kinds(events: list, kind: str) -> list:
    return [e for e in events if e.kind == kind]


def test_replace_sync_makes_phi_identical_and_theta_equal_phi(base_model) -> None:
    swarm = Swarm(base_model, 3, _outer(h=4, fragments=2))  # fragment 0 at 2, 6; fragment 1 at 4, 8
    merged_steps = {0: [], 1: []}
    for t in range(1, 9):
        before = [[swarm.phi(i, p) for p in range(2)] for i in range(3)]
        events = swarm.step(t)
        merged = {e.fragment for e in _kinds(events[0], "merged")}
        for p in range(2):
            if p in merged:
                merged_steps[p].append(t)
                for i in range(3):
                    assert torch.equal(swarm.phi(i, p), swarm.phi(0, p))
                    assert torch.equal(swarm.theta(i, p), swarm.phi(i, p))
                    assert not torch.equal(swarm.phi(i, p), before[i][p])
                assert all(e.group_size == 3 for e in _kinds(events[0], "merged"))
            else:
                for i in range(3):
                    assert torch.equal(swarm.phi(i, p), before[i][p])
                    assert not torch.equal(swarm.theta(i, p), swarm.phi(i, p))  # local progress kept
    assert merged_steps == {0: [2, 6], 1: [4, 8]}
    assert [loop.version(0) for loop in swarm.loops] == [2, 2, 2]


def test_weighted_group_average_is_token_weighted_mean_of_deltas(base_model) -> None:
    outer = _outer(h=2)
    swarm = Swarm(base_model, 3, outer)
    tokens = [1.0, 2.0, 5.0]
    swarm.step(1, tokens)
    swarm.train(tokens)
    phi0 = swarm.phi(0)
    deltas = [swarm.phi(i) - swarm.theta(i) for i in range(3)]
    swarm.sync(2)
    requests = [tr.calls[-1][0] for tr in swarm.transports]
    results = [tr.calls[-1][1].result() for tr in swarm.transports]
    assert [r.weight for r in requests] == [2.0, 4.0, 10.0]
    for req, d in zip(requests, deltas, strict=True):
        assert torch.equal(decode_chunks(get_codec("fp32"), req.chunks, req.numel), d)
    expected = (2 * deltas[0] + 4 * deltas[1] + 10 * deltas[2]) / 16
    for res in results:
        assert res.ok and res.total_weight == 16.0
        assert_close(res.average, expected, atol=1e-7, rtol=1e-5)
    # phi moved by the outer step on that average (fresh momentum)
    ref_phi, ref_buf = phi0.clone(), torch.zeros_like(phi0)
    NesterovOuterOptimizer(outer.lr, outer.momentum).step(ref_phi, ref_buf, expected)
    assert_close(swarm.phi(1), ref_phi, atol=1e-6, rtol=0)


def test_failed_sync_is_atomic_and_tokens_carry_over(base_model) -> None:
    swarm = Swarm(base_model, 3, _outer(h=2), drop_prob=0.35, seed=3)
    last_ok = [0, 0, 0]
    n_failed = n_ok = 0
    for t in range(1, 25):
        swarm.train()
        pre = [(swarm.phi(i), swarm.theta(i), swarm.loops[i].states[0].momentum.clone(), swarm.loops[i].version(0))
               for i in range(3)]
        events = swarm.sync(t)
        if t % 2:
            continue
        for i in range(3):
            req = swarm.transports[i].calls[-1][0]
            assert req.weight == 10.0 * (t - last_ok[i])  # tokens of failed rounds carried over
            caught_up = bool(_kinds(events[i], "caught_up"))
            if _kinds(events[i], "failed"):
                n_failed += 1
                if not caught_up:
                    phi, theta, mom, version = pre[i]
                    assert torch.equal(swarm.phi(i), phi)
                    assert torch.equal(swarm.theta(i), theta)
                    assert torch.equal(swarm.loops[i].states[0].momentum, mom)
                    assert swarm.loops[i].version(0) == version
                assert swarm.loops[i].states[0].tokens_since_send == req.weight
            else:
                assert _kinds(events[i], "merged")
                n_ok += 1
                last_ok[i] = t
                assert torch.equal(swarm.theta(i), swarm.phi(i))
                assert swarm.loops[i].states[0].tokens_since_send == 0.0
        ok_workers = [i for i in range(3) if _kinds(events[i], "merged")]
        for i in ok_workers:
            assert torch.equal(swarm.phi(i), swarm.phi(ok_workers[0]))
    assert n_failed > 0 and n_ok > 0
    assert sum(loop.stats.catch_ups for loop in swarm.loops) > 0
    assert sum(loop.stats.syncs_failed for loop in swarm.loops) == n_failed


@pytest.mark.parametrize("max_carry", [3, 0])
def test_a_fragment_whose_rounds_keep_failing_drops_the_progress_it_carries(base_model, max_carry: int) -> None:
    """Worker 2's rounds all fail: it carries its progress (and tokens) for max_carry - 1 failed rounds; the
    max_carry-th drops it (theta <- phi, tokens 0, a "dropped" event) instead of growing a stale delta that
    peers end up refusing. max_carry = 0 carries it forever."""
    swarm = Swarm(base_model, 3, _outer(h=2, max_carry=max_carry), drops={2: set(range(100))})
    dropped_at, weights = [], []
    for t in range(1, 17):
        events = swarm.step(t)
        if t % 2:
            continue
        weights.append(swarm.transports[2].calls[-1][0].weight)
        assert _kinds(events[2], "failed") and _kinds(events[0], "merged")
        if _kinds(events[2], "dropped"):
            dropped_at.append(t)
            assert torch.equal(swarm.theta(2), swarm.phi(2))
            assert swarm.loops[2].states[0].tokens_since_send == 0.0
        else:
            assert not torch.equal(swarm.theta(2), swarm.phi(2))  # the progress is still carried
    if max_carry:
        assert dropped_at == [6, 12]  # every 3rd failed round (sends at even steps)
        assert weights == [20.0, 40.0, 60.0, 20.0, 40.0, 60.0, 20.0, 40.0]
    else:
        assert dropped_at == [] and weights == [20.0 * k for k in range(1, 9)]


@pytest.mark.parametrize("max_carry", [3, 0])
def test_progress_made_while_the_clock_stood_still_is_bounded_before_it_is_sent(base_model, max_carry: int) -> None:
    """A worker whose clock stands still (ahead of the swarm's median) trains on and sends nothing: the daemon only
    adds the tokens. At its next send the progress, 42 inner steps' worth at h = 2, is scaled to
    ``carry_steps(h, max_carry)`` steps' worth (8 at max_carry = 3): theta moves back toward phi by that share,
    the direction is kept, the weight is capped, and a "bounded" event says so. A normal send is untouched, and
    max_carry = 0 bounds nothing."""
    from locoswarm.node.core.outer_loop import carry_steps

    swarm = Swarm(base_model, 2, _outer(h=2, max_carry=max_carry))
    for t in (1, 2):  # an ordinary round
        events = swarm.step(t)
    assert _kinds(events[0], "merged") and not _kinds(events[0], "bounded")
    assert swarm.transports[0].calls[-1][0].weight == 20.0
    for _ in range(40):  # the clock stands still: inner steps, no sync
        swarm.train()
    swarm.step(3)
    swarm.train()
    phi, theta = swarm.phi(0), swarm.theta(0)
    events = swarm.sync(4)
    request = swarm.transports[0].calls[-1][0]
    sent = decode_chunks(get_codec("fp32"), request.chunks, request.numel)
    if not max_carry:
        assert not _kinds(events[0], "bounded") and request.weight == 420.0
        assert_close(sent, phi - theta)
        return
    limit = carry_steps(2, max_carry) * 10.0
    assert limit == 80.0 and request.weight == limit
    assert_close(sent, (phi - theta) * (limit / 420.0), atol=1e-7, rtol=1e-5)
    [bounded] = _kinds(events[0], "bounded")
    assert "spans 42 inner steps" in bounded.error and "8 steps' worth" in bounded.error
    assert swarm.loops[0].stats.bounded == 1 and _kinds(events[0], "merged")


def test_rounds_this_node_refused_fold_the_carried_progress_into_phi_instead_of_dropping_it(base_model) -> None:
    """A worker that refuses every round's result (e.g. reduced parts that colluders turned against its progress):
    at the max_carry-th failed round its carried progress is not thrown away but folded into phi by an outer step
    on it alone (version + 1, theta by the merge rule, tokens 0, a "folded" event), so it keeps training as a node
    with no peer would. Rounds that failed for want of peers still drop it (the test above), and so does a streak
    of which fewer than half were refused here. One worker: no peer's newer version to catch up to."""
    for refuses in ("all", "none", "one in three"):
        swarm = Swarm(base_model, 1, _outer(h=2, max_carry=3), drops={0: set(range(100))})
        st = swarm.loops[0].states[0]
        folded_at = []
        for t in range(1, 17):
            # sends at even steps; "one in three": only the first round of each streak of 3 is refused here
            swarm.transports[0].refuses = refuses == "all" or (refuses == "one in three" and t % 6 == 2)
            swarm.train()
            before_phi, carried, version = swarm.phi(0), swarm.theta(0), st.version
            momentum = st.momentum.clone()
            events = swarm.sync(t)
            if t % 2:
                continue
            assert _kinds(events[0], "failed")
            if _kinds(events[0], "folded"):
                folded_at.append(t)
                assert st.version == version + 1 and st.tokens_since_send == 0.0
                assert torch.equal(swarm.theta(0), swarm.phi(0))           # replace: theta <- phi
                # plain SGD on the progress it carried: phi moved 0.7 of the way, the momentum buffer untouched
                assert_close(swarm.phi(0), before_phi + 0.7 * (carried - before_phi), atol=1e-6, rtol=1e-5)
                assert torch.equal(st.momentum, momentum)
                assert "folded into phi" in _kinds(events[0], "folded")[0].error
                assert st.folded  # a catch-up must now do no worse than this phi (test_guard)
            else:
                assert st.version == version and torch.equal(swarm.phi(0), before_phi)
        if refuses == "all":
            assert folded_at == [6, 12] and swarm.loops[0].stats.folds == 2
        else:
            assert folded_at == [] and swarm.loops[0].stats.folds == 0 and st.version == 0


def test_after_a_fold_the_nodes_contributions_agree_with_its_groups_again(base_model) -> None:
    """Three workers whose inner steps share a common direction (plus their own noise), alpha merge: worker 2
    refuses three rounds in a row and folds its carried progress into phi, then merges with the others again. Its
    next five contributions agree with the mean of the other two's (cosine above +0.2; in step they agree at about
    +0.5): the fold leaves the momentum buffer as it is and sets theta <- phi. With the Nesterov step and the alpha
    merge they agreed at -0.22 to -0.80, and another honest node banned the folder for its direction."""
    swarm = Swarm(base_model, 3, _outer(method="alpha", alpha=0.5, h=2, max_carry=3))
    common = [torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) for p in swarm.models[0].parameters()]

    def train() -> None:
        for i, (model, loop) in enumerate(zip(swarm.models, swarm.loops, strict=True)):
            with torch.no_grad():
                for p, c in zip(model.parameters(), common, strict=True):
                    p.add_(3.0 * c + torch.randn(p.shape, generator=swarm.gens[i]), alpha=1e-3)
            loop.add_tokens(10.0)

    for t in range(1, 11):
        train()
        swarm.sync(t)
    swarm.transports[2].drop_rounds, swarm.transports[2].refuses = set(range(11, 17)), True
    folded = []
    for t in range(11, 17):
        train()
        folded += _kinds(swarm.sync(t)[2], "folded")
    assert len(folded) == 1
    swarm.transports[2].drop_rounds = set()
    codec, agreement = get_codec("fp32"), []
    for t in range(17, 27):
        train()
        events = swarm.sync(t)
        if t % 2 == 0:
            assert all(_kinds(e, "merged") for e in events)
            sent = [decode_chunks(codec, tr.calls[-1][0].chunks, tr.calls[-1][0].numel) for tr in swarm.transports]
            agreement.append(float(torch.nn.functional.cosine_similarity(sent[2], (sent[0] + sent[1]) / 2, dim=0)))
    assert len(agreement) == 5 and min(agreement) > 0.2, agreement


def test_a_fold_stops_holding_catch_ups_to_its_own_phi_once_rounds_fail_for_want_of_peers(base_model) -> None:
    """After a fold a catch-up must do no worse than the node's own phi (``FOLDED_SLACK``), but only while the node
    is refusing its peers: a later streak of rounds that failed for want of peers (nobody meets it at its version)
    drops its progress and ends that, so a node alone on a folded lineage can take the swarm's phi again."""
    swarm = Swarm(base_model, 1, _outer(h=2, max_carry=3), drops={0: set(range(100))})
    st = swarm.loops[0].states[0]
    seen = []
    for t in range(1, 13):
        swarm.transports[0].refuses = t <= 6  # the first streak is refused here, the second fails for want of peers
        swarm.train()
        events = swarm.sync(t)
        if t % 2 == 0:
            seen.append((t, [e.kind for e in events[0] if e.kind in ("folded", "dropped")], st.folded))
    assert seen == [(2, [], False), (4, [], False), (6, ["folded"], True),
                    (8, [], True), (10, [], True), (12, ["dropped"], False)]


def _one_behind(base_model: torch.nn.Module) -> Swarm:
    """Three workers at tau = 1 after step 3, worker 2 a version behind (its round at step 2 was dropped)."""
    swarm = Swarm(base_model, 3, _outer(method="rebase", h=2, tau=1), drops={2: {2}})
    for t in range(1, 4):
        swarm.step(t)
    assert [loop.version(0) for loop in swarm.loops] == [1, 1, 0]
    return swarm


def _send_at_4(swarm: Swarm) -> list[list]:
    """Step 4 as the daemon makes it, split between the merge and the send so the test can look between them."""
    for loop in swarm.loops:
        loop.collect(4)
    return [loop.send(4) for loop in swarm.loops]


def test_behind_worker_catches_up_before_sending(base_model) -> None:
    # Worker 2's sync at step 2 is dropped; workers 0 and 1 average. tau = 1 lets us look between send
    # and merge of the step-4 sync.
    swarm = _one_behind(base_model)
    assert not torch.equal(swarm.phi(2), swarm.phi(0))
    swarm.train()
    phi_old, theta_old = swarm.phi(2), swarm.theta(2)
    events = _send_at_4(swarm)
    assert [e.kind for e in events[2]] == ["caught_up", "sent"]
    assert not _kinds(events[0], "caught_up")
    assert swarm.loops[2].version(0) == 1
    assert torch.equal(swarm.phi(2), swarm.phi(0))
    assert torch.equal(swarm.loops[2].states[0].momentum, swarm.loops[0].states[0].momentum)
    # local progress carried onto the fetched phi, and sent as one long pseudo-gradient
    assert_close(swarm.theta(2), swarm.phi(2) - (phi_old - theta_old), atol=1e-6, rtol=0)
    req = swarm.transports[2].calls[-1][0]
    assert req.version == 1 and req.weight == 40.0
    assert_close(decode_chunks(get_codec("fp32"), req.chunks, req.numel), phi_old - theta_old, atol=1e-6, rtol=0)
    swarm.hub.flush()
    for t in (5,):
        swarm.step(t)
    assert [loop.version(0) for loop in swarm.loops] == [2, 2, 2]
    assert swarm.loops[2].stats.catch_ups == 1


def test_a_worker_behind_replays_the_steps_it_missed_and_holds_the_others_state_bit_for_bit(base_model) -> None:
    """A catch-up by replay (``locoswarm.node.core.step_log``): worker 2 missed a round; its transport is asked
    with the version it holds and answers with the logged averages of the steps since, not the state. Worker 2
    applies them with its own outer optimizer and then holds worker 0's phi and momentum exactly (its digest
    check passes), with its local progress carried over as after a download."""
    swarm = _one_behind(base_model)
    assert [s.version for s in swarm.loops[0].snapshot(0).steps] == [1]  # the step of the round worker 2 missed
    swarm.transports[2].replay_from = swarm.loops[0]
    swarm.train()
    phi_old, theta_old = swarm.phi(2), swarm.theta(2)
    events = _send_at_4(swarm)
    assert [e.kind for e in events[2]] == ["caught_up", "sent"]
    assert swarm.transports[2].fetched == [(0, 0)]
    assert swarm.loops[2].version(0) == 1 and swarm.loops[2].stats.replays == 1
    assert torch.equal(swarm.phi(2), swarm.phi(0))
    assert torch.equal(swarm.loops[2].states[0].momentum, swarm.loops[0].states[0].momentum)
    assert_close(swarm.theta(2), swarm.phi(2) - (phi_old - theta_old), atol=1e-6, rtol=0)
    swarm.hub.flush()
    swarm.step(5)
    assert [loop.version(0) for loop in swarm.loops] == [2, 2, 2]
    assert torch.equal(swarm.phi(2), swarm.phi(0))


@pytest.mark.parametrize("fault", ["tampered step", "another phi"])
def test_a_replay_that_does_not_lead_to_the_holders_state_is_not_taken(base_model, fault) -> None:
    """A replayed average with one exponent bit flipped misses the digest the holder logged after its step; a node
    whose own phi at the replay's base is not the holder's (another lineage at the same version number) misses the
    digest logged before it. Either way the node takes nothing (phi, momentum and version as they were), tells its
    transport why (``reject_replay``: it then downloads the state for a while) and counts no catch-up."""
    swarm = _one_behind(base_model)
    swarm.transports[2].replay_from = swarm.loops[0]
    swarm.transports[2].tamper = fault == "tampered step"
    if fault == "another phi":
        swarm.loops[2].states[0].phi.add_(1e-3)
    swarm.train()
    phi_old, momentum_old = swarm.phi(2), swarm.loops[2].states[0].momentum.clone()
    events = _send_at_4(swarm)
    assert [e.kind for e in events[2]] == ["sent"]
    assert swarm.loops[2].version(0) == 0 and swarm.loops[2].stats.catch_ups == 0
    assert torch.equal(swarm.phi(2), phi_old)
    assert torch.equal(swarm.loops[2].states[0].momentum, momentum_old)
    assert swarm.transports[2].rejected == [{
        "tampered step": "the replayed state of version 1 is not the holder's",
        "another phi": "this node's state of version 0 is not the holder's (another phi)"}[fault]]


def test_the_step_log_serves_only_an_unbroken_chain_that_ends_at_the_state_as_it_is() -> None:
    """``StepLog.chain``: the longest run of logged steps, each starting where the previous one ended, the last
    ending at the state now; a state changed by anything else (a catch-up, a fold) breaks it, and the log keeps
    ``depth`` steps."""
    from locoswarm.node.core.step_log import StepLog
    from locoswarm.node.core.transport import EncodedAverage

    avg = EncodedAverage("fp32", 1, (b"\0\0\0\0",))
    log = StepLog(depth=3)
    assert log.chain(b"0", 0) == ()
    for v in range(1, 5):
        log.record(str(v - 1).encode(), str(v).encode(), v, avg)
    chain = log.chain(b"4", 4)
    assert [(s.version, s.before, s.after) for s in chain] == [(2, b"1", b"2"), (3, b"2", b"3"), (4, b"3", b"4")]
    assert log.chain(b"4.5", 4) == ()          # phi moved since the last step
    assert log.chain(b"4", 5) == ()            # the version moved (a catch-up, a relabel)
    log.record(b"9", b"10", 5, avg)            # a step from a state the last one did not leave
    assert [s.version for s in log.chain(b"10", 5)] == [5]
    log.clear()
    assert log.chain(b"10", 5) == ()
    with pytest.raises(ValueError, match="at least one step"):
        StepLog(depth=0)
    small = StepLog(depth=4, max_bytes=10)   # 4-byte steps: two fit, and the last one always stays
    for v in range(1, 5):
        small.record(str(v - 1).encode(), str(v).encode(), v, avg)
    assert [s.version for s in small.chain(b"4", 4)] == [3, 4]
    small.record(b"4", b"5", 5, EncodedAverage("fp32", 100, (bytes(400),)))
    assert [s.version for s in small.chain(b"5", 5)] == [5]


@pytest.mark.parametrize("by", ["download", "replay"])
def test_a_slow_catch_up_blocks_nothing_and_lands_on_the_groups_state(base_model, by) -> None:
    """Worker 2 is behind; its catch-up takes a round. It sends its progress meanwhile (no waiting), merges
    that round onto its stale phi, and when the catch-up (of the state before that round) lands, the round
    is applied again on top of it: worker 2 then holds the others' phi and momentum bit for bit. A replay of
    the steps missed starts from the state worker 2 held when it asked, which that round has moved on since
    (NATed nodes merge a round later than the public ones, and a replay that needed the state as it is when it
    lands never landed: they stayed a version behind, on a phi of their own, for a whole bench run)."""
    swarm = _one_behind(base_model)
    if by == "replay":
        swarm.transports[2].replay_from = swarm.loops[0]
    swarm.transports[2].held = []
    events = swarm.step(4)
    assert [e.kind for e in events[2]] == ["sent"]  # no catch-up first: the download is under way
    assert len(swarm.transports[2].held) == 1 and swarm.transports[2].calls[-1][0].version == 0
    events = swarm.step(5)  # the round merges everywhere, the download has not finished
    assert _kinds(events[2], "merged") and not _kinds(events[2], "caught_up")
    assert [loop.version(0) for loop in swarm.loops] == [2, 2, 1]
    swarm.transports[2].held[0].released = True
    swarm.train()
    events = [loop.collect(6) for loop in swarm.loops]
    assert [e.kind for e in events[2]] == ["caught_up"]
    assert [loop.version(0) for loop in swarm.loops] == [2, 2, 2]
    assert torch.equal(swarm.phi(2), swarm.phi(0))
    assert torch.equal(swarm.loops[2].states[0].momentum, swarm.loops[0].states[0].momentum)
    for t in range(6, 10):
        swarm.step(t)
    assert torch.equal(swarm.phi(2), swarm.phi(0)) and swarm.loops[2].version(0) == swarm.loops[0].version(0)
    assert swarm.loops[2].stats.catch_ups == 1 and swarm.loops[2].stats.replays == (by == "replay")


SLOW_H = 8  # h=8, F=1: the first send is at step 8


def _slow_round(swarm: Swarm, release_at: int | None, until: int) -> tuple[list[_HeldHandle], dict[int, list]]:
    """Step to the first send (step SLOW_H) with that round's handles held, release them at ``release_at``
    (None: never), step on to ``until``. Returns the held handles and worker 0's events per step."""
    events: dict[int, list] = {}
    held: list[_HeldHandle] = []
    for t in range(1, until + 1):
        for tr in swarm.transports:
            tr.hold = t == SLOW_H
        if t == release_at:
            for h in held:
                h.released = True
        events[t] = swarm.step(t)[0]
        if t == SLOW_H:
            assert _kinds(events[t], "sent")
            held = [h for tr in swarm.transports for _, h in tr.calls if isinstance(h, _HeldHandle)]
    return held, events


def test_a_round_slower_than_tau_is_merged_late_while_training_goes_on(base_model) -> None:
    """alpha, h=8, tau=1: the round is not finished at tau. Training goes on (nobody waits), the result is
    merged on every worker when it lands, three steps after the send, and the workers' phi agree."""
    swarm = Swarm(base_model, 2, _outer(method="alpha", h=SLOW_H, tau=1))
    assert swarm.loops[0].late_window() == SLOW_H  # auto (the default): h / fragments
    held, ev = _slow_round(swarm, release_at=SLOW_H + 3, until=SLOW_H + 4)
    assert len(held) == 2 and not any(h.waited for h in held)
    assert not any(_kinds(ev[t], "merged") for t in range(SLOW_H, SLOW_H + 3))
    merged = _kinds(ev[SLOW_H + 3], "merged")
    assert len(merged) == 1 and merged[0].step - SLOW_H == 3
    assert [loop.version(0) for loop in swarm.loops] == [1, 1]
    assert torch.equal(swarm.phi(0), swarm.phi(1))


def test_a_round_is_waited_for_at_the_end_of_the_late_window_and_replace_and_compensate_wait_at_tau(
        base_model, monkeypatch) -> None:
    import threading
    import time

    from locoswarm.node.core import late_window as lw

    # A budget well above a step's compute, so that a loaded machine (a CI neighbour, a benchmark) cannot make
    # one wait per worker look like two: at 0.3 s, a step that waited once each took 2.0 s under load.
    stall = 1.0
    monkeypatch.setattr(lw, "MIN_STALL_S", stall)
    # A round that lands while the node waits at the end of its late window is merged at once.
    swarm = Swarm(base_model, 2, _outer(method="alpha", h=SLOW_H, tau=1, max_delay=3))
    held, ev = _slow_round(swarm, release_at=None, until=SLOW_H + 2)
    assert held and not any(_kinds(ev[t], "merged") for t in range(SLOW_H, SLOW_H + 3))
    threading.Timer(0.1, lambda: [setattr(h, "released", True) for h in held]).start()
    t0 = time.monotonic()
    assert _kinds(swarm.step(SLOW_H + 3)[0], "merged") and time.monotonic() - t0 < stall + 0.5
    assert swarm.loops[0].stats.stalls_cut == 0 and [loop.version(0) for loop in swarm.loops] == [1, 1]
    # One that does not land within the stall budget is left in flight: training goes on (no second wait),
    # and it is merged when it lands.
    swarm = Swarm(base_model, 2, _outer(method="alpha", h=SLOW_H, tau=1, max_delay=3))
    held, ev = _slow_round(swarm, release_at=None, until=SLOW_H + 2)
    t0 = time.monotonic()
    assert not _kinds(swarm.step(SLOW_H + 3)[0], "merged")
    assert 2 * stall <= time.monotonic() - t0 < 3 * stall + 0.8  # each of the two workers waited its budget once
    assert all(loop.stats.stalls_cut == 1 for loop in swarm.loops) and [lp.version(0) for lp in swarm.loops] == [0, 0]
    t0 = time.monotonic()
    assert not _kinds(swarm.step(SLOW_H + 4)[0], "merged") and time.monotonic() - t0 < 0.5 * stall
    for h in held:
        h.released = True
    merged = _kinds(swarm.step(SLOW_H + 5)[0], "merged")
    assert len(merged) == 1 and not any(h.waited for h in held)
    assert [loop.version(0) for loop in swarm.loops] == [1, 1] and torch.equal(swarm.phi(0), swarm.phi(1))
    # Blocking DiLoCo; compensate (its correction fed back when merged late); no late window at all: they wait
    # at tau, for as long as the round takes (no stall budget).
    for kw in ({"method": "replace"}, {"method": "compensate"}, {"method": "alpha", "max_delay": 0}):
        swarm = Swarm(base_model, 2, _outer(h=SLOW_H, tau=1, **kw))
        assert swarm.loops[0].late_window() == 1
        held, ev = _slow_round(swarm, release_at=None, until=SLOW_H + 1)
        assert held and all(h.waited for h in held) and _kinds(ev[SLOW_H + 1], "merged")
        assert swarm.loops[0].stats.stalls_cut == 0


def test_the_stall_budget_is_the_late_windows_wall_time_at_least_a_floor() -> None:
    from locoswarm.node.core.late_window import MIN_STALL_S, has_late_window, stall_budget

    assert stall_budget(0.05) == MIN_STALL_S and stall_budget(7.5) == 7.5
    assert has_late_window(merges_late=True, max_delay=-1) and has_late_window(merges_late=True, max_delay=3)
    assert not has_late_window(merges_late=True, max_delay=0) and not has_late_window(merges_late=False, max_delay=-1)


def test_two_catch_ups_in_a_row_without_a_merged_round_are_a_catch_up_loop(base_model) -> None:
    # Worker 2's syncs at steps 2 and 4 are dropped: it catches up at 4 (behind after 2), is dropped again,
    # catches up again at 6 (a loop), merges at 6; later catch-ups would start a new count.
    swarm = Swarm(base_model, 3, _outer(method="rebase", h=2, tau=1), drops={2: {2, 4}})
    kinds: dict[int, list[str]] = {}
    for t in range(1, 11):
        kinds[t] = [e.kind for e in swarm.step(t)[2]]
    assert "caught_up" in kinds[4] and "catch_up_loop" not in kinds[4]
    assert "caught_up" in kinds[6] and "catch_up_loop" in kinds[6]
    assert all("catch_up_loop" not in k for t, k in kinds.items() if t != 6)
    assert swarm.loops[2].stats.catch_up_loops == 1 and swarm.loops[0].stats.catch_up_loops == 0
    assert swarm.loops[2].states[0].catch_ups_in_row == 0  # merged since


def test_stats_bytes_equal_results_and_reduce_pattern(base_model) -> None:
    swarm = Swarm(base_model, 3, _outer(h=2, fragments=2))
    all_events = [[] for _ in range(3)]
    for t in range(1, 7):
        for i, ev in enumerate(swarm.step(t)):
            all_events[i] += ev
    for i, loop in enumerate(swarm.loops):
        results = [h.result() for _, h in swarm.transports[i].calls]
        assert loop.stats.bytes_sent == sum(r.bytes_sent for r in results) == sum(e.bytes_sent for e in all_events[i])
        assert loop.stats.bytes_received == sum(r.bytes_received for r in results)
        assert loop.stats.bytes_sent > 0
    # per round: total sent == total received == 2 (n-1) payloads + headers of the n (n-1) messages
    n = 3
    for k in range(len(swarm.transports[0].calls)):
        req = swarm.transports[0].calls[k][0]
        res = [tr.calls[k][1].result() for tr in swarm.transports]
        total = 2 * (n - 1) * 4 * req.numel + n * (n - 1) * HEADER_BYTES
        assert sum(r.bytes_sent for r in res) == sum(r.bytes_received for r in res) == total


def test_eager_runs_rounds_and_theta_equals_phi_after_send(base_model) -> None:
    outer = _outer(method="eager", h=3, tau=3)
    swarm = Swarm(base_model, 2, outer)
    phi0 = swarm.phi(0)
    for t in range(1, 13):
        swarm.train()
        if t == 3:
            own = phi0 - swarm.theta(0)
        events = swarm.sync(t)
        if t % 3 == 0:
            assert [e.kind for e in events[0]] == (["sent"] if t == 3 else ["merged", "sent"])
            for i in range(2):
                assert torch.isfinite(swarm.phi(i)).all()
                assert torch.equal(swarm.theta(i), swarm.phi(i))
        if t == 3:
            # first round: g = own/2, b = g, phi = phi0 - lr (g + mu g)
            assert_close(swarm.phi(0), phi0 - outer.lr * (1 + outer.momentum) * 0.5 * own, atol=1e-6, rtol=0)
    assert [loop.stats.syncs_ok for loop in swarm.loops] == [3, 3]
    assert [loop.version(0) for loop in swarm.loops] == [4, 4]


def test_eager_with_one_worker_is_blocking_diloco_exactly(base_model) -> None:
    """Alone, the group average of round k-1 is exactly the node's own contribution, so the eager outer
    gradient avg(k-1) - own(k-1) + own(k) is own(k): the outer steps of blocking DiLoCo, at the same steps."""
    eager = Swarm(base_model, 1, _outer(method="eager", h=3, tau=3))
    diloco = Swarm(base_model, 1, _outer(method="replace", h=3, tau=0))
    for t in range(1, 19):
        eager.step(t)
        diloco.step(t)
        assert torch.equal(eager.theta(0), diloco.theta(0)), t
        assert torch.equal(eager.phi(0), diloco.phi(0)), t
    assert eager.loops[0].version(0) == diloco.loops[0].version(0) == 6


def test_eager_with_identical_workers_applies_own_at_once_and_the_rest_a_round_late(base_model) -> None:
    """M workers with identical data: all hold one phi, and round k's outer gradient is the paper's
    g_k = own_k / M + (M - 1) / M * avg_{k-1} with avg_{k-1} = own_{k-1} (not DiLoCo's own_k: eager with
    identical data is DiLoCo with (M-1)/M of every update one round late, so the two differ)."""
    m, h = 3, 2
    outer = _outer(method="eager", h=h, tau=h)
    swarm = Swarm(base_model, m, outer)
    swarm.gens = [torch.Generator().manual_seed(5) for _ in range(m)]  # identical inner progress
    phi, buf = swarm.phi(0), torch.zeros_like(swarm.phi(0))
    opt = NesterovOuterOptimizer(outer.lr, outer.momentum)
    prev = None
    for t in range(1, 4 * h + 1):
        swarm.train()
        own = swarm.phi(0) - swarm.theta(0)
        swarm.sync(t)
        if t % h:
            continue
        g = own / m if prev is None else own / m + (m - 1) / m * prev
        opt.step(phi, buf, g)
        prev = own
        for i in range(m):
            assert_close(swarm.phi(i), phi, atol=1e-6, rtol=0)
            assert torch.equal(swarm.phi(i), swarm.phi(0))


def test_naive_delay_applies_the_previous_rounds_average_and_restarts_theta(base_model) -> None:
    """The naive one-outer-step delay (lr 1, no momentum, by hand): at the send of round k the outer step is
    the group average of round k-1 (nothing at round 1), theta <- phi, and round k's fresh progress, measured
    from the phi of round k-1, is sent. Unlike rebase, the progress made while round k-1 ran is not kept."""
    swarm = Swarm(base_model, 2, _outer(method="delay", h=2, tau=2, lr=1.0, momentum=0.0))
    phi0 = swarm.phi(0)
    sent_from = phi0
    for t in range(1, 7):
        swarm.train()
        own = [swarm.phi(i) - swarm.theta(i) for i in range(2)]
        events = swarm.sync(t)
        if t % 2:
            continue
        k = t // 2
        req = swarm.transports[0].calls[-1][0]
        assert_close(decode_chunks(get_codec("fp32"), req.chunks, req.numel), own[0], atol=0, rtol=0)
        if k == 1:
            assert torch.equal(swarm.phi(0), phi0)  # nothing late yet: a zero step
        else:
            late = swarm.transports[0].calls[-2][1].result().average
            assert_close(swarm.phi(0), sent_from - late, atol=1e-6, rtol=0)
            assert [e.kind for e in events[0]] == ["merged", "sent"]
        for i in range(2):
            assert torch.equal(swarm.theta(i), swarm.phi(i))
        assert_close(swarm.phi(0), swarm.phi(1), atol=0, rtol=0)
        sent_from = swarm.phi(0)
    assert [loop.version(0) for loop in swarm.loops] == [3, 3]


def _eager_cumulative(base_model, tokens: list[float]) -> tuple[Swarm, torch.Tensor, list[torch.Tensor]]:
    """lr = 1, mu = 0: phi_end = phi0 - sum of all outer gradients applied (two rounds, then drain)."""
    swarm = Swarm(base_model, 2, _outer(method="eager", h=2, tau=2, lr=1.0, momentum=0.0))
    phi0 = swarm.phi(0)
    for t in range(1, 5):
        swarm.step(t, tokens)
    for loop in swarm.loops:
        loop.drain(5)
    averages = [h.result().average for _, h in swarm.transports[0].calls]
    assert len(averages) == 2
    return swarm, phi0, averages


def test_eager_applies_exactly_the_group_averages_equal_weights(base_model) -> None:
    swarm, phi0, averages = _eager_cumulative(base_model, [10.0, 10.0])
    for i in range(2):
        assert_close(swarm.phi(i), phi0 - averages[0] - averages[1], atol=1e-6, rtol=0)


def test_eager_applies_exactly_the_group_averages_unequal_weights(base_model) -> None:
    swarm, phi0, averages = _eager_cumulative(base_model, [30.0, 10.0])
    for i in range(2):
        assert_close(swarm.phi(i), phi0 - averages[0] - averages[1], atol=1e-6, rtol=0)
    assert_close(swarm.phi(0), swarm.phi(1), atol=1e-6, rtol=0)


def test_eager_outer_gradient_subtracts_the_share_in_the_group_and_brings_its_own_part_to_it() -> None:
    """Round t-1 averaged 3/4 a + 1/4 b (this node: a, weight 3 of 4) while it had applied a at the share
    it expected then (1/2): the others' part is avg - 3/4 a = 1/4 b, its own part of t-1 gets the missing
    1/4 a, and its fresh c enters at 3/4. Left out of the group (share 0), the average is all others' and
    the 1/2 a it applied is taken back."""
    a, b, c = _t(4, 0), _t(0, 8), _t(1, 1)
    g = eager_outer_gradient(0.75 * a + 0.25 * b, a, 0.75, 0.5, c, 0.75)
    assert_close(g, 0.25 * b + 0.25 * a + 0.75 * c)
    g = eager_outer_gradient(b, a, 0.0, 0.5, c, 0.25)
    assert_close(g, b - 0.5 * a + 0.25 * c)


class _LeftOutHandle(AverageHandle):
    """This node's contribution was not in the group that averaged the round (screened out, say): the
    group's result, as ``peer`` got it, with no weight of this node in it."""

    def __init__(self, peer: AverageHandle) -> None:
        self.peer = peer

    def done(self) -> bool:
        return self.peer.done()

    def result(self, timeout: float | None = None) -> AverageResult:
        r = self.peer.result(timeout)
        return AverageResult(ok=True, average=r.average, group_size=r.group_size, total_weight=r.total_weight,
                             own_weight=0.0, max_version=r.max_version)


def test_eager_worker_left_out_of_a_round_rejoins_the_groups_phi_and_keeps_its_share(base_model) -> None:
    """Three workers (lr 1, no momentum); worker 2's contribution is not in round 2's group {0, 1}. At round
    3 its share in that group is 0: the group's average enters whole, the third of its own round-2 progress
    it applied is taken back, and it keeps expecting a third for its fresh part (not the 1/2 of a group it
    was not in). Workers 0 and 1 had a share of 1/2 in it and expect 1/2. So every phi is the sum of the
    group averages minus the worker's own fresh part at its expected share."""
    swarm = Swarm(base_model, 3, _outer(method="eager", h=2, tau=2, lr=1.0, momentum=0.0))
    swarm.transports[2].start_average = _left_out_at(swarm.transports[2], 4, swarm.transports[0])
    phi0 = swarm.phi(0)
    for t in range(1, 6):
        swarm.step(t)
    swarm.train()
    own = [swarm.phi(i) - swarm.theta(i) for i in range(3)]
    swarm.sync(6)
    averages = [swarm.transports[0].calls[k][1].result().average for k in range(2)]
    for i, share in enumerate((0.5, 0.5, 1 / 3)):
        assert_close(swarm.phi(i), phi0 - averages[0] - averages[1] - share * own[i], atol=1e-6, rtol=0)


def _left_out_at(transport: RecordingTransport, round_: int, peer: RecordingTransport):
    """``transport.start_average`` that leaves its node out of round ``round_`` (``peer`` sends first)."""
    start = transport.start_average

    def start_average(request: AverageRequest) -> AverageHandle:
        if request.round != round_:
            return start(request)
        handle = _LeftOutHandle(peer.calls[-1][1])
        transport.calls.append((request, handle))
        return handle
    return start_average


class _Quadratic(torch.nn.Module):
    """One parameter vector w; a worker's loss is |w - c_m|^2 / 2, trained by plain gradient descent."""

    def __init__(self, w0: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w0.clone())


def _quadratic_swarm(method: str, centers: list[torch.Tensor], *, h: int, gamma: float, lr: float, momentum: float,
                     rounds: int) -> list[OuterLoop]:
    """Workers m = 0..M-1 minimize |w - c_m|^2 / 2 with ``h`` gradient steps of size ``gamma`` per round
    (w <- c_m + (1 - gamma)^h (w - c_m)), synced by ``method``; drained at the end."""
    from locoswarm.node.partition import Fragment

    n, dim = len(centers), centers[0].numel()
    outer = _outer(method=method, h=h, tau=h if method in ("eager", "delay", "rebase") else 0, lr=lr,
                   momentum=momentum)
    hub = InProcessHub(get_codec("fp32"), n, robust=PLAIN)
    models = [_Quadratic(torch.zeros(dim)) for _ in range(n)]
    loops = [OuterLoop(m, [Fragment(0, ("w",), (), dim)], outer, hub.transport(i), expected_group_size=n)
             for i, m in enumerate(models)]
    for i, loop in enumerate(loops):
        hub.register_state(i, loop.version, loop.snapshot)
    for t in range(1, rounds * h + 1):
        with torch.no_grad():
            for model, c in zip(models, centers, strict=True):
                model.w.sub_(gamma * (model.w - c))
        for loop in loops:
            loop.add_tokens(1.0)
        _lockstep(loops, hub, t)
    for loop in loops:
        loop.drain(rounds * h)
    return loops


def _lockstep(loops: list[OuterLoop], hub: InProcessHub, t: int) -> None:
    """One clock step of workers in one thread, as the simulator drives them: collect, send, flush, collect."""
    for loop in loops:
        loop.collect(t)
    for loop in loops:
        loop.send(t)
    hub.flush()
    for loop in loops:
        loop.collect(t)


QUAD_CENTERS = [_t(1.0, -2.0, 0.5), _t(3.0, 0.0, -1.5), _t(-1.0, 4.0, 2.5), _t(1.0, 2.0, 0.5)]


def test_eager_over_two_rounds_applies_each_contribution_once_on_a_quadratic() -> None:
    """By hand (lr 1, no momentum; kappa = 1 - (1 - gamma)^h is the share of the way to c_m a round goes):
    round 1: d_m1 = kappa (phi0 - c_m), phi1_m = phi0 - d_m1 / M (own part at once);
    round 2 from phi1_m: d_m2 = kappa (phi1_m - c_m), phi2_m = phi1_m - (avg(d_1) - d_m1 / M + d_m2 / M)
    = phi0 - avg(d_1) - d_m2 / M: round 1's contributions applied exactly once (neither doubled nor dropped),
    round 2's own part at 1/M; the drain adds the others' part of round 2, so all end at phi0 - avg(d_1) -
    avg(d_2)."""
    m, h, gamma = len(QUAD_CENTERS), 3, 0.2
    kappa = 1 - (1 - gamma) ** h
    loops = _quadratic_swarm("eager", QUAD_CENTERS, h=h, gamma=gamma, lr=1.0, momentum=0.0, rounds=2)
    phi0 = torch.zeros(3)
    d1 = [kappa * (phi0 - c) for c in QUAD_CENTERS]
    d2 = [kappa * (phi0 - d / m - c) for d, c in zip(d1, QUAD_CENTERS, strict=True)]
    expected = phi0 - sum(d1) / m - sum(d2) / m
    for loop in loops:
        assert_close(loop.states[0].phi, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("method", "momentum"), [("replace", 0.9), ("delay", 0.9), ("rebase", 0.9), ("eager", 0.0)])
def test_every_overlap_rule_converges_to_the_mean_objectives_minimum_on_a_quadratic(method: str,
                                                                                   momentum: float) -> None:
    """The minimum of the mean of |w - c_m|^2 / 2 is the mean of the c_m: DiLoCo, the naive delay, rebase and
    eager all bring every worker there (a counting defect, an own part applied twice or never, would move
    it). Eager without momentum: with it, see the next test."""
    loops = _quadratic_swarm(method, QUAD_CENTERS, h=3, gamma=0.05, lr=0.7, momentum=momentum, rounds=400)
    for loop in loops:
        assert_close(loop.states[0].phi, sum(QUAD_CENTERS) / len(QUAD_CENTERS), atol=1e-3, rtol=0)


def test_eager_under_momentum_reaches_the_minimum_on_average_over_its_workers() -> None:
    """Under Nesterov momentum eager's fixed points are every set of phis whose mean progress is zero: its
    own-share dipoles (+s d at round k, -s d at k+1) leave each worker's phi s * sum_j step_j d_(k-j) from the
    group's, weights summing to lr / (1 - mu) (0.7 without momentum, 7 with 0.9), and nothing pulls the
    workers together. The mean of the workers' phis is the minimum all the same."""
    loops = _quadratic_swarm("eager", QUAD_CENTERS, h=3, gamma=0.05, lr=0.7, momentum=0.9, rounds=400)
    mean_phi = sum(loop.states[0].phi for loop in loops) / len(loops)
    assert_close(mean_phi, sum(QUAD_CENTERS) / len(QUAD_CENTERS), atol=1e-3, rtol=0)


def test_a_stale_update_under_nesterov_momentum_diverges_on_a_stiff_quadratic() -> None:
    """Why eager trailed DiLoCo: with 4 workers 3/4 of eager's update is one round stale, and a round that
    takes a stiff direction most of the way (gamma 0.5, h 3: kappa 0.875) makes the stale update, amplified
    by Nesterov momentum 0.9 at lr 0.7, overshoot more each round (spectral radius 1.09 for eager, 1.23 for
    the naive delay, 0.59 for DiLoCo); without momentum eager settles too (0.68)."""
    def distance(method: str, momentum: float) -> float:
        loops = _quadratic_swarm(method, QUAD_CENTERS, h=3, gamma=0.5, lr=0.7, momentum=momentum, rounds=40)
        return float(torch.linalg.vector_norm(loops[0].states[0].phi - sum(QUAD_CENTERS) / len(QUAD_CENTERS)))

    start = float(torch.linalg.vector_norm(sum(QUAD_CENTERS) / len(QUAD_CENTERS)))
    assert distance("replace", 0.9) < 1e-4 * start
    assert distance("eager", 0.9) > start
    assert distance("delay", 0.9) > distance("eager", 0.9)
    assert distance("eager", 0.0) < 1e-4 * start


@pytest.mark.parametrize("method", ["alpha", "compensate", "rebase"])
def test_overlapped_merge_happens_at_send_plus_tau(base_model, method: str) -> None:
    outer = _outer(method=method, h=4, tau=2, alpha=0.5, lambda0=0.2)
    swarm = Swarm(base_model, 2, outer)
    for t in range(1, 4):
        swarm.step(t)
    swarm.train()
    snapshots = [swarm.theta(i) for i in range(2)]
    events = swarm.sync(4)
    assert [e.kind for e in events[0]] == ["sent"]
    phi_sent = swarm.phi(0)
    events = swarm.step(5)
    assert events == [[], []]
    assert torch.equal(swarm.phi(0), phi_sent) and swarm.loops[0].version(0) == 0
    swarm.train()
    theta_pre = [swarm.theta(i) for i in range(2)]
    events = swarm.sync(6)
    assert [(e.kind, e.step) for e in events[0]] == [("merged", 6)]
    assert swarm.loops[0].version(0) == 1
    assert torch.equal(swarm.phi(0), swarm.phi(1)) and not torch.equal(swarm.phi(0), phi_sent)
    st = swarm.loops[0].states[0]
    if method == "alpha":
        expected = merge_alpha(theta_pre[0], st.phi, 0.5)
    elif method == "rebase":
        expected = merge_rebase(theta_pre[0], st.phi, snapshots[0])
    else:
        expected = merge_compensate(theta_pre[0], st.phi, snapshots[0], 0.2, st.bounds)
    assert_close(swarm.theta(0), expected, atol=1e-6, rtol=0)
    assert not torch.equal(swarm.theta(0), st.phi)


def test_adaptive_schedule_group_members_pick_the_same_fragment(base_model) -> None:
    swarm = Swarm(base_model, 2, _outer(method="replace", h=4, fragments=2, schedule="adaptive", sends_per_h=4))
    picks = []
    for t in range(1, 13):
        events = swarm.step(t)
        sent = [[e.fragment for e in ev if e.kind == "sent"] for ev in events]
        assert sent[0] == sent[1] and len(sent[0]) == 1
        picks.append(sent[0][0])
        assert not _kinds(events[0], "failed")
    assert picks[:2] == [0, 1]  # never-sent fragments first
    assert swarm.loops[0].shared_r is not None and swarm.loops[0].shared_r.numel() == 2
    assert torch.equal(swarm.loops[0].shared_r, swarm.loops[1].shared_r)


def test_the_side_vector_r_is_summed_over_the_group_not_averaged() -> None:
    """CoCoDC all-reduces R with a sum (its public restatement): with unequal token weights a weighted
    mean would rank the fragments differently from the sum."""
    codec = get_codec("fp32")
    hub = InProcessHub(codec, 4, seed=0, robust=PLAIN)
    chunks = encode_chunks(codec, torch.ones(8))
    handles = [hub.transport(i).start_average(AverageRequest(0, 5, chunks, 8, weight, 1, extras=_t(*r)))
               for i, (weight, r) in enumerate([(1.0, (0.9, 0.0)), (9.0, (0.0, 0.2))])]
    hub.flush()
    results = [h.result(5) for h in handles]
    assert all(r.ok for r in results)
    for r in results:
        assert_close(r.extras, _t(0.9, 0.2))  # the token-weighted mean (0.09, 0.18) would pick fragment 1


def test_adaptive_schedule_adopting_the_leaders_state_realigns_picks(base_model) -> None:
    """Two members whose schedule states diverged pick different fragments; once one adopts the other's
    state as it was at the slot (what the slot's matchmaking tells it), they pick alike again."""
    swarm = Swarm(base_model, 2, _outer(method="replace", h=4, fragments=2, schedule="adaptive", sends_per_h=2))
    for t in range(1, 9):
        swarm.step(t)
    leader = swarm.loops[0]
    pick = leader.schedule.pick(10, ScheduleView([s.last_send for s in leader.states], shared_r=leader.shared_r))
    state_at_slot = leader.schedule_state()
    swarm.loops[1].states[1 - pick].last_send = None  # diverged (say, a restart from an old checkpoint)
    events = swarm.step(10)
    picks = [[e.fragment for e in ev if e.kind == "sent"] for ev in events]
    assert picks == [[pick], [1 - pick]]
    leader_request = next(req for req, _ in reversed(swarm.transports[0].calls) if req.round == 10)
    assert leader_request.schedule == state_at_slot and leader_request.fragment == pick
    swarm.loops[1].adopt_schedule(leader_request.schedule, leader_request.fragment, 10)
    assert swarm.loops[1].schedule_state() == swarm.loops[0].schedule_state()
    for t in range(11, 23):
        events = swarm.step(t)
        sent = [[e.fragment for e in ev if e.kind == "sent"] for ev in events]
        assert sent[0] == sent[1], (t, sent)
        assert not _kinds(events[0], "failed") and not _kinds(events[1], "failed")


# ---- consensus of phi under gossip -------------------------------------------------------------------

def _spread(swarm: Swarm, n: int) -> float:
    phis = torch.stack([swarm.phi(i) for i in range(n)])
    mean = phis.mean(0)
    return float((phis - mean).norm(dim=1).max() / mean.norm())


@pytest.mark.slow  # about 60 s here: a long gossip run, outside the fast tier
def test_consensus_keeps_phi_spread_bounded_under_pairwise_gossip(base_model) -> None:
    """Without consensus rounds phi random-walks apart under pairwise gossip (the spread grows); with one
    every 2nd round it stays bounded (measured at 40 and 80 steps)."""
    spreads = {}
    for every in (0, 2):
        swarm = Swarm(base_model, 4, _outer(h=2, consensus_every=every), group_size=2, seed=1)
        for t in range(1, 81):
            swarm.step(t)
            if t == 40:
                spreads[(every, t)] = _spread(swarm, 4)
        spreads[(every, 80)] = _spread(swarm, 4)
        if every:
            assert swarm.loops[0].stats.consensus_rounds == 20
    assert spreads[(0, 80)] > spreads[(0, 40)] > 0
    assert spreads[(2, 80)] <= spreads[(2, 40)] * 1.1, spreads
    assert spreads[(2, 80)] < 0.2 * spreads[(0, 80)], spreads


def test_consensus_under_all_reduce_moves_nothing_and_costs_no_bytes(base_model) -> None:
    sent = {}
    for every in (0, 1):
        swarm = Swarm(base_model, 3, _outer(h=2, tau=1, method="rebase", consensus_every=every))
        for t in range(1, 6):
            swarm.step(t)
        # Under an all-reduce every phi is equal: digests agree, the round exchanges nothing.
        assert all(torch.equal(swarm.phi(i), swarm.phi(0)) for i in range(3))
        sent[every] = swarm.loops[0].stats.bytes_sent
        if every:
            assert swarm.loops[0].stats.consensus_rounds >= 2
            assert swarm.loops[0].stats.last_consensus_shift == 0.0
    assert sent[1] == sent[0] > 0


def test_consensus_shift_moves_phi_and_theta_together(base_model) -> None:
    swarm = Swarm(base_model, 4, _outer(h=2, consensus_every=1), group_size=2, seed=2)
    for t in range(1, 3):
        swarm.step(t)
    loop = swarm.loops[0]
    before = [(swarm.theta(i) - swarm.phi(i)) for i in range(4)]
    swarm.train()
    progress = [(swarm.theta(i) - swarm.phi(i)) for i in range(4)]
    assert not torch.equal(before[0], progress[0])
    swarm.sync(3)  # no sync due at an odd step: nothing moves
    swarm.train()
    swarm.sync(4)  # a delta round plus a consensus round (uniform mean of phi within the pair)
    assert loop.stats.consensus_rounds >= 2
    assert loop.stats.last_consensus_shift > 0


def test_consensus_makes_diverged_outer_states_bit_identical_and_they_stay_so(base_model) -> None:
    """Two members at one version whose phi *and* momentum differ (say each stepped alone before they met):
    a consensus round averages the whole outer state, and its result is exact: both then hold bit-identical
    phi and momentum, and every later round keeps them so (a phi-only consensus left them apart for good,
    since their momenta differed and every outer step moved them apart again)."""
    for method, tau in (("replace", 0), ("alpha", 1)):
        swarm = Swarm(base_model, 2, _outer(h=2, tau=tau, method=method, consensus_every=2))
        for t in range(1, 3):
            swarm.step(t)
        other = swarm.loops[1].states[0]
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            other.phi.add_(torch.randn(other.phi.shape, generator=gen), alpha=1e-3)
            other.momentum.add_(torch.randn(other.phi.shape, generator=gen), alpha=1e-3)
        assert not torch.equal(swarm.phi(0), swarm.phi(1))
        identical_from = None
        for t in range(3, 21):
            swarm.step(t)
            same = (torch.equal(swarm.phi(0), swarm.phi(1))
                    and torch.equal(swarm.loops[0].states[0].momentum, swarm.loops[1].states[0].momentum))
            if identical_from is None and same:
                identical_from = t
            assert same or identical_from is None, (method, t, "apart again after a consensus made them equal")
        assert identical_from is not None and identical_from <= 8, (method, identical_from)
        assert swarm.loops[0].stats.consensus_rounds >= 4
        assert swarm.loops[0].version(0) == swarm.loops[1].version(0)


class _Gate(AverageHandle):
    """A consensus round still exchanging until ``open``; ``waited``: someone blocked on it before that."""

    def __init__(self, inner: AverageHandle) -> None:
        self.inner, self.open, self.waited = inner, False, False

    def done(self) -> bool:
        return self.open and self.inner.done()

    def result(self, timeout: float | None = None) -> AverageResult:
        self.waited = self.waited or not self.open
        return self.inner.result(timeout)


@pytest.mark.parametrize("late", ["both", "one"])
def test_a_consensus_round_still_exchanging_holds_no_merge_and_is_taken_at_a_later_one(base_model, late) -> None:
    """A consensus round whose members differ moves the whole outer state in fp32 (on a slow link, tens of
    seconds): the delta round sent with it merges after waiting for it ``CONSENSUS_WAIT_S`` at most (never
    blocking on ``result()``), and the consensus is taken at the first merge of the fragment after it came
    through, moving phi and theta together. Taken late, the outer step taken meanwhile is applied again from the
    group's mean state: the members then hold the same phi and momentum bit for bit, whether both took it late or
    one in time and one late (the mean plus the local moves left them apart by the momentum of that step)."""
    swarm = Swarm(base_model, 2, _outer(h=2, tau=0, method="replace", consensus_every=2))
    swarm.step(1)
    other = swarm.loops[1].states[0]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        other.phi.add_(torch.randn(other.phi.shape, generator=gen), alpha=1e-3)
        other.momentum.add_(torch.randn(other.momentum.shape, generator=gen), alpha=1e-3)
    swarm.train()
    for i, loop in enumerate(swarm.loops):
        swarm.loops[i].advance_sends(1, 2, 0.0)  # a delta round and a consensus round (due at step 2)
        loop.pending_consensus[0].handle = _Gate(loop.pending_consensus[0].handle)
    swarm.hub.flush()
    gates = [loop.pending_consensus[0].handle for loop in swarm.loops]
    if late == "one":
        gates[0].open = True
    versions = [loop.version(0) for loop in swarm.loops]
    events = [loop.collect(2) for loop in swarm.loops]
    assert all(_kinds(e, "merged") for e in events), events
    assert [loop.version(0) for loop in swarm.loops] == [v + 1 for v in versions]
    assert not any(g.waited for g in gates)
    assert [0 in loop.pending_consensus for loop in swarm.loops] == [late == "both", True]
    assert [loop.stats.consensus_rounds for loop in swarm.loops] == [int(late == "one"), 0]
    for gate in gates:
        gate.open = True
    for t in range(3, 5):  # the next delta round of fragment 0 merges at step 4: the consensus is taken first
        swarm.step(t)
    assert all(loop.stats.consensus_rounds == 1 and 0 not in loop.pending_consensus for loop in swarm.loops)
    assert all(loop.stats.last_consensus_shift > 0 for loop in swarm.loops)
    assert torch.equal(swarm.phi(0), swarm.phi(1))
    assert torch.equal(swarm.loops[0].states[0].momentum, swarm.loops[1].states[0].momentum)


# ==================================================================================================
# Outer state off the training device (``[outer] offload``)
# ==================================================================================================


def test_offload_setting_picks_where_the_outer_state_lives() -> None:
    from locoswarm.node.core.state import outer_state_device

    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert outer_state_device("auto", gpu) == cpu and outer_state_device("auto", cpu) == cpu
    assert outer_state_device("off", gpu) == gpu and outer_state_device("cpu", gpu) == cpu
    with pytest.raises(ValueError, match="offload"):
        outer_state_device("disk", cpu)


def test_fragment_state_copies_theta_parameter_by_parameter_across_dtypes() -> None:
    from locoswarm.node.core.state import FragmentState

    params = [torch.nn.Parameter(torch.randn(3, 4).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(5))]
    st = FragmentState.create(0, params, error_feedback=True, device=torch.device("cpu"))
    assert st.phi.dtype == torch.float32 and st.device == torch.device("cpu") and st.numel == 17
    assert torch.equal(st.phi[:12], params[0].detach().float().reshape(-1))
    new = torch.arange(17, dtype=torch.float32) / 7
    st.set_theta(new)
    assert params[0].dtype == torch.bfloat16 and torch.equal(params[1].detach(), new[12:])
    assert torch.equal(st.theta(), torch.cat([new[:12].to(torch.bfloat16).float(), new[12:]]))


@pytest.mark.parametrize("offload", ["off", "cpu"])
def test_outer_steps_are_the_same_wherever_the_outer_state_lives(base_model, offload: str) -> None:
    """Two workers on the training device (CUDA where there is one); the outer state on it or on the CPU
    (pinned): the same phi after the same rounds, and the model stays on its device."""
    from locoswarm.node.core.state import outer_state_device

    train = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    phis = {}
    for where in ("off", offload):
        hub = InProcessHub(get_codec("fp32"), 2, seed=0, robust=PLAIN)
        models = [copy.deepcopy(base_model).to(train) for _ in range(2)]
        outer = _outer(method="alpha", h=2, fragments=2, tau=1)
        device = outer_state_device(where, train)
        loops = [OuterLoop(m, partition(base_model, 2), outer, hub.transport(i), expected_group_size=2,
                           state_device=device) for i, m in enumerate(models)]
        for i, loop in enumerate(loops):
            hub.register_state(i, loop.version, loop.snapshot)
        gens = [torch.Generator().manual_seed(50 + i) for i in range(2)]
        for t in range(1, 9):
            for model, loop, gen in zip(models, loops, gens, strict=True):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen).to(train), alpha=1e-3)
                loop.add_tokens(10.0)
            _lockstep(loops, hub, t)
        assert all(loop.stats.syncs_ok >= 6 for loop in loops)
        assert all(st.device.type == device.type for loop in loops for st in loop.states)
        assert all(p.device.type == train.type for m in models for p in m.parameters())
        if device.type == "cpu" and train.type == "cuda":
            assert all(st.phi.is_pinned() for loop in loops for st in loop.states)
        phis[where] = [st.phi.cpu() for loop in loops for st in loop.states]
    for a, b in zip(phis["off"], phis[offload], strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


class _DoneHandle(AverageHandle):
    def __init__(self, result: AverageResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> AverageResult:
        return self._result


class _BackgroundTransport(Transport):
    """A transport whose rounds finish by the time the driver asks (as the swarm's, running on its own
    thread, does for a fast round): each is a group of two whose other member sent the same progress."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, int, float]] = []  # (fragment, round, weight)

    def start_average(self, request: AverageRequest) -> AverageHandle:
        self.rounds.append((request.fragment, request.round, request.weight))
        codec = get_codec(request.codec or "fp32")
        avg = decode_chunks(codec, request.chunks, request.numel)
        return _DoneHandle(AverageResult(ok=True, average=avg, group_size=2, total_weight=2 * request.weight,
                                         own_weight=request.weight, max_version=request.version))

    def latest_version(self, fragment: int) -> int:
        return -1

    def fetch_fragment(self, fragment: int) -> FragmentSnapshot | None:
        return None


def test_advance_takes_each_crossed_slot_once_at_its_latest_and_merges_what_is_due(base_model) -> None:
    """The daemon's one call per inner step. h = 8, F = 2: fragment 1 is due at multiples of 8, fragment 0
    at 4 + multiples of 8. One step to 4 sends fragment 0 and (tau = 0) merges it in the same call; a jump of
    the swarm clock from 5 to 22 (a slow node taking the swarm's clock) crosses 14..22: each fragment is sent
    once, at its latest crossed slot (16 for fragment 1, 20 for fragment 0), with every token since its last
    send, and both merge in that call."""
    transport = _BackgroundTransport()
    loop = OuterLoop(copy.deepcopy(base_model), partition(base_model, 2), _outer(h=8, fragments=2), transport,
                     expected_group_size=2)
    kinds = [(e.kind, e.fragment) for e in loop.advance(3, 4, 10.0)]
    assert transport.rounds == [(0, 4, 10.0)]
    assert kinds == [("sent", 0), ("merged", 0)]
    assert loop.advance(4, 5, 10.0) == []
    events = loop.advance(5, 22, 30.0)
    assert transport.rounds[1:] == [(1, 16, 50.0), (0, 20, 40.0)]
    assert sorted((e.kind, e.fragment, e.round) for e in events if e.kind == "merged") == [
        ("merged", 0, 20), ("merged", 1, 16)]
    assert [loop.version(p) for p in range(2)] == [2, 1]


class _ThetaLog:
    """A ``ThetaAccess`` that records which fragment's theta the outer loop reads or writes at which step."""

    def __init__(self) -> None:
        self.step = 0
        self.log: list[tuple[int, str, int]] = []

    def before_read(self, fragment: int) -> None:
        self.log.append((self.step, "read", fragment))

    def after_write(self, fragment: int) -> None:
        self.log.append((self.step, "write", fragment))


@pytest.mark.parametrize("method", ["compensate", "eager"])
def test_the_outer_loop_touches_theta_only_of_the_fragment_it_syncs(base_model, method: str) -> None:
    """A node over several ranks moves a fragment between them only when the outer loop reads or writes its
    theta (``locoswarm.node.ranks.ThetaSync``): between syncs the outer loop touches none, and a send or a
    merge touches its own fragment only. Told or not, the outer steps are the same."""
    phis = {}
    for told in (False, True):
        hub = InProcessHub(get_codec("fp32"), 2, seed=0, robust=PLAIN)
        models = [copy.deepcopy(base_model) for _ in range(2)]
        logs = [_ThetaLog() for _ in range(2)]
        outer = _outer(method=method, h=8, fragments=2, tau=2)  # fragment 0 sent at 4, 12; 1 at 8, 16
        loops = [OuterLoop(m, partition(base_model, 2), outer, hub.transport(i), expected_group_size=2,
                           theta_access=logs[i] if told else None) for i, m in enumerate(models)]
        for i, loop in enumerate(loops):
            hub.register_state(i, loop.version, loop.snapshot)
        gens = [torch.Generator().manual_seed(70 + i) for i in range(2)]
        syncs: list[set[tuple[int, int]]] = [set(), set()]
        for t in range(1, 19):
            for i, (model, loop) in enumerate(zip(models, loops, strict=True)):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gens[i]), alpha=1e-3)
                loop.add_tokens(10.0)
                logs[i].step = t
            events: list[list] = [loop.collect(t) for loop in loops]
            for i, loop in enumerate(loops):
                events[i] += loop.send(t)
            hub.flush()
            for i, loop in enumerate(loops):
                events[i] += loop.collect(t)
                syncs[i] |= {(t, e.fragment) for e in events[i] if e.kind in ("sent", "merged")}
        phis[told] = [st.phi.clone() for loop in loops for st in loop.states]
        assert all(loop.stats.syncs_ok >= 2 for loop in loops), [loop.stats.syncs_ok for loop in loops]
    for i, log in enumerate(logs):
        touched = {(t, p) for t, _, p in log.log if t > 0}
        assert touched == syncs[i], f"worker {i}: theta touched at {sorted(touched)}, syncs at {sorted(syncs[i])}"
        assert {t for t, kind, _ in log.log if kind == "write" and t > 0}, "no merge wrote theta"
        assert {(0, "read", 0), (0, "read", 1)} == {e for e in log.log if e[0] == 0}  # phi's start
    for a, b in zip(phis[False], phis[True], strict=True):
        assert torch.equal(a, b)


def test_outer_steps_alone_are_counted_apart_from_rounds_with_peers(base_model) -> None:
    """A swarm of one merges its own progress (group size 1): those are solo steps, and the rounds merged with
    peers are ``syncs_ok - solo_steps`` (what the status reports as rounds)."""
    alone = Swarm(base_model, 1, _outer(h=2))
    pair = Swarm(base_model, 2, _outer(h=2))
    for t in range(1, 7):
        alone.step(t)
        pair.step(t)
    stats = alone.loops[0].stats
    assert stats.syncs_ok == stats.solo_steps == 3
    assert all(loop.stats.syncs_ok == 3 and loop.stats.solo_steps == 0 for loop in pair.loops)
