"""SparseLoCo: chunk-wise top-k, 2-bit pseudo-gradients with a decayed error-feedback accumulator.

Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo"
(2025, arXiv 2508.15706). Per fragment each member keeps an accumulator ``e`` (the error-feedback residual of
the outer loop) and per sync::

    e    <- beta * e + Delta               # the decayed accumulator stands in for DiLoCo's outer momentum
    sent <- Q2(TopK_chunk(e))              # per chunk of ``chunk`` elements its k largest |e|, 2-bit values
    e    <- e - sent                       # what was not sent stays local
    phi  <- phi - lr * mean(sent)          # plain outer SGD (momentum 0; the paper: lr ~ 1, beta ~ 0.95)

:class:`SparseCodec` is the wire format (a :class:`~locoswarm.node.core.codecs.Codec`, so the transports,
robust screening and reducers treat it as any block codec: one codec block is one top-k chunk); and
:class:`SparseLoCoCompressor` applies the decay before the outer loop's error feedback.

Two layouts share the codec, told apart by the first byte of each payload chunk:

- ``0`` (a member's part, fixed size, :meth:`SparseCodec.encode`): all per-block float32 scales (2-bit values
  only), then all kept indices as little-endian uint16 (within their block, strictly increasing), then the
  values: 2-bit codes four per byte, low bits first, code ``c`` is ``s * (-1, -1/3, 1/3, 1)[c]`` (nearest
  level, error at most ``s / 3`` where ``s`` is the block's largest kept magnitude); or float32 values
  (``value_bits = 32``, no scales). A block of ``n`` elements keeps ``min(k, n)`` entries.
- ``1`` (a reducer's average, :meth:`SparseCodec.encode_reduced`): the average of sparse parts has the union
  of the members' supports (up to ``n_members * k`` per block), so it is not top-k'ed again (that would
  silently drop what members sent): per block a uint32 count of nonzeros, then the per-block float32 scales
  (int8 values only), the indices (uint16), then int8 absmax codes (``q / 127 * s``), or float32 values. Its
  size varies with the union; :meth:`SparseCodec.encoded_size` is the fixed size of layout 0.

Decoding validates untrusted bytes: exact sizes, counts no larger than their block, indices in range and
strictly increasing, finite non-negative scales and finite values; every violation raises ``ValueError``.
"""

from __future__ import annotations

import numpy as np
import torch

from locoswarm.node.core.codecs import Codec, _check_numel, _flatten_fp32, _raise_non_finite

SENT, REDUCED = 0, 1  # the layouts' tag bytes
_LEVELS = torch.tensor([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0], dtype=torch.float32)
_INT8_MAX = 127
MAX_CHUNK = 1 << 16  # indices are uint16 within their block


def _block_scales(vals: torch.Tensor, blk: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block the largest kept magnitude (the wire's scale; 0 for an all-zero block) and the same with zeros
    replaced by 1 (what values are divided by)."""
    scales = torch.zeros(n_blocks, dtype=torch.float32, device=vals.device)
    scales.scatter_reduce_(0, blk, vals.abs(), reduce="amax")
    return scales, torch.where(scales > 0, scales, torch.ones_like(scales))


class SparseCodec(Codec):
    """Chunk-wise top-k with 2-bit (or float32) values; ``block_size`` is the top-k chunk."""

    name = "sparse"
    bits = 2

    def __init__(self, block_size: int = 4096, topk: int = 64, value_bits: int = 2) -> None:
        if not 1 <= block_size <= MAX_CHUNK:
            raise ValueError(f"sparse chunk must be in [1, {MAX_CHUNK}], got {block_size}")
        if not 1 <= topk <= block_size:
            raise ValueError(f"sparse topk must be in [1, chunk={block_size}], got {topk}")
        if value_bits not in (2, 32):
            raise ValueError(f"sparse value_bits must be 2 or 32, got {value_bits}")
        super().__init__(block_size)
        self.topk = topk
        self.value_bits = value_bits
        self.bits = value_bits

    def __repr__(self) -> str:
        return f"SparseCodec(block_size={self.block_size}, topk={self.topk}, value_bits={self.value_bits})"

    # ------------------------------------------------------------------ sizes
    def _block_lengths(self, numel: int) -> list[int]:
        c = self.block_size
        nb = -(-numel // c)
        return [c] * (nb - 1) + [numel - c * (nb - 1)] if nb else []

    def _kept(self, numel: int) -> tuple[int, int]:
        """(blocks, kept entries) of a member's part of ``numel`` elements."""
        c, nb = self.block_size, -(-numel // self.block_size)
        if not nb:
            return 0, 0
        return nb, (nb - 1) * min(self.topk, c) + min(self.topk, numel - c * (nb - 1))

    def _values_size(self, kept: int, bits: int) -> int:
        return (kept + 3) // 4 if bits == 2 else (kept if bits == 8 else 4 * kept)

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        if numel == 0:
            return 0
        nb, kept = self._kept(numel)
        scales = 4 * nb if self.value_bits == 2 else 0
        return 1 + scales + 2 * kept + self._values_size(kept, self.value_bits)

    # ------------------------------------------------------------------ encode
    def _select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block the kept entries: (block-local indices sorted, values, block id) as flat tensors."""
        c, numel = self.block_size, flat.numel()
        full = numel // c
        idx, vals, blk = [], [], []
        if full:
            rows = flat[: full * c].view(full, c)
            k = min(self.topk, c)
            top = rows.abs().topk(k, dim=1, sorted=False).indices
            top = top.sort(dim=1).values  # ascending within a block: the canonical order on the wire
            idx.append(top.reshape(-1))
            vals.append(rows.gather(1, top).reshape(-1))
            blk.append(torch.arange(full, device=flat.device).repeat_interleave(k))
        if numel > full * c:
            tail = flat[full * c:]
            k = min(self.topk, tail.numel())
            top = tail.abs().topk(k, sorted=False).indices.sort().values
            idx.append(top)
            vals.append(tail[top])
            blk.append(torch.full((k,), full, device=flat.device, dtype=torch.long))
        return torch.cat(idx), torch.cat(vals), torch.cat(blk)

    def encode(self, x: torch.Tensor) -> bytes:
        flat = _flatten_fp32(x)
        if flat.numel() == 0:
            return b""
        idx, vals, blk = self._select(flat)
        if not bool(torch.isfinite(vals).all()):  # a non-finite entry has the largest |x|, so it is kept
            _raise_non_finite(flat)
        parts = [np.array([SENT], dtype=np.uint8).tobytes()]
        if self.value_bits == 2:
            scales, safe = _block_scales(vals, blk, -(-flat.numel() // self.block_size))
            unit = vals / safe[blk]
            codes = ((unit + 1.0) * 1.5).round_().clamp_(0, 3).to(torch.uint8)
            pad = (-codes.numel()) % 4
            if pad:
                codes = torch.cat([codes, codes.new_zeros(pad)])
            q = codes.view(-1, 4)
            packed = q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)
            parts += [scales.cpu().numpy().astype("<f4").tobytes(),
                      idx.to(torch.int32).cpu().numpy().astype("<u2").tobytes(), packed.cpu().numpy().tobytes()]
        else:
            parts += [idx.to(torch.int32).cpu().numpy().astype("<u2").tobytes(),
                      vals.cpu().numpy().astype("<f4").tobytes()]
        return b"".join(parts)

    def encode_reduced(self, x: torch.Tensor) -> bytes:
        """A reducer's combination (layout 1): every nonzero of ``x`` kept, int8 values with a per-block scale
        (float32 values with ``value_bits = 32``)."""
        flat = _flatten_fp32(x)
        if flat.numel() == 0:
            return b""
        if not bool(torch.isfinite(flat).all()):
            _raise_non_finite(flat)
        c, lengths = self.block_size, self._block_lengths(flat.numel())
        nz = torch.nonzero(flat, as_tuple=True)[0]
        blk, local = nz // c, nz % c
        counts = torch.bincount(blk, minlength=len(lengths))
        vals = flat[nz]
        parts = [np.array([REDUCED], dtype=np.uint8).tobytes(), counts.cpu().numpy().astype("<u4").tobytes()]
        if self.value_bits == 2:
            scales, safe = _block_scales(vals, blk, len(lengths))
            q = (vals / safe[blk] * _INT8_MAX).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
            parts += [scales.cpu().numpy().astype("<f4").tobytes(),
                      local.to(torch.int32).cpu().numpy().astype("<u2").tobytes(), q.cpu().numpy().tobytes()]
        else:
            parts += [local.to(torch.int32).cpu().numpy().astype("<u2").tobytes(),
                      vals.cpu().numpy().astype("<f4").tobytes()]
        return b"".join(parts)

    # ------------------------------------------------------------------ decode
    def decode(self, data: bytes, numel: int, device: torch.device | str | None = None) -> torch.Tensor:
        _check_numel(numel)
        device = torch.device("cpu") if device is None else torch.device(device)
        if numel == 0:
            if len(data):
                raise ValueError(f"sparse payload has {len(data)} bytes for 0 elements")
            return torch.zeros(0, dtype=torch.float32, device=device)
        return self._decode_checked(bytes(data), numel).to(device)

    def _decode_checked(self, data: bytes, numel: int) -> torch.Tensor:
        if not data:
            raise ValueError(f"sparse payload is empty for {numel} elements")
        lengths = self._block_lengths(numel)
        nb = len(lengths)
        if data[0] == SENT:
            _check_size(data, self.encoded_size(numel), numel, "part")
            k = min(self.topk, self.block_size)
            counts = np.full(nb, k, dtype=np.int64)
            counts[-1] = min(self.topk, lengths[-1])
            bits, off = self.value_bits, 1
        elif data[0] == REDUCED:
            if len(data) < 1 + 4 * nb:
                raise ValueError(f"sparse average has {len(data)} bytes, too few for {nb} block counts")
            counts = np.frombuffer(data, dtype="<u4", count=nb, offset=1).astype(np.int64)
            if np.any(counts > np.asarray(lengths)):
                raise ValueError("sparse average counts more entries than its block holds")
            bits, off = (8 if self.value_bits == 2 else 32), 1 + 4 * nb
            kept = int(counts.sum())
            expected = off + (4 * nb if bits == 8 else 0) + 2 * kept + self._values_size(kept, bits)
            _check_size(data, expected, numel, "average")
        else:
            raise ValueError(f"sparse payload has unknown layout tag {data[0]}")
        kept = int(counts.sum())
        scales = None
        if bits != 32:
            scales = np.frombuffer(data, dtype="<f4", count=nb, offset=off).astype(np.float32)
            off += 4 * nb
            if not np.all(np.isfinite(scales)) or np.any(scales < 0):
                raise ValueError("sparse payload has a negative or non-finite scale")
        local = np.frombuffer(data, dtype="<u2", count=kept, offset=off).astype(np.int64)
        off += 2 * kept
        blk = np.repeat(np.arange(nb, dtype=np.int64), counts)
        if kept:
            if np.any(local >= np.asarray(lengths, dtype=np.int64)[blk]):
                raise ValueError("sparse payload has an index outside its block")
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            increasing = np.diff(local) > 0
            firsts = starts[1:][counts[1:] > 0]
            increasing[firsts[firsts > 0] - 1] = True  # a block's first index may be below the last block's
            if not np.all(increasing):
                raise ValueError("sparse payload's indices are not strictly increasing within a block")
        if bits == 2:
            packed = np.frombuffer(data, dtype=np.uint8, count=(kept + 3) // 4, offset=off)
            codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:kept]
            values = _LEVELS.numpy()[codes] * scales[blk]
        elif bits == 8:
            q = np.frombuffer(data, dtype=np.int8, count=kept, offset=off).astype(np.float32)
            values = q / _INT8_MAX * scales[blk]
        else:
            values = np.frombuffer(data, dtype="<f4", count=kept, offset=off).astype(np.float32)
            if not np.all(np.isfinite(values)):
                raise ValueError("sparse payload has a non-finite value")
        out = np.zeros(numel, dtype=np.float32)
        out[blk * self.block_size + local] = values
        return torch.from_numpy(out)


def _check_size(data: bytes, expected: int, numel: int, what: str) -> None:
    if len(data) != expected:
        raise ValueError(f"sparse {what} has {len(data)} bytes but {expected} are expected for {numel} elements")

