"""``locoswarm status``: watch a running node (its control API) or, with ``--swarm``, a whole swarm.

- ``locoswarm status``              live view of the node on 127.0.0.1:7615, refreshed every second
- ``locoswarm status --once``       print one frame and exit (``--json``: the status as JSON)
- ``locoswarm status --control H:P`` another node (env LOCOSWARM_CONTROL)
- ``locoswarm status --swarm MULTIADDR --config peers.toml``  no local node needed: join the swarm's DHT
  as a client and show the peers' heartbeats

A node that does not answer is one line on stderr and exit code 1 (a service that is down, not a
mistake in the command line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from locoswarm.node.commands import add_config_args, load_config_from_args
from locoswarm.node.config import fingerprint
from locoswarm.node.control import (
    DEFAULT_CONTROL_HOST,
    DEFAULT_CONTROL_PORT,
    ENV_CONTROL,
    NodeUnreachable,
    parse_hostport,
)
from locoswarm.node.control import format_hostport as _fmt
from locoswarm.node.errors import UserError
from locoswarm.node.helptext import describe
from locoswarm.node.status import NodePeerStatus, NodeStatus, PeerStatus, Spread, SwarmView
from locoswarm.node.swarm.dht import start_dht, validate_bootstrap
from locoswarm.node.swarm.membership import Membership, fragment_spread
from locoswarm.protocol import control_pb2

RPC_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    default = os.environ.get(ENV_CONTROL) or f"{DEFAULT_CONTROL_HOST}:{DEFAULT_CONTROL_PORT}"
    p = sub.add_parser("status", help="watch a running node (or, with --swarm, a swarm) in the terminal",
                       description=describe(__doc__))
    p.add_argument("--control", default=default, metavar="HOST:PORT",
                   help=f"the node's control API (env {ENV_CONTROL}; default {default})")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print the status as JSON and exit")
    p.add_argument("--swarm", metavar="MULTIADDR", default=None,
                   help="no local node: join the swarm's DHT through this peer as a client and show its peers "
                        "(with --config, the swarm's peers.toml)")
    p.add_argument("--interval", type=float, default=WATCH_INTERVAL_S, help="seconds between refreshes (default 1)")
    add_config_args(p)
    p.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    """``locoswarm status``; a node that does not answer raises :class:`NodeUnreachable` (exit 1)."""
    try:
        return _run_status(args)
    except BrokenPipeError:  # `locoswarm status --json | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run_status(args: argparse.Namespace) -> int:
    if not 0.2 <= args.interval <= 60:
        raise UserError(f"--interval {args.interval} is not allowed; use 0.2..60 seconds")
    if args.swarm:
        return _run_swarm(args)
    host, port = parse_hostport(args.control)
    client = ControlClient(host, port)
    try:
        if args.json:
            print(json.dumps(client.status().to_json(), indent=1, sort_keys=True))
            return 0
        if args.once:
            _print_once(client.status())
            return 0
        return _live(client.watch(args.interval))
    finally:
        client.close()


# ---- the node's control API ----------------------------------------------------------------------------

class ControlClient:
    """A gRPC client of one node's control API; RPC failures become one-line :class:`UserError`\\ s."""

    def __init__(self, host: str, port: int) -> None:
        import grpc

        # lazy, as grpc above: the stub imports it (~17 ms at every CLI start, measured)
        from locoswarm.protocol import control_pb2_grpc

        self.where = _fmt(host, port)
        # A proxy from the environment must never see (or break) a loopback control connection.
        self.channel = grpc.insecure_channel(self.where, options=[("grpc.enable_http_proxy", 0)])
        self.stub = control_pb2_grpc.ControlStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def _error(self, exc: Exception) -> UserError:
        import grpc

        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None):
            return NodeUnreachable(f"no node answers on {self.where} (is 'locoswarm run' running? start one or "
                                   f"pass --control HOST:PORT)")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return NodeUnreachable(f"something answers on {self.where}, but not a locoswarm node's control API "
                                   f"(or one too old); pass --control HOST:PORT of a node")
        details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        return NodeUnreachable(f"the node on {self.where} answered with an error: {code.name}: {details}")

    def status(self) -> NodeStatus:
        import grpc

        try:
            return NodeStatus.from_proto(self.stub.GetStatus(control_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def peers(self) -> dict[str, NodePeerStatus]:
        import grpc

        try:
            reply = self.stub.ListPeers(control_pb2.ListPeersRequest(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return {p.peer_id: NodePeerStatus.from_proto(p) for p in reply.peers}

    def leave(self, reason: str = "") -> tuple[bool, str]:
        import grpc

        try:
            reply = self.stub.Leave(control_pb2.LeaveRequest(reason=reason), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return reply.accepted, reply.message

    def watch(self, interval: float = WATCH_INTERVAL_S) -> Iterator[NodeStatus]:
        """Statuses as the node streams them; the first one is fetched with a deadline, so a node
        that is not running fails at once. Ends with :class:`NodeUnreachable` if the node goes away."""
        import grpc

        yield self.status()
        stream = self.stub.WatchStatus(control_pb2.WatchRequest(interval_s=interval))
        try:
            for msg in stream:
                yield NodeStatus.from_proto(msg)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise NodeUnreachable(f"the node on {self.where} stopped answering (it left the swarm or was "
                                  f"stopped)") from None
        finally:
            stream.cancel()
        raise NodeUnreachable(f"the node on {self.where} ended the status stream (it is shutting down)")


# ---- output --------------------------------------------------------------------------------------------

def _console() -> Any:
    """A console as wide as the terminal; piped output gets $COLUMNS or 120 (rich would pick 80)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        try:
            width = int(os.environ.get("COLUMNS", "120"))
        except ValueError:
            width = 120
        console = Console(width=max(60, width))
    return console


def _print_once(status: NodeStatus | SwarmView) -> None:
    # lazy: the rich view costs ~13 ms at every CLI start (measured)
    from locoswarm.node.control.tui import render

    console = _console()
    console.print(render(status, console.width, live=False))


def _live(frames: Iterator[NodeStatus] | Iterator[SwarmView]) -> int:
    """Redraw on every status until Ctrl+C (exit 0) or the node goes away (one line, exit 1)."""
    from rich.live import Live

    # lazy, as rich.live above: the rich view costs ~13 ms at every CLI start (measured)
    from locoswarm.node.control.tui import render

    console = _console()
    first = next(frames)  # a node that does not answer raises here, before the screen is taken
    try:
        with Live(render(first, console.width), console=console, auto_refresh=False, screen=console.is_terminal,
                  redirect_stderr=False) as live:
            for status in frames:
                live.update(render(status, console.width), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        with contextlib.suppress(Exception):
            frames.close()  # type: ignore[attr-defined]
    return 0


# ---- the swarm from its DHT, without a local node ---------------------------------------------------------

def swarm_view(heartbeats: dict, cfg: Any, via: str, now: float) -> SwarmView:
    """What :func:`locoswarm.node.control.tui.render` draws without a local node, from ``Membership.peers()``."""
    fp = fingerprint(cfg)
    return SwarmView(swarm=cfg.swarm.name, fingerprint=fp, via=via, now=now,
                     peers={pid: PeerStatus.from_heartbeat(hb) for pid, hb in heartbeats.items()},
                     spread={k: Spread.from_json(v) for k, v in fragment_spread(heartbeats, []).items()},
                     note="" if heartbeats else (f"no live heartbeat of swarm '{cfg.swarm.name}' (fingerprint {fp}): "
                                                 f"is --config the swarm's peers.toml?"))


def _run_swarm(args: argparse.Namespace) -> int:
    from hivemind.utils import get_dht_time

    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    for name in ("locoswarm", "hivemind"):  # a status view prints the view, not the DHT's chatter
        logging.getLogger(name).setLevel(logging.ERROR)
    cfg = load_config_from_args(args)
    addrs = validate_bootstrap([args.swarm])
    with tempfile.TemporaryDirectory(prefix="locoswarm-status-") as tmp:
        try:
            dht = start_dht(addrs, identity_path=Path(tmp) / "identity.key", attempts=1, log=lambda line: None,
                            start_timeout=30.0, client_mode=True)
        except UserError as exc:
            if "could not join" in str(exc):
                raise NodeUnreachable(f"no swarm answers at {args.swarm} (is a node running there? pass the "
                                      f"multiaddr a running node prints)") from None
            raise
        try:
            membership = Membership(dht, cfg, str(dht.peer_id), timeout=10.0)
            membership.check_fingerprint()  # a wrong peers.toml shows an empty swarm: name the difference

            def view() -> SwarmView:
                return swarm_view(membership.peers(include_self=True), cfg, args.swarm, get_dht_time())

            if args.json:
                print(json.dumps(view().to_json(), indent=1, sort_keys=True))
                return 0
            if args.once:
                _print_once(view())
                return 0
            return _live(_poll(view, args.interval))
        finally:
            dht.shutdown()


def _poll(view: Callable[[], SwarmView], interval: float) -> Iterator[SwarmView]:
    while True:
        yield view()
        time.sleep(interval)


__all__ = ["ControlClient", "register", "run_status", "swarm_view"]
