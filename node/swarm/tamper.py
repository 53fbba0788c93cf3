"""The wire seam: every point where what a node sends, reduces or serves could be rewritten, behind one public face.

A node never rewrites anything: the installed ``Tamper`` is the identity. The hostile-node benchmark
(``locoswarm.node.bench.hostile``) installs a subclass in its own process before the node starts, so the attack
harness depends on this interface alone, and the transport's and the daemon's private methods stay free to change.
Each hook is called where the honest value is final, just before it leaves the node:

- ``contribution``: a contribution's chunks and header values, as streamed to the reducer of one part;
- ``sender``: the sender its header names (the authenticated stream's peer id is not the header's to change);
- ``returned``: a reducer's reduced part as it arrived (seen, not changed);
- ``reduced``: the part of a round's average this node reduced, as it streams it back;
- ``published``: the fragment snapshot its state server serves and its heartbeats' digest names;
- ``heartbeat``: the heartbeat it publishes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from locoswarm.node.core.codecs import Codec
    from locoswarm.node.core.outer_loop import OuterLoop
    from locoswarm.node.core.transport import AverageRequest, FragmentSnapshot
    from locoswarm.node.swarm.averaging import SwarmTransport
    from locoswarm.protocol import swarm_pb2


class Tamper:
    """The identity at every point of the seam; a hostile node's attack overrides the hooks it needs."""

    def attached(self, transport: SwarmTransport) -> None:
        """The node's transport was built (an attack may read its public face: ``peer_id``, ``codec``, ``view``)."""

    def contribution(self, reducer: str, req: AverageRequest, part: range, bounds: Sequence[tuple[int, int]],
                     codec: Codec) -> AverageRequest:
        """The request streamed to ``reducer``, which reduces the chunks ``part`` (``bounds``: every chunk's
        element range; ``codec``: the one ``req.chunks`` are encoded with)."""
        return req

    def sender(self, reducer: str, own: str) -> str:
        """The sender that the header of this node's contribution to ``reducer`` names (``own``: its peer id)."""
        return own

    def returned(self, reducer: str, req: AverageRequest, chunks: Mapping[int, bytes]) -> None:
        """``reducer`` returned ``chunks``, its checked reduced part of ``req``'s round."""

    def reduced(self, fragment: int, round_: int, chunks: dict[int, bytes], codec: Codec,
                sizes: Mapping[int, int], *, consensus: bool) -> dict[int, bytes]:
        """The chunks of a round's average this node reduced (``sizes``: each chunk's element count;
        ``consensus``: a round that averages phi itself), as it streams them back to the members and applies
        them itself."""
        return chunks

    def published(self, snapshot: FragmentSnapshot, outer: OuterLoop) -> FragmentSnapshot:
        """The snapshot of a fragment that this node's state server serves and its heartbeats announce the digest
        of (``outer``: the node's outer loop, whose own snapshot this is)."""
        return snapshot

    def heartbeat(self, heartbeat: swarm_pb2.Heartbeat, outer: OuterLoop) -> swarm_pb2.Heartbeat:
        """The heartbeat this node publishes."""
        return heartbeat


_installed = Tamper()


def install(tamper: Tamper) -> None:
    """Make ``tamper`` this process's seam (the hostile-node benchmark only; before the node starts)."""
    global _installed
    _installed = tamper


def installed() -> Tamper:
    """This process's seam: the identity unless a hostile node installed its attack."""
    return _installed
