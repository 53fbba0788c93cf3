"""The ``locoswarm bench swarm`` command: set up the links, run each configuration, write the report.

Order of work, and why: every flag is checked first (a bad value costs nothing and names itself);
then whether namespaces can be made at all (root, ``ip netns add``), both as one line and exit 2.
The topology is created once; each configuration gets fresh nodes (a swarm of its own) on the same
links, shaped for every configuration but ``unshaped``. With ``--nat K`` the last K nodes (never node 0,
the bootstrap) each sit behind a router of their own that lets no connection in: they listen on their
private address, announce no other and have no latency proxy. The report is rewritten after each
configuration, so an interrupted session still leaves what it measured.

Cleanup: a SIGTERM, SIGHUP or Ctrl+C raises ``KeyboardInterrupt`` once (further ones are ignored
while cleaning up); the ``finally`` blocks stop every peer and proxy by process group and delete the
namespaces, which removes every veth, qdisc and iptables rule with them.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from locoswarm.node.bench import children_scratch
from locoswarm.node.bench.swarm import spec
from locoswarm.node.bench.swarm.spec import CONFIGS, DEFAULT_CONFIGS, PRESETS
from locoswarm.node.commands import add_data_args, data_paths
from locoswarm.node.config import load_config, to_toml
from locoswarm.node.core.late_window import late_window
from locoswarm.node.errors import UserError
from locoswarm.node.helptext import describe
from locoswarm.node.plan import (
    CATCH_UP_RATE,
    HIVEMIND_LINK_EFFICIENCY,
    LINK_EFFICIENCY,
    ROUND_OVERHEAD_S,
    hivemind_utilization,
    recommend,
    utilization,
)

HIVEMIND_MODULE = ["locoswarm.node.bench.swarm.peers", "hivemind"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("swarm", help="real nodes in network namespaces on shaped links (needs root)",
                       description=describe(__doc__))
    add_data_args(p)
    p.add_argument("--out", required=True, help="report directory (results.json, report.md, swarm.png)")
    p.add_argument("--nodes", type=int, default=4,
                   help="nodes per configuration, 2 to 32 (default 4; refused where this machine's memory, by an "
                        "estimate per preset, would not hold them)")
    p.add_argument("--step-time", type=float, default=0.0, metavar="S",
                   help="synthetic compute (benchmarks only): every node sleeps S seconds per inner step after a cheap "
                        "update of the real parameters instead of training (run --synthetic-step), so many nodes fit "
                        "few cores; 0.01 to 60 (default 0: real training)")
    p.add_argument("--speeds", default="", metavar="M,M,...",
                   help="per-node step-time multipliers, one per node, 1 to 100, e.g. 1,1,2,5: with --step-time a "
                        "node's synthetic step is M x S, without it the node runs with --throttle M (default: all 1)")
    p.add_argument("--seconds", type=float, default=90.0, help="measured seconds per configuration (default 90)")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds between the swarm forming and the measurement (default 10)")
    p.add_argument("--bandwidth", default="20mbit",
                   help="cap of every link, both directions, tc style: 20mbit, 5mbit, 1gbit, none (default 20mbit)")
    p.add_argument("--upload", default=None, help="upload cap per node (default: --bandwidth)")
    p.add_argument("--download", default=None, help="download cap per node (default: --bandwidth)")
    p.add_argument("--latency-ms", default="0", help="one-way latency added by a TCP proxy per node (default 0)")
    p.add_argument("--loss", default="0", help="random packet loss per direction: 0.01 or 1%% (default 0)")
    p.add_argument("--nat", default="0", metavar="K",
                   help="put the last K nodes each behind a NAT router of its own (outbound connections only, no "
                        "port forward); 0 to nodes-1, node 0 (the bootstrap) stays public (default 0)")
    p.add_argument("--cut", default="", metavar="I-J,...",
                   help="pairs of nodes that cannot connect at all, as behind a firewall between the two (every "
                        "packet between them dropped), e.g. 2-3 (default: none)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated configurations (default {DEFAULT_CONFIGS}; known: {','.join(CONFIGS)})")
    p.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--config", default=None,
                   help="base peers.toml of the recommended stack (default: built-in defaults)")
    p.add_argument("--eval-every", type=int, default=100, help="inner steps between eval losses (default 100)")
    p.add_argument("--ready-timeout", type=float, default=240.0,
                   help="seconds the nodes may take to start and see each other (default 240)")
    p.add_argument("--keep-logs", action="store_true", help="copy every node's log to OUT/logs/CONFIG/")
    p.set_defaults(func=run_swarm)


class _Interrupt:
    """SIGTERM/SIGHUP/SIGINT -> one KeyboardInterrupt; later signals are ignored so cleanup finishes."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.fired:
            print("locoswarm: cleaning up, please wait", file=sys.stderr)
            return
        self.fired = True
        raise KeyboardInterrupt

    def install(self) -> dict[int, object]:
        old = {}
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            old[sig] = signal.signal(sig, self)
        return old


def _base_config(args: argparse.Namespace):
    if args.preset not in PRESETS:
        raise UserError(f"--preset: cannot use {args.preset!r}; choose one of {', '.join(PRESETS)}")
    if args.config and not Path(args.config).is_file():
        raise UserError(f"--config {args.config}: no such file; give a peers.toml or leave it out")
    overrides = [f"model.preset={args.preset}", "swarm.name=swarm-bench"]
    if not args.config:
        overrides.append("data.max_bytes=8000000")  # every node tokenizes its corpus: keep start-up short
    return load_config(args.config, overrides)


def _params(cfg) -> int:
    # lazy: locoswarm.node.data and .model import torch (~1 s, measured); this module does not
    from locoswarm.node.data import load_tokenizer
    from locoswarm.node.model import build_meta_model, count_params

    return count_params(build_meta_model(cfg.model, load_tokenizer(cfg.model.tokenizer).vocab_size))


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def run_swarm(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # lazy: netns, report and runner cost ~10 ms at every CLI start (measured)
    from locoswarm.node.bench.swarm import netns
    from locoswarm.node.bench.swarm.report import compute_sentence, write_report
    from locoswarm.node.bench.swarm.runner import ConfigRun, PeerLaunch, RunSettings

    # ---- every flag first: one clear line, exit 2 ----
    configs = spec.parse_configs(args.configs)
    spec.check_range("--nodes", args.nodes, 2, spec.MAX_NODES, "a node count")
    if args.step_time != 0:
        spec.check_range("--step-time", args.step_time, 0.01, spec.MAX_STEP_TIME_S,
                         "seconds per inner step (or 0: off)")
    speeds = spec.parse_speeds(args.speeds, args.nodes)
    if "hivemind" in configs and (args.step_time or any(s != 1 for s in speeds)):
        raise UserError("--step-time and --speeds do not apply to the hivemind configuration (its peers train for "
                        "real, unthrottled); drop hivemind from --configs or drop those flags")
    nat = spec.parse_nat(args.nat, args.nodes)
    cuts = spec.parse_cuts(args.cut, args.nodes)
    spec.check_range("--seconds", args.seconds, 5, 3600, "seconds")
    spec.check_range("--warmup", args.warmup, 0, 600, "seconds")
    spec.check_range("--eval-every", args.eval_every, 0, 1_000_000, "inner steps")
    spec.check_range("--ready-timeout", args.ready_timeout, 10, 3600, "seconds")
    up = spec.parse_link_rate(args.upload if args.upload is not None else args.bandwidth,
                              "--upload" if args.upload is not None else "--bandwidth")
    down = spec.parse_link_rate(args.download if args.download is not None else args.bandwidth,
                                "--download" if args.download is not None else "--bandwidth")
    link = spec.LinkSpec(up, down, spec.parse_latency(args.latency_ms), spec.parse_loss(args.loss))
    base = _base_config(args)
    data = [str(Path(d).resolve()) for d in data_paths(args)]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory; give a directory for the report")
    memory = spec.check_memory(args.nodes, args.preset, spec.available_memory_mb())
    netns.check_possible(loss=link.loss > 0, nat=nat > 0, cut=bool(cuts))
    netns.remove_stale()

    out.mkdir(parents=True, exist_ok=True)
    params = _params(base)
    workers = min(args.nodes, base.network.group_size)
    console = Console(stderr=True)
    setup = {
        "command": _command_line(sys.argv),
        "nodes": args.nodes, "nat": nat, "natted_nodes": netns.natted_nodes(args.nodes, nat),
        "cuts": [list(c) for c in cuts],
        # synthetic compute (0: real training) and each node's step-time multiplier: the report states both
        "synthetic_step_s": args.step_time, "speeds": speeds, "memory_estimate": memory,
        "seconds": args.seconds, "warmup": args.warmup, "preset": args.preset,
        "params": params, "workers_per_group": workers, "configs": configs,
        "link": {"upload_bps": up, "download_bps": down, "latency_ms": link.latency_ms, "loss": link.loss,
                 "description": link.describe()},
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}",
        "data": data or "the node's default corpus (8 MB of this Python's standard library sources)",
        "base_config": args.config or "built-in defaults",
        "load_average_start": os.getloadavg(),
    }
    results: dict[str, dict] = {name: {} for name in configs}
    started = time.monotonic()
    interrupt = _Interrupt()
    old_handlers = interrupt.install()
    columns = [TextColumn("{task.description:<28}"), BarColumn(),
               TextColumn("{task.completed:>4.0f}/{task.total:.0f} s"), TimeElapsedColumn()]
    try:
        with tempfile.TemporaryDirectory(prefix="locoswarm-swarm-bench-") as tmp, children_scratch(), \
                netns.Topology(args.nodes, nat=nat, cuts=cuts) as topo, Progress(*columns, console=console) as progress:
            tasks = {name: progress.add_task(f"{name}: waiting", total=args.seconds) for name in configs}
            settings = RunSettings(nodes=args.nodes, seconds=args.seconds, warmup=args.warmup,
                                   ready_timeout=args.ready_timeout, work_dir=Path(tmp), data=data,
                                   eval_every=args.eval_every, latency_ms=link.latency_ms,
                                   node_args=spec.node_compute_args(args.step_time, speeds))
            for name in configs:
                conf = results[name]
                shaped = name != "unshaped"
                conf["link"] = link.describe() if shaped else "unshaped"
                if shaped:
                    topo.shape(netns.Shaping(up, down, link.loss))
                else:
                    topo.unshape()
                links = topo.describe()
                conf["qdiscs"] = links[topo.ns(0)]
                if nat or cuts:  # every node's link, the NATed ones' on their routers
                    conf["links"] = links
                pick = None
                if name == "planner":
                    step_time = next((r["summary"]["step_time_s"] for r in results.values()
                                      if r.get("summary") and r["summary"].get("step_time_s")), None)
                    if step_time is None:
                        conf["error"] = "no step time measured before the planner's turn (a configuration ran first?)"
                        continue
                    rec = recommend(params, step_time, link.rate_bps * LINK_EFFICIENCY, workers=workers,
                                    latency=link.latency_ms / 1e3, round_overhead=ROUND_OVERHEAD_S,
                                    catch_up_rate=CATCH_UP_RATE)
                    pick = spec.PlannerPick(rec.h, rec.fragments, rec.tau, rec.codec, rec.utilization)
                    setup["planner_pick"] = vars(pick)
                    setup["planner_step_time_s"] = step_time
                if name == "hivemind":
                    launch_module = HIVEMIND_MODULE
                    cfg = spec.config_for("recommended", base)
                    conf["settings"] = {"optimizer": "hivemind.Optimizer (see node/bench/swarm/peers.py)"}
                else:
                    launch_module = ["locoswarm.node.cli", "run"]
                    cfg = spec.config_for(name if name != "unshaped" else "recommended", base, pick)
                    conf["settings"] = spec.outer_settings(cfg)
                cfg_path = Path(tmp) / f"{name}.toml"
                cfg_path.write_text(to_toml(cfg))
                task = tasks[name]

                def on_progress(what: str, done: float, task=task, name=name) -> None:
                    progress.update(task, description=f"{name}: {what}", completed=done)

                extra = ["--nodes", str(args.nodes)] if name == "hivemind" else []
                run = ConfigRun(name, PeerLaunch(launch_module, cfg_path, extra), topo, settings, proxied=shaped,
                                on_progress=on_progress)
                conf.update(run.run())
                for node, speed in zip(conf.get("nodes") or [], speeds, strict=False):
                    node["speed"] = speed
                if args.keep_logs:
                    _copy_logs(Path(tmp) / name, out / "logs" / name)
                _predict(conf, cfg, params, link if shaped else None, workers, utilization)
                summary = write_report(out, {**setup, "wall_s": time.monotonic() - started}, results)
                progress.update(task, description=f"{name}: " + ("done" if "error" not in conf else "FAILED"))
                if "error" in conf:
                    progress.console.print(f"{name}: could not run: {conf['error']}")
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    setup["load_average_end"] = os.getloadavg()
    summary = write_report(out, {**setup, "wall_s": time.monotonic() - started}, results)
    Console().print(summary)
    Console().print(compute_sentence(setup))
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'swarm.png'}")
    return 0


def _predict(conf: dict, cfg, params: int, link, workers: int, utilization) -> None:
    """The planner's utilization for this configuration, with each node's measured step time (and the
    configuration's mean step time for the configuration row).

    ``hivemind.Optimizer`` (local updates, ``target_batch_size`` = H steps of every peer) has a model of its
    own, ``locoswarm.node.plan.hivemind_utilization``: one fp32 all-reduce of all parameters per epoch that its
    local steps wait for while the epoch clock runs on. The model leaves out its state loads (a peer that fell
    an epoch behind downloads parameters and optimizer state before it steps on)."""
    # lazy: locoswarm.node.core.merge imports torch (~1 s, measured); this module does not
    from locoswarm.node.core.merge import make_merge_rule

    o = cfg.outer
    rate = link.rate_bps * LINK_EFFICIENCY if link is not None else math.inf  # what a round's transfers get
    latency = link.latency_ms / 1e3 if link is not None else 0.0
    if "optimizer" in (conf.get("settings") or {}):
        hivemind_rate = link.rate_bps * HIVEMIND_LINK_EFFICIENCY if link is not None else math.inf

        def model(step_time: float) -> float:
            return hivemind_utilization(params, step_time, hivemind_rate, h=o.h, latency=latency, workers=workers,
                                        block_size=o.block_size)
    else:
        # the overlap the node really has: its late window (a slow round is waited for only at its end)
        overlap = late_window(h=o.h, fragments=o.fragments, tau=o.tau, max_delay=o.max_delay,
                              merges_late=make_merge_rule(o.method).merges_late)

        def model(step_time: float) -> float:
            return utilization(params, step_time, rate, h=o.h, fragments=o.fragments, tau=overlap, codec=o.codec,
                               latency=latency, workers=workers, block_size=o.block_size,
                               round_overhead=ROUND_OVERHEAD_S, catch_up_rate=CATCH_UP_RATE)

    def predict(step_time: float | None) -> float | None:
        return _finite(model(step_time)) if step_time else None

    nodes = conf.get("nodes") or []
    for node in nodes:
        node["predicted"] = predict(node.get("step_time_s"))
    times = [n["step_time_s"] for n in nodes if n.get("step_time_s")]
    conf["predicted"] = predict(sum(times) / len(times)) if times else None


def _copy_logs(src: Path, dst: Path) -> None:
    """The logs of one configuration's peers and proxies (``--keep-logs``)."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for log in sorted(src.glob("*.log")):
        shutil.copyfile(log, dst / log.name)


def _command_line(argv: list[str]) -> str:
    """``locoswarm bench swarm ARGS`` as it was run (also when run as ``python -m locoswarm.node.cli``)."""
    words = list(argv)
    for i in range(len(words) - 1):
        if words[i] == "bench" and words[i + 1] == "swarm":
            return "locoswarm bench swarm " + " ".join(shlex.quote(a) for a in words[i + 2:])
    return "locoswarm bench swarm"
