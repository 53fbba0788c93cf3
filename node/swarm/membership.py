"""Membership: heartbeats in the DHT, the live peer table, fingerprint refusal, fragment spread
(the swarm clock built from the heartbeats is ``locoswarm.node.swarm.clock``).

DHT layout (every key carries the swarm name; every per-swarm key also the fingerprint, so peers
with different shared settings never see each other's records):

- ``locoswarm/<name>/<fingerprint>/peers``: one owner subkey per peer (``<peer id>[owner:<its libp2p
  public key>]``, see :mod:`locoswarm.node.swarm.records`: only that peer can sign a record there), value = a
  serialized :class:`locoswarm.protocol.swarm_pb2.Heartbeat` (a few hundred bytes), expiring ``expiry`` s after
  publication;
- ``locoswarm/<name>/fingerprints``: one subkey per fingerprint in use, value = JSON of its shared
  settings (:func:`locoswarm.node.config.shared_settings`), so a newcomer with other settings is refused with a
  message naming the difference.

hivemind's DHT can crash on records of 16 KiB or more, so record sizes are asserted well below that.
DHT failures never propagate into the training loop: they are logged and reported as False / the
last known table.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from locoswarm.node.config import SwarmConfig, describe_difference, fingerprint, shared_settings
from locoswarm.node.errors import UserError
from locoswarm.node.swarm.clock import lower_median
from locoswarm.protocol import swarm_pb2

if TYPE_CHECKING:  # pragma: no cover
    import hivemind
    from hivemind.utils.crypto import RSAPrivateKey

    from locoswarm.node.swarm.admission import Admission

log = logging.getLogger("locoswarm.membership")

MAX_HEARTBEAT_BYTES = 4096
MAX_SETTINGS_BYTES = 8192
_LOG_EVERY_S = 30.0


def swarm_key(name: str, fingerprint: str, what: str) -> str:
    """A per-swarm DHT key: ``locoswarm/<name>/<fingerprint>/<what>``."""
    return f"locoswarm/{name}/{fingerprint}/{what}"


def fingerprints_key(name: str) -> str:
    """The fingerprint-independent key where peers announce their fingerprint and shared settings."""
    return f"locoswarm/{name}/fingerprints"


def _dht_time() -> float:
    from hivemind.utils import get_dht_time  # not exported at the top level in hivemind 1.1.12

    return get_dht_time()


def heartbeat_age(hb: swarm_pb2.Heartbeat) -> float:
    """How long ago ``hb`` says it was published, by this node's DHT time: 0 for one dated ahead of it (a peer's
    clock ahead of ours, or a lie, is no reason to date its claims earlier than we read them)."""
    return max(0.0, _dht_time() - float(hb.time))


class Membership:
    """This node's heartbeats and its view of the live peers of its swarm (same name and fingerprint).

    ``expiry`` (default: 4 heartbeat intervals) is how long a heartbeat stays valid; ``timeout`` bounds
    every DHT call. ``identity`` is the node's libp2p identity key, which heartbeats are bound to (default:
    the identity file the DHT runs with, see :func:`locoswarm.node.swarm.records.dht_identity`); without one this
    node only reads.
    """

    def __init__(self, dht: hivemind.DHT, cfg: SwarmConfig, peer_id: str, expiry: float | None = None, *,
                 timeout: float = 5.0, identity: RSAPrivateKey | None = None,
                 admission: Admission | None = None, certificate: bytes = b""):
        self.dht = dht
        self.cfg = cfg
        self.peer_id = str(peer_id)
        self.name = cfg.swarm.name
        self.fingerprint = fingerprint(cfg)
        self.expiry = float(expiry) if expiry is not None else 4.0 * cfg.network.heartbeat_interval
        self.timeout = float(timeout)
        self.peers_key = swarm_key(self.name, self.fingerprint, "peers")
        self.fingerprints_key = fingerprints_key(self.name)
        self.settings = shared_settings(cfg)
        self._settings_json = json.dumps(self.settings, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        assert len(self._settings_json.encode()) < MAX_SETTINGS_BYTES, "shared settings too large for the DHT"
        self._identity = identity
        self.admission = admission      # a closed swarm: who may be a member (None: anyone)
        self.certificate = certificate  # this node's, published with its heartbeats
        self._subkey: str | None = None  # this node's owner subkey, built on first publish
        self._announced_at: float | None = None
        self._known: dict[str, tuple[swarm_pb2.Heartbeat, float]] = {}  # peer id -> (heartbeat, expiration)
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()

    # ---- DHT calls with a timeout, never raising ----

    def _warn(self, what: str, exc: BaseException | str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(what, -1e9) >= _LOG_EVERY_S:
            self._last_log[what] = now
            log.warning("membership: %s failed: %s", what, exc or type(exc).__name__)

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` after logging a failure or timeout."""
        future = None
        try:
            with self._lock:  # DHT calls write to one pipe; keep threads (heartbeat, main) from interleaving
                future = getattr(self.dht, method)(*args, return_future=True, **kwargs)
            result = future.result(timeout=self.timeout)
        except TimeoutError:
            if future is not None:
                future.cancel()
            self._warn(what, f"no answer from the DHT in {self.timeout:g} s")
            return False, None
        except Exception as exc:
            self._warn(what, exc)
            return False, None
        self._last_log.pop(what, None)
        return True, result

    def _store(self, what: str, key: str, subkey: str, value: bytes | str, expiry: float) -> bool:
        done, ok = self._call(what, "store", key, value, _dht_time() + expiry, subkey=subkey)
        if done and not ok:
            self._warn(what, "the DHT refused the record (no peer stored it, or a newer one exists)")
        return bool(ok)

    def _get(self, what: str, key: str) -> dict | None:
        """``{subkey: (value, expiration)}`` of the live entries of ``key``; {} if none; None on failure."""
        done, result = self._call(what, "get", key, latest=True)
        if not done:
            return None
        value = getattr(result, "value", None)
        if not isinstance(value, dict):
            return {}
        now = _dht_time()
        out = {}
        for subkey, item in value.items():
            exp = getattr(item, "expiration_time", None)
            if exp is None or exp < now:
                continue
            out[subkey] = (getattr(item, "value", None), exp)
        return out

    # ---- heartbeats ----

    def publish(self, hb: swarm_pb2.Heartbeat) -> bool:
        """Store this node's heartbeat (``peer_id``, ``fingerprint`` and ``time`` are filled in when
        empty). Also re-announces the fingerprint when due. False if the DHT did not take it."""
        msg = swarm_pb2.Heartbeat()
        msg.CopyFrom(hb)
        if not msg.peer_id:
            msg.peer_id = self.peer_id
        if not msg.fingerprint:
            msg.fingerprint = self.fingerprint
        if msg.peer_id != self.peer_id or msg.fingerprint != self.fingerprint:
            self._warn("publish", f"heartbeat of {msg.peer_id}/{msg.fingerprint} does not match this node "
                                  f"({self.peer_id}/{self.fingerprint}); not published")
            return False
        if not msg.time:
            msg.time = _dht_time()
        if self.certificate and not msg.certificate:
            msg.certificate = self.certificate
        data = msg.SerializeToString()
        assert len(data) < MAX_HEARTBEAT_BYTES, f"heartbeat record of {len(data)} bytes is too large for the DHT"
        subkey = self._owner_subkey()
        if subkey is None:
            self._warn("publish", f"no libp2p identity key of peer {self.peer_id} to sign heartbeats with")
            return False
        ok = self._store("publish", self.peers_key, subkey, data, self.expiry)
        if not msg.leaving and (self._announced_at is None
                                or time.monotonic() - self._announced_at > self.expiry / 2):
            self.announce_fingerprint()
        return ok

    def _owner_subkey(self) -> str | None:
        """This node's owner subkey (see :mod:`locoswarm.node.swarm.records`); None without an identity key."""
        if self._subkey is None:
            # lazy: swarm.records imports hivemind (~0.35 s at every CLI start, measured)
            from locoswarm.node.swarm.records import dht_identity, owner_subkey

            identity = self._identity or dht_identity(self.dht)
            if identity is not None:
                try:
                    self._subkey = owner_subkey(self.peer_id, identity)
                except ValueError as exc:
                    self._warn("publish", exc)
        return self._subkey

    def peers(self, include_self: bool = False) -> dict[str, swarm_pb2.Heartbeat]:
        """Live peers of this swarm: ``{peer id: Heartbeat}``. Skips records that are expired, unparsable,
        of another fingerprint, marked ``leaving``, or not published by the peer they name (the entry's
        owner subkey must be bound to the heartbeat's peer id). On a DHT failure: the last known table, minus
        what has expired since."""
        # lazy: swarm.records imports hivemind (~0.35 s at every CLI start, measured)
        from locoswarm.node.swarm.records import subkey_peer

        entries = self._get("peers", self.peers_key)
        now = _dht_time()
        if entries is None:
            table = {p: hb for p, (hb, exp) in self._known.items() if exp >= now}
        else:
            known: dict[str, tuple[swarm_pb2.Heartbeat, float]] = {}
            for subkey, (value, exp) in entries.items():
                if not isinstance(value, bytes):
                    continue
                try:
                    hb = swarm_pb2.Heartbeat.FromString(value)
                except Exception:
                    continue
                if (hb.fingerprint != self.fingerprint or hb.leaving or not hb.peer_id
                        or subkey_peer(subkey) != hb.peer_id or not self._admitted(hb)):
                    continue
                known[hb.peer_id] = (hb, exp)
            self._known = known
            table = {p: hb for p, (hb, _) in known.items()}
        if not include_self:
            table.pop(self.peer_id, None)
        return table

    async def heard(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has a live heartbeat of this swarm in the DHT now, published by itself: read on
        the caller's loop (the network runtime's), for a requester this node's table does not know yet (a state
        server, ``locoswarm.node.swarm.state_sync``)."""
        # lazy: swarm.records imports hivemind (~0.35 s at every CLI start, measured)
        from locoswarm.node.swarm.records import subkey_peer

        found = await self.dht.get(self.peers_key, latest=True, return_future=True)
        value = getattr(found, "value", None)
        if not isinstance(value, dict):
            return False
        now = _dht_time()
        for subkey, item in value.items():
            data, exp = getattr(item, "value", None), getattr(item, "expiration_time", None)
            if subkey_peer(subkey) != peer_id or not isinstance(data, bytes) or exp is None or exp < now:
                continue
            try:
                hb = swarm_pb2.Heartbeat.FromString(data)
            except Exception:
                continue
            if hb.peer_id == peer_id and hb.fingerprint == self.fingerprint and not hb.leaving and self._admitted(hb):
                return True
        return False

    def _admitted(self, hb: swarm_pb2.Heartbeat) -> bool:
        """Whether the heartbeat's peer may be a member: anyone in an open swarm; in a closed one, a peer whose
        heartbeat carries a valid certificate for its id (``locoswarm.node.swarm.admission``)."""
        return (self.admission is None or hb.peer_id == self.peer_id
                or self.admission.admits(hb.peer_id, bytes(hb.certificate)))

    # ---- fingerprints ----

    def announce_fingerprint(self) -> bool:
        """Store this node's fingerprint and shared settings under the swarm's fingerprints key. Every peer of one
        fingerprint announces the same subkey, so the DHT refuses the store where another peer's announcement
        expires later (and a joiner's first store often reaches no peer yet): that is no failure while the key
        holds this fingerprint for a while yet (every normal join used to warn "announce fingerprint failed")."""
        done, ok = self._call("announce fingerprint", "store", self.fingerprints_key, self._settings_json,
                              _dht_time() + self.expiry, subkey=self.fingerprint)
        if done and not ok:
            held = (self._get("announce fingerprint", self.fingerprints_key) or {}).get(self.fingerprint)
            ok = held is not None and held[1] >= _dht_time() + self.expiry / 4
            if not ok:
                self._warn("announce fingerprint", "the DHT refused the record and holds no live announcement of "
                           "this fingerprint (no peer stored it)")
        if ok:
            self._announced_at = time.monotonic()
        return bool(ok)

    def check_fingerprint(self) -> None:
        """Refuse to join when live peers of this swarm name announce other fingerprints and none
        announces ours (an existing swarm refuses a newcomer, not the other way round). Call it before
        :meth:`announce_fingerprint`; afterwards our own announcement counts only if another live peer
        with our fingerprint exists. Raises :class:`UserError` naming the differing settings; a DHT
        failure is logged and lets the node through."""
        entries = self._get("check fingerprint", self.fingerprints_key)
        if not entries:
            return
        foreign = {fp: (value, exp) for fp, (value, exp) in entries.items() if fp != self.fingerprint}
        if not foreign:
            return
        if self.fingerprint in entries and (self._announced_at is None or self.peers()):
            return
        fp, (value, _) = max(foreign.items(), key=lambda item: item[1][1])
        try:
            theirs = json.loads(value)
            diff = describe_difference(theirs, self.settings) if isinstance(theirs, dict) else None
        except (TypeError, ValueError):
            diff = None
        diff = diff or "their shared settings are unreadable"
        others = f" (and {len(foreign) - 1} other fingerprint(s))" if len(foreign) > 1 else ""
        raise UserError(f'swarm "{self.name}" runs fingerprint {fp}{others} but this node has {self.fingerprint}: '
                        f"{diff}; use the swarm's peers.toml")


# ---- swarm-wide views of the heartbeats ----

#: A peer keeps the swarm's pace when it trains at least this share of the median announced rate.
PACE_SHARE = 0.5


def pace_set(rates: Mapping[str, float], share: float = PACE_SHARE) -> set[str]:
    """The peers a round waits for (the others get only the straggler grace): those whose announced
    token rate is at least ``share`` of the median of all announced rates, the asking node's own
    included.

    A function of the heartbeats alone, so every member computes the same set: a rule relative to each
    member's own speed made a fast member cut a straggler that slower members waited for, and the two
    groups then failed the round together (issue 10, ``reports/swarm-20mbit-mismatch-views``). A
    non-finite or negative rate counts as 0."""
    clean = {p: (r if math.isfinite(r) and r >= 0.0 else 0.0) for p, r in rates.items()}
    if not clean:
        return set()
    median = lower_median(list(clean.values()))  # one fast liar cannot raise it
    return {p for p, r in clean.items() if r >= share * median}


def _heartbeats(peers: Mapping[str, swarm_pb2.Heartbeat] | Iterable[swarm_pb2.Heartbeat]) -> list:
    return list(peers.values()) if isinstance(peers, Mapping) else list(peers)


def fragment_spread(peers: Mapping[str, swarm_pb2.Heartbeat] | Iterable[swarm_pb2.Heartbeat],
                    own: Iterable[swarm_pb2.FragmentStatus]) -> dict[int, dict]:
    """The consensus measure per fragment, over this node (``own``) and the peers' heartbeats:

    ``{fragment: {"version", "holders", "distinct_hashes", "norm_spread", "max_version", "max_lag"}}``
    where ``version`` is the highest version held by >= 2 peers (None if none is), ``holders`` how many
    hold it, ``distinct_hashes`` the number of distinct phi hashes among them (1 = consensus),
    ``norm_spread`` (max - min) / mean of their phi norms, ``max_version`` the highest version anyone
    holds and ``max_lag`` ``max_version`` minus the lowest version held.
    """
    holders: dict[int, list[swarm_pb2.FragmentStatus]] = {}
    for statuses in [list(own), *(list(hb.fragments) for hb in _heartbeats(peers))]:
        for fs in {f.fragment: f for f in statuses}.values():  # one status per fragment and peer
            holders.setdefault(int(fs.fragment), []).append(fs)
    out: dict[int, dict] = {}
    for frag in sorted(holders):
        statuses = holders[frag]
        versions = [int(fs.version) for fs in statuses]
        counts: dict[int, int] = {}
        for v in versions:
            counts[v] = counts.get(v, 0) + 1
        shared = [v for v, n in counts.items() if n >= 2]
        version = max(shared) if shared else None
        at = [fs for fs in statuses if version is not None and int(fs.version) == version]
        norms = [float(fs.phi_norm) for fs in at]
        mean = sum(abs(n) for n in norms) / len(norms) if norms else 0.0
        spread = (max(norms) - min(norms)) / mean if norms and mean > 0 else 0.0
        out[frag] = {
            "version": version,
            "holders": len(at),
            "distinct_hashes": len({int(fs.phi_hash) for fs in at}),
            "norm_spread": spread,
            "max_version": max(versions),
            "max_lag": max(versions) - min(versions),
        }
    return out


__all__ = [
    "MAX_HEARTBEAT_BYTES",
    "Membership",
    "fingerprints_key",
    "fragment_spread",
    "heartbeat_age",
    "swarm_key",
]
