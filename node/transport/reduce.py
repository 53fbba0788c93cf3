"""The group reduction every transport performs: reduce-scatter then all-gather of codec chunks.

Members are ordered (by peer id); the payload's chunks are split into ``n`` contiguous parts and
member ``j`` reduces part ``j``: it decodes every member's chunks of that part into fp32, takes the
token-weighted mean, and re-encodes the reduced chunks with the same codec. The reduced chunks are
then all-gathered. Every member decodes the *same* reduced bytes, so the group's result is
bit-identical on all members. Per member and sync this moves about ``2 (n-1)/n`` payloads each way,
the exchange pattern of a ring/butterfly all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from node.core.codecs import Codec
from node.core.payload import chunk_bounds


def part_ranges(n_chunks: int, n_members: int) -> list[range]:
    """Contiguous ranges of chunk indices, one per member (some may be empty)."""
    base, extra = divmod(n_chunks, n_members)
    out, start = [], 0
    for j in range(n_members):
        size = base + (1 if j < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def reduce_chunk(codec: Codec, contributions: Sequence[bytes], weights: Sequence[float],
                 numel: int) -> bytes:
    """Weighted fp32 mean of one chunk from every member, re-encoded with ``codec``."""
    total = float(sum(weights))
    acc = torch.zeros(numel, dtype=torch.float32)
    for data, w in zip(contributions, weights, strict=True):
        codec.decode_accumulate(data, numel, acc, w / total)
    return codec.encode(acc)


def reduce_group(codec: Codec, payloads: Sequence[Sequence[bytes]], weights: Sequence[float],
                 numel: int) -> tuple[list[bytes], list[int], list[int]]:
    """Reduce a whole group's payloads in one place (the in-process transport; tests).

    Returns the reduced chunks (what every member decodes) and, per member, the bytes it sent and
    received under the reduce-scatter + all-gather pattern.
    """
    n = len(payloads)
    bounds = chunk_bounds(numel, codec.block_size)
    parts = part_ranges(len(bounds), n)
    reduced: list[bytes] = [b""] * len(bounds)
    sent = [0] * n
    received = [0] * n
    for j, part in enumerate(parts):
        for c in part:
            a, b = bounds[c]
            reduced[c] = reduce_chunk(codec, [p[c] for p in payloads], weights, b - a)
            for i in range(n):
                if i != j:
                    sent[i] += len(payloads[i][c])        # reduce-scatter: i -> reducer j
                    received[j] += len(payloads[i][c])
                    sent[j] += len(reduced[c])            # all-gather: reducer j -> i
                    received[i] += len(reduced[c])
    return reduced, sent, received
