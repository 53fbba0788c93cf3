"""DiLoCoX's adaptive low-rank codec (node/core/lowrank.py): round trip and error bounds, linearity, error
feedback, the rank rule, exact bytes, the outer loop in the simulator, config and checkpoints."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch

from locoswarm.node.checkpoint import load_checkpoint, save_checkpoint
from locoswarm.node.config import (
    InnerSection,
    ModelSection,
    OuterSection,
    RobustSection,
    SwarmConfig,
    config_from_dict,
    fingerprint,
)
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.compress import BlockCompressor, wire_codec
from locoswarm.node.core.lowrank import (
    GROW_BELOW,
    SHRINK_ABOVE,
    AdaptiveRank,
    LowRankCompressor,
    LowRankLayout,
    lowrank_bits_per_element,
)
from locoswarm.node.core.outer_loop import OuterLoop, make_compressor
from locoswarm.node.core.payload import decode_chunks, payload_size
from locoswarm.node.core.transport import AverageRequest
from locoswarm.node.data import ByteTokenizer, load_corpus
from locoswarm.node.errors import ConfigError
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.model import build_model
from locoswarm.node.partition import partition
from locoswarm.node.sim.methods import method_config
from locoswarm.node.sim.simulator import SimSpec, simulate
from locoswarm.node.swarm.averaging import agree_on_basis
from locoswarm.node.swarm.exchange import Reduction
from locoswarm.node.swarm.matchmaking import match_entry
from locoswarm.node.swarm.offences import OffenceBook
from locoswarm.node.swarm.versions import RoundClaims
from locoswarm.node.swarm.wire import WireError
from locoswarm.node.transport.inprocess import InProcessHub
from locoswarm.protocol import swarm_pb2
from tests.stand_ins import exchange

VOCAB = 257
BLOCK = 64
# Rigorous bounds of the block codecs' relative L2 error at block size B (per element: int8 errs by at most
# s/254, s the block's absmax; fp4 by at most |x|/3 or s/128 below its smallest level), so sum_b B s_b^2 <=
# B |x|^2 gives these. The low-rank decode errs by exactly the codec's error on P (Q has orthonormal columns).
CODEC_BOUND = {"fp32": 1e-5, "int8": math.sqrt(BLOCK) / 254, "fp4": 1 / 3 + math.sqrt(BLOCK) / 128}


def _low_rank(rows: int, cols: int, k: int, seed: int) -> torch.Tensor:
    """A rows x cols matrix of rank k with comparable singular values (orthonormal factors, sigma in [1, 2])."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen))
    return (u * torch.linspace(2.0, 1.0, k)) @ v.T


def _compressor(shapes, codec: str = "fp32", rank: int = 4, min_rank: int = 1, max_rank: int = 16):
    return LowRankCompressor([(0, shapes)], get_codec(codec, BLOCK), rank=rank, min_rank=min_rank,
                             max_rank=max_rank)


def _round(comps: list[LowRankCompressor], deltas: list[torch.Tensor], round_: int,
           residuals: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """One round of a group of members with equal weights: each encodes, the group's mean of the decoded
    wire vectors and the summed extras come back, each finishes. Returns each member's dense result."""
    residuals = residuals or [None] * len(comps)
    encs = [c.encode(0, d, r, round_) for c, d, r in zip(comps, deltas, residuals, strict=True)]
    mean = torch.stack([decode_chunks(c.codec, e.chunks, e.numel) for c, e in zip(comps, encs, strict=True)]).mean(0)
    extras = torch.stack([e.extras for e in encs]).sum(0)
    return [c.finish(e.ticket, mean, extras, e.basis, r) for c, e, r in zip(comps, encs, residuals, strict=True)]


# ---- round trip, error bounds, linearity --------------------------------------------------------------

@pytest.mark.parametrize("codec", ["fp32", "int8", "fp4"])
def test_a_matrix_of_rank_at_most_r_round_trips_within_the_inner_codecs_error(codec: str) -> None:
    shapes = [(96, 64), (64,), (72, 80)]  # the last is taken transposed (its basis on its 72 rows)
    matrices = [_low_rank(96, 64, 3, 1), 0.1 * torch.randn(64), _low_rank(72, 80, 2, 2)]
    delta = torch.cat([m.reshape(-1) for m in matrices])
    comp = _compressor(shapes, codec)
    errors = []
    for t in range(4):  # the first round's basis is the seeded one; the power iteration finds the row spaces
        dense = _round([comp], [delta], t)[0]
        errors.append(float(torch.linalg.vector_norm(dense - delta) / torch.linalg.vector_norm(delta)))
    assert errors[0] > 0.5                                   # a random rank-4 basis misses most of it
    assert all(e <= CODEC_BOUND[codec] for e in errors[2:]), errors
    assert all(k <= r < 2 * k for r, k in zip(comp.ranks(0), (3, 2), strict=True))


def test_the_groups_mean_of_coefficients_decodes_to_the_projection_of_the_mean() -> None:
    shapes = [(48, 40), (40,), (40, 56)]
    a, b = _compressor(shapes), _compressor(shapes)
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(48 * 40 + 40 + 40 * 56, generator=gen) for _ in range(2)]
    q, q_rows = (x.double() for x in a.bases(0))
    mean = (deltas[0] + deltas[1]).double() / 2
    expected = torch.cat([(mean[:1920].view(48, 40) @ q @ q.T).reshape(-1), mean[1920:1960],
                          (q_rows @ q_rows.T @ mean[1960:].view(40, 56)).reshape(-1)])  # basis on the rows
    dense = _round([a, b], deltas, 0)
    assert torch.equal(dense[0], dense[1])
    assert torch.allclose(dense[0].double(), expected, atol=1e-5)


def test_error_feedback_sends_what_the_low_rank_drops_later() -> None:
    """A fixed full-rank 64 x 48 matrix at rank 4: without error feedback 11/12 of it are never sent; with it
    the residual grows until the basis turns to it, then stays bounded, so the sum of the decoded updates
    approaches the sum of the inputs (their gap is the residual, divided by the rounds)."""
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(64 * 48, generator=gen)
    with_ef, without = _compressor([(64, 48)], rank=4, max_rank=4), _compressor([(64, 48)], rank=4, max_rank=4)
    residual = torch.zeros_like(m)
    sent_ef, sent, residual_norms = torch.zeros_like(m), torch.zeros_like(m), []
    for t in range(80):
        sent_ef += _round([with_ef], [m], t, [residual])[0]
        sent += _round([without], [m], t)[0]
        residual_norms.append(float(torch.linalg.vector_norm(residual)))
    total = 80 * m

    def gap(x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x - total) / torch.linalg.vector_norm(total))

    assert gap(sent) > 0.5
    assert gap(sent_ef) < 0.15
    assert max(residual_norms[40:]) < 1.2 * max(residual_norms[:40])   # bounded: it stopped growing
    assert torch.allclose(sent_ef + residual, total, atol=1e-3 * float(total.abs().max()))  # it telescopes


# ---- the rank rule -------------------------------------------------------------------------------------

def test_the_rule_grows_below_the_captured_threshold_and_shrinks_on_a_concentrated_spectrum() -> None:
    rule = AdaptiveRank(2, 32)
    assert rule.next_rank(8, GROW_BELOW - 0.01, 1.0) == 16          # growing wins over shrinking
    assert rule.next_rank(32, 0.1, 0.0) == 32                        # capped at max
    assert rule.next_rank(8, 1.0, SHRINK_ABOVE) == 4
    assert rule.next_rank(8, 0.95, 0.95) == 4                        # the top half held 0.9025 of the energy
    assert rule.next_rank(8, 0.6, 1.0) == 8                          # a concentrated spectrum on a poor basis
    assert rule.next_rank(2, 1.0, 1.0) == 2                          # floored at min
    assert rule.next_rank(8, GROW_BELOW, SHRINK_ABOVE - 0.01) == 8
    p = torch.zeros(10, 4)
    p[0, 0], p[1, 1], p[2, 2] = 3.0, 1.0, 1.0
    assert rule.top_half_share(p) == pytest.approx(10 / 11)
    assert rule.captured_share(1.0, 4.0) == 0.25 and rule.captured_share(0.0, 0.0) == 1.0


@pytest.mark.parametrize("k", [2, 3, 5])
def test_on_low_rank_inputs_the_rank_settles_near_the_true_rank(k: int) -> None:
    comp = _compressor([(80, 64)], rank=8, max_rank=16)
    gen = torch.Generator().manual_seed(5)
    rows = torch.linalg.qr(torch.randn(64, k, generator=gen))[0].T
    seen = []
    for t in range(8):  # each round a new matrix of k equal singular values in the same row space
        m = torch.linalg.qr(torch.randn(80, k, generator=gen))[0] @ rows
        _round([comp], [m.reshape(-1)], t)
        seen.append(comp.ranks(0)[0])
    assert k <= seen[-1] < 2 * k, seen
    assert seen[-3:] == [seen[-1]] * 3, seen       # and stays there


def test_on_full_rank_inputs_the_rank_grows_to_the_max() -> None:
    comp = _compressor([(96, 96)], rank=2, max_rank=16)
    gen = torch.Generator().manual_seed(6)
    for t in range(5):
        _round([comp], [torch.randn(96 * 96, generator=gen)], t)
    assert comp.ranks(0) == (16,)


def test_members_with_different_data_end_with_the_same_rank_and_bit_identical_basis() -> None:
    shapes = [(80, 64), (64, 48), (64,)]
    members = [_compressor(shapes, "int8", rank=4, max_rank=16) for _ in range(3)]
    gen = torch.Generator().manual_seed(7)
    numel = 80 * 64 + 64 * 48 + 64
    for t in range(6):
        deltas = [torch.randn(numel, generator=gen) * (i + 1) for i in range(3)]
        deltas[0][: 80 * 64] += 10 * _low_rank(80, 64, 2, t).reshape(-1)   # local data of one member only
        dense = _round(members, deltas, t, [torch.zeros(numel) for _ in range(3)])
        assert all(torch.equal(dense[0], d) for d in dense[1:])
        assert len({m.tag(0) for m in members}) == 1
        assert len({m.ranks(0) for m in members}) == 1
        assert all(torch.equal(a, b) for m in members[1:] for a, b in zip(m.bases(0), members[0].bases(0),
                                                                          strict=True))
    assert members[0].ranks(0) != (4, 4)  # the rule did move the ranks meanwhile


# ---- bytes -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return build_model(ModelSection(), VOCAB)


def _fragments(model: torch.nn.Module, n: int) -> list[tuple[int, list[tuple[int, ...]]]]:
    named = dict(model.named_parameters())
    return [(f.index, [tuple(named[x].shape) for x in f.names]) for f in partition(model, n)]


def test_payload_size_is_exact_and_below_fp4_for_the_tiny_models_fragments(tiny_model) -> None:
    outer = OuterSection(codec="lowrank")
    comp = make_compressor(outer, _fragments(tiny_model, 2))
    assert isinstance(comp, LowRankCompressor) and comp.codec.name == outer.lowrank_codec
    fp4 = get_codec("fp4", outer.block_size)
    named = dict(tiny_model.named_parameters())
    for f in partition(tiny_model, 2):
        layout = comp.layouts[f.index]
        assert layout.matrices and layout.raw                     # both kinds in every fragment
        delta = 1e-3 * torch.randn(layout.numel)
        enc = comp.encode(f.index, delta, None, 0)
        ranks = comp.ranks(f.index)
        assert ranks == (outer.lowrank_rank,) * len(layout.matrices)
        assert sum(map(len, enc.chunks)) == layout.wire_bytes(ranks, comp.codec) == \
            payload_size(comp.codec, enc.numel)
        assert layout.numel == sum(named[x].numel() for x in f.names)
        assert layout.wire_bytes(ranks, comp.codec) < payload_size(fp4, layout.numel)
    shapes = [s for _, shapes in _fragments(tiny_model, 1) for s in shapes]
    bits = lowrank_bits_per_element(shapes, outer.lowrank_rank, outer.lowrank_max_rank, comp.codec)
    assert 0 < bits < fp4.bits_per_element(10**6)


def test_default_settings_start_at_the_max_rank_so_the_seeded_first_basis_keeps_its_share() -> None:
    # The first round's basis is a seeded random one: it holds about rank / n of a full-rank matrix's
    # energy, so a low initial rank throws away most of the first round (the rule only lowers it later).
    outer = OuterSection(codec="lowrank")
    comp = make_compressor(outer, [(0, [(512, 128)])])
    assert comp.ranks(0) == (outer.lowrank_max_rank,)
    m = torch.randn(512 * 128, generator=torch.Generator().manual_seed(3))
    enc = comp.encode(0, m, None, 0)
    captured = float(enc.own @ m) / float(m @ m)
    assert captured == pytest.approx(outer.lowrank_max_rank / 128, abs=0.05)


def test_only_matrices_whose_factors_are_smaller_go_low_rank() -> None:
    layout = LowRankLayout([(128, 128), (40, 40), (300,), (2, 3, 4), (128, 8), (40, 200)], max_rank=16,
                           block_size=BLOCK)
    assert [(s.rows, s.cols, s.transposed) for s in layout.matrices] == [(128, 128, False), (40, 40, False),
                                                                        (40, 200, True)]
    assert layout.raw_numel == 300 + 24 + 128 * 8
    seg = layout.segments([16, 4, 8])
    assert (seg.y[2] - seg.y[1], seg.raw - seg.y[2]) == (192, 320)  # Y: short side x rank, on whole blocks
    assert all(x % BLOCK == 0 for x in (*seg.p, *seg.y, seg.raw))      # no scale block mixes segments
    assert seg.numel == seg.raw + layout.raw_numel


def test_block_codecs_go_through_the_identity_compressor() -> None:
    outer = OuterSection(codec="int8")
    comp = make_compressor(outer, [(0, [(4, 4)])])
    assert isinstance(comp, BlockCompressor) and wire_codec(outer).name == "int8"
    enc = comp.encode(0, torch.ones(16), None, 0)
    assert enc.basis == b"" and enc.numel == 16 and comp.n_extras(0) == 0


# ---- the outer loop --------------------------------------------------------------------------------------

def _lowrank_outer(**kw) -> OuterSection:
    cfg = {"method": "replace", "h": 2, "fragments": 1, "tau": 0, "codec": "lowrank", "error_feedback": True,
           "schedule": "fixed", "consensus_every": 0, "lowrank_rank": 4, "lowrank_max_rank": 16}
    cfg.update(kw)
    return OuterSection(**cfg)


class _Group:
    """n workers with identical init on the in-process hub, trained by small random steps."""

    def __init__(self, base: torch.nn.Module, n: int, outer: OuterSection, drop: dict[int, set[int]]) -> None:
        self.hub = InProcessHub(wire_codec(outer), n)
        self.models = [copy.deepcopy(base) for _ in range(n)]
        fragments = partition(base, outer.fragments)
        self.loops = [OuterLoop(m, fragments, outer, self.hub.transport(i), expected_group_size=2)
                      for i, m in enumerate(self.models)]
        for i, loop in enumerate(self.loops):
            self.hub.register_state(i, loop.version, loop.snapshot)  # a worker behind catches up from the others
        self.drop = drop
        self.gen = torch.Generator().manual_seed(0)

    def step(self, t: int) -> list[list]:
        events: list[list] = [[] for _ in self.loops]
        for i, (model, loop) in enumerate(zip(self.models, self.loops, strict=True)):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=self.gen), alpha=1e-3)
            loop.add_tokens(10.0)
            events[i] += loop.collect(t)
        for i, loop in enumerate(self.loops):
            if t not in self.drop.get(i, set()):  # a dropped worker skips the round entirely
                events[i] += loop.send(t)
        self.hub.flush()
        for i, loop in enumerate(self.loops):
            events[i] += loop.collect(t)
        return events


def test_a_member_that_missed_a_round_rejoins_through_the_seeded_basis(tiny_model) -> None:
    group = _Group(tiny_model, 3, _lowrank_outer(), drop={2: {4}})
    tags: dict[int, list[bytes]] = {}
    for t in range(1, 9):
        events = group.step(t)
        tags[t] = [loop.compressor.tag(0) for loop in group.loops]
        if t % 2 == 0:
            kinds = [[e.kind for e in ev if e.kind in ("merged", "failed")] for ev in events]
            assert kinds == ([["merged"]] * 3 if t != 4 else [["merged"], ["merged"], []]), (t, kinds)
    assert len(set(tags[2])) == 1
    assert tags[4][0] == tags[4][1] != tags[4][2]        # worker 2 missed round 4: its basis stayed behind
    assert len(set(tags[6])) == 1 and len(set(tags[8])) == 1  # round 6 re-encoded on the seeded basis, then one
    phis = [loop.states[0].phi for loop in group.loops]
    assert torch.equal(phis[0], phis[1]) and torch.equal(phis[0], phis[2])


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["low", "rank", "basis", "power", "iteration", "swarm", "peers", "average", "the", "a"]
    for i in range(4):
        (d / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)))
    return d


@pytest.mark.timeout(300)
def test_diloco_x_runs_in_the_simulator_and_its_loss_falls(corpus_dir: Path) -> None:
    cfg = SwarmConfig()
    cfg.inner.batch_size, cfg.inner.seq_len, cfg.inner.warmup = 4, 32, 2
    cfg.outer.h = 4
    cfg = method_config(cfg, "diloco-x", tau=1)
    assert (cfg.outer.codec, cfg.outer.method, cfg.outer.tau, cfg.outer.fragments) == ("lowrank", "rebase", 4, 1)
    corpus = load_corpus([str(corpus_dir)], cfg.data, ByteTokenizer())
    res = simulate(cfg, corpus, VOCAB, SimSpec(workers=2, steps=16, eval_every=8, eval_batches=2), label="diloco-x")
    assert res.syncs_ok >= 6 and res.syncs_failed == 0
    assert res.extra["spread"] == 0.0                         # every member decoded the same bits
    assert res.final_eval_loss < res.eval_curve[0][1]
    assert all(math.isfinite(v) for _, v in res.eval_curve)


# ---- config and checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize(("outer", "needle"), [
    ({"codec": "lowrank", "lowrank_rank": 64}, "[outer] lowrank_rank = 64 is not between [outer] lowrank_min_rank"),
    ({"lowrank_min_rank": 16, "lowrank_rank": 8}, "set lowrank_min_rank <= lowrank_rank <= lowrank_max_rank"),
    ({"lowrank_max_rank": 0}, "[outer] lowrank_max_rank = 0 is out of range"),
    ({"lowrank_codec": "lowrank"}, '[outer] lowrank_codec = "lowrank" is not allowed'),
])
def test_bad_lowrank_settings_are_one_line_errors(outer: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"outer": outer})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_lowrank_settings_are_in_the_fingerprint() -> None:
    base = fingerprint(config_from_dict({"outer": {"codec": "lowrank"}}))
    for key, value in (("lowrank_rank", 4), ("lowrank_min_rank", 2), ("lowrank_max_rank", 64),
                       ("lowrank_codec", "fp4")):
        assert fingerprint(config_from_dict({"outer": {"codec": "lowrank", key: value}})) != base, key


def test_a_checkpoint_keeps_the_bases_and_ranks(tiny_model, tmp_path: Path) -> None:
    cfg = config_from_dict({"outer": {"codec": "lowrank", "fragments": 2}})

    def node() -> tuple[torch.nn.Module, InnerOptimizer, OuterLoop]:
        model = copy.deepcopy(tiny_model)
        hub = InProcessHub(wire_codec(cfg.outer), 1)
        return model, InnerOptimizer(model, InnerSection()), OuterLoop(model, partition(model, 2), cfg.outer,
                                                                       hub.transport(0), expected_group_size=2)

    model, inner, outer = node()
    comp = outer.compressor
    assert isinstance(comp, LowRankCompressor)
    for t in range(3):  # a group of one: the bases and ranks move on from its own results
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape))
        outer.add_tokens(10.0)
        enc = comp.encode(0, outer.states[0].phi - outer.states[0].theta(), None, t)
        comp.finish(enc.ticket, decode_chunks(comp.codec, enc.chunks, enc.numel), enc.extras, enc.basis, None)
    assert comp.tag(0) != make_compressor(cfg.outer, _fragments(tiny_model, 2)).tag(0)
    save_checkpoint(tmp_path, model=model, inner=inner, outer=outer, meta={"fingerprint": fingerprint(cfg)})
    model2, inner2, outer2 = node()
    assert load_checkpoint(tmp_path, model=model2, inner=inner2, outer=outer2, fingerprint=fingerprint(cfg))
    for p in (0, 1):
        assert outer2.compressor.tag(p) == comp.tag(p)
        assert outer2.compressor.ranks(p) == comp.ranks(p)
        assert all(torch.equal(a, b) for a, b in zip(outer2.compressor.bases(p), comp.bases(p), strict=True))
    assert outer2.fragment_status()[0]["ranks"] == list(comp.ranks(0))


# ---- the swarm transport ---------------------------------------------------------------------------------

def test_the_swarm_re_encodes_only_when_the_groups_tags_differ_and_at_the_leaders() -> None:
    asked: list[bytes] = []

    def reencode(tag: bytes) -> AverageRequest:
        asked.append(tag)
        return dataclasses.replace(req, basis=b"seeded:" + tag, reencode=None)

    req = AverageRequest(fragment=0, round=6, chunks=[], numel=0, weight=1.0, version=0, basis=b"mine",
                         reencode=reencode)
    assert asyncio.run(agree_on_basis(req, [b"mine", b"mine"])) is req and not asked
    agreed = asyncio.run(agree_on_basis(req, [b"leader", b"mine", b"other"]))
    assert agreed is not None and agreed.basis == b"seeded:leader" and asked == [b"leader"]
    block = dataclasses.replace(req, reencode=None)
    assert asyncio.run(agree_on_basis(block, [b"leader", b"mine"])) is None
    assert match_entry("QmA", req, 1.0).basis == b"mine"


def test_a_reducer_refuses_a_part_on_another_basis() -> None:
    async def run() -> list[str]:
        codec = get_codec("int8", BLOCK)
        session = Reduction((0, 6, b"g"), "QmA", codec, ["QmA", "QmB"], range(1), {0: 100}, RobustSection(),
                            consensus=False, basis=b"agreed")
        book = OffenceBook("QmA", None, RoundClaims())
        node = exchange(codec, peer_id="QmA", book=book)

        def header(basis: bytes) -> swarm_pb2.AverageHeader:
            return swarm_pb2.AverageHeader(group_hash=b"g", sender="QmB", weight=1.0, n_chunks=1, basis=basis)

        assert node.check_membership(session, "QmB", header(b"agreed")) is session
        with pytest.raises(WireError, match="basis"):
            node.check_membership(session, "QmB", header(b"other"))
        return list(book.refusals)
    assert asyncio.run(run()) == ["QmB: bad_header: codec, chunk count, extras or basis do not match the round"]
