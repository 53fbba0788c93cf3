"""The convergence benchmark's settings sweep: each method's outer settings picked on a tuning split.

A comparison at one shared outer lr favours the methods that lr happens to suit: a method whose update
is partly one round stale (eager, the naive delay) wants a lower outer lr, or less Nesterov momentum,
than blocking DiLoCo (the Eager paper lowers the lr for the naive delay: 3.01 -> 2.73). So each method
gets a small sweep of its own settings (``locoswarm.node.sim.methods.tuned_settings``: the outer lr and momentum,
plus alpha or lambda0 where its merge rule has one), run on training documents held out as a tuning
split, never on the eval split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from locoswarm.node.errors import UserError

#: The values tried per setting (``--grid KEY=V1,V2,...`` replaces one).
DEFAULT_GRIDS: dict[str, tuple[float, ...]] = {
    "lr": (0.3, 0.5, 0.7, 1.0),
    "momentum": (0.0, 0.5, 0.9),
    "alpha": (0.25, 0.5, 0.75),
    "lambda0": (0.1, 0.2, 0.5),
}

Settings = dict[str, float]


@dataclass
class Trial:
    settings: Settings
    loss: float          # final loss on the tuning split (inf when the run diverged)


@dataclass
class Sweep:
    """Coordinate search over one method's settings, picking by the final loss on the tuning split (ties go
    to the earlier trial): each knob in turn over its grid with the others at the best values so far, then
    the first knob (the lr) once more, since the best lr moves with the momentum chosen after it (the step
    is about lr / (1 - momentum) long).

    ``start`` holds the method's own defaults and any fixed values (those are not swept); ``knobs`` are the
    settings to sweep, in order; ``grids`` their values."""

    method: str
    knobs: tuple[str, ...]
    grids: dict[str, tuple[float, ...]]
    start: Settings
    trials: list[Trial] = field(default_factory=list)

    @property
    def order(self) -> tuple[str, ...]:
        """The knob each stage sweeps: every knob, then the first again (with two or more)."""
        return (*self.knobs, self.knobs[0]) if len(self.knobs) > 1 else self.knobs

    @property
    def stages(self) -> int:
        return len(self.order)

    def candidates(self, stage: int) -> list[Settings]:
        """The settings stage ``stage`` tries: its knob over the grid, the others at the best so far
        (settings already tried in an earlier stage are not run again)."""
        knob = self.order[stage]
        base = self.best()
        tried = [t.settings for t in self.trials]
        out = []
        for value in self.grids[knob]:
            settings = {**base, knob: value}
            if settings not in tried and settings not in out:
                out.append(settings)
        return out

    def record(self, settings: Settings, loss: float) -> None:
        self.trials.append(Trial(dict(settings), loss if math.isfinite(loss) else math.inf))

    def best(self) -> Settings:
        """The settings of the lowest tuning loss so far (``start`` before any trial)."""
        if not self.trials:
            return dict(self.start)
        return dict(min(self.trials, key=lambda t: t.loss).settings)

    def to_dict(self) -> dict:
        return {"knobs": list(self.knobs), "start": self.start, "chosen": self.best(),
                "trials": [{"settings": t.settings, "tune_loss": t.loss} for t in self.trials]}


def run_sweeps(sweeps: Sequence[Sweep], evaluate: Callable[[list[tuple[Sweep, Settings]]], list[float]],
               after_stage: Callable[[], None] = lambda: None) -> None:
    """Run every sweep stage by stage; ``evaluate`` runs one stage's (sweep, settings) pairs of all methods
    (in parallel where it can) and returns their tuning losses in order."""
    for stage in range(max((s.stages for s in sweeps), default=0)):
        batch = [(s, c) for s in sweeps if stage < s.stages for c in s.candidates(stage)]
        for (sweep, settings), loss in zip(batch, evaluate(batch), strict=True):
            sweep.record(settings, loss)
        after_stage()


def parse_fixed(entries: Sequence[str], methods: Sequence[str]) -> dict[str, Settings]:
    """``--fix [METHOD.]KEY=VALUE`` entries -> {method: {key: value}} (no method: every method)."""
    fixed: dict[str, Settings] = {m: {} for m in methods}
    for entry in entries:
        key, sep, text = entry.partition("=")
        scope, dot, name = key.rpartition(".")
        if not sep or name not in DEFAULT_GRIDS or (dot and scope not in methods):
            raise UserError(f"--fix {entry!r} is not allowed; write [METHOD.]KEY=VALUE with KEY one of "
                            f"{', '.join(DEFAULT_GRIDS)} and METHOD one of the methods run, e.g. --fix eager.lr=0.5")
        value = _number(text, f"--fix {entry!r}")
        for method in ([scope] if dot else methods):
            fixed[method][name] = value
    return fixed


def parse_grids(entries: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """``--grid KEY=V1,V2,...`` entries on top of :data:`DEFAULT_GRIDS`."""
    grids = dict(DEFAULT_GRIDS)
    for entry in entries:
        key, sep, text = entry.partition("=")
        if not sep or key not in DEFAULT_GRIDS:
            raise UserError(f"--grid {entry!r} is not allowed; write KEY=V1,V2,... with KEY one of "
                            f"{', '.join(DEFAULT_GRIDS)}, e.g. --grid lr=0.3,0.5")
        values = tuple(_number(v, f"--grid {entry!r}") for v in text.split(","))
        grids[key] = values
    return grids


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"{what}: {text!r} is not a finite number")
    return value
