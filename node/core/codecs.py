"""Payload codecs for pseudo-gradients, and error feedback.

Streaming DiLoCo sends each fragment's outer gradient as low-bit floats (4-bit E3M0 with a scale in
the paper) and the receiver dequantizes and accumulates in fp32. The bytes produced here are exactly
what the transport carries, so every format is specified to the byte (see ``ALGORITHMS.md`` §2):

- ``fp32``: raw little-endian float32.
- ``bf16``: raw little-endian bfloat16 (round to nearest even).
- ``int8``: blockwise absmax. Per block of ``block_size`` elements a float32 scale ``s = max|x|``,
  codes ``q = round(x / s * 127)`` in [-127, 127]. Layout: all scales, then all codes.
- ``fp4``: E3M0. Per block a float32 scale ``s = max|x|``; each element is one nibble, 1 sign bit
  (bit 3) and a 3-bit exponent code ``k``: 0 is zero, 1..7 is ``s * 2**(k - 7)``. Rounding is to the
  nearest level in the linear domain, ties toward the larger magnitude. Two nibbles per byte, low
  nibble first, an odd count padded with a zero nibble. Layout: all scales, then the packed codes.

The quantization math runs in fp32 on the input's device (so CUDA tensors are quantized on the GPU)
and only the final scales and codes are moved to the CPU as bytes. Decoding yields an fp32 CPU tensor,
or one on ``device`` when asked (``decode_accumulate`` into a CUDA accumulator asks): then the compact
wire bytes go to the device and are dequantized there, so a 4-bit payload crosses the bus at 4.5 bits per
element instead of 32. Everything is vectorised torch; there are no Python loops over elements.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np
import torch

from locoswarm.node.core.codec_table import CODECS

__all__ = [
    "CODECS",
    "FP4_LEVELS",
    "Bf16Codec",
    "Codec",
    "Fp4Codec",
    "Fp32Codec",
    "Int8Codec",
    "get_codec",
    "quantization_error",
]

# Bytes per element of the widest codec (fp32); int8 and fp4 take at most 1.5 and 1.0 at the smallest block size, 8.
MAX_BYTES_PER_ELEMENT = 4

_SCALE_BYTES = 4  # one little-endian float32 scale per block
_INT8_MAX = 127
_FP4_MAX_EXP_CODE = 7  # exponent codes 1..7 map to s * 2**(k - 7)
_FP4_SIGN_BIT = 0x8
# |x| / s at or above each threshold bumps the exponent code by one. The first is half of the
# smallest level (values below it become zero); the others are the linear midpoints 1.5 * 2**j
# between consecutive levels 2**j and 2**(j + 1).
_FP4_THRESHOLDS: tuple[float, ...] = (2.0**-7, *(1.5 * 2.0**j for j in range(-6, 0)))


# --------------------------------------------------------------------------------------------------
# Small helpers shared by the codecs
# --------------------------------------------------------------------------------------------------


def _flatten_fp32(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` as a contiguous 1-D fp32 tensor on its own device (fp32 math everywhere)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec input must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"codec input must have a floating dtype, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _raise_non_finite(x: torch.Tensor) -> None:
    """Raise the one-line error for a pseudo-gradient with nan/inf (counted only on failure)."""
    count = int((~torch.isfinite(x)).sum().item())
    raise ValueError(
        f"pseudo-gradient has {count} non-finite value(s) (nan/inf) out of {x.numel()}; "
        "the pseudo-gradient must be finite to be encoded"
    )


def _check_all_finite(x: torch.Tensor) -> None:
    """Reject nan/inf anywhere in ``x``: one of them would poison every peer's average.

    A sum is finite only if every value is (nan and inf propagate), and one reduction pass costs far less
    than ``isfinite`` (which writes a mask as large as ``x``); only a non-finite sum, which may also be
    an overflow of large finite values, pays for the exact check."""
    if x.numel() and not math.isfinite(float(x.sum().item())) \
            and not bool(torch.isfinite(x).all().item()):
        _raise_non_finite(x)


def _check_numel(numel: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


def _check_length(codec: Codec, data: bytes, numel: int) -> None:
    """A truncated or oversized payload means a transport or peer bug; never decode garbage."""
    expected = codec.encoded_size(numel)
    if len(data) != expected:
        raise ValueError(
            f"{codec.name} payload has {len(data)} bytes but {expected} are expected for {numel} "
            f"elements (block_size={codec.block_size}); the payload is truncated or mismatched"
        )


def _to_cpu_bytes(t: torch.Tensor, le_dtype: str) -> bytes:
    """Serialize a tensor as little-endian bytes (``le_dtype`` is a numpy dtype like ``'<f4'``)."""
    if t.device.type != "cpu":  # CUDA is little-endian, as the wire: its bytes as they are
        return _device_bytes(t.detach().contiguous().view(-1).view(torch.uint8))
    arr = t.detach().contiguous().numpy()
    return arr.astype(le_dtype, copy=False).tobytes()


def _device_bytes(raw: torch.Tensor) -> bytes:
    """A device's uint8 tensor as host bytes: one copy across the bus into page-locked memory (about twice
    as fast as into pageable memory, and the caching host allocator reuses it), then out as ``bytes``."""
    host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(raw)
    return host.numpy().tobytes()


def _from_bytes(data: bytes | bytearray | memoryview, le_dtype: str, count: int, offset: int) -> np.ndarray:
    """Read ``count`` little-endian values into a fresh, writable, native-order numpy array."""
    arr = np.frombuffer(data, dtype=le_dtype, count=count, offset=offset)
    return arr.astype(arr.dtype.newbyteorder("="), copy=True)


def _bytes_on(data: bytes | bytearray | memoryview, device: torch.device) -> torch.Tensor:
    """The payload's bytes as a uint8 tensor on ``device`` (a fresh copy there: reading only)."""
    with warnings.catch_warnings():  # read-only ``bytes``: the CPU view is only read, to be copied
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(data, dtype=torch.uint8)
    return host.to(device)


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


#: Elements per piece when a CPU tensor is coded piece by piece: each piece's temporaries (a few MiB)
#: stay in cache and come from the allocator's free lists, where whole-tensor temporaries of tens of MB
#: are fresh pages every call (page faults cost more than the arithmetic: issue 13 measured fp4 encode at
#: a tenth of a memory pass that way). CUDA tensors are coded whole, on the device.
CPU_PIECE = 1 << 18


def _pieces(numel: int, block_size: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """``[start, end)`` element ranges covering ``numel``: whole blocks, an even count, except the last."""
    if device.type != "cpu" or numel <= CPU_PIECE:
        yield 0, numel
        return
    step = max(1, CPU_PIECE // block_size) * block_size
    step *= 2 if step % 2 else 1
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


def _scale_inplace(values: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    """Multiply unit values (starting at a block boundary) by their block's scale, in place."""
    full = values.numel() // block_size * block_size
    if full:
        values[:full].view(-1, block_size).mul_(scales[: full // block_size].unsqueeze(1))
    if values.numel() > full:
        values[full:].mul_(scales[full // block_size])


def _as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """View ``flat`` as (num_blocks, block_size), zero-padding the last partial block.

    Zero padding never changes a block's absmax, and the padded codes are dropped afterwards.
    """
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def _absmax_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block scale ``max|x|``; nan/inf propagate, so a finite check on scales covers the input."""
    return blocks.abs().amax(dim=1)


def _check_scales_finite(scales: torch.Tensor, flat: torch.Tensor) -> None:
    """Cheap finite check: amax propagates nan and inf, so only the (small) scales are scanned."""
    if scales.numel() and not bool(torch.isfinite(scales).all().item()):
        _raise_non_finite(flat)


def _normalized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x / s`` per block, in [-1, 1].

    Division (not multiplication by ``1/s``) because ``1/s`` overflows for tiny subnormal scales,
    and ``x / s`` cannot overflow since ``|x| <= s``. All-zero blocks divide by 1 and stay zero.
    """
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return blocks / safe.unsqueeze(1)


# --------------------------------------------------------------------------------------------------
# The codec interface
# --------------------------------------------------------------------------------------------------


class Codec(ABC):
    """Turns a pseudo-gradient into the exact bytes peers exchange, and back into fp32."""

    name: str
    bits: int

    def __init__(self, block_size: int = 64) -> None:
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact ``len(encode(x))`` for ``x.numel() == numel``, so transports can size buffers."""

    def bits_per_element(self, numel: int) -> float:
        """Real wire cost per element, scales included (what bandwidth budgets should use)."""
        _check_numel(numel)
        if numel == 0:
            return float(self.bits)
        return 8.0 * self.encoded_size(numel) / numel

    @abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """Flatten ``x`` (any shape, float dtype, CPU or CUDA) and return its wire bytes."""

    def encode_reduced(self, x: torch.Tensor) -> bytes:
        """The bytes of a reducer's combination of the members' parts: :meth:`encode` for the dense codecs; a
        sparse codec keeps the union of the members' supports instead of selecting again
        (``locoswarm.node.core.sparse``)."""
        return self.encode(x)

    @abstractmethod
    def _decode_checked(self, data: bytes, numel: int) -> torch.Tensor:
        """Decode a payload whose length is already validated."""

    def decode(self, data: bytes, numel: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Return the fp32 1-D tensor of ``numel`` values that ``data`` encodes: on the CPU, or on
        ``device`` (the bytes are moved there and decoded by the device; same values bit for bit)."""
        _check_numel(numel)
        _check_length(self, data, numel)
        device = torch.device("cpu") if device is None else torch.device(device)
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32, device=device)
        if device.type == "cpu":
            return self._decode_checked(data, numel)
        return self.decode_by_device(data, numel, device)

    def decode_by_device(self, data: bytes, numel: int, device: torch.device | str) -> torch.Tensor:
        """``decode`` by torch ops on ``device`` (the path ``decode`` takes off the CPU); on the CPU it is the
        reference that ``decode``'s numpy pieces must equal bit for bit."""
        _check_numel(numel)
        _check_length(self, data, numel)
        device = torch.device(device)
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32, device=device)
        return self._decode_tensor(_bytes_on(data, device), numel)

    def _decode_tensor(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """Decode a payload (length validated) given as a uint8 tensor, on that tensor's device."""
        raise NotImplementedError

    def decode_accumulate(self, data: bytes, numel: int, acc: torch.Tensor, weight: float = 1.0) -> None:
        """``acc += weight * decode(data)`` in fp32: the receiver's averaging path.

        Accumulating in fp32 (never in the wire format) is what makes low-bit payloads lossless in
        practice: the quantization error of each peer averages out instead of compounding.
        """
        if acc.dtype != torch.float32 or acc.dim() != 1 or acc.numel() != numel:
            raise ValueError(
                f"accumulator must be a 1-D float32 tensor of {numel} elements, "
                f"got dtype={acc.dtype} shape={tuple(acc.shape)}"
            )
        decoded = self.decode(data, numel, acc.device)
        if decoded.numel():
            acc.add_(decoded.to(acc.device, non_blocking=False), alpha=float(weight))


class Fp32Codec(Codec):
    """Lossless reference: raw little-endian float32."""

    name = "fp32"
    bits = 32

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        return 4 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        flat = _flatten_fp32(x)
        _check_all_finite(flat)
        return _to_cpu_bytes(flat, "<f4")

    def _decode_checked(self, data: bytes, numel: int) -> torch.Tensor:
        return torch.from_numpy(_from_bytes(data, "<f4", numel, 0))

    def _decode_tensor(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        return raw.view(torch.float32)  # a fresh tensor of our own; the wire is little-endian, as CUDA is


class Bf16Codec(Codec):
    """Raw bfloat16: halves the bytes, keeps fp32's range, 8 bits of mantissa."""

    name = "bf16"
    bits = 16

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        return 2 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        flat = _flatten_fp32(x)
        _check_all_finite(flat)
        out = np.empty(flat.numel(), dtype="<i2")
        # Finite fp32 values near float max round to bf16 inf; clamp to bf16's largest finite value
        # so that huge (finite) pseudo-gradients never become inf on the wire.
        bf16_max = torch.finfo(torch.bfloat16).max
        for a, b in _pieces(flat.numel(), 1, flat.device):
            halves = flat[a:b].to(torch.bfloat16)
            if not math.isfinite(float(halves.sum(dtype=torch.float32).item())) \
                    and not bool(torch.isfinite(halves).all().item()):
                halves = flat[a:b].clamp(-bf16_max, bf16_max).to(torch.bfloat16)
            if flat.device.type != "cpu":  # one piece: the whole tensor, its bytes across the bus at once
                return _device_bytes(halves.view(torch.uint8))
            out[a:b] = halves.view(torch.int16).numpy()
        return out.tobytes()

    def _decode_checked(self, data: bytes, numel: int) -> torch.Tensor:
        raw = torch.from_numpy(_from_bytes(data, "<i2", numel, 0))
        return raw.view(torch.bfloat16).to(torch.float32)

    def _decode_tensor(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        return raw.view(torch.bfloat16).to(torch.float32)


class _BlockCodec(Codec):
    """Shared layout of the blockwise codecs: ``num_blocks`` float32 scales, then the codes."""

    def _codes_size(self, numel: int) -> int:
        raise NotImplementedError

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        return _SCALE_BYTES * _num_blocks(numel, self.block_size) + self._codes_size(numel)

    def _read_scales(self, data: bytes, numel: int) -> torch.Tensor:
        nblocks = _num_blocks(numel, self.block_size)
        return torch.from_numpy(_from_bytes(data, "<f4", nblocks, 0))

    def _codes_offset(self, numel: int) -> int:
        return _SCALE_BYTES * _num_blocks(numel, self.block_size)

    def _encode_piece(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A piece's per-block scales (fp32) and its codes (uint8 bytes), on the piece's device."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> bytes:
        flat = _flatten_fp32(x)
        numel = flat.numel()
        if numel == 0:
            return b""
        if flat.device.type != "cpu":  # coded whole on the device; scales then codes cross the bus at once
            scales, codes = self._encode_piece(flat)
            _check_scales_finite(scales, flat)
            return _device_bytes(torch.cat([scales.view(torch.uint8), codes]))
        out = np.empty(self.encoded_size(numel), dtype=np.uint8)
        offset = self._codes_offset(numel)
        scales_out = out[:offset].view("<f4")
        codes_out = out[offset:]
        for a, b in _pieces(numel, self.block_size, flat.device):
            scales, codes = self._encode_piece(flat[a:b])
            _check_scales_finite(scales, flat)
            first_block, first_byte = a // self.block_size, self._codes_size(a)
            scales_out[first_block:first_block + scales.numel()] = scales.cpu().numpy()
            codes_out[first_byte:first_byte + codes.numel()] = codes.cpu().numpy()
        return out.tobytes()

    def _decode_piece(self, codes: np.ndarray, out: torch.Tensor) -> None:
        """Write the unit values (before scaling) that ``codes`` (a piece's code bytes) hold into ``out``."""
        raise NotImplementedError

    def _decode_codes(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`_decode_piece` for code bytes that are a uint8 tensor on ``out``'s device."""
        raise NotImplementedError

    def _decode_tensor(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        offset = self._codes_offset(numel)
        out = torch.empty(numel, dtype=torch.float32, device=raw.device)
        self._decode_codes(raw[offset:], out)
        _scale_inplace(out, raw[:offset].view(torch.float32), self.block_size)
        return out

    def _decode_checked(self, data: bytes, numel: int) -> torch.Tensor:
        scales = self._read_scales(data, numel)
        codes = np.frombuffer(data, dtype=np.uint8, offset=self._codes_offset(numel))
        # numpy's allocator asks for huge pages on large buffers: far fewer page faults than torch.empty
        out = torch.from_numpy(np.empty(numel, dtype=np.float32))
        for a, b in _pieces(numel, self.block_size, out.device):
            self._decode_piece(codes[self._codes_size(a):self._codes_size(b)], out[a:b])
            _scale_inplace(out[a:b], scales[a // self.block_size:], self.block_size)
        return out


class Int8Codec(_BlockCodec):
    """Blockwise absmax int8: 8 bits plus 32/block_size bits of scale per element."""

    name = "int8"
    bits = 8

    def _codes_size(self, numel: int) -> int:
        return numel

    def _encode_piece(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = _as_blocks(piece, self.block_size)
        scales = _absmax_scales(blocks)
        q = _normalized(blocks, scales).mul_(_INT8_MAX).round_().clamp_(-_INT8_MAX, _INT8_MAX)
        return scales, q.to(torch.int8).view(-1)[: piece.numel()].view(torch.uint8)

    def _decode_piece(self, codes: np.ndarray, out: torch.Tensor) -> None:
        # (q / 127) * s rather than q * s / 127: q * s overflows when s is near float max.
        out.copy_(torch.from_numpy(codes.view(np.int8).copy())).div_(_INT8_MAX)

    def _decode_codes(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        # A table of q / 127 computed on the CPU: CUDA divides by a scalar as a multiply by its reciprocal,
        # which differs from the CPU's quotient in the last bit for some q.
        torch.index_select(_INT8_TABLE.to(out.device), 0, codes.to(torch.int32), out=out)


#: Byte b of an int8 payload -> its unit value int8(b) / 127, as the CPU decode computes it.
_INT8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).to(torch.float32).div_(_INT8_MAX)


def _fp4_decode_table() -> torch.Tensor:
    """(256, 2) table: a packed byte -> its (low nibble, high nibble) values in units of the scale.

    Decoding by one gather over whole bytes is much faster than unpacking nibbles and then
    computing signs and powers of two separately.
    """
    nibble = torch.zeros(16, dtype=torch.float32)
    for code in range(1, _FP4_MAX_EXP_CODE + 1):
        nibble[code] = 2.0 ** (code - _FP4_MAX_EXP_CODE)
        nibble[code | _FP4_SIGN_BIT] = -(2.0 ** (code - _FP4_MAX_EXP_CODE))
    byte = torch.arange(256)
    return torch.stack([nibble[byte & 0xF], nibble[byte >> 4]], dim=1)


_FP4_TABLE = _fp4_decode_table()


def _fp4_exponent_codes(unit_abs: torch.Tensor) -> torch.Tensor:
    """Exponent code 0..7 of the nearest E3M0 level for ``|x| / s`` in [0, 1] (ties round up).

    Counting passed thresholds is deterministic, exact in the normalized domain, and faster on CPU
    than ``bucketize`` or ``frexp``.
    """
    codes = torch.zeros(unit_abs.shape, dtype=torch.uint8, device=unit_abs.device)
    for threshold in _FP4_THRESHOLDS:
        codes += unit_abs >= threshold
    return codes


def _fp4_encode_table() -> torch.Tensor:
    """(1024,) uint8: the whole nibble (sign and exponent code) of a unit value in [-1, 1], indexed by
    its float32 bits >> 22 (sign, exponent, top mantissa bit).

    Every threshold is a boundary of those buckets: ``2**-7`` starts an exponent, and ``1.5 * 2**j``
    is where the top mantissa bit of exponent ``j`` turns on. So all values of a bucket share one code,
    the code of the bucket's smallest magnitude, and one gather replaces seven comparisons (encode was
    ~6x slower that way)."""
    smallest = (torch.arange(1024, dtype=torch.int32) << 22).view(torch.float32).clamp(-1.0, 1.0)
    codes = _fp4_exponent_codes(smallest.abs())
    return codes | (((smallest < 0) & (codes > 0)).to(torch.uint8) << 3)


_FP4_ENCODE_TABLE = _fp4_encode_table()


def _fp4_nibbles(unit: torch.Tensor) -> torch.Tensor:
    """The nibble of each unit value in [-1, 1] (zero for +-0 and values below half the smallest level)."""
    index = (unit.view(torch.int32) >> 22).bitwise_and_(0x3FF)
    return torch.index_select(_FP4_ENCODE_TABLE.to(unit.device), 0, index)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, low nibble first; an odd count gets a zero high nibble."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


class Fp4Codec(_BlockCodec):
    """E3M0 4-bit floats with a per-block absmax scale (Streaming DiLoCo's outer-gradient format)."""

    name = "fp4"
    bits = 4

    def _codes_size(self, numel: int) -> int:
        return (numel + 1) // 2

    def _encode_piece(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = _as_blocks(piece, self.block_size)
        scales = _absmax_scales(blocks)
        unit = _normalized(blocks, scales).view(-1)[: piece.numel()]
        # The sign only goes on nonzero codes, so every zero is the canonical nibble 0.
        return scales, _pack_nibbles(_fp4_nibbles(unit))

    def _decode_piece(self, codes: np.ndarray, out: torch.Tensor) -> None:
        index = torch.from_numpy(codes.astype(np.int32))
        if out.numel() == 2 * codes.size:
            torch.index_select(_FP4_TABLE, 0, index, out=out.view(-1, 2))
        else:  # an odd count: the last byte's high nibble is padding
            out.copy_(torch.index_select(_FP4_TABLE, 0, index).view(-1)[: out.numel()])

    def _decode_codes(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        values = torch.index_select(_FP4_TABLE.to(out.device), 0, codes.to(torch.int32))
        out.copy_(values.view(-1)[: out.numel()])


_CODEC_CLASSES: dict[str, type[Codec]] = {
    "fp32": Fp32Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "fp4": Fp4Codec,
}


def get_codec(name: str, block_size: int = 64) -> Codec:
    """Build a codec by name; ``block_size`` (elements per scale) matters for int8 and fp4 only."""
    if name not in _CODEC_CLASSES:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"codec block_size must be a positive int, got {block_size!r}")
    return _CODEC_CLASSES[name](block_size)


def quantization_error(x: torch.Tensor, codec: Codec) -> float:
    """Relative L2 error ``||decode(encode(x)) - x|| / (||x|| + tiny)`` for reports.

    Norms are taken in float64 so that huge finite values (near float32 max) do not overflow.
    """
    flat = _flatten_fp32(x).to("cpu")
    decoded = codec.decode(codec.encode(flat), flat.numel())
    ref = flat.to(torch.float64)
    err = torch.linalg.vector_norm(decoded.to(torch.float64) - ref).item()
    norm = torch.linalg.vector_norm(ref).item()
    return err / (norm + torch.finfo(torch.float32).tiny)


def _fp4_levels() -> tuple[float, ...]:
    """Nonnegative E3M0 levels in units of the scale (for docs and tests): 0, 2**-6, ..., 1."""
    return (0.0, *(math.ldexp(1.0, k - _FP4_MAX_EXP_CODE) for k in range(1, _FP4_MAX_EXP_CODE + 1)))


FP4_LEVELS: tuple[float, ...] = _fp4_levels()
