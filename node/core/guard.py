"""Guards on the outer state: nothing non-finite or absurd ever enters phi, momentum or theta.

Every place the outer state changes because of what peers sent checks its input here first: a group
average before the outer step, the outer step itself, a consensus shift, a downloaded snapshot (catch-up
and join). A check returns ``None`` when the change is acceptable, or a one-line reason; the caller then
keeps its state as it was (a refused result counts as a failed sync, whose local progress rides on the
next one) and reports the reason as an event. The transports already screen what each peer sends;
these checks are the last line, independent of any transport, and they never raise.

The limits are generous on purpose: an honest swarm never comes near them (measured: an outer step
moves phi by ~1-3% of its norm, a group average is within a few times a member's own contribution),
while the attacks they stop are orders of magnitude beyond (a poisoned round took |phi| from 66 to 996).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GuardLimits:
    max_average_ratio: float = 16.0   # |group average| <= this x |own contribution| (when it has one)
    max_step_fraction: float = 0.5    # |outer step| <= this x |phi|
    max_shift_fraction: float = 0.5   # consensus: |phi_bar - phi| <= this x |phi|
    max_jump_fraction: float = 1.0    # catch-up: |phi_new - phi| <= this x |phi|
    max_momentum_ratio: float = 1.0   # |momentum| <= this x |phi|


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.detach().to(torch.float64)))


def non_finite(name: str, x: torch.Tensor) -> str | None:
    """A reason if ``x`` holds nan/inf."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        return f"{name} has {bad} non-finite value(s) of {x.numel()}"
    return None


def check_average(average: torch.Tensor, own_norm: float, limits: GuardLimits) -> str | None:
    """A group average about to enter the outer step: finite, and not absurdly larger than this
    node's own contribution (the mean of honest contributions cannot exceed the largest of them)."""
    reason = non_finite("group average", average)
    if reason:
        return reason
    norm = _norm(average)
    if own_norm > 0 and norm > limits.max_average_ratio * own_norm:
        return (f"group average norm {norm:.3g} is {norm / own_norm:.1f}x this node's own contribution "
                f"(limit {limits.max_average_ratio:g}x)")
    return None


def check_outer_step(phi: torch.Tensor, momentum: torch.Tensor, new_phi: torch.Tensor, new_momentum: torch.Tensor,
                     limits: GuardLimits) -> str | None:
    """The result of an outer step: finite, and a move of phi that is not absurd."""
    reason = non_finite("new phi", new_phi) or non_finite("new momentum", new_momentum)
    if reason:
        return reason
    size, scale = _norm(new_phi - phi), _norm(phi)
    if scale > 0 and size > limits.max_step_fraction * scale:
        return (f"outer step would move phi by {size:.3g} = {size / scale:.0%} of its norm "
                f"(limit {limits.max_step_fraction:.0%})")
    return None


def check_shift(shift: torch.Tensor, phi: torch.Tensor, limits: GuardLimits) -> str | None:
    """A consensus correction (phi_bar - phi): finite and small next to phi."""
    reason = non_finite("consensus shift", shift)
    if reason:
        return reason
    size, scale = _norm(shift), _norm(phi)
    if scale > 0 and size > limits.max_shift_fraction * scale:
        return (f"consensus would move phi by {size / scale:.0%} of its norm "
                f"(limit {limits.max_shift_fraction:.0%})")
    return None


def check_snapshot(phi_new: torch.Tensor, momentum_new: torch.Tensor, phi: torch.Tensor,
                   limits: GuardLimits, *, relative: bool = True) -> str | None:
    """A downloaded outer state (phi, momentum) about to replace ``phi``: right size, finite, momentum
    small next to phi, and (``relative``: a catch-up, where the node's own phi is a trained
    reference) not absurdly far from the node's own phi."""
    if phi_new.numel() != phi.numel() or momentum_new.numel() != phi.numel():
        return f"snapshot has {phi_new.numel()}/{momentum_new.numel()} values, expected {phi.numel()}"
    reason = non_finite("snapshot phi", phi_new) or non_finite("snapshot momentum", momentum_new)
    if reason:
        return reason
    scale = _norm(phi_new)
    if _norm(momentum_new) > limits.max_momentum_ratio * max(scale, 1e-12):
        return f"snapshot momentum norm {_norm(momentum_new):.3g} exceeds its phi norm {scale:.3g}"
    if relative:
        own = _norm(phi)
        jump = _norm(phi_new.to(phi.device) - phi)
        if own > 0 and jump > limits.max_jump_fraction * own:
            return (f"snapshot phi is {jump / own:.0%} of this node's phi norm away "
                    f"(limit {limits.max_jump_fraction:.0%})")
    return None
