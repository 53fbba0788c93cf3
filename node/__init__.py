"""locoswarm: a decentralized, peer-to-peer volunteer training node for language models.

Data flows config -> model/data -> inner loop -> outer core -> transport:

- ``locoswarm.node.config``     the swarm descriptor (peers.toml), validation and the swarm fingerprint
- ``locoswarm.node.model``      models built from transformers configs (presets tiny/small/125m)
- ``locoswarm.node.partition``  the strided fragment partition of a model
- ``locoswarm.node.data``       byte-level tokenization, local text corpora, per-worker sharding
- ``locoswarm.node.core``       the outer loop of the four papers, pure torch, no networking
- ``locoswarm.node.transport``  how a fragment's pseudo-gradient gets averaged with peers
- ``locoswarm.node.sim``        M workers in one process on the same core (``locoswarm simulate``)
- ``locoswarm.node.bench``      benchmark commands that write JSON + markdown + PNG reports
- ``locoswarm.node.plan``       the compute-utilization planner (``locoswarm plan``)
"""

__version__ = "0.1.0"
