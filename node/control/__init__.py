"""The node's local control surface: a gRPC API, the ``locoswarm status`` TUI and Prometheus metrics.

- :mod:`locoswarm.node.control.server`   the gRPC ``Control`` service (``protocol/control.proto``) run inside
  ``locoswarm run``; it samples the node (loss history, byte rates, peer joins and leaves) once a second
- :mod:`locoswarm.node.control.metrics`  the same figures in the Prometheus text format (``--metrics-port``)
- :mod:`locoswarm.node.control.tui`      a status (``locoswarm.node.status.NodeStatus``) rendered with rich (a pure
  function, testable at a fixed width)
- :mod:`locoswarm.node.control.cli`      ``locoswarm status``

This module stays import-light (no grpc, no rich): ``locoswarm run`` validates its control flags with it
before anything heavy starts.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Collection

from locoswarm.node.errors import UserError
from locoswarm.node.swarm.dht import check_port_free

DEFAULT_CONTROL_PORT = 7615
DEFAULT_CONTROL_HOST = "127.0.0.1"
ENV_CONTROL = "LOCOSWARM_CONTROL"            # `locoswarm status`: HOST:PORT of the node to ask
ENV_CONTROL_PORT = "LOCOSWARM_CONTROL_PORT"  # `locoswarm run`: the port to serve on
ENV_METRICS_PORT = "LOCOSWARM_METRICS_PORT"


class NodeUnreachable(UserError):
    """No node (or no swarm) answers where the user pointed ``locoswarm status``: exit code 1, as for
    a service that is down, rather than 2 (a mistake in the command line)."""

    exit_code = 1


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def control_port_from_args(value: int | None) -> tuple[int, bool]:
    """``(port, is_default)`` for ``locoswarm run``: ``--control-port``, else ``$LOCOSWARM_CONTROL_PORT``, else
    7615. Only the default may move to another free port when taken: several nodes on one machine
    (the quick start, the tests) must not fail on it, while a port the user chose must be that port."""
    if value is not None:
        return value, False
    env = os.environ.get(ENV_CONTROL_PORT, "").strip()
    if env:
        try:
            return int(env), False
        except ValueError:
            raise UserError(f"{ENV_CONTROL_PORT}={env!r} is not a port number; use 1..65535, or 0 to turn the "
                            f"control API off") from None
    return DEFAULT_CONTROL_PORT, True


def check_control_options(host: str, ports: dict[str, int], allow_remote: bool,
                          may_be_taken: Collection[str] = ()) -> str | None:
    """Validate the control flags of ``locoswarm run`` before the node starts anything.

    The control API can make the node leave and exposes its peers and traffic, so it listens on
    loopback unless the user opts in with ``--allow-remote-control``. ``ports`` maps a flag name to its
    value (0 = off); a port whose flag is in ``may_be_taken`` is not checked for being free. Returns a
    warning to print for a non-loopback host, None otherwise; raises :class:`UserError` naming a bad
    host, port, or a port already in use.
    """
    if host != "localhost":
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise UserError(f"--control-host {host!r} is not an IP address; use 127.0.0.1 (this machine only) "
                            f"or, with --allow-remote-control, 0.0.0.0 or one of this machine's addresses") from None
    for flag, port in ports.items():
        if not 0 <= port <= 65535:
            raise UserError(f"{flag} {port} is not a TCP port; use 1..65535, or 0 to turn it off")
    active = {flag: port for flag, port in ports.items() if port}
    if len(set(active.values())) < len(active):
        raise UserError(f"{' and '.join(active)} are both {next(iter(active.values()))}; give them different ports")
    warning = None
    if active and not is_loopback(host):
        if not allow_remote:
            raise UserError(f"--control-host {host} is reachable from other machines, and the control API can "
                            f"stop this node; pass --allow-remote-control to do it anyway, or use 127.0.0.1")
        warning = remote_warning(host)
    for flag, port in active.items():
        if flag in may_be_taken:
            continue
        try:
            check_port_free("127.0.0.1" if host == "localhost" else host.strip("[]"), port)
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
    return warning


def remote_warning(host: str) -> str:
    """What ``locoswarm run --allow-remote-control`` warns about."""
    return (f"the control API listens on {host}, reachable from other machines, without authentication or "
            f"encryption: anyone who reaches it can read this node's status and make it leave the swarm")


def parse_hostport(text: str, default_port: int = DEFAULT_CONTROL_PORT) -> tuple[str, int]:
    """``HOST:PORT``, ``HOST``, ``:PORT`` or ``[v6]:PORT`` -> (host, port); raises :class:`UserError`."""
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise UserError(f"--control {text!r}: unclosed '[' in an IPv6 address; write it like [::1]:7615")
        host, rest = text[1:end], text[end + 1:]
        port_text = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    host = host or DEFAULT_CONTROL_HOST
    if not port_text:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise UserError(f"--control {text!r}: {port_text!r} is not a TCP port; write HOST:PORT, "
                        f"e.g. 127.0.0.1:{DEFAULT_CONTROL_PORT}")
    return host, port


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = [
    "DEFAULT_CONTROL_HOST",
    "DEFAULT_CONTROL_PORT",
    "ENV_CONTROL",
    "ENV_CONTROL_PORT",
    "ENV_METRICS_PORT",
    "NodeUnreachable",
    "check_control_options",
    "control_port_from_args",
    "format_hostport",
    "is_loopback",
    "parse_hostport",
    "remote_warning",
]
