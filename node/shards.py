"""Corpora larger than memory: pre-tokenized token shards on disk, read a window at a time.

``locoswarm data prepare SRC... --out DIR`` streams the sources (text files, .jsonl, .parquet with
pyarrow, a local Hugging Face ``datasets`` directory with ``datasets``) document by document, never
holding more than one segment: every document is cut into segments of about ``SEGMENT_BYTES`` as
the in-memory loader cuts it, tokenized, sent to train or eval by the same rule (blake2b of the data
seed and the segment's key under ``data.eval_fraction``) and appended, eos after each, to shard
files of at most ``--shard-tokens`` tokens (uint16 when the vocabulary fits, else uint32). A shard is
renamed into place when complete and ``index.json`` is written last, atomically, so a directory with
an index is whole and an interrupted prepare leaves no index behind.

``ShardedTokens`` is what ``locoswarm.node.data.load_corpus`` returns for such a directory: it has a length and
answers slices and batches of contiguous windows by reading exactly those tokens with ``pread`` (no
mapping, no cache of its own), so memory stays flat whatever the corpus size; a window may span two
shards. Sampling stays that of ``TrainBatches``: a batch depends only on (seed, rank, step), so a
resumed node continues where it was without sampler state.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from locoswarm.node.data import (
    SEGMENT_BYTES,
    discover_files,
    is_binary,
    segments_of,
    split_value,
    stream_segments,
    tokenize_bytes,
)
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text

FORMAT = "locoswarm-tokens-1"
INDEX = "index.json"
SHARD_TOKENS = 64 * 1024 * 1024        # tokens per shard file by default (128 MiB of uint16)
READ_BLOCK = 1024 * 1024               # bytes read from a source file at a time


# ---- documents, streamed ------------------------------------------------------------------------

@dataclass
class SourceStats:
    files: int = 0
    skipped_binary: int = 0
    skipped_lines: int = 0
    bytes: int = 0


def iter_documents(files: Sequence[Path], root: str, text_field: str, segment_bytes: int,
                   stats: SourceStats) -> Iterator[tuple[str, bytes]]:
    """Every segment of every file, keyed by its path relative to ``root`` (plus line or row)."""
    for path in files:
        key = Path(os.path.relpath(path, root)).as_posix() if root else path.name
        suffix = path.suffix.lower()
        stats.files += 1
        if suffix == ".parquet":
            yield from _parquet(path, key, text_field, segment_bytes, stats)
        elif suffix == ".jsonl":
            yield from _jsonl(path, key, text_field, segment_bytes, stats)
        else:
            with open(path, "rb") as fh:
                head = fh.read(READ_BLOCK)
                if is_binary(head):
                    stats.skipped_binary += 1
                    continue
                pending = io.BytesIO(head)

                def read(n: int, fh=fh, pending=pending) -> bytes:
                    return pending.read(n) or fh.read(n)

                for seg in stream_segments(key, read, segment_bytes):
                    stats.bytes += len(seg[1])
                    yield seg


def _records(values: Iterator[tuple[str, object]], segment_bytes: int,
             stats: SourceStats) -> Iterator[tuple[str, bytes]]:
    """The segments of text records ``(key, value)``; a value that is not a string is a skipped line."""
    for key, value in values:
        if not isinstance(value, str):
            stats.skipped_lines += 1
            continue
        for seg in segments_of(key, value.encode("utf-8"), segment_bytes):
            stats.bytes += len(seg[1])
            yield seg


def _jsonl(path: Path, key: str, text_field: str, segment_bytes: int,
           stats: SourceStats) -> Iterator[tuple[str, bytes]]:
    def values() -> Iterator[tuple[str, object]]:
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                yield f"{key}#{lineno}", record.get(text_field) if isinstance(record, dict) else None

    return _records(values(), segment_bytes, stats)


def _parquet(path: Path, key: str, text_field: str, segment_bytes: int,
             stats: SourceStats) -> Iterator[tuple[str, bytes]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path} is a Parquet file and reading it needs pyarrow: pip install pyarrow "
                        "(or convert it to .jsonl)") from None
    table = pq.ParquetFile(str(path))
    if text_field not in table.schema_arrow.names:
        raise UserError(f"{path} has no column data.text_field = {text_field!r} (columns: "
                        f"{', '.join(table.schema_arrow.names[:8])}); set data.text_field")

    def values() -> Iterator[tuple[str, object]]:
        row = 0
        for batch in table.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                yield f"{key}#{row}", value

    return _records(values(), segment_bytes, stats)


def _hf_dataset(path: Path, text_field: str, segment_bytes: int, stats: SourceStats) -> Iterator[tuple[str, bytes]]:
    try:
        from datasets import load_from_disk
    except ImportError:
        raise UserError(f"{path} is a Hugging Face datasets directory and reading it needs the datasets "
                        "package: pip install datasets") from None
    ds = load_from_disk(str(path))
    splits = ds.items() if hasattr(ds, "items") else [("", ds)]
    for name, part in splits:
        if text_field not in part.column_names:
            raise UserError(f"{path}: split {name or '(default)'} has no column data.text_field = {text_field!r}")
        stats.files += 1
        yield from _records(((f"{path.name}/{name}#{row}", value) for row, value in enumerate(part[text_field])),
                            segment_bytes, stats)


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


# ---- writing shards ------------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class _ShardWriter:
    """One split's shard files: appends tokens, starts a new file past ``shard_tokens``, renames each
    file into place when it is complete."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self._fh = None
        self._tmp: Path | None = None
        self._count = 0

    def add(self, tokens: np.ndarray) -> None:
        self.documents += 1
        # where this document starts in the open shard (None: in a shard not open yet or already closed)
        self._last_start = self._count if self._fh is not None else 0
        self._last_shard = len(self.shards)
        pos = 0
        while pos < len(tokens):
            if self._fh is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._tmp = self.out / f".{name}.tmp"
                self._fh = open(self._tmp, "wb")  # noqa: SIM115 - closed in _close
                self._count = 0
                self._name = name
            take = min(len(tokens) - pos, self.shard_tokens - self._count)
            self._fh.write(tokens[pos:pos + take].astype(self.dtype, copy=False).tobytes())
            self._count += take
            pos += take
            if self._count >= self.shard_tokens:
                self._close()

    def _close(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.out / self._name)
        self.shards.append({"file": self._name, "tokens": self._count})
        self._fh, self._count = None, 0

    def take_back_last(self) -> np.ndarray | None:
        """Remove the last document written, when it lies wholly in the open shard, and return its tokens
        (a corpus too small for its eval split gives its last train document to eval); else None."""
        if self._fh is None or self.documents == 0 or self._last_shard != len(self.shards):
            return None
        self._fh.flush()
        n = self._count - self._last_start
        with open(self._tmp, "rb") as fh:
            fh.seek(self._last_start * self.dtype.itemsize)
            tokens = np.frombuffer(fh.read(n * self.dtype.itemsize), dtype=self.dtype).astype(np.int64)
        self._fh.seek(self._last_start * self.dtype.itemsize)
        self._fh.truncate()
        self._count = self._last_start
        self.documents -= 1
        if self._count == 0:  # the shard held only that document
            self._fh.close()
            Path(self._tmp).unlink(missing_ok=True)
            self._fh = None
        return tokens

    def finish(self) -> list[dict]:
        self._close()
        return self.shards

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            Path(self._tmp).unlink(missing_ok=True)
            self._fh = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._count


@dataclass
class PrepareResult:
    out: Path
    train_tokens: int
    eval_tokens: int
    train_docs: int
    eval_docs: int
    files: int
    skipped_binary: int
    skipped_lines: int
    seconds: float
    peak_rss_mb: float


def prepare(paths: Sequence[str], out: Path, data_cfg, tokenizer, tokenizer_spec: str, *,
            shard_tokens: int = SHARD_TOKENS, on_progress: Callable[[int], None] | None = None) -> PrepareResult:
    """Write the token shards of ``paths`` into ``out`` (see the module docstring)."""
    import resource

    out = Path(out)
    if (out / INDEX).exists():
        raise UserError(f"--out {out} already holds prepared data ({INDEX}); remove it or choose another directory")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if shard_tokens < 1024:
        raise UserError(f"--shard-tokens {shard_tokens} is not allowed; use at least 1024")
    sources = [Path(p) for p in paths]
    hf_dirs = [p for p in sources if is_hf_dataset_dir(p)]
    rest = [str(p) for p in sources if p not in hf_dirs]
    files = discover_files(rest, [*data_cfg.extensions, ".parquet"]) if rest or not hf_dirs else []
    parents = [str(f.parent) for f in files]
    root = os.path.commonpath(parents) if parents else ""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out} cannot be created ({exc.strerror or exc})") from None
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _ShardWriter(out, s, dtype, shard_tokens) for s in ("train", "eval")}
    stats = SourceStats()
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    start = time.perf_counter()
    try:
        docs = iter_documents(files, root, data_cfg.text_field, SEGMENT_BYTES, stats)
        for hf in hf_dirs:
            docs = _chain(docs, _hf_dataset(hf, data_cfg.text_field, SEGMENT_BYTES, stats))
        for key, data in docs:
            split = "eval" if split_value(key, data_cfg.seed) < data_cfg.eval_fraction else "train"
            tokens = np.asarray(tokenize_bytes(tokenizer, data), dtype=np.int64)
            writers[split].add(np.concatenate([tokens, eos]))
            if on_progress is not None:
                on_progress(stats.bytes)
        if writers["eval"].documents == 0 and writers["train"].documents > 1:
            # Too few documents for data.eval_fraction to pick one: the last one goes to eval (the in-memory
            # loader takes the one with the smallest hash; streaming cannot go back to it).
            moved = writers["train"].take_back_last()
            if moved is not None:
                writers["eval"].add(moved)
        shards = {s: w.finish() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if not shards["train"] or not shards["eval"]:
        empty = "train" if not shards["train"] else "eval"
        raise UserError(f"the {empty} split of {', '.join(map(str, paths))} is empty ({writers['train'].documents} "
                        f"train and {writers['eval'].documents} eval documents or segments); add data or set "
                        "data.eval_fraction")
    index = {
        "format": FORMAT, "tokenizer": tokenizer_spec, "vocab_size": int(tokenizer.vocab_size),
        "eos_id": int(tokenizer.eos_id), "dtype": dtype.name, "seed": int(data_cfg.seed),
        "eval_fraction": float(data_cfg.eval_fraction), "segment_bytes": SEGMENT_BYTES,
        "splits": shards, "documents": {s: w.documents for s, w in writers.items()},
        "sources": [str(p) for p in paths], "files": stats.files, "skipped_binary": stats.skipped_binary,
        "skipped_lines": stats.skipped_lines, "bytes": stats.bytes,
    }

    atomic_write_text(out / INDEX, json.dumps(index, indent=1) + "\n")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return PrepareResult(out, writers["train"].tokens, writers["eval"].tokens, writers["train"].documents,
                         writers["eval"].documents, stats.files, stats.skipped_binary, stats.skipped_lines,
                         time.perf_counter() - start, peak)


def _chain(*iterators: Iterator) -> Iterator:
    for it in iterators:
        yield from it


# ---- reading shards ------------------------------------------------------------------------------

def is_prepared(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX).is_file()


def read_index(directory: Path) -> dict:
    try:
        index = json.loads((Path(directory) / INDEX).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{directory}/{INDEX} cannot be read ({exc}); prepare the data again with "
                        "'locoswarm data prepare'") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UserError(f"{directory}/{INDEX} is not a {FORMAT} index; prepare the data again with "
                        "'locoswarm data prepare'")
    return index


class ShardedTokens:
    """The tokens of one split of a prepared directory as one sequence (see the module docstring).

    ``len()``, ``[a:b]`` (a view), ``[index]`` with a 2-D index of contiguous rows (a batch of windows:
    ``starts[:, None] + arange(seq_len)``) -> an int32 tensor, like a 1-D token tensor."""

    def __init__(self, directory: Path, split: str, shards: list[dict], dtype: str,
                 start: int = 0, end: int | None = None, _fds: list[int] | None = None) -> None:
        self.directory, self.split = Path(directory), split
        self._shards = shards
        self._dtype = np.dtype(dtype)
        self._bounds = np.cumsum([0] + [int(s["tokens"]) for s in shards])
        if _fds is None:
            _fds = []
            for s in shards:
                path = self.directory / s["file"]
                try:
                    size = path.stat().st_size
                except OSError:
                    raise UserError(f"{path} is missing; prepare the data again") from None
                if size != int(s["tokens"]) * self._dtype.itemsize:
                    raise UserError(f"{path} has {size} bytes, not the {s['tokens']} tokens its index says; "
                                    "prepare the data again")
                _fds.append(os.open(path, os.O_RDONLY))
        self._fds = _fds
        self.start = start
        self.end = int(self._bounds[-1]) if end is None else end

    def __len__(self) -> int:
        return self.end - self.start

    def read(self, pos: int, count: int) -> np.ndarray:
        """``count`` tokens from position ``pos`` of this view, as int32."""
        if pos < 0 or pos + count > len(self):
            raise IndexError(f"tokens {pos}..{pos + count} outside 0..{len(self)}")
        out = np.empty(count, dtype=np.int32)
        at, done = self.start + pos, 0
        while done < count:
            k = int(np.searchsorted(self._bounds, at, side="right")) - 1
            offset = at - int(self._bounds[k])
            take = min(count - done, int(self._bounds[k + 1]) - at)
            raw = os.pread(self._fds[k], take * self._dtype.itemsize, offset * self._dtype.itemsize)
            out[done:done + take] = np.frombuffer(raw, dtype=self._dtype)
            done += take
            at += take
        return out

    def __getitem__(self, index):
        if isinstance(index, slice):
            a, b, step = index.indices(len(self))
            if step != 1:
                raise ValueError("only contiguous slices of token shards")
            return ShardedTokens(self.directory, self.split, self._shards, self._dtype.name,
                                 self.start + a, self.start + max(a, b), self._fds)
        index = torch.as_tensor(index)
        if index.dim() != 2:
            raise ValueError("index token shards with a [batch, seq_len] tensor of contiguous windows")
        starts, n = index[:, 0].tolist(), index.shape[1]
        rows = [self.read(int(s), n) for s in starts]
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, n), dtype=torch.int32)

    def __repr__(self) -> str:
        return f"ShardedTokens({self.directory}, {self.split}, {len(self):,} tokens)"


def load_prepared(directory: Path, tokenizer, tokenizer_spec: str) -> tuple[ShardedTokens, ShardedTokens, dict]:
    """The train and eval tokens of a prepared directory, checked against the swarm's tokenizer."""
    index = read_index(directory)
    if index.get("vocab_size") != tokenizer.vocab_size or index.get("eos_id") != tokenizer.eos_id:
        raise UserError(f"{directory} was prepared with tokenizer {index.get('tokenizer')!r} (vocabulary "
                        f"{index.get('vocab_size')}), not model.tokenizer = {tokenizer_spec!r} (vocabulary "
                        f"{tokenizer.vocab_size}); prepare it again with the swarm's peers.toml")
    splits = index.get("splits") or {}
    train = ShardedTokens(directory, "train", splits.get("train") or [], index["dtype"])
    eval_ = ShardedTokens(directory, "eval", splits.get("eval") or [], index["dtype"])
    return train, eval_, index
