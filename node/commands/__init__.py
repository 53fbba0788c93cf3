"""The ``locoswarm`` subcommands of the node's own modules: flags and environment in, the domain modules
(``locoswarm.node.daemon``, ``locoswarm.node.config``, ``locoswarm.node.partition``, ``locoswarm.node.checkpoint``)
called. Those modules never import the command line; ``locoswarm.node.cli`` only builds the parser and dispatches."""

from __future__ import annotations

import argparse
import os

from locoswarm.node.config import load_config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that reads the swarm descriptor."""
    parser.add_argument("--config", default=os.environ.get("LOCOSWARM_CONFIG"),
                        help="swarm descriptor peers.toml (env LOCOSWARM_CONFIG; default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, e.g. --set outer.h=20 (repeatable)")


def load_config_from_args(args: argparse.Namespace):
    return load_config(args.config, args.overrides)


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that trains: the data and the device."""
    parser.add_argument("--data", nargs="*", default=None, metavar="PATH",
                        help="text files, directories or globs (env LOCOSWARM_DATA, ':'-separated; "
                             "default: this Python's standard-library sources)")
    parser.add_argument("--device", default=os.environ.get("LOCOSWARM_DEVICE", "auto"),
                        help="auto, cpu, cuda or cuda:N (env LOCOSWARM_DEVICE)")


def data_paths(args: argparse.Namespace) -> list[str]:
    """The data paths of ``--data``, else of LOCOSWARM_DATA (empty: the default corpus)."""
    if args.data is not None:
        return list(args.data)
    env = os.environ.get("LOCOSWARM_DATA", "")
    return [p for p in env.split(":") if p]
