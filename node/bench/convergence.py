"""``locoswarm bench convergence``: every method side by side on the same data, seed and steps.

Methods (``node.sim.methods``): dp, diloco, streaming, streaming-fp4, delayed, eager,
streaming-overlap, cocodc, locoswarm. Each runs the in-process simulator with the same model,
data shards, inner optimizer and number of inner steps. The report compares final held-out eval loss,
steps to reach streaming-overlap's final loss, bytes per worker per inner step and peak bytes per
sync, relative to dp and diloco, and checks the papers' claims against the numbers measured.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from node.errors import UserError
from node.helptext import describe

ALL_METHODS = ("dp", "diloco", "streaming", "streaming-fp4", "delayed", "naive-delay", "eager",
               "streaming-overlap", "cocodc", "locoswarm", "diloco-x")
TARGET_METHOD = "streaming-overlap"


@dataclass(frozen=True)
class Profile:
    """A benchmark size: model, swarm and schedule. ``quick`` fits 10 minutes on 2 CPU cores."""

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


PROFILES = {
    "quick": Profile("quick", {"preset": "tiny"}, workers=4, steps=240, h=30, fragments=2, tau=3,
                     batch_size=8, seq_len=64, lr=2e-3, warmup=30, eval_every=15, eval_batches=8),
    "default": Profile("default", {"preset": "tiny"},
                       workers=4, steps=800, h=40, fragments=2, tau=4,
                       batch_size=8, seq_len=128, lr=2e-3, warmup=50, eval_every=20, eval_batches=16),
}


def register(sub: argparse._SubParsersAction) -> None:
    from node.commands import add_config_args
    from node.sim import add_data_args

    p = sub.add_parser("convergence", help="all methods side by side on the same data, seed and steps",
                       description=describe(__doc__))
    add_config_args(p)
    add_data_args(p)
    p.add_argument("--out", required=True, help="report directory (results.json, report.md, loss.png)")
    p.add_argument("--quick", action="store_true", help="small profile: <= 10 minutes on 2 CPU cores")
    p.add_argument("--workers", type=int, default=None, help="workers M (default: the profile's)")
    p.add_argument("--steps", type=int, default=None, help="inner steps per worker (default: the profile's)")
    p.add_argument("--h", type=int, default=None, help="inner steps between syncs of a fragment")
    p.add_argument("--fragments", type=int, default=None, help="fragments F of the streaming methods")
    p.add_argument("--tau", type=int, default=None, help="overlap of the tau>0 methods")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help=f"comma-separated subset of {','.join(ALL_METHODS)}")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated runs (torch RNG, dropped syncs); data sampling follows data.seed "
                        "(default 0)")
    p.add_argument("--render-only", action="store_true",
                   help="re-render report.md and loss.png from an existing DIR/results.json")
    p.set_defaults(func=run_convergence)


def _profile(args: argparse.Namespace) -> Profile:
    base = PROFILES["quick" if args.quick else "default"]
    changes = {k: getattr(args, k) for k in ("workers", "steps", "h", "fragments", "tau")
               if getattr(args, k) is not None}
    for key, value in changes.items():
        if value < (0 if key == "tau" else 1):
            raise UserError(f"--{key} {value} is not allowed; it must be >= {0 if key == 'tau' else 1}")
    return Profile(**{**asdict(base), **changes})


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in ALL_METHODS]
    if bad or not names:
        raise UserError(f"--methods {text!r}: unknown method {bad[0] if bad else '(none)'}; "
                        f"choose from {','.join(ALL_METHODS)}")
    return names


def base_config(args: argparse.Namespace, prof: Profile):
    """The user's config (or defaults) with the profile's model, inner and schedule settings."""
    from node.commands import load_config_from_args
    from node.config import validate

    cfg = load_config_from_args(args)
    if not args.config and not args.overrides:
        for key, value in prof.model_overrides.items():
            setattr(cfg.model, key, value)
        cfg.inner.batch_size, cfg.inner.seq_len = prof.batch_size, prof.seq_len
        cfg.inner.lr, cfg.inner.warmup = prof.lr, prof.warmup
    cfg.outer.h, cfg.outer.fragments, cfg.outer.tau = prof.h, prof.fragments, 0
    cfg.outer.method = "replace"
    cfg.network.group_size = max(cfg.network.group_size, prof.workers)  # all-reduce, as in the papers
    if prof.tau > prof.h:
        raise UserError(f"--tau {prof.tau} must be <= --h {prof.h}")
    validate(cfg, source="bench")
    return cfg


def steps_to_target(curve: list[tuple[int, float]], target: float | None) -> int | None:
    if target is None:
        return None
    for step, loss in curve:
        if step > 0 and loss <= target:
            return step
    return None


def run_convergence(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from node.data import load_corpus, load_tokenizer
    from node.model import resolve_device
    from node.sim import data_paths
    from node.sim.methods import method_config
    from node.sim.simulator import SimSpec, simulate, simulate_dp

    if args.render_only:
        return render_existing(Path(args.out))
    prof = _profile(args)
    methods = _methods(args.methods)
    cfg = base_config(args, prof)
    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    with console.status("loading data"):
        corpus = load_corpus(data_paths(args), cfg.data, tokenizer)
    console.print(f"[bold]bench convergence[/] profile={prof.name} workers={prof.workers} steps={prof.steps} "
                  f"H={prof.h} F={prof.fragments} tau={prof.tau} device={device}\n[dim]{corpus.description}[/]")
    for warning in corpus.warnings:
        console.print(f"[yellow]data: {warning}[/]")
    spec = SimSpec(workers=prof.workers, steps=prof.steps, eval_every=prof.eval_every,
                   eval_batches=prof.eval_batches, seed=args.seed, device=str(device))
    results: dict[str, dict] = {}
    setup = {"profile": asdict(prof), "model": asdict(cfg.model), "inner": asdict(cfg.inner),
             "data": corpus.description, "device": str(device), "seed": args.seed, "methods": methods}
    started = time.perf_counter()
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        overall = progress.add_task("all methods", total=len(methods))
        for name in methods:
            mcfg = method_config(cfg, name, prof.tau)
            run = simulate_dp if name == "dp" else simulate
            res = run(mcfg, corpus, tokenizer.vocab_size, spec, label=name, progress=progress)
            results[name] = _method_entry(res, mcfg, name)
            progress.update(overall, advance=1)
            progress.console.print(f"{name:<18} final eval loss {res.final_eval_loss:.4f}  "
                                   f"{_bytes(res.bytes_per_worker_per_step)}/worker/step  "
                                   f"syncs ok {res.syncs_ok} failed {res.syncs_failed}  {res.wall_seconds:.0f} s")
            # Keep what is done so far on disk: a long run interrupted late still leaves a report.
            write_report(out, setup, results, time.perf_counter() - started)
    report = write_report(out, setup, results, time.perf_counter() - started)
    Console().print(report["table_md"])
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'loss.png'}")
    return 0


def render_existing(out: Path) -> int:
    path = out / "results.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--render-only: {path} does not exist; run the benchmark with --out {out} first") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--render-only: {path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    write_report(out, doc["setup"], doc["methods"], doc.get("wall_seconds", 0.0))
    print(f"rendered {out / 'report.md'} and {out / 'loss.png'} from {path}")
    return 0


def _method_entry(res, cfg, name: str) -> dict:
    from node.core.compress import wire_codec

    entry = {
        "final_eval_loss": res.final_eval_loss,
        "eval_curve": [[s, v] for s, v in res.eval_curve],
        "bytes_per_worker_per_step": res.bytes_per_worker_per_step,
        "peak_bytes_per_sync": res.peak_bytes_per_sync,
        "bytes_sent_per_worker": res.bytes_sent_per_worker,
        "syncs_ok": res.syncs_ok, "syncs_failed": res.syncs_failed,
        "phi_spread": res.extra.get("spread", 0.0),
        "wall_seconds": res.wall_seconds, "n_params": res.n_params,
    }
    if name != "dp":
        codec = wire_codec(cfg.outer)  # lowrank: its factors' block codec (its bytes are measured)
        entry["outer"] = asdict(cfg.outer)
        entry["codec_bits_per_element"] = codec.bits_per_element(res.n_params)
    return entry


def write_report(out: Path, setup: dict, results: dict[str, dict], wall: float) -> dict:
    """Fill in steps-to-target and the claims, and write results.json, report.md and loss.png."""
    from node.fsutil import atomic_write_text

    target = results.get(TARGET_METHOD, {}).get("final_eval_loss")
    for entry in results.values():
        entry["steps_to_target"] = steps_to_target([tuple(p) for p in entry["eval_curve"]], target)
    claims = check_claims(results, setup)
    doc = {"setup": setup, "target": {"method": TARGET_METHOD, "eval_loss": target},
           "methods": results, "claims": claims, "wall_seconds": wall}
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1))
    table = markdown_table(results)
    atomic_write_text(out / "report.md", render_markdown(setup, results, claims, table, wall))
    plot(out / "loss.png", results, setup)
    return {"table_md": table, **doc}


def _rel(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"{100 * (a - b) / b:+.2f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def markdown_table(results: dict[str, dict]) -> str:
    dp, dl = results.get("dp"), results.get("diloco")
    rows = ["| method | final eval loss | vs dp | vs diloco | steps to target | bytes/worker/step | "
            "x fewer than dp | peak bytes/sync | peak vs diloco |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        fewer = (f"{dp['bytes_per_worker_per_step'] / r['bytes_per_worker_per_step']:.1f}x"
                 if dp and r["bytes_per_worker_per_step"] else "-")
        peak = (f"{r['peak_bytes_per_sync'] / dl['peak_bytes_per_sync']:.3f}"
                if dl and dl["peak_bytes_per_sync"] else "-")
        rows.append(f"| {name} | {r['final_eval_loss']:.4f} | "
                    f"{_rel(r['final_eval_loss'], dp and dp['final_eval_loss'])} | "
                    f"{_rel(r['final_eval_loss'], dl and dl['final_eval_loss'])} | "
                    f"{r.get('steps_to_target') if r.get('steps_to_target') is not None else 'not reached'} | "
                    f"{_bytes(r['bytes_per_worker_per_step'])} | {fewer} | "
                    f"{_bytes(r['peak_bytes_per_sync'])} | {peak} |")
    return "\n".join(rows)


def _loss(results: dict, name: str) -> float | None:
    return results.get(name, {}).get("final_eval_loss")


def check_claims(results: dict[str, dict], setup: dict) -> list[dict]:
    """Each paper claim with the measured numbers and a verdict computed from them."""
    claims = []

    def rel(a: str, b: str) -> float | None:
        la, lb = _loss(results, a), _loss(results, b)
        return None if la is None or lb is None else (la - lb) / lb

    def add(claim: str, paper: str, measured: str, holds: bool | None) -> None:
        verdict = "n/a" if holds is None else ("reproduced" if holds else "NOT reproduced")
        claims.append({"claim": claim, "paper": paper, "measured": measured, "verdict": verdict})

    tol = 0.01  # "no loss": within 1% of the final eval loss
    r = rel("streaming", "diloco")
    add("streaming vs diloco", "same loss", f"{r:+.2%}" if r is not None else "-",
        None if r is None else r <= tol)
    r = rel("streaming-fp4", "streaming")
    add("fp4 vs fp32 (streaming)", "no measurable loss", f"{r:+.2%}" if r is not None else "-",
        None if r is None else r <= tol)
    re_, rd = rel("eager", "diloco"), rel("naive-delay", "diloco")
    add("eager vs diloco", "within about 1% (2.69 vs 2.67)", f"{re_:+.2%}" if re_ is not None else "-",
        None if re_ is None else re_ <= tol)
    add("naive delay vs eager", "delay clearly worse (3.01 vs 2.69)",
        f"naive delay {rd:+.2%}, eager {re_:+.2%} vs diloco" if None not in (rd, re_) else "-",
        None if None in (rd, re_) else rd > re_ + tol / 2)
    sc = results.get("cocodc", {}).get("steps_to_target")
    so = results.get(TARGET_METHOD, {}).get("steps_to_target")
    if sc is not None and so:
        add("cocodc vs streaming-overlap steps to target", "21.0% fewer steps",
            f"{sc} vs {so} steps: {100 * (so - sc) / so:.1f}% fewer", sc < so)
    elif "cocodc" in results and so:
        add("cocodc vs streaming-overlap steps to target", "21.0% fewer steps",
            f"cocodc did not reach the target within {setup['profile']['steps']} steps", False)
    dp, dl = results.get("dp"), results.get("diloco")
    if dp and dl and dl["bytes_per_worker_per_step"]:
        h = setup["profile"]["h"]
        bits = dl.get("codec_bits_per_element", 32.0)
        ratio = dp["bytes_per_worker_per_step"] / dl["bytes_per_worker_per_step"]
        bound = 32 * h / bits
        add("diloco bytes per inner step vs fp32 dp", f">= 32*H/b = {32 * h / 32:.0f}x (b=32)",
            f"{ratio:.3f}x (b = {bits:.3f} codec bits/element incl. block scales: bound {bound:.2f}x; "
            f"protocol headers add {100 * (1 - ratio / bound if bound else 0):.4f}%)",
            ratio >= bound * (1 - 1e-3))
    st = results.get("streaming")
    if st and dl and dl["peak_bytes_per_sync"]:
        f = setup["profile"]["fragments"]
        ratio = st["peak_bytes_per_sync"] / dl["peak_bytes_per_sync"]
        add("streaming peak bytes per sync vs diloco", f"1/F = {1 / f:.3f}",
            f"{ratio:.3f} (largest fragment / whole model)", abs(ratio - 1 / f) <= 0.25 / f)
    return claims


def render_markdown(setup: dict, results: dict, claims: list[dict], table: str, wall: float) -> str:
    prof = setup["profile"]
    lines = [
        "# Convergence benchmark", "",
        f"Profile `{prof['name']}`: {prof['workers']} workers, {prof['steps']} inner steps each, "
        f"H={prof['h']}, F={prof['fragments']}, tau={prof['tau']} (overlap methods), "
        f"batch {prof['batch_size']} x {prof['seq_len']} tokens per worker step, inner AdamW lr {prof['lr']}. "
        f"Device {setup['device']}, seed {setup['seed']}, wall time {wall / 60:.1f} min.",
        f"Model: {next(iter(results.values()))['n_params']:,} parameters ({setup['model']['arch']}). "
        f"Data: {setup['data']}.", "",
        f"Target for *steps to target*: the final eval loss of `{TARGET_METHOD}`. Evaluation every "
        f"{prof['eval_every']} steps on {prof['eval_batches']} held-out batches, with worker 0's live "
        "parameters. Bytes: what a worker sends (reduce-scatter + all-gather of codec bytes, plus "
        "small headers); dp = ring all-reduce of fp32 gradients every step.", "",
        table, "", "## Claims of the papers, checked", "",
        "| claim | paper | measured | verdict |", "|---|---|---|---|",
    ]
    lines += [f"| {c['claim']} | {c['paper']} | {c['measured']} | {c['verdict']} |" for c in claims]
    lines += ["", "## Methods as run", "",
              "| method | merge | F | H | tau | codec | error feedback | schedule |",
              "|---|---|---:|---:|---:|---|---|---|"]
    for name, r in results.items():
        o = r.get("outer")
        if o is None:
            lines.append(f"| {name} | gradients averaged every step | - | 1 | 0 | fp32 | - | - |")
        else:
            merge = f"alpha {o['alpha']}" if o["method"] == "alpha" else (
                f"compensate lambda0 {o['lambda0']}" if o["method"] == "compensate" else o["method"])
            lines.append(f"| {name} | {merge} | {o['fragments']} | {o['h']} | {o['tau']} | {o['codec']} | "
                         f"{'yes' if o['error_feedback'] else 'no'} | {o['schedule']} |")
    lines += ["", "![eval loss](loss.png)", ""]
    return "\n".join(lines)


def plot(path: Path, results: dict[str, dict], setup: dict) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from node.fsutil import atomic_write_bytes

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    for name, r in results.items():
        steps = [p[0] for p in r["eval_curve"]]
        losses = [p[1] for p in r["eval_curve"]]
        ax.plot(steps, losses, label=name, lw=2 if name in ("dp", "diloco", "locoswarm") else 1.2)
    all_losses = [p[1] for r in results.values() for p in r["eval_curve"] if math.isfinite(p[1])]
    if all_losses:
        finals = [r["final_eval_loss"] for r in results.values()]
        ax.set_ylim(min(all_losses) - 0.05, max(finals) + 0.6 * (max(all_losses) - max(finals)) * 0.25 + 0.3)
    ax.set_xlabel("inner step")
    ax.set_ylabel("held-out eval loss (nats/token)")
    ax.set_title(f"eval loss, {setup['profile']['workers']} workers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = list(results)
    bx.barh(names, [results[n]["bytes_per_worker_per_step"] for n in names], color="tab:gray")
    bx.set_xscale("log")
    bx.set_xlabel("bytes sent per worker per inner step (log)")
    bx.invert_yaxis()
    bx.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
