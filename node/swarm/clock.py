"""The swarm clock: swarm-wide progress counted in inner steps, the time base of rounds.

Rounds of fragment p happen at clock values t with ``t % H == offset_p`` (``locoswarm.node.core.schedule``), and
all members of a round name it by that t, so every node needs about the same clock at the same moment.

What the clock is: each node counts its own inner steps (+1 per step) and steers that count toward the
**median** of the clocks of the live peers that train and its own (:meth:`SwarmClock.tick`). The swarm
clock therefore advances at the inner-step pace of the swarm's median node: a faster node's clock runs
a few steps ahead and slows down (it may stand still for a step), a slower node's runs behind and
speeds up, and one far behind (a pause, a late joiner) jumps to the median. On a swarm of equally fast
nodes it advances exactly one per inner step. It never goes down.

A peer's clock "now" is its last accepted heartbeat clock extrapolated at the swarm's *inner-step*
rate (the median of the peers' and this node's measured inner-step rates), never at a rate measured
from clocks: clocks adopt each other's values, and extrapolating those feeds back. That, with taking
the *max* of the extrapolations and adding +1 per step on top, was the old clock's 1.2-1.65x drift:
every overshoot (a peer paused for an eval or a round, extrapolated as if it kept stepping) was
ratcheted in and never given back. A median is not moved by one such peer, nor by one liar.

What a peer claims is checked before it counts (:meth:`SwarmClock.observe`, judged at the next
:meth:`settle`, :meth:`tick` or :meth:`join`); an impossible claim is ignored (the peer's previous
accepted value is kept) and reported to ``on_offence(peer, "clock", detail)``:

- between two heartbeats of a known peer, its inner steps may not advance faster than ``max_rate``
  and its clock not faster than ``rate_factor`` times the swarm's inner-step rate (``max_rate``
  while no rate is known; peers that do not step, e.g. joiners loading state, are no measure of it),
  or the peer's own measured inner-step rate when that is higher, measured on this node's own time,
  plus a slack for polling jitter, unless
  the new clock lands within that slack of the clocks' lower median (an honest node far behind
  jumps to the median: that is catching up, and a CI run saw three such jumps get an honest node
  banned by everyone). Such a claim is ignored, and counted as an offence only when it is more than
  ``FIRST_CLAIM_ABSURD`` times beyond both bounds: this node's rates may be the stale ones;
- a peer's first claim (new, or back after a silence of ``4 * interval``) may not be more than that
  slack above the lower median of the clocks: its own, this node's once joined, the other accepted
  peers' and the other first claims seen together (so a high clock stands where at least half the
  clocks are as high); a lone first claim cannot be contradicted. Such a claim is ignored, and counted
  as an offence only when it is more than ``FIRST_CLAIM_ABSURD`` times the other *peers'* lower median
  plus the slack: the witnesses may be the wrong ones (fresh joiners at clock 0 against a node that
  trained alone), and this node's own clock convicts nobody alone, since a node held up by its failed
  rounds is the one that fell behind (a docker CI run: such a node banned both honest peers);
- a clock or inner step that goes back is a restart (it resumed from a checkpoint): accepted, and the
  peer's rate is measured afresh instead of reading the checkpoint load as a huge rate; a value that
  is negative, beyond 2**53, or a non-finite timestamp is absurd.

Banned peers (``is_banned``) and peers not heard of for ``4 * interval`` do not count. All times are
seconds of one clock function (``now``; wall time by default, as heartbeat times are).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

MAX_CLOCK = 2**53        # beyond this a clock is absurd (and no longer exact as a float)
MIN_SLACK = 16           # steps a claim may exceed its bound by, whatever the rates
MIN_BAND = 4             # steps behind the median beyond which this node jumps instead of steering
GAIN = 0.1               # share of the distance to the median closed per inner step
FIRST_CLAIM_ABSURD = 4.0  # a first claim this many times the others' median (plus slack) is an offence

Report = tuple[str, str, bool]  # (peer, why its claim was ignored, whether that is an offence)


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
    """Inner steps per second over a sliding window of (time, inner step) samples."""

    def __init__(self, window: float, min_span: float) -> None:
        self.window = window
        self.min_span = min_span
        self._samples: deque[tuple[float, int]] = deque()

    def reset(self) -> None:
        self._samples.clear()

    def add(self, t: float, steps: int) -> None:
        if self._samples and t <= self._samples[-1][0]:
            return
        self._samples.append((t, steps))
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Steps per second, or None while the samples span less than ``min_span`` seconds."""
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= self.min_span else None


class PeerClock:
    """What this node accepted from one peer: its last clock and inner step, when (its timestamp,
    clamped to this node's time: ``anchor``; this node's time: ``accepted_at``) and its step rate."""

    def __init__(self, claim: Claim, anchor: float, window: float, min_span: float) -> None:
        self.steps = StepRate(window, min_span)
        self.clock = claim.clock
        self.inner_step = claim.inner_step
        self.anchor = anchor
        self.accepted_at = claim.seen
        self.steps.add(anchor, claim.inner_step)

    def went_back(self, claim: Claim) -> bool:
        return claim.clock < self.clock or claim.inner_step < self.inner_step

    def accept(self, claim: Claim, anchor: float) -> None:
        restarted = self.went_back(claim)
        if restarted:
            self.steps.reset()  # a restart: what it did before is no rate
        self.steps.add(anchor, claim.inner_step)
        self.clock, self.inner_step = claim.clock, claim.inner_step
        self.anchor = anchor if restarted else max(self.anchor, anchor)
        self.accepted_at = claim.seen

    def line(self, now: float, rate: float, max_ahead: float) -> float:
        """The peer's clock now: its last accepted clock, extrapolated at ``rate`` (at most ``max_ahead`` s)."""
        return self.clock + rate * min(max(0.0, now - self.anchor), max_ahead)


@dataclass(frozen=True)
class _Bounds:
    """The rates and bounds of one moment: the swarm's inner-step rate (None while unknown), how fast a
    clock may advance, the slack on top and the lag beyond which this node jumps to the median."""

    rate: float | None
    clock_rate: float
    slack: float
    tolerance: float
    band: float


class SwarmClock:
    """This node's swarm clock (see the module docstring).

    Args:
        peer_id: this node's peer id.
        interval: the heartbeat interval in seconds (how often peer tables are refreshed).
        clock: the clock to start from (a checkpoint's), until :meth:`join`.
        on_offence: called with ``(peer_id, "clock", detail, offence=...)`` for every ignored claim.
        is_banned: peers for which it returns True do not count.
        now: the time function (wall time: heartbeat timestamps are wall time too).
        rate_factor: a clock may advance this many times faster than the swarm's inner-step rate.
        max_rate: no inner-step rate above this (steps/s) is possible; the clock bound while no rate is known.
    """

    def __init__(self, peer_id: str, interval: float, *, clock: int = 0,
                 on_offence: Callable[..., object] | None = None,
                 is_banned: Callable[[str], bool] | None = None, now: Callable[[], float] = time.time,
                 rate_factor: float = 4.0, max_rate: float = 10_000.0) -> None:
        if interval <= 0 or rate_factor < 1 or max_rate <= 0:
            raise ValueError(f"need interval > 0, rate_factor >= 1, max_rate > 0 (got {interval}, {rate_factor}, "
                             f"{max_rate})")
        self.peer_id = str(peer_id)
        self.interval = float(interval)
        self.on_offence = on_offence
        self.is_banned = is_banned
        self.rate_factor = float(rate_factor)
        self.max_rate = float(max_rate)
        self.max_ahead = 2.0 * self.interval   # extrapolation limit: a table is refreshed every interval
        self.gap = 4.0 * self.interval         # a peer unheard of for longer is judged afresh
        self._window = 8.0 * self.interval
        self._now = now
        self._clock = max(0, int(clock))
        self._pos = float(self._clock)         # the clock with its fraction (steering moves it by fractions)
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

    def peer_clock(self, peer_id: str) -> int | None:
        """The last clock accepted from ``peer_id`` (None if none is)."""
        with self._lock:
            peer = self._peers.get(str(peer_id))
            return None if peer is None else peer.clock

    def rate(self) -> float | None:
        """The swarm's inner-step rate (steps/s) as this node measures it; None while unknown."""
        with self._lock:
            return self._bounds(self._live(self._now())).rate

    def observe(self, peer_id: str, clock: int, inner_step: int, time: float) -> None:
        """One heartbeat of a peer, judged at the next :meth:`settle`, :meth:`tick` or :meth:`join`
        together with the others seen since (so first claims can contradict each other)."""
        claim = Claim(int(clock), int(inner_step), float(time), self._now())
        with self._lock:
            self._pending[str(peer_id)] = claim

    def observe_table(self, heartbeats: Mapping[str, HeartbeatLike]) -> None:
        """The daemon's refreshed peer table: observe every peer that trains (a joining peer's clock is
        not yet the swarm's), forget the others, and judge the claims."""
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
            self._own.add(now, int(inner_step))
            self._advance(now)
            clock = self._clock
        self._report(reports)
        return clock

    def estimate(self) -> int:
        """The swarm's clock as this node sees it now, changing nothing: the median of the accepted live peers'
        clocks (extrapolated) and this node's own once it has joined; its own without peers. A joiner bounds
        the versions it believes by it before it has a clock of its own (``locoswarm.node.swarm.versions``)."""
        now = self._now()
        with self._lock:
            live = self._live(now)
            rate = self._bounds(live).rate or 0.0
            lines = [p.line(now, rate, self.max_ahead) for p in live.values()]
            if self._established or not lines:
                lines.append(float(self._clock))
            return max(self._clock, int(statistics.median(lines)))

    def join(self, own_clock: int) -> int:
        """Entering the swarm (after the state download): take the median of the accepted peers' clocks,
        or ``own_clock`` when no peer trains. From here on this node's clock is also a witness."""
        now = self._now()
        with self._lock:
            reports = self._settle(now)
            live = self._live(now)
            rate = self._bounds(live).rate or 0.0
            lines = [p.line(now, rate, self.max_ahead) for p in live.values()]
            start = statistics.median(lines) if lines else max(0, int(own_clock))
            self._clock = min(MAX_CLOCK, max(0, int(start)))
            self._pos = float(self._clock)
            self._established = True
            clock = self._clock
        self._report(reports)
        return clock

    # ---- judging claims --------------------------------------------------------------------------
    def _settle(self, now: float) -> list[Report]:
        reports: list[Report] = []
        batch, self._pending = self._pending, {}
        firsts: dict[str, Claim] = {}
        bounds = self._bounds(self._live(now))
        for pid, claim in batch.items():
            stamp = claim.time if math.isfinite(claim.time) else math.inf  # NaN would never compare as seen
            if stamp <= self._seen.get(pid, -math.inf):
                continue  # the same heartbeat again (the table is re-read every interval), or an older one
            self._seen[pid] = stamp
            if stamp == math.inf or not 0 <= claim.clock <= MAX_CLOCK or not 0 <= claim.inner_step <= MAX_CLOCK:
                reports.append((pid, f"absurd heartbeat: clock {claim.clock}, inner step {claim.inner_step}, "
                                     f"time {claim.time}", True))
                continue
            peer = self._peers.get(pid)
            if peer is None or claim.seen - peer.accepted_at > self.gap:
                firsts[pid] = claim  # new, or back after a silence: judged against the others
            else:
                self._judge_known(pid, peer, claim, now, bounds, reports)
        for pid, claim in firsts.items():
            self._judge_first(pid, claim, [c for q, c in firsts.items() if q != pid], now, bounds, reports)
        return reports

    def _judge_known(self, pid: str, peer: PeerClock, claim: Claim, now: float, bounds: _Bounds,
                     reports: list[Report]) -> None:
        if not peer.went_back(claim):
            # Elapsed time on this node's clock: a peer's own timestamps cannot stretch its allowance.
            elapsed = max(0.0, claim.seen - peer.accepted_at)
            steps, clock = claim.inner_step - peer.inner_step, claim.clock - peer.clock
            max_steps = self.max_rate * elapsed + bounds.slack
            # A clock advances one per own inner step (alone, or on a swarm of its pace), so the peer's own
            # measured pace counts when above the swarm's: a fast node is not a liar to slow ones.
            pace = max(bounds.rate or 0.0, peer.steps.rate() or 0.0)
            clock_rate = self.rate_factor * pace if pace > 0 else bounds.clock_rate
            max_clock = clock_rate * elapsed + self._slack(clock_rate)
            if steps > max_steps:
                reports.append((pid, f"inner step jumped {peer.inner_step} -> {claim.inner_step} in {elapsed:.1f} s "
                                     f"(at most {max_steps:.0f} possible)", True))
                return
            if clock > max_clock:
                # An honest node far behind (a pause, a slow machine) jumps to the swarm's median clock,
                # and right after joins the rates measured are still the slow start's: a jump that lands
                # within the slack of the clocks' lower median (its own included) is catching up, not a lie.
                line = self._line(claim, now, bounds)
                ref, peers_ref = self._references(pid, line, [], now, bounds)
                if ref is None or line > ref + bounds.slack:
                    # Ignored, but an offence only when far beyond both bounds: this node's view of the swarm
                    # (its rates, its witnesses) may be the stale one. Seen: a node that had just joined,
                    # with its peers' rates still those of their slow starts, banned all three honest peers
                    # for their clocks, and the swarm never formed a round again.
                    absurd = clock > FIRST_CLAIM_ABSURD * max_clock and (
                        peers_ref is None or line > FIRST_CLAIM_ABSURD * (peers_ref + bounds.slack))
                    reports.append((pid, f"clock jumped {peer.clock} -> {claim.clock} in {elapsed:.1f} s (at most "
                                         f"{max_clock:.0f} possible at {clock_rate:.1f} steps/s"
                                         + ("" if ref is None else f", and above the swarm's {ref:.0f}") + ")",
                                    absurd))
                    return
        peer.accept(claim, self._anchor(claim))

    def _line(self, claim: Claim, now: float, bounds: _Bounds) -> float:
        """A claim's clock extrapolated to ``now`` at the swarm's inner-step rate."""
        return claim.clock + (bounds.rate or 0.0) * min(max(0.0, now - self._anchor(claim)), self.max_ahead)

    def _references(self, pid: str, line: float, others: list[Claim], now: float,
                          bounds: _Bounds) -> tuple[float | None, float | None]:
        """What a claim of ``pid``'s at ``line`` is judged against: the lower median of every clock, the claim's own
        included (so a high clock stands where at least half the clocks are as high), with ``others`` (claims judged
        together with it), the accepted live peers and this node's own once joined; None when there is no other
        witness. With it, the lower median of the other peers' clocks alone (None without one): this node's own clock
        convicts no one by itself, since it is the stale one when this node was held up. Seen (docker CI run): a node
        whose failed rounds held it for seconds each fell 3,000 steps behind, and with its own clock as the deciding
        witness it banned both honest peers for their clocks."""
        rate = bounds.rate or 0.0
        peers = [self._line(c, now, bounds) for c in others]
        peers += [p.line(now, rate, self.max_ahead) for q, p in self._live(now).items() if q != pid]
        own = [self._pos] if self._established else []
        if not peers and not own:
            return None, None
        return lower_median([line, *peers, *own]), (lower_median(peers) if peers else None)

    def _judge_first(self, pid: str, claim: Claim, others: list[Claim], now: float, bounds: _Bounds,
                     reports: list[Report]) -> None:
        line = self._line(claim, now, bounds)
        ref, peers_ref = self._references(pid, line, others, now, bounds)
        if ref is not None and line > ref + bounds.slack:
            # Ignored, but an offence only when far beyond the other peers: the other witnesses may be the ones
            # that are wrong. Seen: three joiners whose state downloads failed started at clock 0 and outvoted
            # the node that had trained alone to 155; each banned it for its honest clock, and the swarm
            # never formed a round. Once their clocks come within the slack, its claim is accepted.
            reports.append((pid, f"clock {claim.clock} is more than {bounds.slack:.0f} steps above the swarm's "
                                 f"{ref:.0f} (lower median of the clocks)",
                            peers_ref is not None and line > FIRST_CLAIM_ABSURD * (peers_ref + bounds.slack)))
            return
        self._peers[pid] = PeerClock(claim, self._anchor(claim), self._window, 0.5 * self.interval)

    def _anchor(self, claim: Claim) -> float:
        """The heartbeat's time on this node's clock: the peer's timestamp, but never after this node saw
        it nor more than ``max_ahead`` before (a skewed or lying timestamp moves nothing far)."""
        return min(claim.seen, max(claim.seen - self.max_ahead, claim.time))

    # ---- rates and bounds ------------------------------------------------------------------------
    def _live(self, now: float) -> dict[str, PeerClock]:
        """Accepted peers heard of within ``gap`` and not banned."""
        return {pid: p for pid, p in self._peers.items()
                if now - p.accepted_at <= self.gap and not (self.is_banned is not None and self.is_banned(pid))}

    def _slack(self, clock_rate: float) -> float:
        """Steps a claim may exceed its bound by: a heartbeat's age varies by an interval."""
        return MIN_SLACK + clock_rate * self.interval

    def _bounds(self, live: Mapping[str, PeerClock]) -> _Bounds:
        # Peers that do not step (loading state, evaluating, just joined) say nothing about the swarm's
        # pace: counted as rate 0 they made the median 0 and every honest clock's advance a "jump".
        rates = [r for p in live.values() if (r := p.steps.rate()) is not None and r > 0]
        if (own := self._own.rate()) is not None and own > 0:
            rates.append(own)
        rate = min(statistics.median(rates), self.max_rate) if rates else None
        clock_rate = self.rate_factor * rate if rate is not None else self.max_rate
        return _Bounds(rate=rate, clock_rate=clock_rate, slack=self._slack(clock_rate),
                       tolerance=MIN_BAND + 0.5 * (rate or 0.0) * self.interval,
                       band=2 * MIN_BAND + 3.0 * (rate or 0.0) * self.interval)

    # ---- this node's clock -----------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """One own inner step: +1, steered toward the median of the live clocks (own included)."""
        live = self._live(now)
        if not live:
            self._pos += 1.0
        else:
            bounds = self._bounds(live)
            lines = [p.line(now, bounds.rate or 0.0, self.max_ahead) for p in live.values()]
            median = statistics.median([*lines, self._pos])
            lag = median - self._pos
            if lag > bounds.band or (lag > 1.0 and self._slower(bounds)):
                # Far behind (a long pause), or a node slower than the swarm's median: take the swarm's clock
                # now. A slow node that only steered would stay behind by its tolerance, i.e. arrive at every
                # round long after the others formed their groups.
                self._pos = median
            else:
                # Within ``tolerance`` the lag is the heartbeats' staleness, not a different pace: steering
                # on it would slow every node down (or, with overshooting lines, speed it up).
                excess = math.copysign(max(0.0, abs(lag) - bounds.tolerance), lag)
                self._pos += max(0.0, 1.0 + GAIN * excess)  # ahead: slower, even standing still; behind: faster
        self._pos = min(float(MAX_CLOCK), self._pos)
        self._clock = max(self._clock, math.floor(self._pos))

    def _slower(self, bounds: _Bounds) -> bool:
        """Whether this node steps clearly slower than the swarm's median inner-step rate."""
        own = self._own.rate()
        return own is not None and bounds.rate is not None and own < 0.8 * bounds.rate

    def _report(self, reports: list[Report]) -> None:
        if self.on_offence is None:
            return
        for pid, detail, offence in reports:
            self.on_offence(pid, "clock", detail, offence=offence)


__all__ = ["MAX_CLOCK", "SwarmClock"]
