"""The outer loop's guards: whatever a transport hands back (a poisoned average, a bad snapshot) never
enters phi, momentum or theta; the loop reports a "refused" event, keeps its state and keeps syncing.
A transport that corrupts results stands in for a hostile group (the swarm transport screens first;
these guards are the last line, independent of it)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from locoswarm.node.config import ModelSection, OuterSection
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.guard import GuardLimits, check_average, check_outer_step, check_shift, check_snapshot
from locoswarm.node.core.judge import EffectJudge, LossJudge
from locoswarm.node.core.outer_loop import DOUBTED_SLACK, SNAPSHOT_SLACK, OuterLoop
from locoswarm.node.core.state import FragmentState
from locoswarm.node.core.transport import (
    AverageHandle,
    AverageRequest,
    AverageResult,
    FragmentSnapshot,
    MemberShare,
    PartOrigin,
    Transport,
)
from locoswarm.node.model import build_model
from locoswarm.node.partition import partition
from locoswarm.node.transport.inprocess import InProcessHub

VOCAB = 257


class _Poisoned(AverageHandle):
    def __init__(self, inner: AverageHandle, poison, group_version: int | None = None, fail: bool = False,
                 foreign: bool = False, edit=None) -> None:
        self.inner, self.poison, self.group_version, self.fail = inner, poison, group_version, fail
        self.foreign, self.edit = foreign, edit

    def done(self) -> bool:
        return self.fail or self.inner.done()

    def result(self, timeout: float | None = None) -> AverageResult:
        if self.fail:
            return AverageResult(ok=False, error="no peer in group")
        res = self.inner.result(timeout)
        if res.ok and res.average is not None and self.poison is not None:
            res.average = self.poison(res.average)
        if res.ok and self.group_version is not None:
            res.max_version = self.group_version
        if res.ok and self.foreign:
            res.parts = [PartOrigin("QmPartner", 0, res.average.numel() if res.average is not None else 0,
                                    one_lineage=False)]
            res.kin = 0.5  # its partner sent from another phi
        if res.ok and self.edit is not None:
            self.edit(res)
        return res


class PoisoningTransport(Transport):
    """Delegates to the hub; rounds listed in ``poison`` come back with their average corrupted, and
    ``snapshot`` (when set) is what catching up downloads; rounds listed in ``fail`` fail for want of peers (they
    reach no other member), and those in ``foreign`` had a member that sent from another phi. ``group_version``
    / ``latest`` (when set) stand for the swarm transport's corroborated versions: what a round reports as its
    group's version, and the newest version this node believes peers hold."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.poison: dict[int, object] = {}
        self.fail: set[int] = set()
        self.foreign: set[int] = set()
        self.snapshot: FragmentSnapshot | None = None
        self.rejected: list[tuple[str, str]] = []
        self.offences: list[bool] = []
        self.conclusive: list[bool] = []
        self.blamed: list[PartOrigin] = []
        self.edit: dict[int, object] = {}  # round -> a change made to its (complete) result
        self.members_blamed: list[str] = []
        self.alarms: list[str] = []
        self.group_version: int | None = None
        self.latest: int | None = None

    def start_average(self, request: AverageRequest) -> AverageHandle:
        if request.round in self.fail:
            return _Poisoned(None, None, fail=True)
        return _Poisoned(self.inner.start_average(request), self.poison.get(request.round), self.group_version,
                         foreign=request.round in self.foreign, edit=self.edit.get(request.round))

    def latest_version(self, fragment: int) -> int:
        if self.latest is not None:
            return self.latest
        return self.snapshot.version if self.snapshot is not None else self.inner.latest_version(fragment)

    def fetch_fragment(self, fragment: int) -> FragmentSnapshot | None:
        return self.snapshot if self.snapshot is not None else self.inner.fetch_fragment(fragment)

    def reject_snapshot(self, snapshot: FragmentSnapshot, reason: str, *, offence: bool = True,
                        conclusive: bool = False) -> None:
        self.rejected.append((snapshot.source, reason))
        self.offences.append(offence)
        self.conclusive.append(conclusive)

    def reject_part(self, result: AverageResult, part: PartOrigin, reason: str) -> None:
        self.blamed.append(part)

    def reject_member(self, result: AverageResult, share: MemberShare, reason: str) -> None:
        self.members_blamed.append(share.member)

    def alarm(self, reason: str) -> None:
        self.alarms.append(reason)


def test_a_catch_up_far_from_our_phi_is_a_conclusive_offence_whatever_it_measures() -> None:
    """A downloaded phi whose cosine with our trained phi is below FAR_COSINE (a reversal), at most FAR_GAP versions
    ahead, is refused as a conclusive offence even where it measures better (a negated fragment of two measured
    within the snapshot slack); one far ahead (a node resumed from an old checkpoint) is judged by its effect only,
    and one near ours that measured worse is refused without blame (an honest holder whose phi went another way)."""
    from locoswarm.node.core.outer_loop import ABSURD_WORSE, FAR_GAP

    class Scripted(QuadraticJudge):
        losses_now: tuple[float, float] = (2.0, 1.0)  # theirs, ours

        def joint_losses(self, states, candidates) -> list[float]:
            return list(self.losses_now)

    assert 1 + ABSURD_WORSE > 2.0
    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    for t in range(1, 7):
        step(t)
    judge = loops[0].judge = Scripted(target)
    st = loops[0].states[0]
    phi = st.phi.detach().cpu().clone()
    side = torch.randn(phi.shape, generator=torch.Generator().manual_seed(3))
    side -= torch.dot(side, phi) / torch.dot(phi, phi) * phi
    near = -0.2 * phi + 0.98 * phi.norm() * side / side.norm()  # cosine -0.2: lineages split early on
    far = -phi
    cases = [(near, 3, (2.0, 1.0), "refused", False), (far, 3, (2.0, 1.0), "refused", True),
             (far, FAR_GAP, (0.5, 1.0), "refused", True), (far, FAR_GAP + 1, (0.5, 1.0), "caught_up", None)]
    for t, (snap_phi, gap, losses, kind, conclusive) in zip(range(8, 16, 2), cases, strict=True):
        judge.losses_now = losses
        version = st.version
        transports[0].snapshot = FragmentSnapshot(0, version + gap, snap_phi, torch.zeros_like(phi), source="QmX")
        before = st.phi.clone()
        loops[0].pending.clear()
        events = [e for e in loops[0].send(t) if e.kind in ("refused", "caught_up")]
        assert [e.kind for e in events] == [kind], (gap, events)
        if conclusive is None:
            assert st.version == version + gap
            continue
        assert torch.equal(st.phi, before)
        assert transports[0].conclusive[-1] is conclusive and transports[0].offences[-1] is conclusive
        assert ("points against this node's" in events[0].error) is conclusive, events[0].error


class QuadraticJudge(EffectJudge):
    """A held-out "loss" every worker's training lowers: the squared distance of the fragment from ``target``
    (every other parameter ignored), with the LossJudge's tolerance rule."""

    def __init__(self, target: torch.Tensor, relative_tolerance: float = 0.05) -> None:
        self.target = target
        self.relative_tolerance = relative_tolerance
        self.calls = 0

    def tolerance(self, reference: float) -> float:
        return self.relative_tolerance * abs(reference)

    def joint_losses(self, states: list[FragmentState], candidates) -> list[float]:
        self.calls += 1
        return [float(sum(((c.to(self.target.device) - self.target) ** 2).sum() for c in cand))
                for cand in candidates]


def _pair(method: str = "replace", judge_target: torch.Tensor | None = None):
    outer = OuterSection(method=method, h=2, fragments=1, tau=0, codec="fp32", error_feedback=False, lr=0.7,
                         momentum=0.9, schedule="fixed", consensus_every=0)
    base = build_model(ModelSection(), VOCAB)
    hub = InProcessHub(get_codec("fp32", 64), 2, seed=0)
    fragments = partition(base, 1)
    models = [copy.deepcopy(base) for _ in range(2)]
    transports = [PoisoningTransport(hub.transport(i)) for i in range(2)]
    judges = [QuadraticJudge(judge_target) if judge_target is not None else None for _ in models]
    loops = [OuterLoop(m, fragments, outer, t, judge=j, expected_group_size=2)
             for m, t, j in zip(models, transports, judges, strict=True)]
    for i, loop in enumerate(loops):
        hub.register_state(i, loop.version, loop.snapshot)
    gens = [torch.Generator().manual_seed(7 + i) for i in range(2)]

    def step(t: int) -> list[list]:
        for model, loop, gen in zip(models, loops, gens, strict=True):
            with torch.no_grad():
                if judge_target is None:
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
                else:  # training lowers the judge's loss: a step toward the target, plus noise
                    st = loop.states[0]
                    theta = st.theta()
                    st.set_theta(theta + 0.1 * (judge_target - theta) + 1e-4 * torch.randn(theta.shape, generator=gen))
            loop.add_tokens(10.0)
        events: list[list] = [[] for _ in loops]
        for i, loop in enumerate(loops):
            events[i] += loop.collect(t) + loop.send(t)
        hub.flush()
        for i, loop in enumerate(loops):
            events[i] += loop.collect(t)
        return events

    return loops, transports, step


@pytest.mark.parametrize("poison", [
    pytest.param(lambda a: torch.full_like(a, float("nan")), id="nan"),
    pytest.param(lambda a: torch.full_like(a, 1e30), id="huge"),
    pytest.param(lambda a: a * 1000.0, id="scaled"),
])
def test_a_poisoned_average_is_refused_and_the_next_round_merges(poison) -> None:
    loops, transports, step = _pair()
    step(1)
    transports[0].poison[2] = poison
    phi_before = loops[0].states[0].phi.clone()
    version_before = loops[0].version(0)
    events = step(2)
    refused = [e for e in events[0] if e.kind == "refused"]
    assert len(refused) == 1 and refused[0].error
    assert torch.equal(loops[0].states[0].phi, phi_before) and loops[0].version(0) == version_before
    assert bool(torch.isfinite(loops[0].states[0].theta()).all())
    assert loops[0].stats.refused == 1
    step(3)
    events = step(4)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]
    assert bool(torch.isfinite(loops[0].states[0].phi).all())


def test_a_bad_catch_up_snapshot_is_refused_and_blamed_on_its_source() -> None:
    loops, transports, step = _pair()
    step(1)
    step(2)
    st = loops[0].states[0]
    phi = st.phi.detach().cpu().clone()
    nan_phi = phi.clone()
    nan_phi[3] = float("nan")
    transports[0].snapshot = FragmentSnapshot(0, st.version + 1000, nan_phi, torch.zeros_like(phi), source="QmLiar")
    before = st.phi.clone()
    events = [e for e in loops[0].send(4) if e.kind == "refused"]
    assert events and "non-finite" in events[0].error
    assert torch.equal(st.phi, before) and loops[0].version(0) < 1000
    assert transports[0].rejected and transports[0].rejected[0][0] == "QmLiar"


def test_a_fragment_still_at_its_initial_state_catches_up_to_a_far_trained_phi() -> None:
    # A joiner whose download of a fragment failed keeps it at version 0 (its init): the swarm's phi may be
    # many times its norm away. That is no lie: the catch-up gets a joiner's checks (finite, bounded momentum).
    loops, transports, _ = _pair()
    st = loops[0].states[0]
    assert loops[0].version(0) == 0
    far = st.phi.detach().cpu().clone() * 13.0
    transports[0].snapshot = FragmentSnapshot(0, 115, far, torch.zeros_like(far), source="QmHonest")
    events = loops[0].send(2)
    assert [e.kind for e in events if e.kind in ("caught_up", "refused")] == ["caught_up"]
    assert loops[0].version(0) == 115 and not transports[0].rejected
    # Once trained (version > 0), the same jump is absurd and refused.
    loops, transports, step = _pair()
    step(1)
    step(2)
    st = loops[0].states[0]
    assert loops[0].version(0) > 0
    transports[0].snapshot = FragmentSnapshot(0, 300, st.phi.detach().cpu() * 13.0, torch.zeros_like(far),
                                              source="QmLiar")
    events = loops[0].send(4)
    assert [e.kind for e in events if e.kind in ("caught_up", "refused")] == ["refused"]
    assert transports[0].rejected[-1][0] == "QmLiar"


class _NoRound(AverageHandle):
    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> AverageResult:
        return AverageResult.failed("no peer in group")


class _FarAheadSwarm(Transport):
    """Peers that hold ``snaps`` (one per fragment, None: its holder is gone) and form no round; a holder once
    refused is not asked again (the swarm transport's cool-down)."""

    def __init__(self, snaps: dict[int, FragmentSnapshot | None]) -> None:
        self.snaps = snaps
        self.fetched: list[int] = []
        self.rejected: list[tuple[int, bool, bool]] = []

    def start_average(self, request: AverageRequest) -> AverageHandle:
        return _NoRound()

    def latest_version(self, fragment: int) -> int:
        return 105

    def fetch_fragment(self, fragment: int) -> FragmentSnapshot | None:
        self.fetched.append(fragment)
        snap = self.snaps[fragment]
        return None if snap is None or any(f == fragment for f, _, _ in self.rejected) else snap

    def reject_snapshot(self, snapshot: FragmentSnapshot, reason: str, *, offence: bool = True,
                        conclusive: bool = False) -> None:
        self.rejected.append((snapshot.fragment, offence, conclusive))


class _CoupledJudge(EffectJudge):
    """Fragments trained together: the model does well with all of them from one lineage (``1.0``, or
    ``new_loss`` when all come from the swarm's ``snaps``), and absurdly badly with a mix (``10.0``)."""

    def __init__(self, loop: OuterLoop, snaps: dict[int, FragmentSnapshot | None], new_loss: float = 1.0,
                 relative: float = 0.0, nothing: float = math.inf) -> None:
        self.loop, self.snaps, self.new_loss, self.relative, self.nothing = loop, snaps, new_loss, relative, nothing

    def tolerance(self, reference: float) -> float:
        return self.relative * abs(reference)

    def knowing_nothing(self) -> float:
        return self.nothing

    def joint_losses(self, states, candidates) -> list[float]:
        out = []
        for cand in candidates:
            new = {st.index: self.snaps[st.index] is not None and torch.equal(c, self.snaps[st.index].phi)
                   for st, c in zip(states, cand, strict=True)}
            sides = {new.get(p, False) for p in range(len(self.loop.states))}
            out.append(10.0 if len(sides) > 1 else self.new_loss if True in sides else 1.0)
        return out


def _far_behind_node(served: set[int], new_loss: float = 1.0, relative: float = 0.0, nothing: float = math.inf,
                     doubted: bool = False, start: int = 5, kin: bool = True):
    """A two-fragment node at v``start`` whose peers hold v105 of the fragments in ``served`` (``doubted``: the
    transport doubts the holder; ``kin``: the holder announces this node's other fragment)."""
    outer = OuterSection(method="replace", h=2, fragments=2, tau=0, codec="fp32", error_feedback=False,
                         schedule="fixed", consensus_every=0)
    model = build_model(ModelSection(), VOCAB)
    fragments = partition(model, 2)
    snaps: dict[int, FragmentSnapshot | None] = {}
    transport = _FarAheadSwarm(snaps)
    loop = OuterLoop(model, fragments, outer, transport, expected_group_size=2)
    assert loop.adopt([FragmentSnapshot(p, start, loop.snapshot(p).phi.clone(), loop.snapshot(p).momentum.clone())
                       for p in range(2)], keep_progress=False) == {}
    for p in range(2):
        phi = loop.snapshot(p).phi.clone()
        snaps[p] = FragmentSnapshot(p, 105, phi + 0.01, torch.zeros_like(phi), source="QmHolder",
                                    doubted=doubted, kin=kin) if p in served else None
    loop.judge = _CoupledJudge(loop, snaps, new_loss, relative, nothing)
    events = []
    for t in range(1, 9):
        loop.add_tokens(10.0)
        events += loop.collect(t) + loop.send(t)
    return loop, transport, [e for e in events if e.kind in ("caught_up", "refused")]


def test_a_node_far_behind_judges_its_catch_ups_as_one_model() -> None:
    """A node far behind on every fragment (resumed from an old checkpoint) measured the swarm's fragment beside its
    own stale other one: several times its loss, and it banned an honest holder for it. Its catch-ups wait for each
    other and are judged together; one whose partner cannot be had is refused without blame; a combination that
    does absurdly worse is one offence of its source, not conclusive (an honest holder's phi measured 4x once)."""
    loop, transport, events = _far_behind_node({0, 1})
    assert sorted(e.fragment for e in events if e.kind == "caught_up") == [0, 1], events
    assert transport.rejected == [] and loop.version(0) == loop.version(1) == 105

    loop, transport, events = _far_behind_node({0})  # fragment 1's holder is gone: asked once, then judged alone
    assert [(e.kind, e.fragment) for e in events] == [("refused", 0)], events
    assert transport.rejected == [(0, False, False)] and transport.fetched.count(1) >= 1
    assert loop.version(0) == 5

    loop, transport, events = _far_behind_node({0, 1}, new_loss=10.0)
    assert sorted((e.kind, e.fragment) for e in events) == [("refused", 0), ("refused", 1)], events
    assert "fragments [0, 1] together" in events[0].error
    assert transport.rejected == [(0, True, False), (1, False, False)]
    assert loop.version(0) == loop.version(1) == 5


def test_an_absurd_catch_up_is_conclusive_only_when_it_does_worse_than_knowing_nothing() -> None:
    """Four times this node's loss and more is an offence of its source; a ban at once only where the phi also
    does worse than a model that knows nothing (uniform over the vocabulary: a liar's garbage). An honest holder's
    phi that low-rank re-encoded rounds had damaged measured 4.44 against 1.105, below the 5.55 of knowing nothing,
    and the honest node banned for it at once sat alone for the rest of a CI run."""
    for theirs, conclusive in ((4.5, False), (10.0, True)):
        loop, transport, events = _far_behind_node({0, 1}, new_loss=theirs, nothing=5.0)
        assert sorted((e.kind, e.fragment) for e in events) == [("refused", 0), ("refused", 1)], events
        assert transport.rejected == [(0, True, conclusive), (1, False, False)], theirs
        assert loop.version(0) == loop.version(1) == 5
    judge = LossJudge(build_model(ModelSection(), VOCAB), [torch.zeros(1, 4, dtype=torch.long)], "cpu",
                      relative_tolerance=1.0)
    assert judge.knowing_nothing() == pytest.approx(math.log(VOCAB))


def test_one_fragment_of_another_lineage_is_no_ban_at_once() -> None:
    """A catch-up of one fragment is judged beside this node's other one. Where the holder announces that other
    fragment as this node holds it (``FragmentSnapshot.kin``), the mix is the holder's own model, and doing worse
    than knowing nothing bans it at once; where it does not, the mix may join two lineages, which alone measured
    10.1 against 2.12 (an honest low-rank joiner, banned at once in a test run): refused, one offence, no ban."""
    for kin in (True, False):
        loop, transport, events = _far_behind_node({0}, nothing=5.0, start=104, kin=kin)
        assert [(e.kind, e.fragment) for e in events][:1] == [("refused", 0)], events
        assert transport.rejected[0] == (0, True, kin), kin
        assert loop.version(0) == 104


def test_a_catch_up_never_takes_a_phi_much_worse_than_its_own_and_says_whence_it_came() -> None:
    """A catch-up may do at most ``SNAPSHOT_SLACK`` times the effect tolerance worse than the node's own phi (at the
    default tolerance, a share of 1.0 of the loss: 50%), measured on the judge's whole pool of batches; a refused one
    is no offence of its source (an honest phi may go another way) and the node keeps its own. A taken one is logged
    with its source and the two losses."""
    for worse in (1.0 + 1.2 * SNAPSHOT_SLACK, 1.0 + 2 * SNAPSHOT_SLACK):
        loop, transport, events = _far_behind_node({0, 1}, new_loss=worse, relative=1.0)
        assert sorted((e.kind, e.fragment) for e in events) == [("refused", 0), ("refused", 1)], (worse, events)
        assert transport.rejected == [(0, False, False), (1, False, False)]
        assert loop.version(0) == loop.version(1) == 5
    loop, transport, events = _far_behind_node({0, 1}, new_loss=1.0 + SNAPSHOT_SLACK / 2, relative=1.0)
    assert sorted((e.kind, e.fragment) for e in events) == [("caught_up", 0), ("caught_up", 1)], events
    assert loop.version(0) == loop.version(1) == 105
    assert "from QmHolder" in events[0].error and "held-out loss" in events[0].error


def test_a_catch_up_from_a_source_the_transport_doubts_may_do_only_a_little_worse() -> None:
    """A source the transport muted lately for its standing drift (``FragmentSnapshot.doubted``) serves a phi at
    most ``DOUBTED_SLACK`` times the tolerance worse: 2 + 2 drift runs took a drifter's phi 22% worse. Refused without
    blame (an honest member disturbed by an attack is muted now and then too); a phi about as good is still taken."""
    worse = 1.0 + (DOUBTED_SLACK + SNAPSHOT_SLACK) / 2     # the undoubted bound would take it
    loop, transport, events = _far_behind_node({0, 1}, new_loss=worse, relative=1.0, doubted=True)
    assert sorted((e.kind, e.fragment) for e in events) == [("refused", 0), ("refused", 1)], events
    assert "muted lately" in events[0].error
    assert transport.rejected == [(0, False, False), (1, False, False)]
    assert loop.version(0) == loop.version(1) == 5
    loop, _, events = _far_behind_node({0, 1}, new_loss=worse, relative=1.0)
    assert sorted((e.kind, e.fragment) for e in events) == [("caught_up", 0), ("caught_up", 1)], events
    loop, _, events = _far_behind_node({0, 1}, new_loss=1.0 + DOUBTED_SLACK / 2, relative=1.0, doubted=True)
    assert sorted((e.kind, e.fragment) for e in events) == [("caught_up", 0), ("caught_up", 1)], events
    assert loop.version(0) == loop.version(1) == 105


def test_the_pooled_loss_is_the_mean_over_every_held_out_batch_and_leaves_the_model_as_it_was() -> None:
    model = build_model(ModelSection(), VOCAB)
    fragments = partition(model, 1)
    loop = OuterLoop(model, fragments, OuterSection(method="replace", h=2, fragments=1, tau=0, codec="fp32",
                                                    error_feedback=False), _FarAheadSwarm({0: None}),
                     expected_group_size=2)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(3)]
    judge = LossJudge(model, batches, "cpu", relative_tolerance=1.0)
    st = loop.states[0]
    before = [p.detach().clone() for p in model.parameters()]
    other = st.phi + 0.05 * torch.randn(st.phi.shape, generator=gen)
    pooled = judge.pooled_losses([st], [[st.phi], [other]])
    singles = [judge.joint_losses([st], [[st.phi], [other]]) for _ in batches]   # one batch per call, in turn
    for k in range(2):
        assert pooled[k] == pytest.approx(sum(s[k] for s in singles) / len(batches), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_adopt_refuses_a_non_finite_join_download() -> None:
    loops, _, _ = _pair()
    st = loops[0].states[0]
    bad = st.phi.detach().cpu().clone()
    bad[0] = float("inf")
    refused = loops[0].adopt([FragmentSnapshot(0, 5, bad, torch.zeros_like(bad), source="QmX")], keep_progress=False)
    assert "non-finite" in refused[0].reason and refused[0].offence and loops[0].version(0) == 0
    good = st.phi.detach().cpu().clone() + 0.01
    assert loops[0].adopt([FragmentSnapshot(0, 5, good, torch.zeros_like(good))], keep_progress=False) == {}
    assert loops[0].version(0) == 5 and torch.allclose(st.phi.cpu(), good)


def test_check_functions_bound_honest_scales() -> None:
    limits = GuardLimits()
    x = torch.randn(1000)
    assert check_average(x, float(x.norm()), limits) is None
    assert check_average(x * 100, float(x.norm()), limits) is not None
    assert check_average(x * 100, 0.0, limits, phi_norm=float(x.norm())) is not None   # contributed nothing
    assert check_average(x, 0.0, limits, phi_norm=float(x.norm())) is None
    # a joiner's own progress is tiny next to its partner's: 20x its own is fine while small next to phi
    assert check_average(x, float(x.norm()) / 20, limits, phi_norm=10 * float(x.norm())) is None
    assert check_average(x * 100, float(x.norm()), limits, phi_norm=10 * float(x.norm())) is not None
    phi, mom = torch.randn(1000), torch.zeros(1000)
    avg = torch.randn(1000) * 5  # an early honest step can be several times |phi|
    assert check_outer_step(phi, mom, phi - 0.7 * 1.9 * avg, 0.9 * mom + avg, avg, limits) is None
    assert check_outer_step(phi, mom, phi - 1e6 * avg, mom + avg, avg, limits) is not None
    assert check_shift(phi * 0.01, phi, limits) is None and check_shift(phi, phi, limits) is not None
    assert check_snapshot(phi + 0.1, mom, phi, limits) is None
    assert check_snapshot(phi * 1e6, mom, phi, limits) is not None
    assert check_snapshot(phi[:10], mom[:10], phi, limits) is not None


def test_a_member_a_version_ahead_of_its_group_takes_the_groups_phi_and_version() -> None:
    # Node 0 stepped once more than the group (e.g. alone, just before a peer joined): its claim is not
    # corroborated, so node 1 does not follow it. Averaging deltas alone would keep the two phis apart
    # for good; node 0 must take the group's version at once and the group's phi before its next send.
    loops, transports, step = _pair()
    step(1)
    step(2)
    v = loops[0].version(0)
    assert v == loops[1].version(0) >= 1
    mine = loops[0].snapshot(0)
    assert loops[0].adopt([FragmentSnapshot(0, v + 1, mine.phi + 0.01, mine.momentum)], keep_progress=True) == {}
    transports[1].latest = v                      # node 1 believes nobody holds a newer version
    transports[0].group_version = transports[1].group_version = v
    step(3)
    events = step(4)
    assert [e.kind for e in events[0] if e.kind in ("merged", "failed")] == ["merged"]
    assert loops[0].version(0) == loops[1].version(0) == v + 1
    assert not torch.equal(loops[0].states[0].phi, loops[1].states[0].phi)  # not yet: at node 0's next send
    assert not any(e.kind == "caught_up" for e in events[1])
    for t in transports:  # both now claim v + 1: the hub's view is the corroborated one again
        t.group_version = t.latest = None
    step(5)
    events = step(6)
    assert [e.kind for e in events[0]][:2] == ["caught_up", "sent"]
    assert loops[0].version(0) == loops[1].version(0) == v + 2
    assert torch.equal(loops[0].states[0].phi, loops[1].states[0].phi)
    assert torch.equal(loops[0].states[0].momentum, loops[1].states[0].momentum)
    events = step(8)
    assert not any(e.kind == "caught_up" for e in events[0])  # once: the phis agree again


def _trained_target() -> torch.Tensor:
    base = build_model(ModelSection(), VOCAB)
    phi = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    return phi + 0.05 * torch.randn(phi.shape, generator=torch.Generator().manual_seed(3))


def test_the_effect_check_passes_an_honest_average_and_refuses_a_harmful_one_blaming_its_part() -> None:
    """An average whose outer step would do worse on the held-out check than the node's own progress alone is
    refused (a failed round: phi and version unchanged), and the reducer of the part that is harmful on its own
    is blamed; honest rounds pass, and the next one merges."""
    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    step(1)
    events = step(2)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]
    assert loops[0].stats.effect_checks >= 1 and loops[0].stats.effect_refused == 0
    st = loops[0].states[0]
    n = st.numel

    def poison(avg: torch.Tensor) -> torch.Tensor:  # the second reducer's part, negated and scaled
        out = avg.clone()
        out[n // 2:] *= -3.0
        return out

    transports[0].poison[4] = poison
    phi, version = st.phi.clone(), loops[0].version(0)
    step(3)
    events = step(4)
    refused = [e for e in events[0] if e.kind == "refused"]
    assert len(refused) == 1 and refused[0].error.startswith("effect:")
    assert torch.equal(st.phi, phi) and loops[0].version(0) == version
    assert loops[0].stats.effect_refused == 1
    assert transports[0].blamed and all(p.end > n // 2 for p in transports[0].blamed)
    assert all(p.start >= n // 2 - 1 or p.end > n // 2 for p in transports[0].blamed)
    step(5)
    events = step(6)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]


def test_a_harmful_own_part_is_blamed_on_the_members_whose_contributions_alone_are_harmful() -> None:
    """Where the part this node reduced itself is harmful alone (colluders that make most of its group set the
    centre its screening judges by), each member's own contribution to it is judged alone, and only the sender
    of a harmful one is blamed, not the honest member beside it."""
    target = _trained_target()
    _, transports, step = _pair(judge_target=target)
    step(1)
    step(2)

    def flip(res: AverageResult) -> None:  # a colluder's contribution made the own part: the honest one's, negated 3x
        own = next(p for p in res.parts if p.reducer == "w000000")
        honest = MemberShare("w000001", res.average[own.start:own.end].clone())
        flipped = -3.0 * honest.values
        res.average[own.start:own.end] = flipped
        res.parts = [p if p is not own else PartOrigin(own.reducer, own.start, own.end, shares=(
            MemberShare("QmFlip", flipped), honest)) for p in res.parts]

    transports[0].edit[4] = flip
    step(3)
    events = step(4)
    refused = [e for e in events[0] if e.kind == "refused"]
    assert len(refused) == 1 and refused[0].error.startswith("effect:")
    assert transports[0].members_blamed == ["QmFlip"]
    step(5)
    events = step(6)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]
    assert transports[0].members_blamed == ["QmFlip"]


def test_where_the_screening_of_its_own_part_was_outvoted_a_passed_round_is_still_attributed() -> None:
    """A round's average that passes the effect check is applied; where this node's screening of its own part was
    outvoted (``PartOrigin.contested``) that part is judged alone too, and a member whose contribution alone does
    worse by MEMBER_SLACK of the tolerance is blamed. Where it was not outvoted nothing more is measured."""
    from locoswarm.node.core.outer_loop import MEMBER_SLACK

    class Lenient(QuadraticJudge):  # no round is harmful as a whole; the member check keeps its slack
        def harmful(self, loss: float, reference: float, slack: float = 1.0) -> bool:
            return slack == MEMBER_SLACK and super().harmful(loss, reference, slack)

    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    for i in range(2):
        loops[i].judge = Lenient(target)
    step(1)
    step(2)

    def outvoted(contested: bool):
        def edit(res: AverageResult) -> None:  # a colluder outvoted this node in its own part
            own = next(p for p in res.parts if p.reducer == "w000000")
            honest = MemberShare("w000001", res.average[own.start:own.end].clone())
            flipped = -3.0 * honest.values
            res.average[own.start:own.end] = flipped
            res.parts = [p if p is not own else PartOrigin(own.reducer, own.start, own.end, shares=(
                MemberShare("QmFlip", flipped), honest), contested=contested) for p in res.parts]
        return edit

    transports[0].edit[4] = outvoted(contested=False)
    step(3)
    events = step(4)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]
    assert transports[0].members_blamed == [] and loops[0].stats.contested_checks == 0
    transports[0].edit[6] = outvoted(contested=True)
    step(5)
    events = step(6)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]
    assert transports[0].members_blamed == ["QmFlip"] and loops[0].stats.contested_checks == 1


def test_the_effect_check_measures_the_own_step_only_for_an_average_harmful_against_phi() -> None:
    """An honest round costs two measured candidates (the average's step and phi); only an average harmful against
    phi has the own step measured as well (a reference that can only excuse it)."""

    class Counting(QuadraticJudge):
        measured = 0

        def lazy_losses(self, state, candidates):
            for c in candidates:
                self.measured += 1
                yield self.losses(state, [c])[0]

    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    judge = loops[0].judge = Counting(target)
    step(1)
    events = step(2)
    assert [e.kind for e in events[0] if e.kind in ("merged", "refused")] == ["merged"]
    assert loops[0].stats.effect_checks == 1 and judge.measured == 2
    n = loops[0].states[0].numel
    transports[0].poison[4] = lambda avg: torch.cat([avg[:n // 2], -3.0 * avg[n // 2:]])
    step(3)
    events = step(4)
    assert [e.kind for e in events[0] if e.kind == "refused"] == ["refused"]
    assert loops[0].stats.effect_checks == 2 and judge.measured == 5


def test_rounds_each_within_the_tolerance_cannot_add_up_past_the_healthiest_phi() -> None:
    """Rounds whose averages each do a little worse than the phi they replace, well within the tolerance, are taken
    until the held-out loss would rise past ``HEALTHY_SLACK`` times the tolerance above the lowest loss of a phi this
    node held (two drifters walked an honest node from 2.65 to 38 this way); then refused without blame, while a
    round that does better than the phi as it stands is still taken. A restore forgets the marks. From half that
    slack on (``ALARM_SHARE``), each round that passes the tolerance alarms the transport (``Transport.alarm``)."""
    from locoswarm.node.core.outer_loop import ALARM_SHARE, HEALTHY_SLACK

    class Drifting(QuadraticJudge):
        """Every round's average does ``rise`` worse than phi as it stands (``level``); the own step no better."""
        level, rise = 2.0, 0.0

        def health_slack(self) -> float:  # ``[robust] health_slack`` at the robustness bench's value
            return HEALTHY_SLACK

        def lazy_losses(self, state, candidates):
            yield self.level * (1 + self.rise)
            yield self.level
            yield self.level

    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    judge = loops[0].judge = Drifting(target)
    judge.rise = 0.4 * HEALTHY_SLACK * judge.relative_tolerance  # 0.2% a round: the tolerance is 5%

    alarmed: list[int] = []  # alarms raised by each judged round, in order

    def rounds(first: int, last: int) -> list[str]:
        kinds = []
        for t in range(first, last):
            for e in step(t)[0]:
                if e.kind in ("merged", "refused"):
                    kinds.append(e.kind)
                    alarmed.append(len(transports[0].alarms) - sum(alarmed))
                    if e.kind == "merged":
                        judge.level *= 1 + judge.rise
                    else:
                        assert "healthiest phi this node held" in e.error, e.error
        return kinds

    kinds = rounds(1, 11)
    assert kinds[:3] == ["merged", "merged", "refused"] and set(kinds[2:]) == {"refused"}, kinds
    assert judge.level <= 2.0 * (1 + HEALTHY_SLACK * judge.relative_tolerance)
    assert not transports[0].blamed  # a sum of small steps is nobody's doing alone
    # 0.2% above the marks: quiet; 0.4% (past half the slack of 0.5%) and on: an alarm each round
    assert ALARM_SHARE == 0.5 and alarmed[:3] == [0, 1, 1] and set(alarmed[2:]) == {1}, alarmed
    assert "healthiest phi held" in transports[0].alarms[0], transports[0].alarms[0]
    judge.rise = -0.01  # a round that does better than phi as it stands: taken, however far above the marks
    judge.level *= 1.5
    assert set(rounds(11, 15)) == {"merged"}
    judge.rise = 0.4 * HEALTHY_SLACK * judge.relative_tolerance
    assert rounds(15, 17)[-1] == "refused"
    loops[0].load_state_dict(loops[0].state_dict())
    assert rounds(17, 19)[0] == "merged"  # a restored model is judged from where it now stands


def test_after_a_fold_a_catch_up_must_do_no_worse_than_the_nodes_own_phi() -> None:
    """A node that folded its progress into its own phi refused its peers' rounds: their phi is taken only where it
    does no worse than its own (``FOLDED_SLACK``), not within the usual ``SNAPSHOT_SLACK``, until a merged round or
    a catch-up (2 + 2 drift: fold, catch up from a drifter 0.1-13% worse, fold again, nine times in 14 s)."""
    from locoswarm.node.core.outer_loop import FOLDED_SLACK, IN_STEP_GAP

    assert FOLDED_SLACK < SNAPSHOT_SLACK
    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    for t in range(1, 7):
        step(t)
    st = loops[0].states[0]
    worse = 0.005  # 1% worse on the quadratic judge: inside the snapshot slack (2.5% at its tolerance of 5%)
    for t, folded, expected in [(8, True, "refused"), (10, False, "caught_up")]:
        phi = st.phi.detach().cpu().clone()
        st.folded = folded
        st.in_step = False  # the snapshot slack judges where it did not fold
        transports[0].snapshot = FragmentSnapshot(0, st.version + IN_STEP_GAP + 1, phi + worse * (phi - target),
                                                  torch.zeros_like(phi), source="QmX")
        loops[0].pending.clear()
        events = [e for e in loops[0].send(t) if e.kind in ("refused", "caught_up")]
        assert [e.kind for e in events] == [expected]
        if folded:
            assert "after a fold" in events[0].error and transports[0].offences[-1] is False
            assert torch.equal(st.phi.cpu(), phi)
    st.folded = True
    better = st.phi.detach().cpu().clone()
    transports[0].snapshot = FragmentSnapshot(0, st.version + IN_STEP_GAP + 1, better - 0.1 * (better - target),
                                              torch.zeros_like(better), source="QmY")
    loops[0].pending.clear()
    assert [e.kind for e in loops[0].send(12) if e.kind == "caught_up"] == ["caught_up"]  # a better one is taken
    assert not st.folded


def test_a_catch_up_never_replaces_phi_with_a_worse_one() -> None:
    """A downloaded phi that does much worse on the held-out check than the node's own is refused: four times
    the loss and more (a negated phi) is an offence of its source, not conclusive (an honest holder's damaged phi
    measured 4.02x once); 69% worse (past the snapshot slack, but maybe an honest holder whose phi went another way)
    is no offence."""
    from locoswarm.node.core.outer_loop import FAR_GAP

    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    for t in range(1, 7):
        step(t)
    st = loops[0].states[0]
    phi = st.phi.detach().cpu().clone()
    gap = FAR_GAP + 3  # past the distance rule's reach (a node far behind): the effect alone decides
    for t, (snap_phi, offence) in zip((8, 10), [(-phi, True), (phi + 0.3 * (phi - target), False)], strict=True):
        transports[0].snapshot = FragmentSnapshot(0, st.version + gap, snap_phi, torch.zeros_like(phi), source="QmX")
        before = st.phi.clone()
        loops[0].pending.clear()  # the round sent at the previous step would hold the download back
        events = [e for e in loops[0].send(t) if e.kind == "refused"]
        assert events and "effect" in events[0].error
        assert torch.equal(st.phi, before)
        assert transports[0].offences[-1] is offence and transports[0].conclusive[-1] is False
    # a better one is taken
    transports[0].snapshot = FragmentSnapshot(0, st.version + 3, target.clone(), torch.zeros_like(phi), source="QmY")
    loops[0].pending.clear()
    events = loops[0].send(12)
    assert any(e.kind == "caught_up" for e in events)


def test_a_fragment_in_step_with_the_swarm_takes_no_catch_up_much_worse_than_its_own_phi() -> None:
    """A fragment in step with its group (a merged round of one lineage, and since then no catch-up judged otherwise)
    takes a download only within ``IN_STEP_SLACK`` times the tolerance of its own phi for each ``IN_STEP_GAP``
    versions it is ahead (2 + 2 state liars: an honest node took 7 catch-ups up to 16% and 39% worse, and its eval
    rose 14% above clean). Refused without blame, however often it is served; a catch-up taken within it leaves the
    fragment in step. Failed rounds do not end it (two drifters' join failed an honest node's rounds, and it then
    took their states 20% and 29% worse); a round merged where half the members or more sent from another phi does,
    a minority of another phi does not (``AverageResult.kin``: two colluding state liars in every group of 6 took 4
    honest nodes out of step); a swarm far enough ahead is taken within ``SNAPSHOT_SLACK``, and that catch-up ends
    being in step."""
    from locoswarm.node.core.outer_loop import IN_STEP_GAP, IN_STEP_SLACK

    assert IN_STEP_SLACK < SNAPSHOT_SLACK
    target = _trained_target()

    def in_step_pair():
        loops, transports, step = _pair(judge_target=target)
        for t in range(1, 7):
            step(t)
        assert loops[0].states[0].in_step
        return loops[0], transports[0]

    def catch_up(loop, transport, t: int, gap: int, worse: float) -> list:
        """``worse``: 0.005 is 1% worse on the quadratic judge, past the in-step slack up to 16 versions ahead
        (0.25% per 4 versions at its tolerance of 5%) and inside the snapshot slack (2.5%)."""
        st = loop.states[0]
        phi = st.phi.detach().cpu().clone()
        transport.snapshot = FragmentSnapshot(0, st.version + gap, phi + worse * (phi - target),
                                              torch.zeros_like(phi), source="QmX")
        loop.pending.clear()  # the round sent at the previous step would hold the download back
        events = [e for e in loop.send(t) if e.kind in ("refused", "caught_up")]
        transport.snapshot = None
        loop.pending.clear()  # its round would wait for a partner that does not send at this step
        return events

    loop, transport = in_step_pair()
    st = loop.states[0]
    phi, version = st.phi.clone(), st.version
    for t, gap in [(8, 2), (10, 2), (12, 2 * IN_STEP_GAP)]:  # served again at once, and further ahead: refused
        [refused] = catch_up(loop, transport, t, gap, 0.005)
        assert refused.kind == "refused" and "in step with the swarm" in refused.error
        assert transport.offences[-1] is False and torch.equal(st.phi, phi) and st.version == version
    assert [e.kind for e in catch_up(loop, transport, 14, 2, -0.01)] == ["caught_up"]  # a better one is taken
    assert st.in_step and st.version == version + 2
    assert [e.kind for e in catch_up(loop, transport, 16, 2, 0.005)] == ["refused"]    # and it is still in step
    transport.fail = set(range(17, 40))
    kinds = [e.kind for t in range(17, 28) for e in loop.collect(t) + loop.send(t)]  # rounds fail for want of peers
    assert "dropped" in kinds  # until it dropped the progress they carried: still in step
    loop.pending.clear()
    assert st.in_step and [e.kind for e in catch_up(loop, transport, 28, 2, 0.005)] == ["refused"]
    assert [e.kind for e in catch_up(loop, transport, 30, 5 * IN_STEP_GAP, 0.005)] == ["caught_up"]  # far ahead
    assert st.in_step  # within 1.25%: in step still

    loops, transports, step = _pair(judge_target=target)  # a round with a member of another phi: not in step
    transports[0].foreign = {6}
    for t in range(1, 7):
        step(t)
    assert not loops[0].states[0].in_step
    assert [e.kind for e in catch_up(loops[0], transports[0], 8, 2, 0.005)] == ["caught_up"]
    loops, transports, step = _pair(judge_target=target)  # one member of three of another phi: in step still
    def minority(res: AverageResult) -> None:
        res.parts = [PartOrigin("QmPartner", 0, res.average.numel(), one_lineage=False)]
        res.kin = 2 / 3

    transports[0].edit = {6: minority}
    for t in range(1, 7):
        step(t)
    assert loops[0].states[0].in_step
    assert [e.kind for e in catch_up(loops[0], transports[0], 8, 2, 0.005)] == ["refused"]

    loop, transport = in_step_pair()
    gap = round(IN_STEP_GAP * SNAPSHOT_SLACK / IN_STEP_SLACK)  # the snapshot slack's reach
    assert [e.kind for e in catch_up(loop, transport, 8, gap, 0.005)] == ["caught_up"]
    assert not loop.states[0].in_step


def test_a_run_of_catch_ups_is_judged_against_the_model_before_the_first() -> None:
    """Catch-ups with no merged round between them are judged against the lower of the model's loss now and its
    loss before the first of them: each within the snapshot slack of the one before, they cannot walk a model to a
    much worse one (2 + 2 drift: 2.65, 3.19, 4.10, 4.90 in a second). A merged round starts the run again."""
    target = _trained_target()
    loops, transports, step = _pair(judge_target=target)
    for t in range(1, 7):
        step(t)
    loop, transport = loops[0], transports[0]
    st = loop.states[0]
    st.in_step = False  # out of step (a bad join): the snapshot slack, 2.5% on the quadratic judge, judges

    def catch_up(t: int, worse: float) -> list:
        phi = st.phi.detach().cpu().clone()
        transport.snapshot = FragmentSnapshot(0, st.version + 2, phi + worse * (phi - target), torch.zeros_like(phi),
                                              source="QmX")
        loop.pending.clear()
        events = [e for e in loop.send(t) if e.kind in ("refused", "caught_up")]
        transport.snapshot = None
        loop.pending.clear()
        return events

    assert [e.kind for e in catch_up(8, 0.008)] == ["caught_up"]  # 1.6% worse
    phi = st.phi.clone()
    [refused] = catch_up(10, 0.008)  # 1.6% worse again: 3.2% worse than before the first
    assert refused.kind == "refused" and "before its catch-ups since its last merged round" in refused.error
    assert torch.equal(st.phi, phi) and transport.offences[-1] is False
    st.in_step = False
    for t in range(12, 16):
        step(t)  # merged rounds: a new run
    st.in_step = False
    assert [e.kind for e in catch_up(16, 0.008)] == ["caught_up"]
