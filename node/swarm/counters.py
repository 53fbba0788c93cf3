"""Bytes on the wire, per peer, per fragment and per round: counted by the exchange of a round's parts
(``locoswarm.node.swarm.exchange``) and the state protocol (``locoswarm.node.swarm.state_sync``), read by the
node's status and control API."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class ByteCounters:
    """Bytes on the wire (serialized protocol messages), per peer and per fragment."""

    sent_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_by_fragment: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    received_by_fragment: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    by_round: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def sent(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.sent_by_peer[peer] += n
        self.sent_by_fragment[fragment] += n
        self.by_round[(fragment, round_)][0] += n

    def received(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.received_by_peer[peer] += n
        self.received_by_fragment[fragment] += n
        self.by_round[(fragment, round_)][1] += n

    def received_unmatched(self, peer: str, n: int) -> None:
        """Bytes of a message not (yet) tied to one of this node's rounds: per peer only, so that made-up
        (fragment, round) pairs never grow the per-round table."""
        self.received_by_peer[peer] += n

    @property
    def total_sent(self) -> int:
        return sum(self.sent_by_peer.values())

    @property
    def total_received(self) -> int:
        return sum(self.received_by_peer.values())
