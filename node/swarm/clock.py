"""The swarm clock: swarm-wide progress counted in inner steps, the time base of rounds.

Rounds of fragment p happen at clock values t with ``t % H == offset_p`` (``node.core.schedule``), and
all members of a round must name it by the same t, so every node needs about the same clock at the
same moment, advancing at about the pace of the fastest honest node's inner steps (a slower node
adopts that pace, so it meets the others in the same rounds; its contribution is weighted by tokens).

How a node's clock moves (:meth:`SwarmClock.tick`, after each of its own inner steps):

- The **leader** is the peer with the smallest peer id among the fast tier: the nodes (this one
  included) whose inner-step rate is within ``tier`` of the fastest known rate and whose clock keeps
  pace with their own steps. The leader counts its own steps: +1 per step.
- Every other node **follows the leader's line**: the leader's last accepted clock extrapolated at the
  leader's inner-step rate (at most ``3 * interval`` ahead). Its clock takes that value, so it may
  stand still while it is ahead of the line; it never goes down. Because a node only follows a peer
  with a smaller id, adoption never runs in a circle: no node re-adopts its own estimate through
  others, which is what made the previous clock (everyone took the max of everyone's extrapolation
  and added +1 per step) run 1.2-1.65x faster than any node's inner steps.
- Any node **catches up** with an accepted peer whose line is more than a small band ahead of it
  (a node that fell behind, a leader that does not see a faster tier yet, nodes that disagree on who
  leads).

What a peer claims is checked before it counts (:meth:`SwarmClock.observe`, judged in
:meth:`SwarmClock.settle`); an implausible claim is ignored and reported through ``on_implausible``:

- a known peer's clock must stay under a ceiling that grows at the fastest plausible step rate
  (the fastest known rate, plus a margin) since its last accepted claim, plus a slack; a claim above
  it is still accepted when the others back it (it is within the slack of the lower median of the
  other peers' lines and this node's own clock);
- a peer's first claim, one after a gap of ``4 * interval``, or one after a restart (its clock went
  back) is checked against that lower median only; a lone peer cannot be contradicted;
- inner steps that go back (a restart) or jump (a checkpoint load) reset the peer's rate instead of
  being read as a huge rate; a rate above ``rate_ratio`` times the median of the known rates (or
  ``max_rate``) is never used; timestamps are clamped to this node's own observation times.

All times are seconds of one clock function (``now``; wall time by default, as heartbeat times are).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

MAX_CLOCK = 2**53        # beyond this a clock is absurd (and no longer exact as a float)
MIN_SLACK = 16           # steps a claim may exceed its bound by, whatever the rates
MIN_BAND = 4             # steps a peer must be ahead before this node catches up with it
JUMP_RATIO = 3.0         # a peer's heartbeat pair this much faster than its usual pace is a jump, not a rate


class HeartbeatLike(Protocol):
    clock: int
    inner_step: int
    time: float
    has_state: bool


@dataclass(frozen=True)
class Claim:
    """One heartbeat's claim: the peer's clock and inner steps at its timestamp ``time``, seen by this
    node at its own time ``seen``."""

    clock: int
    inner_step: int
    time: float
    seen: float


def lower_median(values: list[float]) -> float:
    """The lower median: with two values, the smaller (a high claim needs a majority behind it)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class StepRate:
    """Inner steps per second over a sliding window of (time, inner step, clock) samples.

    With ``jump_ratio`` (a peer's heartbeats), a sample pair more than ``jump_ratio`` times faster than
    the median pair is a jump (a checkpoint load, a restart), not a rate: only what follows it counts,
    and no rate is given before two pairs can be compared.
    """

    def __init__(self, window: float, min_span: float, jump_ratio: float | None = None) -> None:
        self.window = window
        self.min_span = min_span
        self.jump_ratio = jump_ratio
        self._samples: deque[tuple[float, int, int]] = deque()
        self._rate: float | None = None

    def reset(self) -> None:
        self._samples.clear()
        self._rate = None

    def add(self, t: float, steps: int, clock: int) -> None:
        if self._samples and t <= self._samples[-1][0]:
            return
        self._samples.append((t, steps, clock))
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window:
            self._samples.popleft()
        self._rate = self._estimate()

    def rate(self) -> float | None:
        """Steps per second, or None while the samples span less than ``min_span``."""
        return self._rate

    def _estimate(self) -> float | None:
        first, last = self._samples[0], self._samples[-1]
        if self.jump_ratio is not None:
            samples = list(self._samples)
            pairs = [(b[0] - a[0], b[1] - a[1]) for a, b in pairwise(samples)]
            if len(pairs) < 2:
                return None
            median = lower_median([ds / dt for dt, ds in pairs])
            jumps = [i for i, (dt, ds) in enumerate(pairs) if ds > self.jump_ratio * median * dt + 2]
            if jumps:
                first = samples[jumps[-1] + 1]
        span = last[0] - first[0]
        return (last[1] - first[1]) / span if span >= self.min_span else None

    def keeps_pace(self, tier: float) -> bool:
        """Whether the clock advanced at least about as much as the inner steps over the window, as
        a leader's does (a node that lets the swarm clock fall behind cannot lead it)."""
        if len(self._samples) < 2:
            return False
        (_, s0, c0), (_, s1, c1) = self._samples[0], self._samples[-1]
        return c1 - c0 >= (1.0 - tier) * (s1 - s0) - 2


class PeerClock:
    """What this node accepted from one peer: its last clock claim anchored at a local time, its
    inner-step rate and the ceiling its next claim must stay under."""

    def __init__(self, claim: Claim, anchor: float, now: float, slack: float, window: float, min_span: float) -> None:
        self.clock = claim.clock
        self.inner_step = claim.inner_step
        self.anchor = anchor
        self.accepted_at = now
        self.steps = StepRate(window, min_span, jump_ratio=JUMP_RATIO)
        self.steps.add(anchor, claim.inner_step, claim.clock)
        self._ceiling = claim.clock + slack
        self._ceiling_at = now

    def rate(self, cap: float) -> float | None:
        rate = self.steps.rate()
        return None if rate is None else min(rate, cap)

    def line(self, now: float, max_ahead: float, cap: float) -> float:
        """The peer's clock now: its last accepted clock, extrapolated at its own inner-step rate."""
        ahead = min(max(0.0, now - self.anchor), max_ahead)
        return self.clock + (self.rate(cap) or 0.0) * ahead

    def ceiling(self, now: float, cap_rate: float) -> float:
        """The highest clock this peer may claim now: the ceiling grows at ``cap_rate`` steps/s."""
        return self._ceiling + cap_rate * max(0.0, now - self._ceiling_at)

    def accept(self, claim: Claim, anchor: float, now: float, *, slack: float, cap_rate: float,
               rate_cap: float) -> None:
        went_back = claim.inner_step < self.inner_step or claim.clock < self.clock
        span = anchor - self.anchor
        jumped = span > 0 and claim.inner_step - self.inner_step > rate_cap * span + 2
        if went_back or jumped:
            self.steps.reset()  # a restart or a checkpoint load: not a rate
        self.steps.add(anchor, claim.inner_step, claim.clock)
        # Token-bucket ceiling: slack once, not per heartbeat, so small lies cannot add up.
        self._ceiling = min(self.ceiling(now, cap_rate), claim.clock + slack)
        self._ceiling_at = now
        self.clock, self.inner_step = claim.clock, claim.inner_step
        self.anchor = max(self.anchor, anchor)
        self.accepted_at = now


@dataclass(frozen=True)
class _View:
    """What this node knows at one moment: live peers, known rates (capped) and the bounds from them."""

    now: float
    live: dict[str, PeerClock]
    rates: dict[str, float]
    rate_cap: float
    fastest: float
    max_ahead: float
    cap_rate: float
    slack: float
    band: float

    def line(self, peer: PeerClock) -> float:
        """The peer's clock now, extrapolated at its own inner-step rate (a leader's pace)."""
        return peer.line(self.now, self.max_ahead, self.rate_cap)

    def report(self, reports: list[tuple[str, str]], item: tuple[str, str]) -> None:
        """Report an ignored claim, unless no rate is known yet: then claims made at different times
        cannot be compared precisely, and an honest peer could be taken for a liar."""
        if self.rates:
            reports.append(item)

    def swarm_line(self, clock: int, anchor: float) -> float:
        """A clock claimed at ``anchor``, brought to now at the fastest known rate: the pace of every
        clock of the swarm, followers' included (their own inner steps are slower)."""
        return clock + self.fastest * min(max(0.0, self.now - anchor), self.max_ahead)


class SwarmClock:
    """This node's swarm clock (see the module docstring).

    Args:
        peer_id: this node's peer id (the leader is the smallest id of the fast tier).
        interval: this node's heartbeat interval in seconds (how often it refreshes its peer table).
        clock: the clock to start from (a checkpoint's), until :meth:`join`.
        on_implausible: called with ``(peer_id, detail)`` for every ignored claim.
        now: the time function (wall time; heartbeat times are wall time too).
        tier: a node within this fraction of the fastest rate may lead.
        rate_ratio, max_rate: a rate above ``rate_ratio`` times the median known rate, or above
            ``max_rate`` steps/s, is not used.
        rate_margin: a clock may run this fraction faster than the fastest known rate.
    """

    def __init__(self, peer_id: str, interval: float, *, clock: int = 0,
                 on_implausible: Callable[[str, str], None] | None = None, now: Callable[[], float] = time.time,
                 tier: float = 0.1, rate_ratio: float = 20.0, max_rate: float = 10_000.0,
                 rate_margin: float = 0.25) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")
        self.peer_id = peer_id
        self.interval = float(interval)
        self.on_implausible = on_implausible
        self.tier = tier
        self.rate_ratio = rate_ratio
        self.max_rate = max_rate
        self.rate_margin = rate_margin
        self.max_ahead = 3.0 * self.interval   # extrapolation limit; an older heartbeat cannot lead
        self.gap = 4.0 * self.interval         # a peer unheard of for longer is judged afresh
        self._window = 8.0 * self.interval
        self._now = now
        self._clock = max(0, int(clock))
        self._established = False              # own clock counts as a witness only after join()
        self._own = StepRate(self._window, 0.5 * self.interval)
        self._peers: dict[str, PeerClock] = {}
        self._seen: dict[str, float] = {}      # newest peer timestamp judged, per peer
        self._pending: dict[str, Claim] = {}
        self._lock = threading.Lock()

    # ---- the node's calls ------------------------------------------------------------------------
    @property
    def value(self) -> int:
        with self._lock:
            return self._clock

    def observe(self, peer_id: str, clock: int, inner_step: int, time: float) -> None:
        """One heartbeat of a peer (judged at the next :meth:`settle`, :meth:`tick` or :meth:`join`,
        together with the other claims seen since, so first claims can contradict each other)."""
        claim = Claim(int(clock), int(inner_step), float(time), self._now())
        with self._lock:
            self._pending[str(peer_id)] = claim

    def observe_table(self, heartbeats: Mapping[str, HeartbeatLike]) -> None:
        """The daemon's refreshed peer table: observe every peer that trains (a joining peer's clock
        is not yet the swarm's), forget the others, and judge the claims."""
        with self._lock:
            for pid in [p for p in self._peers if p not in heartbeats or not heartbeats[p].has_state]:
                del self._peers[pid]
            for pid in [p for p in self._seen if p not in heartbeats]:
                del self._seen[pid]
        for pid, hb in heartbeats.items():
            if hb.has_state:
                self.observe(pid, hb.clock, hb.inner_step, hb.time)
        self.settle()

    def settle(self) -> None:
        """Judge the claims observed since the last call."""
        with self._lock:
            reports = self._settle(self._now())
        self._report(reports)

    def tick(self, inner_step: int) -> int:
        """After this node's inner step number ``inner_step``: the node's clock (never lower than before)."""
        now = self._now()
        with self._lock:
            reports = self._settle(now)
            self._own.add(now, int(inner_step), self._clock)
            self._clock = self._advance(self._view(now))
            clock = self._clock
        self._report(reports)
        return clock

    def join(self, own_clock: int) -> int:
        """Entering the swarm (after the state download): take the swarm's clock, the highest line of
        the accepted peers (first claims judged against each other: a lying peer's huge clock is not
        taken when others contradict it), or ``own_clock`` when no peer trains. From here on this
        node's clock also counts as a witness against other peers' claims."""
        now = self._now()
        with self._lock:
            reports = self._settle(now)
            view = self._view(now)
            lines = [view.line(p) for p in view.live.values()]
            self._clock = min(MAX_CLOCK, int(max(lines))) if lines else max(0, int(own_clock))
            self._established = True
            clock = self._clock
        self._report(reports)
        return clock

    # ---- judging claims --------------------------------------------------------------------------
    def _settle(self, now: float) -> list[tuple[str, str]]:
        reports: list[tuple[str, str]] = []
        batch, self._pending = self._pending, {}
        firsts: dict[str, Claim] = {}
        for pid, claim in batch.items():
            stamp = claim.time if math.isfinite(claim.time) else math.inf  # NaN would never compare as seen
            if stamp <= self._seen.get(pid, -math.inf):
                continue  # the same heartbeat again (the table is re-read every interval), or an older one
            self._seen[pid] = stamp
            if stamp == math.inf or not 0 <= claim.clock <= MAX_CLOCK or not 0 <= claim.inner_step <= MAX_CLOCK:
                reports.append((pid, f"absurd heartbeat: clock {claim.clock}, inner step {claim.inner_step}, "
                                     f"time {claim.time}"))
                continue
            peer = self._peers.get(pid)
            if peer is None or claim.seen - peer.accepted_at > self.gap or claim.clock < peer.clock:
                firsts[pid] = claim  # new, back after a gap, or restarted: judged against the others
            else:
                self._judge_known(pid, peer, claim, self._view(now), reports)
        for pid, claim in firsts.items():
            self._judge_first(pid, claim, [c for q, c in firsts.items() if q != pid], self._view(now), reports)
        return reports

    def _judge_known(self, pid: str, peer: PeerClock, claim: Claim, view: _View,
                     reports: list[tuple[str, str]]) -> None:
        ceiling = peer.ceiling(claim.seen, view.cap_rate)
        if claim.clock > ceiling:
            ref = self._reference(view, pid, [])
            if ref is None or view.swarm_line(claim.clock, self._anchor(claim)) > ref + view.slack:
                view.report(reports, (pid, f"clock {claim.clock} above its bound {int(ceiling)} (it claimed "
                                           f"{peer.clock} {claim.seen - peer.accepted_at:.1f} s before; fastest "
                                           f"plausible rate {view.cap_rate:.1f}/s)"))
                return
        peer.accept(claim, self._anchor(claim), claim.seen, slack=view.slack, cap_rate=view.cap_rate,
                    rate_cap=view.rate_cap)

    def _judge_first(self, pid: str, claim: Claim, others: list[Claim], view: _View,
                     reports: list[tuple[str, str]]) -> None:
        ref = self._reference(view, pid, others)
        if ref is not None and view.swarm_line(claim.clock, self._anchor(claim)) > ref + view.slack:
            view.report(reports, (pid, f"clock {claim.clock} more than {view.slack:.0f} steps above the swarm's "
                                       f"{ref:.0f} (the lower median of the other peers and this node)"))
            return
        self._peers[pid] = PeerClock(claim, self._anchor(claim), claim.seen, view.slack, self._window,
                                      0.5 * self.interval)

    def _reference(self, view: _View, exclude: str, extra: list[Claim]) -> float | None:
        """The swarm's clock now according to the others: the lower median of this node's clock (once
        joined), the other accepted peers' clocks and ``extra`` (the other first claims being judged),
        each brought to now at the swarm's pace; None without witnesses."""
        witnesses = [view.swarm_line(c.clock, self._anchor(c)) for c in extra]
        witnesses += [view.swarm_line(p.clock, p.anchor) for q, p in view.live.items() if q != exclude]
        if self._established:
            witnesses.append(float(self._clock))
        return lower_median(witnesses) if witnesses else None

    def _anchor(self, claim: Claim) -> float:
        """The heartbeat's time on this node's clock: the peer's timestamp, but never after this node
        saw it nor more than ``max_ahead`` before (a skewed or lying timestamp moves nothing far)."""
        return min(claim.seen, max(claim.seen - self.max_ahead, claim.time))

    # ---- rates and bands -------------------------------------------------------------------------
    def _view(self, now: float) -> _View:
        """The live peers and the rates and bounds derived from them, at ``now``."""
        live = {pid: p for pid, p in self._peers.items() if now - p.accepted_at <= self.gap}
        rates = {pid: r for pid, p in live.items() if (r := p.steps.rate()) is not None}
        own = self._own.rate()
        if own is not None:
            rates[self.peer_id] = own
        positive = [r for r in rates.values() if r > 0]
        # No rate above this is used: rate_ratio times the median of the known rates.
        rate_cap = min(self.max_rate, self.rate_ratio * lower_median(positive) if positive else self.max_rate)
        rates = {pid: min(r, rate_cap) for pid, r in rates.items()}
        fastest = max(rates.values(), default=0.0)
        return _View(
            now=now, live=live, rates=rates, rate_cap=rate_cap, fastest=fastest, max_ahead=self.max_ahead,
            # how fast any clock may plausibly run: the fastest known rate plus a margin
            cap_rate=(1.0 + self.rate_margin) * fastest if rates else self.max_rate,
            # steps a claim may exceed its bound by: polling jitter and extrapolation error
            slack=MIN_SLACK + 3.0 * (1.0 + self.rate_margin) * fastest * self.interval,
            # how far a peer must be ahead before this node catches up with it outside the leader rule
            band=MIN_BAND + 2.0 * fastest * self.interval)

    # ---- this node's clock -----------------------------------------------------------------------
    def _leader(self, view: _View) -> str | None:
        """The peer this node follows (None: this node counts its own steps)."""
        rates = {pid: r for pid, r in view.rates.items() if pid == self.peer_id or (
            view.live[pid].steps.keeps_pace(self.tier)
            and view.now - view.live[pid].anchor <= self.max_ahead)}  # a leader gone silent is not followed
        if not rates:
            return None
        fastest = max(rates.values())
        leader = min(pid for pid, r in rates.items() if r >= (1.0 - self.tier) * fastest)
        return None if leader == self.peer_id else leader

    def _advance(self, view: _View) -> int:
        clock = self._clock
        nxt = float(clock + 1)
        leader = self._leader(view)
        if leader is not None:
            line = view.line(view.live[leader])
            if line >= clock - view.band:  # far behind us: the leader is not tracking; count our own steps
                nxt = max(float(clock), math.floor(line))
        top = max((view.line(p) for p in view.live.values()), default=-math.inf)
        if top > nxt + view.band:
            nxt = math.floor(top)
        return min(MAX_CLOCK, max(clock, int(nxt)))

    def _report(self, reports: list[tuple[str, str]]) -> None:
        if self.on_implausible is None:
            return
        for pid, detail in reports:
            self.on_implausible(pid, detail)

