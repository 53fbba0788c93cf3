"""DHT records bound to their publisher's libp2p identity, and bounded in size.

A record that speaks for a peer (its heartbeat, its matchmaking entry) is stored under an *owner
subkey*: ``"<peer id>[owner:ssh-rsa AAAA...]"``, the peer id followed by the RSA public key of the
node's libp2p identity (the ``identity.key`` file p2pd runs with). hivemind's
``RSASignatureValidator``, built with that same identity key, then signs every record stored under
the node's own owner subkey, and every DHT node running these validators refuses, on each store it is
asked to keep and on each find response it receives, a record under an owner subkey that is not
signed by that key. Since a libp2p peer id is the hash of the identity's public key, only the holder of
peer ``P``'s private key can write under a subkey whose owner key hashes to ``P``:
:func:`subkey_peer` checks that link, so a reader that accepts an entry only when
``subkey_peer(subkey) == entry.peer_id`` reads only what that peer itself published. (Peer B can sign
a subkey ``"<A's id>[owner:<B's key>]"`` with its own key; :func:`subkey_peer` maps it to None.)

Values are bounded too: hivemind's DHT process can die on records of 16 KiB or more, so
:class:`RecordSizeValidator` refuses, before any signature check, a record whose stored value
(serialized value plus signature) exceeds :data:`MAX_RECORD_BYTES` or whose subkey exceeds
:data:`MAX_SUBKEY_BYTES`. With a subkey dictionary (several subkeys under one key) each entry is
validated on its own, so the bound is per entry, never per dictionary.

Usage::

    dht = hivemind.DHT(..., identity_path=path, record_validators=record_validators(path))
    dht.store(key, value, expiration, subkey=owner_subkey(peer_id, identity_key(path)))
    ok = subkey_peer(subkey) == entry.peer_id          # on every entry read back
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from locoswarm.node.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    import hivemind

# The stored value: msgpack of the application's value plus the 356-byte signature. A heartbeat is a
# few hundred bytes; 8 KiB stays well below hivemind's 16 KiB failure size.
MAX_RECORD_BYTES = 8192
# An owner subkey is ~430 bytes (a 46-char peer id + the ssh-rsa form of a 2048-bit key, 380 chars).
MAX_SUBKEY_BYTES = 1024
# The keys libp2p and hivemind generate: 2048-bit RSA, exponent 65537. Other sizes and exponents are
# refused so that one signature check costs what a normal one does (a huge modulus or exponent makes
# verification arbitrarily slow).
_KEY_BITS = (2048, 4096)
_EXPONENT = 65537
_CACHE_SIZE = 1024

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_OWNER_SUBKEY = re.compile(rf"([{_B58}]{{1,128}})\[owner:(ssh-rsa [A-Za-z0-9+/]+={{0,2}})\]")


# ---- identity ----

def identity_key(path: Path | str) -> RSAPrivateKey:
    """The node's libp2p identity (``path``: hivemind's identity file, a protobuf ``PrivateKey`` holding
    a DER RSA key) as a hivemind ``RSAPrivateKey``. A missing file is created the way hivemind creates
    it (``P2P.generate_identity``, directory included), so a DHT started afterwards with
    ``identity_path=path`` runs as the same peer. Raises :class:`UserError` on an unreadable file."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        der = serialization.load_der_private_key(proto.data, password=None)
        if proto.key_type != crypto_pb2.RSA or not isinstance(der, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except Exception as exc:
        raise UserError(f"the identity file {path} is not a libp2p RSA private key ({exc or type(exc).__name__}); "
                        f"restore it, or delete it to start with a new peer id") from None
    # hivemind's RSAPrivateKey has no constructor from existing key bytes; its pickle state is the DER
    # private key, so restoring that state is the supported way to wrap an existing key.
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})
    return key


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: the sha2-256 multihash of the protobuf
    ``PublicKey`` holding the DER SubjectPublicKeyInfo (as ``PeerID.from_identity`` derives it)."""
    der = _crypto_key(public_key).public_bytes(encoding=serialization.Encoding.DER,
                                               format=serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def dht_identity(dht: hivemind.DHT) -> RSAPrivateKey | None:
    """The identity key of a DHT started with ``identity_path`` (as :func:`locoswarm.node.swarm.dht.start_dht`
    does; ``hivemind.DHT`` keeps the keyword arguments it hands to its P2P in its ``kwargs``); None if it
    has none or the file is unreadable. :func:`owner_subkey` checks that it is the key of the peer id."""
    path = (getattr(dht, "kwargs", None) or {}).get("identity_path")
    if not path or not Path(path).is_file():
        return None
    try:
        return identity_key(path)
    except UserError:
        return None


# ---- owner subkeys ----

def owner_subkey(peer_id: str, key: RSAPrivateKey | RSAPublicKey) -> str:
    """The subkey under which peer ``peer_id`` publishes its per-peer records: the peer id followed by
    ``[owner:<ssh-rsa public key>]`` of its identity ``key`` (private or public). Raises ValueError if
    ``key`` is not the identity of ``peer_id`` (its records would be unreadable to everyone)."""
    public = key.get_public_key() if hasattr(key, "get_public_key") else key
    subkey = f"{peer_id}[owner:{public.to_bytes().decode()}]"
    if subkey_peer(subkey) != peer_id:
        raise ValueError(f"the key is not the libp2p identity of peer {peer_id}")
    return subkey


def subkey_peer(subkey: object) -> str | None:
    """The peer id an owner subkey is bound to: its peer-id prefix, if the owner key that follows is an
    acceptable RSA key whose libp2p peer id is that prefix. None for anything else (not a str, not an
    owner subkey, a garbled or non-RSA key, a key of another peer). Results are cached (bounded)."""
    if not isinstance(subkey, str) or len(subkey) > MAX_SUBKEY_BYTES:
        return None
    return _subkey_peer(subkey)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _subkey_peer(subkey: str) -> str | None:
    match = _OWNER_SUBKEY.fullmatch(subkey)
    if match is None:
        return None
    public = _owner_key(match.group(2).encode())
    if public is None:
        return None
    return match.group(1) if peer_id_of(public) == match.group(1) else None


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _owner_key(data: bytes) -> RSAPublicKey | None:
    """An ssh-rsa public key, parsed, if it is one we accept (see ``_KEY_BITS``); else None."""
    try:
        public = RSAPublicKey.from_bytes(data)
    except Exception:
        return None
    numbers = _crypto_key(public).public_numbers()
    if not _KEY_BITS[0] <= numbers.n.bit_length() <= _KEY_BITS[1] or numbers.e != _EXPONENT:
        return None
    return public


def _crypto_key(public: RSAPublicKey):
    """The ``cryptography`` key inside a hivemind ``RSAPublicKey``, reloaded from its public ssh form."""
    return serialization.load_ssh_public_key(public.to_bytes())


# ---- validators ----

class OwnerSignatureValidator(RSASignatureValidator):
    """hivemind's owner-signature check (signing with this node's identity key), refusing instead of
    raising on owner keys we do not accept: garbled, not RSA, of an odd size or exponent.

    The same record arrives many times (from each replica a lookup asks, and on every re-read of a key
    until its owner replaces it), so the digests of the last ``cache_size`` records found valid are kept
    and a repeat costs a hash, not an RSA verification (~0.3 ms)."""

    _OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)

    def __init__(self, private_key: RSAPrivateKey, cache_size: int = 4096) -> None:
        super().__init__(private_key)
        self._cache_size = int(cache_size)
        self._valid: OrderedDict[bytes, None] = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        found = set(self._OWNER.findall(record.key) + self._OWNER.findall(record.subkey or b""))
        if not found:
            return True  # not a protected record
        if len(found) > 1 or any(_owner_key(k) is None for k in found):
            return False
        digest = _record_digest(record)
        if digest in self._valid:
            self._valid.move_to_end(digest)
            return True
        try:
            ok = bool(super().validate(record))
        except Exception:  # a malformed record from a peer is refused, never raised into hivemind
            return False
        if ok:
            self._valid[digest] = None
            if len(self._valid) > self._cache_size:
                self._valid.popitem(last=False)
        return ok


def _record_digest(record: DHTRecord) -> bytes:
    """sha256 over every field of the record (length-prefixed), signature included."""
    h = hashlib.sha256()
    for part in (record.key, record.subkey or b"", record.value):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    h.update(struct.pack("!d", record.expiration_time))
    return h.digest()


class RecordSizeValidator(RecordValidatorBase):
    """Refuses records whose stored value exceeds ``max_value`` bytes or whose subkey exceeds
    ``max_subkey`` bytes. It runs first on validation (priority above the signature check's 10), so it
    sees the value as stored, signature included, and an oversized record costs no RSA work."""

    def __init__(self, max_value: int = MAX_RECORD_BYTES, max_subkey: int = MAX_SUBKEY_BYTES) -> None:
        self.max_value = int(max_value)
        self.max_subkey = int(max_subkey)

    def validate(self, record: DHTRecord) -> bool:
        return len(record.value) <= self.max_value and len(record.subkey or b"") <= self.max_subkey

    @property
    def priority(self) -> int:
        return 20


def record_validators(identity_path: Path | str, *, max_value: int = MAX_RECORD_BYTES) -> list[RecordValidatorBase]:
    """The validators for ``hivemind.DHT(record_validators=...)``: the owner-signature check, signing
    with the node's libp2p identity (``identity_path``, created if missing: see :func:`identity_key`),
    and the size bound. Pass the same ``identity_path`` to the DHT."""
    return [OwnerSignatureValidator(identity_key(identity_path)), RecordSizeValidator(max_value)]


__all__ = [
    "MAX_RECORD_BYTES",
    "MAX_SUBKEY_BYTES",
    "OwnerSignatureValidator",
    "RecordSizeValidator",
    "dht_identity",
    "identity_key",
    "owner_subkey",
    "peer_id_of",
    "record_validators",
    "subkey_peer",
]
