"""Chunked payloads: the unit the transport moves and the reducers split.

A pseudo-gradient of ``numel`` elements is encoded as independent chunks of ``chunk_elems(block, numel)``
elements (a multiple of the codec's block size), so that a group's reduce-scatter can hand whole
chunks to each reducer, and a chunk that arrives can be decoded on its own. Encoding by chunks gives
the same values as encoding the whole tensor, because chunk boundaries fall on block boundaries.

A payload has at least ``MIN_CHUNKS`` chunks where chunks of ``MIN_CHUNK_ELEMS`` allow it: every member of
a group of up to that many reduces a share of every fragment, and so judges every other member's
contribution to it (``locoswarm.node.core.robust``). With 16 Ki elements per chunk alone, a fragment of the
robustness bench's model (55 Ki elements) had 4 chunks: in a group of 6 two members reduced nothing and
could never see, let alone refuse, what a hostile member sent.
"""

from __future__ import annotations

import torch

from locoswarm.node.core.codecs import Codec

CHUNK_TARGET_ELEMS = 1 << 14  # 16 Ki elements: 9 KiB of fp4, 64 KiB of fp32; small enough to balance reducers
MIN_CHUNKS = 16               # chunks a payload is cut into at least (module docstring) ...
MIN_CHUNK_ELEMS = 1 << 10     # ... unless its chunks would be smaller than this (a direction needs elements)


def chunk_elems(block_size: int, numel: int | None = None) -> int:
    """Elements per chunk of a payload of ``numel`` elements: the largest multiple of ``block_size`` not above
    ``CHUNK_TARGET_ELEMS`` (at least one block), smaller for small payloads so that they have ``MIN_CHUNKS``
    chunks, but not below ``MIN_CHUNK_ELEMS``. Without ``numel``: the largest a chunk can be (message bounds)."""
    largest = max(block_size, (CHUNK_TARGET_ELEMS // block_size) * block_size)
    if numel is None or numel <= 0:
        return largest
    wanted = max(MIN_CHUNK_ELEMS, -(-numel // MIN_CHUNKS))
    wanted = -(-wanted // block_size) * block_size  # whole blocks: chunk boundaries fall on block boundaries
    return max(block_size, min(largest, wanted))


def chunk_bounds(numel: int, block_size: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of each chunk."""
    step = chunk_elems(block_size, numel)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)] or [(0, 0)]


def encode_chunks(codec: Codec, x: torch.Tensor) -> list[bytes]:
    flat = x.reshape(-1)
    return [codec.encode(flat[a:b]) for a, b in chunk_bounds(flat.numel(), codec.block_size)]


def decode_chunks(codec: Codec, chunks: list[bytes], numel: int) -> torch.Tensor:
    """The tensor of ``numel`` elements that ``chunks`` encode; ValueError on a size that does not match."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"impossible element count {numel!r}")
    # ``numel`` may come from a peer: count its chunks by arithmetic before building any list or tensor.
    expected = max(1, -(-numel // chunk_elems(codec.block_size, numel)))
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
