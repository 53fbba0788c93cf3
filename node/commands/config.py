"""``locoswarm config``: check and print the swarm descriptor and its fingerprint."""

from __future__ import annotations

import argparse
from typing import Any

from locoswarm.node.commands import add_config_args
from locoswarm.node.config import fingerprint, load_config, render_init, to_toml


def _cmd_config(args: argparse.Namespace) -> int:
    if args.init:
        print(render_init(), end="")
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.fingerprint:
        print(fingerprint(cfg))
        return 0
    source = args.config or "built-in defaults"
    print(f"# swarm fingerprint: {fingerprint(cfg)} (config: {source}"
          f"{', with --set overrides' if args.overrides else ''})")
    print(to_toml(cfg), end="")
    return 0


def register(sub: Any) -> None:
    """Add the ``config`` subcommand to the CLI's subparsers."""

    parser = sub.add_parser(
        "config", help="check and print the swarm descriptor (peers.toml) and its fingerprint",
        description="Validate the swarm descriptor and print it as TOML with its fingerprint.")
    add_config_args(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fingerprint", action="store_true",
                      help="print only the swarm fingerprint (16 hex chars)")
    mode.add_argument("--init", action="store_true",
                      help="print a commented default peers.toml: locoswarm config --init > peers.toml")
    parser.set_defaults(func=_cmd_config)
