"""Chunked payloads: the unit the transport moves and the reducers split.

A pseudo-gradient of ``numel`` elements is encoded as independent chunks of ``chunk_elems(block)``
elements (a multiple of the codec's block size), so that a group's reduce-scatter can hand whole
chunks to each reducer, and a chunk that arrives can be decoded on its own. Encoding by chunks gives
the same values as encoding the whole tensor, because chunk boundaries fall on block boundaries.
"""

from __future__ import annotations

import torch

from locoswarm.node.core.codecs import Codec

CHUNK_TARGET_ELEMS = 1 << 14  # 16 Ki elements: 9 KiB of fp4, 64 KiB of fp32; small enough to balance reducers


def chunk_elems(block_size: int) -> int:
    """Elements per chunk: the largest multiple of ``block_size`` not above 64 Ki (at least one block)."""
    return max(block_size, (CHUNK_TARGET_ELEMS // block_size) * block_size)


def chunk_bounds(numel: int, block_size: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of each chunk."""
    step = chunk_elems(block_size)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)] or [(0, 0)]


def encode_chunks(codec: Codec, x: torch.Tensor) -> list[bytes]:
    flat = x.reshape(-1)
    return [codec.encode(flat[a:b]) for a, b in chunk_bounds(flat.numel(), codec.block_size)]


def decode_chunks(codec: Codec, chunks: list[bytes], numel: int) -> torch.Tensor:
    """The tensor of ``numel`` elements that ``chunks`` encode; ValueError on a size that does not match."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"impossible element count {numel!r}")
    # ``numel`` may come from a peer: count its chunks by arithmetic before building any list or tensor.
    expected = max(1, -(-numel // chunk_elems(codec.block_size)))
    if len(chunks) != expected:
        raise ValueError(f"payload has {len(chunks)} chunks, expected {expected} for {numel} elements")
    bounds = chunk_bounds(numel, codec.block_size)
    out = torch.empty(numel, dtype=torch.float32)
    for (a, b), data in zip(bounds, chunks, strict=True):
        out[a:b] = codec.decode(data, b - a)
    return out


def payload_size(codec: Codec, numel: int) -> int:
    """Exact bytes of ``encode_chunks`` for ``numel`` elements."""
    return sum(codec.encoded_size(b - a) for a, b in chunk_bounds(numel, codec.block_size))


def encode_with_feedback(codec: Codec, x: torch.Tensor,
                         residual: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor]:
    """Encode ``x`` (plus the error-feedback residual, when given) into chunks.

    Returns the chunks and the fp32 values they decode to (on ``x``'s device): that decoded tensor is
    this sender's contribution as every peer will see it. The residual is updated in place to the
    quantization error ``(x + e) - decoded``, which the next sync of this fragment carries (EF: without
    it a low-bit codec drops the same part of a slowly varying pseudo-gradient every sync, and that bias
    accumulates in the outer optimizer; with it the dropped part is sent later).
    """
    target = x.reshape(-1).float()
    if residual is not None:
        if residual.dtype != torch.float32 or residual.numel() != target.numel() or residual.device != target.device:
            raise ValueError(f"error-feedback residual must be float32 with {target.numel()} elements on "
                             f"{target.device}, got {residual.dtype} with {residual.numel()} on {residual.device}")
        target = target + residual.reshape(-1)
    chunks = encode_chunks(codec, target)
    decoded = decode_chunks(codec, chunks, target.numel()).to(target.device)
    if residual is not None:
        residual.copy_((target - decoded).view(residual.shape))
    return chunks, decoded
