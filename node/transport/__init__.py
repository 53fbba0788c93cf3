"""How a fragment's pseudo-gradient is averaged with peers.

``base`` defines the interface the outer core talks to; ``inprocess`` implements it for workers in
one process (the simulator, unit tests). The swarm transport (hivemind DHT + libp2p streams) plugs in
behind the same interface.
"""

from node.transport.base import AverageHandle, AverageRequest, AverageResult, FragmentSnapshot, Transport

__all__ = ["AverageHandle", "AverageRequest", "AverageResult", "FragmentSnapshot", "Transport"]
