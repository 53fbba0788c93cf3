"""``OuterLoop``: one worker's outer loop over F fragments, shared by the simulator and the daemon.

After each inner step, as the swarm clock moves from ``prev`` to ``t``, the driver calls
``advance(prev, t, tokens)`` (the daemon), or, when several workers share one thread (the simulator),
``advance_sends(prev, t, tokens)`` on each, a transport flush, then ``collect(t)`` on each:

1. ``collect``: every sync due at ``t`` (sent at ``t_s`` with ``t_s + tau = t``) is waited for; a
   complete result gets the Nesterov outer step on (phi_p, b_p), then the method's merge rule sets
   theta_p. A failed result changes nothing: the local progress stays in theta_p and the next sync of
   the fragment carries it (weighted by all the tokens it represents), up to ``max_carry`` failed
   rounds in a row; then that stale progress is dropped (theta_p <- phi_p, a "dropped" event), or, where this
   node refused what peers sent in those rounds, folded into phi by an outer step on it alone ("folded").
   Nor may one sync carry more inner steps than ``max_carry + 1`` send intervals: a node whose clock stands
   still trains on without sending, and its progress is scaled down to that before it is sent ("bounded").
2. ``send``: every fragment the schedule names at ``t`` is sent: catch up first if peers hold a newer
   version (fetch phi_p, b_p and rebase the local progress onto them), then Delta_p = phi_p - theta_p
   (+ error feedback), encode, snapshot theta_p, start the asynchronous average.

The late rules (``eager``, ``delay``; tau = H) differ: at a send, the late group average of the
previous round (and, for eager, a share of the fresh Delta) forms the outer gradient (see
``locoswarm.node.core.merge``), theta_p <- phi_p, and the fresh Delta is sent.

Whatever peers sent passes ``locoswarm.node.core.guard`` before it changes phi, momentum or theta: a group
average, the outer step it makes, a consensus shift, a downloaded snapshot. With an effect judge
(``locoswarm.node.core.judge``) a group average and a downloaded snapshot must also not do worse on a
held-out batch than what this node holds on its own. A refused one leaves the state as it was (a "refused"
event; for a sync result, the same as a failed sync), and the transport is told whom to blame. A local
divergence (non-finite theta, e.g. an inner lr far too high) resets theta to phi instead of sending it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from locoswarm.node.config import OuterSection
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.compress import BlockCompressor, Compressor, Encoded, SparseLoCoCompressor, wire_codec
from locoswarm.node.core.consensus import CONSENSUS_CODEC, StateConsensus, join_state, split_state, state_digest
from locoswarm.node.core.guard import (
    GuardLimits,
    check_average,
    check_momentum,
    check_outer_step,
    check_shift,
    check_snapshot,
    non_finite,
)
from locoswarm.node.core.judge import EffectJudge
from locoswarm.node.core.late_window import has_late_window, late_window, stall_budget
from locoswarm.node.core.lowrank import LowRankCompressor
from locoswarm.node.core.merge import LateRule, make_merge_rule
from locoswarm.node.core.outer_optimizer import NesterovOuterOptimizer
from locoswarm.node.core.payload import decode_chunks, encode_chunks
from locoswarm.node.core.schedule import ScheduleState, ScheduleView, make_schedule
from locoswarm.node.core.state import FragmentState, ThetaAccess, tensor_crc
from locoswarm.node.core.step_log import STEP_LOG_BYTES, StepLog, fingerprint
from locoswarm.node.core.transport import (
    AverageHandle,
    AverageRequest,
    AverageResult,
    FetchHandle,
    FragmentSnapshot,
    PartOrigin,
    Transport,
)

MIN_WEIGHT = 1.0  # tokens: the least a contribution claims (see OuterLoop._start)
MAX_REPLAY = 4    # merged rounds remembered while a catch-up download is under way (see OuterLoop._land)
CONSENSUS_WAIT_S = 2.0  # longest a merge waits for its fragment's consensus round (OuterLoop._apply_consensus)
# A downloaded phi whose held-out loss is more than this share above the node's own is no honest holder's
# (``OuterLoop._judge_effect``): a negated phi gives several times the loss. An honest holder's phi can be
# damaged too: the effect check lets an average do up to twice the loss (``effect_tolerance`` 1.0) and a hostile
# reducer's part got into one such round before its ban; an honest peer measured a partner's phi 2.2x its own
# (a CI run of the hostile-node tests) and, once, 4.02x (low-rank re-encoded rounds had set a pair's phi back; the
# honest node it banned sat alone for the rest of a CI run; it measured 4.44, below the 5.55 of a model that knows
# nothing). So 4x is an offence, conclusive only when the phi also does worse than knowing nothing
# (``EffectJudge.knowing_nothing``: uniform over the vocabulary; a liar's garbage phi) and the source's own model
# was judged (every fragment from it, or ``FragmentSnapshot.kin``: one fragment of another lineage beside ours
# measured 10.1 against 2.12, an honest low-rank joiner's, banned at once in a test run): otherwise its source serves
# no state and is believed no version claim for the reputation's window (``Reputation.offended``) and is banned at
# the reputation's threshold of offences, while an honest one's damage heals in the rounds it still takes part in.
# A reversal (``FAR_COSINE``) and a non-finite loss are conclusive.
ABSURD_WORSE = 3.0
# A downloaded phi whose cosine with our own trained phi is below FAR_COSINE (it points against ours), at most
# FAR_GAP versions ahead of ours, is no honest holder's, whatever it measures: a state liar's negated phi has cosine
# -1, and on the tiny preset it measured only 1.6-3.8x the loss or, one fragment of two negated, within the snapshot
# slack (one honest node took it; robustness bench). Anything less than a reversal goes to the effect check: honest
# phis can be far apart early in training, when Adam's steps dwarf the shared initialisation and a lineage split
# for a few rounds goes its own way. Bounds tried first and found to fail honest holders: half of |phi| away (62%
# seen 4 versions ahead, cosine about 0.8) and a cosine of 0.5 (-0.16 seen 3 versions ahead, 4 honest nodes on a
# starved 2-core machine); each banned an honest partner.
# A node far behind (resumed from an old checkpoint) and a fragment still at its initial state (version 0) are
# exempt: their distance to the swarm is as far as training took it.
FAR_COSINE = -0.5
FAR_GAP = 16
# A downloaded phi is refused for its effect past this many times the effect tolerance (50% worse at the default
# tolerance of 1.0), measured on the judge's whole pool of held-out batches (``EffectJudge.pooled_losses``: a
# catch-up replaces the whole fragment and is rare, so it is worth 8 batches instead of one). Refused without blame:
# the swarm's phi is the lineage a node must follow, even where it does worse on this node's data. No single bound
# separates the cases measured (robustness bench, 180 s): honest catch-ups in clean runs -1.3% to +2.6%; from two
# colluding drifters' phi (2 + 2) +6.8% to +26.6%, after which both honest nodes' eval jumped 30% above clean; and
# an honest node's catch-up to its group's phi, measured beside its other fragment of another lineage (3 + 1, a
# state-liar run, the node already 0.5 above the others after a bad join) +26%. A bound of 5% stopped the first and
# kept that node on a phi of its own for the whole window: its reduced parts were refused 36 times for their size,
# and the honest mean ended 8.3% above clean. Telling them apart needs more than the loss: whom the node refused.
SNAPSHOT_SLACK = 0.5
# ... and past FOLDED_SLACK times the tolerance (any worse) where this node folded the fragment's progress into its
# own phi since its last merged round (``_fold``): it refused the rounds of the peers it would now download from, so
# their phi is no lineage it must follow unless it does better than its own. Why: in 2 + 2 drift runs each honest
# node folded, then caught up from a drifter, again and again (fold, catch-up, fold: nine catch-ups in 14 s, each
# 0.1-13% worse than its own phi), and its phi went from 2.73 to 3.5 (robustness bench, 3374a9e). Only until the
# fragment's rounds fail for want of peers long enough to drop their progress (``_bound_carry``): the node is then
# alone on its lineage, not refusing anyone, and holding out for a phi no worse than its own would keep it there
# for good (no round of the swarm's version can include it, and the swarm's phi need not do better on its data).
FOLDED_SLACK = 0.0
# ... and past DOUBTED_SLACK times the tolerance (5% worse at the default tolerance) where the transport doubts the
# source (``FragmentSnapshot.doubted``: it muted that peer lately for its standing drift): its phi carries the drift
# that was muted. Why: in a 2 + 2 drift run both honest nodes caught up from a drifter they had muted 4 times in the
# 10 s before, its phi 22% worse on their held-out batches than their own, and their eval rose 20% above clean
# (robustness bench, drift_ceiling 0.75, 9e0975f); honest catch-ups in clean runs measured -1.3% to +2.6%. Not for
# states from peers never met in a round (tried: a node resumed after SIGKILL meets nobody until it has caught up,
# and honest catch-ups 6-7% worse than its phi were refused until the suite's test timed out).
DOUBTED_SLACK = 0.05
# ... and past IN_STEP_SLACK times the tolerance for each IN_STEP_GAP versions the download is ahead (at least once, at
# most SNAPSHOT_SLACK) where the fragment is in step with its group (``FragmentState.in_step``: it merged a round with
# peers in which more than half of the members, itself included, sent from its phi, and since then merged no round in
# which half or more sent from another phi (a minority of colluders of another phi in its groups leaves it in step),
# took no catch-up judged otherwise and was not restored): a few outer steps of the lineage it was in step with move the
# held-out loss by a few percent at most (honest catch-ups in clean runs: -1.3% to +2.6%), so a state much worse than a
# healthy phi is no progress worth taking, whoever vouches for its version. Why: with 2 honest nodes and 2 colluding
# state liars (robustness bench, ``replayliar``, 31b7f64) the liars' claims were the swarm's belief, and one honest node
# took 7 catch-ups from them, up to 16% and 39% worse than its own phi; the run's worst moment was 14.1% above clean
# (3.8% with this rule). A catch-up taken within it leaves the fragment in step (its phi is as healthy as the one it
# replaced).
# Rounds that fail do not end it: two drifters' join made an honest node's rounds fail (group mismatches) until it
# dropped its progress, and it then took their states 5-6 versions ahead, 20% and 29% worse, by the SNAPSHOT_SLACK a
# node out of step gets (2 + 2 drift, 992a8a6: worst +75.6% above clean). A node behind for real is not stranded by it:
# the further the swarm gets ahead, the more its phi may do worse on this node's batches (a small corpus), 10% at 8
# versions, 50% at 40. Only after rounds of one lineage: a node whose phi left its group's (a bad join: its group's phi
# measured 26% worse beside its other fragment) is not in step, and a 5% bound for every catch-up kept such a node on a
# phi of its own for a whole window (robustness bench, 8ed535c).
IN_STEP_SLACK = 0.05
IN_STEP_GAP = 4
# With ``[robust] health_slack`` above 0 (``EffectJudge.health_slack``; HEALTHY_SLACK is the value the robustness bench
# runs), a round's average is refused where its outer step does worse than this node's phi as it stands and its loss
# on the held-out batch is more than that many effect tolerances (10% at the default tolerance) above the lowest loss
# of a phi this node held on that batch (``OuterLoop._healthiest``): the tolerance bounds one round, this bounds their
# sum. Why: with 2 honest nodes and 2 colluding drifters (robustness bench, 9a30f65) one honest node merged 55
# rounds of 4 with the drifters, each within the tolerance of the phi it replaced, and its loss went from 2.65 to 38
# in 40 s. An honest round of one lineage moves the held-out loss by a few percent (honest catch-ups in clean runs:
# -1.3% to +2.6%), and a round that does better than the phi it replaces is always taken, so a node set back for any
# reason climbs back. The marks are forgotten where the model is replaced wholesale (a join, a restore), not at a
# catch-up: forgetting them there let each catch-up (within its own slack) start a new 10% (2 + 2 drift, e020703:
# the marks went 2.53 -> 3.24 -> 3.44 in a minute, the honest eval 27% above clean at worst). Off by default: on the
# test suite's small corpus (held-out losses of 0.5-0.9 that swing by a third between rounds) an honest pair refused
# about 500 of each other's rounds in 8 minutes with it, and the hostile-node tests failed their honest checks.
HEALTHY_SLACK = 0.1
# ... and where a round's average passes the tolerance but its loss is more than ALARM_SHARE of that health slack above
# the healthiest mark (5% with the bench's values), the transport is alarmed (``Transport.alarm``): this node's loss is
# climbing by a sum of rounds, and for a while it judges its peers' persistent differences from its own progress
# against a fixed ceiling (``core.persistence.ALARM_CEILING``) rather than only the senders' median, which two
# colluders without an honest majority set. Why half: the mark stops the climb, the alarm must find its cause before.
# Why not for a round that fails the tolerance: a flip or a bad part is refused and attributed by itself.
ALARM_SHARE = 0.5
# In a refused round, this node's own part and then each member's contribution to it are judged alone against
# this many effect tolerances (10% at the default) over the worse of phi and the own step (``_blame_members``): a
# paired comparison on one batch, so far tighter than the tolerance of a whole round, which must allow for honest
# averages on a node's batch. An honest member's progress alone, in a part of a fragment, does about what this
# node's own does there; a flip at the largest accepted norm undoes it two to three times over.
MEMBER_SLACK = 0.1


@dataclass
class SyncEvent:
    kind: str                 # "sent" | "merged" | "failed" | "caught_up" | "catch_up_loop" | "refused" | "diverged"
                              # | "dropped" | "folded" | "bounded"
    fragment: int
    step: int
    version: int
    group_size: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    error: str = ""
    round: int = -1            # swarm step at which the sync started (the round id)
    own_weight: float = 0.0
    total_weight: float = 0.0
    matchmaking_s: float = 0.0  # the transport's timing of the round (AverageResult)
    round_s: float = 0.0


@dataclass
class OuterStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    syncs_ok: int = 0
    solo_steps: int = 0                   # ... of which outer steps alone (a swarm of one: group size 1)
    syncs_failed: int = 0
    catch_ups: int = 0
    catch_up_loops: int = 0               # catch-ups of a fragment with no merged round since its last one
    replays: int = 0                      # ... of which replayed the steps missed instead of downloading
    folds: int = 0                        # carried progress folded into phi after refused rounds (``_bound_carry``)
    bounded: int = 0                      # sends whose progress spanned too many inner steps (``_bound_progress``)
    stalls_cut: int = 0                   # rounds left in flight after their stall budget (late_window)
    refused: int = 0                      # results or snapshots the guards refused
    effect_checks: int = 0                # results and snapshots the effect judge compared
    effect_refused: int = 0               # ... of which it refused (counted in ``refused`` too)
    contested_checks: int = 0             # passed averages whose own part's screening was outvoted, judged alone
    consensus_rounds: int = 0
    consensus_failed: int = 0             # consensus rounds that did not complete (phi kept as it was)
    last_consensus_error: str = ""
    last_consensus_shift: float = 0.0     # |phi_bar - phi| / |phi| of the last consensus round
    bytes_by_round: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def peak_bytes_per_sync(self) -> int:
        """Most bytes this worker sent for the syncs started at one step."""
        return max(self.bytes_by_round.values(), default=0)


@dataclass
class _Consensus:
    """A consensus round under way: the outer state this node sent (phi and momentum joined), and the group averages
    of the outer steps it took since, while the round was still exchanging (``OuterLoop._apply_consensus``)."""

    handle: AverageHandle
    sent: torch.Tensor
    steps: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Fetch:
    """A catch-up download under way: the least version it must bring, and the rounds merged meanwhile
    (the group's version at send time, the average) to apply on top of it when it lands."""

    handle: FetchHandle
    least: int
    replay: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    staged: FragmentSnapshot | None = None  # downloaded and checked on its own; its effect not judged yet
    # The phi and momentum of the version a replay of the steps missed starts from (``_start_fetch``): rounds this
    # node merges meanwhile move its own state on, and are applied again on top of the replay's outcome.
    base: tuple[torch.Tensor, torch.Tensor] | None = None
    replayed: bool = False  # ``staged`` is the outcome of such a replay


@dataclass(frozen=True)
class Refusal:
    """Why a downloaded outer state was refused: ``offence`` counts against its source, ``conclusive`` bans it
    at once (no honest holder could have served it)."""

    reason: str
    offence: bool
    conclusive: bool


@dataclass
class _Pending:
    handle: AverageHandle
    sent_step: int
    due_step: int             # merged no earlier than this step (send + tau) ...
    deadline_step: int        # ... and waited for at this step if it has not finished (see late_window)
    weight: float
    snapshot: torch.Tensor | None
    residual_before: torch.Tensor | None
    own: torch.Tensor | None = None
    own_share: float = 0.0
    sent_at: float = 0.0      # monotonic seconds at the send (the late window's wall time; the stall budget)
    stalled: bool = False     # waited its stall budget at the end of the late window and left in flight
    own_norm: float = 0.0     # norm of this node's decoded contribution (the guard's yardstick)
    phi_norm: float = 0.0     # norm of phi when it was sent (the yardstick when it contributed nothing)
    ticket: object | None = None  # what the compressor needs to read the result (locoswarm.node.core.compress)
    wire_numel: int = 0       # elements of the vector the group averaged (the fragment's, unless low-rank)


def make_compressor(outer: OuterSection, fragments: Sequence[tuple[int, Sequence[tuple[int, ...]]]]) -> Compressor:
    """The compressor ``[outer] codec`` names; ``fragments``: (index, shapes of its tensors) per fragment."""
    if outer.codec == "lowrank":
        return LowRankCompressor(fragments, wire_codec(outer), rank=outer.lowrank_rank,
                                 min_rank=outer.lowrank_min_rank, max_rank=outer.lowrank_max_rank)
    if outer.codec == "sparseloco":
        return SparseLoCoCompressor(wire_codec(outer), outer.sparse_beta)
    return BlockCompressor(wire_codec(outer))


class OuterLoop:
    """The outer loop of one worker (see module docstring).

    Args:
        model: the worker's model; its parameters are theta.
        fragments: the partition (``locoswarm.node.partition.partition``); each has ``index`` and ``names``.
        outer: the ``[outer]`` settings.
        transport: where averages happen.
        expected_group_size: group size assumed for the eager rule's own share before a group result
            has told the real share (``[network] group_size``, at most the workers there are; no default here:
            the config holds it).
        wait_timeout: seconds to wait for a due result before counting the round as failed.
        state_device: where phi, momentum and the residual live (default: the model's device); all outer
            arithmetic happens there, the model only sees theta copied in and out.
        theta_access: told of every read and write of a fragment's theta (a node over several ranks moves
            that fragment between them: ``locoswarm.node.ranks.ThetaSync``); None: the model is theta.
        judge: compares what a round's average or a downloaded snapshot would do to the model on a held-out
            batch with what this node holds (``locoswarm.node.core.judge``); None: no effect check.
    """

    def __init__(self, model: torch.nn.Module, fragments: Sequence, outer: OuterSection, transport: Transport,
                 *, expected_group_size: int, wait_timeout: float | None = None,
                 limits: GuardLimits | None = None, state_device: torch.device | None = None,
                 theta_access: ThetaAccess | None = None, judge: EffectJudge | None = None) -> None:
        self.cfg = outer
        self.rule = make_merge_rule(outer.method, alpha=outer.alpha, lambda0=outer.lambda0)
        self.transport = transport
        self.optimizer = NesterovOuterOptimizer(outer.lr, outer.momentum)
        self.schedule = make_schedule(outer.schedule, outer.h, len(fragments), outer.sends_per_h)
        named = dict(model.named_parameters())
        self.states = [FragmentState.create(f.index, [named[n] for n in f.names], outer.error_feedback,
                                            device=state_device, access=theta_access) for f in fragments]
        # How a Delta becomes the vector the group averages, and back (chosen once from [outer] codec).
        self.compressor = make_compressor(outer, [(f.index, [tuple(named[n].shape) for n in f.names])
                                                  for f in fragments])
        self.pending: dict[int, _Pending] = {}
        # Fragments whose phi left the group's (this node was a version ahead of its round's members):
        # the next send first takes the group's phi at the same version (``_catch_up``).
        self._resync: set[int] = set()
        self._fetches: dict[int, _Fetch] = {}  # catch-up downloads under way, per fragment
        self._staging_asked: set[int] = set()  # fragments far behind fetched for the staged downloads' judgement
        # The held-out loss of this model when it judged its first catch-up since its last round merged with peers
        # (``_judge_effect``): later catch-ups are judged against the lower of it and the loss now, so a run of
        # catch-ups, each within its bound of the one before, cannot walk a healthy model to a much worse one
        # (2 + 2 drift, 992a8a6: 2.65 -> 3.19 -> 4.10 -> 4.90 in one second, fragments 0 and 1 in turn).
        self._loss_before_catch_ups: float | None = None
        # The lowest held-out loss of a phi this node held, per batch of the judge's pool (``HEALTHY_SLACK``).
        self._healthiest: dict[int, float] = {}
        # The outer steps each fragment took from its groups' averages, for peers that missed them
        # (``locoswarm.node.core.step_log``): only where the wire average is what the step applies.
        self._steps = ([StepLog(max_bytes=STEP_LOG_BYTES // len(self.states)) for _ in self.states]
                       if self.compressor.replayable else None)
        self.consensus = StateConsensus(outer.consensus_every, len(fragments))
        self.pending_consensus: dict[int, _Consensus] = {}
        self.shared_r: torch.Tensor | None = None
        self.stats = OuterStats()
        self._step_tokens = 0.0  # the tokens of one inner step (``add_tokens``): ``_bound_progress`` counts steps
        self.expected_share = 1.0 / max(1, expected_group_size)
        self.wait_timeout = wait_timeout
        self.limits = limits or GuardLimits()
        self.judge = judge

    # ---- the driver's calls -------------------------------------------------------------------
    def add_tokens(self, tokens: float) -> None:
        if tokens > 0:
            self._step_tokens = float(tokens)
        for st in self.states:
            st.tokens_since_send += tokens

    def advance(self, prev: int, step: int, tokens: float) -> list[SyncEvent]:
        """The driver's one call after each inner step: the swarm clock moved from ``prev`` to ``step``
        (usually by one; by more when a slower node adopts the swarm's progress) and the step processed
        ``tokens`` tokens. Every result due is merged, every send slot crossed is taken (each fragment at
        most once, at its latest slot), and a result that a send made due at once (tau = 0) is merged."""
        return self.advance_sends(prev, step, tokens) + self.collect(step)

    def advance_sends(self, prev: int, step: int, tokens: float) -> list[SyncEvent]:
        """:meth:`advance` up to its sends, without the last ``collect(step)``. For a driver that runs several
        workers in one thread (the simulator): it calls this on every worker, lets the transport average
        what they sent (``InProcessHub.flush``), then ``collect(step)`` on every worker. The daemon's
        transport works in the background, so it calls :meth:`advance`."""
        self.add_tokens(tokens)
        first = max(prev + 1, step - self.cfg.h + 1)
        if step - first < 1:
            return self.collect(step) + self.send(step)
        events = []
        for t in range(first, step + 1):
            events += self.collect(t)
        # Only the latest crossed slot of each fragment: an older one is a round the others have most
        # likely finished, so this node would arrive late to it and wait for nothing.
        view = self._schedule_view()
        latest: dict[int, int] = {}
        for t in range(step, first - 1, -1):
            due = self.schedule.due(t, view)
            for p in due:
                latest.setdefault(p, t)
            if due and self.schedule.adaptive:
                break  # one pick per slot: the newest slot's
        for t in sorted(set(latest.values())):
            events += self.send(t, only={p for p, tp in latest.items() if tp == t})
        return events

    def collect(self, step: int) -> list[SyncEvent]:
        events = []
        for p in sorted(self.pending):
            pend = self.pending[p]
            if pend.due_step > step or self.rule.late:
                continue  # a late rule consumes the result at the next send of the fragment
            if step < pend.deadline_step and not pend.handle.done():
                continue  # not finished yet: training goes on, and the result is merged when it lands
            if not pend.handle.done() and not self._stall(pend):
                continue  # waited its stall budget: left in flight, merged when it lands
            del self.pending[p]
            events.extend(self._merge(self.states[p], pend, self._wait(pend, self.states[p]), step))
        if self._fetches:
            events.extend(self._land_fetches(step))
        return events

    def _stall(self, pend: _Pending) -> bool:
        """A round still running at the end of its late window: wait for it, at most its stall budget
        (``locoswarm.node.core.late_window.stall_budget``) and once; whether to take its result now. Without a
        late window (replace, compensate, ``max_delay = 0``) the node waits for it as blocking DiLoCo does; a
        round left in flight longer than ``wait_timeout`` is waited for (and fails) like any other."""
        if not has_late_window(merges_late=self.rule.merges_late, max_delay=self.cfg.max_delay):
            return True
        elapsed = time.monotonic() - pend.sent_at
        if pend.stalled:
            return self.wait_timeout is not None and elapsed >= self.wait_timeout
        pend.stalled = True
        if pend.handle.wait(stall_budget(elapsed)):
            return True
        self.stats.stalls_cut += 1
        return False

    def send(self, step: int, only: set[int] | None = None) -> list[SyncEvent]:
        view = self._schedule_view()
        events = []
        for p in self.schedule.due(step, view):
            if only is not None and p not in only:
                continue
            st = self.states[p]
            if p in self.pending and not self.rule.late:
                continue  # still in flight: its progress rides on the next sync
            if isinstance(self.rule, LateRule):
                events.extend(self._send_late(self.rule, st, step))
            else:
                events.extend(self._send(st, step))
        return events

    def late_window(self) -> int:
        """Steps after a send by which its round must have finished; until then a round slower than tau
        is not waited for (``locoswarm.node.core.late_window``, ``[outer] max_delay``)."""
        c = self.cfg
        return late_window(h=c.h, fragments=c.fragments, tau=c.tau, max_delay=c.max_delay,
                           merges_late=self.rule.merges_late)

    def _schedule_view(self) -> ScheduleView:
        # a late rule's syncs are always in flight (consumed at the next send), so they block no pick
        return ScheduleView(last_send=[s.last_send for s in self.states],
                            in_flight=set(self.pending) if not self.rule.late else set(),
                            shared_r=self.shared_r)

    def drain(self, step: int) -> list[SyncEvent]:
        """Merge every in-flight sync now (end of a run)."""
        events = []
        for p in sorted(self.pending):
            pend = self.pending.pop(p)
            st = self.states[p]
            res = self._wait(pend, st)
            if isinstance(self.rule, LateRule):
                average, share, late_events = self._late_result(st, pend, res, step)
                g = self.rule.outer_gradient(average, pend.own, share, pend.own_share, torch.zeros_like(st.phi), 0.0)
                events.extend(late_events)
                refused = self._late_step(st, g, step)
                events.extend(refused)
                if refused:
                    continue
                if late_events[-1].kind == "merged":
                    self._follow_group(st, res)
                st.set_theta(st.phi)
            else:
                events.extend(self._merge(st, pend, res, step))
        return events

    # ---- sends ----------------------------------------------------------------------------------
    def _send(self, st: FragmentState, step: int) -> list[SyncEvent]:
        events = self._catch_up(st, step)
        events += self._bound_progress(st, step)
        theta = st.theta()
        delta = st.phi - theta
        diverged = self._diverged(st, step, delta)
        if diverged is not None:
            return [*events, diverged]
        residual_before = st.residual.clone() if st.residual is not None else None
        enc = self.compressor.encode(st.index, delta, st.residual, step)
        st.last_quant_error = _relative_error(enc.own, delta)
        handle = self._start(st, step, enc)
        self.pending[st.index] = _Pending(handle, step, step + self.cfg.tau, step + self.late_window(),
                                          st.tokens_since_send, snapshot=theta, residual_before=residual_before,
                                          own=enc.own if self.judge is not None else None,
                                          sent_at=time.monotonic(), own_norm=float(torch.linalg.vector_norm(enc.own)),
                                          phi_norm=float(torch.linalg.vector_norm(st.phi)), ticket=enc.ticket,
                                          wire_numel=enc.numel)
        st.tokens_since_send = 0.0
        st.last_send = step
        if self.consensus.due(step, self.cfg.h):
            self._start_consensus(st, step)
        events.append(SyncEvent("sent", st.index, step, st.version))
        return events

    def _start_consensus(self, st: FragmentState, step: int) -> None:
        """Also average the outer state (phi and momentum) in this round (see ``locoswarm.node.core.consensus``)."""
        sent = join_state(st.phi, st.momentum)
        codec = get_codec(CONSENSUS_CODEC)
        handle = self.transport.start_average(AverageRequest(
            fragment=self.consensus.round_fragment(st.index), round=step, chunks=encode_chunks(codec, sent),
            numel=sent.numel(), weight=1.0, version=st.version, codec=CONSENSUS_CODEC,
            digest=state_digest(sent)))
        self.pending_consensus[st.index] = _Consensus(handle, sent)

    def _apply_consensus(self, st: FragmentState) -> torch.Tensor | None:
        """Take the group's mean outer state, if this fragment's consensus round is pending and came
        through. Called before the outer step of the delta round sent with it, so that on every member
        that held phi and momentum unchanged since the send, both become the group's mean bit for bit and
        the identical outer step that follows keeps them equal. Returns the shift of phi (theta moved by
        it too; None: nothing moved).

        Waited for ``CONSENSUS_WAIT_S`` at most: a consensus round whose members' states differ moves the whole
        outer state in fp32, 8 bytes per parameter, and on 5 Mbit/s links that took about 30 s, for which the
        delta round's merge, and training at its late window, waited on every member (bench runs with two nodes
        behind NAT stalled all four nodes at every tenth sync). One still exchanging then is left pending and taken
        at a later merge of the fragment, as a catch-up lands (``_restep``): the outer steps taken since the send are
        applied again from the group's mean state, so a member that took it late ends where one that took it in
        time did, bit for bit (the mean plus the local moves, ``settle``, left them apart by the momentum each step
        used: a loaded 4-node gossip swarm's phi spread past 5%). On fast links it comes in time, and every member
        takes it at the same merge."""
        item = self.pending_consensus.get(st.index)
        if item is None:
            return None
        handle, sent = item.handle, item.sent
        deadline = time.monotonic() + CONSENSUS_WAIT_S
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not handle.done():
            return None
        del self.pending_consensus[st.index]
        res = handle.result()
        self.stats.bytes_sent += res.bytes_sent
        self.stats.bytes_received += res.bytes_received
        if not res.ok:
            self.stats.consensus_failed += 1
            self.stats.last_consensus_error = res.error
            return None
        self.stats.consensus_rounds += 1
        if res.average is None:  # every member already held this outer state
            self.stats.last_consensus_shift = 0.0
            return None
        if res.average.numel() != sent.numel():
            self.stats.refused += 1
            return None
        phi, momentum = self._restep(st, item, res.average)
        shift = phi - st.phi
        reason = check_shift(shift, st.phi, self.limits) or check_momentum(momentum, phi, self.limits)
        if reason is not None:
            self.stats.refused += 1
            return None
        st.phi.copy_(phi)
        st.momentum.copy_(momentum)
        st.set_theta(st.theta() + shift)
        self.stats.last_consensus_shift = float(torch.linalg.vector_norm(shift)) / max(
            1e-12, float(torch.linalg.vector_norm(st.phi)))
        return shift

    def _restep(self, st: FragmentState, item: _Consensus, average: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Phi and momentum after a consensus round whose group ``average`` of the outer state comes after the outer
        steps ``item.steps`` were taken: those steps again from the mean, where they are all that moved the state
        since the send (replayed from what was sent, they reach the state as it is bit for bit); else the mean
        plus whatever moved (``StateConsensus.settle``)."""
        device = st.phi.device
        phi_mean, momentum_mean = (t.to(device) for t in split_state(average, st.numel))
        phi_sent, momentum_sent = (t.to(device) for t in split_state(item.sent, st.numel))
        if item.steps:
            phi, momentum = self._stepped_from(phi_sent, momentum_sent, item.steps)
            if torch.equal(phi, st.phi) and torch.equal(momentum, st.momentum):
                return self._stepped_from(phi_mean, momentum_mean, item.steps)
        return (self.consensus.settle(phi_mean, phi_sent, st.phi),
                self.consensus.settle(momentum_mean, momentum_sent, st.momentum))

    def _stepped_from(self, phi: torch.Tensor, momentum: torch.Tensor,
                      steps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Phi and momentum after the outer ``steps`` from ``phi`` and ``momentum`` (on copies)."""
        phi, momentum = phi.clone(), momentum.clone()
        for delta in steps:
            self.optimizer.step(phi, momentum, delta)
        return phi, momentum

    def _send_late(self, rule: LateRule, st: FragmentState, step: int) -> list[SyncEvent]:
        events = self._bound_progress(st, step)
        theta = st.theta()
        own_now_raw = st.phi - theta
        diverged = self._diverged(st, step, own_now_raw)
        if diverged is not None:
            return [diverged]
        # The previous round's result first: reading it may move the compressor's shared basis, which the
        # fresh contribution is then encoded on.
        late = self.pending.pop(st.index, None)
        late_avg, own_prev, share_in_group, share_applied = None, None, 0.0, 0.0
        if late is not None:
            late_avg, share_in_group, late_events = self._late_result(st, late, self._wait(late, st), step)
            own_prev, share_applied = late.own, late.own_share
            events.extend(late_events)
        enc = self.compressor.encode(st.index, own_now_raw, st.residual, step)
        own_now = enc.own
        st.last_quant_error = _relative_error(own_now, own_now_raw)
        share_now = rule.own_share(self.expected_share)
        g = rule.outer_gradient(late_avg, own_prev, share_in_group, share_applied, own_now, share_now)
        events.extend(self._late_step(st, g, step))
        st.set_theta(st.phi)
        handle = self._start(st, step, enc)
        self.pending[st.index] = _Pending(handle, step, step + self.cfg.tau, step + self.late_window(),
                                          st.tokens_since_send, snapshot=None, residual_before=None, own=own_now,
                                          own_share=share_now, own_norm=float(torch.linalg.vector_norm(own_now)),
                                          phi_norm=float(torch.linalg.vector_norm(st.phi)), ticket=enc.ticket,
                                          wire_numel=enc.numel)
        st.tokens_since_send = 0.0
        st.last_send = step
        events.append(SyncEvent("sent", st.index, step, st.version))
        return events

    def _late_step(self, st: FragmentState, g: torch.Tensor, step: int) -> list[SyncEvent]:
        """A late rule's outer step on ``g``; a refusal cannot come from peers (their part was checked):
        phi stays as it was and it is reported."""
        reason = self._outer_step(st, g)
        if reason is None:
            return []
        self.stats.refused += 1
        return [SyncEvent("refused", st.index, step, st.version, error=reason)]

    def _late_result(self, st: FragmentState, late: _Pending, res: AverageResult,
                     step: int) -> tuple[torch.Tensor | None, float, list[SyncEvent]]:
        """A late rule's previous round as its outer gradient needs it: the group's average and this node's
        token share in the group that averaged it (0 when its contribution was not in it), and the event.
        A failed or refused round is a group of one: nobody else's progress arrived, and this node's own
        contribution is its average (share 1), so the rest of it is applied."""
        reason = self._check_result(st, res, late)
        if not res.ok:
            return late.own, 1.0, [self._event("failed", st, step, res, late.sent_step)]
        if reason is not None:
            return late.own, 1.0, [self._refused(st, step, res, late.sent_step, reason)]
        share = res.own_weight / res.total_weight if res.own_weight > 0 and res.total_weight > 0 else 0.0
        if share > 0:
            self.expected_share = share  # the next round's groups are most likely alike
        average = res.average if res.average is not None else late.own  # all contributions equal: ours
        return average, share, [self._event("merged", st, step, res, late.sent_step)]

    def _start(self, st: FragmentState, step: int, enc: Encoded) -> AverageHandle:
        # A contribution weighs at least one token: reducers refuse a weight <= 0 as a lie, and a fragment
        # that just dropped its progress (or made no step since) has an honest zero to send.
        r = self._r_vector(step)
        request = AverageRequest(
            fragment=st.index, round=step, chunks=enc.chunks, numel=enc.numel,
            weight=max(st.tokens_since_send, MIN_WEIGHT), version=st.version, extras=torch.cat([r, enc.extras]),
            schedule=self.schedule_state() if self.schedule.adaptive else None, basis=enc.basis,
            lineage=tensor_crc(st.phi))
        if enc.basis:
            def reencode(tag: bytes) -> AverageRequest | None:
                again = self.compressor.reencode(enc.ticket, tag)
                if again is None:
                    return None
                return replace(request, chunks=again.chunks, numel=again.numel, basis=again.basis,
                               extras=torch.cat([r, again.extras]), reencode=None)
            request.reencode = reencode
        return self.transport.start_average(request)

    # ---- the adaptive schedule's shared state ---------------------------------------------------
    def schedule_state(self) -> ScheduleState:
        """What the adaptive schedule picks from (before this slot's pick is recorded)."""
        r = None if self.shared_r is None else tuple(float(x) for x in self.shared_r.tolist())
        return ScheduleState(tuple(s.last_send for s in self.states), r)

    def set_schedule_state(self, state: ScheduleState) -> None:
        """Start the adaptive schedule from another worker's state (a joining node takes a peer's)."""
        for st, last in zip(self.states, state.last_send, strict=True):
            st.last_send = last
        self.shared_r = None if state.shared_r is None else torch.tensor(state.shared_r, dtype=torch.float32)

    def adopt_schedule(self, state: ScheduleState, picked: int, step: int) -> None:
        """Take another worker's schedule state as it was at its send slot ``step``, where it picked
        ``picked``: from the next slot on, both pick the same fragments again. Used when members of a
        swarm find they picked different fragments (a failed round, a join, a restart)."""
        for st, last in zip(self.states, state.last_send, strict=True):
            st.last_send = last
        self.states[picked].last_send = step
        self.shared_r = None if state.shared_r is None else torch.tensor(state.shared_r, dtype=torch.float32)

    def _r_vector(self, step: int) -> torch.Tensor:
        """CoCoDC's R_p = |phi_p - theta_p|_1 / (I_p |p|) for every fragment (adaptive schedule only)."""
        if not self.schedule.adaptive:
            return torch.zeros(0)
        r = torch.zeros(len(self.states))
        for st in self.states:
            interval = max(1, step - (st.last_send if st.last_send is not None else 0))
            r[st.index] = float((st.phi - st.theta()).abs().sum()) / (interval * max(1, st.numel))
        return r

    # ---- results --------------------------------------------------------------------------------
    def _wait(self, pend: _Pending, st: FragmentState) -> AverageResult:
        """The round's result, its average read back by the compressor into a dense average of Delta and its
        extras cut to the schedule's R (a result the compressor cannot read is a failed round)."""
        res = pend.handle.result(timeout=self.wait_timeout)
        if not res.ok or res.average is None:
            return res
        n_r = len(self.states) if self.schedule.adaptive else 0
        extras = res.extras if res.extras is not None else torch.zeros(0)
        try:
            dense = self.compressor.finish(pend.ticket, res.average, extras[n_r:], res.basis, st.residual)
        except ValueError as exc:
            return replace(res, ok=False, average=None, error=f"unreadable result: {exc}")
        return replace(res, average=dense.to(st.device), extras=extras[:n_r])

    def _merge(self, st: FragmentState, pend: _Pending, res: AverageResult, step: int) -> list[SyncEvent]:
        reason = self._check_result(st, res, pend) if res.ok else None
        # The consensus sent with this round first (see _apply_consensus); the send's snapshot of theta
        # moves with phi and theta, so the merge rule below sees the same local geometry.
        shift = self._apply_consensus(st)
        if shift is not None and pend.snapshot is not None:
            pend.snapshot.add_(shift.to(pend.snapshot.device))
        if res.ok and reason is None:
            reason = self._logged_step(st, res)
        if not res.ok or reason is not None:
            # Keep the local progress (it is still phi - theta) and the tokens it represents; undo
            # the residual update, since nothing of this payload was applied.
            st.tokens_since_send += pend.weight
            if pend.residual_before is not None and st.residual is not None:
                st.residual.copy_(pend.residual_before)
            if reason is not None:
                event = self._refused(st, step, res, pend.sent_step, reason)
            else:
                event = self._event("failed", st, step, res, pend.sent_step)
            return [event, *self._bound_carry(st, step, refused=reason is not None or res.refused)]
        st.failed_rounds = st.refused_rounds = 0
        consensus = self.pending_consensus.get(st.index)
        if consensus is not None and res.average is not None:  # taken late: this step is applied again after it
            if len(consensus.steps) < MAX_REPLAY:
                consensus.steps.append(res.average.detach().to(st.phi.device).clone())
            else:
                del self.pending_consensus[st.index]
        fetch = self._fetches.get(st.index)
        if fetch is not None and len(fetch.replay) < MAX_REPLAY and res.average is not None:
            fetch.replay.append((res.max_version, res.average.detach().clone()))
        self._follow_group(st, res)
        if res.extras is not None and res.extras.numel():
            self.shared_r = res.extras.clone()
        st.set_theta(self.rule.merge(st.theta(), st.phi, pend.snapshot, st.bounds))
        return [self._event("merged", st, step, res, pend.sent_step)]

    def _bound_carry(self, st: FragmentState, step: int, *, refused: bool = False) -> list[SyncEvent]:
        """After a failed round: the local progress stays in theta for the next sync, but not forever. A
        fragment whose rounds keep failing carries an ever larger, ever staler delta, until the peers'
        screening refuses it as too large, so every later round fails too (seen: a joiner whose first
        rounds failed carried 900 steps, was refused 400 times, then banned for its token weight). After
        ``max_carry`` failed rounds in a row the fragment drops that progress (theta <- phi), as a
        hivemind peer that fell out of sync reloads the swarm's state; the next sync starts fresh.

        Where this node itself refused what peers sent in at least half of those rounds (``refused``: an average's
        effect, a reduced part against its own progress), the progress is folded into phi instead, by an outer step
        on it alone that leaves the momentum buffer as it is (``_fold``): peers whose results it refuses must not
        stall it (rounds that failed for want of peers, a join or a group mismatch are the swarm's to redo). Two
        colluders with two honest nodes failed every round for 80 s (their parts, and the honest reducers' parts
        their contributions turned, were refused); dropping the progress every 4 rounds kept both honest nodes at
        one loss while the clean run went on, 15% above it at worst (robustness bench, 2 + 2 drift, 9b131b7)."""
        st.failed_rounds += 1
        st.refused_rounds += int(refused)
        if not self.cfg.max_carry or st.failed_rounds < self.cfg.max_carry:
            return []
        failed, refusals = st.failed_rounds, st.refused_rounds
        st.failed_rounds = st.refused_rounds = 0
        if 2 * refusals >= failed and self._fold(st) is None:
            return [SyncEvent("folded", st.index, step, st.version,
                              error=f"{failed} rounds in a row failed, {refusals} refused here: the local progress "
                                    "they carried is folded into phi by an outer step on it alone")]
        st.set_theta(st.phi)
        self._carry_nothing(st)
        st.folded = False  # these rounds failed for want of peers, not by refusals: no longer a fold (FOLDED_SLACK)
        return [SyncEvent("dropped", st.index, step, st.version,
                          error=f"{failed} rounds in a row failed: the local progress they carried is dropped "
                                "(theta <- phi)")]

    def _bound_progress(self, st: FragmentState, step: int) -> list[SyncEvent]:
        """Before a send: local progress that spans more than ``carry_steps`` inner steps is scaled down to that
        many steps' worth, theta <- phi + (theta - phi) * limit / tokens, and so is its token weight.

        Why: a node's clock stands still while it is ahead of the swarm's median (``locoswarm.node.swarm.clock``),
        and it trains on without sending. In a robustness bench run the others were held up by rounds that
        failed, and one honest node made 675 inner steps at one clock value, another 1,250, at h = 8. Their next
        rounds sent those piles as one outer gradient each, weighted by all their tokens. The outer optimizer is
        tuned for a pseudo-gradient of about h steps: the Nesterov momentum applied the pile again in the next
        rounds (1.33, 0.57, 0.51 times it), and the group's phi went from a held-out loss of 2.7 to 3.8 and 4.9
        within seconds. The honest peers then caught up to it inside the effect check's slack. Scaled, not
        dropped: the pile's direction is still progress (its first step improved that phi), and the bound is the
        most that ``max_carry`` failed rounds let a sync carry anyway. ``max_carry = 0`` bounds nothing."""
        if not self.cfg.max_carry or self._step_tokens <= 0:
            return []
        limit = carry_steps(self.cfg.h, self.cfg.max_carry) * self._step_tokens
        carried = st.tokens_since_send
        if carried <= limit:
            return []
        share = limit / carried
        phi = st.phi
        st.set_theta(phi + (st.theta() - phi) * share)
        st.tokens_since_send = limit
        self.stats.bounded += 1
        return [SyncEvent("bounded", st.index, step, st.version,
                          error=f"the local progress spans {carried / self._step_tokens:.0f} inner steps; scaled "
                                f"to {limit / self._step_tokens:.0f} steps' worth ({share:.2f}x) before it is sent")]

    def _fold(self, st: FragmentState) -> str | None:
        """DiLoCo with one worker for once: an outer step on this node's own carried progress (phi - theta), then
        theta <- phi. None when done; else why the guard refused it (nothing changed).

        The step is plain SGD with the outer lr, the momentum buffer untouched (``solo_step``), and no merge rule
        mixes theta: the progress is all in phi now, and the group's rounds that follow must find this node's
        contributions made of fresh progress only. With the Nesterov step and the alpha merge, a folder's next
        five contributions agreed with its group's at -0.22 to -0.80 (in-process, three workers on a common
        direction; +0.52 in step), and with theta <- phi alone at +0.80 then -0.21 to -0.76; with both rules at
        +0.33 to +0.48. An honest node that folded after refusing a joiner's turned parts was banned by another
        honest node for its direction 3 s later, "mean -0.206 over its last 2" (robustness bench, 3 + 1, 0fdf05a)."""
        theta = st.theta()
        reason = self._outer_step(st, st.phi - theta, momentum=False)
        if reason is not None:
            return reason
        st.set_theta(st.phi)
        self._carry_nothing(st)
        self.stats.folds += 1
        st.folded = True
        return None

    @staticmethod
    def _carry_nothing(st: FragmentState) -> None:
        """After a drop or a fold: no progress, tokens or quantization residual left to carry into the next sync."""
        st.tokens_since_send = 0.0
        if st.residual is not None:
            st.residual.zero_()

    def _logged_step(self, st: FragmentState, res: AverageResult) -> str | None:
        """The outer step on a group's average, kept in the fragment's step log where the wire's bytes of that
        average are known (``locoswarm.node.core.step_log``)."""
        if self._steps is None or res.encoded is None or res.group_size < 2:
            return self._outer_step(st, res.average)
        before = fingerprint(st.phi, st.momentum)
        reason = self._outer_step(st, res.average)
        if reason is None:
            self._steps[st.index].record(before, fingerprint(st.phi, st.momentum), st.version, res.encoded)
        return reason

    def _replayed(self, st: FragmentState, snap: FragmentSnapshot,
                  base: tuple[torch.Tensor, torch.Tensor] | None) -> FragmentSnapshot | str | None:
        """A replay (``FragmentSnapshot.is_replay``) as the state it leads to from this node's phi and momentum of
        version ``snap.base`` (``base``, kept when the catch-up started: rounds merged since are applied again on
        top, as on a download); None without them; else why not: this node's state at ``base`` is not the
        holder's (another phi), a step is unreadable or refused by the guard, or a step's outcome is not the
        holder's (``verify``)."""
        if base is None:
            return None
        phi, momentum = base[0].clone(), base[1].clone()
        if snap.verify is not None and not snap.verify(snap.base, phi.cpu(), momentum.cpu()):
            return f"this node's state of version {snap.base} is not the holder's (another phi)"
        for i, average in enumerate(s.average for s in snap.steps):
            try:
                delta = decode_chunks(get_codec(average.codec, self.cfg.block_size), list(average.chunks),
                                      average.numel)
            except ValueError as exc:
                return f"step {i + 1} of the replay is unreadable: {exc}"
            if delta.numel() != st.numel:
                return f"step {i + 1} of the replay has {delta.numel()} elements, not {st.numel}"
            before_phi, before_momentum = phi.clone(), momentum.clone()
            self.optimizer.step(phi, momentum, delta)
            reason = check_outer_step(before_phi, before_momentum, phi, momentum, delta, self.limits)
            if reason is not None:
                return f"step {i + 1} of the replay: {reason}"
            if snap.verify is not None and not snap.verify(snap.base + i + 1, phi.cpu(), momentum.cpu()):
                return f"the replayed state of version {snap.base + i + 1} is not the holder's"
        return replace(snap, phi=phi.cpu(), momentum=momentum.cpu(), base=-1, steps=(), verify=None)

    def _outer_step(self, st: FragmentState, delta: torch.Tensor, *, momentum: bool = True) -> str | None:
        """Apply the outer step unless the guard refuses its outcome (then nothing changes); without ``momentum``
        a step that leaves the buffer as it is (``NesterovOuterOptimizer.solo_step``)."""
        phi, buffer = st.phi.clone(), st.momentum.clone()
        if momentum:
            self.optimizer.step(phi, buffer, delta)
        else:
            self.optimizer.solo_step(phi, delta)
        reason = check_outer_step(st.phi, st.momentum, phi, buffer, delta, self.limits)
        if reason is not None:
            return reason
        st.phi.copy_(phi)
        st.momentum.copy_(buffer)
        st.version += 1
        return None

    def _follow_group(self, st: FragmentState, res: AverageResult) -> None:
        """After an outer step from a group round: a member that entered it a version ahead of the
        group's (corroborated) version, e.g. it stepped alone just before peers joined, holds a phi no
        other member holds, and averaging deltas would keep it apart for good. It takes the group's
        version and, before its next send, the group's phi (carrying its local progress over)."""
        if res.group_size >= 2 and 0 <= res.max_version < st.version - 1:
            st.version = res.max_version + 1
            self._resync.add(st.index)

    def _check_result(self, st: FragmentState, res: AverageResult, pend: _Pending) -> str | None:
        if not res.ok or res.average is None:
            return None
        return (check_average(res.average, pend.own_norm, self.limits, phi_norm=pend.phi_norm)
                or self._judge_result(st, res, pend))

    def _stepped(self, st: FragmentState, delta: torch.Tensor) -> torch.Tensor:
        """Phi after an outer step on ``delta`` (on copies: nothing changes)."""
        return self._stepped_from(st.phi, st.momentum, [delta])[0]

    def _judge_result(self, st: FragmentState, res: AverageResult, pend: _Pending) -> str | None:
        """The effect check of a round's average (``_effect_refusal``); where it passes and this node's screening
        of its own part was outvoted, that part is judged alone (``_judge_contested``)."""
        reason = self._effect_refusal(st, res, pend)
        if reason is None and pend.own is not None and res.average is not None:
            self._judge_contested(st, res, pend.own.to(st.device), pend)
        return reason

    def _judge_contested(self, st: FragmentState, res: AverageResult, own: torch.Tensor, pend: _Pending) -> None:
        """Where this node's screening of its own part was outvoted (``PartOrigin.contested``: a contribution
        pointed against its own and with the others' median), it cannot tell from directions whether it is the
        odd one or the others collude; the held-out loss can. Its part alone (its own progress elsewhere) is
        judged like a refused round's (``_blame_parts``): where it does worse by MEMBER_SLACK of the tolerance
        than the worse of phi and the own step, each member's contribution is judged alone (``_blame_members``).
        The average itself passed and is applied: this is attribution only, a few forward passes in such rounds.
        Why: two flippers that make most of an honest node's groups are the median there, so its direction
        judgements of them count for nothing and, without a harmful average, nothing else judged them."""
        contested = [p for p in res.parts if p.contested and p.shares]
        if self.judge is None or not contested or not (pend.wire_numel == st.numel == res.average.numel()):
            return
        self.stats.contested_checks += len(contested)
        self._blame_parts(st, res, own, res.average.to(st.device), "effect: a round that passed, where this "
                          "node's screening of its own part was outvoted", parts=contested)

    def _effect_refusal(self, st: FragmentState, res: AverageResult, pend: _Pending) -> str | None:
        """The effect check of a round's average (``locoswarm.node.core.judge``): None unless its outer step
        does worse on a held-out batch than both this node's phi as it is and the step on its own contribution;
        else the reason, after blaming each part whose own effect is that bad on its reducer
        (``Transport.reject_part``). The worse of the two is the reference: an honest average of long local
        runs can do a little worse on one node's batch than that node's own progress (seen on a small corpus
        at H = 320: refused in most rounds), but not worse than standing still."""
        if self.judge is None or pend.own is None or res.average is None or res.group_size < 2:
            return None
        own = pend.own.to(st.device)
        average = res.average.to(st.device)
        self.stats.effect_checks += 1
        # The own step's loss is measured only when the average is harmful against phi alone: the reference is
        # the worse of the two, so it can only excuse the average, never condemn it (a forward pass saved in
        # nearly every round: the effect check was about 2% of an honest node's training time, 4 nodes, tiny).
        with contextlib.closing(self.judge.lazy_losses(
                st, [self._stepped(st, average), st.phi, self._stepped(st, own)])) as losses:
            group_loss, still_loss = next(losses), next(losses)
            healthiest, health_slack = self._note_health(still_loss), self.judge.health_slack()
            unhealthy = health_slack > 0 and self.judge.harmful(group_loss, healthiest, slack=health_slack)
            if (health_slack > 0 and self.judge.harmful(group_loss, healthiest, slack=ALARM_SHARE * health_slack)
                    and not self.judge.harmful(group_loss, still_loss)):
                self.transport.alarm(f"fragment {st.index}: a round's average gives a held-out loss of "
                                     f"{group_loss:.4f} against the {healthiest:.4f} of the healthiest phi held")
            if not self.judge.harmful(group_loss, still_loss) and not (unhealthy and group_loss > still_loss):
                return None
            own_loss = next(losses)
        reference = max(own_loss, still_loss)
        harmful = self.judge.harmful(group_loss, reference)
        if not harmful and not (unhealthy and group_loss > reference):
            return None
        self.stats.effect_refused += 1
        reason = (f"effect: the group's average would raise the held-out loss to {group_loss:.4f}, where this "
                  f"node's phi gives {still_loss:.4f} and its own progress {own_loss:.4f}")
        if not harmful:  # a small step on from a sum of them: no reducer's doing alone
            reason = (f"{reason}, past {health_slack:.0%} of the tolerance above the {healthiest:.4f} of the "
                      "healthiest phi this node held")
        if res.parts and pend.wire_numel == st.numel == average.numel():
            self._blame_parts(st, res, own, average, reason)
        return reason

    def _note_health(self, held: float) -> float:
        """Note ``held``, the held-out loss of the phi this node holds on the batch the judge measured last, and
        return the lowest noted on that batch since the marks were last forgotten (``HEALTHY_SLACK``)."""
        batch = self.judge.last_batch if self.judge is not None else 0
        best = min(self._healthiest.get(batch, math.inf), held if math.isfinite(held) else math.inf)
        self._healthiest[batch] = best
        return best

    def _blame_parts(self, st: FragmentState, res: AverageResult, own: torch.Tensor, average: torch.Tensor,
                     reason: str, parts: Sequence[PartOrigin] | None = None) -> None:
        """Which reducers' parts make a refused average harmful: each part alone (this node's own progress
        elsewhere) on one held-out batch, against the worse of standing still and the own step on that batch;
        a part that is harmful alone is its reducer's doing. Where this node's own part does worse alone by
        MEMBER_SLACK of the tolerance, its members' contributions are judged alone too (``_blame_members``).
        ``parts``: only these of the round's parts (all by default)."""
        parts = [p for p in (res.parts if parts is None else parts) if 0 <= p.start < p.end <= st.numel]
        candidates = [self._stepped(st, own), st.phi]
        for part in parts:
            mixed = own.clone()
            mixed[part.start:part.end] = average[part.start:part.end]
            candidates.append(self._stepped(st, mixed))
        losses = self.judge.losses(st, candidates)
        reference = max(losses[0], losses[1])
        for part, loss in zip(parts, losses[2:], strict=True):
            if self.judge.harmful(loss, reference):
                self.transport.reject_part(res, part, f"{reason}; its part alone gives {loss:.4f} against "
                                                      f"{reference:.4f}")
            if part.shares and self.judge.harmful(loss, reference, slack=MEMBER_SLACK):
                self._blame_members(st, res, own, part, reason)

    def _blame_members(self, st: FragmentState, res: AverageResult, own: torch.Tensor, part: PartOrigin,
                       reason: str) -> None:
        """Which members' contributions make this node's own harmful ``part`` harmful: each member's share alone
        in the part's range (this node's own progress elsewhere), against the worse of standing still and the own
        step, on one held-out batch; a share that does worse alone by MEMBER_SLACK of the tolerance is its sender's
        doing. Why: the reducer of
        this part is this node, and it screened each contribution against the group's robust centre, which
        colluders that make most of a group set (4 honest + 2 flippers: the two honest nodes the others' bans left
        to group with the pair never banned them, and caught up 35 times in 180 s). What a member's own delta
        does to this node's model is its own, whoever else sent what."""
        shares = [s for s in part.shares if s.values.numel() == part.end - part.start]
        if not shares:
            return
        candidates = [self._stepped(st, own), st.phi]
        for share in shares:
            alone = own.clone()
            alone[part.start:part.end] = share.values.to(own.device, own.dtype)
            candidates.append(self._stepped(st, alone))
        losses = self.judge.losses(st, candidates)
        reference = max(losses[0], losses[1])
        for share, loss in zip(shares, losses[2:], strict=True):
            if self.judge.harmful(loss, reference, slack=MEMBER_SLACK):
                self.transport.reject_member(res, share, f"{reason}; its contribution alone gives {loss:.4f} "
                                                         f"against {reference:.4f}")

    def _refused(self, st: FragmentState, step: int, res: AverageResult, sent_step: int, reason: str) -> SyncEvent:
        """A complete result the guard refused: counted as a failed sync, reported as "refused"."""
        self.stats.refused += 1
        ev = self._event("failed", st, step, AverageResult.failed(reason, own_weight=res.own_weight), sent_step)
        ev.kind = "refused"
        ev.bytes_sent, ev.bytes_received = res.bytes_sent, res.bytes_received
        self.stats.bytes_sent += res.bytes_sent
        self.stats.bytes_received += res.bytes_received
        return ev

    def _diverged(self, st: FragmentState, step: int, delta: torch.Tensor) -> SyncEvent | None:
        """Local progress that is not finite cannot be sent: theta restarts from phi (the driver resets its
        inner optimizer on this event); the outer state is untouched."""
        reason = non_finite("local progress", delta)
        if reason is None:
            return None
        st.set_theta(st.phi)
        st.tokens_since_send = 0.0
        if st.residual is not None:
            st.residual.zero_()
        return SyncEvent("diverged", st.index, step, st.version, error=f"{reason}: theta reset to phi")

    def _event(self, kind: str, st: FragmentState, step: int, res: AverageResult,
               sent_step: int) -> SyncEvent:
        if kind == "merged":
            st.catch_ups_in_row = 0
            st.folded = False
            if res.ok and res.group_size > 1:
                # A round with peers ends a run of catch-ups (``_loss_before_catch_ups``), and says whether this
                # fragment is in step with its group (``IN_STEP_SLACK``): where more than half of the members sent
                # from its phi (``AverageResult.kin``). An honest node that refused its honest partner's phi, once
                # merging rounds with it again, must be able to take that phi: one held out for 90 s against the
                # loss it had before its catch-ups (2.71), while its own phi went to 4.4 and 13.8 in rounds with that
                # partner (2 + 2 drift, 55354b7). A minority of another phi leaves it in step: two colluding state
                # liars of another phi in every group of 6 took 4 honest nodes out of step, and each then took a
                # catch-up from them 13-18% worse than its own phi (4 + 2 replayliar, 13a8383).
                st.in_step = res.kin > 0.5
                self._loss_before_catch_ups = None
        if res.ok:
            if kind == "merged" and res.group_size == 1:
                # counted before ``syncs_ok``: the status thread reads ``syncs_ok - solo_steps`` as the rounds
                # merged with peers, and must never see a solo step there (a benchmark that waited for a
                # node's first round stopped on one, then read 0 rounds)
                self.stats.solo_steps += 1
            self.stats.syncs_ok += 1
        else:
            self.stats.syncs_failed += 1
        self.stats.bytes_sent += res.bytes_sent
        self.stats.bytes_received += res.bytes_received
        self.stats.bytes_by_round[sent_step] += res.bytes_sent
        return SyncEvent(kind, st.index, step, st.version, res.group_size, res.bytes_sent,
                         res.bytes_received, res.error, round=sent_step, own_weight=res.own_weight,
                         total_weight=res.total_weight, matchmaking_s=res.matchmaking_s, round_s=res.round_s)

    # ---- catching up ----------------------------------------------------------------------------
    def _catch_up(self, st: FragmentState, step: int) -> list[SyncEvent]:
        """Before a send: land a download that finished; when behind and none is under way, start one.
        The send goes on from where this node is: its local progress is a valid contribution whatever
        phi it started from, and waiting for the download (seconds on a slow link) made the node late
        to its round again (issue 10)."""
        events = self._land(st, step)
        if st.index in self._fetches:
            return events
        least = st.version if st.index in self._resync else st.version + 1
        if self.transport.latest_version(st.index) < least:
            return events
        self._fetches[st.index] = self._start_fetch(st, least)
        return events + self._land(st, step)  # a transport that fetches at once (in-process)

    def _start_fetch(self, st: FragmentState, least: int) -> _Fetch:
        """A catch-up of ``st`` that brings at least version ``least``. It may replay the swarm's steps from this
        node's own version (``locoswarm.node.core.step_log``), unless its phi left the group's (``_resync``) or
        no step can be replayed here; the state it replays from is kept, since rounds merged meanwhile move it on."""
        if self._steps is None or st.index in self._resync:
            return _Fetch(self.transport.start_fetch(st.index), least)
        base = (st.phi.detach().clone(), st.momentum.detach().clone())
        return _Fetch(self.transport.start_fetch(st.index, st.version), least, base=base)

    def _land_fetches(self, step: int) -> list[SyncEvent]:
        events = []
        for p in sorted(self._fetches):
            events.extend(self._land(self.states[p], step))
        return events

    def _land(self, st: FragmentState, step: int) -> list[SyncEvent]:
        """Take a finished download of ``st``'s outer state: phi and momentum from the peer, this node's
        local progress carried onto them (delay-compensated), then the outer steps of rounds this node
        merged while the download was under way, where they continue the downloaded version (so a
        download that lands one round late still ends at the group's state). A download is checked on its
        own (bounds, distance from our phi), then staged; its effect is judged with the other staged ones
        (``_land_staged``)."""
        fetch = self._fetches.get(st.index)
        if fetch is None:
            return []
        if fetch.staged is None:
            if not fetch.handle.done():
                return []
            snap = fetch.handle.result()
            if snap is not None and snap.is_replay:
                replayed = self._replayed(st, snap, fetch.base)
                if isinstance(replayed, str):
                    self.transport.reject_replay(snap, replayed)
                    replayed = None
                snap, fetch.replayed = replayed, replayed is not None
            if snap is None or snap.version < fetch.least:
                del self._fetches[st.index]
                return self._land_staged(step)  # a staged download may have waited for this one
            # Far from our own phi is absurd only when ours is a trained reference: a fragment still at its
            # initial state (its join download failed, version 0) is as far from the swarm's as training took
            # it (seen: 1228% after one node trained alone for 115 outer steps), like a joiner's; it gets the
            # joiner's absolute checks, or it would refuse and ban every honest peer it could catch up from.
            refusal = self._check_alone(st, snap, relative=st.version > 0)
            if refusal is not None:
                del self._fetches[st.index]
                return [self._refuse_snapshot(st, snap, refusal, step), *self._land_staged(step)]
            fetch.staged = snap
        return self._land_staged(step)

    def _land_staged(self, step: int) -> list[SyncEvent]:
        """Judge the staged downloads together and take them, or refuse them together.

        The effect of a fragment is measured with every other parameter as this node holds it, and a node far
        behind on another fragment too (resumed from an old checkpoint, back from a long stall) measured an
        honest swarm's fragment beside its own stale ones: 2-9x the loss of its own model, and the restarted node
        of an integration test banned an honest survivor for it. So while another fragment is more than
        ``FAR_GAP`` versions behind the swarm, its download is started and waited for, and the fragments are
        judged as one model. A fragment whose download does not come (failed, refused) is asked once; the
        staged ones are then judged in the context there is, and a refusal there blames nobody. Not while a
        round of a staged fragment is in flight: its result would be applied twice."""
        staged = {p: f for p, f in sorted(self._fetches.items()) if f.staged is not None}
        if not staged:
            return []
        behind = [p for p in range(len(self.states)) if p not in staged and self._far_behind(p)]
        if any(p in self._fetches for p in behind):
            return []  # on its way
        events: list[SyncEvent] = []
        asked = [p for p in behind if p not in self._staging_asked]
        for p in asked:
            self._staging_asked.add(p)
            self._fetches[p] = self._start_fetch(self.states[p], self.states[p].version + 1)
        if asked:  # an in-process transport's download is done at once: it is staged (and judged) here
            return [e for p in asked for e in self._land(self.states[p], step)]
        if any(p in self.pending and not self.rule.late for p in staged):
            return []
        self._staging_asked.clear()
        for p in staged:
            del self._fetches[p]
        fresh = {p: f for p, f in staged.items() if f.staged.version >= self.states[p].version}
        if not fresh:
            return []
        states = [self.states[p] for p in fresh]
        snaps = [f.staged for f in fresh.values()]
        # decided once: the bound they are judged by, and whether a catch-up taken within it leaves them in step
        in_step = self._in_step_slack(states, snaps)
        refusal, judged = self._judge_effect(states, snaps, stale=bool(behind), in_step_slack=in_step, chained=True)
        if refusal is not None:
            once = replace(refusal, offence=False, conclusive=False)  # one judgement: one offence
            return [self._refuse_snapshot(st, snap, refusal if i == 0 else once, step)
                    for i, (st, snap) in enumerate(zip(states, snaps, strict=True))]
        for p, fetch in fresh.items():
            events.extend(self._apply_snapshot(self.states[p], fetch, step, judged,
                                               in_step=in_step is not None and in_step < SNAPSHOT_SLACK))
        return events

    def _far_behind(self, fragment: int) -> bool:
        """Whether ``fragment`` is more than ``FAR_GAP`` versions behind the newest one known among peers."""
        return self.transport.latest_version(fragment) - self.states[fragment].version > FAR_GAP

    def _apply_snapshot(self, st: FragmentState, fetch: _Fetch, step: int, judged: str = "", *,
                        in_step: bool = False) -> list[SyncEvent]:
        snap = fetch.staged
        theta = st.theta()
        phi_old = st.phi.clone()
        st.phi.copy_(snap.phi.to(st.phi.device))
        st.momentum.copy_(snap.momentum.to(st.momentum.device))
        st.version = snap.version
        st.folded = False
        st.in_step = in_step
        self.pending_consensus.pop(st.index, None)  # it averaged the state this one replaces
        for group_version, average in fetch.replay:
            if group_version == st.version and self._outer_step(st, average) is not None:
                break
        self._resync.discard(st.index)
        st.set_theta(self.rule.carry(theta, st.phi, phi_old, st.bounds))
        self.stats.catch_ups += 1
        self.stats.replays += int(fetch.replayed)
        st.catch_ups_in_row += 1
        source = f"from {snap.source[:12]}" if snap.source else ""
        events = [SyncEvent("caught_up", st.index, step, st.version,
                            error=", ".join(x for x in (source, judged) if x))]
        if st.catch_ups_in_row >= 2:
            # Behind again at the next send: this node keeps arriving after its group (a slow link, a long
            # download), so each catch-up is followed by another instead of by a merged round.
            self.stats.catch_up_loops += 1
            events.append(SyncEvent("catch_up_loop", st.index, step, st.version,
                                    error=f"{st.catch_ups_in_row} catch-ups in a row without a merged round"))
        return events

    def _refuse_snapshot(self, st: FragmentState, snap: FragmentSnapshot, refusal: Refusal, step: int) -> SyncEvent:
        self.transport.reject_snapshot(snap, refusal.reason, offence=refusal.offence, conclusive=refusal.conclusive)
        self.stats.refused += 1
        return SyncEvent("refused", st.index, step, st.version, error=f"catch-up to v{snap.version}: {refusal.reason}")

    def _check_alone(self, st: FragmentState, snap: FragmentSnapshot, *, relative: bool) -> Refusal | None:
        """The checks of a downloaded outer state that need no other fragment: its bounds (``check_snapshot``; an
        offence), then a reversal of our phi (``_far_snapshot``; conclusive). None when it may be judged."""
        reason = check_snapshot(snap.phi, snap.momentum, st.phi, self.limits, relative=relative)
        if reason is not None:
            return Refusal(reason, offence=True, conclusive=False)
        reason = self._far_snapshot(st, snap)
        return None if reason is None else Refusal(reason, offence=True, conclusive=True)

    def _far_snapshot(self, st: FragmentState, snap: FragmentSnapshot) -> str | None:
        """Why a downloaded phi is no honest holder's whatever it measures: its cosine with our trained phi is below
        ``FAR_COSINE``, at most ``FAR_GAP`` versions ahead; else None."""
        gap = snap.version - st.version
        if st.version <= 0 or gap > FAR_GAP:
            return None
        theirs = snap.phi.to(st.phi.device)
        norms = float(theirs.norm()) * float(st.phi.norm())
        if norms <= 0:
            return None
        cosine = float(torch.dot(theirs, st.phi)) / norms
        if cosine >= FAR_COSINE:
            return None
        return (f"its phi points against this node's (cosine {cosine:+.2f}, {gap} versions ahead; an honest "
                f"holder's is never a reversal, below {FAR_COSINE:+.1f})")

    def _judge_effect(self, states: Sequence[FragmentState], snaps: Sequence[FragmentSnapshot], *,
                      stale: bool = False, in_step_slack: float | None = None,
                      chained: bool = False) -> tuple[Refusal | None, str]:
        """The effect check of downloaded outer states, taken together: None when they may replace ours.
        Refused without blame when they do worse than ours past ``SNAPSHOT_SLACK`` times the tolerance (a
        catch-up never replaces a healthy model with a much worse one; an honest holder whose phi merely went
        another way than ours is not blamed); an offence when they give a held-out loss ``ABSURD_WORSE`` above
        ours (conclusive when it is not finite, or worse than knowing nothing where it is the source's own model:
        ``FragmentSnapshot.kin``), all came from one source and no
        other fragment of ours is far behind (``stale``: the comparison then mixes fragments of distant
        versions). Stricter right after a fold (``FOLDED_SLACK``), from a source the transport doubts
        (``DOUBTED_SLACK``) and by ``in_step_slack`` where the fragments are in step (``_in_step_slack``). ``chained``
        (a catch-up, not a join): ours is the lower of this model's loss now and its loss before its first
        catch-up since its last merged round (``_loss_before_catch_ups``). With the verdict, the two losses in
        words (for the log: what a catch-up did to this node's model)."""
        if self.judge is None:
            return None, ""
        self.stats.effect_checks += 1
        theirs, now = self.judge.pooled_losses(
            states, [[s.phi.to(st.device) for s, st in zip(snaps, states, strict=True)], [st.phi for st in states]])
        ours, earlier = now, ""
        if chained:
            before = self._loss_before_catch_ups
            if before is None or not math.isfinite(before):
                self._loss_before_catch_ups = now
            elif before < now:
                ours, earlier = before, f" ({before:.4f} before its catch-ups since its last merged round)"
        judged = f"held-out loss {theirs:.4f}, this node's own {now:.4f}{earlier}"
        folded = any(st.folded for st in states)
        doubted = any(s.doubted for s in snaps)
        slack = (FOLDED_SLACK if folded else DOUBTED_SLACK if doubted
                 else in_step_slack if in_step_slack is not None else SNAPSHOT_SLACK)
        if not self.judge.harmful(theirs, ours, slack=slack):
            return None, judged
        self.stats.effect_refused += 1
        absurd = not stale and (not math.isfinite(theirs) or theirs > now * (1 + ABSURD_WORSE))
        blamed = absurd and len({s.source for s in snaps}) == 1
        whole = len(snaps) == len(self.states) or all(s.kin for s in snaps)  # the source's own model judged
        conclusive = blamed and (not math.isfinite(theirs) or (whole and theirs > self.judge.knowing_nothing()))
        which = "its phi" if len(snaps) == 1 else f"with fragments {[s.fragment for s in snaps]} together, its phi"
        after = (" (after a fold: no worse is taken)" if folded else
                 f" (from a source this node muted lately: at most {DOUBTED_SLACK:.0%} of the tolerance worse)"
                 if doubted else f" (in step with the swarm: at most {in_step_slack:.0%} of the tolerance worse)"
                 if in_step_slack is not None else "")
        return Refusal(f"effect: {which} gives a held-out loss of {theirs:.4f}, this node's own {now:.4f}{earlier}"
                       f"{after}", offence=blamed, conclusive=conclusive), judged

    @staticmethod
    def _in_step_slack(states: Sequence[FragmentState], snaps: Sequence[FragmentSnapshot]) -> float | None:
        """The slack these downloads are judged by where every fragment is in step with its group
        (``FragmentState.in_step``): ``IN_STEP_SLACK`` for each ``IN_STEP_GAP`` versions the furthest is ahead
        (at least once, at most ``SNAPSHOT_SLACK``); None where one is not."""
        if not all(st.in_step for st in states):
            return None
        gap = max(snap.version - st.version for st, snap in zip(states, snaps, strict=True))
        return min(SNAPSHOT_SLACK, IN_STEP_SLACK * max(1.0, gap / IN_STEP_GAP))

    def adopt(self, snaps: Sequence[FragmentSnapshot], *, keep_progress: bool) -> dict[int, Refusal]:
        """Join: take downloaded outer states (newer ones only), each checked for its bounds and distance, their
        effect judged together (``_judge_effect``). With ``keep_progress`` (a node resumed from its checkpoint)
        its own local progress rides on the new phi; otherwise theta starts at phi. Returns the refused
        fragments with why (nothing of them changed: the caller reports it and counts it against the source)."""
        refused: dict[int, Refusal] = {}
        taken = []
        for snap in snaps:
            st = self.states[snap.fragment]
            if snap.version < st.version:
                continue
            refusal = self._check_alone(st, snap, relative=keep_progress)
            if refusal is not None:
                refused[snap.fragment] = refusal
            else:
                taken.append(snap)
        if taken:
            refusal, _ = self._judge_effect([self.states[s.fragment] for s in taken], taken)
            if refusal is not None:
                refused.update({s.fragment: refusal for s in taken})
                taken = []
        for snap in taken:
            st = self.states[snap.fragment]
            theta = st.theta()
            progress = st.phi - theta if keep_progress else torch.zeros_like(theta)
            st.phi.copy_(snap.phi.to(st.phi.device))
            st.momentum.copy_(snap.momentum.to(st.momentum.device))
            st.version = snap.version
            st.set_theta(st.phi - progress)
        if taken:
            self._loss_before_catch_ups = None  # a join replaced the model: no catch-up since a merged round yet
            self._healthiest.clear()  # ... and its health is that of the swarm's phi
        self.stats.refused += len(refused)
        return refused

    # ---- the state contract (checkpoints) ----------------------------------------------------------
    STAT_FIELDS = ("bytes_sent", "bytes_received", "syncs_ok", "syncs_failed", "catch_ups", "catch_up_loops",
                   "replays")

    def state_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """``(required, optional)`` tensor keys of :meth:`state_dict` with their shapes."""
        required, optional = {}, {"shared_r": (len(self.states),), **self.compressor.state_shapes()}
        for st in self.states:
            required[f"{st.index}/phi"] = required[f"{st.index}/momentum"] = tuple(st.phi.shape)
            optional[f"{st.index}/residual"] = tuple(st.phi.shape)
        return required, optional

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the outer loop: ``tensors`` (``<p>/phi``, ``<p>/momentum``,
        ``<p>/residual`` with error feedback, ``shared_r`` once known, the compressor's shared state such as
        the low-rank bases and ranks; live tensors, copy them to keep them), per-fragment ``fragments``
        records (index, version, last_send, tokens_since_send), the ``expected_share`` and a few ``stats``.

        In-flight syncs are not kept: a fragment whose sync is in flight is saved as if that sync had failed
        (its tokens added back, its residual as before the send), which is what :meth:`_merge` does with a
        failed sync; a restarted node re-sends that progress. If the group did complete that round, this
        contribution counts twice: the price of never waiting for the network at a save. Under a late rule
        (eager, delay) the part of the last own contribution not yet applied is dropped."""
        tensors: dict[str, torch.Tensor] = {}
        fragments = []
        for st in self.states:
            pend = self.pending.get(st.index)
            tokens, residual = st.tokens_since_send, st.residual
            if pend is not None and not self.rule.late:
                tokens += pend.weight
                if pend.residual_before is not None and residual is not None:
                    residual = pend.residual_before
            tensors[f"{st.index}/phi"] = st.phi
            tensors[f"{st.index}/momentum"] = st.momentum
            if residual is not None:
                tensors[f"{st.index}/residual"] = residual
            fragments.append({"index": st.index, "version": int(st.version),
                              "last_send": None if st.last_send is None else int(st.last_send),
                              "tokens_since_send": float(tokens)})
        if self.shared_r is not None:
            tensors["shared_r"] = self.shared_r
        tensors.update(self.compressor.state_dict())
        return {"tensors": tensors, "fragments": fragments, "expected_share": float(self.expected_share),
                "stats": {k: getattr(self.stats, k) for k in self.STAT_FIELDS}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (the caller checked shapes and finiteness). Nothing is
        in flight afterwards; a missing residual (error feedback is a local setting) restores zero."""
        tensors = state["tensors"]
        records = {int(r["index"]): r for r in state["fragments"]}
        for st in self.states:
            st.phi.copy_(tensors[f"{st.index}/phi"])
            st.momentum.copy_(tensors[f"{st.index}/momentum"])
            if st.residual is not None:
                residual = tensors.get(f"{st.index}/residual")
                if residual is not None:
                    st.residual.copy_(residual)
                else:
                    st.residual.zero_()
            rec = records[st.index]
            st.version = int(rec["version"])
            st.last_send = None if rec["last_send"] is None else int(rec["last_send"])
            st.tokens_since_send = float(rec["tokens_since_send"])
            st.failed_rounds = st.refused_rounds = 0
            st.folded = st.in_step = False
        self._loss_before_catch_ups = None
        self._healthiest.clear()
        shared_r = tensors.get("shared_r")
        self.shared_r = None if shared_r is None else shared_r.to(torch.float32).clone()
        self.compressor.load_state_dict(tensors)
        self.pending.clear()
        self.pending_consensus.clear()
        self._fetches.clear()
        self._staging_asked.clear()
        if "expected_share" in state:
            self.expected_share = float(state["expected_share"])
        for key, value in (state.get("stats") or {}).items():
            if key in self.STAT_FIELDS:
                setattr(self.stats, key, value)

    def snapshot(self, fragment: int) -> FragmentSnapshot:
        """The fragment's outer state, with the steps that led to it that a peer may replay instead."""
        st = self.states[fragment]
        phi, momentum = st.phi.detach().cpu().clone(), st.momentum.detach().cpu().clone()
        steps = () if self._steps is None else self._steps[fragment].chain(fingerprint(phi, momentum), st.version)
        return FragmentSnapshot(fragment, st.version, phi, momentum, steps=steps)

    def version(self, fragment: int) -> int:
        return self.states[fragment].version

    @property
    def n_fragments(self) -> int:
        return len(self.states)

    def in_flight(self) -> int:
        """Syncs started and not merged yet."""
        return len(self.pending)

    def fragment_status(self) -> list[dict]:
        """Per fragment, for status displays: index, version, size, last send and last quantization error."""
        return [{"fragment": st.index, "version": st.version, "numel": st.numel, "last_send": st.last_send,
                 "quant_error": st.last_quant_error, **self.compressor.status(st.index)} for st in self.states]


def carry_steps(h: int, max_carry: int) -> int:
    """The most inner steps of local progress one sync of a fragment carries: the send intervals of ``h`` steps of
    ``max_carry`` failed rounds and of the round itself (``OuterLoop._bound_progress``; what a peer's token claim
    may cover: ``Node.max_weight``)."""
    return (max(0, int(max_carry)) + 1) * max(1, int(h))


def _relative_error(decoded: torch.Tensor, target: torch.Tensor) -> float:
    denom = float(torch.linalg.vector_norm(target))
    if denom == 0 or not math.isfinite(denom):
        return 0.0
    return float(torch.linalg.vector_norm(decoded.to(target.device) - target)) / denom
