"""The node's status structure (``node/status.py``): its JSON (``status.json``, ``locoswarm status --json``)
and its proto (the control API) give the same structure back, field for field, and no proto field is left
out. The samples fill every field of every record from the records' annotations, so a field added to the
records or to ``control.proto`` alone fails here."""

from __future__ import annotations

import dataclasses
import itertools
import json
import types
import typing
from typing import Any

import pytest

from locoswarm.node.status import NodeStatus, PeerStatus, Record, Spread, SwarmView
from locoswarm.protocol import control_pb2, swarm_pb2

pytestmark = pytest.mark.timeout(30)


def sample(tp: Any, counter: itertools.count, optional_none: bool = False) -> Any:
    """A value of the annotated type ``tp`` with every field set, each scalar distinct and not its default
    (``optional_none``: every ``X | None`` is None instead, containers still hold one element)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return None if optional_none else sample(next(a for a in args if a is not type(None)), counter)
    if origin is list:
        return [sample(args[0], counter, optional_none)]
    if origin is dict:
        return {sample(args[0], counter): sample(args[1], counter, optional_none)}
    if isinstance(tp, type) and issubclass(tp, Record):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: sample(hints[f.name], counter, optional_none) for f in dataclasses.fields(tp)})
    n = next(counter)
    return {int: n, float: n + 0.25, str: f"Qm{n}", bool: True}[tp]


def full(cls: type, optional_none: bool = False) -> Any:
    return sample(cls, itertools.count(1), optional_none)


def unset_proto_fields(msg: Any, path: str = "") -> list[str]:
    """Fields of ``msg`` (recursively) that hold their default: what ``to_proto`` did not fill."""
    unset = []
    for fd in msg.DESCRIPTOR.fields:
        name, value = f"{path}{fd.name}", getattr(msg, fd.name)
        if fd.is_repeated:  # repeated fields and maps
            if not len(value):
                unset.append(name)
            elif fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
                unset += unset_proto_fields(value[0], name + "[0].")
        elif fd.message_type is not None:
            unset += unset_proto_fields(value, name + ".") if msg.HasField(fd.name) else [name]
        elif (fd.has_presence and not msg.HasField(fd.name)) or value == fd.default_value:
            unset.append(name)
    return unset


@pytest.mark.parametrize("optional_none", [False, True], ids=["every-field", "optionals-none"])
def test_json_round_trip_is_lossless(optional_none):
    st = full(NodeStatus, optional_none)
    text = json.dumps(st.to_json())
    assert NodeStatus.from_json(json.loads(text)) == st
    view = full(SwarmView, optional_none)
    assert SwarmView.from_json(json.loads(json.dumps(view.to_json()))) == view


@pytest.mark.parametrize("optional_none", [False, True], ids=["every-field", "optionals-none"])
def test_proto_round_trip_is_lossless(optional_none):
    st = full(NodeStatus, optional_none)
    msg = st.to_proto()
    assert NodeStatus.from_proto(control_pb2.Status.FromString(msg.SerializeToString())) == st
    assert NodeStatus.from_proto(NodeStatus().to_proto()) == NodeStatus()


def test_every_proto_field_comes_from_the_structure():
    assert unset_proto_fields(full(NodeStatus).to_proto()) == []


def test_status_json_keeps_the_keys_its_readers_use():
    """tests/swarm_util.py, node/bench/*, docker/bootstrap_from.py read status.json by these keys."""
    doc = full(NodeStatus).to_json()
    assert {"peer_id", "fingerprint", "swarm", "addrs", "pid", "uptime_s", "clock", "inner_step", "tokens", "state",
            "loss", "tokens_per_s", "compute_utilization", "eval_curve", "fragments", "peers", "spread", "syncs_ok",
            "syncs_failed", "catch_ups", "catch_up_loops", "solo_steps", "consensus", "bytes", "refusals",
            "reputation", "events"} <= set(doc)
    frag, fragment = doc["fragments"][0], doc["fragments"][0]["fragment"]
    assert {"fragment", "version", "numel", "last_send", "quant_error", "phi_hash", "phi_norm"} <= set(frag)
    assert doc["spread"] == {str(fragment): frag["spread"]}  # keyed by the fragment as a string
    assert set(doc["spread"][str(fragment)]) == {"version", "holders", "distinct_hashes", "norm_spread",
                                                 "max_version", "max_lag"}
    clock, loss = doc["eval_curve"][0]  # [clock, loss] pairs
    assert isinstance(clock, int) and isinstance(loss, float)
    assert set(doc["consensus"]) == {"rounds", "last_shift", "failed", "last_error"}
    assert {"sent", "received", "sent_by_peer", "received_by_peer", "sent_by_fragment"} <= set(doc["bytes"])
    assert all(isinstance(k, str) for k in doc["bytes"]["sent_by_fragment"])
    peer = next(iter(doc["reputation"]["peers"].values()))
    assert set(doc["reputation"]) == {"peers", "refused", "banned"}
    assert set(peer) == {"refused", "offences", "by_kind", "banned", "banned_for_s", "last", "first_banned", "scores",
                         "forgiven"}
    assert {"time", "kind", "detail", "clock", "fragment", "round", "bytes_sent", "bytes_received", "group_size",
            "version", "own_weight", "total_weight"} <= set(doc["events"][0])
    assert {"clock", "inner_step", "tokens_per_s", "time"} <= set(next(iter(doc["peers"].values())))


def test_reputation_snapshot_is_the_reputation_json():
    """The node types ``Reputation.snapshot()`` with ``ReputationStatus.from_json``: same keys."""
    import logging

    from locoswarm.node.status import ReputationStatus
    from locoswarm.node.swarm.reputation import Reputation

    rep = Reputation(now=lambda: 100.0, log=logging.getLogger("test.reputation"))
    for _ in range(3):
        rep.refuse("QmA", "forged_sender", "part for fragment 0")
    snap = rep.snapshot()
    typed = ReputationStatus.from_json(snap)
    assert typed.to_json() == snap
    assert typed.banned == 1 and typed.peers["QmA"].banned and typed.peers["QmA"].by_kind == {"forged_sender": 3}


def test_peer_from_heartbeat_and_an_old_status():
    hb = swarm_pb2.Heartbeat(peer_id="QmP", clock=9, inner_step=8, tokens=100, tokens_per_s=12.5, loss=2.5, time=7.0,
                             has_state=True, control_port=7616,
                             fragments=[swarm_pb2.FragmentStatus(fragment=1, version=4)])
    peer = PeerStatus.from_heartbeat(hb)
    assert peer == PeerStatus(clock=9, inner_step=8, tokens_per_s=12.5, time=7.0, loss=2.5, tokens=100,
                              control_port=7616, has_state=True, fragments={1: 4})
    # a status.json of an older node: keys missing take their defaults, unknown ones are ignored
    old = NodeStatus.from_json({"peer_id": "QmOld", "state": "training", "eval_curve": [[0, 5.0]], "gone": 1,
                                "spread": {"0": {"version": None, "holders": 0}}})
    assert old.peer_id == "QmOld" and old.eval_curve[0].loss == 5.0 and old.fragments == [] and old.loss is None
    assert Spread.from_json({"version": None, "holders": 0}) == Spread()


class FakeOuter:
    """What ``Node.status_snapshot`` reads of the outer loop: two fragments, fragment 0 sent at step 112."""

    def __init__(self) -> None:
        from locoswarm.node.core.outer_loop import OuterStats

        self.stats = OuterStats(syncs_ok=9, solo_steps=4, syncs_failed=2, catch_ups=1, consensus_rounds=3,
                                last_consensus_shift=0.01)

    def fragment_status(self) -> list[dict]:
        return [{"fragment": 0, "version": 7, "numel": 6, "last_send": 112, "quant_error": 0.03},
                {"fragment": 1, "version": 6, "numel": 5, "last_send": None, "quant_error": None}]

    def schedule_state(self):
        from locoswarm.node.core.schedule import ScheduleState

        return ScheduleState((112, None), None)


def test_node_status_snapshot(tmp_path):
    """The node's own builder: per-fragment hashes, bytes, last merged round and spread; per-peer heartbeat
    figures, bytes and judgement; what status.json gets is its JSON."""
    import logging
    import zlib
    from collections import deque
    from types import SimpleNamespace

    import torch

    from locoswarm.node.config import load_config
    from locoswarm.node.core.transport import FragmentSnapshot
    from locoswarm.node.daemon import Node, NodeOptions
    from locoswarm.node.swarm.counters import ByteCounters
    from locoswarm.node.swarm.reputation import Reputation

    node = Node(load_config(None, []), NodeOptions(state_dir=tmp_path, control_port=7615, metrics_port=9615))
    node.peer_id, node.maddrs, node.state, node.loss, node.clock, node.local_step = "QmSelf", ["/ip4/1"], "training", \
        2.5, 120, 118
    node.outer = FakeOuter()
    phi = torch.arange(6, dtype=torch.float32)
    node.published = {0: FragmentSnapshot(0, 7, phi, torch.zeros(6))}  # fragment 1 not published yet
    node.counters = ByteCounters()
    node.counters.sent("QmPeer", 0, 112, 1000)
    node.counters.received("QmPeer", 0, 112, 900)
    node.transport = SimpleNamespace(refusals=deque(["QmPeer: bad_weight: too heavy"]),
                                     standing_rounds=lambda: 3, streams_served=lambda: 5, undialable=lambda: 2)
    node.reputation = Reputation(now=lambda: 100.0, log=logging.getLogger("test.reputation"))
    node.reputation.refuse("QmPeer", "bad_weight", "too heavy")
    node.peer_table = {"QmPeer": swarm_pb2.Heartbeat(
        peer_id="QmPeer", clock=119, inner_step=117, tokens_per_s=50.0, loss=2.4, time=99.0, has_state=True,
        fragments=[swarm_pb2.FragmentStatus(fragment=0, version=7, phi_hash=zlib.crc32(phi.numpy().tobytes()),
                                            phi_norm=float(phi.norm()))])}
    node.eval_curve = [(0, 5.5), (100, 3.0)]
    node.record_event("merged", "fragment 0 round v7", fragment=0, round=112, group_size=2, version=7,
                      own_weight=8.0, total_weight=16.0)
    node.clock = 124

    st = node.status_snapshot()
    f0, f1 = st.fragments
    assert (f0.phi_hash, f0.phi_norm) == (zlib.crc32(phi.numpy().tobytes()), pytest.approx(float(phi.norm())))
    assert f1.phi_hash is None and f1.phi_norm is None and f1.last_merge_clock is None and f1.group_size == 0
    assert (f0.bytes_sent, f0.bytes_received, f0.group_size, f0.last_merge_clock) == (1000, 900, 2, 120)
    assert f0.spread == Spread(version=7, holders=2, distinct_hashes=1, norm_spread=0.0, max_version=7, max_lag=0)
    assert f1.spread is None  # nobody announces fragment 1: no spread to show
    peer = st.peers["QmPeer"]
    assert (peer.clock, peer.fragments, peer.has_state, peer.bytes_sent, peer.refused) == (119, {0: 7}, True, 1000, 1)
    assert st.syncs_ok == 9 - 4 and st.solo_steps == 4 and st.consensus.rounds == 3 and st.standing_rounds == 3
    assert (st.reachability.state, st.reachability.mode, st.reachability.inbound_streams) == ("unknown", "auto", 5)
    assert st.reachability.undialable == 2
    assert (st.control_port, st.metrics_port, st.state, st.loss) == (7615, 9615, "training", 2.5)
    assert [(p.clock, p.loss) for p in st.eval_curve] == [(0, 5.5), (100, 3.0)]
    assert st.events[-1].own_weight == 8.0 and st.refusals == ["QmPeer: bad_weight: too heavy"]
    node.write_status()
    on_disk = json.loads((tmp_path / "status.json").read_text())
    assert on_disk["spread"]["0"]["holders"] == 2 and on_disk["fragments"][1]["phi_norm"] is None
    # what is measured anew at each write (time, utilization, the process's memory) comes from the file
    disk = NodeStatus.from_json(on_disk)
    assert disk == dataclasses.replace(st, uptime_s=on_disk["uptime_s"], now=on_disk["now"],
                                       compute_utilization=on_disk["compute_utilization"], memory=disk.memory)
    assert disk.memory.rss > 0
