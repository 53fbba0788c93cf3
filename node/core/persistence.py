"""Persistent deviation: a member whose deviation from its group's centre points the same way round after round.

Centred clipping (``locoswarm.node.core.robust``) bounds what one contribution moves the average by in one round:
its share of the group's weight times the clip radius. That bound holds per round, not over time. Honest
deviations from the centre are mostly minibatch noise: round after round they point in unrelated directions and
their sum grows like the square root of the rounds. A drift (ALIE-like: "a little is enough", Baruch et al.
2019) adds the same pattern every round inside the radius, so its sum grows linearly and the outer momentum
amplifies it further: measured on the tiny preset, +9.3% held-out loss over 180 s while every single round was
inside the bounds.

So a reducer remembers, per sender, fragment and chunk, an exponential average of a fixed sample of that sender's
deviations from the centre (:class:`DeviationMemory`), and measures each new deviation's cosine with it: the
*persistence* of the sender's deviation (0 without history, near 0 for noise, near 1 for a fixed pattern). Honest
members deviate persistently too, since each trains on its own documents (0.3-0.5 on the tiny preset), so a
sender's clip radius shrinks only for persistence above the group's median (``core.robust.persistence_shrink``): a
fixed pattern (0.86-0.90 measured) loses most of its pull away from the centre, while its component along the
centre (its progress) still counts. Nothing is refused or banned for it: an honest member whose data differ more
than the others' loses only that share of its radius. In a pair the two deviations from their mean are opposite,
so equally persistent: a pair cannot tell a drifter from its partner this way.

Memory is bounded: ``samples`` evenly spaced values per chunk, at most ``max_entries`` (sender, fragment, chunk)
entries, the least recently used forgotten first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

#: The exponential average's weight of the past: an attack must keep its pattern over several rounds to matter,
#: and a weight of one half lets the average follow a sender within a few rounds.
DECAY = 0.5
SAMPLES = 256
MAX_ENTRIES = 8192


def sample_index(size: int, samples: int = SAMPLES) -> torch.Tensor:
    """The evenly spaced positions of a chunk of ``size`` elements that the memory keeps."""
    return torch.linspace(0, size - 1, min(size, samples)).round().long()


class DeviationMemory:
    """Per (sender, fragment, chunk): the exponential average of a sample of the sender's deviations from its
    groups' centres (see the module docstring). One per reducer (it judges only what it reduced itself)."""

    def __init__(self, decay: float = DECAY, samples: int = SAMPLES, max_entries: int = MAX_ENTRIES) -> None:
        self.decay = float(decay)
        self.samples = int(samples)
        self.max_entries = int(max_entries)
        self._mem: OrderedDict[tuple[str, int, int], torch.Tensor] = OrderedDict()

    def round(self, fragment: int, senders: Sequence[str], chunks: Sequence[int]) -> DeviationRound:
        """A reduction of ``chunks`` (global chunk indices, in the part's order) of ``fragment`` with one row per
        sender: observe its deviations chunk by chunk, read the persistence, then commit."""
        return DeviationRound(self, fragment, list(senders), list(chunks))

    def get(self, key: tuple[str, int, int]) -> torch.Tensor | None:
        return self._mem.get(key)

    def put(self, key: tuple[str, int, int], value: torch.Tensor) -> None:
        self._mem.pop(key, None)
        self._mem[key] = value
        while len(self._mem) > self.max_entries:
            self._mem.popitem(last=False)

    def __len__(self) -> int:
        return len(self._mem)


class DeviationRound:
    """One reduction's observations (``DeviationMemory.round``)."""

    def __init__(self, memory: DeviationMemory, fragment: int, senders: list[str], chunks: list[int]) -> None:
        self.memory = memory
        self.fragment = fragment
        self.senders = senders
        self.chunks = chunks
        n = len(senders)
        self._dot = [0.0] * n
        self._now_sq = [0.0] * n
        self._past_sq = [0.0] * n
        self._new: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]

    def observe(self, k: int, deviations: torch.Tensor) -> None:
        """Chunk ``k`` of the part: ``deviations`` (rows, elements) of each sender's values from the centre."""
        c = self.chunks[k]
        sample = deviations[:, sample_index(deviations.shape[1], self.memory.samples)].to(torch.float32)
        for i, sender in enumerate(self.senders):
            now = sample[i]
            self._new[i][c] = now
            past = self.memory.get((sender, self.fragment, c))
            if past is None or past.shape != now.shape:
                continue
            self._dot[i] += float(now @ past)
            self._now_sq[i] += float(now @ now)
            self._past_sq[i] += float(past @ past)

    def persistence(self) -> list[float]:
        """Per sender: the cosine of this round's deviation with its remembered average (0 without history)."""
        out = []
        for dot, a, b in zip(self._dot, self._now_sq, self._past_sq, strict=True):
            out.append(dot / math.sqrt(a * b) if a > 0 and b > 0 else 0.0)
        return out

    def commit(self) -> None:
        """Fold this round's deviations into the memory."""
        d = self.memory.decay
        for sender, new in zip(self.senders, self._new, strict=True):
            for c, now in new.items():
                key = (sender, self.fragment, c)
                past = self.memory.get(key)
                fresh = past is None or past.shape != now.shape
                self.memory.put(key, now.clone() if fresh else d * past + (1 - d) * now)


__all__ = ["DeviationMemory", "DeviationRound", "sample_index"]
