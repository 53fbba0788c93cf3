"""SparseLoCo (arXiv 2508.15706): the sparse codec, the decayed error-feedback accumulator, its reduction,
its place in the config, the simulator, checkpoints and the planner."""

from __future__ import annotations

import copy
import math
import struct

import numpy as np
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
from locoswarm.node.core.codec_table import codec_bits, sparse_bits
from locoswarm.node.core.compress import SparseLoCoCompressor, wire_codec
from locoswarm.node.core.outer_loop import OuterLoop, make_compressor
from locoswarm.node.core.payload import decode_chunks, encode_chunks, payload_size
from locoswarm.node.core.robust import make_aggregator
from locoswarm.node.core.sparse import REDUCED, SparseCodec
from locoswarm.node.errors import ConfigError
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.model import build_model
from locoswarm.node.partition import partition
from locoswarm.node.sim.methods import METHODS, method_config
from locoswarm.node.transport.inprocess import InProcessHub
from locoswarm.node.transport.reduce import reduce_group


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return build_model(ModelSection(), 257)


def _rand(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---- the codec -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [1, 63, 4096, 4096 * 3 + 17, 50_000])
def test_round_trip_keeps_the_top_k_per_chunk_within_a_third_of_its_scale(numel: int) -> None:
    codec = SparseCodec(4096, 64)
    x = _rand(numel)
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(numel)
    y = codec.decode(data, numel)
    for a in range(0, numel, 4096):
        xb, yb = x[a:a + 4096], y[a:a + 4096]
        k = min(64, xb.numel())
        kept = yb != 0
        assert int(kept.sum()) <= k
        top = xb.abs().topk(k).indices
        s = float(xb.abs().max())
        # what is kept is the chunk's top-k (a 2-bit value is never zero), each within s / 3 of its value
        assert set(torch.nonzero(kept).flatten().tolist()) == set(top.tolist())
        assert float((yb[top] - xb[top]).abs().max()) <= s / 3 + 1e-6
        assert float(yb.abs().max()) <= s * (1 + 1e-6)


def test_full_precision_at_density_one_is_lossless() -> None:
    codec = SparseCodec(256, 256, value_bits=32)
    x = _rand(1000)
    assert torch.equal(codec.decode(codec.encode(x), 1000), x)


def test_ties_keep_exactly_k_distinct_entries_and_all_zero_chunks_decode_to_zero() -> None:
    codec = SparseCodec(64, 8)
    x = torch.zeros(64 * 3)
    x[64:128] = 1.0                           # a chunk of ties
    x[128:192] = torch.tensor([1.0, -1.0] * 32)
    data = codec.encode(x)
    y = codec.decode(data, x.numel())
    assert torch.equal(y[:64], torch.zeros(64))   # an all-zero chunk
    for a in (64, 128):
        kept = torch.nonzero(y[a:a + 64]).flatten()
        assert kept.numel() == 8
        assert torch.equal(y[a:a + 64][kept], x[a:a + 64][kept])  # +-1 are exact levels of the 2-bit code
    # indices on the wire are strictly increasing within their chunk
    nb = 3
    idx = np.frombuffer(data, dtype="<u2", count=24, offset=1 + 4 * nb).reshape(3, 8)
    assert (np.diff(idx, axis=1) > 0).all()


def test_non_finite_input_is_refused() -> None:
    x = _rand(100)
    x[5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        SparseCodec(64, 4).encode(x)


def _corrupt_cases(codec: SparseCodec, numel: int) -> list[tuple[str, bytes]]:
    good = bytearray(codec.encode(_rand(numel)))
    nb = -(-numel // codec.block_size)
    off_idx = 1 + 4 * nb
    out_of_range = bytearray(good)
    out_of_range[off_idx:off_idx + 2] = struct.pack("<H", 65535)
    unsorted = bytearray(good)
    unsorted[off_idx + 2:off_idx + 4] = unsorted[off_idx:off_idx + 2]   # a repeated index
    nan_scale = bytearray(good)
    nan_scale[1:5] = struct.pack("<f", float("nan"))
    neg_scale = bytearray(good)
    neg_scale[1:5] = struct.pack("<f", -1.0)
    huge_count = bytes([REDUCED]) + struct.pack("<I", 1 << 31) * nb
    return [("truncated", bytes(good[:-1])), ("extended", bytes(good) + b"\0"), ("empty", b""),
            ("tag", bytes([7]) + bytes(good[1:])), ("index", bytes(out_of_range)), ("order", bytes(unsorted)),
            ("nan scale", bytes(nan_scale)), ("negative scale", bytes(neg_scale)), ("count", huge_count),
            ("short counts", bytes([REDUCED, 1]))]


@pytest.mark.parametrize("case", range(10))
def test_decoding_untrusted_bytes_raises_value_error(case: int) -> None:
    codec = SparseCodec(64, 8)
    name, data = _corrupt_cases(codec, 200)[case]
    assert name
    with pytest.raises(ValueError):
        codec.decode(data, 200)


def test_full_precision_values_must_be_finite() -> None:
    codec = SparseCodec(64, 8, value_bits=32)
    data = bytearray(codec.encode(_rand(64)))
    data[-4:] = struct.pack("<f", float("inf"))
    with pytest.raises(ValueError, match="non-finite"):
        codec.decode(bytes(data), 64)


def test_a_reduced_average_keeps_the_union_of_supports() -> None:
    codec = SparseCodec(64, 4)
    parts = [codec.decode(codec.encode(_rand(200, seed)), 200) for seed in range(3)]
    mean = sum(parts) / 3
    data = codec.encode_reduced(mean)
    y = codec.decode(data, 200)
    assert torch.equal(y != 0, mean != 0)      # nothing of what members sent is dropped again
    for a in range(0, 200, 64):               # int8 values: within a block's absmax / 254
        s = float(mean[a:a + 64].abs().max())
        assert float((y[a:a + 64] - mean[a:a + 64]).abs().max()) <= s / 254 + 1e-7


# ---- the compressor: the decayed accumulator ---------------------------------------------------------------

def test_the_residual_after_a_round_is_the_accumulator_minus_what_was_sent() -> None:
    comp = SparseLoCoCompressor(SparseCodec(256, 8), beta=0.9)
    residual = _rand(1000, 1).clone()
    delta = _rand(1000, 2)
    accumulator = 0.9 * residual + delta
    enc = comp.encode(0, delta, residual, 0)
    sent = decode_chunks(comp.codec, enc.chunks, 1000)
    assert torch.equal(enc.own, sent)
    torch.testing.assert_close(residual, accumulator - sent, atol=1e-6, rtol=0)
    assert int((sent != 0).sum()) <= 8 * 4


def _outer(**kw) -> OuterSection:
    cfg = {"method": "replace", "h": 2, "fragments": 1, "tau": 0, "schedule": "fixed", "consensus_every": 0,
           "lr": 1.0, "momentum": 0.0}
    cfg.update(kw)
    return OuterSection(**cfg)


def _run(base: torch.nn.Module, outer: OuterSection, n: int, steps: int) -> list[torch.Tensor]:
    hub = InProcessHub(wire_codec(outer), n)
    models = [copy.deepcopy(base) for _ in range(n)]
    loops = [OuterLoop(m, partition(base, 1), outer, hub.transport(i), expected_group_size=n)
             for i, m in enumerate(models)]
    gen = torch.Generator().manual_seed(0)
    for t in range(1, steps + 1):
        for model, loop in zip(models, loops, strict=True):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
            loop.add_tokens(10.0)
            loop.collect(t)
        for loop in loops:
            loop.send(t)
        hub.flush()
        for loop in loops:
            loop.collect(t)
    return [loop.states[0].phi.clone() for loop in loops]


@pytest.mark.parametrize("n", [1, 2])
def test_density_one_at_full_precision_is_diloco_without_momentum(tiny_model, n: int) -> None:
    sparse = _outer(codec="sparseloco", error_feedback=True, sparse_chunk=256, sparse_topk=256,
                    sparse_value_bits=32, sparse_beta=0.95)
    diloco = _outer(codec="fp32", error_feedback=False)
    for a, b in zip(_run(tiny_model, sparse, n, 6), _run(tiny_model, diloco, n, 6), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_checkpoint_keeps_the_accumulator(tiny_model, tmp_path) -> None:
    cfg = config_from_dict({"outer": {"codec": "sparseloco", "fragments": 2, "sparse_chunk": 64, "sparse_topk": 2}})

    def node() -> tuple[torch.nn.Module, InnerOptimizer, OuterLoop]:
        model = copy.deepcopy(tiny_model)
        hub = InProcessHub(wire_codec(cfg.outer), 1)
        return model, InnerOptimizer(model, InnerSection()), OuterLoop(model, partition(model, 2), cfg.outer,
                                                                       hub.transport(0), expected_group_size=1)

    model, inner, outer = node()
    assert isinstance(outer.compressor, SparseLoCoCompressor)
    for st in outer.states:
        st.residual.copy_(torch.randn(st.residual.shape))
    save_checkpoint(tmp_path, model=model, inner=inner, outer=outer, meta={"fingerprint": fingerprint(cfg)})
    model2, inner2, outer2 = node()
    assert load_checkpoint(tmp_path, model=model2, inner=inner2, outer=outer2, fingerprint=fingerprint(cfg))
    for a, b in zip(outer.states, outer2.states, strict=True):
        assert torch.equal(a.residual, b.residual)


# ---- the group reduction ---------------------------------------------------------------------------------

def test_three_members_sparse_parts_average_to_the_dense_mean_of_what_they_sent() -> None:
    codec = SparseCodec(64, 4)
    numel = 64 * 40 + 10
    xs = [_rand(numel, seed) * (i + 1) for i, seed in enumerate((3, 4, 5))]
    payloads = [encode_chunks(codec, x) for x in xs]
    sent_dense = [decode_chunks(codec, p, numel) for p in payloads]
    settings = RobustSection(aggregator="clipped_mean", agreement_floor=-1.0, agreement_full=-1.0, weight_factor=1e6)
    reduced, sent, received, _ = reduce_group(codec, payloads, [1.0, 1.0, 1.0], numel, settings,
                                              make_aggregator(settings))
    avg = decode_chunks(codec, reduced, numel)
    mean = sum(sent_dense) / 3
    for a in range(0, numel, 64):
        s = float(mean[a:a + 64].abs().max())
        assert float((avg[a:a + 64] - mean[a:a + 64]).abs().max()) <= s / 254 + 1e-6
    # the real bytes: each reduced chunk carries the union of up to three supports, more than one part
    assert sum(map(len, reduced)) > payload_size(codec, numel)
    assert sum(map(len, reduced)) < 4 * payload_size(codec, numel)
    assert sum(sent) == sum(received)


def test_the_in_process_transport_averages_sparse_contributions(tiny_model) -> None:
    outer = _outer(codec="sparseloco", error_feedback=True, sparse_chunk=256, sparse_topk=16)
    phis = _run(tiny_model, outer, 3, 4)
    assert torch.equal(phis[0], phis[1]) and torch.equal(phis[0], phis[2])   # every member decoded the same bits
    start = torch.cat([p.detach().reshape(-1) for p in tiny_model.parameters()])
    assert float((phis[0] - start).abs().sum()) > 0


# ---- config, methods, bytes --------------------------------------------------------------------------------

@pytest.mark.parametrize(("outer", "needle"), [
    ({"codec": "sparseloco", "sparse_topk": 128, "sparse_chunk": 64},
     "[outer] sparse_topk = 128 is larger than [outer] sparse_chunk = 64"),
    ({"codec": "sparseloco", "error_feedback": False}, "set error_feedback = true"),
    ({"sparse_value_bits": 4}, "[outer] sparse_value_bits = 4 is not allowed"),
    ({"sparse_beta": 1.5}, "[outer] sparse_beta = 1.5 is out of range"),
    ({"sparse_chunk": 0}, "[outer] sparse_chunk = 0 is out of range"),
])
def test_bad_sparse_settings_are_one_line_errors(outer: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"outer": outer})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_sparse_settings_are_in_the_fingerprint() -> None:
    base = fingerprint(config_from_dict({"outer": {"codec": "sparseloco"}}))
    for key, value in (("sparse_chunk", 2048), ("sparse_topk", 32), ("sparse_beta", 0.9), ("sparse_value_bits", 32)):
        assert fingerprint(config_from_dict({"outer": {"codec": "sparseloco", key: value}})) != base, key


def test_the_method_is_the_papers_recipe() -> None:
    cfg = method_config(SwarmConfig(), "sparseloco", tau=1)
    o = cfg.outer
    assert (o.codec, o.momentum, o.lr, o.sparse_beta, o.sparse_chunk, o.sparse_topk) == (
        "sparseloco", 0.0, 1.0, 0.95, 4096, 64)
    assert isinstance(make_compressor(o, [(0, [(8, 8)])]), SparseLoCoCompressor)
    assert "sparseloco" in METHODS


def test_bytes_per_sync_are_as_computed() -> None:
    codec = SparseCodec(4096, 64)
    numel = 4096 * 64  # 16 payload chunks of 16 Ki elements: one tag byte each
    assert payload_size(codec, numel) == 64 * (4 + 64 * 2 + 16) + 16
    assert sum(map(len, encode_chunks(codec, _rand(numel)))) == payload_size(codec, numel)
    assert math.isclose(sparse_bits(4096, 64, 2), 148 * 8 / 4096)
    assert math.isclose(codec_bits("sparseloco", 4096, topk=64), sparse_bits(4096, 64, 2))
    assert codec_bits("fp4", 64) / sparse_bits(4096, 64, 2) > 15


def test_the_planner_knows_the_bytes_of_a_round() -> None:
    from locoswarm.node.plan import method_rows, sparseloco_bits

    # two members: parts at 0.289 bits up, averages of the union (<= 128 of 4096, 24 bits each + 64 per chunk) down
    assert sparseloco_bits(2) == pytest.approx((148 * 8 / 4096 + (128 * 24 + 64) / 4096) / 2)
    assert sparseloco_bits(2) < sparseloco_bits(8) < codec_bits("fp4", 64)
    rows = {r.method: r for r in method_rows(1e9, 0.1, 1e8, h=100, fragments=8, tau=1) if r.codec in ("sparse", "fp32")}
    assert rows["sparseloco"].required_bandwidth < rows["diloco"].required_bandwidth / 20


def test_a_swarm_node_refuses_sparseloco_with_one_line_naming_the_setting(tmp_path, capsys) -> None:
    """The swarm's exchange does not carry variable-length sparse averages yet: ``locoswarm run`` says so before
    anything starts, on one line, with what is allowed (exit 2, no traceback)."""
    import locoswarm.node.cli

    config = tmp_path / "peers.toml"
    config.write_text('[outer]\ncodec = "sparseloco"\n')
    code = locoswarm.node.cli.main(["run", "--config", str(config), "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "codec = 'sparseloco' is not allowed in a swarm" in err and "use fp4" in err and "Traceback" not in err
    assert not (tmp_path / "state").exists()
