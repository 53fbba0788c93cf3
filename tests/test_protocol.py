"""The checked-in protocol code matches protocol/*.proto; records stay far below hivemind's 16 KiB limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from locoswarm.protocol import swarm_pb2

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh():
    res = subprocess.run([sys.executable, "-m", "locoswarm.protocol.generate", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_heartbeat_stays_small_with_many_fragments():
    peer = "Qm" + "x" * 44
    hb = swarm_pb2.Heartbeat(
        peer_id=peer, addrs=[f"/ip4/203.0.113.7/tcp/31337/p2p/{peer}"] * 4, fingerprint="0123456789abcdef",
        clock=10**9, inner_step=10**9, tokens=10**12, tokens_per_s=1e6, loss=2.5, time=1.8e9,
        fragments=[swarm_pb2.FragmentStatus(fragment=i, version=10**6, phi_hash=2**32 - 1, phi_norm=123.0,
                                            last_send=10**9) for i in range(32)],
        shared_r=[1.0] * 32)
    assert hb.ByteSize() < 4096


def test_adaptive_slot_leader_state_becomes_the_schedule_hint() -> None:
    """In an adaptive-schedule slot, a member whose pick or state differs from the member with the smallest
    peer id is told that leader's state (to adopt); equal states, or being the leader, give no hint."""
    from locoswarm.node.core.schedule import ScheduleState
    from locoswarm.node.core.transport import AverageRequest
    from locoswarm.node.swarm.matchmaking import ScheduleHint, leader_schedule, match_entry

    def request(fragment: int, last_send: tuple, shared_r: tuple | None) -> AverageRequest:
        return AverageRequest(fragment=fragment, round=40, chunks=[], numel=0, weight=1.0, version=3,
                              schedule=ScheduleState(last_send, shared_r))

    leader_req = request(0, (None, 32), None)
    mine = request(1, (36, 32), (0.25, 0.5))
    entries = {"QmA": match_entry("QmA", leader_req, 1.0), "QmB": match_entry("QmB", mine, 1.1)}
    assert leader_schedule("QmB", mine, entries["QmB"], entries) == \
        ScheduleHint(40, 0, ScheduleState((None, 32), None), "QmA")
    agreeing = request(0, (None, 32), None)
    assert leader_schedule("QmB", agreeing, match_entry("QmB", agreeing, 1.1),
                           {"QmA": entries["QmA"], "QmB": match_entry("QmB", agreeing, 1.1)}) is None
    assert leader_schedule("QmA", leader_req, entries["QmA"], entries) is None
    # a leader whose state is malformed (a shared_r of the wrong length) is its offence, not a hint
    bad = match_entry("QmA", leader_req, 1.0)
    bad.shared_r.extend([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="malformed schedule state"):
        leader_schedule("QmB", mine, entries["QmB"], {"QmA": bad, "QmB": entries["QmB"]})
