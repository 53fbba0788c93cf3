"""``locoswarm status``'s screen: a status dict rendered with rich.

:func:`render` is a pure function of the status dict (the node's, through the control API, or a swarm
view built from DHT heartbeats) and a width, so ``--once``, the live view and the tests draw the same
frame; ages are computed from the status's own ``now`` (the node's clock), never the viewer's.
Laid out for 100-140 columns; narrower terminals get shortened ids and fewer columns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

SPARKS = "▁▂▃▄▅▆▇█"
QUIET_KINDS = {"merged", "sent"}      # routine: summarized in one line instead of listed
EVENT_STYLES = {"failed": "bold red", "timed_out": "bold red", "peer_left": "yellow", "peer_joined": "green",
                "joined": "green", "resumed": "cyan", "caught_up": "cyan", "catch_up_loop": "yellow",
                "dropped": "yellow", "merged": "dim"}


# ---- formatting -----------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    """Decimal units (kB = 1000 B), as network rates are usually quoted."""
    n = float(n or 0)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    n = float(n or 0)
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(then: float | None, now: float) -> str:
    return "never" if then is None else f"{duration(now - then)} ago"


def short_id(peer_id: str, width: int = 14) -> str:
    """``QmXyZ12…9fGh`` keeps both ends: the start is shared by many ids, the end tells them apart."""
    if len(peer_id) <= width:
        return peer_id
    head = (width - 1) // 2 + 1
    return f"{peer_id[:head]}…{peer_id[-(width - 1 - head):]}"


def sparkline(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as block characters, scaled between their min and max."""
    vals = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return SPARKS[3] * len(vals)
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / (hi - lo) * len(SPARKS)))] for v in vals)


def _loss_text(loss: float | None) -> str:
    return "—" if loss is None or not math.isfinite(loss) else f"{loss:.3f}"


def _kv_grid() -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    return grid


def event_kind(e: dict) -> str:
    """``failed`` rounds whose error says so show as ``timed_out``."""
    kind = str(e.get("kind", ""))
    if kind == "failed" and any(w in str(e.get("detail", "")).lower() for w in ("timed out", "timeout")):
        return "timed_out"
    return kind


# ---- sections -------------------------------------------------------------------------------------

def _node_panel(st: dict, width: int) -> Panel:
    g = _kv_grid()
    g.add_row("peer", st.get("peer_id") or "—")
    state = st.get("state") or "?"
    g.add_row("state", Text.assemble((state, "bold green" if state == "training" else "yellow"),
                                     f"   up {duration(st.get('uptime_s'))}   pid {st.get('pid', '—')}"))
    g.add_row("step", f"{st.get('inner_step', 0):,} inner   clock {st.get('clock', 0):,}   "
                      f"tokens {human_count(st.get('tokens', 0))}")
    util = float(st.get("compute_utilization") or 0.0)
    bar_w = 10
    filled = max(0, min(bar_w, round(util * bar_w)))
    g.add_row("speed", Text.assemble(f"{human_count(st.get('tokens_per_s') or 0)} tok/s   compute ",
                                     ("█" * filled, "green"), ("░" * (bar_w - filled), "dim"), f" {util:.0%}"))
    history = [s["loss"] for s in st.get("loss_history") or []]
    spark = sparkline(history, max(10, min(40, width // 2 - 36)))
    curve = st.get("eval_curve") or []
    eval_text = f"   eval {curve[-1][1]:.3f}" if curve else ""
    g.add_row("loss", Text.assemble((_loss_text(st.get("loss")), "bold"), " ", (spark, "cyan"), eval_text))
    return Panel(g, title="node", title_align="left", box=box.ROUNDED)


def _network_panel(st: dict) -> Panel:
    b = st.get("bytes") or {}
    g = _kv_grid()
    g.add_row("up", f"{human_bytes(b.get('sent_per_s', 0))}/s   total {human_bytes(b.get('sent', 0))}")
    g.add_row("down", f"{human_bytes(b.get('received_per_s', 0))}/s   total {human_bytes(b.get('received', 0))}")
    failed = int(st.get("syncs_failed", 0))
    consensus = st.get("consensus") or {}
    c_failed = int(consensus.get("failed") or 0)
    g.add_row("rounds", Text.assemble(f"{st.get('syncs_ok', 0)} ok   ", (f"{failed} failed", "red" if failed else ""),
                                      f"   {consensus.get('rounds', 0)} consensus",
                                      (f" ({c_failed} failed)" if c_failed else "", "red")))
    loops = st.get("catch_up_loops", 0)
    g.add_row("other", f"{st.get('catch_ups', 0)} catch-ups" + (f" ({loops} in a loop)" if loops else ""))
    refused, banned = _refusal_totals(st)
    g.add_row("peers", Text.assemble((f"{refused} refused", "yellow" if refused else ""), "   ",
                                     (f"{banned} banned", "bold red" if banned else "")))
    solo = int(st.get("solo_steps", 0))
    if solo:
        g.add_row("alone", f"{solo} outer steps with no peer")
    return Panel(g, title="network", title_align="left", box=box.ROUNDED)


def _refusal_totals(st: dict) -> tuple[int, int]:
    """(refusals, peers banned now): the node's reputation totals; a status without one (an older node)
    counts its recent refusal lines."""
    rep = st.get("reputation")
    if rep is None:
        return len(st.get("refusals") or []), 0
    return int(rep.get("refused", 0)), int(rep.get("banned", 0))


def _spread_text(sp: dict | None) -> Text:
    if not sp:
        return Text("—", style="dim")
    if sp.get("version") is None:
        return Text(f"alone (max v{sp.get('max_version', 0)})", style="dim")
    hashes = int(sp.get("distinct_hashes", 0))
    text = Text(f"{sp.get('holders', 0)} at v{sp['version']} ")
    text.append("agree" if hashes == 1 else f"{hashes} hashes", style="green" if hashes == 1 else "bold yellow")
    if sp.get("max_lag"):
        text.append(f", lag {sp['max_lag']}", style="yellow")
    return text


def _fragments_table(st: dict, width: int) -> Table:
    now = float(st.get("now") or time.time())
    clock = int(st.get("clock", 0))
    t = Table(title="fragments", title_justify="left", box=box.SIMPLE_HEAD, expand=True, padding=(0, 1),
              show_edge=False)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("version", justify="right", no_wrap=True)
    t.add_column("last sync", justify="right", no_wrap=True)
    t.add_column("staleness", justify="right", no_wrap=True)
    t.add_column("group", justify="right", no_wrap=True)
    t.add_column("sent", justify="right", no_wrap=True)
    t.add_column("received", justify="right", no_wrap=True)
    t.add_column("quant err", justify="right", no_wrap=True)
    t.add_column("spread across peers" if width >= 110 else "spread", no_wrap=True, ratio=1)
    if width >= 120:
        t.add_column("params", justify="right", no_wrap=True)
    for f in st.get("fragments") or []:
        merged_clock = f.get("last_merge_clock")
        stale = "—" if merged_clock is None else f"{max(0, clock - int(merged_clock))} steps"
        q = f.get("quant_error")
        row = [str(f["fragment"]), f"v{f.get('version', 0)}", ago(f.get("last_merge_time"), now), stale,
               str(f.get("group_size") or "—"), human_bytes(f.get("bytes_sent", 0)),
               human_bytes(f.get("bytes_received", 0)), "—" if q is None else f"{q:.1%}",
               _spread_text(f.get("spread") or (st.get("spread") or {}).get(str(f["fragment"])))]
        if width >= 120:
            row.append(human_count(f.get("numel", 0)))
        t.add_row(*row)
    return t


def _peer_row(pid: str, info: dict, now: float, id_width: int, note: str = "") -> list[Any]:
    frags = info.get("fragments") or {}
    versions = " ".join(f"v{frags[k]}" for k in sorted(frags, key=int)) or "—"
    seen = info.get("time")
    name = Text(short_id(pid, id_width) + note, style="bold" if note else "")
    if info.get("banned"):
        name.append(" banned", style="bold red")
    refused = info.get("refused")  # None: not known (the swarm view, from heartbeats only)
    refused_text = Text("" if note else "—" if refused is None else str(refused), style="yellow" if refused else "dim")
    return [name, f"{info.get('inner_step', 0):,}", f"{info.get('clock', 0):,}",
            human_count(info.get("tokens_per_s", 0)), _loss_text(info.get("loss")), versions, refused_text,
            "now" if note else ago(seen, now)]


def _swarm_table(st: dict, width: int, title: str = "swarm") -> Table:
    now = float(st.get("now") or time.time())
    peers = st.get("peers") or {}
    t = Table(title=f"{title} ({len(peers)} peer{'s' if len(peers) != 1 else ''} in the DHT)", title_justify="left",
              box=box.SIMPLE_HEAD, expand=True, padding=(0, 1),
              show_edge=False)
    id_width = 52 if width >= 130 else 24 if width >= 110 else 16
    t.add_column("peer", no_wrap=True)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("clock", justify="right", no_wrap=True)
    t.add_column("tok/s", justify="right", no_wrap=True)
    t.add_column("loss", justify="right", no_wrap=True)
    t.add_column("fragments", no_wrap=True, overflow="ellipsis", ratio=1)
    t.add_column("refused", justify="right", no_wrap=True)
    t.add_column("last seen", justify="right", no_wrap=True)
    if st.get("inner_step") is not None and st.get("peer_id"):
        own = {"inner_step": st.get("inner_step", 0), "clock": st.get("clock", 0),
               "tokens_per_s": st.get("tokens_per_s", 0), "loss": st.get("loss"),
               "fragments": {str(f["fragment"]): f.get("version", 0) for f in st.get("fragments") or []}}
        t.add_row(*_peer_row(st["peer_id"], own, now, id_width, note=" (this node)"))
    reputation = ((st.get("reputation") or {}).get("peers") or {}) if "reputation" in st else None
    for pid, info in sorted(peers.items(), key=lambda kv: (-kv[1].get("clock", 0), kv[0])):
        if reputation is not None:  # this node's own judgement of the peer (the control server adds it too)
            rep = reputation.get(pid) or {}
            info = {**info, "refused": int(rep.get("refused", 0)), "banned": bool(rep.get("banned", False))}
        t.add_row(*_peer_row(pid, info, now, id_width))
    if not peers:
        t.add_row(Text("no other peer has a live heartbeat" if st.get("peer_id") else "no peer has a live heartbeat",
                       style="dim"), "", "", "", "", "", "", "")
    return t


def _kinds_text(r: dict) -> Text:
    """``forged_sender 2, non_member 1 · last non_member: ...``: why, then the latest detail."""
    kinds = sorted((r.get("by_kind") or {}).items(), key=lambda kv: (-int(kv[1]), kv[0]))
    text = Text(", ".join(f"{k} {n}" for k, n in kinds))
    if r.get("last"):
        text.append(f" · last {r['last']}", style="dim")
    return text


def _reputation_table(st: dict, width: int, limit: int = 6) -> Table | None:
    """The peers this node refused something of, banned ones first (heartbeat or not: an outsider that
    never joined the swarm shows here only); None when there are none."""
    reputation = (st.get("reputation") or {}).get("peers") or {}
    if not reputation:
        return None
    refused, banned = _refusal_totals(st)
    live = st.get("peers") or {}
    t = Table(title=f"refused / banned peers ({refused} refused, {banned} banned)", title_justify="left",
              box=box.SIMPLE_HEAD, expand=True, padding=(0, 1), show_edge=False)
    id_width = 52 if width >= 130 else 24 if width >= 110 else 16
    t.add_column("peer", no_wrap=True)
    t.add_column("heartbeat", no_wrap=True)
    t.add_column("refused", justify="right", no_wrap=True)
    t.add_column("offences", justify="right", no_wrap=True)
    t.add_column("ban", no_wrap=True)
    t.add_column("refusals by kind · last", no_wrap=True, overflow="ellipsis", ratio=1)
    ranked = sorted(reputation.items(), key=lambda kv: (not kv[1].get("banned"), -int(kv[1].get("refused", 0)), kv[0]))
    for pid, r in ranked[:limit]:
        ban = (Text(f"banned {duration(r.get('banned_for_s'))}", style="bold red") if r.get("banned")
               else Text("—", style="dim"))
        t.add_row(short_id(pid, id_width), Text("live", style="green") if pid in live else Text("none", style="dim"),
                  str(r.get("refused", 0)), str(r.get("offences", 0)), ban, _kinds_text(r))
    if len(ranked) > limit:
        t.add_row(Text(f"… {len(ranked) - limit} more", style="dim"), "", "", "", "", "")
    return t


def _event_rows(events: Sequence[dict], limit: int) -> list[tuple[float, str, int, str]]:
    """``(time, kind, count, detail)`` rows, oldest first: joins, leaves and other news one by one; failed
    rounds grouped by reason (alone or with a slow swarm they repeat every round and would hide the rest)."""
    rows: list[tuple[float, str, int, str]] = []
    failures: dict[tuple[str, str], dict] = {}
    for e in events:
        kind = event_kind(e)
        if kind in QUIET_KINDS:
            continue
        detail = str(e.get("detail", ""))
        if kind in ("failed", "timed_out"):
            reason = detail.split(": ", 1)[1] if ": " in detail else detail
            group = failures.setdefault((kind, reason), {"count": 0, "fragments": set(), "time": 0.0})
            group["count"] += 1
            group["time"] = max(group["time"], float(e.get("time", 0)))
            if e.get("fragment") is not None:
                group["fragments"].add(int(e["fragment"]))
            continue
        rows.append((float(e.get("time", 0)), kind, 1, detail))
    for (kind, reason), g in failures.items():
        frags = sorted(g["fragments"])
        where = f" (fragment{'s' if len(frags) > 1 else ''} {', '.join(map(str, frags))})" if frags else ""
        rows.append((g["time"], kind, g["count"], reason + where))
    rows.sort(key=lambda r: r[0])
    return rows[-limit:]


def _events_table(st: dict, width: int, limit: int = 8) -> Table:
    events = st.get("events") or []
    rows = _event_rows(events, limit)
    merged = [e for e in events if e.get("kind") == "merged"]
    t = Table(title="recent events", title_justify="left", box=box.SIMPLE_HEAD, expand=True, padding=(0, 1),
              show_header=False, show_edge=False)
    t.add_column("time", no_wrap=True, style="dim")
    t.add_column("kind", no_wrap=True)
    t.add_column("detail", overflow="ellipsis", no_wrap=True, ratio=1)
    for when, kind, count, detail in rows:
        label = kind.replace("_", " ") + (f" ×{count}" if count > 1 else "")
        t.add_row(time.strftime("%H:%M:%S", time.localtime(when)), Text(label, style=EVENT_STYLES.get(kind, "")),
                  detail)
    if merged:
        last = merged[-1]
        t.add_row(time.strftime("%H:%M:%S", time.localtime(last.get("time", 0))), Text("merged", style="dim"),
                  Text(f"{len(merged)} recent rounds merged; last: fragment {last.get('fragment')} "
                       f"v{last.get('version')} with {last.get('group_size')} peers, "
                       f"{human_bytes(last.get('bytes_sent', 0))} up / {human_bytes(last.get('bytes_received', 0))} "
                       f"down", style="dim"))
    if not rows and not merged:
        t.add_row("", "", Text("none yet", style="dim"))
    return t


def _header(st: dict) -> Text:
    text = Text()
    text.append(" locoswarm ", style="bold white on blue")
    text.append(f"  swarm {st.get('swarm') or '?'}", style="bold")
    text.append(f"   fingerprint {st.get('fingerprint') or '?'}")
    now = st.get("now")
    if now:
        text.append(f"   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}", style="dim")
    if st.get("via"):
        via = str(st["via"])
        head, sep, pid = via.rpartition("/p2p/")
        text.append(f"\n no local node: the swarm's DHT through {head}{sep}{short_id(pid, 24) if sep else via}",
                    style="dim")
    return text


def render(status: dict, width: int = 120) -> RenderableType:
    """One frame of ``locoswarm status`` for a terminal ``width`` columns wide.

    ``status`` is a node's status dict (``status_from_proto``) or, without a local node
    (``status --swarm``), a dict with ``mode: "swarm"``, ``swarm``, ``fingerprint``, ``via``, ``now``,
    ``peers`` and ``spread``.
    """
    if status.get("mode") == "swarm":
        note = [Text(f" {status['note']}", style="yellow")] if status.get("note") else []
        return Group(_header(status), _swarm_table(status, width, title="swarm"), *note, _swarm_fragments(status),
                     Text(" Ctrl+C to quit · refreshed every second", style="dim"))
    top = Table.grid(expand=True, padding=(0, 1))
    top.add_column(ratio=3)
    top.add_column(ratio=2)
    top.add_row(_node_panel(status, width), _network_panel(status))
    footer = Text(" Ctrl+C to quit · refreshed every second", style="dim")
    reputation = _reputation_table(status, width)
    return Group(_header(status), top, _fragments_table(status, width), _swarm_table(status, width),
                 *([reputation] if reputation is not None else []), _events_table(status, width), footer)


def _swarm_fragments(st: dict) -> Table:
    """Swarm view: the consensus measure per fragment, from the peers' heartbeats only."""
    t = Table(title="fragments across peers", title_justify="left", box=box.SIMPLE_HEAD, expand=True, padding=(0, 1),
              show_edge=False)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("max version", justify="right", no_wrap=True)
    t.add_column("spread across peers", ratio=1, no_wrap=True)
    spread = st.get("spread") or {}
    for frag in sorted(spread, key=int):
        sp = spread[frag]
        t.add_row(str(frag), f"v{sp.get('max_version', 0)}", _spread_text(sp))
    if not spread:
        t.add_row("", "", Text("no fragment versions published yet", style="dim"))
    return t


__all__ = ["ago", "duration", "event_kind", "human_bytes", "human_count", "render", "short_id", "sparkline"]
