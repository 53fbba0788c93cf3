"""``locoswarm data prepare``: pre-tokenize a corpus into token shards (``locoswarm.node.shards``)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from locoswarm.node.commands import add_config_args, load_config_from_args
from locoswarm.node.errors import UserError

# locoswarm.node.shards.SHARD_TOKENS, said again here: building the parser must not import torch (locoswarm.node.shards
# does)
SHARD_TOKENS = 64 * 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare corpora larger than memory (token shards read from disk)",
                       description="Data commands. 'prepare' streams text sources into token shards that "
                                   "'locoswarm run --data DIR' and the simulator read a window at a time.")
    verbs = p.add_subparsers(dest="data_command", required=True, metavar="VERB", parser_class=type(p))
    prep = verbs.add_parser(
        "prepare", help="tokenize text files, .jsonl, .parquet or a datasets directory into token shards",
        description="Stream SRC (files, directories, globs; .jsonl with data.text_field; .parquet with pyarrow; a "
                    "local Hugging Face datasets directory with datasets) through the swarm's tokenizer into "
                    "uint16/uint32 shard files with an index.json, split into train and eval as the node splits "
                    "text (data.seed, data.eval_fraction). Memory stays flat whatever the corpus size.")
    add_config_args(prep)
    prep.add_argument("sources", nargs="+", metavar="SRC", help="files, directories or globs to read")
    prep.add_argument("--out", required=True, help="directory to write the shards and index.json into")
    prep.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                      help=f"tokens per shard file (default {SHARD_TOKENS:,})")
    prep.set_defaults(func=run_prepare)


def _source_bytes(paths: list[str], extensions: list[str]) -> int:
    # lazy: locoswarm.node.data imports torch (~1 s, measured); this module does not
    from locoswarm.node.data import discover_files

    total = 0
    for f in discover_files(paths, [*extensions, ".parquet"]):
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def run_prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    # lazy: locoswarm.node.data and .shards import torch (~1 s, measured); this module does not
    from locoswarm.node.data import load_tokenizer
    from locoswarm.node.shards import is_hf_dataset_dir, prepare

    cfg = load_config_from_args(args)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    console = Console(stderr=True)
    plain = [s for s in args.sources if not is_hf_dataset_dir(Path(s))]
    total = _source_bytes(plain, cfg.data.extensions) if plain else None
    columns = [TextColumn("preparing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("prepare", total=total)
        result = prepare(args.sources, Path(args.out), cfg.data, tokenizer, cfg.model.tokenizer,
                         shard_tokens=args.shard_tokens,
                         on_progress=lambda done: progress.update(task, completed=done))
    if result.train_tokens == 0:
        raise UserError("no training tokens were written")
    print(f"prepared {result.out}: {result.files} files ({result.skipped_binary} binary skipped, "
          f"{result.skipped_lines} bad lines), {result.train_docs} train + {result.eval_docs} eval docs or segments, "
          f"{result.train_tokens:,} train + {result.eval_tokens:,} eval tokens in {result.seconds:.1f} s, "
          f"peak memory {result.peak_rss_mb:.0f} MB")
    return 0
