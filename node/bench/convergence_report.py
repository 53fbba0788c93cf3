"""The convergence benchmark's report: seeds aggregated, steps to target, the papers' claims checked,
written as results.json, report.md and loss.png (``locoswarm.node.bench.convergence`` runs the methods).

Every method ran once per seed; its row shows the mean final eval loss over the seeds with their spread
(min..max and the sample standard deviation), and the claims are judged on those means, with the spread
quoted next to them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from locoswarm.node.bench import write_png
from locoswarm.node.fsutil import atomic_write_text

FORMAT = 2
TARGET_METHOD = "diloco"               # the default target of steps-to-target: DiLoCo's mean final eval loss
OVERLAP_METHOD = "streaming-overlap"   # CoCoDC's claim is against it, at its own final loss
NO_LOSS = 0.01                         # "no loss" in the papers' sense: within 1% of the final eval loss
SEARCH = "outer lr, then momentum, then alpha or lambda0, then the lr once more"  # locoswarm.node.bench.tuning.Sweep
EAGER_TOLERANCE = 0.03                 # the acceptance: eager within 3% of DiLoCo
DILOCO_X_TOLERANCE = 0.02              # ... and diloco-x within 2%


# ---- aggregation -----------------------------------------------------------------------------------

def steps_to_target(curve: list[tuple[int, float]], target: float | None) -> int | None:
    """The first evaluated step (> 0) whose eval loss is at or below ``target``; None if never."""
    if target is None:
        return None
    for step, loss in curve:
        if step > 0 and loss <= target:
            return step
    return None


def mean_curve(runs: list[dict]) -> list[list[float]]:
    """The eval curve averaged over the runs, at the steps all of them evaluated."""
    common = set.intersection(*({int(s) for s, _ in r["eval_curve"]} for r in runs)) if runs else set()
    by_step = [{int(s): v for s, v in r["eval_curve"]} for r in runs]
    return [[s, sum(c[s] for c in by_step) / len(by_step)] for s in sorted(common)]


def summarize(entry: dict, target: float | None) -> None:
    """Fill ``entry``'s aggregates from its ``runs``: mean, std, min and max final eval loss, the mean curve,
    and steps to ``target`` per run and on average over the runs that reached it."""
    runs = entry["runs"]
    finals = [float(r["final_eval_loss"]) for r in runs]
    entry["final_eval_loss"] = sum(finals) / len(finals)
    entry["final_std"] = statistics.stdev(finals) if len(finals) >= 2 else 0.0
    entry["final_min"], entry["final_max"] = min(finals), max(finals)
    entry["eval_curve"] = mean_curve(runs)
    for r in runs:
        r["steps_to_target"] = steps_to_target([tuple(p) for p in r["eval_curve"]], target)
    reached = [r["steps_to_target"] for r in runs if r["steps_to_target"] is not None]
    entry["reached"] = len(reached)
    entry["steps_to_target"] = sum(reached) / len(reached) if reached else None


def normalize(doc: dict) -> dict:
    """A results.json of the first format (one run per method, no tuning) in this format's shape; one of
    this format from before a setting was recorded gets what it ran with."""
    if doc.get("format") == FORMAT:
        # a run from before the sweep's second lr pass says so (setup["search"] is recorded since)
        doc["setup"].setdefault("search", "outer lr, then momentum, then alpha or lambda0")
        return doc
    setup = doc["setup"]
    seed = setup.get("seed", 0)
    setup.setdefault("seeds", [seed])
    setup.setdefault("tuned", False)
    for entry in doc["methods"].values():
        entry.setdefault("runs", [{"seed": seed, "final_eval_loss": entry["final_eval_loss"],
                                   "eval_curve": entry["eval_curve"], "wall_seconds": entry.get("wall_seconds", 0.0)}])
        entry.setdefault("settings", {k: entry["outer"][k] for k in ("lr",) if "outer" in entry})
    doc.setdefault("tuning", {})
    doc.setdefault("target", {})
    doc["format"] = FORMAT
    return doc


def default_target(results: dict[str, dict], fixed: float | None) -> dict:
    """The target of steps-to-target: ``fixed`` when given, else DiLoCo's mean final eval loss."""
    if fixed is not None:
        return {"rule": "fixed", "eval_loss": fixed}
    entry = results.get(TARGET_METHOD)
    if entry is None or not entry.get("runs"):
        return {"rule": f"{TARGET_METHOD} not run: no target", "eval_loss": None}
    finals = [float(r["final_eval_loss"]) for r in entry["runs"]]
    return {"rule": f"{TARGET_METHOD}'s mean final eval loss", "eval_loss": sum(finals) / len(finals)}


# ---- claims ------------------------------------------------------------------------------------------

class _Claims:
    """The claims table under construction: each claim with the numbers measured and its verdict."""

    def __init__(self, results: dict[str, dict]) -> None:
        self.results = results
        self.rows: list[dict] = []

    def add(self, claim: str, paper: str, measured: str, holds: bool | None, missing: list[str] | None = None) -> None:
        if missing:
            verdict = f"n/a ({', '.join(missing)} not run)"
        else:
            verdict = "n/a" if holds is None else ("reproduced" if holds else "NOT reproduced")
        self.rows.append({"claim": claim, "paper": paper, "measured": measured, "verdict": verdict})

    def missing(self, *names: str) -> list[str]:
        return [n for n in names if n not in self.results]

    def loss(self, name: str) -> float:
        return float(self.results[name]["final_eval_loss"])

    def rel(self, a: str, b: str) -> float:
        return (self.loss(a) - self.loss(b)) / self.loss(b)

    def show(self, name: str) -> str:
        """``name 2.4512 (2.4400..2.4624)``: the mean with the seeds' range."""
        e = self.results[name]
        spread = (f" ({e['final_min']:.4f}..{e['final_max']:.4f})"
                  if "final_min" in e and len(e.get("runs", [])) > 1 else "")
        return f"{name} {self.loss(name):.4f}{spread}"

    def versus(self, a: str, b: str, paper: str, claim: str, holds) -> None:
        """A claim on ``a``'s mean loss relative to ``b``'s; ``holds(rel)`` judges it."""
        missing = self.missing(a, b)
        if missing:
            self.add(claim, paper, "-", None, missing)
            return
        r = self.rel(a, b)
        self.add(claim, paper, f"{self.show(a)} vs {self.show(b)}: {r:+.2%}", holds(r))


def check_claims(results: dict[str, dict], setup: dict) -> list[dict]:
    """Each paper claim (and the issue's acceptance) with the measured numbers and a verdict computed
    from them; a claim on a method that was not run is ``n/a``."""
    c = _Claims(results)
    c.versus("streaming", "diloco", "same loss", "streaming vs diloco", lambda r: r <= NO_LOSS)
    c.versus("streaming-fp4", "streaming", "no measurable loss", "fp4 vs fp32 (streaming)", lambda r: r <= NO_LOSS)
    c.versus("eager", "diloco", "2.69 vs 2.67 (500M, H=30); acceptance: within 3%", "eager vs diloco",
             lambda r: r <= EAGER_TOLERANCE)
    c.versus("eager", "naive-delay", "naive delay 3.01 (2.73 at a lower outer lr), eager 2.69",
             "eager better than naive delay", lambda r: r < 0)
    _diloco_x_claim(c)
    c.versus("locoswarm", "diloco", "acceptance: <= diloco", "recommended stack (locoswarm) vs diloco",
             lambda r: r <= 0)
    _cocodc_claim(c, setup)
    _bytes_claims(c, setup)
    return c.rows


def _diloco_x_claim(c: _Claims) -> None:
    claim, paper = "diloco-x vs diloco, bytes vs fp4", "acceptance: within 2% of diloco at fewer bytes than fp4"
    missing = c.missing("diloco-x", "diloco", "streaming-fp4")
    if missing:
        c.add(claim, paper, "-", None, missing)
        return
    r = c.rel("diloco-x", "diloco")
    bx = c.results["diloco-x"]["bytes_per_worker_per_step"]
    b4 = c.results["streaming-fp4"]["bytes_per_worker_per_step"]
    c.add(claim, paper, f"{c.show('diloco-x')} vs {c.show('diloco')}: {r:+.2%}; {_bytes(bx)} vs fp4 "
          f"{_bytes(b4)} per worker per step ({bx / b4:.2f}x)", r <= DILOCO_X_TOLERANCE and bx < b4)


def _cocodc_claim(c: _Claims, setup: dict) -> None:
    claim, paper = "cocodc vs streaming-overlap steps to target", "21.0% fewer steps"
    missing = c.missing("cocodc", OVERLAP_METHOD)
    if missing:
        c.add(claim, paper, "-", None, missing)
        return
    target = c.loss(OVERLAP_METHOD)
    steps = {}
    for name in ("cocodc", OVERLAP_METHOD):
        reached = [steps_to_target([tuple(p) for p in r["eval_curve"]], target) for r in c.results[name]["runs"]]
        steps[name] = None if None in reached else sum(reached) / len(reached)
    sc, so = steps["cocodc"], steps[OVERLAP_METHOD]
    if sc is None or not so:
        c.add(claim, paper, f"target {target:.4f} ({OVERLAP_METHOD}'s mean final loss): cocodc did not reach it "
              f"in every seed within {setup['profile']['steps']} steps", False)
        return
    c.add(claim, paper, f"{sc:.0f} vs {so:.0f} steps to {target:.4f}: {100 * (so - sc) / so:.1f}% fewer", sc < so)


def _bytes_claims(c: _Claims, setup: dict) -> None:
    dp, dl, st = (c.results.get(n) for n in ("dp", "diloco", "streaming"))
    if dp and dl and dl["bytes_per_worker_per_step"]:
        h = setup["profile"]["h"]
        bits = dl.get("codec_bits_per_element", 32.0)
        ratio = dp["bytes_per_worker_per_step"] / dl["bytes_per_worker_per_step"]
        bound = 32 * h / bits
        c.add("diloco bytes per inner step vs fp32 dp", f">= 32*H/b = {32 * h / 32:.0f}x (b=32)",
              f"{ratio:.3f}x (b = {bits:.3f} codec bits/element incl. block scales: bound {bound:.2f}x; "
              f"protocol headers add {100 * (1 - ratio / bound if bound else 0):.4f}%)", ratio >= bound * (1 - 1e-3))
    if st and dl and dl["peak_bytes_per_sync"]:
        f = setup["profile"]["fragments"]
        ratio = st["peak_bytes_per_sync"] / dl["peak_bytes_per_sync"]
        c.add("streaming peak bytes per sync vs diloco", f"1/F = {1 / f:.3f}",
              f"{ratio:.3f} (largest fragment / whole model)", abs(ratio - 1 / f) <= 0.25 / f)


# ---- writing -----------------------------------------------------------------------------------------

def write_report(out: Path, doc: dict) -> dict:
    """Aggregate ``doc['methods']``' runs, check the claims, and write results.json, report.md and loss.png.
    ``doc`` holds ``setup``, ``methods`` (each with its ``runs``), ``tuning`` and ``wall_seconds``."""
    results = doc["methods"]
    doc["target"] = default_target(results, doc["setup"].get("fixed_target"))
    for entry in results.values():
        summarize(entry, doc["target"]["eval_loss"])
    doc["claims"] = check_claims(results, doc["setup"])
    doc["format"] = FORMAT
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1))
    table = markdown_table(results)
    atomic_write_text(out / "report.md", render_markdown(doc, table))
    if results:
        plot(out / "loss.png", results, doc["setup"])
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


def _settings(entry: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in (entry.get("settings") or {}).items()) or "-"


def _steps(entry: dict) -> str:
    n = len(entry.get("runs", [])) or 1
    if entry.get("steps_to_target") is None:
        return "not reached"
    return f"{entry['steps_to_target']:.0f}" + (f" ({entry['reached']}/{n})" if n > 1 else "")


def markdown_table(results: dict[str, dict]) -> str:
    dp, dl = results.get("dp"), results.get("diloco")
    rows = ["| method | settings | final eval loss | seeds min..max | std | vs dp | vs diloco | steps to target | "
            "bytes/worker/step | x fewer than dp | peak bytes/sync | peak vs diloco |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        fewer = (f"{dp['bytes_per_worker_per_step'] / r['bytes_per_worker_per_step']:.1f}x"
                 if dp and r["bytes_per_worker_per_step"] else "-")
        peak = (f"{r['peak_bytes_per_sync'] / dl['peak_bytes_per_sync']:.3f}"
                if dl and dl["peak_bytes_per_sync"] else "-")
        rows.append(f"| {name} | {_settings(r)} | {r['final_eval_loss']:.4f} | "
                    f"{r['final_min']:.4f}..{r['final_max']:.4f} | {r['final_std']:.4f} | "
                    f"{_rel(r['final_eval_loss'], dp and dp['final_eval_loss'])} | "
                    f"{_rel(r['final_eval_loss'], dl and dl['final_eval_loss'])} | {_steps(r)} | "
                    f"{_bytes(r['bytes_per_worker_per_step'])} | {fewer} | "
                    f"{_bytes(r['peak_bytes_per_sync'])} | {peak} |")
    return "\n".join(rows)


def tuning_table(tuning: dict[str, dict]) -> list[str]:
    """One row per trial of each method's sweep; the chosen settings in bold."""
    lines = ["| method | settings tried | final tuning loss | chosen |", "|---|---|---:|---|"]
    for name, sweep in tuning.items():
        chosen = sweep["chosen"]
        for t in sweep["trials"]:
            mark = "**chosen**" if t["settings"] == chosen else ""
            loss = f"{t['tune_loss']:.4f}" if math.isfinite(t["tune_loss"]) else "diverged"
            lines.append(f"| {name} | {', '.join(f'{k} {v:g}' for k, v in t['settings'].items())} | {loss} | {mark} |")
        if not sweep["trials"]:
            lines.append(f"| {name} | fixed: {', '.join(f'{k} {v:g}' for k, v in chosen.items())} | - | **chosen** |")
    return lines


def render_markdown(doc: dict, table: str) -> str:
    setup, results, claims = doc["setup"], doc["methods"], doc["claims"]
    prof = setup["profile"]
    seeds = setup.get("seeds", [setup.get("seed", 0)])
    wall = doc.get("wall_seconds", 0.0)
    n_params = next(iter(results.values()))["n_params"] if results else 0
    target = doc.get("target", {})
    lines = [
        "# Convergence benchmark", "",
        f"Profile `{prof['name']}`: {prof['workers']} workers, {prof['steps']} inner steps each, "
        f"H={prof['h']}, F={prof['fragments']}, tau={prof['tau']} (overlap methods), "
        f"batch {prof['batch_size']} x {prof['seq_len']} tokens per worker step, inner AdamW lr {prof['lr']}. "
        f"Device {setup['device']}, seeds {', '.join(map(str, seeds))} (model init and batch sampling), "
        f"wall time {wall / 60:.1f} min{_phases(doc)}.",
        f"Model: {n_params:,} parameters ({setup['model']['arch']}). Data: {setup['data']}.", "",
        _tuning_sentence(setup), "",
        f"Final eval loss: the mean over the seeds, with their min..max and sample std. Steps to target: the "
        f"first evaluation at or below {_target_text(target)}, averaged over the seeds that reached it (k/N). "
        f"Evaluation every {prof['eval_every']} steps on {prof['eval_batches']} held-out batches, with worker 0's "
        "live parameters; the final evaluation after every sync still in flight has landed (as a node that stops "
        "does), so an overlapping method is not judged one round short. Bytes: what a worker sends "
        "(reduce-scatter + all-gather of codec bytes, plus small headers); dp = ring all-reduce of fp32 gradients "
        "every step.", "",
        table, "", "## Claims of the papers, checked", "",
        "| claim | paper | measured (mean over seeds, min..max) | verdict |", "|---|---|---|---|",
    ]
    lines += [f"| {c['claim']} | {c['paper']} | {c['measured']} | {c['verdict']} |" for c in claims]
    if doc.get("tuning"):
        lines += ["", "## Tuning (on the tuning split, seed " + str(seeds[0]) + ")", "", *tuning_table(doc["tuning"])]
    lines += ["", "## Methods as run", "",
              "| method | merge | F | H | tau | outer lr | codec | error feedback | schedule |",
              "|---|---|---:|---:|---:|---:|---|---|---|"]
    for name, r in results.items():
        o = r.get("outer")
        if o is None:
            lines.append(f"| {name} | gradients averaged every step | - | 1 | 0 | - | fp32 | - | - |")
        else:
            merge = f"alpha {o['alpha']:g}" if o["method"] == "alpha" else (
                f"compensate lambda0 {o['lambda0']:g}" if o["method"] == "compensate" else o["method"])
            lines.append(f"| {name} | {merge} | {o['fragments']} | {o['h']} | {o['tau']} | {o['lr']:g} | "
                         f"{o['codec']} | {'yes' if o['error_feedback'] else 'no'} | {o['schedule']} |")
    lines += ["", "![eval loss](loss.png)", ""]
    return "\n".join(lines)


def _phases(doc: dict) -> str:
    phases = doc.get("phases") or {}
    parts = [f"{name} {p['runs']} runs in {p['seconds'] / 60:.1f} min" for name, p in phases.items() if p.get("runs")]
    return f" ({'; '.join(parts)})" if parts else ""


def _target_text(target: dict) -> str:
    if target.get("eval_loss") is None:
        return "no target (diloco not run and no --target given)"
    return f"{target['eval_loss']:.4f} ({target['rule']})"


def _tuning_sentence(setup: dict) -> str:
    sources = setup.get("settings_from")
    if isinstance(sources, dict):  # reports written before --settings-from was repeatable
        sources = [sources]
    if sources:
        rest = (f"was swept here with runs of {setup.get('tune_steps')} steps" if setup.get("swept_here")
                else "ran at its presets")
        parts = []
        for source in sources:
            methods = ", ".join(source.get("settings") or {}) or "none"
            parts.append(f"the sweep of `{source['dir']}` (commit {source.get('commit') or '-'}; methods {methods}): "
                         f"runs of {source.get('tune_steps')} steps on its tuning split ({source.get('tune_split')}), "
                         f"coordinate search: {source.get('search')}")
        what = parts[0] if len(parts) == 1 else "; ".join(f"({i + 1}) {t}" for i, t in enumerate(parts))
        these, where = ("its", "it") if len(parts) == 1 else ("their", "any of them")
        return (f"Tuned by {what}; {these} trials are in the tuning table. A method not in {where} {rest}. "
                "The eval split is used only by the final runs.")
    if not setup.get("tuned"):
        fixed = setup.get("fixed") or {}
        note = f"; fixed: {json.dumps(fixed)}" if any(fixed.values()) else ""
        return f"Not tuned: every method runs its preset settings{note}."
    return (f"Tuned: each method's outer settings were swept on a tuning split ({setup.get('tune_split', '')}) "
            f"with runs of {setup.get('tune_steps')} steps, seed {setup['seeds'][0]}, and the lowest final tuning "
            f"loss chosen (coordinate search: {setup.get('search', SEARCH)}; grids "
            f"{json.dumps(setup.get('grids', {}))}). The eval split is used only by the final runs.")


def plot(path: Path, results: dict[str, dict], setup: dict) -> None:
    """Mean eval curves with the seeds' min..max band, and bytes per worker per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    for name, r in results.items():
        steps = [p[0] for p in r["eval_curve"]]
        line, = ax.plot(steps, [p[1] for p in r["eval_curve"]], label=name,
                        lw=2 if name in ("dp", "diloco", "locoswarm") else 1.2)
        if len(r.get("runs", [])) > 1:
            per_run = [{int(s): v for s, v in run["eval_curve"]} for run in r["runs"]]
            lo = [min(c[s] for c in per_run) for s in steps]
            hi = [max(c[s] for c in per_run) for s in steps]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    all_losses = [p[1] for r in results.values() for p in r["eval_curve"] if math.isfinite(p[1])]
    if all_losses:
        finals = [r["final_eval_loss"] for r in results.values() if math.isfinite(r["final_eval_loss"])] or all_losses
        ax.set_ylim(min(all_losses) - 0.05, max(finals) + 0.6 * (max(all_losses) - max(finals)) * 0.25 + 0.3)
    ax.set_xlabel("inner step")
    ax.set_ylabel("held-out eval loss (nats/token)")
    n_seeds = max(len(r.get("runs", [])) for r in results.values())
    ax.set_title(f"eval loss, {setup['profile']['workers']} workers"
                 + (f", mean of {n_seeds} seeds (band: min..max)" if n_seeds > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = list(results)
    bx.barh(names, [results[n]["bytes_per_worker_per_step"] for n in names], color="tab:gray")
    bx.set_xscale("log")
    bx.xaxis.set_minor_formatter(NullFormatter())  # labels of near-equal bars would overlap
    bx.set_xlabel("bytes sent per worker per inner step (log)")
    bx.invert_yaxis()
    bx.grid(alpha=0.3, axis="x")
    write_png(fig, path)
