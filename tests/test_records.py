"""Signed DHT records (locoswarm.node.swarm.records): owner subkeys bound to the libp2p identity, on real hivemind
DHTs on loopback.

Three DHTs run in this test process: A and C are honest locoswarm nodes, B is the attacker. B is a
normal node too (its validators sign with its own identity), and it also talks raw DHT RPCs to the
others (bypassing its own validators) and plants records in its own storage, as a modified node could.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from locoswarm.node.config import SwarmConfig
from locoswarm.node.errors import UserError
from locoswarm.node.swarm.dht import start_dht, visible_maddrs
from locoswarm.node.swarm.membership import Membership
from locoswarm.node.swarm.records import (
    MAX_RECORD_BYTES,
    OwnerSignatureValidator,
    RecordSizeValidator,
    identity_key,
    owner_subkey,
    peer_id_of,
    record_validators,
    subkey_peer,
)
from locoswarm.protocol import swarm_pb2

# ---- helpers ----


def _p2pds_of(pid: int) -> set[int]:
    """p2pd processes descended from ``pid`` (an independent /proc walk)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            data = Path(f"/proc/{entry}/stat").read_text(errors="replace")
            names[int(entry)] = data[data.find("(") + 1:data.rfind(")")]
            parents[int(entry)] = int(data[data.rfind(")") + 2:].split()[1])
    out, queue = set(), [pid]
    while queue:
        parent = queue.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                queue.append(child)
                if names.get(child) == "p2pd":
                    out.add(child)
    return out


def _signed(key: RSAPrivateKey, dht_key: str, subkey: str, value: object, expiration: float) -> bytes:
    """The stored form of ``value`` under ``(dht_key, subkey)``, signed with ``key`` whatever owner the
    subkey names (what hivemind's RSASignatureValidator appends when the owner is the signer)."""
    record = DHTRecord(DHTID.generate(source=dht_key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration)
    return record.value + b"[signature:" + key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record))) + b"]"


async def _raw_store(_dht, node, peer: str, dht_key: str, subkey: str, stored: bytes, expiration: float):
    """Runs in B's DHT process: a raw store RPC to ``peer`` (B's own validators are not involved)."""
    ok = await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=dht_key)], [stored],
                                        expiration, subkeys=[subkey])
    return None if ok is None else list(ok)  # a protobuf repeated field does not cross the process pipe


async def _plant(_dht, node, dht_key: str, subkey: str, stored: bytes, expiration: float) -> bool:
    """Runs in B's DHT process: put a record straight into its storage, so B serves it to readers."""
    return node.protocol.storage.store_subkey(DHTID.generate(source=dht_key), subkey, stored, expiration)


async def _local_subkeys(_dht, node, dht_key: str) -> list:
    """Runs in a DHT process: the subkeys its own storage holds under ``dht_key``."""
    found = node.protocol.storage.get(DHTID.generate(source=dht_key))
    if found is None or not hasattr(found.value, "items"):
        return []
    return [subkey for subkey, _ in found.value.items()]


def _in(dht, coro, **kwargs):
    """Run ``coro`` in ``dht``'s process, bounded in time."""
    return dht.run_coroutine(functools.partial(coro, **kwargs), return_future=True).result(timeout=15)


def _raw(dht, target, dht_key: str, subkey: str, stored: bytes, expiration: float) -> list | None:
    return _in(dht, _raw_store, peer=str(target.peer_id), dht_key=dht_key, subkey=subkey, stored=stored,
               expiration=expiration)


def _stored_subkeys(dht, dht_key: str) -> list:
    return _in(dht, _local_subkeys, dht_key=dht_key)


def _read(dht, dht_key: str) -> dict:
    """``{subkey: value}`` a reader gets for ``dht_key``."""
    found = dht.get(dht_key, latest=True)
    return {} if found is None else {subkey: item.value for subkey, item in found.value.items()}


# ---- owner subkeys, without a DHT ----

@pytest.mark.timeout(30)
def test_identity_key_is_the_libp2p_identity(tmp_path):
    path = tmp_path / "state" / "identity.key"
    key = identity_key(path)  # creates the file (and its directory) like hivemind
    assert path.stat().st_mode & 0o777 == 0o400
    peer = PeerID.from_identity(path.read_bytes()).to_base58()
    assert peer_id_of(key.get_public_key()) == peer
    assert identity_key(path).to_bytes() == key.to_bytes()  # read back, not regenerated
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    with pytest.raises(UserError, match=r"bad\.key is not a libp2p RSA private key"):
        identity_key(bad)


@pytest.mark.timeout(30)
def test_subkey_peer_binding(tmp_path):
    a, b = identity_key(tmp_path / "a.key"), identity_key(tmp_path / "b.key")
    pa, pb = peer_id_of(a.get_public_key()), peer_id_of(b.get_public_key())
    sa = owner_subkey(pa, a)
    assert sa.startswith(f"{pa}[owner:ssh-rsa ") and sa.endswith("]") and len(sa) < 512
    assert subkey_peer(sa) == pa and subkey_peer(owner_subkey(pa, a.get_public_key())) == pa
    assert subkey_peer(owner_subkey(pb, b)) == pb

    b_public = b.get_public_key().to_bytes().decode()
    a_public = a.get_public_key().to_bytes().decode()
    ed_public = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak_public = RSAPublicKey(weak.public_key())
    weak_peer = peer_id_of(weak_public)
    refused = [
        f"{pa}[owner:{b_public}]",                      # A's id with B's key
        f"{pb}[owner:{a_public}]",                      # B's id with A's key
        f"{pa}[owner:{a_public[:-8]}AAAAAAAA]",          # garbled key
        f"{pa}[owner:ssh-rsa !!!notbase64]",
        f"{pa}[owner:{ed_public}]",                     # not RSA
        f"{weak_peer}[owner:{weak_public.to_bytes().decode()}]",  # matching id, but a 1024-bit key
        f"{pa}[owner:{a_public}] ",                     # trailing junk
        f"{pa}[owner:{a_public}][owner:{a_public}]",
        pa,                                             # not protected
        "",
        sa + "x" * 2000,
    ]
    for subkey in refused:
        assert subkey_peer(subkey) is None, subkey[:80]
    for not_str in (None, 5, sa.encode(), [sa]):
        assert subkey_peer(not_str) is None
    with pytest.raises(ValueError, match="not the libp2p identity"):
        owner_subkey(pa, b)


@pytest.mark.timeout(30)
def test_validators_refuse_without_raising(tmp_path):
    key = identity_key(tmp_path / "a.key")
    peer = peer_id_of(key.get_public_key())
    validators = record_validators(tmp_path / "a.key")
    assert {type(v) for v in validators} == {OwnerSignatureValidator, RecordSizeValidator}
    composite = CompositeValidator(validators)
    key_id = DHTID.generate(source="k").to_bytes()
    exp = get_dht_time() + 30

    def record(subkey: str, value: object) -> DHTRecord:
        return DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), exp)

    own = record(owner_subkey(peer, key), b"hello")
    signed = dataclasses.replace(own, value=composite.sign_value(own))
    assert len(signed.value) > len(own.value) + 300  # the signature
    assert composite.validate(signed) and composite.strip_value(signed) == own.value
    assert not composite.validate(own)  # unsigned
    # valid records are remembered: a repeat is accepted, any change to a remembered one is not
    assert composite.validate(signed)
    tampered_signature = signed.value[:-10] + (b"A" if signed.value[-10:-9] != b"A" else b"B") + signed.value[-9:]
    for tampered in (dataclasses.replace(signed, value=tampered_signature),
                     dataclasses.replace(signed, value=MSGPackSerializer.dumps(b"jello") + signed.value[7:]),
                     dataclasses.replace(signed, expiration_time=exp + 1)):
        assert not composite.validate(tampered)
    assert composite.validate(record("plain", b"x"))  # unprotected records are not ours to refuse
    # a garbled owner key makes hivemind's own validator raise; ours refuses
    garbled = record(f"{peer}[owner:ssh-rsa AAAAB3Nza]", b"x")
    garbled = dataclasses.replace(garbled, value=garbled.value + b"[signature:AAAA]")
    assert not composite.validate(garbled)
    # the size bound counts the stored value, signature included
    size = RecordSizeValidator()
    assert size.validate(record("s", b"x" * (MAX_RECORD_BYTES - 8)))
    assert not size.validate(record("s", b"x" * MAX_RECORD_BYTES))
    assert not size.validate(record("s" * 2000, b"x"))
    big = record(owner_subkey(peer, key), b"x" * MAX_RECORD_BYTES)
    assert not composite.validate(dataclasses.replace(big, value=composite.sign_value(big)))


# ---- on real DHTs ----

@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """Honest A and C, attacker B: ``(dhts, keys)`` as dicts by name."""
    before = _p2pds_of(os.getpid())
    d = tmp_path_factory.mktemp("records")
    dhts: dict = {}
    try:
        dhts["a"] = start_dht([], identity_path=d / "a.key")
        peers = visible_maddrs(dhts["a"])
        dhts["b"] = start_dht(peers, identity_path=d / "b.key")
        dhts["c"] = start_dht(peers, identity_path=d / "c.key")
        keys = {name: identity_key(d / f"{name}.key") for name in dhts}
        yield dhts, keys
    finally:
        for dht in dhts.values():
            with contextlib.suppress(Exception):
                dht.shutdown()
        deadline = time.monotonic() + 10
        while _p2pds_of(os.getpid()) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _p2pds_of(os.getpid()) - before, "a p2pd outlived its DHT"


@pytest.mark.timeout(60)
def test_only_the_owner_writes_under_its_subkey(swarm):
    dhts, keys = swarm
    a, b, c = dhts["a"], dhts["b"], dhts["c"]
    pa = str(a.peer_id)
    sa = owner_subkey(pa, keys["a"])
    k = "test/records/owner"

    # the owner's record: stored, read back by another node with the signature stripped, bound to A
    assert a.store(k, b"genuine", get_dht_time() + 60, subkey=sa)
    assert _read(c, k) == {sa: b"genuine"} and subkey_peer(sa) == pa

    # B under A's owner subkey, through its own (validating, signing) DHT: nobody takes it, B included
    exp = get_dht_time() + 90  # newer than A's: it would replace A's record if accepted
    assert not b.store(k, b"forged", exp, subkey=sa)
    # B's raw store RPCs, unsigned or signed with B's own key: A and C refuse
    for stored in (MSGPackSerializer.dumps(b"forged"), _signed(keys["b"], k, sa, b"forged", exp)):
        for target in (a, c):
            assert _raw(b, target, k, sa, stored, exp) == [False]
    # a correctly signed record of B is accepted by the same RPC (so the refusals above are the signatures)
    sb = owner_subkey(str(b.peer_id), keys["b"])
    assert _raw(b, c, k, sb, _signed(keys["b"], k, sb, b"b's own", exp), exp) == [True]
    # B signs "A's id + B's key": valid signature, so the DHT keeps it, but it is not bound to A
    mixed = f"{pa}[owner:{keys['b'].get_public_key().to_bytes().decode()}]"
    assert _raw(b, c, k, mixed, _signed(keys["b"], k, mixed, b"mixed", exp), exp) == [True]
    assert subkey_peer(mixed) is None
    for dht in (a, c):
        assert _stored_subkeys(dht, k).count(sa) <= 1
    got = _read(c, k)
    assert got[sa] == b"genuine" and got[sb] == b"b's own"

    # B serves a forged record from its own storage: a reader refuses B's answer, reads A's record elsewhere.
    # (First, a record only B holds reaches the reader: readers do ask B.)
    assert _in(b, _plant, dht_key=k, subkey="only-on-b", stored=MSGPackSerializer.dumps(b"b"), expiration=exp)
    assert _read(c, k)["only-on-b"] == b"b"
    assert _in(b, _plant, dht_key=k, subkey=sa, stored=MSGPackSerializer.dumps(b"forged"), expiration=exp + 30)
    assert sa in _stored_subkeys(b, k)
    for reader in (a, c):
        assert _read(reader, k)[sa] == b"genuine"


@pytest.mark.timeout(60)
def test_oversized_records_are_refused(swarm):
    dhts, keys = swarm
    a, b, c = dhts["a"], dhts["b"], dhts["c"]
    sa = owner_subkey(str(a.peer_id), keys["a"])
    sb = owner_subkey(str(b.peer_id), keys["b"])
    k = "test/records/size"
    exp = get_dht_time() + 60
    fits = b"x" * (MAX_RECORD_BYTES - 512)  # leaves room for the msgpack header and the signature
    assert a.store(k, fits, exp, subkey=sa)
    assert not a.store(k, b"y" * MAX_RECORD_BYTES, exp + 1, subkey=sa)  # refused by A itself and by all others
    big = b"z" * (MAX_RECORD_BYTES + 100)
    assert _raw(b, c, k, sb, _signed(keys["b"], k, sb, big, exp), exp) == [False]
    assert _raw(b, c, k, "plain", MSGPackSerializer.dumps(big), exp) == [False]  # unprotected records too
    assert _read(c, k) == {sa: fits}


def _cfg(name: str) -> SwarmConfig:
    cfg = SwarmConfig()
    cfg.swarm.name = name
    return cfg


def _heartbeat(peer_id: str, membership: Membership, clock: int) -> bytes:
    return swarm_pb2.Heartbeat(peer_id=peer_id, fingerprint=membership.fingerprint, clock=clock, inner_step=5,
                               time=get_dht_time(), has_state=True).SerializeToString()


@pytest.mark.timeout(60)
def test_membership_heartbeats_are_bound_to_their_peer(swarm):
    dhts, keys = swarm
    a, b, c = dhts["a"], dhts["b"], dhts["c"]
    pa, pb = str(a.peer_id), str(b.peer_id)
    cfg = _cfg("signed-heartbeats")
    ma, mb, mc = (Membership(dht, cfg, str(dht.peer_id), expiry=30) for dht in (a, b, c))
    k = mc.peers_key
    exp = get_dht_time() + 20  # earlier than the genuine heartbeats' expiry: B's own must replace its forgery
    sa = owner_subkey(pa, keys["a"])
    mixed = f"{pa}[owner:{keys['b'].get_public_key().to_bytes().decode()}]"
    sb = owner_subkey(pb, keys["b"])
    # B claims to be A, every way it can: A's plain peer id (the old layout), A's id with B's key (signed),
    # its own owner subkey, and A's owner subkey (refused by the DHT)
    forged = _heartbeat(pa, mc, clock=999)
    assert b.store(k, forged, exp, subkey=pa)
    assert _raw(b, c, k, mixed, _signed(keys["b"], k, mixed, forged, exp), exp) == [True]
    assert b.store(k, forged, exp, subkey=sb)
    assert _raw(b, c, k, sa, _signed(keys["b"], k, sa, forged, exp), exp) == [False]
    assert len(_read(c, k)) == 3  # the DHT holds them; membership must ignore them
    assert mc.peers(include_self=True) == {}

    # genuine heartbeats of A and B round-trip, and A's is A's own (clock 7), not the forged one
    assert ma.publish(swarm_pb2.Heartbeat(clock=7)) and mb.publish(swarm_pb2.Heartbeat(clock=3))
    seen = mc.peers()
    assert set(seen) == {pa, pb}
    assert seen[pa].clock == 7 and seen[pb].clock == 3
    assert set(ma.peers()) == {pb}
    # a Membership of a DHT without an identity file only reads
    assert not Membership(_NoIdentity(), cfg, pa, timeout=1.0).publish(swarm_pb2.Heartbeat(clock=1))


class _NoIdentity:
    """A DHT started without ``identity_path``: Membership has no key to bind heartbeats to."""

    def __init__(self) -> None:
        self.kwargs: dict = {}
