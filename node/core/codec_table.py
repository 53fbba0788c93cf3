"""The block codecs' names and wire cost, without torch: the one home of what the configuration (its choices), the
planner (``locoswarm plan``, which must start fast) and the codecs themselves say of them. ``core/codecs.py``
implements each codec from this table; the tests check its encoded sizes against ``codec_bits``."""

from __future__ import annotations

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "fp4")  # widest first
ELEMENT_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "fp4": 4}  # bits of one coded element
SCALE_BITS = 32  # the block codecs' one little-endian float32 scale per block
SCALED = frozenset({"int8", "fp4"})  # the codecs that carry one scale per block


SPARSE = "sparseloco"  # SparseLoCo's top-k codec (core/sparse.py): its cost depends on the chunk and k too
SPARSE_INDEX_BITS = 16  # one little-endian uint16 index per kept entry, within its chunk


def sparse_bits(chunk: int, topk: int, value_bits: int = 2) -> float:
    """Wire bits per element of a SparseLoCo part: per chunk ``min(k, chunk)`` indices and values, plus one float32
    scale with 2-bit values (chunk 4096, k 64: 0.289); the one tag byte per payload chunk is not counted."""
    k = min(topk, chunk)
    return (k * (SPARSE_INDEX_BITS + value_bits) + (SCALE_BITS if value_bits == 2 else 0)) / chunk


def codec_bits(codec: str, block_size: int, *, topk: int = 64, value_bits: int = 2) -> float:
    """Wire bits per element of ``codec``, its block scales included (fp4 at block 64: 4.5); for ``sparseloco``
    ``block_size`` is the top-k chunk and ``topk``, ``value_bits`` its settings (what a member sends; a reducer's
    average carries the union of the members' supports at 8 bits). Raises ``KeyError`` for another name not in
    ``CODECS``."""
    if codec == SPARSE:
        return sparse_bits(block_size, topk, value_bits)
    return ELEMENT_BITS[codec] + (SCALE_BITS / block_size if codec in SCALED else 0.0)
