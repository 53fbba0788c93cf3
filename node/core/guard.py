"""Guards on the outer state: nothing non-finite or absurd ever enters phi, momentum or theta.

Every place the outer state changes because of what peers sent checks its input here first: a group
average before the outer step, the outer step itself, a consensus shift, a downloaded snapshot (catch-up
and join). A check returns ``None`` when the change is acceptable, or a one-line reason; the caller then
keeps its state as it was (a refused result counts as a failed sync, whose local progress rides on the
next one) and reports the reason as an event. The transports already screen what each peer sends;
these checks are the last line, independent of any transport, and they never raise.

The limits are generous on purpose, and relative to what an honest swarm can produce rather than to the
size of phi: early in training an honest outer step can move a fragment by several times its norm
(observed: 480% of |phi| on the tiny test model, whose init is small), so phi-relative bounds are only
used where honest changes are small by construction (a consensus correction) or as absurdity bounds.
What they stop is orders of magnitude beyond (a poisoned round took |phi| from 66 to 996 and then to
inf); the transports' screening catches the subtler cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GuardLimits:
    max_average_ratio: float = 16.0   # |group average| <= this x |own contribution| (when it has one) ...
    max_average_phi: float = 1.0      # ... or <= this x |phi| (a joiner's own progress is tiny next to others')
    max_step_ratio: float = 8.0       # |outer step| <= this x (|average| + |old momentum|): lr <= ~4
    max_shift_fraction: float = 0.5   # consensus: |phi_bar - phi| <= this x |phi|
    max_jump_fraction: float = 10.0   # catch-up: |phi_new - phi| <= this x |phi| (absurd only)
    max_momentum_ratio: float = 100.0  # snapshot: |momentum| <= this x |phi| (absurd only)


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.detach().to(torch.float64)))


def non_finite(name: str, x: torch.Tensor) -> str | None:
    """A reason if ``x`` holds nan/inf."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        return f"{name} has {bad} non-finite value(s) of {x.numel()}"
    return None


def check_average(average: torch.Tensor, own_norm: float, limits: GuardLimits, *, phi_norm: float = 0.0) -> str | None:
    """A group average about to enter the outer step: finite, and not absurdly larger than this
    node's own contribution (the mean of honest contributions cannot exceed the largest of them) unless it
    stays within ``max_average_phi`` x |phi|: a node that joined a moment ago has made a few steps, its
    partner a whole round's (a CI run saw an honest joiner refuse 19x and 29x its own, average norm 4-6
    against a phi norm of ~40, fail its rounds, and be banned). A node that contributed nothing (no
    progress since its last sync) judges by phi alone: an average larger than ``max_jump_fraction`` x |phi|
    is absurd."""
    reason = non_finite("group average", average)
    if reason:
        return reason
    norm = _norm(average)
    if own_norm > 0 and norm > limits.max_average_ratio * own_norm and norm > limits.max_average_phi * phi_norm:
        return (f"group average norm {norm:.3g} is {norm / own_norm:.1f}x this node's own contribution "
                f"(limit {limits.max_average_ratio:g}x) and above phi's norm {phi_norm:.3g}")
    if own_norm <= 0 and phi_norm > 0 and norm > limits.max_jump_fraction * phi_norm:
        return (f"group average norm {norm:.3g} is {norm / phi_norm:.1f}x phi's norm while this node "
                f"contributed nothing (limit {limits.max_jump_fraction:g}x)")
    return None


def check_outer_step(phi: torch.Tensor, momentum: torch.Tensor, new_phi: torch.Tensor, new_momentum: torch.Tensor,
                     average: torch.Tensor, limits: GuardLimits) -> str | None:
    """The result of an outer step on ``average``: finite, and a move of phi that an outer optimizer
    with a sane learning rate can make from that average and the old momentum."""
    reason = non_finite("new phi", new_phi) or non_finite("new momentum", new_momentum)
    if reason:
        return reason
    size, scale = _norm(new_phi - phi), _norm(average) + _norm(momentum)
    if size > limits.max_step_ratio * scale:
        return (f"outer step would move phi by {size:.3g}, {size / max(scale, 1e-30):.1f}x its inputs' norm "
                f"(limit {limits.max_step_ratio:g}x)")
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


def check_momentum(momentum: torch.Tensor, phi: torch.Tensor, limits: GuardLimits) -> str | None:
    """A momentum from peers (a consensus mean): finite and not absurdly large next to phi."""
    reason = non_finite("momentum", momentum)
    if reason:
        return reason
    if _norm(momentum) > limits.max_momentum_ratio * max(_norm(phi), 1e-12):
        return f"momentum norm {_norm(momentum):.3g} exceeds its phi norm {_norm(phi):.3g}"
    return None


def check_snapshot(phi_new: torch.Tensor, momentum_new: torch.Tensor, phi: torch.Tensor,
                   limits: GuardLimits, *, relative: bool = True) -> str | None:
    """A downloaded outer state (phi, momentum) about to replace ``phi``: right size, finite, momentum
    small next to phi, and (``relative``: a catch-up, where the node's own phi is a trained
    reference) not absurdly far from the node's own phi."""
    if phi_new.numel() != phi.numel() or momentum_new.numel() != phi.numel():
        return f"snapshot has {phi_new.numel()}/{momentum_new.numel()} values, expected {phi.numel()}"
    reason = non_finite("snapshot phi", phi_new) or check_momentum(momentum_new, phi_new, limits)
    if reason:
        return f"snapshot {reason}" if reason.startswith("momentum") else reason
    if relative:
        own = _norm(phi)
        jump = _norm(phi_new.to(phi.device) - phi)
        if own > 0 and jump > limits.max_jump_fraction * own:
            return (f"snapshot phi is {jump / own:.0%} of this node's phi norm away "
                    f"(limit {limits.max_jump_fraction:.0%})")
    return None
