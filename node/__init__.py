"""locoswarm: a decentralized, peer-to-peer volunteer training node for language models.

Data flows config -> model/data -> inner loop -> outer core -> transport:

- ``node.config``     the swarm descriptor (peers.toml), validation and the swarm fingerprint
- ``node.model``      models built from transformers configs (presets tiny/small/125m)
- ``node.partition``  the strided fragment partition of a model
- ``node.data``       byte-level tokenization, local text corpora, per-worker sharding
- ``node.core``       the outer loop of the four papers, pure torch, no networking
- ``node.transport``  how a fragment's pseudo-gradient gets averaged with peers
- ``node.sim``        M workers in one process on the same core (``locoswarm simulate``)
- ``node.bench``      benchmark commands that write JSON + markdown + PNG reports
- ``node.plan``       the compute-utilization planner (``locoswarm plan``)
"""

__version__ = "0.1.0"
