"""What a node's transport asks of the node: the swarm as the node sees it (``SwarmView``), and where a catch-up's
state comes from (``StateSource``). Two narrow faces passed in at construction, instead of a callback per question.

The answers here are a node's that knows nothing beyond its own: no live peer, no belief, no bound, every weight
claim allowed, nothing to download. The daemon's ``Node`` answers from its heartbeat table, swarm clock, state
server and reputation; ``StateClient`` downloads states and steps; tests override what they need.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING

from locoswarm.node.swarm.versions import Belief

if TYPE_CHECKING:
    from locoswarm.node.core.transport import FragmentSnapshot


class SwarmView:
    """The swarm as this node sees it, for its transport's rounds, catch-ups and serving."""

    def live_peers(self) -> list[str]:
        """Peers whose heartbeats say they train (hold state): every round's candidates."""
        return []

    def pace_peers(self) -> list[str]:
        """The live peers that keep the swarm's pace (``membership.pace_set``): the ones a round waits for."""
        return self.live_peers()

    def straggler_grace(self) -> float | None:
        """How long a round may wait for live peers outside the pace set; None: the matchmaking timeout."""
        return None

    def step_time(self) -> float:
        """Seconds per inner step of the swarm (0: unknown)."""
        return 0.0

    def compute_step_time(self) -> float:
        """Seconds this node computes per inner step, without its waits for rounds (0: unknown)."""
        return 0.0

    def in_rounds(self) -> bool:
        """Whether the swarm's members count this node in their rounds yet (they have seen its heartbeat)."""
        return True

    def max_weight(self, peer: str, own_weight: float) -> float:
        """The most tokens ``peer`` can claim in a round where this node claims ``own_weight``."""
        return math.inf

    def joining_peers(self) -> list[str]:
        """Peers joining now by their heartbeats (no state yet)."""
        return []

    def serving_peers(self) -> list[str]:
        """Peers this node serves a state download now."""
        return []

    def version_bound(self) -> int | None:
        """The most outer versions a fragment can hold at the swarm's clock; None: no bound known."""
        return None

    def outbound_peers(self) -> Collection[str]:
        """Peers that declare themselves outbound only (behind NAT): nobody can dial them."""
        return ()

    def latest_versions(self, fragment: int) -> Belief:
        """The version of ``fragment`` to believe among the peers' heartbeats, and the holders to take it from."""
        return Belief()

    def kin(self, peer: str, fragment: int) -> bool:
        """Whether ``peer`` announces this node's state of every fragment but ``fragment``
        (``FragmentSnapshot.kin``)."""
        return True


class StateSource:
    """Where a catch-up downloads from: blocking calls of the transport's fetch thread."""

    def fetch(self, fragment: int, peers: list[str], min_version: int = 0,
              digest: bytes = b"") -> FragmentSnapshot | None:
        """The state of ``fragment`` at ``min_version`` or newer (hashing to ``digest`` there) from the first of
        ``peers`` that serves it, or None."""
        return None

    def fetch_steps(self, fragment: int, peers: list[str], have: int, target: int) -> FragmentSnapshot | None:
        """The outer steps of ``fragment`` from version ``have`` to ``target`` or beyond, or None (then a catch-up
        downloads the state)."""
        return None
