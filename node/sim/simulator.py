"""M workers in one process on the same outer core, through the in-process transport.

The swarm clock advances one tick per step. Worker ``m`` has a relative speed ``s_m`` in (0, 1]: it
makes an inner step on a tick whenever its accumulated credit reaches 1, so a worker at speed 1/3
makes a third of the steps (and tokens). Syncs are scheduled by the swarm clock, not by local step
counts, and each contribution is weighted by the tokens it represents, so a slow worker contributes
what it has and is never waited for. ``drop_prob`` makes a worker's sync fail at random; it then
keeps its local progress and catches up from peers before its next contribution.

Evaluation uses worker 0's live parameters: the model a peer actually holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from locoswarm.node.config import SwarmConfig
from locoswarm.node.core.compress import wire_codec
from locoswarm.node.core.judge import LossJudge
from locoswarm.node.core.outer_loop import OuterLoop
from locoswarm.node.core.state import outer_state_device
from locoswarm.node.data import Corpus, TrainBatches, eval_batches, evaluate, judge_batches
from locoswarm.node.errors import UserError
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.model import build_model
from locoswarm.node.partition import partition
from locoswarm.node.transport.inprocess import InProcessHub


@dataclass
class SimSpec:
    workers: int = 4
    steps: int = 500
    eval_every: int = 25
    eval_batches: int = 8
    speeds: list[float] | None = None
    drop_prob: float = 0.0
    seed: int = 0
    device: str = "cpu"
    # Seed of the model's init and of every worker's batch sampling; None: data.seed (as the swarm does).
    # The convergence benchmark's repeated runs differ by it (``seed`` alone leaves a run without drops
    # unchanged).
    sample_seed: int | None = None

    def data_seed(self, cfg: SwarmConfig) -> int:
        return cfg.data.seed if self.sample_seed is None else self.sample_seed


@dataclass
class SimResult:
    method: str
    eval_curve: list[tuple[int, float]]
    train_curve: list[tuple[int, float]]
    final_eval_loss: float
    bytes_sent_per_worker: float
    bytes_per_worker_per_step: float
    peak_bytes_per_sync: int
    syncs_ok: int
    syncs_failed: int
    catch_ups: int
    inner_steps: list[int]
    wall_seconds: float
    n_params: int
    extra: dict = field(default_factory=dict)


class _Worker:
    def __init__(self, rank: int, cfg: SwarmConfig, corpus: Corpus, vocab_size: int, spec: SimSpec,
                 device: torch.device, total_steps: int) -> None:
        self.rank = rank
        self.model = build_model(cfg.model, vocab_size, seed=spec.data_seed(cfg)).to(device)
        self.inner = InnerOptimizer(self.model, cfg.inner, total_steps=total_steps)
        self.batches = TrainBatches(corpus.train, rank, spec.workers, cfg.inner.batch_size,
                                    cfg.inner.seq_len, spec.data_seed(cfg))
        self.speed = 1.0 if spec.speeds is None else spec.speeds[rank]
        self.credit = 0.0
        self.local_step = 0
        self.last_loss = float("nan")
        self.outer: OuterLoop | None = None

    def tick(self) -> int:
        """Advance one clock tick; returns the tokens processed (0 if this worker had no step)."""
        self.credit += self.speed
        if self.credit < 1.0 - 1e-9:
            return 0
        self.credit -= 1.0
        batch = self.batches.get(self.local_step)
        self.last_loss = self.inner.step([batch])
        self.local_step += 1
        return batch.numel()


def check_spec(spec: SimSpec) -> None:
    if spec.workers < 1:
        raise UserError(f"--workers {spec.workers} must be >= 1")
    if spec.steps < 1:
        raise UserError(f"--steps {spec.steps} must be >= 1")
    if spec.speeds is not None:
        if len(spec.speeds) != spec.workers:
            raise UserError(f"--speeds has {len(spec.speeds)} values but --workers is {spec.workers}; "
                            "give one speed per worker")
        bad = [s for s in spec.speeds if not 0 < s <= 1]
        if bad:
            raise UserError(f"--speeds value {bad[0]} is not allowed; speeds are relative, in (0, 1]")
    if not 0 <= spec.drop_prob < 1:
        raise UserError(f"--drop-prob {spec.drop_prob} is not allowed; use a probability in [0, 1)")


def simulate(cfg: SwarmConfig, corpus: Corpus, vocab_size: int, spec: SimSpec, *, label: str = "",
             progress=None) -> SimResult:
    """Run the outer-loop core with ``spec.workers`` in-process workers."""
    check_spec(spec)
    device = torch.device(spec.device)
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    workers = [_Worker(m, cfg, corpus, vocab_size, spec, device, spec.steps) for m in range(spec.workers)]
    fragments = partition(workers[0].model, cfg.outer.fragments)
    codec = wire_codec(cfg.outer)
    hub = InProcessHub(codec, cfg.network.group_size, seed=spec.seed, drop_prob=spec.drop_prob, robust=cfg.robust)
    held_out = (judge_batches(corpus.eval, cfg.robust.judge_sequences, cfg.inner.seq_len)
                if cfg.robust.effect_check else None)
    for w in workers:
        judge = (LossJudge(w.model, held_out, device, relative_tolerance=cfg.robust.effect_tolerance,
                                health_slack=cfg.robust.health_slack)
                 if held_out is not None else None)
        w.outer = OuterLoop(w.model, fragments, cfg.outer, hub.transport(w.rank),
                            expected_group_size=min(cfg.network.group_size, spec.workers),
                            state_device=outer_state_device(cfg.outer.offload, device), judge=judge)
        hub.register_state(w.rank, w.outer.version, w.outer.snapshot)
    evals = eval_batches(corpus.eval, cfg.inner.batch_size, cfg.inner.seq_len, spec.eval_batches)
    eval_curve = [(0, evaluate(workers[0].model, evals, device))]
    train_curve: list[tuple[int, float]] = []
    task = progress.add_task(label or "simulate", total=spec.steps) if progress else None
    for t in range(1, spec.steps + 1):
        tokens = [w.tick() for w in workers]  # every worker's inner step (if its speed gives it one) first
        for w, n in zip(workers, tokens, strict=True):  # then the daemon's advance(), split around the flush
            w.outer.advance_sends(t - 1, t, n)
        hub.flush()
        for w in workers:
            w.outer.collect(t)
        losses = [w.last_loss for w in workers if w.local_step > 0]
        train_curve.append((t, sum(losses) / max(1, len(losses))))
        if t % spec.eval_every == 0 or t == spec.steps:
            eval_curve.append((t, evaluate(workers[0].model, evals, device)))
        if task is not None:
            progress.update(task, advance=1, description=f"{label:<18} eval {eval_curve[-1][1]:.3f}")
    before_drain = _land_in_flight(workers, spec.steps, evals, device, eval_curve)
    stats = [w.outer.stats for w in workers]
    sent = sum(s.bytes_sent for s in stats) / len(stats)
    return SimResult(
        method=label, eval_curve=eval_curve, train_curve=train_curve, final_eval_loss=eval_curve[-1][1],
        bytes_sent_per_worker=sent, bytes_per_worker_per_step=sent / spec.steps,
        peak_bytes_per_sync=max(s.peak_bytes_per_sync for s in stats),
        syncs_ok=sum(s.syncs_ok for s in stats), syncs_failed=sum(s.syncs_failed for s in stats),
        catch_ups=sum(s.catch_ups for s in stats), inner_steps=[w.local_step for w in workers],
        wall_seconds=time.perf_counter() - start, n_params=_outer_phi(workers[0]).numel(),
        extra={"spread": phi_spread(workers), "final_before_drain": before_drain})


def _land_in_flight(workers: list[_Worker], step: int, evals: list[torch.Tensor], device: torch.device,
                    eval_curve: list[tuple[int, float]]) -> float | None:
    """End of the run: merge every sync still in flight (``OuterLoop.drain``, as the daemon does when it stops)
    and evaluate again, so the final model holds every round it trained. Without it a method whose rounds
    overlap training ends with its last round unapplied: the naive delay (and 3/4 of eager's update with
    4 workers) would be judged on a model one round behind blocking DiLoCo's. Returns the final eval loss
    before the drain (None: nothing was in flight)."""
    if not any(w.outer.in_flight() for w in workers):
        return None
    for w in workers:
        w.outer.drain(step)
    before = eval_curve[-1][1]
    eval_curve[-1] = (step, evaluate(workers[0].model, evals, device))
    return before


def phi_spread(workers: list[_Worker]) -> float:
    """Largest relative L2 distance of any worker's phi from worker 0's (consensus check)."""
    ref = _outer_phi(workers[0])
    norm = float(torch.linalg.vector_norm(ref)) or 1.0
    return max((float(torch.linalg.vector_norm(_outer_phi(w) - ref)) / norm for w in workers[1:]), default=0.0)


def _outer_phi(worker: _Worker) -> torch.Tensor:
    """A worker's phi over all fragments, as one flat vector."""
    return torch.cat([worker.outer.snapshot(p).phi for p in range(worker.outer.n_fragments)])


def simulate_dp(cfg: SwarmConfig, corpus: Corpus, vocab_size: int, spec: SimSpec, *, label: str = "dp",
                progress=None) -> SimResult:
    """Data-parallel baseline: every step averages the M workers' gradients (one shared model).

    Bytes are those of a ring all-reduce of fp32 gradients: 2 (M-1)/M * 4 bytes per parameter per
    worker per step (reduce-scatter + all-gather).
    """
    check_spec(spec)
    device = torch.device(spec.device)
    start = time.perf_counter()
    model = build_model(cfg.model, vocab_size, seed=spec.data_seed(cfg)).to(device)
    inner = InnerOptimizer(model, cfg.inner, total_steps=spec.steps)
    shards = [TrainBatches(corpus.train, m, spec.workers, cfg.inner.batch_size, cfg.inner.seq_len,
                           spec.data_seed(cfg)) for m in range(spec.workers)]
    n_params = sum(p.numel() for p in model.parameters())
    per_step = 2 * (spec.workers - 1) / spec.workers * 4 * n_params
    evals = eval_batches(corpus.eval, cfg.inner.batch_size, cfg.inner.seq_len, spec.eval_batches)
    eval_curve = [(0, evaluate(model, evals, device))]
    train_curve = []
    task = progress.add_task(label, total=spec.steps) if progress else None
    for t in range(1, spec.steps + 1):
        loss = inner.step([s.get(t - 1) for s in shards])
        train_curve.append((t, loss))
        if t % spec.eval_every == 0 or t == spec.steps:
            eval_curve.append((t, evaluate(model, evals, device)))
        if task is not None:
            progress.update(task, advance=1, description=f"{label:<18} eval {eval_curve[-1][1]:.3f}")
    return SimResult(
        method=label, eval_curve=eval_curve, train_curve=train_curve, final_eval_loss=eval_curve[-1][1],
        bytes_sent_per_worker=per_step * spec.steps, bytes_per_worker_per_step=per_step,
        peak_bytes_per_sync=int(per_step), syncs_ok=spec.steps, syncs_failed=0, catch_ups=0,
        inner_steps=[spec.steps] * spec.workers, wall_seconds=time.perf_counter() - start, n_params=n_params)
