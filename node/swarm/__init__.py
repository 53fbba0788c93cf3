"""The networked swarm: process hygiene, DHT discovery, membership heartbeats, fragment averaging and
state download over hivemind's DHT and libp2p.

- ``node.swarm.process``     process group, orphan watchdog, signal handlers
- ``node.swarm.dht``         starting the DHT (bootstrap with retries, identity, port checks)
- ``node.swarm.membership``  heartbeats, the peer table, fingerprint refusal
- ``node.swarm.clock``       the swarm clock from the heartbeats, bounded against lying peers
- ``node.swarm.records``     DHT records bound to the publisher's libp2p identity (signed), size bounds
"""
