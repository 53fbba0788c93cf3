"""The ``locoswarm`` subcommands of the node's own modules: flags and environment in, the domain modules
(``locoswarm.node.daemon``, ``locoswarm.node.config``, ``locoswarm.node.partition``, ``locoswarm.node.checkpoint``)
called. Those modules never import the command line; ``locoswarm.node.cli`` only builds the parser and dispatches."""

from __future__ import annotations

import argparse
import os


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that reads the swarm descriptor."""
    parser.add_argument("--config", default=os.environ.get("LOCOSWARM_CONFIG"),
                        help="swarm descriptor peers.toml (env LOCOSWARM_CONFIG; default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, e.g. --set outer.h=20 (repeatable)")


def load_config_from_args(args: argparse.Namespace):
    from locoswarm.node.config import load_config

    return load_config(args.config, args.overrides)
