"""``locoswarm bench memory``: the peak memory of real nodes per model preset and ``[outer] offload``.

For every preset of ``--presets`` and every setting of ``--offload``, ``--nodes`` real nodes
(``locoswarm run`` processes on loopback, a DHT and p2pd each, all on ``--device``) form a swarm and
train until every node has merged ``--rounds`` rounds with a peer. Then each node's own report of its
memory is read from its ``status.json`` (``memory``: the resident memory of its process and its peak,
and on a CUDA device what PyTorch holds there now, its peak and the device's capacity), with its
speed. The nodes share the machine (and its GPU), but each figure is one process's own.

Each node's processes are measured too (:func:`process_memory`, from ``/proc/<pid>/smaps_rollup``): the node,
its watchdog, the DHT child and its p2pd, with the proportional set size (PSS: shared pages split between
the processes that map them, so the figures add up) and the unique set size (USS: pages no other process
maps); the report gives the breakdown of each configuration's first node and every node's total PSS.

Beside each measurement stands the planner's estimate of the training device's memory for the same
preset (its standard shape), batch and offload setting (``locoswarm.node.sizing``: weights, gradients,
AdamW, the outer state when it stays on the device, activations), so that a GPU run checks the estimate.
On the CPU the device columns are empty and offload changes nothing (the outer state lives in host
memory either way).

Writes ``results.json``, ``report.md`` and ``memory.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

from locoswarm.node.bench import keep_logs, local_swarm_runs, write_png
from locoswarm.node.bench.robustness import LocalProc
from locoswarm.node.commands import add_data_args, data_paths
from locoswarm.node.config import PRESET_NAMES, InnerSection
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text
from locoswarm.node.helptext import describe
from locoswarm.node.sizing import estimate, preset_params

OFFLOADS = ("off", "cpu", "auto")
MB = 1e6

# Fast rounds (as the multi-process tests use) on any preset; --config replaces it.
BASE_SWARM: dict[str, dict] = {
    "swarm": {"name": "memory-bench"},
    "inner": {"batch_size": 8, "seq_len": 128, "warmup": 5},
    "outer": {"method": "compensate", "h": 20, "fragments": 2, "tau": 2, "codec": "fp4"},
    "network": {"group_size": 8, "matchmaking_timeout": 3.0, "round_timeout": 30.0, "heartbeat_interval": 0.5},
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="peak memory of real nodes per preset and offload setting (JSON + md + PNG)",
                       description=describe(__doc__))
    add_data_args(p)
    p.add_argument("--out", required=True,
                   help="report directory (results.json, report.md, memory.png; the nodes' logs under logs/)")
    p.add_argument("--presets", default="tiny,small", help="comma-separated model presets (default tiny,small)")
    p.add_argument("--offload", default="off,cpu",
                   help=f"comma-separated [outer] offload settings (default off,cpu; known: {','.join(OFFLOADS)})")
    p.add_argument("--nodes", type=int, default=2, help="nodes per configuration (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds each node merges with a peer before it is "
                                                         "measured (default 2)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds a configuration may take to start and merge its rounds (default 900)")
    p.add_argument("--config", default=None,
                   help="the swarm's peers.toml; its preset and offload are set per configuration (default: "
                        "a swarm with fast rounds, batch 8 x 128 tokens)")
    p.set_defaults(func=run_memory)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise UserError(f"{flag} {text!r} is not allowed; use a comma-separated list of {', '.join(allowed)}")
    return values


def _base_config(path: str | None) -> dict[str, dict]:
    if path is None:
        return json.loads(json.dumps(BASE_SWARM))
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"--config {path}: cannot read it ({exc.strerror}); give an existing peers.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path} is not valid TOML ({exc}); fix the file") from None


def _write_config(path: Path, base: dict[str, dict], preset: str, offload: str) -> Path:
    doc = json.loads(json.dumps(base))
    doc.setdefault("model", {})["preset"] = preset
    doc.setdefault("outer", {})["offload"] = offload
    lines = []
    for name, values in doc.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _predicted_gib(preset: str, offload: str, device: str, inner: dict) -> float:
    """The planner's device memory for this preset, batch and offload (``locoswarm.node.sizing``)."""
    defaults = InnerSection()
    batch, seq = int(inner.get("batch_size", defaults.batch_size)), int(inner.get("seq_len", defaults.seq_len))
    on_device = offload == "off" or (offload == "auto" and not device.startswith("cuda"))
    # The GPU class only sets the step time and whether it fits; memory is the same on every class.
    return estimate(preset, "h100", tokens_per_step=batch * seq, seq_len=seq, outer_on_device=on_device).total_gib


class Configuration:
    """One preset and offload setting: start the nodes, wait for their rounds, read their memory, stop."""

    def __init__(self, preset: str, offload: str, root: Path, base: dict, args: argparse.Namespace,
                 data: list[str]) -> None:
        self.preset, self.offload = preset, offload
        self.name = f"{preset} offload={offload}"
        self.root = root
        self.config = _write_config(root / "peers.toml", base, preset, offload)
        self.args = args
        self.data = data
        self.procs: list[LocalProc] = []

    def node_args(self) -> list[str]:
        args = ["--config", str(self.config), "--device", self.args.device, "--eval-every", "1000000"]
        if not self.args.device.startswith("cuda"):
            args += ["--threads", "1"]  # the nodes share the cores
        return args + (["--data", *self.data] if self.data else [])

    def spawn(self, i: int, extra: list[str]) -> LocalProc:
        name = f"node{i}"
        proc = LocalProc(name, ["locoswarm.node.cli", "run"], [*self.node_args(), *extra,
                                                                "--state-dir", str(self.root / name)],
                         self.root / name, self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def run(self, progress=None) -> dict:
        result: dict = {"preset": self.preset, "offload": self.offload, "nodes": [], "error": None}
        started = time.monotonic()
        try:
            first = self.spawn(0, [])
            addrs = first.wait_for(lambda s: s.get("addrs"), self.args.timeout, "addresses")["addrs"]
            boot = next((a for a in addrs if "/127.0.0.1/" in a), addrs[0])
            for i in range(1, self.args.nodes):
                self.spawn(i, ["--bootstrap", boot])
            task = progress.add_task(f"  {self.name}", total=self.args.rounds * len(self.procs)) if progress else None
            statuses: list[dict] = []
            for proc in self.procs:
                left = max(1.0, self.args.timeout - (time.monotonic() - started))
                statuses.append(proc.wait_for(lambda s: s.get("syncs_ok", 0) >= self.args.rounds, left,
                                              f"{self.args.rounds} merged rounds"))
                if task is not None:
                    progress.update(task, advance=self.args.rounds)
            statuses = [proc.status() or st for proc, st in zip(self.procs, statuses, strict=True)]
            result["nodes"] = [_with_processes(_node_row(st), process_memory(proc.proc.pid))
                               for proc, st in zip(self.procs, statuses, strict=True)]
        except Exception as exc:  # a configuration that could not run is reported; the others still run
            result["error"] = f"{type(exc).__name__}: {exc}"[:400]
        finally:
            for proc in self.procs:
                proc.stop()
        result["seconds"] = round(time.monotonic() - started, 1)
        return result


def _smaps_rollup_kb(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            lines = fh.read().splitlines()[1:]
    except OSError:
        return None
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            out[parts[0][:-1]] = int(parts[1])
    return out


def process_memory(pid: int) -> list[dict]:
    """PSS and USS (MB) of the node process ``pid`` and of its living descendants (its watchdog, the DHT child,
    p2pd), each as ``{"pid", "name", "pss_mb", "uss_mb", "rss_mb"}``, the node first. Empty off Linux."""
    from locoswarm.node.swarm.process import descendants, proc_stat

    rows = []
    for p in [pid, *descendants(pid)]:
        st, mem = proc_stat(p), _smaps_rollup_kb(p)
        if st is None or mem is None:
            continue
        rows.append({"pid": p, "name": st[0], "pss_mb": round(mem.get("Pss", 0) / 1024, 1),
                     "uss_mb": round((mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0)) / 1024, 1),
                     "rss_mb": round(mem.get("Rss", 0) / 1024, 1)})
    return rows


def _with_processes(row: dict, procs: list[dict]) -> dict:
    return {**row, "processes": procs,
            "total_pss_mb": round(sum(p["pss_mb"] for p in procs), 1) if procs else None}


def _node_row(st: dict) -> dict:
    m = st.get("memory") or {}

    def mb(key: str) -> float | None:
        return None if m.get(key) is None else round(m[key] / MB, 1)

    return {"rss_mb": mb("rss"), "peak_rss_mb": mb("peak_rss"), "device": m.get("device", ""),
            "device_allocated_mb": mb("device_allocated"), "device_peak_mb": mb("device_peak"),
            "device_total_mb": mb("device_total"), "rounds": int(st.get("syncs_ok", 0)),
            "inner_steps": int(st.get("inner_step", 0)),
            # over the node's last 5 s (none yet: a node that reached its rounds sooner)
            "tokens_per_s": round(float(st["tokens_per_s"]), 1) if st.get("tokens_per_s") else None}


def run_memory(args: argparse.Namespace) -> int:
    from rich.console import Console

    presets = _choices(args.presets, PRESET_NAMES, "--presets")
    offloads = _choices(args.offload, OFFLOADS, "--offload")
    if not 2 <= args.nodes <= 8:
        raise UserError(f"--nodes {args.nodes} is not allowed; use 2..8 (the nodes must merge rounds together)")
    if not 1 <= args.rounds <= 100:
        raise UserError(f"--rounds {args.rounds} is not allowed; use 1..100")
    if not 10 <= args.timeout <= 7200:
        raise UserError(f"--timeout {args.timeout} is not allowed; use 10..7200 seconds")
    # lazy: locoswarm.node.model imports torch (~1 s, measured); this module does not
    from locoswarm.node.model import resolve_device

    args.device = str(resolve_device(args.device))  # auto -> cuda or cpu, once for every node
    base = _base_config(args.config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    data = [str(Path(d).resolve()) for d in data_paths(args)]
    setup = {"presets": presets, "offload": offloads, "nodes": args.nodes, "rounds": args.rounds,
             "device": args.device, "config": args.config or BASE_SWARM, "data": data or "the node's default corpus"}
    results: dict[str, dict] = {}
    started = time.perf_counter()
    with local_swarm_runs("memory", len(presets) * len(offloads), console) as (tmp, progress, overall):
        for i, (preset, offload) in enumerate((p, o) for p in presets for o in offloads):
            root = tmp / f"c{i}"
            root.mkdir()
            run = Configuration(preset, offload, root, base, args, data)
            r = run.run(progress)
            r["params"] = preset_params(preset)
            r["predicted_device_gib"] = round(_predicted_gib(preset, offload, args.device, base.get("inner", {})), 3)
            results[run.name] = r
            keep_logs(root, out / "logs" / f"{preset}-{offload}")
            progress.console.print(_one_line(run.name, r))
            progress.update(overall, advance=1)
            write_report(out, setup, results, time.perf_counter() - started)
    report = write_report(out, setup, results, time.perf_counter() - started)
    Console().print(report["table_md"])
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'memory.png'}")
    return 0 if all(r["error"] is None for r in results.values()) else 1


def _peak(r: dict, key: str) -> float | None:
    values = [n[key] for n in r["nodes"] if n.get(key) is not None]
    return max(values) if values else None


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def _one_line(name: str, r: dict) -> str:
    if r["error"]:
        return f"{name}: failed: {r['error']}"
    return (f"{name}: peak RSS {_fmt(_peak(r, 'peak_rss_mb'))} MB, device peak {_fmt(_peak(r, 'device_peak_mb'))} MB "
            f"(predicted {r['predicted_device_gib'] * 1024:.0f} MiB), total PSS of a node's processes "
            f"{_fmt(_peak(r, 'total_pss_mb'))} MB, {r['seconds']:.0f} s")


def markdown_table(results: dict[str, dict]) -> str:
    rows = ["| configuration | parameters | peak RSS per node (MB) | device peak per node (MB) | predicted device "
            "(MiB) | rounds | tokens/s per node |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r["error"]:
            rows.append(f"| {name} | {r['params']:,} | failed: {r['error'][:80]} | | | | |")
            continue
        nodes = r["nodes"]
        rows.append(f"| {name} | {r['params']:,} | {', '.join(_fmt(n['peak_rss_mb']) for n in nodes)} | "
                    f"{', '.join(_fmt(n['device_peak_mb']) for n in nodes)} | "
                    f"{r['predicted_device_gib'] * 1024:.0f} | {', '.join(str(n['rounds']) for n in nodes)} | "
                    f"{', '.join(_fmt(n['tokens_per_s']) for n in nodes)} |")
    return "\n".join(rows)


def process_table(results: dict[str, dict]) -> str:
    """Per configuration, the processes of its first node: PSS and USS in MB, and the total PSS."""
    rows = ["| configuration | process | PSS (MB) | USS (MB) |", "|---|---|---:|---:|"]
    for name, r in results.items():
        procs = r["nodes"][0].get("processes") if r["nodes"] else None
        if r["error"] or not procs:
            continue
        for i, p in enumerate(procs):
            what = "node" if i == 0 else p["name"]
            rows.append(f"| {name} | {what} | {p['pss_mb']:.1f} | {p['uss_mb']:.1f} |")
        totals = ", ".join(_fmt(n.get("total_pss_mb")) for n in r["nodes"])
        rows.append(f"| {name} | **total PSS** (each node: {totals}) | "
                    f"**{_fmt(r['nodes'][0].get('total_pss_mb'), '.1f')}** | |")
    return "\n".join(rows)


def write_report(out: Path, setup: dict, results: dict[str, dict], wall: float) -> dict:
    doc = {"setup": setup, "configurations": results, "wall_seconds": round(wall, 1)}
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1))
    table = markdown_table(results)
    atomic_write_text(out / "report.md", "\n".join([
        "# Peak memory of real nodes per preset and offload setting (`locoswarm bench memory`)", "",
        f"{setup['nodes']} nodes per configuration on `{setup['device']}`, each measured once it had merged "
        f"{setup['rounds']} rounds with a peer; each figure is one node process's own (`status.json` `memory`). "
        "The predicted column is the planner's estimate of the training device's memory "
        "(`locoswarm plan --sizes`); on the CPU there is no device column to compare it with.", "",
        table, "", "## Each process of a node", "",
        "The first node of each configuration, when it was measured: the node process, its watchdog, the DHT "
        "child and its p2pd. PSS splits shared pages between the processes that map them (the figures add up); "
        "USS counts the pages only that process maps.", "",
        process_table(results), "",
        "![peak memory per configuration](memory.png)", "", f"Wall time: {wall:.0f} s.", ""]))
    plot(out / "memory.png", results)
    return {"table_md": table, **doc}


def plot(path: Path, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names) + 2), 4.5))
    xs = range(len(names))
    series = [("peak RSS", [_peak(results[n], "peak_rss_mb") for n in names]),
              ("device peak", [_peak(results[n], "device_peak_mb") for n in names]),
              ("predicted device", [results[n]["predicted_device_gib"] * 1024**3 / MB for n in names]),
              ("total PSS of a node's processes", [_peak(results[n], "total_pss_mb") for n in names])]
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        ax.bar([x - 0.4 + width * (k + 0.5) for x in xs], [v or 0 for v in values], width=width, label=label)
    ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("MB (largest node)")
    ax.set_title("node memory per preset and offload setting")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    write_png(fig, path)
