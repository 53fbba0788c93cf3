"""Closed swarms: admission by certificates signed with the swarm owner's key.

An open swarm admits anyone who publishes a heartbeat; the defences bound what a member can do
(``docs/security.md``). A team that wants only its own machines in sets ``[swarm] owner_key`` (shared, so a
closed swarm has its own fingerprint) to the public half of an Ed25519 key pair it keeps, and gives each of
its nodes a certificate: the owner's signature over the swarm's name, the node's libp2p peer id and an expiry
(``locoswarm admit``). A node then counts a peer as a member only with a valid certificate for exactly that
peer id: it ignores the heartbeats and match entries of everyone else, refuses their averaging streams and
state requests, and counts the strangers it refused. The certificate travels in the heartbeat and in every
match entry (about 150 bytes), so every member judges every peer by the same bytes.

The peer id is what libp2p authenticates on every stream, so a certificate cannot be used by another node;
expiry bounds a leaked one. Nothing else changes: members of a closed swarm are judged like any others.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

CONTEXT = b"locoswarm-admission-v1"
MAX_CERTIFICATE_BYTES = 512
MAX_CACHE = 4096
MAX_STRANGERS = 4096


class AdmissionError(ValueError):
    """A key or certificate that cannot be used (one line for the user)."""


def public_key_text(key: ed25519.Ed25519PublicKey) -> str:
    """The ``[swarm] owner_key`` form of a public key: base64 of its 32 raw bytes."""
    return base64.b64encode(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()


def load_public_key(text: str) -> ed25519.Ed25519PublicKey:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
        return ed25519.Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise AdmissionError(f"owner_key {text[:20]!r}... is not the base64 of a 32-byte Ed25519 public key "
                             "(make one with 'locoswarm admit keygen')") from exc


def new_owner_key() -> tuple[bytes, str]:
    """A new owner key pair: the private key as PEM (keep it secret) and the public key's ``owner_key`` text."""
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return pem, public_key_text(private.public_key())


def load_private_key(pem: bytes) -> ed25519.Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise AdmissionError("the owner key file is not a PEM private key made by 'locoswarm admit keygen'") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise AdmissionError("the owner key file holds another kind of key; make an Ed25519 one with "
                             "'locoswarm admit keygen'")
    return key


@dataclass(frozen=True)
class Certificate:
    """The owner's word that ``peer_id`` may be a member of swarm ``swarm`` until ``expires`` (unix time)."""

    peer_id: str
    swarm: str
    expires: int
    signature: bytes

    def message(self) -> bytes:
        return b"\0".join((CONTEXT, self.swarm.encode(), self.peer_id.encode(), str(int(self.expires)).encode()))

    def to_bytes(self) -> bytes:
        return json.dumps({"peer_id": self.peer_id, "swarm": self.swarm, "expires": int(self.expires),
                           "signature": base64.b64encode(self.signature).decode()},
                          separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        if len(data) > MAX_CERTIFICATE_BYTES:
            raise AdmissionError(f"a certificate of {len(data)} bytes is larger than {MAX_CERTIFICATE_BYTES}")
        try:
            doc = json.loads(data)
            return cls(str(doc["peer_id"]), str(doc["swarm"]), int(doc["expires"]),
                       base64.b64decode(doc["signature"], validate=True))
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise AdmissionError("not a certificate made by 'locoswarm admit sign'") from exc


def sign(owner: ed25519.Ed25519PrivateKey, peer_id: str, swarm: str, expires: int) -> Certificate:
    unsigned = Certificate(peer_id, swarm, int(expires), b"")
    return Certificate(peer_id, swarm, int(expires), owner.sign(unsigned.message()))


class Admission:
    """Who may be a member of a closed swarm (module docstring): ``admits(peer_id, certificate bytes)``.
    Verdicts are cached per (peer, certificate); strangers refused are counted (bounded)."""

    def __init__(self, owner_key: str, swarm: str, *, now: Callable[[], float] = time.time) -> None:
        self.public = load_public_key(owner_key)
        self.swarm = swarm
        self._now = now
        self._cache: OrderedDict[tuple[str, bytes], tuple[bool, int]] = OrderedDict()
        self._strangers: OrderedDict[str, None] = OrderedDict()
        self.refused = 0

    def why_not(self, peer_id: str, data: bytes) -> str | None:
        """None when ``data`` is a valid, unexpired certificate of ``peer_id`` for this swarm, else why not."""
        if not data:
            return "no certificate"
        key = (peer_id, bytes(data))
        cached = self._cache.get(key)
        if cached is None:
            cached = self._verify(peer_id, bytes(data))
            self._cache[key] = cached
            while len(self._cache) > MAX_CACHE:
                self._cache.popitem(last=False)
        ok, expires = cached
        if not ok:
            return "a certificate the owner did not sign for this peer and swarm"
        if expires < self._now():
            return "an expired certificate"
        return None

    def _verify(self, peer_id: str, data: bytes) -> tuple[bool, int]:
        try:
            cert = Certificate.from_bytes(data)
        except AdmissionError:
            return False, 0
        if cert.peer_id != peer_id or cert.swarm != self.swarm:
            return False, 0
        try:
            self.public.verify(cert.signature, cert.message())
        except InvalidSignature:
            return False, 0
        return True, cert.expires

    def admits(self, peer_id: str, data: bytes) -> bool:
        if self.why_not(peer_id, data) is None:
            return True
        self.stranger(peer_id)
        return False

    def stranger(self, peer_id: str) -> None:
        """Count a refusal of a peer without a valid certificate."""
        self.refused += 1
        self._strangers.pop(peer_id, None)
        self._strangers[peer_id] = None
        while len(self._strangers) > MAX_STRANGERS:
            self._strangers.popitem(last=False)

    @property
    def strangers(self) -> int:
        """Distinct strangers refused (the most recent ``MAX_STRANGERS``)."""
        return len(self._strangers)


__all__ = ["Admission", "AdmissionError", "Certificate", "load_private_key", "load_public_key", "new_owner_key",
           "public_key_text", "sign"]
