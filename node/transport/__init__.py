"""How a fragment's pseudo-gradient is averaged with peers.

The interface the outer core talks to lives with the core (``locoswarm.node.core.transport``); ``inprocess``
implements it for workers in one process (the simulator, unit tests). The swarm transport (hivemind DHT +
libp2p streams) plugs in behind the same interface.
"""

from locoswarm.node.core.transport import AverageHandle, AverageRequest, AverageResult, FragmentSnapshot, Transport

__all__ = ["AverageHandle", "AverageRequest", "AverageResult", "FragmentSnapshot", "Transport"]
