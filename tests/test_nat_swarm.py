"""Two public nodes and two that nobody can dial, as real ``locoswarm run`` processes: on loopback with the
outbound-only ones declared (``--reachability outbound-only``), and in network namespaces behind real NAT
routers (MASQUERADE, inbound connections dropped) where every node finds out for itself.

Every node must merge rounds, the four must agree on phi, and nobody may have opened a stream to an
outbound-only node (its ``reachability.inbound_streams`` stays 0): rounds never depend on a connection that
cannot exist."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from swarm_util import NodeProc, bootstrap_addr, write_config, write_corpus

pytestmark = pytest.mark.timeout(300)

SLOW = ("--throttle", "3", "--eval-every", "0")


def _merged(status: dict) -> list[dict]:
    return [e for e in status.get("events", []) if e["kind"] == "merged"]


def _views(nodes: list[NodeProc]) -> list[dict[int, tuple[int, int]]]:
    return [{f["fragment"]: (f["version"], f["phi_hash"]) for f in n.status().get("fragments", [])} for n in nodes]


def _wait_agree(nodes: list[NodeProc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        views = _views(nodes)
        if all(v == views[0] for v in views[1:]) and views[0]:
            return
        time.sleep(0.3)
    tails = "\n".join(f"--- {n.name}\n{n.tail(20)}" for n in nodes)
    raise AssertionError(f"the four never agreed on phi: {_views(nodes)}\n{tails}")


def _check_round_roles(nodes: list[NodeProc], public: list[NodeProc], outbound: list[NodeProc],
                       reachabilities: dict[str, str]) -> None:
    """Rounds merged everywhere, agreement, nobody dialled the outbound-only nodes, and every node's status and
    its peers' heartbeats name each node's reachability."""
    for node in nodes:  # both fragments merged a few times on every node
        node.wait_status(lambda s: {e["fragment"] for e in _merged(s)} == {0, 1} and len(_merged(s)) >= 6, 180,
                         "six merged rounds of both fragments")
    _wait_agree(nodes, 90)
    statuses = {n.name: n.status() for n in nodes}
    for node in nodes:
        st = statuses[node.name]
        assert st["reachability"]["state"] == reachabilities[node.name], (node.name, st["reachability"])
        seen = {pid: peer["reachability"] for pid, peer in st["peers"].items()}
        for other in nodes:
            if other is not node:
                assert seen[statuses[other.name]["peer_id"]] == reachabilities[other.name], (node.name, seen)
    for node in outbound:  # it took part in every merged round without anybody opening a stream to it
        assert statuses[node.name]["reachability"]["inbound_streams"] == 0, statuses[node.name]["reachability"]
    for node in public:  # the public members reduced the parts
        assert statuses[node.name]["reachability"]["inbound_streams"] > 0
    for node in nodes:  # the four averaged in one group: two reducers, two members nobody dials
        assert any(e["group_size"] == 4 for e in _merged(statuses[node.name])), _merged(statuses[node.name])


def test_two_outbound_only_nodes_average_through_two_public_ones_on_loopback(tmp_path: Path) -> None:
    # h = 48: each fragment's round every 48 steps (about 2.5 s here), not 8. At 8 the four nodes' versions moved
    # twice a second, and in a CI run the four did not agree within 90 s: one node made about 1,900 steps while
    # the swarm clock moved 330, averages and catch-ups measured at held-out 6-7 against 0.75 were refused, and
    # one reducer's parts were refused as pointing against the members' progress (an open pace defect).
    config = write_config(tmp_path / "peers.toml", outer={"h": 48},
                          network={"group_size": 4, "matchmaking_timeout": 3.0, "round_timeout": 10.0,
                                   "heartbeat_interval": 0.5})
    data = write_corpus(tmp_path / "data")
    nodes: list[NodeProc] = []

    def start(name: str, *extra: str) -> NodeProc:
        node = NodeProc(name, tmp_path / name, ["--config", str(config), "--data", str(data), *SLOW, *extra],
                        tmp_path / f"{name}.log")
        nodes.append(node)
        return node

    try:
        first = start("public0")
        boot = bootstrap_addr(first.wait_status(lambda s: s.get("addrs"), 90, "its addresses"))
        second = start("public1", "--bootstrap", boot)
        natted = [start(f"outbound{i}", "--bootstrap", boot, "--reachability", "outbound-only") for i in (2, 3)]
        st = second.wait_status(lambda s: s.get("reachability", {}).get("source") == "checked", 90, "its check")
        assert st["reachability"]["state"] == "public" and st["reachability"]["reachable"] >= 1
        _check_round_roles(nodes, [first, second], natted,
                           {"public0": "public", "public1": "public", "outbound2": "outbound-only",
                            "outbound3": "outbound-only"})
        assert "outbound-only" in natted[0].status()["reachability"]["mode"]
    finally:
        for node in nodes:
            node.stop()
    assert not any(n.group_alive() for n in nodes), "processes left behind"


def _netns_reason() -> str | None:
    from locoswarm.node.bench.swarm import netns
    from locoswarm.node.errors import UserError

    try:
        netns.check_possible(nat=True, cut=True)
    except UserError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def _namespace_swarm(tmp_path: Path, **topology) -> Iterator[list[NodeProc]]:
    """Four ``locoswarm run`` nodes in the network namespaces of ``netns.Topology(4, **topology)``, node 0 the
    bootstrap the others join: yields them started. Stops them, deletes the namespaces and checks that nothing of
    either is left. Skips where namespaces with iptables rules cannot be made here."""
    reason = _netns_reason()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(f"network namespaces with iptables rules cannot be made here: {reason}")
    from locoswarm.node.bench.swarm import netns

    # h = 48: at the helpers' h = 8 each fragment's round came every 0.5 s against a 3 s matchmaking window; in a CI
    # run one node of the cut pair then caught up 101 times in a row and merged nothing for 150 s
    config = write_config(tmp_path / "peers.toml", outer={"h": 48},
                          network={"group_size": 4, "matchmaking_timeout": 3.0, "round_timeout": 10.0,
                                   "heartbeat_interval": 0.5})
    data = write_corpus(tmp_path / "data")
    topo = netns.Topology(4, **topology)
    nodes: list[NodeProc] = []

    def start(i: int, *extra: str) -> NodeProc:
        args = ["--config", str(config), "--data", str(data), "--host", topo.address(i), "--port", "31337",
                *SLOW, *extra]
        node = NodeProc(f"node{i}", tmp_path / f"node{i}", args, tmp_path / f"node{i}.log",
                        prefix=topo.exec_prefix(i))
        nodes.append(node)
        return node

    try:
        topo.create()
        first = start(0)
        addrs = first.wait_status(lambda s: s.get("addrs"), 90, "its addresses")["addrs"]
        boot = next(a for a in addrs if f"/{topo.address(0)}/" in a)
        for i in (1, 2, 3):
            start(i, "--bootstrap", boot)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
        topo.close()
    assert not any(n.group_alive() for n in nodes), "processes left behind"
    assert netns.bench_namespaces(int(topo.tag)) == []


@pytest.mark.slow
def test_two_nodes_behind_nat_routers_find_out_and_average_through_two_public_ones(tmp_path: Path) -> None:
    with _namespace_swarm(tmp_path, nat=2) as nodes:
        first, others = nodes[0], nodes[1:]
        for node in others:  # each one checked by node 0 through the address its connection came from
            node.wait_status(lambda s: s.get("reachability", {}).get("source") == "checked", 90, "its check")
        _check_round_roles(nodes, [first, others[0]], others[1:],
                           {"node0": "public", "node1": "public", "node2": "outbound-only",
                            "node3": "outbound-only"})
        # told once, in one line of its log (the status keeps only the last 50 events: merges push it out)
        told = [line for line in others[1].log_path.read_text(errors="replace").splitlines()
                if "reachability: outbound only" in line]
        assert len(told) == 1 and "forward TCP port" in told[0], told or others[1].tail()


@pytest.mark.slow
def test_a_pair_that_cannot_connect_is_kept_apart_and_every_node_keeps_merging(tmp_path: Path) -> None:
    """Four public nodes, with every packet between nodes 2 and 3 dropped (a firewall between two particular
    peers): each of the pair learns from its failed dials that it cannot reach the other, and the rounds route
    around the pair (``locoswarm.node.swarm.dial_failures``). Without that, every round of four failed for both."""
    with _namespace_swarm(tmp_path, cuts=((2, 3),)) as nodes:
        pair = nodes[2:]
        # one of the two fails to dial the other; they are kept apart from then on, so the other may never try
        deadline = time.monotonic() + 180
        while not any(n.status().get("reachability", {}).get("undialable") for n in pair):
            assert time.monotonic() < deadline, "no failed dial between the pair: " + pair[0].tail()
            time.sleep(0.3)
        mark = time.time()  # events keep their wall time (the list holds the last 200)
        for node in nodes:
            node.wait_status(lambda s: sum(1 for e in s.get("events", []) if e["time"] >= mark
                                           and e["kind"] == "merged" and e["group_size"] >= 2) >= 6, 150,
                             "six merged rounds after the pair's failed dials")
        for node in nodes:
            st = node.status()
            after = [e for e in st["events"] if e["time"] >= mark]
            merged = [e for e in after if e["kind"] == "merged" and e["group_size"] >= 2]
            # Without the routing every round of the pair fails on its dial to the other (and with it the rounds
            # of the other members they reduce for); other failures (a member late for a round on a loaded
            # machine) are not the cut's. One per fragment is allowed: the rounds under way when the first failed
            # dial was recorded, and a standing list of four the other node of the pair may take once.
            cut = [e["detail"] for e in after if e["kind"] == "failed" and "could not open a stream" in e["detail"]]
            assert len(cut) <= 2, (node.name, cut[:5], node.tail())
            assert st["reachability"]["state"] == "public", st["reachability"]
            if node in pair:  # never again in one group with the other: no group of four
                assert st["reachability"]["undialable"] <= 1, st["reachability"]
                assert all(e["group_size"] <= 3 for e in merged), [e["group_size"] for e in merged]
            else:
                assert st["reachability"]["undialable"] == 0, (node.name, st["reachability"])
