"""The fragment partition of Streaming DiLoCo: which parameters are synced together.

Decoder blocks are assigned **strided**: block ``l`` goes to fragment ``l mod F`` (better than
contiguous groups in the Streaming DiLoCo paper, because every fragment then spans the whole depth
and syncing one fragment perturbs the whole network a little rather than one region a lot).

Parameters outside the blocks follow their position in ``named_parameters()`` order:
- before the first block (token and position embeddings) -> fragment 0;
- after the last block (final norm, LM head) -> the fragment that holds the LAST block, so the head
  and final norm are synced together with the block whose output they consume directly.
Using position rather than names keeps this correct for any architecture whose blocks are found by
``block_index``. With F = number of blocks and an even count this also spreads the two big
non-block tensors of an untied model (embedding, head) over different fragments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from rich.table import Table

from locoswarm.node.errors import UserError

# "model.layers.3." (Llama) or "transformer.h.3." (GPT-2); also matches under wrapper prefixes such
# as "module." (DDP) or "_orig_mod." (torch.compile).
_BLOCK_RE = re.compile(r"(?:^|\.)(?:model\.layers|transformer\.h)\.(\d+)\.")


@dataclass(frozen=True)
class Fragment:
    """One unit of synchronization: parameter names in ``named_parameters()`` order."""

    index: int
    names: tuple[str, ...]
    blocks: tuple[int, ...]
    numel: int


def block_index(name: str) -> int | None:
    """Decoder block number of a parameter name, or None for non-block parameters."""
    match = _BLOCK_RE.search(name)
    return int(match.group(1)) if match else None


def _n_blocks(names: list[str]) -> int:
    indices = {i for i in map(block_index, names) if i is not None}
    return max(indices) + 1 if indices else 0


def _assign(names: list[str], n_fragments: int, n_blocks: int) -> list[int]:
    """Fragment index of every name (see module docstring for the rule)."""
    last_fragment = (n_blocks - 1) % n_fragments
    seen_block = False
    out = []
    for name in names:
        block = block_index(name)
        if block is not None:
            seen_block = True
            out.append(block % n_fragments)
        else:
            out.append(last_fragment if seen_block else 0)
    return out


def partition(model: torch.nn.Module, n_fragments: int) -> list[Fragment]:
    """Split the parameters of ``model`` into ``n_fragments`` strided fragments.

    Every parameter of ``model.named_parameters()`` (tied weights appear once) lands in exactly one
    fragment. Raises ``UserError`` unless 1 <= n_fragments <= number of decoder blocks, because an
    empty fragment would sync nothing yet still take a slot of the schedule.
    """
    named = list(model.named_parameters())
    names = [name for name, _ in named]
    n_blocks = _n_blocks(names)
    if n_blocks == 0:
        raise UserError("the model has no decoder blocks named 'model.layers.N.' or 'transformer.h.N.'; "
                        "cannot build fragments")
    if not 1 <= n_fragments <= n_blocks:
        raise UserError(f"outer.fragments = {n_fragments} but the model has {n_blocks} decoder blocks; "
                        f"choose 1..{n_blocks}")
    assignment = _assign(names, n_fragments, n_blocks)
    fragments = []
    for index in range(n_fragments):
        members = [(name, p) for (name, p), f in zip(named, assignment, strict=True) if f == index]
        blocks = sorted({b for name, _ in members if (b := block_index(name)) is not None})
        fragments.append(Fragment(index=index, names=tuple(name for name, _ in members),
                                  blocks=tuple(blocks), numel=sum(p.numel() for _, p in members)))
    return fragments


def fragment_params(model: torch.nn.Module, fragment: Fragment) -> list[torch.nn.Parameter]:
    """The parameters of ``fragment`` in its name order (the order used for flat sync buffers)."""
    params = dict(model.named_parameters())
    try:
        return [params[name] for name in fragment.names]
    except KeyError as exc:
        raise ValueError(f"fragment {fragment.index} names parameter {exc.args[0]!r} "
                         "which this model does not have") from None


def _blocks_text(blocks: tuple[int, ...]) -> str:
    return ",".join(map(str, blocks)) if blocks else "-"


def partition_table(model: torch.nn.Module, fragments: list[Fragment]) -> Table:
    """A rich table: per fragment its blocks, tensor count, parameter count and share, plus a total."""
    total = sum(f.numel for f in fragments) or 1
    table = Table(title=f"{len(fragments)} fragments (strided)")
    for column, justify in (("fragment", "right"), ("blocks", "left"), ("tensors", "right"),
                            ("parameters", "right"), ("share", "right")):
        table.add_column(column, justify=justify)
    for f in fragments:
        table.add_row(str(f.index), _blocks_text(f.blocks), str(len(f.names)), f"{f.numel:,}",
                      f"{100 * f.numel / total:.1f}%")
    table.add_section()
    table.add_row("total", str(sum(len(f.blocks) for f in fragments)) + " blocks",
                  str(sum(len(f.names) for f in fragments)), f"{sum(f.numel for f in fragments):,}",
                  "100.0%")
    return table


def partition_json(fragments: list[Fragment]) -> list[dict]:
    """JSON-ready form of a partition."""
    return [{"index": f.index, "blocks": list(f.blocks), "numel": f.numel, "names": list(f.names)}
            for f in fragments]
