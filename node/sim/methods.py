"""The training methods compared by the simulator and the convergence benchmark.

Each method is the swarm configuration of one paper's recipe, applied on top of a base config that
fixes the model, data, inner optimizer, H, F and the overlap tau. ``dp`` is not an outer-loop
method: gradients are averaged every step (same global batch).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from locoswarm.node.config import SwarmConfig


@dataclass(frozen=True)
class Method:
    name: str
    paper: str
    description: str
    apply: Callable[[SwarmConfig, int], None] | None   # (cfg, overlap tau) -> None; None for dp


def _outer(**values: object) -> Callable[[SwarmConfig, int], None]:
    def apply(cfg: SwarmConfig, tau: int) -> None:
        for key, value in values.items():
            if value == "TAU":
                value = tau
            elif value == "H":
                value = cfg.outer.h
            elif value == "F":
                value = cfg.outer.fragments
            setattr(cfg.outer, key, value)
    return apply


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("dp", "data-parallel baseline", "gradients averaged every step, same global batch", None),
    Method("diloco", "DiLoCo (Douillard et al. 2023)", "F=1, blocking sync every H steps, fp32",
           _outer(fragments=1, tau=0, method="replace", codec="fp32", error_feedback=False, schedule="fixed")),
    Method("streaming", "Streaming DiLoCo (Douillard et al. 2025)", "F strided fragments, tau=0, fp32",
           _outer(tau=0, method="replace", codec="fp32", error_feedback=False, schedule="fixed")),
    Method("streaming-fp4", "Streaming DiLoCo", "F fragments, tau=0, FP4 E3M0 payloads",
           _outer(tau=0, method="replace", codec="fp4", error_feedback=False, schedule="fixed")),
    Method("delayed", "one-step delay (DiLoCoX)",
           "F=1, sync overlaps a whole round (tau=H), local progress rebased",
           _outer(fragments=1, tau="H", method="rebase", codec="fp32", error_feedback=False, schedule="fixed")),
    Method("naive-delay", "naive one-outer-step delay (baseline of the Eager paper)",
           "F=1, tau=H, the late group average applied, theta <- phi",
           _outer(fragments=1, tau="H", method="delay", codec="fp32", error_feedback=False, schedule="fixed")),
    Method("eager", "Eager updates (Kale et al. 2025)", "F=1, tau=H, own update applied at once",
           _outer(fragments=1, tau="H", method="eager", codec="fp32", error_feedback=False, schedule="fixed")),
    Method("streaming-overlap", "Streaming DiLoCo", "F fragments, tau>0, alpha=0.5 mix, fp32",
           _outer(tau="TAU", method="alpha", alpha=0.5, codec="fp32", error_feedback=False, schedule="fixed")),
    Method("cocodc", "CoCoDC (2025)", "F fragments, tau>0, Taylor delay compensation, adaptive schedule, fp32",
           _outer(tau="TAU", method="compensate", lambda0=0.2, codec="fp32", error_feedback=False,
                  schedule="adaptive", sends_per_h="F")),
    # The recommended stack, chosen by measurement (reports/default): the alpha mix of Streaming DiLoCo beat
    # CoCoDC's compensation at our scale, and FP4 with error feedback costs no loss at 1/7 of the bytes.
    Method("locoswarm", "this project's default stack",
           "F fragments, tau>0, alpha=0.5 mix, FP4 + error feedback, fixed schedule",
           _outer(tau="TAU", method="alpha", alpha=0.5, codec="fp4", error_feedback=True, schedule="fixed")),
    Method("diloco-x", "DiLoCoX (Qi et al. 2025)",
           "F=1, one-step-delay overlap (tau=H, rebase) + adaptive low-rank compression with error feedback",
           _outer(fragments=1, tau="H", method="rebase", codec="lowrank", error_feedback=True, schedule="fixed")),
    # diloco-x without its delay: what the low-rank compression alone costs against diloco.
    Method("diloco-lowrank", "DiLoCoX's compression on DiLoCo",
           "F=1, blocking sync every H steps, adaptive low-rank compression with error feedback",
           _outer(fragments=1, tau=0, method="replace", codec="lowrank", error_feedback=True, schedule="fixed")),
    # The paper's recipe: DiLoCo's blocking sync with the decayed accumulator in place of the outer momentum
    # (momentum 0, outer lr 1, beta 0.95), top-64 of every 4096 entries at 2 bits.
    Method("sparseloco", "SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706)",
           "F=1, blocking sync every H steps, chunk-wise top-k (1.6%) 2-bit with a decayed error-feedback accumulator",
           _outer(fragments=1, tau=0, method="replace", codec="sparseloco", error_feedback=True, schedule="fixed",
                  lr=1.0, momentum=0.0, sparse_chunk=4096, sparse_topk=64, sparse_beta=0.95, sparse_value_bits=2)),
]}


def tuned_settings(name: str, cfg: SwarmConfig) -> tuple[str, ...]:
    """The ``[outer]`` settings a fair comparison tunes for method ``name`` configured as ``cfg`` (its
    ``method_config``): the outer lr and momentum of every outer-loop method (Nesterov momentum amplifies a
    stale update: eager and the naive delay want less of it than blocking DiLoCo), plus its merge rule's own
    knobs (alpha, lambda0); none for dp, whose only optimizer is the inner one."""
    # lazy: locoswarm.node.core.merge imports torch (~1 s, measured); this module does not
    from locoswarm.node.core.merge import make_merge_rule

    if METHODS[name].apply is None:
        return ()
    return ("lr", "momentum", *make_merge_rule(cfg.outer.method).tunable)


def method_config(base: SwarmConfig, name: str, tau: int) -> SwarmConfig:
    """A copy of ``base`` configured for method ``name`` (the overlap methods use ``tau``)."""
    cfg = copy.deepcopy(base)
    method = METHODS[name]
    if method.apply is not None:
        method.apply(cfg, tau)
    return cfg
