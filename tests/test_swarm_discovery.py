"""Discovery, membership and process hygiene of the networked node, on real hivemind DHTs (loopback).

Unit tests run several DHTs inside this test process; the orphan tests start real node-like
subprocesses and kill them. Every process started here is stopped by pid, and no file is left
outside ``tmp_path``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import hivemind  # noqa: F401 (imported up front so DHT timings exclude the import)
import pytest

from locoswarm.node.config import SwarmConfig, fingerprint
from locoswarm.node.errors import Stopped, UserError
from locoswarm.node.swarm.dht import (
    ENV_BOOTSTRAP,
    bootstrap_from_env_and_args,
    join_command,
    start_dht,
    validate_bootstrap,
    visible_maddrs,
)
from locoswarm.node.swarm.membership import Membership, fingerprints_key, fragment_spread, swarm_key
from locoswarm.protocol import swarm_pb2

REPO = Path(__file__).resolve().parents[1]
SOCKETS = "/tmp/hivemind-*.sock"


# ---- helpers: an independent /proc walk (not the code under test) ----

def _stat(pid: int) -> tuple[str, str, int, int, int] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    comm = data[data.find("(") + 1:data.rfind(")")]
    f = data[data.rfind(")") + 2:].split()
    return comm, f[0], int(f[1]), int(f[2]), int(f[19])


def _alive(pid: int, starttime: int | None = None) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in "ZX" and (starttime is None or st[4] == starttime)


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None and st[2] == pid:
            out.append(int(name))
    return out


def _descendants(pid: int) -> list[int]:
    out, queue = [], [pid]
    while queue:
        for child in _children(queue.pop()):
            if _alive(child):
                out.append(child)
                queue.append(child)
    return out


def _p2pds_of(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if (_stat(p) or ("",))[0] == "p2pd"]


def _stray_p2pds(before: set[int], where: Path) -> list[int]:
    """Living p2pd processes started since ``before`` that are ours: descendants of this test process,
    or any p2pd whose identity file (``-id=``) lies under ``where`` (orphans included)."""
    mine = set(_p2pds_of(os.getpid()))
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None and st[0] == "p2pd" and st[1] not in "ZX":
            with contextlib.suppress(OSError):
                if str(where) in Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace"):
                    mine.add(int(name))
    return sorted(mine - before)


def _wait_gone(pids: dict[int, int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p, t in pids.items() if _alive(p, t)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p, t in pids.items() if _alive(p, t)]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _unbound_new_sockets(before: set[str]) -> list[str]:
    bound = set()
    with open("/proc/net/unix") as fh:
        next(fh)
        bound = {line.split()[7] for line in fh if len(line.split()) >= 8}
    return sorted(p for p in set(glob.glob(SOCKETS)) - before if p not in bound)


def _shutdown(*dhts) -> None:
    for dht in dhts:
        with contextlib.suppress(Exception):
            dht.shutdown()


# ---- shared DHT pair for membership tests ----

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    before = set(_p2pds_of(os.getpid()))
    d = tmp_path_factory.mktemp("pair")
    a = start_dht([], identity_path=d / "a.key")
    b = start_dht(visible_maddrs(a), identity_path=d / "b.key")
    yield a, b
    _shutdown(a, b)
    assert not _stray_p2pds(before, d)


def _cfg(name: str, **outer) -> SwarmConfig:
    cfg = SwarmConfig()
    cfg.swarm.name = name
    for key, value in outer.items():
        setattr(cfg.outer, key, value)
    return cfg


# ---- discovery ----

@pytest.mark.timeout(60)
def test_dhts_find_each_other_and_identity_persists(tmp_path, capsys):
    before_p2pd, before_files = set(_p2pds_of(os.getpid())), set(glob.glob(SOCKETS))
    t0 = time.monotonic()
    a = start_dht([], identity_path=tmp_path / "a" / "node.key")  # creates the state dir
    t_start = time.monotonic() - t0
    b = c = None
    try:
        addrs = visible_maddrs(a)
        assert addrs and all("/p2p/" in x for x in addrs) and addrs[0].startswith("/ip4/127.0.0.1/")
        t0 = time.monotonic()
        b = start_dht(addrs, identity_path=tmp_path / "b.key")
        t_join = time.monotonic() - t0
        c = start_dht(addrs, identity_path=tmp_path / "c.key")
        cfg = _cfg("discovery")
        ids = [str(x.peer_id) for x in (a, b, c)]
        members = [Membership(x, cfg, pid) for x, pid in zip((a, b, c), ids, strict=True)]
        for m, x in zip(members, (a, b, c), strict=True):
            assert m.publish(swarm_pb2.Heartbeat(addrs=visible_maddrs(x)))
        # c bootstrapped from a only, yet sees b (and a), and b sees c
        assert set(members[2].peers()) == {ids[0], ids[1]}
        assert set(members[1].peers(include_self=True)) == set(ids)
        assert list(members[2].peers()[ids[1]].addrs) == visible_maddrs(b)

        # restart b with the same key file: same peer id
        old_id = ids[1]
        b.shutdown()
        t0 = time.monotonic()
        b = start_dht(addrs, identity_path=tmp_path / "b.key")
        t_restart = time.monotonic() - t0
        assert str(b.peer_id) == old_id
        # a second live node with b's key is refused
        with pytest.raises(UserError, match="already used by another running node"):
            start_dht(addrs, identity_path=tmp_path / "b.key", attempts=1)
    finally:
        _shutdown(*(x for x in (a, b, c) if x is not None))
    with capsys.disabled():
        print(f"\n[timing] first DHT up in {t_start:.2f} s, a joiner in {t_join:.2f} s, "
              f"a restart with its key file in {t_restart:.2f} s")
    assert not _stray_p2pds(before_p2pd, tmp_path)
    assert not _unbound_new_sockets(before_files)


@pytest.mark.timeout(60)
def test_an_identity_locked_by_another_process_is_refused_at_once_and_freed_when_it_dies(tmp_path):
    """Two nodes on one machine with one state directory: the second is refused before it starts a p2pd
    (a lock on the identity file, freed by the kernel when the holder dies), without relying on
    hivemind's probe of the swarm. A forked child of the holder does not keep the lock."""
    key = tmp_path / "node.key"
    first = start_dht([], identity_path=key)  # creates the key; this process holds its lock
    first.shutdown()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys, time
            from pathlib import Path
            from locoswarm.node.errors import UserError
            from locoswarm.node.swarm.dht import _lock_identity, _unlock_identity
            while True:  # retry until the lock is ours: a child of the test's first DHT may still be exiting
                try:
                    fd = _lock_identity(Path({str(key)!r}))
                    break
                except UserError:  # held; anything else is a failure the test should see at once
                    time.sleep(0.05)
            if os.fork() == 0:  # a child forked while the lock is held must not keep it
                time.sleep(30)
                os._exit(0)
            print("locked", flush=True)
            if sys.stdin.readline().strip() == "unlock":
                _unlock_identity(fd)
                print("unlocked", flush=True)
            sys.stdin.readline()
            """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # the holder says when it has the lock; a pytest timeout bounds a holder that never does
        assert holder.stdout.readline().strip() == "locked"
        before_p2pd = set(_p2pds_of(os.getpid()))
        t0 = time.monotonic()
        with pytest.raises(UserError) as info:
            start_dht([], identity_path=key, attempts=1)
        assert "already used by another running node" in str(info.value) and str(key) in str(info.value)
        assert time.monotonic() - t0 < 1.0 and set(_p2pds_of(os.getpid())) == before_p2pd
        holder.stdin.write("unlock\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "unlocked"
        # the holder and its forked child still live; the lock is free
        dht = start_dht([], identity_path=key, attempts=1)
        dht.shutdown()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)


@pytest.mark.timeout(30)
def test_unreachable_bootstrap_gives_up_with_clear_lines(tmp_path):
    before_p2pd, before_files = set(_p2pds_of(os.getpid())), set(glob.glob(SOCKETS))
    dead = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/QmdCwHzEH5CaKFMGj5Q7xdrsyc19GeCJSkU8S98K3ygWov"
    lines: list[str] = []
    with pytest.raises(UserError, match="could not join the swarm") as info:
        start_dht([dead], identity_path=tmp_path / "node.key", attempts=2, backoff=(0.2, 1.0), log=lines.append)
    assert dead in str(info.value)
    assert len(lines) == 2, lines
    assert lines[0] == f"bootstrap: no answer from {dead} (connection refused); retrying in 0.2 s (attempt 1)"
    assert lines[1].startswith(f"bootstrap: no answer from {dead} (connection refused); giving up")
    assert _wait_gone({p: _stat(p)[4] for p in _stray_p2pds(before_p2pd, tmp_path)}, 3.0) == []
    assert not _stray_p2pds(before_p2pd, tmp_path)
    assert not _unbound_new_sockets(before_files)

    # a stop event ends endless retries
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with pytest.raises(Stopped, match="stopped before joining"):
        start_dht([dead], identity_path=tmp_path / "node.key", attempts=None, backoff=(5.0, 5.0),
                  log=lambda _: None, stop=stop)
    assert not _stray_p2pds(before_p2pd, tmp_path)


@pytest.mark.timeout(30)
def test_one_dead_one_live_bootstrap_peer_joins(pair, tmp_path):
    a, _ = pair
    dead = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{a.peer_id}"
    for peers in ([dead, visible_maddrs(a)[0]], [visible_maddrs(a)[0], dead]):
        c = start_dht(peers, identity_path=tmp_path / "c.key", attempts=1, log=lambda _: None)
        try:
            m = Membership(c, _cfg("dead-live"), str(c.peer_id))
            assert m.publish(swarm_pb2.Heartbeat())
            assert str(c.peer_id) in Membership(a, _cfg("dead-live"), str(a.peer_id)).peers()
        finally:
            c.shutdown()


@pytest.mark.timeout(30)
def test_fixed_port_in_use_is_refused(pair, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_dht([], port=port, identity_path=tmp_path / "x.key")
    finally:
        sock.close()
    # a port held by another p2pd (which binds with SO_REUSEPORT) is refused too
    port = _closed_port()
    a = start_dht([], port=port, identity_path=tmp_path / "a.key")
    try:
        assert f"/tcp/{port}/" in visible_maddrs(a)[0]
        with pytest.raises(UserError, match=f"port {port} "):
            start_dht([], port=port, identity_path=tmp_path / "b.key")
    finally:
        a.shutdown()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", ["garbage", "/ip4/127.0.0.1/tcp/9", "/ip4/1.2.3.4/tcp/31337/p2p/QmPeerId",
                                 "/ip4/999.1.1.1/tcp/1/p2p/QmdCwHzEH5CaKFMGj5Q7xdrsyc19GeCJSkU8S98K3ygWov"])
def test_bad_multiaddr_is_refused(bad, tmp_path):
    good = "/ip4/127.0.0.1/tcp/9/p2p/QmdCwHzEH5CaKFMGj5Q7xdrsyc19GeCJSkU8S98K3ygWov"
    with pytest.raises(UserError, match="bootstrap address") as info:
        start_dht([good, bad], identity_path=tmp_path / "x.key")
    assert repr(bad) in str(info.value)
    assert not list(tmp_path.iterdir())  # refused before anything started
    assert validate_bootstrap([f" {good} ", good]) == [good]


@pytest.mark.timeout(10)
def test_bootstrap_precedence_and_join_command(monkeypatch):
    p = "/ip4/10.0.0.{}/tcp/1/p2p/QmdCwHzEH5CaKFMGj5Q7xdrsyc19GeCJSkU8S98K3ygWov"
    monkeypatch.delenv(ENV_BOOTSTRAP, raising=False)
    assert bootstrap_from_env_and_args([p.format(1)], None) == [p.format(1)]
    monkeypatch.setenv(ENV_BOOTSTRAP, f"{p.format(2)}, {p.format(3)}  {p.format(2)}")
    assert bootstrap_from_env_and_args([p.format(1)], []) == [p.format(2), p.format(3)]
    assert bootstrap_from_env_and_args([p.format(1)], [p.format(4), p.format(5)]) == [p.format(4), p.format(5)]
    monkeypatch.setenv(ENV_BOOTSTRAP, "  ")
    assert bootstrap_from_env_and_args([p.format(1)], None) == [p.format(1)]

    lo = "/ip4/127.0.0.1/tcp/5/p2p/QmdCwHzEH5CaKFMGj5Q7xdrsyc19GeCJSkU8S98K3ygWov"
    lan = "/ip4/192.168.1.5/tcp/5/p2p/QmdCwHzEH5CaKFMGj5Q7xdrsyc19GeCJSkU8S98K3ygWov"
    assert join_command([lo, lan], "my peers.toml") == f"locoswarm run --config 'my peers.toml' --bootstrap {lan}"
    only_lo = join_command([lo], None)
    assert only_lo.startswith(f"locoswarm run --bootstrap {lo}  # loopback address")


# ---- membership ----

def _heartbeat(clock: int = 0, n_fragments: int = 8, **kw) -> swarm_pb2.Heartbeat:
    frags = [swarm_pb2.FragmentStatus(fragment=i, version=10 + i, phi_hash=0xDEADBEEF, phi_norm=123.5)
             for i in range(n_fragments)]
    return swarm_pb2.Heartbeat(clock=clock, inner_step=123456, tokens=10**12, tokens_per_s=12345.6, loss=3.21,
                               fragments=frags, has_state=True, control_port=8080, **kw)


@pytest.mark.timeout(30)
def test_heartbeat_round_trip_expiry_and_leaving(pair):
    a, b = pair
    cfg = _cfg("heartbeats")
    ma, mb = Membership(a, cfg, str(a.peer_id), expiry=1.5), Membership(b, cfg, str(b.peer_id), expiry=30)
    hb = _heartbeat(7, addrs=visible_maddrs(a) * 2)
    ma_hb = swarm_pb2.Heartbeat()
    ma_hb.CopyFrom(hb)
    ma_hb.peer_id, ma_hb.fingerprint, ma_hb.time = str(a.peer_id), fingerprint(cfg), 1.0
    assert len(ma_hb.SerializeToString()) < 1024  # 8 fragments and 2 addresses
    assert ma.publish(hb) and mb.publish(_heartbeat(3))
    seen = mb.peers()
    assert set(seen) == {str(a.peer_id)}
    got = seen[str(a.peer_id)]
    assert got.clock == 7 and len(got.fragments) == 8 and got.fingerprint == fingerprint(cfg) and got.time > 0
    assert set(mb.peers(include_self=True)) == {str(a.peer_id), str(b.peer_id)}

    # junk under the key: unparsable, foreign fingerprint, subkey that is not the sender
    from hivemind.utils import get_dht_time

    exp = get_dht_time() + 30
    b.store(ma.peers_key, b"\xff\xfe not a heartbeat", exp, subkey="junk")
    b.store(ma.peers_key, swarm_pb2.Heartbeat(peer_id="foreign", fingerprint="0" * 16).SerializeToString(),
            exp, subkey="foreign")
    b.store(ma.peers_key, swarm_pb2.Heartbeat(peer_id="liar", fingerprint=fingerprint(cfg)).SerializeToString(),
            exp, subkey="someone-else")
    assert set(mb.peers()) == {str(a.peer_id)}

    # a leaving peer drops out at once
    assert mb.publish(_heartbeat(3, leaving=True))
    assert str(b.peer_id) not in ma.peers(include_self=True)
    # expiry: a's heartbeat vanishes 1.5 s after publication
    time.sleep(1.8)
    assert mb.peers() == {}
    # a heartbeat of another peer id or fingerprint is not published
    assert not ma.publish(swarm_pb2.Heartbeat(peer_id="other"))
    assert swarm_key("x", "f", "peers") == "locoswarm/x/f/peers"


class _StuckDHT:
    """A DHT whose calls never finish (or fail): membership must not block or raise."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def _future(self):
        if self.fail:
            raise RuntimeError("DHT process is dead")
        return concurrent.futures.Future()

    def store(self, *args, **kwargs):
        return self._future()

    def get(self, *args, **kwargs):
        return self._future()


class _RefusingDHT:
    """A DHT that refuses every store and answers reads with ``held``: {subkey: (value, expiration)}."""

    def __init__(self, held: dict):
        self.held = held
        self.stores = 0

    @staticmethod
    def _done(result):
        future = concurrent.futures.Future()
        future.set_result(result)
        return future

    def store(self, *args, **kwargs):
        self.stores += 1
        return self._done(False)

    def get(self, *args, **kwargs):
        items = {k: SimpleNamespace(value=v, expiration_time=e) for k, (v, e) in self.held.items()}
        return self._done(SimpleNamespace(value=items))


@pytest.mark.timeout(10)
def test_a_refused_fingerprint_announcement_is_fine_while_a_peer_holds_it(caplog):
    from hivemind.utils import get_dht_time

    cfg = _cfg("announce")
    probe = Membership(_RefusingDHT({}), cfg, "me", expiry=60)
    held = _RefusingDHT({probe.fingerprint: ("{}", get_dht_time() + 50)})  # another peer announced it later
    assert Membership(held, cfg, "me", expiry=60).announce_fingerprint() is True
    assert "announce fingerprint" not in caplog.text
    stale = _RefusingDHT({probe.fingerprint: ("{}", get_dht_time() + 5), "otherfp": ("{}", get_dht_time() + 50)})
    assert Membership(stale, cfg, "me", expiry=60).announce_fingerprint() is False
    assert probe.announce_fingerprint() is False
    assert "announce fingerprint failed" in caplog.text and "holds no live announcement" in caplog.text


@pytest.mark.timeout(10)
def test_dht_failures_never_raise(caplog):
    cfg = _cfg("stuck")
    for dht in (_StuckDHT(), _StuckDHT(fail=True)):
        m = Membership(dht, cfg, "me", timeout=0.2)
        t0 = time.monotonic()
        assert m.publish(_heartbeat()) is False
        assert m.peers() == {}
        m.check_fingerprint()  # lets the node through
        assert time.monotonic() - t0 < 2.0
    assert "membership: publish failed" in caplog.text


@pytest.mark.timeout(30)
def test_fingerprint_refusal_names_the_difference(pair):
    a, b = pair
    swarm = _cfg("fp-check", codec="fp4")
    other = _cfg("fp-check", codec="int8")
    ma = Membership(a, swarm, str(a.peer_id))
    ma.check_fingerprint()  # nobody there yet
    assert ma.publish(_heartbeat())  # announces the fingerprint too
    mb = Membership(b, other, str(b.peer_id))
    with pytest.raises(UserError) as info:
        mb.check_fingerprint()
    msg = str(info.value)
    assert msg == (f'swarm "fp-check" runs fingerprint {fingerprint(swarm)} but this node has {fingerprint(other)}: '
                   f"outer.codec: fp4 vs int8; use the swarm's peers.toml")
    # same fingerprint passes, a different swarm name is another swarm
    Membership(b, _cfg("fp-check", codec="fp4"), str(b.peer_id)).check_fingerprint()
    Membership(b, _cfg("fp-check-2", codec="int8"), str(b.peer_id)).check_fingerprint()
    # the settings record it announced in the DHT stays small
    record = a.get(fingerprints_key("fp-check"), latest=True).value[fingerprint(swarm)].value
    assert json.loads(record) == ma.settings and len(record) < 8192


# ---- swarm progress on synthetic heartbeats ----

@pytest.mark.timeout(10)
def test_fragment_spread():
    fs = swarm_pb2.FragmentStatus
    peers = {
        "p1": swarm_pb2.Heartbeat(clock=5, fragments=[fs(fragment=0, version=4, phi_hash=1, phi_norm=10.0),
                                                      fs(fragment=1, version=2, phi_hash=7, phi_norm=5.0)]),
        "p2": swarm_pb2.Heartbeat(clock=9, fragments=[fs(fragment=0, version=4, phi_hash=2, phi_norm=12.0),
                                                      fs(fragment=1, version=3, phi_hash=8, phi_norm=5.0)]),
        "p3": swarm_pb2.Heartbeat(clock=2, fragments=[fs(fragment=0, version=5, phi_hash=3, phi_norm=11.0)]),
    }
    own = [fs(fragment=0, version=4, phi_hash=1, phi_norm=11.0), fs(fragment=1, version=2, phi_hash=7, phi_norm=5.0)]
    spread = fragment_spread(peers, own)
    assert spread[0]["version"] == 4 and spread[0]["holders"] == 3 and spread[0]["distinct_hashes"] == 2
    assert spread[0]["norm_spread"] == pytest.approx(2.0 / 11.0)
    assert spread[0]["max_version"] == 5 and spread[0]["max_lag"] == 1
    assert spread[1] == {"version": 2, "holders": 2, "distinct_hashes": 1, "norm_spread": 0.0,
                         "max_version": 3, "max_lag": 1}
    lone = fragment_spread({}, [fs(fragment=3, version=1)])
    assert lone[3]["version"] is None and lone[3]["holders"] == 0 and lone[3]["max_lag"] == 0


# ---- orphans: real node-like subprocesses ----

NODE_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    sys.path.insert(0, sys.argv[2])
    from locoswarm.node.swarm.process import become_group_leader, install_signal_handlers, start_watchdog, stop_watchdog
    leader = become_group_leader() if sys.argv[3] == "group" else False
    watchdog = start_watchdog(poll_s=0.2)
    from pathlib import Path
    from locoswarm.node.swarm.dht import start_dht
    stop = threading.Event()
    install_signal_handlers(stop)
    dht = start_dht([], identity_path=Path(sys.argv[1]) / "node.key")
    install_signal_handlers(stop)
    # Two of the watchdog's polls after the DHT is up. Known window: a p2pd started less than a poll before
    # a SIGKILL is one the watchdog never saw, and its socket is removed only if the DHT child's SIGTERM
    # handler runs (it does unless the child is stuck in C code); 1 run in 8 of this file left it then.
    time.sleep(0.5)
    print(json.dumps({"pid": os.getpid(), "pgid": os.getpgrp(), "leader": leader, "watchdog": watchdog,
                      "dht": dht.pid}), flush=True)
    while not stop.wait(0.1):
        pass
    from hivemind.utils import get_dht_time
    # the DHT still works after a Ctrl+C of the node's group: a leaving heartbeat can go out
    ok = dht.store("locoswarm/test/leaving", b"bye", get_dht_time() + 5, subkey="me")
    print(json.dumps({"leaving_stored": ok}), flush=True)
    dht.shutdown()
    stop_watchdog(watchdog)
    sys.exit(0)
""")


def _start_node(tmp_path: Path, group: bool = True) -> tuple[subprocess.Popen, dict, dict[int, int], set[str]]:
    script = tmp_path / "node_script.py"
    script.write_text(NODE_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="WARNING")
    err = open(tmp_path / "stderr.txt", "wb")  # noqa: SIM115 (closed by the caller via proc)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(REPO),
                             "group" if group else "no-group"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=err, env=env)
    err.close()
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"node did not start: {(tmp_path / 'stderr.txt').read_text()[-2000:]}")
    info = json.loads(proc.stdout.readline())
    assert info["pid"] == proc.pid
    if group:
        assert info["leader"] and info["pgid"] == proc.pid
    else:
        assert not info["leader"] and info["pgid"] == os.getpgrp()  # it shares the test's group
    p2pds = _p2pds_of(info["dht"])  # walked before any kill
    assert p2pds, "the DHT child started no p2pd"
    tree = {p: _stat(p)[4] for p in [info["dht"], info["watchdog"], *p2pds, *_descendants(proc.pid)]}
    files = {arg[len("-listen=/unix"):] for p in p2pds
             for arg in Path(f"/proc/{p}/cmdline").read_bytes().decode().split("\0") if arg.startswith("-listen=")}
    files |= set(glob.glob(f"/dev/shm/torch_{proc.pid}_*")) | set(glob.glob(f"/dev/shm/torch_{info['dht']}_*"))
    return proc, info, tree, files


def _finish(proc: subprocess.Popen, tree: dict[int, int]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    for pid, starttime in tree.items():  # last resort, by pid: nothing may outlive the test
        if _alive(pid, starttime):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("group", [True, False], ids=["own-group", "shared-group"])
def test_sigkill_leaves_no_orphans(tmp_path, capsys, group):
    """SIGKILL of the node: its watchdog stops the DHT child, p2pd and torch_shm_manager and removes their
    files. In a shared group (no become_group_leader) it must spare the group, i.e. this test process."""
    proc, _, tree, files = _start_node(tmp_path, group)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        left = _wait_gone(tree, 5.0)
        elapsed = time.monotonic() - t0
        assert not left, f"left behind: {[(p, _stat(p)) for p in left]}"
        deadline = time.monotonic() + 5.0  # the watchdog removes the files right after the processes
        while [f for f in files if os.path.exists(f)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [f for f in files if os.path.exists(f)], (tmp_path / "stderr.txt").read_text()[-2000:]
        with capsys.disabled():
            print(f"\n[timing] after SIGKILL everything was gone in {elapsed:.2f} s ({'own' if group else 'shared'} "
                  f"group, {len(tree)} processes)")
    finally:
        _finish(proc, tree)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c-to-group"])
def test_graceful_exit_leaves_nothing(tmp_path, how):
    proc, info, tree, files = _start_node(tmp_path)
    try:
        if how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(info["pgid"], signal.SIGINT)  # the node leads this group (asserted above)
        assert proc.wait(20) == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
        # The moment the node has returned, nothing of it is left in its process group: its watchdog moved
        # to a session of its own before the node exited (it only tidies up from there).
        in_group = [p for p in tree if _alive(p) and (_stat(p) or (0,) * 5)[3] == info["pgid"]]
        assert not in_group, f"still in the node's group: {[(p, _stat(p)) for p in in_group]}"
        watchdog = _stat(info["watchdog"])
        assert watchdog is None or watchdog[1] in "ZX" or os.getsid(info["watchdog"]) == info["watchdog"]
        stderr = (tmp_path / "stderr.txt").read_text()
        assert stderr.count("leaving the swarm (Ctrl+C again to force)") == 1, stderr[-2000:]
        assert "Traceback" not in stderr and "hard way" not in stderr, stderr[-2000:]
        assert json.loads(proc.stdout.readline()) == {"leaving_stored": True}
        # The watchdog is in the tree: after an orderly exit it waits for the node and torch's shm manager,
        # removes the shm files the manager left (a loaded CI run saw some outlive it), then ends.
        left = _wait_gone(tree, 10.0)
        assert not left, f"left behind: {[(p, _stat(p)) for p in left]}"
        assert not [f for f in files if os.path.exists(f)]
    finally:
        _finish(proc, tree)


def test_a_dead_processes_socket_still_listed_as_bound_is_removed_after_the_wait(tmp_path, monkeypatch):
    """/proc/net/unix can list a killed process's socket for a while: with a wait it goes anyway (all owners
    are dead, and nothing can bind a path whose file exists); without one, a listed socket is kept."""
    from locoswarm.node.swarm import process

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "hivemind-p2pd-test.sock"
    monkeypatch.setattr(process, "_unix_sockets", lambda: [("1", str(path))])
    path.write_text("")
    # (a reused pid's stale /dev/shm/torch_<pid>_* files may be removed too: only the socket is judged)
    assert str(path) not in process.cleanup_ipc_files([dead.pid], [str(path)]) and path.exists()
    t0 = time.monotonic()
    assert str(path) in process.cleanup_ipc_files([dead.pid], [str(path)], retry_s=0.3)
    assert not path.exists() and 0.25 < time.monotonic() - t0 < 3.0
    path.write_text("")  # an owner still alive: nothing is removed, however long the wait
    assert process.cleanup_ipc_files([os.getpid()], [str(path)], retry_s=0.1) == [] and path.exists()


def test_pace_set_is_the_same_for_every_member_and_ignores_one_fast_liar() -> None:
    from locoswarm.node.swarm.membership import pace_set

    rates = {"a": 3000.0, "b": 2900.0, "c": 1700.0, "d": 400.0}
    # Every member computes from the same announced rates: the same set, whatever its own speed.
    assert pace_set(rates) == {"a", "b", "c"}
    # The lower median: one peer announcing an absurd rate does not push honest peers out.
    assert pace_set({**rates, "liar": 1e12}) == {"a", "b", "c", "liar"}
    # Rates that cannot be (nan, negative) count as 0: peers just starting, so the round waits for all.
    assert pace_set({"a": 1000.0, "b": float("nan"), "c": -5.0, "d": 900.0}) == {"a", "b", "c", "d"}
    assert pace_set({"a": 1000.0, "b": float("nan"), "d": 900.0, "e": 950.0}) == {"a", "d", "e"}
    assert pace_set({"a": 0.0, "b": 0.0}) == {"a", "b"}  # nobody measured yet: wait for all
    assert pace_set({}) == set()


# A child that binds a unix socket at argv[1], prints "bound", and sleeps (a p2pd's stand-in).
SOCKET_CHILD = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); "
                "print('bound', flush=True); time.sleep(120)")

LATE_CHILD_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from locoswarm.node.swarm.process import become_group_leader, start_watchdog
    become_group_leader()
    start_watchdog(poll_s=60.0)  # one poll at start; the child below comes after it
    time.sleep(0.3)
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[2]], stdout=subprocess.PIPE)
    child.stdout.readline()
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _start_socket_owner(tmp_path: Path, script: str, args: list[str], **popen) -> tuple[subprocess.Popen, str]:
    """Run ``script`` with ``[*args, socket path, SOCKET_CHILD]``; returns the process and the socket path."""
    sock = f"/tmp/hivemind-p2pd-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    path = tmp_path / "owner.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path), *args, sock, SOCKET_CHILD], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, **popen)
    return proc, sock


def _child_of(proc: subprocess.Popen) -> tuple[int, int]:
    """The (pid, start time) of the socket child the script reports once its socket is bound."""
    ready, _, _ = select.select([proc.stdout], [], [], 20)
    assert ready, "the script did not start its child"
    child = int(proc.stdout.readline())
    return child, _stat(child)[4]


@pytest.mark.timeout(30)
def test_a_socket_bound_after_the_watchdogs_last_poll_is_removed_after_sigkill(tmp_path):
    """The watchdog records the leftover processes' files once more before it stops them: a p2pd that
    bound its socket after the last poll must not leave the socket behind (a CI run saw one)."""
    proc, sock = _start_socket_owner(tmp_path, LATE_CHILD_SCRIPT, [str(REPO)])
    try:
        child, child_start = _child_of(proc)
        assert os.path.exists(sock)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10.0
        while (os.path.exists(sock) or _alive(child, child_start)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child, child_start), "the watchdog did not stop the child"
        assert not os.path.exists(sock), "the child's socket was left behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)


LEAN_WATCHDOG_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import torch  # noqa: F401 (a node has imported torch before it starts its watchdog)
    from locoswarm.node.swarm.process import become_group_leader, start_watchdog
    become_group_leader()
    print(start_watchdog(poll_s=0.2), flush=True)
    time.sleep(120)
""")


def _smaps_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split()[:2]
        out[name.rstrip(":")] = int(value) / 1024
    return out


@pytest.mark.timeout(60)
def test_the_watchdog_imports_no_torch_even_when_its_node_did(tmp_path):
    """The watchdog is a fresh interpreter on the standard library: forked from a node that had imported
    torch it held 100 MB PSS (70 MB of it its own). It maps no torch library and stays small, and it still
    cleans up once its node is SIGKILLed."""
    path = tmp_path / "lean.py"
    path.write_text(LEAN_WATCHDOG_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(path), str(REPO)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 40)
        assert ready, "the script did not start its watchdog"
        watchdog = int(proc.stdout.readline())
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:  # until the fresh interpreter has started its watch
            cmdline = Path(f"/proc/{watchdog}/cmdline").read_bytes().split(b"\0")
            if b"--locoswarm-watchdog" in cmdline and _stat(watchdog)[0] == "locoswarm-watch":
                break
            time.sleep(0.05)
        assert b"--locoswarm-watchdog" in cmdline, cmdline
        time.sleep(0.5)  # a few polls
        maps = Path(f"/proc/{watchdog}/maps").read_text()
        assert "torch" not in maps and "libgomp" not in maps, "the watchdog maps torch's libraries"
        mem = _smaps_mb(watchdog)
        assert mem["Private_Clean"] + mem["Private_Dirty"] < 30, mem  # measured: about 8 MB
        assert mem["Pss"] < 40, mem
        start = _stat(watchdog)[4]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10.0
        while _alive(watchdog, start) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(watchdog, start), "the watchdog outlived its node"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


OWNER_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    open(f"/dev/shm/torch_{os.getpid()}_test_0", "w").close()  # as torch's shared memory leaves them
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], stdout=subprocess.PIPE,
                             start_new_session=True)  # a helper in a session of its own
    child.stdout.readline()
    print(child.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.timeout(30)
def test_kill_groups_leaves_neither_processes_nor_their_files(tmp_path):
    """What the benchmarks (and the tests' NodeProc) do to nodes: SIGKILL by process group, which takes
    the node's watchdog too. The files the processes owned go with them, and a descendant in a session of
    its own is killed as well."""
    from locoswarm.node.swarm.process import kill_groups

    proc, sock = _start_socket_owner(tmp_path, OWNER_SCRIPT, [], start_new_session=True)
    shm = f"/dev/shm/torch_{proc.pid}_test_0"
    child = None
    try:
        child, child_start = _child_of(proc)
        assert os.path.exists(sock) and os.path.exists(shm)
        removed = kill_groups({proc.pid}, proc, timeout=10)
        assert proc.poll() is not None and not _alive(child, child_start)
        assert not os.path.exists(sock) and not os.path.exists(shm), removed
        assert set(removed) == {sock, shm}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        for path in (sock, shm):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_the_network_runtime_leaves_no_client_socket_behind(pair) -> None:
    """The node's replica of the DHT's daemon binds /tmp/hivemind-p2pclient-*.sock once it serves a handler;
    ``NetworkRuntime.stop`` removes it (test runs used to leave a few of them)."""
    from locoswarm.node.swarm.runtime import NetworkRuntime

    async def noop(stream_info, reader, writer) -> None:
        writer.close()

    before = set(glob.glob("/tmp/hivemind-p2pclient-*.sock"))
    runtime = NetworkRuntime(pair[0])
    try:
        runtime.call(runtime.p2p.add_binary_stream_handler("locoswarm.test.noop", noop), timeout=10)
        made = set(glob.glob("/tmp/hivemind-p2pclient-*.sock")) - before
        assert made, "the replica bound no client socket: nothing to check"
    finally:
        runtime.stop()
    assert not {p for p in made if os.path.exists(p)}, made
