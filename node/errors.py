"""Errors that are the user's to fix.

A ``UserError`` is printed by the CLI as one line (``locoswarm: error: ...``) with exit code 2 and no
traceback. Its message must name the bad value, say what is allowed and how to fix it.
"""


class UserError(Exception):
    """A mistake in the user's input: configuration, flags, paths."""

    exit_code = 2


class ConfigError(UserError):
    """An invalid swarm descriptor (peers.toml) or node-local setting."""


class Stopped(Exception):
    """The user stopped the node (Ctrl+C, SIGTERM) before it had joined anything to leave: the CLI prints the
    message as one line, no traceback, and exits 130, as an interrupted command does (not 2: it is no mistake)."""

    exit_code = 130
