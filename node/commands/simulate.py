"""``locoswarm simulate``: M workers in one process on the outer core (``locoswarm.node.sim``)."""

from __future__ import annotations

import argparse
import json

from locoswarm.node.commands import add_config_args, add_data_args, data_paths, load_config_from_args
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text
from locoswarm.node.sim.methods import METHODS, method_config


def parse_speeds(text: str | None, workers: int) -> list[float] | None:
    if not text:
        return None
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--speeds {text!r} is not a comma-separated list of numbers, e.g. 1,1,0.33") from None
    return speeds


def register(sub: argparse._SubParsersAction) -> None:

    p = sub.add_parser("simulate", help="run M workers in one process on the outer-loop core",
                       description="Simulate a swarm in one process: M workers, the same outer core, "
                                   "the in-process transport.")
    add_config_args(p)
    add_data_args(p)
    p.add_argument("--workers", type=int, default=4, help="number of simulated workers (default 4)")
    p.add_argument("--steps", type=int, default=200, help="swarm clock steps (default 200)")
    p.add_argument("--method", default=None, metavar="METHOD",
                   help=f"apply a benchmark method preset: {', '.join(METHODS)} (default: the config's "
                        "[outer] settings)")
    p.add_argument("--speeds", default=None, help="relative worker speeds in (0,1], e.g. 1,1,1,0.33")
    p.add_argument("--drop-prob", type=float, default=0.0, help="probability a worker's sync is dropped")
    p.add_argument("--eval-every", type=int, default=25, help="evaluate every N steps (default 25)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the run's randomness: which syncs --drop-prob drops, torch's global RNG (data "
                        "sampling follows data.seed) (default 0)")
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write the result as JSON")
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Table

    # lazy: locoswarm.node.data, .model and .sim.simulator import torch (~1 s, measured); this module does not
    from locoswarm.node.data import load_corpus, load_tokenizer
    from locoswarm.node.model import resolve_device
    from locoswarm.node.sim.simulator import SimSpec, check_spec, simulate, simulate_dp

    cfg = load_config_from_args(args)
    if args.method is not None and args.method not in METHODS:
        raise UserError(f"--method {args.method!r} is not known; choose one of {', '.join(METHODS)}")
    if args.eval_every < 1:
        raise UserError(f"--eval-every {args.eval_every} must be >= 1")
    device = resolve_device(args.device)
    spec = SimSpec(workers=args.workers, steps=args.steps, eval_every=args.eval_every,
                   eval_batches=args.eval_batches, speeds=parse_speeds(args.speeds, args.workers),
                   drop_prob=args.drop_prob, seed=args.seed, device=str(device))
    check_spec(spec)  # before loading data: a bad flag fails at once
    console = Console(stderr=True)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    with console.status("loading data"):
        corpus = load_corpus(data_paths(args), cfg.data, tokenizer)
    console.print(f"[dim]{corpus.description}[/]")
    for warning in corpus.warnings:
        console.print(f"[yellow]data: {warning}[/]")
    label = args.method or cfg.outer.method
    if args.method is not None:
        cfg = method_config(cfg, args.method, cfg.outer.tau)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        run = simulate_dp if args.method == "dp" else simulate
        result = run(cfg, corpus, tokenizer.vocab_size, spec, label=label, progress=progress)
    table = Table(title=f"simulate: {label}, {spec.workers} workers, {spec.steps} steps")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("eval loss (start -> end)", f"{result.eval_curve[0][1]:.4f} -> {result.final_eval_loss:.4f}"),
        ("bytes sent per worker", f"{result.bytes_sent_per_worker:,.0f}"),
        ("bytes per worker per step", f"{result.bytes_per_worker_per_step:,.0f}"),
        ("peak bytes per sync", f"{result.peak_bytes_per_sync:,}"),
        ("syncs ok / failed", f"{result.syncs_ok} / {result.syncs_failed}"),
        ("catch-ups", str(result.catch_ups)),
        ("inner steps per worker", ", ".join(map(str, result.inner_steps))),
        ("phi spread (rel. L2)", f"{result.extra.get('spread', 0.0):.2e}"),
        ("wall time", f"{result.wall_seconds:.1f} s"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    if args.json_out:
        atomic_write_text(args.json_out, json.dumps(asdict(result), indent=1))
    return 0
