"""The checked-in protocol code matches protocol/*.proto; records stay far below hivemind's 16 KiB limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from protocol import swarm_pb2

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh():
    res = subprocess.run([sys.executable, "-m", "protocol.generate", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
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
