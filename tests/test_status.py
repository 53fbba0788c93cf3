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

from node.status import NodeStatus, PeerStatus, Record, Spread, SwarmView
from protocol import control_pb2, swarm_pb2

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
    assert set(peer) == {"refused", "offences", "by_kind", "banned", "banned_for_s", "last"}
    assert {"time", "kind", "detail", "clock", "fragment", "round", "bytes_sent", "bytes_received", "group_size",
            "version", "own_weight", "total_weight"} <= set(doc["events"][0])
    assert {"clock", "inner_step", "tokens_per_s", "time"} <= set(next(iter(doc["peers"].values())))


def test_reputation_snapshot_is_the_reputation_json():
    """The node types ``Reputation.snapshot()`` with ``ReputationStatus.from_json``: same keys."""
    import logging

    from node.status import ReputationStatus
    from node.swarm.reputation import Reputation

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
