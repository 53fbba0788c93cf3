"""The swarm benchmark's report: ``results.json``, ``report.md`` and ``swarm.png`` (all written atomically).

``summarize`` turns the raw per-node measurements of every configuration into the figures the report
shows: each node's utilization relative to the *same node's* unshaped utilization (the ceiling of
this machine, which shares its cores among all peers), the per-configuration mean and range, steps/s,
rounds ok/failed with the failure reasons counted, bytes/s, catch-ups, the last eval loss, and the
planner's predicted utilization next to each measurement. Per node also whether it sat behind NAT
(``--nat``), the reachability it reported, the bytes relayed and its rounds by kind.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from locoswarm.node.bench import write_png
from locoswarm.node.fsutil import atomic_write_text
from locoswarm.node.plan import ROUND_OVERHEAD_S

FILES = ("results.json", "report.md", "swarm.png")


def _mean(xs: list[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return sum(vals) / len(vals) if vals else None


def summarize(configs: dict[str, dict]) -> dict[str, dict]:
    """Add ``relative`` per node and a ``summary`` per configuration (in place; also returned).

    A node's relative utilization is its utilization over its own unshaped one; without an unshaped
    run (or where that node's is missing) it is None and the configuration mean uses the unshaped mean."""
    ceiling = configs.get("unshaped", {}).get("nodes") or []
    ceiling_mean = _mean([n.get("utilization") for n in ceiling])
    for conf in configs.values():
        nodes = conf.get("nodes") or []
        for i, node in enumerate(nodes):
            util = node.get("utilization")
            own = ceiling[i].get("utilization") if i < len(ceiling) else None
            ref = own or ceiling_mean
            node["relative"] = util / ref if util is not None and ref else None
        if not nodes:
            conf["summary"] = None
            continue
        reasons: Counter[str] = Counter()
        for node in nodes:
            reasons.update(node.get("failure_reasons") or {})
        rel = [n["relative"] for n in nodes if n.get("relative") is not None]
        conf["summary"] = {
            "utilization": _mean([n.get("utilization") for n in nodes]),
            "relative": _mean(rel),
            "relative_min": min(rel) if rel else None,
            "relative_max": max(rel) if rel else None,
            "steps_per_s": _mean([n.get("steps_per_s") for n in nodes]),
            "step_time_s": _mean([n.get("step_time_s") for n in nodes]),
            "rounds_ok": sum(n.get("rounds_ok", 0) for n in nodes),
            "rounds_failed": sum(n.get("rounds_failed", 0) for n in nodes),
            "failure_reasons": dict(reasons.most_common()),
            "catch_ups": sum(n.get("catch_ups", 0) for n in nodes),
            "standing_rounds": sum(n.get("standing_rounds", 0) for n in nodes),
            "matchmade_rounds": sum(n.get("matchmade_rounds", 0) for n in nodes),
            "dropped": sum(n.get("dropped", 0) for n in nodes),
            "relayed_bytes": sum(n.get("relayed_bytes", 0) for n in nodes),
            "behind_nat": sum(1 for n in nodes if n.get("behind_nat")),
            "reachability": dict(Counter(str(n.get("reachability") or "unknown") for n in nodes).most_common()),
            "catch_up_loops": sum(n.get("catch_up_loops", 0) for n in nodes),
            "sent_bytes_per_s": _mean([n.get("sent_bytes_per_s") for n in nodes]),
            "received_bytes_per_s": _mean([n.get("received_bytes_per_s") for n in nodes]),
            "eval_loss": _mean([n.get("eval_loss") for n in nodes]),
            "matchmaking_s": _mean([n.get("matchmaking_s") for n in nodes]),
            "round_s": _mean([n.get("round_s") for n in nodes]),
        }
    return configs


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(float(x)) else format(float(x), spec)


def _settings(s: dict | None) -> str:
    if not s:
        return "-"
    if "optimizer" in s:
        return str(s["optimizer"])
    return f"{s['method']} H={s['h']} F={s['fragments']} tau={s['tau']} {s['codec']}"


def _standing(s: dict) -> str:
    """How many of the rounds took standing members (no DHT matchmaking; ``node/swarm/standing.py``)."""
    n = s.get("standing_rounds")
    return f" ({n} standing)" if n else ""


def _reasons(reasons: dict[str, int], limit: int = 3) -> str:
    items = list(reasons.items())[:limit]
    text = "; ".join(f"{n}x {r}" for r, n in items).replace("|", "/")
    return text + ("; ..." if len(reasons) > limit else "") if text else "-"


def markdown_table(configs: dict[str, dict]) -> str:
    """One row per configuration: means over the nodes (relative: mean and range)."""
    rows = ["| configuration | settings | link | utilization | vs unshaped (min-max) | planner predicted | "
            "steps/s | rounds ok / failed | round s (matchmaking s) | failure reasons | sent kB/s per node | "
            "catch-ups | eval loss |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, conf in configs.items():
        s = conf.get("summary")
        if not s and not conf.get("error"):
            rows.append(f"| {name} | - | - | not run (yet) | | | | | | | | | |")
            continue
        if not s:
            rows.append(f"| {name} | {_settings(conf.get('settings'))} | {conf.get('link', '-')} | could not run: "
                        f"{str(conf.get('error', ''))[:160].replace('|', '/')} | | | | | | | | | |")
            continue
        span = f"{_f(s['relative'])} ({_f(s['relative_min'], '.2f')}-{_f(s['relative_max'], '.2f')})"
        sent = _f(None if s["sent_bytes_per_s"] is None else s["sent_bytes_per_s"] / 1e3, ".1f")
        rows.append(f"| {name} | {_settings(conf.get('settings'))} | {conf.get('link', '-')} | "
                    f"{_f(s['utilization'])} | {span} | {_f(conf.get('predicted'))} | {_f(s['steps_per_s'], '.2f')} | "
                    f"{s['rounds_ok']} / {s['rounds_failed']}{_standing(s)} | {_f(s.get('round_s'), '.2f')} "
                    f"({_f(s.get('matchmaking_s'), '.2f')}) | {_reasons(s['failure_reasons'])} | {sent} | "
                    f"{s['catch_ups']} | {_f(s['eval_loss'])} |")
    return "\n".join(rows)


def node_row(name: str, i: int, n: dict, predicted: float | None = None) -> str:
    """The per-node table's row of node ``i`` of configuration ``name``."""
    sent = None if n.get("sent_bytes_per_s") is None else n["sent_bytes_per_s"] / 1e3
    recv = None if n.get("received_bytes_per_s") is None else n["received_bytes_per_s"] / 1e3
    relayed = (n.get("relayed_bytes") or 0) / 1e3
    nat = "yes" if n.get("behind_nat") else "no"
    reach = str(n.get("reachability") or "unknown").replace("|", "/")
    return (f"| {name} | {i} | {nat} | {reach} | {_f(n.get('utilization'))} | {_f(n.get('relative'))} | "
            f"{_f(n.get('predicted', predicted))} | {_f(n.get('steps_per_s'), '.2f')} | "
            f"{_f(n.get('step_time_s'), '.3f')} | {n.get('rounds_ok', 0)} / {n.get('rounds_failed', 0)} | "
            f"{n.get('standing_rounds', 0)} / {n.get('matchmade_rounds', 0)} | {n.get('dropped', 0)} | "
            f"{_f(sent, '.1f')} | {_f(recv, '.1f')} | {_f(relayed, '.1f')} | {n.get('undialable', 0)} | "
            f"{n.get('catch_ups', 0)} | {_f(n.get('eval_loss'))} | {_f(n.get('speed'), 'g')} | "
            f"{_f(n.get('first_merge_s'), '.1f')} | {_f(n.get('rss_mb'), '.0f')} |")


def node_table(configs: dict[str, dict]) -> str:
    """One row per node and configuration."""
    rows = ["| configuration | node | behind NAT | reachability | utilization | vs unshaped | predicted | steps/s | "
            "step time (s) | rounds ok / failed | standing / matchmade | dropped | sent kB/s | received kB/s | "
            "relayed kB | undialable | catch-ups | eval loss | speed | first merge (s) | RSS (MB) |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, conf in configs.items():
        for i, n in enumerate(conf.get("nodes") or []):
            rows.append(node_row(name, i, n, conf.get("predicted")))
    return "\n".join(rows)


def nat_sentence(setup: dict) -> str:
    """The report's line on ``--nat``: how many nodes (which) sat behind NAT, and what that means."""
    nat = int(setup.get("nat") or 0)
    if not nat:
        return "Nodes behind NAT: 0 (every node public)."
    which = ", ".join(str(i) for i in setup.get("natted_nodes") or [])
    return (f"Nodes behind NAT: {nat} of {setup.get('nodes')} (node{'s' if nat > 1 else ''} {which or '?'}; node 0, "
            "the bootstrap, is public): each sits behind a router namespace of its own that masquerades its "
            "outbound connections and drops every inbound one (no port forward), listens on its private address "
            "without a latency proxy (its connections cross the proxies of the public nodes it dials) and is given "
            "no address to announce.")


def cut_sentence(setup: dict) -> str:
    """The report's line on ``--cut``: which pairs of nodes could not connect at all ('' where none)."""
    cuts = setup.get("cuts") or []
    if not cuts:
        return ""
    pairs = ", ".join(f"{a}-{b}" for a, b in cuts)
    return (f" Pairs of nodes that cannot connect (`--cut`): {pairs}: every packet between the two is dropped in "
            "both their namespaces, as by a firewall between two particular peers.")


def compute_sentence(setup: dict) -> str:
    """The report's line on how the nodes computed: real training or synthetic compute (``--step-time``), and each
    node's step-time multiplier (``--speeds``) where they differ."""
    step = float(setup.get("synthetic_step_s") or 0.0)
    speeds = [float(s) for s in setup.get("speeds") or []]
    if step > 0:
        text = (f"**Compute was synthetic** (`--step-time {step:g}`): no node trained; each inner step slept "
                f"{step:g} s times the node's speed after a cheap deterministic update of the real parameters "
                "(`locoswarm run --synthetic-step`), so rounds, codecs and bytes are those of the preset while "
                "the step time is set, not measured, and eval losses are not taken.")
    else:
        text = "Compute was real: every node trained the model."
    if speeds and any(s != 1.0 for s in speeds):
        how = "a synthetic step of that multiple" if step > 0 else "`--throttle` by that factor"
        text += (" Per-node step-time multipliers (`--speeds`): " + ", ".join(f"node {i} x{s:g}" for i, s in
                                                                               enumerate(speeds)) + f" ({how}).")
    m = setup.get("memory_estimate") or {}
    if m.get("max_nodes") is not None:
        text += (f" Memory: about {m['per_node_mb']:.0f} MB per node by estimate, {m['needed_mb'] / 1e3:.1f} GB for "
                 f"{setup.get('nodes')} nodes; this machine had {m['available_mb'] / 1e3:.1f} GB available at the "
                 f"start, enough for about {m['max_nodes']} nodes of this preset.")
    return text


def _load(avg: list[float] | tuple[float, ...] | None) -> str:
    return "-" if not avg else f"{avg[0]:.1f}"


def render_markdown(setup: dict, configs: dict[str, dict]) -> str:
    link = setup.get("link", {})
    lines = [
        "# Swarm benchmark: real nodes on shaped links", "",
        f"{setup.get('nodes')} real `locoswarm run` nodes, each in its own network namespace behind a veth pair "
        f"to a bridge; link per node: {link.get('description', '-')}. Model preset `{setup.get('preset')}` "
        f"({setup.get('params', 0) / 1e6:.2f}M parameters). Each configuration runs fresh nodes for "
        f"{setup.get('seconds'):g} s of measurement after the swarm formed and {setup.get('warmup'):g} s of warm-up; "
        f"all configurations share the same links in one session (wall time {setup.get('wall_s', 0) / 60:.1f} min). "
        f"Machine: {setup.get('machine', '-')}, load average {_load(setup.get('load_average_start'))} at the start "
        f"and {_load(setup.get('load_average_end'))} at the end (other work on the machine slows every node alike "
        f"but makes short windows noisy). {nat_sentence(setup)}{cut_sentence(setup)}", "",
        compute_sentence(setup), "",
        "*Utilization* is the share of wall time a node spends in inner steps over the window (its "
        "`compute_utilization` differenced between two statuses); *vs unshaped* divides it by the same node's "
        "utilization in the `unshaped` run of this session (same nodes and cores, no tc, no loss, no proxy): on a "
        "machine whose cores all peers share, that is the ceiling. *Planner predicted* is "
        "`locoswarm.node.plan.utilization` for the configuration's H, F, tau and codec with the measured step time, "
        "the parameter count, the link rate and latency, n = min(nodes, group size) workers and the planner's round "
        f"overhead ({ROUND_OVERHEAD_S:g} s per sync; the hivemind row by "
        "`locoswarm.node.plan.hivemind_utilization`: one fp32 all-reduce of all parameters per epoch that its "
        "local steps wait for while its epoch clock runs on): "
        "compare it with *vs unshaped*. Rounds: merged and failed syncs over all nodes in the window (*standing*: "
        "rounds that took the last merged round's members without DHT matchmaking); *round s (matchmaking s)*: the "
        "mean wall time of a merged round from its start to its result, and to its member list; failure reasons with "
        "peer ids and numbers replaced. *Eval loss*: a node's last periodic evaluation (every `eval_every` local "
        "steps), '-' for a node that made none after its initial one. Per node: *behind NAT* (`--nat`), "
        "*reachability* as the node reports it at the window's end (`reachability.state` in its status: public, "
        "relayed, outbound-only; unknown where it reports none), *relayed kB*: the growth of its "
        "`reachability.relayed_bytes` over the window; *undialable*: the peers it failed to dial lately at the "
        "window's end (`reachability.undialable`: rounds keep it out of their groups); "
        "*standing / matchmade*: its rounds that took standing "
        "members and those that matchmade (merged + failed - standing); *dropped*: its `dropped` events (stale "
        "progress thrown away); *speed*: its step-time multiplier (`--speeds`); *first merge (s)*: from its start to "
        "its first round merged with peers; *RSS (MB)*: its node process's resident memory at the window's end "
        "(its DHT child and p2pd not counted).", "",
        markdown_table(configs), "",
        "![relative utilization per configuration](swarm.png)", "",
        "## Per node", "", node_table(configs), "",
    ]
    if setup.get("planner_pick"):
        p = setup["planner_pick"]
        lines += [f"Planner pick (from the measured step time {_f(setup.get('planner_step_time_s'), '.3f')} s): "
                  f"H={p['h']} F={p['fragments']} tau={p['tau']} {p['codec']}, predicted {_f(p['predicted'])}.", ""]
    lines += ["Reproduce: `" + setup.get("command", "locoswarm bench swarm") + "`", ""]
    return "\n".join(lines)


def plot(path: Path, configs: dict[str, dict]) -> None:
    """Bars: mean relative utilization per configuration, dots: each node, crosses: the prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(configs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(names) + 2), 4.5))
    for x, name in enumerate(names):
        conf = configs[name]
        s = conf.get("summary") or {}
        if s.get("relative") is not None:
            ax.bar(x, s["relative"], width=0.6, color="#4c72b0", alpha=0.8, label="measured (mean)" if x == 0 else None)
        rel = [n.get("relative") for n in conf.get("nodes") or [] if n.get("relative") is not None]
        ax.scatter([x] * len(rel), rel, color="black", s=14, zorder=3, label="each node" if x == 0 else None)
        if conf.get("predicted") is not None:
            ax.scatter([x], [conf["predicted"]], marker="x", color="#dd5555", s=80, zorder=4,
                       label="planner" if x == 0 else None)
        if not s:
            ax.text(x, 0.05, "could not run", ha="center", rotation=90, fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("utilization relative to unshaped")
    ax.set_ylim(0, 1.25)
    ax.grid(alpha=0.3, axis="y")
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=8, loc="lower left")
    ax.set_title("compute utilization on shaped links")
    write_png(fig, path)


def write_report(out: Path, setup: dict, configs: dict[str, dict]) -> str:
    """Write the three files; returns the markdown summary table."""
    summarize(configs)
    doc = {"setup": setup, "configs": configs}
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1, allow_nan=False, default=str))
    atomic_write_text(out / "report.md", render_markdown(setup, configs))
    plot(out / "swarm.png", configs)
    return markdown_table(configs)
