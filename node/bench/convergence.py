"""``locoswarm bench convergence``: every method side by side, each at its own tuned settings, over seeds.

Methods: every entry of the registry ``locoswarm.node.sim.methods.METHODS`` (dp, diloco, streaming, streaming-fp4,
delayed, naive-delay, eager, streaming-overlap, cocodc, locoswarm, and whatever is added there). Each runs
the in-process simulator with the same model, data shards, inner optimizer and number of inner steps.

A fair comparison: first each method's outer settings (the outer lr and momentum, plus alpha or lambda0
where its merge rule has one) are swept on a *tuning split*, training documents held out by the eval
split's hash rule with another salt (``locoswarm.node.data.load_corpus(tune_fraction=...)``), and the lowest final
tuning loss is kept (``locoswarm.node.bench.tuning``); then every method runs at its chosen settings once per seed
(model init and batch sampling differ) and is evaluated on the eval split, never seen before. The final
model is the one after every sync in flight has landed (``locoswarm.node.sim.simulator``). The report gives the
mean final eval loss with the seeds' spread, steps to a target (DiLoCo's mean final eval loss, or
``--target``), bytes, the tuning table and the papers' claims checked (``locoswarm.node.bench.convergence_report``).

Profiles and their expected run time, tuned with 2 seeds (``--no-tune``: the eval runs alone):
quick (tiny model, 240 steps, H 30: 8 rounds), default (tiny, 800 steps, H 40: 20 rounds), long (tiny,
960 steps, H 30: 32 rounds), small (the 26M preset, 960 steps, H 30, batch 16 x 256: meant for one GPU;
device auto, bf16 autocast in the inner steps, fp32 outer state). See the README for measured and
estimated times on 2 CPU cores and on one GPU.
"""

from __future__ import annotations

import argparse
import math
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from locoswarm.node.bench.convergence_report import (  # re-exported: the tests and callers use them from here
    SEARCH,
    check_claims,
    normalize,
    steps_to_target,
    write_report,
)
from locoswarm.node.bench.tuning import DEFAULT_GRIDS, Settings, Sweep, parse_fixed, parse_grids, run_sweeps
from locoswarm.node.commands import add_config_args, add_data_args, data_paths, load_config_from_args
from locoswarm.node.config import named_settings, validate
from locoswarm.node.errors import UserError
from locoswarm.node.helptext import describe
from locoswarm.node.sim.methods import METHODS, method_config, tuned_settings

if TYPE_CHECKING:
    from locoswarm.node.config import SwarmConfig
    from locoswarm.node.data import Corpus

__all__ = ["ALL_METHODS", "PROFILES", "check_claims", "steps_to_target", "write_report"]

ALL_METHODS = tuple(METHODS)  # the registry's order; a method added there is benchmarked without editing this


@dataclass(frozen=True)
class Profile:
    """A benchmark size: model, swarm, schedule, and the length of the tuning runs."""

    name: str
    model_overrides: dict
    workers: int
    steps: int
    h: int
    fragments: int
    tau: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int
    tune_steps: int


PROFILES = {
    "quick": Profile("quick", {"preset": "tiny"}, workers=4, steps=240, h=30, fragments=2, tau=3,
                     batch_size=8, seq_len=64, lr=2e-3, warmup=30, eval_every=15, eval_batches=8, tune_steps=240),
    "default": Profile("default", {"preset": "tiny"}, workers=4, steps=800, h=40, fragments=2, tau=4,
                       batch_size=8, seq_len=128, lr=2e-3, warmup=50, eval_every=20, eval_batches=16, tune_steps=400),
    "long": Profile("long", {"preset": "tiny"}, workers=4, steps=960, h=30, fragments=2, tau=3,
                    batch_size=8, seq_len=64, lr=2e-3, warmup=50, eval_every=30, eval_batches=8, tune_steps=480),
    "small": Profile("small", {"preset": "small"}, workers=4, steps=960, h=30, fragments=2, tau=3,
                     batch_size=16, seq_len=256, lr=1e-3, warmup=100, eval_every=30, eval_batches=16, tune_steps=480),
}
DEFAULT_PROFILE = "default"
DEFAULT_SEEDS = 2
DEFAULT_TUNE_FRACTION = 0.02


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convergence", help="all methods side by side: tuned on a tuning split, run over seeds",
                       description=describe(__doc__))
    add_config_args(p)
    add_data_args(p)
    p.add_argument("--out", required=True, help="report directory (results.json, report.md, loss.png)")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help=f"benchmark size: {', '.join(PROFILES)} (default {DEFAULT_PROFILE}; see the description)")
    p.add_argument("--quick", action="store_true", help="the quick profile (same as --profile quick)")
    p.add_argument("--workers", type=int, default=None, help="workers M (default: the profile's)")
    p.add_argument("--steps", type=int, default=None, help="inner steps per worker (default: the profile's)")
    p.add_argument("--h", type=int, default=None, help="inner steps between syncs of a fragment")
    p.add_argument("--fragments", type=int, default=None, help="fragments F of the streaming methods")
    p.add_argument("--tau", type=int, default=None, help="overlap of the tau>0 methods")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help=f"comma-separated subset of {','.join(ALL_METHODS)}")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                   help=f"runs per method, seeds SEED..SEED+N-1 (model init and batch sampling; "
                        f"default {DEFAULT_SEEDS})")
    p.add_argument("--seed", type=int, default=0,
                   help="first seed (default 0: the model init and sampling of data.seed, as the swarm runs)")
    p.add_argument("--no-tune", action="store_true",
                   help="skip the sweep: every method runs its preset settings (and any --fix)")
    p.add_argument("--fix", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                   help="a fixed setting, not swept: lr, momentum, alpha or lambda0, for one method or (no "
                        "METHOD.) all, e.g. --fix eager.lr=0.5 or --fix momentum=0.9 (repeatable)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="the values swept for lr, momentum, alpha or lambda0 (default lr 0.3,0.5,0.7,1; momentum "
                        "0,0.5,0.9; alpha 0.25,0.5,0.75; lambda0 0.1,0.2,0.5)")
    p.add_argument("--settings-from", action="append", default=[], metavar="DIR",
                   help="each method's settings from the sweep of an earlier tuned report (DIR/results.json), e.g. "
                        "the quick profile's for the long one (same model, batch and tuning split; its tuning runs "
                        "were shorter); repeatable: a method takes the first report that ran it; methods none ran "
                        "are swept here (unless --no-tune); --fix still wins")
    p.add_argument("--tune-steps", type=int, default=None,
                   help="inner steps of each tuning run (default: the profile's; at most --steps)")
    p.add_argument("--tune-fraction", type=float, default=DEFAULT_TUNE_FRACTION,
                   help="share of the training documents held out as the tuning split "
                        f"(default {DEFAULT_TUNE_FRACTION})")
    p.add_argument("--target", type=float, default=None,
                   help="eval loss of steps-to-target (default: diloco's mean final eval loss)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once, each in a process of its own (default 1; on 2 cores or one GPU, 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per run (default 1: on a shared or small machine more threads per run "
                        "spin against each other; use --jobs for parallel runs)")
    p.add_argument("--render-only", action="store_true",
                   help="re-render report.md and loss.png from an existing DIR/results.json")
    p.set_defaults(func=run_convergence)


# ---- input ---------------------------------------------------------------------------------------------

def _profile(args: argparse.Namespace) -> Profile:
    name = args.profile or ("quick" if args.quick else DEFAULT_PROFILE)
    if name not in PROFILES:
        raise UserError(f"--profile {name!r} is not a profile; choose one of {', '.join(PROFILES)}")
    if args.quick and name != "quick":
        raise UserError(f"--quick and --profile {name} disagree; give one of them")
    base = PROFILES[name]
    changes = {k: getattr(args, k) for k in ("workers", "steps", "h", "fragments", "tau")
               if getattr(args, k) is not None}
    for key, value in changes.items():
        if value < (0 if key == "tau" else 1):
            raise UserError(f"--{key} {value} is not allowed; it must be >= {0 if key == 'tau' else 1}")
    steps = changes.get("steps", base.steps)
    tune_steps = args.tune_steps if args.tune_steps is not None else min(base.tune_steps, steps)
    if not 1 <= tune_steps <= steps:
        raise UserError(f"--tune-steps {tune_steps} is not allowed; tuning runs take 1..{steps} steps (--steps)")
    return Profile(**{**asdict(base), **changes, "tune_steps": tune_steps})


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in ALL_METHODS]
    if bad or not names:
        raise UserError(f"--methods {text!r}: unknown method {bad[0] if bad else '(none)'}; "
                        f"choose from {','.join(ALL_METHODS)}")
    return names


def _check_counts(args: argparse.Namespace) -> None:
    if args.seeds < 1:
        raise UserError(f"--seeds {args.seeds} is not allowed; run at least 1 seed (2 for a spread)")
    if args.jobs < 1:
        raise UserError(f"--jobs {args.jobs} is not allowed; it must be >= 1")
    if args.threads < 1:
        raise UserError(f"--threads {args.threads} is not allowed; it must be >= 1")
    if not 0 < args.tune_fraction <= 0.5:
        raise UserError(f"--tune-fraction {args.tune_fraction} is not allowed; use a share in (0, 0.5]")
    if args.target is not None and not math.isfinite(args.target):
        raise UserError(f"--target {args.target} is not allowed; give a finite eval loss")


def base_config(args: argparse.Namespace, prof: Profile):
    """The user's config (or defaults) with the profile's model, inner and schedule settings, except those the
    user set (a ``--set robust.clip_factor=3`` must not also change the profile's sequence length)."""
    cfg = load_config_from_args(args)
    named = named_settings(args.config, args.overrides)
    profile = {**{("model", k): v for k, v in prof.model_overrides.items()},
               ("inner", "batch_size"): prof.batch_size, ("inner", "seq_len"): prof.seq_len,
               ("inner", "lr"): prof.lr, ("inner", "warmup"): prof.warmup}
    for (section, key), value in profile.items():
        if f"{section}.{key}" not in named:
            setattr(getattr(cfg, section), key, value)
    cfg.outer.h, cfg.outer.fragments, cfg.outer.tau = prof.h, prof.fragments, 0
    cfg.outer.method = "replace"
    cfg.network.group_size = max(cfg.network.group_size, prof.workers)  # all-reduce, as in the papers
    if prof.tau > prof.h:
        raise UserError(f"--tau {prof.tau} must be <= --h {prof.h}")
    validate(cfg, source="bench")
    return cfg


# ---- runs -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One simulated run: a method at some settings, one seed, on the tuning or the eval split."""

    method: str
    settings: dict
    seed: int
    steps: int
    split: str          # "tune" | "eval"

    @property
    def label(self) -> str:
        knobs = " ".join(f"{k}={v:g}" for k, v in self.settings.items())
        return f"{self.method} {self.split} s{self.seed} {knobs}".strip()


@dataclass
class BenchContext:
    """What every run shares: the config, the corpus with its tuning split, the profile and the device.
    Built once per process (a pool's worker rebuilds it from the same inputs: the split is deterministic)."""

    cfg: SwarmConfig
    corpus: Corpus
    vocab_size: int
    profile: Profile
    device: str
    tune_fraction: float
    data: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, cfg: SwarmConfig, data: list[str], prof: Profile, device: str,
             tune_fraction: float) -> BenchContext:
        # lazy: locoswarm.node.data imports torch (~1 s, measured); this module does not
        from locoswarm.node.data import load_corpus, load_tokenizer

        tokenizer = load_tokenizer(cfg.model.tokenizer)
        corpus = load_corpus(data, cfg.data, tokenizer, tune_fraction=tune_fraction)
        if corpus.tune is None or len(corpus.tune) < cfg.inner.seq_len:
            raise UserError(f"the tuning split has {0 if corpus.tune is None else len(corpus.tune)} tokens, fewer than "
                            f"inner.seq_len = {cfg.inner.seq_len}; raise --tune-fraction or add data")
        return cls(cfg, corpus, tokenizer.vocab_size, prof, device, tune_fraction, list(data))

    def method_config(self, method: str, settings: Settings) -> SwarmConfig:
        """The method's config at ``settings`` (outer lr, momentum, alpha, lambda0), validated."""
        cfg = method_config(self.cfg, method, self.profile.tau)
        for key, value in settings.items():
            setattr(cfg.outer, key, value)
        validate(cfg, source="bench")
        return cfg

    def run(self, job: Job, progress=None) -> dict:
        """Simulate ``job``; its record for the report (final loss and curve on the job's split, bytes)."""
        # lazy: locoswarm.node.core.compress and .sim.simulator import torch (~1 s, measured); this module does not
        from locoswarm.node.core.compress import wire_codec
        from locoswarm.node.sim.simulator import SimSpec, simulate, simulate_dp

        p = self.profile
        corpus = self.corpus if job.split == "eval" else replace(self.corpus, eval=self.corpus.tune)
        cfg = self.method_config(job.method, job.settings)
        spec = SimSpec(workers=p.workers, steps=job.steps, eval_every=p.eval_every, eval_batches=p.eval_batches,
                       seed=job.seed, device=self.device, sample_seed=cfg.data.seed + job.seed)
        run = simulate_dp if METHODS[job.method].apply is None else simulate
        res = run(cfg, corpus, self.vocab_size, spec, label=job.label, progress=progress)
        record = {
            "seed": job.seed, "final_eval_loss": res.final_eval_loss, "eval_curve": [[s, v] for s, v in res.eval_curve],
            "syncs_ok": res.syncs_ok, "syncs_failed": res.syncs_failed, "phi_spread": res.extra.get("spread", 0.0),
            "final_before_drain": res.extra.get("final_before_drain"), "wall_seconds": res.wall_seconds,
        }
        static = {"bytes_per_worker_per_step": res.bytes_per_worker_per_step,
                  "peak_bytes_per_sync": res.peak_bytes_per_sync,
                  "bytes_sent_per_worker": res.bytes_sent_per_worker, "n_params": res.n_params}
        if METHODS[job.method].apply is not None:
            static["outer"] = asdict(cfg.outer)
            # lowrank: its factors' block codec (its bytes are measured, not derived from this)
            static["codec_bits_per_element"] = wire_codec(cfg.outer).bits_per_element(res.n_params)
        return {"run": record, "static": static}


class _RelayProgress:
    """The part of rich's Progress the simulator calls, relayed through a queue from a pool's process."""

    def __init__(self, q, job_id: int) -> None:
        self.q, self.job_id = q, job_id

    def add_task(self, description: str, total: int) -> int:
        self.q.put(("add", self.job_id, description, total))
        return self.job_id

    def update(self, task: int, advance: int = 0, description: str | None = None) -> None:
        self.q.put(("update", self.job_id, advance, description))


_CONTEXT: BenchContext | None = None  # a pool process's context (built once by _init_worker)


def _init_worker(cfg: SwarmConfig, data: list[str], prof: Profile, device: str, tune_fraction: float,
                 threads: int) -> None:
    import torch

    global _CONTEXT
    torch.set_num_threads(threads)
    _CONTEXT = BenchContext.load(cfg, data, prof, device, tune_fraction)


def _run_in_worker(job: Job, q, job_id: int) -> dict:
    assert _CONTEXT is not None
    out = _CONTEXT.run(job, _RelayProgress(q, job_id))
    q.put(("done", job_id, None, None))
    return out


class Runner:
    """Runs jobs here (``jobs`` = 1) or in a pool of processes, showing a bar per run in progress and one
    overall bar; ``on_done(job, out)`` is called as each run finishes (the report is rewritten then)."""

    def __init__(self, ctx: BenchContext, jobs: int, threads: int, progress) -> None:
        self.ctx, self.jobs, self.threads, self.progress = ctx, jobs, threads, progress
        self._pool = None
        self._queue = None
        self._manager = None

    def __enter__(self) -> Runner:
        if self.jobs > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            spawn = mp.get_context("spawn")
            self._manager = spawn.Manager()
            self._queue = self._manager.Queue()
            c = self.ctx
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=spawn, initializer=_init_worker,
                                             initargs=(c.cfg, c.data, c.profile, c.device, c.tune_fraction,
                                                       self.threads))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._manager.shutdown()

    def run(self, jobs: Sequence[Job], title: str, on_done) -> list[dict]:
        overall = self.progress.add_task(title, total=len(jobs))
        outs: list[dict | None] = [None] * len(jobs)
        if self._pool is None:
            for i, job in enumerate(jobs):
                outs[i] = self._finish(job, self._run_here(job), overall, on_done)
        else:
            outs = self._run_pool(jobs, overall, on_done)
        self.progress.remove_task(overall)
        return outs

    def _run_here(self, job: Job) -> dict:
        before = set(self.progress.task_ids)
        out = self.ctx.run(job, self.progress)
        for task in set(self.progress.task_ids) - before:
            self.progress.remove_task(task)
        return out

    def _run_pool(self, jobs: Sequence[Job], overall, on_done) -> list[dict]:
        from concurrent.futures import as_completed

        tasks: dict[int, object] = {}
        stop = threading.Event()
        relay = threading.Thread(target=self._relay, args=(tasks, stop), daemon=True)
        relay.start()
        try:
            futures = {self._pool.submit(_run_in_worker, job, self._queue, i): i for i, job in enumerate(jobs)}
            outs: list[dict | None] = [None] * len(jobs)
            for fut in as_completed(futures):
                i = futures[fut]
                outs[i] = self._finish(jobs[i], fut.result(), overall, on_done)
            return outs
        finally:
            stop.set()
            relay.join()

    def _relay(self, tasks: dict, stop: threading.Event) -> None:
        """Forward the pool's progress messages to the bars (this thread alone touches ``tasks``)."""
        while not stop.is_set():
            try:
                kind, job_id, a, b = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "add":
                tasks[job_id] = self.progress.add_task(a, total=b)
            elif kind == "update" and job_id in tasks:
                self.progress.update(tasks[job_id], advance=a, description=b)
            elif kind == "done" and job_id in tasks:
                self.progress.remove_task(tasks.pop(job_id))

    def _finish(self, job: Job, out: dict, overall, on_done) -> dict:
        self.progress.update(overall, advance=1)
        r = out["run"]
        self.progress.console.print(f"{job.label:<40} final {job.split} loss {r['final_eval_loss']:.4f}  "
                                    f"{r['wall_seconds']:.0f} s")
        on_done(job, out)
        return out


# ---- the benchmark ---------------------------------------------------------------------------------

def run_convergence(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    # lazy, as torch above: locoswarm.node.model imports it (~1 s, measured); this module does not
    from locoswarm.node.model import resolve_device

    if args.render_only:
        return render_existing(Path(args.out))
    prof = _profile(args)
    methods = _methods(args.methods)
    _check_counts(args)
    fixed = parse_fixed(args.fix, methods)
    source = _settings_from(args.settings_from, methods)
    grids = parse_grids(args.grid)
    cfg = base_config(args, prof)
    # the report states the batch, sequence and inner schedule the runs used (the user's where set)
    prof = replace(prof, batch_size=cfg.inner.batch_size, seq_len=cfg.inner.seq_len, lr=cfg.inner.lr,
                   warmup=cfg.inner.warmup)
    device = str(resolve_device(args.device))
    console = Console(stderr=True)

    with console.status("loading data"):
        ctx = BenchContext.load(cfg, data_paths(args), prof, device, args.tune_fraction)
    given = {m: {**source["settings"].get(m, {}), **fixed[m]} for m in methods}  # --fix wins over the source
    for method in methods:  # every fixed and swept value must make a valid config (one line, before any run)
        ctx.method_config(method, given[method])
        for knob in _knobs(ctx, method):
            for value in grids[knob]:
                ctx.method_config(method, {**given[method], knob: value})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seed, args.seed + args.seeds))
    corpus = ctx.corpus
    console.print(f"[bold]bench convergence[/] profile={prof.name} workers={prof.workers} steps={prof.steps} "
                  f"H={prof.h} F={prof.fragments} tau={prof.tau} device={device} seeds={seeds} "
                  f"tuned={not args.no_tune} jobs={args.jobs} threads={args.threads}\n[dim]{corpus.description}[/]")
    for warning in corpus.warnings:
        console.print(f"[yellow]data: {warning}[/]")
    setup = {"profile": asdict(prof), "model": asdict(cfg.model), "inner": asdict(cfg.inner),
             "data": corpus.description, "device": device, "seeds": seeds, "methods": methods,
             "tuned": not args.no_tune or bool(source["settings"]), "tune_steps": prof.tune_steps,
             "grids": {k: list(v) for k, v in grids.items()}, "search": SEARCH,
             "settings_from": source["report"], "swept_here": not args.no_tune,
             "tune_split": f"{corpus.n_tune_docs} training documents, {len(corpus.tune):,} tokens, "
                           f"--tune-fraction {args.tune_fraction}",
             "fixed": fixed, "fixed_target": args.target, "jobs": args.jobs, "threads": args.threads,
             "commit": _commit()}
    doc = {"setup": setup, "methods": {}, "tuning": dict(source["tuning"]), "phases": {}, "wall_seconds": 0.0}
    started = time.perf_counter()
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    torch.set_num_threads(args.threads)
    with Progress(*columns, console=console) as progress, Runner(ctx, args.jobs, args.threads, progress) as runner:
        def save(*_: object) -> None:
            # Keep what is done so far on disk: a long run interrupted late still leaves a report.
            doc["wall_seconds"] = time.perf_counter() - started
            write_report(out, doc)

        sweeps = {m: _sweep(ctx, m, given[m], grids) for m in methods}
        if not args.no_tune:
            _tune(ctx, runner, sweeps, seeds[0], doc, save)
        chosen = {m: {**given[m], **s.best()} for m, s in sweeps.items()}  # untuned: the presets and fixes
        _evaluate(runner, methods, chosen, seeds, prof.steps, doc, save)
    doc["wall_seconds"] = time.perf_counter() - started
    report = write_report(out, doc)
    Console().print(report["table_md"])
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'loss.png'} "
                  f"in {doc['wall_seconds'] / 60:.1f} min")
    return 0


def _knobs(ctx: BenchContext, method: str) -> tuple[str, ...]:
    return tuned_settings(method, ctx.method_config(method, {}))


def _sweep(ctx: BenchContext, method: str, fixed: Settings, grids: dict[str, tuple[float, ...]]) -> Sweep:
    """The method's sweep: its tuned settings not fixed, starting from its preset values and the fixes."""
    knobs = _knobs(ctx, method)
    cfg = ctx.method_config(method, fixed)
    start = {k: float(getattr(cfg.outer, k)) for k in knobs}
    return Sweep(method, tuple(k for k in knobs if k not in fixed), grids, start)


def _tune(ctx: BenchContext, runner: Runner, sweeps: dict[str, Sweep], seed: int, doc: dict, save) -> None:
    """Run every method's sweep on the tuning split (``sweeps[m].best()`` is then its choice)."""
    started = time.perf_counter()

    def evaluate(batch: list[tuple[Sweep, Settings]]) -> list[float]:
        jobs = [Job(s.method, settings, seed, ctx.profile.tune_steps, "tune") for s, settings in batch]
        outs = runner.run(jobs, f"tuning ({len(jobs)} runs)", lambda *_: None)
        return [o["run"]["final_eval_loss"] for o in outs]

    def after_stage() -> None:
        doc["tuning"].update({m: s.to_dict() for m, s in sweeps.items() if s.trials})
        doc["phases"]["tuning"] = {"runs": sum(len(s.trials) for s in sweeps.values()),
                                   "seconds": time.perf_counter() - started}
        save()

    run_sweeps(list(sweeps.values()), evaluate, after_stage)


def _evaluate(runner: Runner, methods: list[str], chosen: dict[str, Settings], seeds: list[int], steps: int,
              doc: dict, save) -> None:
    """Every method at its chosen settings, once per seed, on the eval split; the report grows as runs end."""
    started = time.perf_counter()
    jobs = [Job(m, chosen[m], s, steps, "eval") for s in seeds for m in methods]
    done: dict[str, dict] = {}

    def on_done(job: Job, out: dict) -> None:
        entry = done.setdefault(job.method, {"settings": dict(job.settings), "runs": [], **out["static"]})
        entry["runs"].append(out["run"])
        entry["runs"].sort(key=lambda r: r["seed"])
        doc["methods"] = {m: done[m] for m in methods if m in done}
        doc["phases"]["evaluation"] = {"runs": sum(len(e["runs"]) for e in done.values()),
                                       "seconds": time.perf_counter() - started}
        save()

    runner.run(jobs, f"evaluation ({len(jobs)} runs)", on_done)


def render_existing(out: Path) -> int:
    write_report(out, _read_results(out, "--render-only", f"run the benchmark with --out {out} first"))
    print(f"rendered {out / 'report.md'} and {out / 'loss.png'} from {out / 'results.json'}")
    return 0


def _read_results(directory: Path, flag: str, hint: str) -> dict:
    """An earlier report's results.json, in this format's shape (one line and exit 2 if it cannot be read)."""
    import json

    path = directory / "results.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{flag}: {path} does not exist; {hint}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag}: {path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return normalize(doc)


def _settings_from(directories: list[str], methods: list[str]) -> dict:
    """``--settings-from DIR`` (repeatable): the settings each method of ``methods`` was run at in the first of
    those tuned reports that ran it, that report's tuning trials for it, and where they came from (per report:
    its tune steps, search, tuning split and the settings it gave)."""
    settings: dict[str, dict[str, float]] = {}
    tuning: dict[str, dict] = {}
    reports = []
    for directory in directories:
        doc = _read_results(Path(directory), "--settings-from", "give the directory of a tuned report")
        setup = doc["setup"]
        if not setup.get("tuned"):
            raise UserError(f"--settings-from {directory}: that run was not tuned (--no-tune); give a tuned report")
        given = {m: {k: float(v) for k, v in doc["methods"][m].get("settings", {}).items() if k in DEFAULT_GRIDS}
                 for m in methods if m in doc["methods"] and m not in settings}
        settings.update(given)
        tuning.update({m: doc["tuning"][m] for m in given if m in doc["tuning"]})
        reports.append({"dir": str(directory), "tune_steps": setup.get("tune_steps"), "search": setup.get("search"),
                        "tune_split": setup.get("tune_split"), "commit": setup.get("commit", ""),
                        "settings": given})
    return {"settings": settings, "tuning": tuning, "report": reports or None}


def _commit() -> str:
    """The commit the benchmark ran at (with '+dirty' for local changes), or '' outside a git checkout."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head}+dirty" if head and dirty else head
