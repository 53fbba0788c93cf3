"""The ``locoswarm`` command line.

Each subsystem registers its own subcommand (``register(subparsers)``) and owns its flags; this
module only dispatches and turns user mistakes into one clear line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from node.errors import UserError
from node.helptext import describe


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and a hint) instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that reads the swarm descriptor."""
    parser.add_argument("--config", default=os.environ.get("LOCOSWARM_CONFIG"),
                        help="swarm descriptor peers.toml (env LOCOSWARM_CONFIG; default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, e.g. --set outer.h=20 (repeatable)")


def load_config_from_args(args: argparse.Namespace):
    from node.config import load_config

    return load_config(args.config, args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="locoswarm", description=describe(__doc__))
    parser.add_argument("--version", action="version", version="locoswarm 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    from node import config, daemon, partition, plan
    from node.bench import register as register_bench
    from node.control.cli import register as register_status
    from node.export import register_export, register_generate
    from node.sim import register as register_sim

    for register in (daemon.register, config.register, partition.register, register_sim, register_bench,
                     plan.register, register_export, register_generate, register_status):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"locoswarm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("locoswarm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
