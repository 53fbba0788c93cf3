"""Which fragment syncs at which step.

- ``FixedSchedule`` (Streaming DiLoCo, Douillard et al. 2025): fragment p syncs every H steps at its
  own offset, offsets evenly spaced, so one fragment is in flight every H/F steps and the peak
  bandwidth drops by F.
- ``AdaptiveSchedule`` (CoCoDC, 2025): N sends per H steps, one every H/N steps; each time pick the
  fragment whose staleness is >= H (the most stale first), else one never sent, else the one with the
  largest R_p = |phi_p - theta_p|_1 / (I_p |p|). Members of a group must pick the same fragment, so the
  R vector used is the one summed over the group (CoCoDC all-reduces R with a sum) that travelled with
  the previous sync's payload.

Steps are the swarm clock: the number of inner steps the swarm has made, equal on every member.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ScheduleState:
    """The adaptive schedule's state a worker picked from at one send slot (before its pick). It travels
    with the sync request, so members that disagree learn it and re-align (``OuterLoop.adopt_schedule``)."""

    last_send: tuple[int | None, ...]
    shared_r: tuple[float, ...] | None


@dataclass
class ScheduleView:
    """What a schedule may look at; identical on every member of a group."""

    last_send: Sequence[int | None]            # swarm step of each fragment's last send
    in_flight: set[int] = field(default_factory=set)
    shared_r: torch.Tensor | None = None       # group-summed R vector of the last completed sync


class FixedSchedule:
    #: Whether members pick from shared state (last sends, summed R) that travels with their rounds.
    adaptive = False

    def __init__(self, h: int, n_fragments: int) -> None:
        if n_fragments > h:
            raise ValueError(f"fixed schedule needs fragments <= h, got {n_fragments} > {h}")
        self.h = h
        self.n_fragments = n_fragments
        # Fragment p first syncs after (p+1) H/F steps, then every H steps: with F = 1, at H, 2H, ...
        self.offsets = [round((p + 1) * h / n_fragments) % h for p in range(n_fragments)]

    def due(self, step: int, view: ScheduleView | None = None) -> list[int]:
        if step <= 0:
            return []
        return [p for p, off in enumerate(self.offsets) if step % self.h == off]


class AdaptiveSchedule:
    adaptive = True

    def __init__(self, h: int, n_fragments: int, sends_per_h: int = 0) -> None:
        self.h = h
        self.n_fragments = n_fragments
        self.sends_per_h = sends_per_h or n_fragments
        self.interval = max(1, round(h / self.sends_per_h))

    def due(self, step: int, view: ScheduleView) -> list[int]:
        if step <= 0 or step % self.interval != 0:
            return []
        pick = self.pick(step, view)
        return [] if pick is None else [pick]

    def pick(self, step: int, view: ScheduleView) -> int | None:
        candidates = [p for p in range(self.n_fragments) if p not in view.in_flight]
        if not candidates:
            return None

        def staleness(p: int) -> int:
            last = view.last_send[p]
            return step - (last if last is not None else 0)

        stale = [p for p in candidates if staleness(p) >= self.h]
        if stale:
            return max(stale, key=lambda p: (staleness(p), -p))
        never = [p for p in candidates if view.last_send[p] is None]
        if never:
            return never[0]
        if view.shared_r is None:
            return max(candidates, key=lambda p: (staleness(p), -p))
        r = view.shared_r
        return max(candidates, key=lambda p: (float(r[p]), -p))


def make_schedule(kind: str, h: int, n_fragments: int, sends_per_h: int = 0) -> FixedSchedule | AdaptiveSchedule:
    if kind == "fixed":
        return FixedSchedule(h, n_fragments)
    if kind == "adaptive":
        return AdaptiveSchedule(h, n_fragments, sends_per_h)
    raise ValueError(f"unknown schedule {kind!r}; choose 'fixed' or 'adaptive'")
