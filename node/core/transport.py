"""The interface between the outer core and whatever averages pseudo-gradients with peers.

The core starts an average of one fragment's encoded pseudo-gradient and later polls or waits for
the group's result. A result is atomic: either the complete weighted average, identical on every
member of the group, or a failure, in which case the core keeps its local progress for the next sync.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from locoswarm.node.core.schedule import ScheduleState


@dataclass
class AverageRequest:
    fragment: int
    round: int                 # swarm clock step at which the sync started: equal on every member
    chunks: list[bytes]        # codec payload, see locoswarm.node.core.payload
    numel: int
    weight: float              # tokens this contribution represents
    version: int               # sender's outer version of this fragment
    extras: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # small fp32 vector, summed over the group
    codec: str = ""            # payload codec when not the swarm's (consensus rounds carry fp32 phi)
    digest: bytes = b""        # when every member's digest is equal, nothing needs averaging: the round
                               # succeeds at once with ``average = None`` and no payload is exchanged
    schedule: ScheduleState | None = None  # adaptive schedule: what the sender picked this fragment from
    # Low-rank payloads (locoswarm.node.core.lowrank) are coefficients on a basis: ``basis`` tags it (its ranks and a
    # hash), and every member of a group must send the same tag. Where they differ, the group takes the
    # leader's (smallest id) tag and each member calls ``reencode(leader_tag)``: the same pseudo-gradient
    # on the seeded basis of this round at the leader's ranks (None: it cannot, and it leaves the round).
    basis: bytes = b""
    reencode: Callable[[bytes], AverageRequest | None] | None = None
    # crc32 of the sender's phi of the fragment at the send: its lineage. Members judge each other's direction
    # (for bans) only within one lineage: progress made from another phi may point elsewhere in good faith.
    lineage: int = 0


@dataclass(frozen=True)
class EncodedAverage:
    """A round's group average as the wire carried it: ``chunks`` of ``codec`` encoding ``numel`` elements
    (``locoswarm.node.core.payload``). What a node that missed the round replays (``locoswarm.node.core.step_log``)."""

    codec: str
    numel: int
    chunks: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


@dataclass(frozen=True)
class OuterStep:
    """One outer step a fragment took: the group ``average`` whose step produced ``version``, from the state of
    digest ``before`` to the state of digest ``after`` (``locoswarm.node.core.state.state_digest``)."""

    version: int
    average: EncodedAverage
    before: bytes = b""
    after: bytes = b""


@dataclass(frozen=True)
class PartOrigin:
    """Who reduced which elements of a round's average: ``[start, end)`` of the payload vector came from
    ``reducer``. The outer loop blames a part that would harm its model on it (:meth:`Transport.reject_part`).
    ``one_lineage``: every member that contributed to this node's part sent from this node's phi (the harm
    of an average made from other phis may be honest: a joiner, a member a round behind)."""

    reducer: str
    start: int
    end: int
    one_lineage: bool = True
    # This node's own part only: each other member's contribution to it, decoded (``MemberShare``). When the
    # part alone is harmful the outer loop judges each alone (``OuterLoop._blame_members``): colluders that
    # make most of a group set the centre a reducer screens against, but not what their own deltas do.
    shares: tuple[MemberShare, ...] = ()
    # ... and whether this node's screening of it was outvoted (a contribution pointed against its own and with
    # the others' median, ``robust.Agreement.outvoted``): it could not tell who is odd, so the outer loop asks
    # the held-out loss even where the round's average passes (``OuterLoop._judge_contested``).
    contested: bool = False


@dataclass(frozen=True, eq=False)
class MemberShare:
    """What one member alone sent for ``[start, end)`` of the round's payload vector (its parent
    ``PartOrigin``'s range), decoded; ``same_lineage``: it sent from this node's phi."""

    member: str
    values: torch.Tensor
    same_lineage: bool = True


# Failures of a round before this member's contribution reached any other member. The transports fail rounds
# with these texts (as ``AverageResult.error``, or inside a peer's refusal); the robustness bench tells a hostile
# node's rounds that sent something from those that did not by them (``UNSENT_FAILURES``).
NO_PEER_IN_GROUP = "no peer in group"
LATE_FOR_ROUND = "arrived after the matchmaking window closed"
NOT_IN_ROUND = "this peer is not in the round"
GROUP_MISMATCH = "group mismatch"
BASIS_MISMATCH = "low-rank basis mismatch"
EXCLUDED_BY_ALL = "every other member of the round excludes this node (banned there)"
NOT_AT_CONSENSUS_VERSION = "not at the consensus round's version"
UNSENT_FAILURES = (NO_PEER_IN_GROUP, LATE_FOR_ROUND, NOT_IN_ROUND, GROUP_MISMATCH, BASIS_MISMATCH, EXCLUDED_BY_ALL,
                   NOT_AT_CONSENSUS_VERSION)


@dataclass
class AverageResult:
    ok: bool
    average: torch.Tensor | None = None   # fp32 flat, sum_i w_i * delta_i / sum_i w_i (None: all equal)
    extras: torch.Tensor | None = None
    group_size: int = 0
    total_weight: float = 0.0
    own_weight: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    error: str = ""
    max_version: int = -1                 # newest outer version the group's members hold (corroborated) at send time
    encoded: EncodedAverage | None = None  # ``average`` as the wire carried it (None: not known), see OuterStep
    basis: bytes = b""                    # the basis tag the group's payloads used (see AverageRequest.basis)
    # Where the round's wall time went (0 where a transport does not measure it): from its start until its
    # member list was decided, and until its result was complete. The fixed cost of a round, next to the
    # transfer time, is what the planner models and the swarm benchmark reports.
    matchmaking_s: float = 0.0
    round_s: float = 0.0
    parts: list[PartOrigin] = field(default_factory=list)  # who reduced what (empty: not known)
    # Failed because this node refused what a peer sent it (a reduced part pointing against its own progress, or
    # malformed), not for want of peers or time: the outer loop then keeps the progress such rounds carried.
    refused: bool = False
    # Members of the group that some reducer reduced without (their part came late, was refused, or they formed
    # another group): the members' lists differed, so this round's list is no basis for the next one.
    missing: int = 0
    # The share of the members whose contributions to this node's part came, this node included, that sent from its
    # phi (1.0: all, or not known). A fragment is in step with its group where more than half did
    # (``OuterLoop``, ``IN_STEP_SLACK``).
    kin: float = 1.0

    @classmethod
    def failed(cls, error: str, *, own_weight: float = 0.0, refused: bool = False) -> AverageResult:
        return cls(ok=False, error=error, own_weight=own_weight, refused=refused)


@dataclass
class FragmentSnapshot:
    """A peer's outer state of one fragment, fetched by a node that fell behind."""

    fragment: int
    version: int
    phi: torch.Tensor
    momentum: torch.Tensor
    source: str = ""          # the peer it came from (a transport's own bookkeeping)
    # The transport doubts its source: it muted that peer's contributions lately for their standing drift
    # (``DeviationMemory.muted_lately``). The effect check then allows it less (``outer_loop.DOUBTED_SLACK``).
    doubted: bool = False
    # The source announced this node's state of every other fragment (the same digest at the same version, or a
    # version one apart): a judgement of this fragment beside this node's others then judges the source's own model.
    # False where the mix may join two lineages, which alone can do worse than a model that knows nothing (an
    # honest low-rank joiner's fragment beside its partner's other one measured 10.1 against 2.12): the effect
    # check then does not ban its source at once (``outer_loop.ABSURD_WORSE``).
    kin: bool = True
    # The source's claim of its swarm clock and inner steps when it sent the state, and this node's wall
    # time then (None: not told): judged by the swarm clock like a heartbeat before a joiner takes a clock.
    clock: int | None = None
    inner_step: int = 0
    seen: float = 0.0
    # On a holder: the outer steps its phi took last, from its groups' averages (``StepLog.chain``), which it can
    # serve a node a few versions behind instead of this whole state.
    steps: tuple[OuterStep, ...] = ()
    # A *replay* instead of a state, where ``base`` >= 0: ``steps`` take the phi and momentum of version ``base``
    # to ``version``, in order (phi and momentum are empty). ``verify(v, phi, momentum)``, called at ``base`` and
    # after each step with the version reached, tells whether that state is the one the holder had there (and,
    # where the swarm's holders announce one, the digest of that version); None: nothing to check.
    base: int = -1
    verify: Callable[[int, torch.Tensor, torch.Tensor], bool] | None = None

    @property
    def is_replay(self) -> bool:
        return self.base >= 0


class AverageHandle(ABC):
    @abstractmethod
    def done(self) -> bool:
        """True once ``result()`` returns without waiting."""

    @abstractmethod
    def result(self, timeout: float | None = None) -> AverageResult:
        """The group's result; a failed result (never an exception) on timeout or error."""

    def cancel(self) -> None:  # noqa: B027 - optional for transports that cannot cancel
        """Give up on this round (the node is leaving)."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the round to finish without giving up on it (unlike a
        ``result`` that times out); whether it has finished."""
        deadline = time.monotonic() + timeout
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))
        return True


class FetchHandle:
    """A download of one fragment's outer state (:meth:`Transport.start_fetch`); this base class holds
    a download that already finished."""

    def __init__(self, snapshot: FragmentSnapshot | None) -> None:
        self._snapshot = snapshot

    def done(self) -> bool:
        return True

    def result(self) -> FragmentSnapshot | None:
        """The snapshot, or None when no peer could serve one (call once ``done()``)."""
        return self._snapshot


class Transport(ABC):
    @abstractmethod
    def start_average(self, request: AverageRequest) -> AverageHandle:
        """Start averaging ``request`` with a group of peers; returns at once."""

    @abstractmethod
    def latest_version(self, fragment: int) -> int:
        """Newest outer version of ``fragment`` known among peers (-1 if unknown)."""

    @abstractmethod
    def fetch_fragment(self, fragment: int) -> FragmentSnapshot | None:
        """Outer state of ``fragment`` from a peer holding the newest version, or None."""

    def start_fetch(self, fragment: int, have: int | None = None) -> FetchHandle:
        """Start :meth:`fetch_fragment` without waiting for it. By default it runs at once (in-process
        transports, where it costs nothing); a networked transport downloads in the background so the
        node keeps training meanwhile. ``have``: the version of the fragment this node holds on the swarm's
        phi (None: its phi is not the swarm's), from which a transport may fetch a replay (``FragmentSnapshot``)
        instead of the state."""
        return FetchHandle(self.fetch_fragment(fragment))

    def reject_snapshot(self, snapshot: FragmentSnapshot, reason: str, *, offence: bool = True,  # noqa: B027
                        conclusive: bool = False) -> None:
        """The core refused a snapshot this transport fetched (the guard found it absurd, or the effect check
        worse than what this node holds): a transport that knows where it came from does not fetch from that
        peer again for a while and, for an ``offence``, holds it against it (``conclusive``: no honest holder
        could have served it, a ban at once). Nothing to do by default."""

    def reject_replay(self, snapshot: FragmentSnapshot, reason: str) -> None:  # noqa: B027
        """The core could not take a replay this transport fetched (``FragmentSnapshot.replay``): a transport
        fetches the state instead for a while. Nothing to do by default."""

    def reject_part(self, result: AverageResult, part: PartOrigin, reason: str) -> None:  # noqa: B027
        """The core refused a round's result because of ``part`` (its effect on the held-out loss): a transport
        holds it against the part's reducer. Nothing to do by default."""

    def reject_member(self, result: AverageResult, share: MemberShare, reason: str) -> None:  # noqa: B027
        """The core refused a round's result, and ``share``, one member's own contribution to this node's part,
        is harmful alone (its effect on the held-out loss): a transport holds it against that member. Nothing to
        do by default."""

    def alarm(self, reason: str) -> None:  # noqa: B027
        """The core's effect check saw this node's held-out loss climb well above the healthiest it held, through
        rounds that each passed (``core.outer_loop.ALARM_SHARE``): a sum of small harms, nobody's alone. A transport
        may judge its peers' persistent differences more strictly for a while. Nothing to do by default."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release resources."""
