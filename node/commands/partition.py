"""``locoswarm partition``: how the model is cut into fragments."""

from __future__ import annotations

import argparse
import json

from locoswarm.node.commands import add_config_args, load_config_from_args


def _handler(args: argparse.Namespace) -> int:
    from rich.console import Console

    # lazy: locoswarm.node.data, .model and .partition import torch (~1 s, measured); this module does not
    from locoswarm.node.data import load_tokenizer
    from locoswarm.node.model import build_meta_model, count_params
    from locoswarm.node.partition import partition, partition_json, partition_table

    cfg = load_config_from_args(args)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    # Names and sizes are all we need: the meta device skips allocation and init (fast for 125m).
    model = build_meta_model(cfg.model, tokenizer.vocab_size)
    fragments = partition(model, cfg.outer.fragments)
    if args.json:
        print(json.dumps(partition_json(fragments), indent=2))
        return 0
    console = Console()
    console.print(partition_table(model, fragments))
    console.print(f"model {cfg.model.arch}/{cfg.model.preset}: {count_params(model):,} parameters "
                  f"in {len(fragments)} fragments")
    return 0


def register(sub) -> None:
    """Add the ``partition`` subcommand: show how the model is cut into fragments."""

    parser = sub.add_parser("partition", help="show the fragment partition of the model",
                            description="Build the model of [model] and show how outer.fragments "
                                        "fragments split its parameters (strided over blocks).")
    add_config_args(parser)
    parser.add_argument("--json", action="store_true", help="print the partition as JSON")
    parser.set_defaults(func=_handler)
