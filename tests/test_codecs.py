"""Unit tests for the pseudo-gradient payload codecs and error feedback (node/core/codecs.py).

The codecs define the bytes on the wire, so besides accuracy bounds these tests pin the exact byte
layout, sizes, and the rejection of inputs (non-finite) and payloads (wrong length) that would
otherwise corrupt every peer's average.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from locoswarm.node.core.codecs import (
    CODECS,
    FP4_LEVELS,
    Codec,
    get_codec,
    quantization_error,
)
from locoswarm.node.core.payload import encode_with_feedback

SIZES = (1, 2, 63, 64, 65, 1000, 4097)
BLOCK_SIZES = (1, 7, 64, 128)
F32_MAX = float(np.finfo(np.float32).max)


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen)


def _block_scales(x: np.ndarray, block_size: int) -> np.ndarray:
    """Per-element absmax of its block (float64), the reference for the blockwise codecs."""
    n = x.size
    pad = (-n) % block_size
    blocks = np.abs(np.concatenate([x, np.zeros(pad, dtype=x.dtype)])).reshape(-1, block_size)
    return np.repeat(blocks.max(axis=1).astype(np.float64), block_size)[:n]


def _round_trip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(x.numel())
    return codec.decode(data, x.numel())


# --------------------------------------------------------------------------------------------------
# Sizes and factory
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_encoded_size_matches_encode(name: str, block_size: int) -> None:
    codec = get_codec(name, block_size)
    for n in (0, *SIZES):
        assert len(codec.encode(_randn(n))) == codec.encoded_size(n)


def test_bits_per_element() -> None:
    assert get_codec("fp4", 64).bits_per_element(64 * 100) == pytest.approx(4.5)
    assert get_codec("int8", 64).bits_per_element(64 * 100) == pytest.approx(8.5)
    assert get_codec("bf16").bits_per_element(1000) == 16.0
    assert get_codec("fp32").bits_per_element(1000) == 32.0
    # A partial block still pays a whole scale, and an odd count a whole byte.
    assert get_codec("fp4", 64).encoded_size(65) == 2 * 4 + 33


def test_the_codec_table_is_what_the_codecs_encode_and_what_the_config_allows() -> None:
    """``core/codec_table.py`` is the torch-free home of the codecs' names and wire cost (the planner and the
    configuration read it): each codec's encoded size over whole blocks is exactly its ``codec_bits``."""
    from locoswarm.node.config import config_from_dict
    from locoswarm.node.core.codec_table import ELEMENT_BITS, codec_bits
    from locoswarm.node.errors import ConfigError

    assert set(ELEMENT_BITS) == set(CODECS)
    for name in CODECS:
        for block in (8, 64, 256):
            codec = get_codec(name, block)
            assert codec.bits == ELEMENT_BITS[name]
            assert codec.bits_per_element(block * 100) == pytest.approx(codec_bits(name, block)), (name, block)
    for name in CODECS:
        cfg = config_from_dict({"outer": {"codec": name, "lowrank_codec": name}}).outer
        assert (cfg.codec, cfg.lowrank_codec) == (name, name)
    with pytest.raises(ConfigError, match='"fp32", "bf16", "int8", "fp4", "lowrank"'):
        config_from_dict({"outer": {"codec": "fp8"}})


def test_codec_attributes() -> None:
    for name, bits in zip(CODECS, (32, 16, 8, 4), strict=True):
        codec = get_codec(name, 32)
        assert (codec.name, codec.bits, codec.block_size) == (name, bits, 32)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64"])
def test_get_codec_rejects_bad_block_size(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        get_codec("fp4", bad)  # type: ignore[arg-type]


def test_get_codec_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        get_codec("fp8")


# --------------------------------------------------------------------------------------------------
# Round-trip accuracy
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_fp32_exact(n: int) -> None:
    x = _randn(n)
    assert torch.equal(_round_trip(get_codec("fp32"), x), x)


@pytest.mark.parametrize("n", SIZES)
def test_bf16_relative_error(n: int) -> None:
    x = _randn(n)
    y = _round_trip(get_codec("bf16"), x)
    assert torch.equal(y, x.to(torch.bfloat16).float())
    assert bool(((y - x).abs() <= x.abs() * 2.0**-8).all())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_int8_error_within_half_step(n: int, block_size: int) -> None:
    x = _randn(n, seed=n)
    y = _round_trip(get_codec("int8", block_size), x).double().numpy()
    xs = x.double().numpy()
    s = _block_scales(x.numpy(), block_size)
    assert np.all(np.abs(y - xs) <= s / 254 * (1 + 1e-5) + 1e-30)


def _fp4_reference(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: per element every signed level of its block; return (levels, nearest distance)."""
    s = _block_scales(x, block_size)
    mags = np.array(FP4_LEVELS, dtype=np.float64)
    candidates = np.concatenate([mags, -mags[1:]])[None, :] * s[:, None]
    dist = np.abs(candidates - x.astype(np.float64)[:, None])
    return candidates, dist.min(axis=1)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_fp4_values_are_levels_and_nearest(n: int, block_size: int) -> None:
    x = _randn(n, seed=100 + n)
    y = _round_trip(get_codec("fp4", block_size), x).double().numpy()
    candidates, nearest = _fp4_reference(x.numpy(), block_size)
    # Every decoded value is exactly 0 or +-s * 2**(k - 7).
    assert np.all(np.any(y[:, None] == candidates, axis=1))
    # And it is the nearest level (up to float32 rounding of x / s at exact midpoints).
    s = _block_scales(x.numpy(), block_size)
    assert np.all(np.abs(y - x.double().numpy()) <= nearest + 1e-6 * s)


def test_fp4_rounding_thresholds() -> None:
    """Zero below half the smallest level, ties to the larger magnitude, max element exact."""
    codec = get_codec("fp4", 8)
    x = torch.tensor([1.0, 2.0**-7, 2.0**-7 * 0.99, 0.75, 0.74, -0.375, -0.3, 2.0**-6])
    y = codec.decode(codec.encode(x), x.numel())
    expected = torch.tensor([1.0, 2.0**-6, 0.0, 1.0, 0.5, -0.5, -0.25, 2.0**-6])
    assert torch.equal(y, expected)


def test_fp4_byte_layout() -> None:
    """Scales first (float32 LE), then codes two per byte, low nibble first, odd count zero-padded."""
    codec = get_codec("fp4", 4)
    x = torch.tensor([1.0, -0.5, 0.0, 0.25, 3.0])
    data = codec.encode(x)
    # Block 0: s=1, codes 7, 8|6, 0, 5. Block 1: s=3, code 7, then a zero pad nibble.
    assert data == struct.pack("<ff", 1.0, 3.0) + bytes([0xE7, 0x50, 0x07])


def test_int8_byte_layout() -> None:
    codec = get_codec("int8", 2)
    data = codec.encode(torch.tensor([1.0, -1.0, 0.5]))
    assert data == struct.pack("<ff", 1.0, 0.5) + struct.pack("<bbb", 127, -127, 127)


def test_fp32_and_bf16_byte_layout() -> None:
    x = torch.tensor([1.0, -2.0])
    assert get_codec("fp32").encode(x) == struct.pack("<ff", 1.0, -2.0)
    assert get_codec("bf16").encode(x) == struct.pack("<HH", 0x3F80, 0xC000)


def test_accepts_any_shape_and_float_dtype() -> None:
    x = _randn(6 * 7).reshape(6, 7).to(torch.bfloat16)
    for name in CODECS:
        codec = get_codec(name)
        y = codec.decode(codec.encode(x), x.numel())
        assert y.dtype == torch.float32 and y.shape == (42,)
        assert codec.encode(x) == codec.encode(x.float().reshape(-1))


def test_rejects_integer_input() -> None:
    with pytest.raises(ValueError, match="floating dtype"):
        get_codec("fp4").encode(torch.arange(4))


# --------------------------------------------------------------------------------------------------
# Edge values
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_zeros_round_trip_exactly(name: str) -> None:
    x = torch.zeros(130)
    y = _round_trip(get_codec(name), x)
    assert torch.equal(y, x) and not torch.signbit(y).any()


@pytest.mark.parametrize("name", CODECS)
def test_empty_tensor(name: str) -> None:
    codec = get_codec(name)
    assert codec.encode(torch.zeros(0)) == b""
    assert codec.decode(b"", 0).shape == (0,)
    acc = torch.zeros(0)
    codec.decode_accumulate(b"", 0, acc)


@pytest.mark.parametrize("name", CODECS)
def test_huge_values_round_trip(name: str) -> None:
    x = torch.tensor([3e38, -3e38, F32_MAX, -F32_MAX, 1e38, 1.0, -2.5e37])
    y = _round_trip(get_codec(name, 4), x)
    assert bool(torch.isfinite(y).all())
    err = quantization_error(x, get_codec(name, 4))
    assert np.isfinite(err)
    tolerance = {"fp32": 0.0, "bf16": 2.0**-8, "int8": 1 / 127, "fp4": 1 / 3}[name]
    assert err <= tolerance
    # A block maximum is its own scale (exact), or within bf16 rounding (clamped to bf16's max).
    assert y[2].item() == pytest.approx(F32_MAX, rel=2.0**-8)
    assert y[3].item() == -y[2].item()


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_mixed_tiny_and_huge_blocks(name: str) -> None:
    """Per-block scales keep a tiny block accurate next to a huge one, and subnormals are safe."""
    tiny = _randn(64, seed=1) * 1e-30
    huge = _randn(64, seed=2) * 1e37
    subnormal = torch.full((64,), 1e-40)
    x = torch.cat([tiny, huge, subnormal])
    codec = get_codec(name, 64)
    y = _round_trip(codec, x)
    assert bool(torch.isfinite(y).all())
    for part in (slice(0, 64), slice(64, 128)):
        rel = (y[part].double() - x[part].double()).norm() / x[part].double().norm()
        assert rel.item() < (0.01 if name == "int8" else 0.3)
    assert bool((y[128:] == x[128:]).all())  # a constant block is its own scale


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rejects_non_finite(name: str, bad: float) -> None:
    x = _randn(200)
    x[[3, 70, 199]] = bad
    with pytest.raises(ValueError, match=r"3 non-finite value.*must be finite") as info:
        get_codec(name).encode(x)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", CODECS)
def test_rejects_wrong_length(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(_randn(100))
    for bad in (data[:-1], data + b"\x00", b""):
        with pytest.raises(ValueError, match="bytes but"):
            codec.decode(bad, 100)
    with pytest.raises(ValueError, match="bytes but"):
        codec.decode(data, 101)


# --------------------------------------------------------------------------------------------------
# fp32 accumulation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_decode_accumulate(name: str) -> None:
    codec = get_codec(name)
    x = _randn(1000, seed=5)
    data = codec.encode(x)
    acc0 = _randn(1000, seed=6)
    acc = acc0.clone()
    codec.decode_accumulate(data, 1000, acc, weight=0.25)
    torch.testing.assert_close(acc, acc0 + 0.25 * codec.decode(data, 1000), rtol=1e-6, atol=1e-7)
    before = acc.clone()
    codec.decode_accumulate(data, 1000, acc)
    torch.testing.assert_close(acc, before + codec.decode(data, 1000), rtol=1e-6, atol=1e-7)


def test_decode_accumulate_rejects_bad_accumulator() -> None:
    codec = get_codec("fp4")
    data = codec.encode(_randn(10))
    for acc in (torch.zeros(11), torch.zeros(10, dtype=torch.float64), torch.zeros(2, 5)):
        with pytest.raises(ValueError, match="accumulator"):
            codec.decode_accumulate(data, 10, acc)


# --------------------------------------------------------------------------------------------------
# Error feedback and reporting
# --------------------------------------------------------------------------------------------------


def _ef(codec: Codec, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[bytes, torch.Tensor]:
    """One sync's error-feedback encoding as the outer loop does it, as one payload (one chunk)."""
    chunks, decoded = encode_with_feedback(codec, x, residual)
    assert len(chunks) == 1
    return chunks[0], decoded


@pytest.mark.parametrize("name", CODECS)
def test_error_feedback_residual_update(name: str) -> None:
    codec = get_codec(name)
    x = _randn(300, seed=7).reshape(3, 100)
    residual = _randn(300, seed=8) * 0.1
    old = residual.clone()
    ptr = residual.data_ptr()
    payload, decoded = _ef(codec, x, residual)
    assert residual.data_ptr() == ptr
    assert torch.equal(decoded, codec.decode(payload, 300))
    assert torch.equal(residual, (x.reshape(-1) + old) - decoded)


def test_error_feedback_without_residual_is_plain_encode() -> None:
    codec = get_codec("fp4")
    x = _randn(100, seed=9)
    payload, decoded = _ef(codec, x, None)
    assert payload == codec.encode(x)
    assert torch.equal(decoded, codec.decode(payload, 100))


def test_error_feedback_rejects_mismatched_residual() -> None:
    codec = get_codec("fp4")
    with pytest.raises(ValueError, match="residual"):
        encode_with_feedback(codec, torch.zeros(10), torch.zeros(9))
    with pytest.raises(ValueError, match="residual"):
        encode_with_feedback(codec, torch.zeros(10), torch.zeros(10, dtype=torch.float64))


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_error_feedback_mean_converges(name: str) -> None:
    """Sending the same vector repeatedly: with EF the mean of what peers see converges to x."""
    codec = get_codec(name)
    x = _randn(1000, seed=10) * 1e-3
    steps = 100
    residual = torch.zeros(1000)
    sum_ef = torch.zeros(1000)
    sum_plain = torch.zeros(1000)
    for _ in range(steps):
        sum_ef += _ef(codec, x, residual)[1]
        sum_plain += _ef(codec, x, None)[1]
    err_ef = ((sum_ef / steps) - x).norm().item()
    err_plain = ((sum_plain / steps) - x).norm().item()
    assert err_plain > 0
    assert err_ef < err_plain / 5


def test_quantization_error() -> None:
    x = _randn(4096, seed=11)
    errors = {name: quantization_error(x, get_codec(name)) for name in CODECS}
    assert errors["fp32"] == 0.0
    assert 0 < errors["bf16"] < errors["int8"] < errors["fp4"] < 0.3
    assert quantization_error(torch.zeros(10), get_codec("fp4")) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CODECS)
def test_cuda_round_trip(name: str) -> None:
    codec = get_codec(name)
    x = _randn(4097, seed=12)
    data = codec.encode(x.cuda())
    assert data == codec.encode(x)
    y = codec.decode(data, x.numel())
    assert y.device.type == "cpu"
    residual = torch.zeros(4097, device="cuda")
    payload, decoded = _ef(codec, x.cuda(), residual)
    assert payload == data and decoded.device.type == "cuda"
    assert torch.equal(decoded.cpu(), y)
    acc = torch.zeros(4097, device="cuda")
    codec.decode_accumulate(data, 4097, acc)
    assert torch.equal(acc.cpu(), y)
    on_device = codec.decode(data, 4097, "cuda")  # the bytes decoded by the GPU
    assert on_device.device.type == "cuda" and torch.equal(on_device.cpu(), y)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [1, 63, 4097, 3 * (1 << 18) + 5])  # odd, partial block, several CPU pieces
def test_the_device_decode_path_gives_the_cpu_decode_bit_for_bit(name: str, numel: int) -> None:
    """``decode(data, n, device)`` for a device decodes the wire bytes as a tensor on that device
    (``decode_by_device``); run on the CPU here (the same torch ops), it must equal the numpy-piecewise CPU
    decode exactly."""
    codec = get_codec(name)
    x = _randn(numel, seed=13) * 1e-3
    x[numel // 2] = 0.0
    data = codec.encode(x)
    reference = codec.decode(data, numel)
    decoded = codec.decode_by_device(data, numel, "cpu")
    assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
    assert torch.equal(decoded, reference)


# ---- piecewise coding of large CPU tensors (``CPU_PIECE``) is byte-identical to the whole-tensor spec ----

def _spec_block_encode(x: torch.Tensor, name: str, block_size: int) -> bytes:
    """The formats of the module docstring, computed whole and naively (the reference)."""
    n = x.numel()
    blocks = torch.cat([x, x.new_zeros((-n) % block_size)]).view(-1, block_size)
    scales = blocks.abs().amax(1)
    unit = (blocks / torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)).view(-1)[:n]
    if name == "int8":
        codes = (unit * 127).round().clamp(-127, 127).to(torch.int8).numpy().tobytes()
    else:
        k = torch.zeros(n, dtype=torch.uint8)
        for threshold in (2.0**-7, *(1.5 * 2.0**j for j in range(-6, 0))):
            k += (unit.abs() >= threshold).to(torch.uint8)
        k |= ((unit < 0) & (k > 0)).to(torch.uint8) << 3
        if n % 2:
            k = torch.cat([k, k.new_zeros(1)])
        codes = (k[0::2] | (k[1::2] << 4)).numpy().tobytes()
    return scales.numpy().astype("<f4").tobytes() + codes


def _spec_block_decode(data: bytes, n: int, name: str, block_size: int) -> torch.Tensor:
    nblocks = -(-n // block_size)
    scales = torch.from_numpy(np.frombuffer(data, "<f4", nblocks).copy()).repeat_interleave(block_size)[:n]
    raw = np.frombuffer(data, np.uint8, offset=4 * nblocks)
    if name == "int8":
        unit = torch.from_numpy(raw.view(np.int8).astype(np.float32)) / 127
    else:
        nibbles = np.stack([raw & 0xF, raw >> 4], 1).reshape(-1)[:n]
        k = torch.from_numpy((nibbles & 7).astype(np.float32))
        unit = torch.where(k > 0, 2.0 ** (k - 7), 0.0) * torch.from_numpy(np.where(nibbles & 8, -1.0, 1.0)).float()
    return unit * scales


@pytest.mark.parametrize("name", ["int8", "fp4"])
@pytest.mark.parametrize("block_size", [64, 3])
def test_large_tensors_are_coded_in_pieces_exactly_as_the_format_says(name: str, block_size: int) -> None:
    from locoswarm.node.core.codecs import CPU_PIECE

    n = 2 * CPU_PIECE + 37  # three pieces, an odd count, a partial last block
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)  # blocks of very different scales
    x[1000:1064] = 0.0   # an all-zero block
    th = torch.tensor([2.0**-7, *(1.5 * 2.0**j for j in range(-6, 0))])
    x[5000:5000 + 2 * th.numel()] = torch.cat([th, -torch.nextafter(th, torch.zeros_like(th))])  # exact thresholds
    codec = get_codec(name, block_size)
    data = codec.encode(x)
    assert data == _spec_block_encode(x, name, block_size)
    assert torch.equal(codec.decode(data, n), _spec_block_decode(data, n, name, block_size))


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_large_tensors_in_pieces_match_plain_casts(name: str) -> None:
    from locoswarm.node.core.codecs import CPU_PIECE

    n = 2 * CPU_PIECE + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(6))
    x[7] = 3.0e38  # finite, rounds to bf16 inf: clamped to bf16's max, in whichever piece it falls
    codec = get_codec(name)
    data = codec.encode(x)
    if name == "fp32":
        assert data == x.numpy().astype("<f4").tobytes()
    else:
        expected = x.clamp(-torch.finfo(torch.bfloat16).max, torch.finfo(torch.bfloat16).max).to(torch.bfloat16)
        assert data == expected.view(torch.int16).numpy().astype("<i2").tobytes()
    assert bool(torch.isfinite(codec.decode(data, n)).all())


def test_a_non_finite_value_in_a_late_piece_is_refused() -> None:
    from locoswarm.node.core.codecs import CPU_PIECE

    for name in CODECS:
        x = torch.randn(3 * CPU_PIECE)
        x[-3] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            get_codec(name).encode(x)
        x[-3] = 3.0e38  # finite values whose sum overflows are not refused
        x[-4] = 3.0e38
        get_codec(name).encode(x)
