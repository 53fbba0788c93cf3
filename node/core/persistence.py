"""Persistent deviation: a member whose deviation from its group's centre points the same way round after round.

Centred clipping (``locoswarm.node.core.robust``) bounds what one contribution moves the average by in one round:
its share of the group's weight times the clip radius. That bound holds per round, not over time. Honest
deviations from the centre are mostly minibatch noise: round after round they point in unrelated directions and
their sum grows like the square root of the rounds. A drift (ALIE-like: "a little is enough", Baruch et al.
2019) adds the same pattern every round inside the radius, so its sum grows linearly and the outer momentum
amplifies it further: measured on the tiny preset, +9.3% held-out loss over 180 s while every single round was
inside the bounds.

So a reducer remembers, per sender, fragment and chunk, an exponential average of a fixed sample of that sender's
deviations from the centre (:class:`DeviationMemory`), and measures each new deviation's cosine with it: the
*persistence* of the sender's deviation (0 without history, near 0 for noise, near 1 for a fixed pattern). Honest
members deviate persistently too, since each trains on its own documents (0.3-0.5 on the tiny preset), so a
sender's clip radius shrinks only for persistence above the group's median (``core.robust.persistence_shrink``): a
fixed pattern (0.86-0.90 measured) loses most of its pull away from the centre, while its component along the
centre (its progress) still counts. Nothing is refused or banned for it: an honest member whose data differ more
than the others' loses only that share of its radius. In a pair the two deviations from their mean are opposite,
so equally persistent: a pair cannot tell a drifter from its partner this way.

Memory is bounded: ``samples`` evenly spaced values per chunk, at most ``max_entries`` (sender, fragment, chunk)
entries, the least recently used forgotten first.

That measure needs an honest majority in the group: its centre is the coordinate-wise median, and two drifters
that share a pattern are the median of a group of three. With 4 honest members and 2 such drifters (groups of 3,
so two in five rounds hold both) the honest eval ended 8.3% above a clean run's at equal progress, nobody banned.
So a reducer also remembers each sender's difference from its *own* contribution (the one it trusts), which no
group can move, and keeps per sender an exponential average of that difference's persistence over rounds, its
*standing drift* (:meth:`DeviationMemory.standing_drift`). Between honest members the difference is their data's
and their minibatches', and its persistence is much the same for every honest sender; a drifter's is dominated by
its pattern. A sender whose standing drift exceeds the median of all senders' by ``DRIFT_MARGIN`` has no pull in
this reducer's parts: out of the centre and out of the average, in whichever group. The median is over every sender
this reducer has judged in ``DRIFT_ROUNDS`` rounds or more (at least ``DRIFT_PEERS`` of them), so a minority of the
swarm cannot move it, and where data differ across the swarm, it moves with them.

Muting reaches only the parts honest members reduce: a drifter's own part still held its contribution at full
pull (3 + 1 at d5dd674: muted 534-545 times by each honest node, still +6.9% at equal progress). So each member
publishes whom it mutes (:meth:`DeviationMemory.doubted`, in its match entries), and a member that more than 2/3 of
at least 3 others of the round doubt reduces no part (``locoswarm.node.swarm.averaging.idle_reducers``): it still
contributes, muted, and receives the average; no minority can take an honest member's part that way.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

#: The exponential average's weight of the past: an attack must keep its pattern over several rounds to matter,
#: and a weight of one half lets the average follow a sender within a few rounds.
DECAY = 0.5
SAMPLES = 256
MAX_ENTRIES = 8192
#: Standing drift (module docstring): the weight of the past in a sender's average persistence, the rounds a sender
#: needs before it is judged, the senders the reference needs, and how far above it a sender loses its pull.
DRIFT_DECAY = 0.7
DRIFT_ROUNDS = 4
DRIFT_PEERS = 3
DRIFT_MARGIN = 0.25
MAX_SENDERS = 1024
#: With a ceiling (``[robust] drift_ceiling`` below 1, :class:`DeviationMemory`): a sender muted in SUSTAINED_MUTES of
#: its last SUSTAINED_OF judged rounds is kept apart (``DeviationMemory.apart``) until DOUBT_S after its last mute.
SUSTAINED_MUTES = 6
SUSTAINED_OF = 8
DOUBT_S = 60.0
#: An alarm (:meth:`DeviationMemory.alarm`): this node's effect check saw its held-out loss climb well above the
#: healthiest it held through rounds each within the tolerance (``core.outer_loop.ALARM_SHARE``), the mark of a sum of
#: small harms. For ALARM_S after the last alarm the standing-drift bound is at most ALARM_CEILING, as with a configured
#: ceiling, and a sender that only this ceiling mutes, round after round, is shunned (:meth:`DeviationMemory.shunned`).
#: Why only then: a fixed ceiling separates drifters from honest partners on one corpus (a 2 + 2 drift run: honest
#: 0.37-0.56, drifters 0.77-0.91) but not honest partners on different data (0.61-0.80), who then kept apart for good;
#: with no honest majority the median bound mutes nobody, and two drifters took both honest nodes 10% above their
#: healthiest in 30 rounds (15 s) before the health mark stopped them, +15.2% above clean at worst (robustness bench,
#: 61939bd). An alarm that finds nobody above the ceiling changes nothing.
ALARM_CEILING = 0.75
ALARM_S = 60.0

Key = tuple[str, str, int, int]  # (space, sender, fragment, chunk)


def sample_index(size: int, samples: int = SAMPLES) -> torch.Tensor:
    """The evenly spaced positions of a chunk of ``size`` elements that the memory keeps."""
    return torch.linspace(0, size - 1, min(size, samples)).round().long()


class DeviationMemory:
    """Per (sender, fragment, chunk): the exponential average of a sample of the sender's deviations from its
    groups' centres (see the module docstring). One per reducer (it judges only what it reduced itself).

    ``ceiling`` (``[robust] drift_ceiling``; 1 is off): the standing-drift bound is never above it, whatever the
    senders' median, and a sender muted round after round is kept apart (:meth:`apart`, :meth:`drifting`)."""

    def __init__(self, decay: float = DECAY, samples: int = SAMPLES, max_entries: int = MAX_ENTRIES,
                 ceiling: float = 1.0) -> None:
        self.ceiling = float(ceiling)
        self.decay = float(decay)
        self.samples = int(samples)
        self.max_entries = int(max_entries)
        self._mem: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self._drift: OrderedDict[str, tuple[float, int]] = OrderedDict()  # sender -> (standing drift, rounds)
        self._doubted: set[str] = set()  # senders muted for their standing drift, until they fall well below it
        self._mutes: dict[str, deque[bool]] = {}  # sender -> whether it was muted, in its last judged rounds
        self._alarm_mutes: dict[str, deque[bool]] = {}  # ... whether only an alarm's ceiling muted it (``shunned``)
        self._last_mute: dict[str, float] = {}  # sender -> when it was last muted (monotonic seconds)
        self._alarm_until = -math.inf  # monotonic seconds: until when an alarm caps the bound (``alarm``)

    @property
    def keeps_apart(self) -> bool:
        """Whether a sender muted round after round is kept out of this node's groups and catch-ups (a ceiling)."""
        return self.ceiling < 1.0

    def alarm(self, *, now: float | None = None) -> None:
        """This node's held-out loss climbed through rounds that each passed (``core.outer_loop.ALARM_SHARE``): for
        ``ALARM_S`` the standing-drift bound is at most ``ALARM_CEILING`` and a sender that only this bound mutes,
        round after round, is shunned (:meth:`shunned`)."""
        now = time.monotonic() if now is None else now
        self._alarm_until = max(self._alarm_until, now + ALARM_S)

    def alarmed(self, *, now: float | None = None) -> bool:
        """Whether an alarm (:meth:`alarm`) holds at ``now``."""
        return (time.monotonic() if now is None else now) < self._alarm_until

    def _ceiling(self, now: float) -> float:
        """The ceiling in force: the configured one, and during an alarm at most ``ALARM_CEILING``."""
        return min(self.ceiling, ALARM_CEILING) if self.alarmed(now=now) else self.ceiling

    def round(self, fragment: int, senders: Sequence[str], chunks: Sequence[int]) -> DeviationRound:
        """A reduction of ``chunks`` (global chunk indices, in the part's order) of ``fragment`` with one row per
        sender: observe its deviations chunk by chunk, read the persistence, then commit."""
        return DeviationRound(self, fragment, list(senders), list(chunks))

    def own_round(self, fragment: int, senders: Sequence[str], chunks: Sequence[int]) -> DeviationRound:
        """Like :meth:`round`, for the senders' differences from the reducer's own contribution (kept apart from
        their deviations from the centre); feed its persistence to :meth:`standing_drift`."""
        return DeviationRound(self, fragment, list(senders), list(chunks), space="own")

    def standing_drift(self, senders: Sequence[str], persistence: Sequence[float | None], *,
                       now: float | None = None) -> list[str | None]:
        """Fold each sender's persistence of its difference from our own (None: not measured, e.g. our own row or
        no history yet) into its standing drift, and say per sender why it has no pull (None: it keeps it). The
        bound is the judged senders' median plus ``DRIFT_MARGIN``, never above the ceiling (without ``DRIFT_PEERS``
        judged senders, the ceiling alone). ``now`` (monotonic seconds) stamps a mute."""
        now = time.monotonic() if now is None else now
        self.fold(senders, persistence)
        ref, ceiling = self.reference(), self._ceiling(now)
        if ref is None and ceiling >= 1.0:
            return [None] * len(senders)
        by_median = math.inf if ref is None else ref + DRIFT_MARGIN
        bound = min(ceiling, by_median)
        alarmed = ceiling < self.ceiling
        out: list[str | None] = []
        for sender, p in zip(senders, persistence, strict=True):
            level, rounds = self._drift.get(sender, (0.0, 0))
            muted = p is not None and rounds >= DRIFT_ROUNDS and level > bound
            if p is not None and rounds >= DRIFT_ROUNDS:
                self._mutes.setdefault(sender, deque(maxlen=SUSTAINED_OF)).append(muted)
                self._alarm_mutes.setdefault(sender, deque(maxlen=SUSTAINED_OF)).append(
                    muted and alarmed and level <= by_median)
            if muted:
                self._doubted.add(sender)
                self._last_mute[sender] = now
                against = (f"the senders' median {ref:.2f}" if ref is not None and bound < ceiling else
                           f"above the ceiling {ceiling:.2f}" + (" of an alarm" if ceiling < self.ceiling else ""))
                out.append(f"its difference from this reducer's own persists ({level:.2f} over rounds, {against})")
            else:
                if p is not None and level < bound - DRIFT_MARGIN / 2:
                    self._doubted.discard(sender)
                out.append(None)
        return out

    def fold(self, senders: Sequence[str], persistence: Sequence[float | None]) -> None:
        """Fold each sender's persistence (None: not measured) into its standing drift."""
        for sender, p in zip(senders, persistence, strict=True):
            if p is None:
                continue
            level, rounds = self._drift.pop(sender, (p, 0))
            self._drift[sender] = (DRIFT_DECAY * level + (1 - DRIFT_DECAY) * p if rounds else p, rounds + 1)
            while len(self._drift) > MAX_SENDERS:
                gone = self._drift.popitem(last=False)[0]
                self._doubted.discard(gone)
                self._mutes.pop(gone, None)
                self._alarm_mutes.pop(gone, None)
                self._last_mute.pop(gone, None)

    def reference(self) -> float | None:
        """The median standing drift of the senders judged in ``DRIFT_ROUNDS`` rounds or more (None: fewer than
        ``DRIFT_PEERS`` of them)."""
        judged = [level for level, rounds in self._drift.values() if rounds >= DRIFT_ROUNDS]
        return statistics.median(judged) if len(judged) >= DRIFT_PEERS else None

    def level(self, sender: str) -> float | None:
        """``sender``'s standing drift once judged in ``DRIFT_ROUNDS`` rounds or more (else None)."""
        level, rounds = self._drift.get(sender, (0.0, 0))
        return level if rounds >= DRIFT_ROUNDS else None

    def doubted(self) -> list[str]:
        """The senders this reducer mutes for their standing drift, as its match entries publish them: a sender
        enters when it is muted and leaves only once its standing drift falls below half the margin, so that a sender
        near the bound does not flip the round's reducers (``averaging.idle_reducers``) round after round."""
        return sorted(self._doubted)

    def drifting(self, sender: str, *, now: float | None = None) -> bool:
        """With a ceiling (or during an alarm): whether ``sender`` was muted in at least ``SUSTAINED_MUTES`` of its
        last ``SUSTAINED_OF`` judged rounds here. Such a sender serves this node no state
        (``catchup.CatchUp.may_serve``), whether or not its doubt lapsed: its phi carries the drift it
        spread (2 + 2 drift runs: an honest node took a drifter's phi, 2-15% worse than its own, six times in 12 s).
        Round after round, because an honest member whose rounds an attack disturbed is muted now and then too
        (3 + 1 flip: 0.74-0.80 against each other)."""
        history = self._mutes.get(sender)
        capped = self.keeps_apart or self.alarmed(now=now)
        return capped and history is not None and sum(history) >= SUSTAINED_MUTES

    def apart(self, *, now: float | None = None) -> list[str]:
        """With a ceiling, what the match entries publish as doubted: the senders :meth:`drifting` last muted at most
        ``DOUBT_S`` ago. The round's placement keeps each of them out of this node's groups
        (``groups.kept_apart``), where it also reduces no part, so nothing would renew or clear the doubt: the lapse
        lets the two meet again, and one more round together mutes it again at once (its standing drift is
        remembered) or finds it changed. Without a ceiling: :meth:`doubted`."""
        if not self.keeps_apart:
            return self.doubted()
        return sorted(s for s in self._last_mute if self.muted_lately(s, now=now) and self.drifting(s, now=now))

    def shunned(self, *, now: float | None = None) -> list[str]:
        """Without a configured ceiling, during an alarm: the senders that only the alarm's ceiling muted (the
        senders' median would not have) in at least ``SUSTAINED_MUTES`` of their last ``SUSTAINED_OF`` judged
        rounds, the last at most ``DOUBT_S`` ago. The transport keeps them out of its rounds as it keeps the peers it
        bans (its match entries list them as excluded, so every member places the round alike, where a doubt is
        read by each member's own configured ceiling), with no offence counted; they lapse with the alarm. Not the
        senders the median mutes: with an honest majority the published doubts idle them already, and shunning
        them too turned every alarm's start and lapse into a change of the members' exclusions (4 + 2 drift: group
        mismatches in 73 rounds of two honest nodes, +9.4% at equal progress, against -0.6% without the alarm).
        With a configured ceiling :meth:`apart` does this already: none."""
        if self.keeps_apart or not self.alarmed(now=now):
            return []
        return sorted(s for s, history in self._alarm_mutes.items()
                      if sum(history) >= SUSTAINED_MUTES and self.muted_lately(s, now=now))

    def muted_lately(self, sender: str, *, within_s: float = DOUBT_S, now: float | None = None) -> bool:
        """Whether this reducer muted ``sender`` for its standing drift at most ``within_s`` seconds ago (with or
        without a ceiling): a state it serves carries the drift that was muted (``FragmentSnapshot.doubted``)."""
        at = self._last_mute.get(sender)
        now = time.monotonic() if now is None else now
        return at is not None and now - at <= within_s

    def get(self, key: Key) -> torch.Tensor | None:
        return self._mem.get(key)

    def put(self, key: Key, value: torch.Tensor) -> None:
        self._mem.pop(key, None)
        self._mem[key] = value
        while len(self._mem) > self.max_entries:
            self._mem.popitem(last=False)

    def __len__(self) -> int:
        return len(self._mem)


class DeviationRound:
    """One reduction's observations (``DeviationMemory.round``)."""

    def __init__(self, memory: DeviationMemory, fragment: int, senders: list[str], chunks: list[int],
                 space: str = "centre") -> None:
        self.memory = memory
        self.space = space  # what the deviations are from: the group's centre, or the reducer's own ("own")
        self.fragment = fragment
        self.senders = senders
        self.chunks = chunks
        n = len(senders)
        self._dot = [0.0] * n
        self._now_sq = [0.0] * n
        self._past_sq = [0.0] * n
        self._new: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]

    def observe(self, k: int, deviations: torch.Tensor) -> None:
        """Chunk ``k`` of the part: ``deviations`` (rows, elements) of each sender's values from the centre."""
        c = self.chunks[k]
        sample = deviations[:, sample_index(deviations.shape[1], self.memory.samples)].to(torch.float32)
        for i, sender in enumerate(self.senders):
            now = sample[i]
            self._new[i][c] = now
            past = self.memory.get((self.space, sender, self.fragment, c))
            if past is None or past.shape != now.shape:
                continue
            self._dot[i] += float(now @ past)
            self._now_sq[i] += float(now @ now)
            self._past_sq[i] += float(past @ past)

    def persistence(self) -> list[float]:
        """Per sender: the cosine of this round's deviation with its remembered average (0 without history)."""
        out = []
        for dot, a, b in zip(self._dot, self._now_sq, self._past_sq, strict=True):
            out.append(dot / math.sqrt(a * b) if a > 0 and b > 0 else 0.0)
        return out

    def known(self) -> list[bool]:
        """Per sender: whether it had a remembered deviation to compare with (its persistence means something)."""
        return [b > 0 for b in self._past_sq]

    def commit(self) -> None:
        """Fold this round's deviations into the memory."""
        d = self.memory.decay
        for sender, new in zip(self.senders, self._new, strict=True):
            for c, now in new.items():
                key = (self.space, sender, self.fragment, c)
                past = self.memory.get(key)
                fresh = past is None or past.shape != now.shape
                self.memory.put(key, now.clone() if fresh else d * past + (1 - d) * now)


__all__ = ["DeviationMemory", "DeviationRound", "sample_index"]
