"""``locoswarm status``'s screen: a node's status (``locoswarm.node.status``) rendered with rich.

:func:`render` is a pure function of the status (a :class:`NodeStatus` through the control API, or
a :class:`SwarmView` built from DHT heartbeats) and a width, so ``--once``, the live view and the tests
draw the same frame; ages are computed from the status's own ``now`` (the node's clock), never the viewer's.
Laid out for 100-140 columns; narrower terminals get shortened ids and fewer columns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from locoswarm.node.status import (
    NodePeerStatus,
    NodeStatus,
    PeerReputation,
    PeerStatus,
    ReachabilityStatus,
    Spread,
    StatusEvent,
    SwarmView,
)

SPARKS = "▁▂▃▄▅▆▇█"
QUIET_KINDS = {"merged", "sent"}      # routine: summarized in one line instead of listed
EVENT_STYLES = {"failed": "bold red", "timed_out": "bold red", "peer_left": "yellow", "peer_joined": "green",
                "joined": "green", "resumed": "cyan", "caught_up": "cyan", "catch_up_loop": "yellow",
                "dropped": "yellow", "folded": "yellow", "bounded": "yellow", "merged": "dim"}


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


def event_kind(e: StatusEvent) -> str:
    """``failed`` rounds whose error says so show as ``timed_out``."""
    if e.kind == "failed" and any(w in e.detail.lower() for w in ("timed out", "timeout")):
        return "timed_out"
    return e.kind


# ---- sections -------------------------------------------------------------------------------------

def _node_panel(st: NodeStatus, width: int) -> Panel:
    g = _kv_grid()
    g.add_row("peer", st.peer_id or "—")
    state = st.state or "?"
    g.add_row("state", Text.assemble((state, "bold green" if state == "training" else "yellow"),
                                     f"   up {duration(st.uptime_s)}   pid {st.pid or '—'}"))
    g.add_row("step", f"{st.inner_step:,} inner   clock {st.clock:,}   tokens {human_count(st.tokens)}")
    util = st.compute_utilization
    bar_w = 10
    filled = max(0, min(bar_w, round(util * bar_w)))
    g.add_row("speed", Text.assemble(f"{human_count(st.tokens_per_s)} tok/s   compute ",
                                     ("█" * filled, "green"), ("░" * (bar_w - filled), "dim"), f" {util:.0%}"))
    if st.synthetic_step_s > 0:  # a benchmark's node: its tokens/s and compute share are not a model's
        g.add_row("compute", Text(f"synthetic: {st.synthetic_step_s:.2f} s/step (benchmarks only, no real training)",
                                  style="bold magenta"))
    spark = sparkline([s.loss for s in st.loss_history], max(10, min(40, width // 2 - 36)))
    eval_text = f"   eval {st.eval_curve[-1].loss:.3f}" if st.eval_curve else ""
    g.add_row("loss", Text.assemble((_loss_text(st.loss), "bold"), " ", (spark, "cyan"), eval_text))
    m = st.memory
    g.add_row("memory", f"{human_bytes(m.rss)} (peak {human_bytes(m.peak_rss)})" if m.rss else "—")
    if m.device_allocated is not None:  # an accelerator: what PyTorch holds on it
        total = f" of {human_bytes(m.device_total)}" if m.device_total else ""
        g.add_row(m.device, f"{human_bytes(m.device_allocated)} (peak {human_bytes(m.device_peak or 0)}){total}")
    return Panel(g, title="node", title_align="left", box=box.ROUNDED)


def _network_panel(st: NodeStatus) -> Panel:
    b = st.bytes
    g = _kv_grid()
    g.add_row("up", f"{human_bytes(b.sent_per_s)}/s   total {human_bytes(b.sent)}")
    g.add_row("down", f"{human_bytes(b.received_per_s)}/s   total {human_bytes(b.received)}")
    failed, c_failed = st.syncs_failed, st.consensus.failed
    g.add_row("rounds", Text.assemble(f"{st.syncs_ok} ok   ", (f"{failed} failed", "red" if failed else ""),
                                      f"   {st.standing_rounds} standing   {st.consensus.rounds} consensus",
                                      (f" ({c_failed} failed)" if c_failed else "", "red")))
    loops = st.catch_up_loops
    g.add_row("other", f"{st.catch_ups} catch-ups" + (f" ({st.replays} replayed)" if st.replays else "")
              + (f" ({loops} in a loop)" if loops else "")
              + (f"   {st.stalls_cut} slow rounds left in flight" if st.stalls_cut else ""))
    refused, banned = st.reputation.refused, st.reputation.banned
    g.add_row("peers", Text.assemble((f"{refused} refused", "yellow" if refused else ""), "   ",
                                     (f"{banned} banned", "bold red" if banned else "")))
    if st.solo_steps:
        g.add_row("alone", f"{st.solo_steps} outer steps with no peer")
    g.add_row("reach", _reach_text(st.reachability))
    return Panel(g, title="network", title_align="left", box=box.ROUNDED)


def _reach_text(r: ReachabilityStatus) -> Text:
    """``outbound-only (checked: 0 of 2 peers could dial it)``: the state, how it is known, what it means."""
    style = {"public": "green", "outbound-only": "yellow"}.get(r.state, "dim")
    text = Text(r.state, style=style)
    if r.source == "checked":
        text.append(f" (checked: {r.reachable} of {r.reachable + r.unreachable} peers could dial it)")
    elif r.source:
        text.append(f" ({r.source})", style="dim")
    if r.state == "outbound-only":
        text.append("   reduces no part, serves no state", style="dim")
    elif r.inbound_streams:
        text.append(f"   {r.inbound_streams} streams from peers", style="dim")
    if r.undialable:
        text.append(f"   cannot dial {r.undialable} peer{'s' if r.undialable > 1 else ''} (kept out of its groups)",
                    style="yellow")
    return text


def _spread_text(sp: Spread | None) -> Text:
    if sp is None:
        return Text("—", style="dim")
    if sp.version is None:
        return Text(f"alone (max v{sp.max_version})", style="dim")
    text = Text(f"{sp.holders} at v{sp.version} ")
    agree = sp.distinct_hashes == 1
    text.append("agree" if agree else f"{sp.distinct_hashes} hashes", style="green" if agree else "bold yellow")
    if sp.max_lag:
        text.append(f", lag {sp.max_lag}", style="yellow")
    return text


def _fragments_table(st: NodeStatus, width: int) -> Table:
    now = st.now or time.time()
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
    for f in st.fragments:
        stale = "—" if f.last_merge_clock is None else f"{max(0, st.clock - f.last_merge_clock)} steps"
        q = f.quant_error
        row = [str(f.fragment), f"v{f.version}", ago(f.last_merge_time, now), stale, str(f.group_size or "—"),
               human_bytes(f.bytes_sent), human_bytes(f.bytes_received), "—" if q is None else f"{q:.1%}",
               _spread_text(f.spread)]
        if width >= 120:
            row.append(human_count(f.numel))
        t.add_row(*row)
    return t


def _peer_row(pid: str, peer: PeerStatus, now: float, id_width: int, this_node: bool = False) -> list[Any]:
    """One row of the swarm table. What this node refused of the peer is known in a node's status only
    (:class:`NodePeerStatus`; the swarm view has the heartbeats alone: "—")."""
    versions = " ".join(f"v{peer.fragments[k]}" for k in sorted(peer.fragments)) or "—"
    name = Text(short_id(pid, id_width) + (" (this node)" if this_node else ""), style="bold" if this_node else "")
    judged = isinstance(peer, NodePeerStatus)
    if judged and peer.banned:
        name.append(" banned", style="bold red")
    refused = "" if this_node else str(peer.refused) if judged else "—"
    refused_text = Text(refused, style="yellow" if judged and peer.refused else "dim")
    reach = Text(peer.reachability or "—", style="yellow" if peer.reachability == "outbound-only" else
                 "dim" if peer.reachability in ("", "unknown") else "")
    return [name, f"{peer.inner_step:,}", f"{peer.clock:,}", human_count(peer.tokens_per_s), _loss_text(peer.loss),
            versions, reach, refused_text, "now" if this_node else ago(peer.time, now)]


def _swarm_table(peers: Mapping[str, PeerStatus], now: float, width: int, title: str,
                 this_node: tuple[str, PeerStatus] | None = None) -> Table:
    """The peers, this node's own row first when there is one (``this_node``: its id and figures)."""
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
    t.add_column("reach", no_wrap=True)
    t.add_column("refused", justify="right", no_wrap=True)
    t.add_column("last seen", justify="right", no_wrap=True)
    if this_node is not None:
        t.add_row(*_peer_row(*this_node, now, id_width, this_node=True))
    for pid, peer in sorted(peers.items(), key=lambda kv: (-kv[1].clock, kv[0])):
        t.add_row(*_peer_row(pid, peer, now, id_width))
    if not peers:
        t.add_row(Text("no other peer has a live heartbeat" if this_node else "no peer has a live heartbeat",
                       style="dim"), "", "", "", "", "", "", "", "")
    return t


def _own_row(st: NodeStatus) -> tuple[str, PeerStatus] | None:
    """This node as a row of its swarm table (None before it has an id)."""
    if not st.peer_id:
        return None
    return st.peer_id, PeerStatus(clock=st.clock, inner_step=st.inner_step, tokens_per_s=st.tokens_per_s,
                                  loss=st.loss, fragments={f.fragment: f.version for f in st.fragments},
                                  reachability=st.reachability.state)


def _kinds_text(r: PeerReputation) -> Text:
    """``forged_sender 2, non_member 1 · last non_member: ...``: why, then the latest detail."""
    kinds = sorted(r.by_kind.items(), key=lambda kv: (-kv[1], kv[0]))
    text = Text(", ".join(f"{k} {n}" for k, n in kinds))
    if r.last:
        text.append(f" · last {r.last}", style="dim")
    return text


def _reputation_table(st: NodeStatus, width: int, limit: int = 6) -> Table | None:
    """The peers this node refused something of, banned ones first (heartbeat or not: an outsider that
    never joined the swarm shows here only); None when there are none."""
    rep = st.reputation
    if not rep.peers:
        return None
    t = Table(title=f"refused / banned peers ({rep.refused} refused, {rep.banned} banned)", title_justify="left",
              box=box.SIMPLE_HEAD, expand=True, padding=(0, 1), show_edge=False)
    id_width = 52 if width >= 130 else 24 if width >= 110 else 16
    t.add_column("peer", no_wrap=True)
    t.add_column("heartbeat", no_wrap=True)
    t.add_column("refused", justify="right", no_wrap=True)
    t.add_column("offences", justify="right", no_wrap=True)
    t.add_column("ban", no_wrap=True)
    t.add_column("refusals by kind · last", no_wrap=True, overflow="ellipsis", ratio=1)
    ranked = sorted(rep.peers.items(), key=lambda kv: (not kv[1].banned, -kv[1].refused, kv[0]))
    for pid, r in ranked[:limit]:
        ban = Text(f"banned {duration(r.banned_for_s)}", style="bold red") if r.banned else Text("—", style="dim")
        live = Text("live", style="green") if pid in st.peers else Text("none", style="dim")
        t.add_row(short_id(pid, id_width), live, str(r.refused), str(r.offences), ban, _kinds_text(r))
    if len(ranked) > limit:
        t.add_row(Text(f"… {len(ranked) - limit} more", style="dim"), "", "", "", "", "")
    return t


@dataclass
class _Failures:
    """Failed rounds of one kind and reason, summed up for one row."""

    count: int = 0
    time: float = 0.0
    fragments: set[int] = field(default_factory=set)


def _event_rows(events: Sequence[StatusEvent], limit: int) -> list[tuple[float, str, int, str]]:
    """``(time, kind, count, detail)`` rows, oldest first: joins, leaves and other news one by one; failed
    rounds, and the progress dropped after several of them, grouped by reason (alone or with a slow or silent
    swarm they repeat every round and would hide the rest: in a CI run, `status --once` beside a silent peer
    no longer showed that peer's join, its last row a "dropped" one)."""
    rows: list[tuple[float, str, int, str]] = []
    failures: dict[tuple[str, str], _Failures] = {}
    for e in events:
        kind = event_kind(e)
        if kind in QUIET_KINDS:
            continue
        if kind in ("failed", "timed_out", "dropped", "folded"):
            reason = e.detail.split(": ", 1)[1] if ": " in e.detail else e.detail
            group = failures.setdefault((kind, reason), _Failures())
            group.count += 1
            group.time = max(group.time, e.time)
            if e.fragment is not None:
                group.fragments.add(e.fragment)
            continue
        rows.append((e.time, kind, 1, e.detail))
    for (kind, reason), g in failures.items():
        frags = sorted(g.fragments)
        where = f" (fragment{'s' if len(frags) > 1 else ''} {', '.join(map(str, frags))})" if frags else ""
        rows.append((g.time, kind, g.count, reason + where))
    rows.sort(key=lambda r: r[0])
    return rows[-limit:]


def _events_table(st: NodeStatus, width: int, limit: int = 8) -> Table:
    rows = _event_rows(st.events, limit)
    merged = [e for e in st.events if e.kind == "merged"]
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
        t.add_row(time.strftime("%H:%M:%S", time.localtime(last.time)), Text("merged", style="dim"),
                  Text(f"{len(merged)} recent rounds merged; last: fragment {last.fragment} "
                       f"v{last.version} with {last.group_size} peers, "
                       f"{human_bytes(last.bytes_sent)} up / {human_bytes(last.bytes_received)} "
                       f"down", style="dim"))
    if not rows and not merged:
        t.add_row("", "", Text("none yet", style="dim"))
    return t


def _header(swarm: str, fingerprint: str, now: float, via: str = "") -> Text:
    text = Text()
    text.append(" locoswarm ", style="bold white on blue")
    text.append(f"  swarm {swarm or '?'}", style="bold")
    text.append(f"   fingerprint {fingerprint or '?'}")
    if now:
        text.append(f"   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}", style="dim")
    if via:
        head, sep, pid = via.rpartition("/p2p/")
        text.append(f"\n no local node: the swarm's DHT through {head}{sep}{short_id(pid, 24) if sep else via}",
                    style="dim")
    return text


def render(status: NodeStatus | SwarmView, width: int = 120, live: bool = True) -> RenderableType:
    """One frame of ``locoswarm status`` for a terminal ``width`` columns wide: a node's status (through
    its control API) or, without a local node (``status --swarm``), the swarm seen from its DHT. ``live``: the
    frame is redrawn every second (its footer says how to quit); ``status --once`` prints one without it."""
    footer = Text(" Ctrl+C to quit · refreshed every second" if live else "", style="dim")
    if isinstance(status, SwarmView):
        note = [Text(f" {status.note}", style="yellow")] if status.note else []
        return Group(_header(status.swarm, status.fingerprint, status.now, status.via),
                     _swarm_table(status.peers, status.now or time.time(), width, title="swarm"), *note,
                     _swarm_fragments(status.spread), footer)
    top = Table.grid(expand=True, padding=(0, 1))
    top.add_column(ratio=3)
    top.add_column(ratio=2)
    top.add_row(_node_panel(status, width), _network_panel(status))
    reputation = _reputation_table(status, width)
    swarm = _swarm_table(status.peers, status.now or time.time(), width, "swarm", this_node=_own_row(status))
    return Group(_header(status.swarm, status.fingerprint, status.now), top, _fragments_table(status, width), swarm,
                 *([reputation] if reputation is not None else []), _events_table(status, width), footer)


def _swarm_fragments(spread: dict[int, Spread]) -> Table:
    """Swarm view: the consensus measure per fragment, from the peers' heartbeats only."""
    t = Table(title="fragments across peers", title_justify="left", box=box.SIMPLE_HEAD, expand=True, padding=(0, 1),
              show_edge=False)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("max version", justify="right", no_wrap=True)
    t.add_column("spread across peers", ratio=1, no_wrap=True)
    for frag, sp in sorted(spread.items()):
        t.add_row(str(frag), f"v{sp.max_version}", _spread_text(sp))
    if not spread:
        t.add_row("", "", Text("no fragment versions published yet", style="dim"))
    return t


__all__ = ["ago", "duration", "event_kind", "human_bytes", "human_count", "render", "short_id", "sparkline"]
