"""Closed swarms (locoswarm.node.swarm.admission, locoswarm admit): certificates, and who counts as a member."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from swarm_util import REPO

from locoswarm.node.config import load_config
from locoswarm.node.errors import UserError
from locoswarm.node.swarm.admission import Admission, Certificate, load_private_key, new_owner_key, sign
from locoswarm.protocol import swarm_pb2

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def owner():
    pem, public = new_owner_key()
    return load_private_key(pem), public


def test_a_certificate_admits_exactly_its_peer_in_its_swarm_until_it_expires(owner) -> None:
    key, public = owner
    clock = [1000.0]
    admission = Admission(public, "team", now=lambda: clock[0])
    cert = sign(key, "QmA", "team", expires=2000).to_bytes()
    assert admission.why_not("QmA", cert) is None and admission.admits("QmA", cert)
    assert admission.why_not("QmB", cert) is not None                             # another peer's certificate
    assert Admission(public, "other").why_not("QmA", cert) is not None              # another swarm's
    stranger_key = load_private_key(new_owner_key()[0])
    assert admission.why_not("QmA", sign(stranger_key, "QmA", "team", 2000).to_bytes()) is not None
    tampered = Certificate.from_bytes(cert)
    forged = Certificate(tampered.peer_id, tampered.swarm, tampered.expires + 10**6, tampered.signature)
    assert admission.why_not("QmA", forged.to_bytes()) is not None                  # a longer life is not signed
    for junk in (b"", b"{}", b"not json", b"x" * 10_000):
        assert admission.why_not("QmA", junk) is not None
    clock[0] = 2001.0
    assert admission.why_not("QmA", cert) == "an expired certificate"
    assert not admission.admits("QmA", cert) and admission.strangers == 1


class _DHTHolding:
    """A DHT whose every key holds ``entries`` (``{subkey: (value, expiration)}``), answered as hivemind's
    ``get(key, latest=True, return_future=True)`` answers."""

    def __init__(self, entries: dict[str, tuple[bytes, float]]) -> None:
        self.entries = entries

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> concurrent.futures.Future:
        found = SimpleNamespace(value={subkey: SimpleNamespace(value=value, expiration_time=exp)
                                       for subkey, (value, exp) in self.entries.items()})
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(found)
        return future


def test_membership_of_a_closed_swarm_ignores_heartbeats_without_a_valid_certificate(owner) -> None:
    """The peer table of a closed swarm holds only certified peers; the others are counted as strangers."""
    from locoswarm.node.swarm.membership import Membership

    key, public = owner
    cfg = load_config(None, ["swarm.name=team"])
    admission = Admission(public, "team")
    entries: dict[str, tuple[bytes, float]] = {}
    me = Membership(_DHTHolding(entries), cfg, "QmMe", admission=admission)

    def heartbeat(peer: str, cert: bytes) -> bytes:
        return swarm_pb2.Heartbeat(peer_id=peer, fingerprint=me.fingerprint, certificate=cert).SerializeToString()

    from locoswarm.node.swarm import records

    good = sign(key, "QmGood", "team", int(time.time()) + 3600).to_bytes()
    entries.update({"QmGood": (heartbeat("QmGood", good), time.time() + 60),
                    "QmStranger": (heartbeat("QmStranger", b""), time.time() + 60),
                    "QmThief": (heartbeat("QmThief", good), time.time() + 60)})  # QmGood's certificate, another id
    original = records.subkey_peer
    records.subkey_peer = lambda subkey: subkey  # the test's subkeys are the peer ids themselves
    try:
        assert set(me.peers()) == {"QmGood"}
    finally:
        records.subkey_peer = original
    assert admission.strangers == 2


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "locoswarm.node.cli", *args], capture_output=True, text=True,
                          timeout=90, cwd=cwd or REPO)


def test_admit_commands_make_a_closed_swarm_a_node_with_a_wrong_certificate_is_refused_before_it_starts(
        tmp_path) -> None:
    keyfile = tmp_path / "owner.key"
    out = _cli("admit", "keygen", "--out", str(keyfile))
    assert out.returncode == 0, out.stderr
    public = out.stdout.split('owner_key = "')[1].split('"')[0]
    assert (keyfile.stat().st_mode & 0o777) == 0o600
    peer = _cli("admit", "peer-id", "--state-dir", str(tmp_path / "a")).stdout.strip()
    other = _cli("admit", "peer-id", "--state-dir", str(tmp_path / "b")).stdout.strip()
    assert peer.startswith("Qm") and other.startswith("Qm") and peer != other
    cert = tmp_path / "a.cert"
    out = _cli("admit", "sign", "--key", str(keyfile), "--swarm", "team", "--peer-id", peer, "--days", "3",
               "--out", str(cert))
    assert out.returncode == 0, out.stderr
    assert json.loads(cert.read_text())["peer_id"] == peer
    assert Admission(public, "team").why_not(peer, cert.read_bytes()) is None
    config = tmp_path / "peers.toml"
    config.write_text(f'[swarm]\nname = "team"\nowner_key = "{public}"\ncertificate = "{cert}"\n')
    assert load_config(config).swarm.owner_key == public
    # node b runs with a's certificate: one line, exit 2, before anything starts
    out = _cli("run", "--config", str(config), "--state-dir", str(tmp_path / "b"), "--max-steps", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"peer {other}" in out.stderr and "locoswarm admit sign" in out.stderr
    # a closed swarm without a certificate, and bad input to the commands
    config.write_text(f'[swarm]\nname = "team"\nowner_key = "{public}"\n')
    with pytest.raises(UserError, match="certificate"):
        load_config(config)
    out = _cli("admit", "sign", "--key", str(keyfile), "--swarm", "team", "--peer-id", peer, "--days", "0",
               "--out", str(cert))
    assert out.returncode == 2 and "--days 0" in out.stderr
    out = _cli("admit", "keygen", "--out", str(keyfile))
    assert out.returncode == 2 and "--force" in out.stderr
