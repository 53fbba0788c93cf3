"""The block codecs' names and wire cost, without torch: the one home of what the configuration (its choices), the
planner (``locoswarm plan``, which must start fast) and the codecs themselves say of them. ``core/codecs.py``
implements each codec from this table; the tests check its encoded sizes against ``codec_bits``."""

from __future__ import annotations

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "fp4")  # widest first
ELEMENT_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "fp4": 4}  # bits of one coded element
SCALE_BITS = 32  # the block codecs' one little-endian float32 scale per block
SCALED = frozenset({"int8", "fp4"})  # the codecs that carry one scale per block


def codec_bits(codec: str, block_size: int) -> float:
    """Wire bits per element of ``codec``, its block scales included (fp4 at block 64: 4.5). Raises ``KeyError``
    for a name not in ``CODECS``."""
    return ELEMENT_BITS[codec] + (SCALE_BITS / block_size if codec in SCALED else 0.0)
