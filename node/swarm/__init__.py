"""The networked swarm: process hygiene, DHT discovery, membership heartbeats, fragment averaging and
state download over hivemind's DHT and libp2p.

- ``locoswarm.node.swarm.process``     process group, orphan watchdog, signal handlers
- ``locoswarm.node.swarm.dht``         starting the DHT (bootstrap with retries, identity, port checks)
- ``locoswarm.node.swarm.membership``  heartbeats, the peer table, fingerprint refusal
- ``locoswarm.node.swarm.clock``       the swarm clock from the heartbeats, bounded against lying peers
- ``locoswarm.node.swarm.records``     DHT records bound to the publisher's libp2p identity (signed), size bounds
"""
