"""The data pipeline: tokenizers, file discovery, the train/eval split and sharded batches.

Everything here is deterministic and offline: every worker of a swarm derives the same split from
the same files and ``[data]`` settings, draws its training windows only from its own shard, and
evaluates on the same fixed windows, so losses of workers and methods are comparable.

Token tensors of a ``Corpus`` are 1-D **int16** when the vocabulary fits (the byte tokenizer's 257 ids:
the default 64 MB byte budget is 128 MB of tokens, a quarter of int64's 512 MB; a simulation shares them
between workers), else int32 (not uint16: most torch operations do not take it). Batches handed to the
model are int64 (``torch.long``), as embeddings and the loss require. Documents are tokenized into large
blocks (:class:`_TokenBlocks`), so that the many small per-document arrays do not stay behind in the heap
after the corpus is joined.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from locoswarm.node.config import DataSection
from locoswarm.node.errors import UserError

# ---------------------------------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus an end-of-document token 256.

    Needs no files and no download, works for every language and for code, and makes token counts
    equal byte counts, which keeps the data budget and throughput easy to reason about.
    """

    vocab_size = 257
    eos_id = 256
    spec = "bytes"  # its model.tokenizer value

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes to tokens without decoding (the fast path of the loader)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int16)

    def decode(self, ids) -> str:
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")

    def to_transformers(self):
        """The same tokenizer as a ``transformers`` fast tokenizer (ids 0..255 = bytes, 256 = eos), so an
        exported model loads with ``AutoTokenizer.from_pretrained`` and needs nothing of locoswarm.

        Built on the ``tokenizers`` library's byte-level pre-tokenizer, which shows each byte as one
        printable character (GPT-2's mapping); a BPE model without merges then maps each such character
        to its byte value, so encoding gives exactly ``encode`` and decoding joins the bytes again."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        shown = _byte_characters()
        vocab = {shown[b]: b for b in range(256)}
        vocab[EOS_TEXT] = self.eos_id
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token=EOS_TEXT,
                                       model_max_length=10**9, clean_up_tokenization_spaces=False)

    def save(self, directory: str | os.PathLike) -> None:
        self.to_transformers().save_pretrained(str(directory))


EOS_TEXT = "<|endoftext|>"


def _byte_characters() -> list[str]:
    """Byte value -> the printable character the byte-level pre-tokenizer shows it as: printable
    Latin-1 bytes as themselves, the other 68 (controls, space, soft hyphen, ...) as U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shown, extra = {}, 0
    for b in range(256):
        if b in printable:
            shown[b] = chr(b)
        else:
            shown[b] = chr(256 + extra)
            extra += 1
    return [shown[b] for b in range(256)]


class HFTokenizer:
    """A local ``transformers`` tokenizer behind the same small interface as ``ByteTokenizer``."""

    def __init__(self, tokenizer, path: str) -> None:
        self._tok = tokenizer
        self.spec = path  # its model.tokenizer value
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        if eos is None:
            eos = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.pad_token_id
        if eos is None:
            raise UserError(f"model.tokenizer = {path!r} defines no eos/sep/pad token; documents need an "
                            "end marker: add an eos_token to the tokenizer or use 'bytes'")
        self.eos_id = int(eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._tok.decode(values, skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        self._tok.save_pretrained(str(directory))


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'bytes' -> ByteTokenizer; otherwise a local tokenizer directory (never downloaded)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise UserError(f"model.tokenizer = {spec!r} is not a directory; use 'bytes' or a local "
                        "tokenizer directory (written by save_pretrained)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.tokenizer = {spec!r} could not be loaded: "
                        f"{str(exc).splitlines()[0]}") from None
    return HFTokenizer(tok, spec)


# ---------------------------------------------------------------------------------------------------
# Files

_GLOB_CHARS = frozenset("*?[")
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _walk(root: Path, extensions: frozenset[str], excluded: frozenset[str] = frozenset()) -> list[Path]:
    """Files under ``root`` with one of ``extensions``; hidden entries (.git, .cache, ...) and
    ``excluded`` directory names are pruned during the walk rather than filtered afterwards,
    so a huge site-packages costs nothing."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded]
        for name in filenames:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in extensions:
                out.append(Path(os.path.abspath(os.path.join(dirpath, name))))
    return out


def _normalize_extensions(extensions: Sequence[str]) -> frozenset[str]:
    return frozenset(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions)


def _expand(entry: str, extensions: frozenset[str]) -> list[Path]:
    path = Path(entry).expanduser()
    if path.is_file():
        return [Path(os.path.abspath(path))]
    if path.is_dir():
        files = _walk(path, extensions)
        if not files:
            raise UserError(f"data path {entry!r} has no files with extensions "
                            f"{', '.join(sorted(extensions))}; set data.extensions or name files")
        return files
    if _GLOB_CHARS & set(entry):
        # A glob is the user's own filter: matched files are taken as named, matched dirs are walked.
        out = []
        for match in glob.glob(str(path), recursive=True):
            m = Path(match)
            out.extend(_walk(m, extensions) if m.is_dir() else [Path(os.path.abspath(m))])
        if out:
            return out
        raise UserError(f"data path {entry!r} matches no files")
    raise UserError(f"data path {entry!r} does not exist; give files, directories or globs")


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def discover_files(paths: Sequence[str], extensions: Sequence[str]) -> list[Path]:
    """Expand files, directories (recursive, by extension) and globs into a sorted, unique list.

    With no paths, the Python standard library's ``*.py`` sources (without site-packages): real text
    that exists on every machine that can run the node, so a swarm can train with zero setup.
    """
    if not paths:
        files = _walk(stdlib_dir(), frozenset({".py"}), _EXCLUDED_STDLIB_DIRS)
        if not files:
            raise UserError(f"no data paths given and no Python sources found under {stdlib_dir()}; "
                            "pass data files or directories")
        return sorted(set(files))
    exts = _normalize_extensions(extensions)
    found: set[Path] = set()
    for entry in paths:
        found.update(_expand(str(entry), exts))
    return sorted(found)


# ---------------------------------------------------------------------------------------------------
# Corpus


SEGMENT_BYTES = 256 * 1024   # a longer document is split into segments of about this size (see _segments)
BINARY_PROBE = 64 * 1024      # bytes of a file looked at to tell text from binary
MAX_BAD_UTF8 = 0.02           # share of undecodable bytes beyond which a file is binary, not text
ODD_SPLIT = 2.0               # an eval share this many times off data.eval_fraction gets a warning


@dataclass
class Corpus:
    """Train and eval tokens (1-D int16 or int32, documents joined, each ending with eos; or, for a prepared
    directory, ``locoswarm.node.shards.ShardedTokens`` that read them from disk a window at a time) and counts.
    ``n_docs`` counts the split's units: documents, long ones cut into segments. ``warnings`` are
    one-line notes on the data the caller should show (skipped binary files, an odd split)."""

    train: torch.Tensor
    eval: torch.Tensor
    n_docs: int
    n_train_docs: int
    n_eval_docs: int
    n_files: int
    skipped_lines: int
    description: str
    skipped_binary: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The tuning split (``load_corpus(tune_fraction=...)``): training documents held out to pick settings,
    # so that the eval split is never looked at before the final runs. None when not asked for.
    tune: torch.Tensor | None = None
    n_tune_docs: int = 0


def is_binary(data: bytes) -> bool:
    """Whether ``data`` (a file's first bytes) is binary: a NUL byte, or more than ``MAX_BAD_UTF8``
    of it undecodable as UTF-8 (a multi-byte character cut at the end does not count)."""
    probe = data[:BINARY_PROBE]
    if b"\x00" in probe:
        return True
    bad = probe.decode("utf-8", errors="replace").count("\ufffd")
    return bad > max(4.0, MAX_BAD_UTF8 * len(probe))


def stream_segments(key: str, read: Callable[[int], bytes], size: int) -> Iterator[tuple[str, bytes]]:
    """The segments of one document read through ``read(n)``: the whole document when it is at most
    ``size`` bytes (key unchanged), else pieces of about ``size`` bytes keyed ``key@i``, each cut after a
    newline in its second half where there is one, else at a UTF-8 character boundary. The split hashes
    the pieces, so one big file no longer goes wholly to eval or wholly to train. At most ``2 * size``
    bytes are held at once (``locoswarm.node.shards`` streams files larger than memory through it)."""
    buf = bytearray()
    eof = False

    def fill() -> None:
        nonlocal eof
        while not eof and len(buf) <= size:
            block = read(size + 1 - len(buf))
            if not block:
                eof = True
            buf.extend(block)

    fill()
    if eof and len(buf) <= size:
        if buf:
            yield key, bytes(buf)
        return
    i = 0
    while buf:
        fill()
        end = len(buf)
        if end > size:
            end = size
            newline = buf.rfind(b"\n", size // 2, size)
            if newline >= 0:
                end = newline + 1
            else:
                while end > 1 and (buf[end] & 0xC0) == 0x80:  # not inside a multi-byte character
                    end -= 1
        yield f"{key}@{i}", bytes(buf[:end])
        del buf[:end]
        i += 1


def segments_of(key: str, data: bytes, size: int = SEGMENT_BYTES) -> Iterator[tuple[str, bytes]]:
    """``stream_segments`` of a document already in memory."""
    return stream_segments(key, io.BytesIO(data).read, size)


class _Reader:
    """Yields (key, bytes) documents in file order until the byte budget is spent.

    The key (path relative to the common root, plus the line number for .jsonl) is what the split
    hashes, so the split does not depend on where the data lives on each machine.
    """

    def __init__(self, files: list[Path], text_field: str, max_bytes: int) -> None:
        self.files = files
        self.text_field = text_field
        self.remaining = max_bytes
        self.skipped_lines = 0
        self.files_read = 0
        self.skipped_binary: list[str] = []
        parents = [str(f.parent) for f in files]
        self.root = os.path.commonpath(parents) if parents else ""

    def _take(self, data: bytes) -> bytes:
        data = data[: self.remaining]
        self.remaining -= len(data)
        return data

    def documents(self) -> Iterator[tuple[str, bytes]]:
        for path in self.files:
            if self.remaining <= 0:
                return
            self.files_read += 1
            key = Path(os.path.relpath(path, self.root)).as_posix()
            if path.suffix.lower() == ".jsonl":
                yield from self._jsonl(path, key)
            else:
                with open(path, "rb") as fh:
                    data = fh.read(self.remaining)
                if is_binary(data):
                    self.skipped_binary.append(key)  # not text: reading it would train on noise
                    continue
                data = self._take(data)
                if data:
                    yield from segments_of(key, data)

    def _jsonl(self, path: Path, key: str) -> Iterator[tuple[str, bytes]]:
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                if self.remaining <= 0:
                    return
                if not line.strip():
                    continue
                text = self._field(line)
                if text is None:
                    self.skipped_lines += 1
                    continue
                data = self._take(text.encode("utf-8"))
                if data:
                    yield from segments_of(f"{key}#{lineno}", data)

    def _field(self, line: bytes) -> str | None:
        try:
            record = json.loads(line)
        except ValueError:
            return None
        value = record.get(self.text_field) if isinstance(record, dict) else None
        return value if isinstance(value, str) else None


def split_value(key: str, seed: int, salt: str = "") -> float:
    """A uniform number in [0, 1) fixed by (document key, seed); another ``salt`` draws an independent
    number for the same document (the tuning split's rule, :data:`TUNE_SALT`)."""
    text = f"{seed}\0{key}" if not salt else f"{salt}\0{seed}\0{key}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


TUNE_SALT = "tune"  # the tuning split: the eval split's hash rule with this salt, on the training documents


def corpus_dtype(vocab_size: int) -> np.dtype:
    """How a corpus holds its tokens: int16 when every id fits, else int32 (a vocabulary below 2**31)."""
    return np.dtype(np.int16) if vocab_size <= 1 << 15 else np.dtype(np.int32)


def tokenize_bytes(tokenizer, data: bytes) -> np.ndarray:
    """``data``'s tokens in :func:`corpus_dtype`."""
    dtype = corpus_dtype(tokenizer.vocab_size)
    if hasattr(tokenizer, "encode_bytes"):
        return tokenizer.encode_bytes(data).astype(dtype, copy=False)
    return np.asarray(tokenizer.encode(data.decode("utf-8", errors="replace")), dtype=dtype)


class _TokenBlocks:
    """Documents' tokens, each copied into a large block (``BLOCK`` tokens, or the document's size) as it is
    read; :meth:`add` returns the document's view. A block is one allocation the allocator hands back to the
    system whole when the corpus is joined and the views are gone; a list of per-document arrays leaves
    its freed pieces in the heap (the default corpus: +250 MB of resident memory for 124 MB of tokens)."""

    BLOCK = 1 << 22

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self._block = np.empty(0, dtype=dtype)
        self._used = 0

    def add(self, tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        if self._used + n > len(self._block):
            self._block = np.empty(max(self.BLOCK, n), dtype=self.dtype)
            self._used = 0
        view = self._block[self._used:self._used + n]
        view[:] = tokens
        self._used += n
        return view


def _join(docs: list[np.ndarray], eos: int) -> torch.Tensor:
    """Concatenate documents, each followed by eos, into one tensor of their dtype (one allocation)."""
    out = np.empty(sum(len(d) + 1 for d in docs), dtype=docs[0].dtype if docs else np.int32)
    pos = 0
    for d in docs:
        out[pos: pos + len(d)] = d
        out[pos + len(d)] = eos
        pos += len(d) + 1
    return torch.from_numpy(out)


def _eval_mask(values: list[float], eval_fraction: float) -> list[bool]:
    """Docs whose hash is under eval_fraction go to eval; with >= 2 docs both sides get at least one."""
    mask = [v < eval_fraction for v in values]
    if len(values) >= 2:
        if not any(mask):
            mask[min(range(len(values)), key=values.__getitem__)] = True
        if all(mask):
            mask[max(range(len(values)), key=values.__getitem__)] = False
    return mask


def _name_paths(paths: Sequence[str]) -> str:
    named = [str(p) for p in paths] if paths else [f"{stdlib_dir()} (default)"]
    return ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")


def _prepared_dir(paths: Sequence[str]) -> Path | None:
    """The directory ``locoswarm data prepare`` wrote, where ``paths`` names exactly one (its ``index.json``)."""
    if len(paths) == 1 and (Path(paths[0]).expanduser() / "index.json").is_file():
        return Path(paths[0]).expanduser()
    return None


def _no_text(paths: Sequence[str], reader: _Reader, text_field: str) -> UserError:
    """The error for data paths whose files hold no document: what was passed over, and what is read."""
    binary = reader.skipped_binary
    return UserError(f"no text found in {_name_paths(paths)} (skipped {reader.skipped_lines} bad .jsonl lines"
                     + (f" and {len(binary)} binary file(s), e.g. {binary[0]!r}" if binary else "")
                     + f"; text field is data.text_field = {text_field!r}); give text files "
                       "(.txt, .md, source code, .jsonl)")


def check_data_paths(paths: Sequence[str], data_cfg: DataSection) -> None:
    """Raise the ``UserError`` that :func:`load_corpus` would for paths that do not exist, hold no files of
    the configured extensions or no text at all, reading only up to the first document: a node checks its
    data before it joins, and reads it after (a wrong swarm is told before a large corpus loads)."""
    if _prepared_dir(paths) is not None:  # a prepared directory's index is read by load_corpus
        return
    # The first document decides: a reader whose budget is one probe reads files in order only until one
    # holds text (binary files and bad .jsonl lines are passed over by the rules load_corpus applies).
    reader = _Reader(discover_files(paths, data_cfg.extensions), data_cfg.text_field,
                     min(data_cfg.max_bytes, BINARY_PROBE))
    if next(reader.documents(), None) is None:
        raise _no_text(paths, reader, data_cfg.text_field)


def load_corpus(paths: Sequence[str], data_cfg: DataSection, tokenizer, *,
                min_train_tokens: int = 2, tune_fraction: float = 0.0) -> Corpus:
    """Read, tokenize and split the corpus.

    Files are read in sorted order until ``data_cfg.max_bytes`` bytes of text (the last document is
    cut), so every worker with the same files and settings reads the same prefix. A document goes to
    eval iff blake2b(seed, key) < eval_fraction (see ``_eval_mask``). A corpus of exactly one document
    (shorter than one segment) is split by tokens instead: its last ``eval_fraction`` goes to eval. A
    document longer than ``SEGMENT_BYTES`` is split as several (``_segments``); binary files are skipped.
    ``min_train_tokens`` lets the caller require one batch worth of training tokens.

    ``tune_fraction > 0`` also carves a tuning split out of the *training* documents (a benchmark picks
    its settings on it, never on eval): a training document goes to tune iff blake2b(salt, seed, key) <
    tune_fraction with salt :data:`TUNE_SALT` (at least one when there are two training documents); it is
    then no longer trained on. A single training document, or a prepared directory (read by tokens, its
    documents are not listed), gives the last ``tune_fraction`` of the training tokens instead.
    """
    start = time.perf_counter()
    prepared = _prepared_dir(paths)
    if prepared is not None:
        corpus = _load_prepared(prepared, data_cfg, tokenizer, min_train_tokens, start)
        return _carve_tune_tail(corpus, tune_fraction) if tune_fraction > 0 else corpus
    files = discover_files(paths, data_cfg.extensions)
    reader = _Reader(files, data_cfg.text_field, data_cfg.max_bytes)
    keys, docs = [], []
    blocks = _TokenBlocks(corpus_dtype(tokenizer.vocab_size))
    for key, data in reader.documents():
        keys.append(key)
        docs.append(blocks.add(tokenize_bytes(tokenizer, data)))
    del blocks  # the views in docs keep the blocks they need
    where = _name_paths(paths)
    binary = reader.skipped_binary
    if not docs:
        raise _no_text(paths, reader, data_cfg.text_field)
    warnings = [f"skipped {len(binary)} binary file(s) (not UTF-8 text): {', '.join(binary[:3])}"
                + (" ..." if len(binary) > 3 else "")] if binary else []
    tune, n_tune_docs = None, 0
    if len(docs) == 1:
        train, eval_ = _split_single(docs[0], data_cfg.eval_fraction, tokenizer.eos_id)
        n_train_docs, n_eval_docs = 1, 0  # one document, split by tokens
    else:
        mask = _eval_mask([split_value(k, data_cfg.seed) for k in keys], data_cfg.eval_fraction)
        train_docs = [(k, d) for k, d, m in zip(keys, docs, mask, strict=True) if not m]
        eval_ = _join([d for d, m in zip(docs, mask, strict=True) if m], tokenizer.eos_id)
        if tune_fraction > 0 and len(train_docs) >= 2:
            tuned = _eval_mask([split_value(k, data_cfg.seed, TUNE_SALT) for k, _ in train_docs], tune_fraction)
            tune = _join([d for (_, d), m in zip(train_docs, tuned, strict=True) if m], tokenizer.eos_id)
            n_tune_docs = sum(tuned)
            train_docs = [kd for kd, m in zip(train_docs, tuned, strict=True) if not m]
        train = _join([d for _, d in train_docs], tokenizer.eos_id)
        n_eval_docs = sum(mask)
        n_train_docs = len(train_docs)
    if tune_fraction > 0 and tune is None:  # one training document: split by tokens
        cut = _tail_cut(len(train), tune_fraction)
        train, tune = train[:cut], train[cut:]
    if len(train) < max(min_train_tokens, 2) or len(eval_) < 2:
        raise UserError(f"corpus too small: {where} gives {len(train)} train and {len(eval_)} eval tokens, "
                        f"need at least {max(min_train_tokens, 2)} train tokens; add data or raise "
                        "data.max_bytes")
    share = len(eval_) / (len(train) + (len(tune) if tune is not None else 0) + len(eval_))
    if data_cfg.eval_fraction > 0 and not 1 / ODD_SPLIT <= share / data_cfg.eval_fraction <= ODD_SPLIT:
        warnings.append(f"the eval split holds {share:.1%} of the tokens, not the data.eval_fraction = "
                        f"{data_cfg.eval_fraction:g} asked for ({len(docs)} documents or segments are too few to "
                        "split finely): add data or set data.eval_fraction")
    seconds = time.perf_counter() - start
    n_bytes = data_cfg.max_bytes - reader.remaining
    tuned = f" / {n_tune_docs} tune" if n_tune_docs else ""
    split = ("1 doc split by tokens" if len(docs) == 1
             else f"{len(docs)} docs or segments ({n_train_docs} train{tuned} / {n_eval_docs} eval)")
    tune_tokens = f" + {len(tune):,} tune" if tune is not None else ""
    description = (f"{where}: {reader.files_read - len(binary)} files, {split}, {n_bytes / 1e6:.1f} MB, "
                   f"{len(train):,} train{tune_tokens} + {len(eval_):,} eval tokens, {reader.skipped_lines} "
                   "skipped lines" + (f", {len(binary)} binary files skipped" if binary else "") + f", {seconds:.1f} s")
    return Corpus(train=train, eval=eval_, n_docs=len(docs), n_train_docs=n_train_docs,
                  n_eval_docs=n_eval_docs, n_files=reader.files_read - len(binary),
                  skipped_lines=reader.skipped_lines, description=description, skipped_binary=binary,
                  warnings=warnings, tune=tune, n_tune_docs=n_tune_docs)


def _tail_cut(n_tokens: int, fraction: float) -> int:
    """Where the last ``fraction`` of ``n_tokens`` training tokens starts (at least one token each side)."""
    return min(max(1, n_tokens - max(1, round(n_tokens * fraction))), n_tokens - 1)


def _carve_tune_tail(corpus: Corpus, fraction: float) -> Corpus:
    """A prepared directory's tuning split: the last ``fraction`` of its training tokens (its documents
    are not listed, so they cannot be hashed one by one)."""
    import dataclasses

    cut = _tail_cut(len(corpus.train), fraction)
    return dataclasses.replace(corpus, train=corpus.train[:cut], tune=corpus.train[cut:],
                               description=f"{corpus.description}; tune = the last {len(corpus.train) - cut:,} "
                                           "train tokens")


def _load_prepared(directory: Path, data_cfg: DataSection, tokenizer, min_train_tokens: int,
                   start: float) -> Corpus:
    """A directory written by ``locoswarm data prepare``: its shards, read a window at a time."""
    # lazy: import circle (locoswarm.node.shards imports this module at its head)
    from locoswarm.node.shards import load_prepared

    train, eval_, index = load_prepared(directory, tokenizer, tokenizer.spec)
    if len(train) < max(min_train_tokens, 2):
        raise UserError(f"{directory} holds {len(train)} train tokens, need at least {max(min_train_tokens, 2)}")
    warnings = []
    if index.get("seed") != data_cfg.seed or index.get("eval_fraction") != data_cfg.eval_fraction:
        warnings.append(f"{directory} was split with data.seed = {index.get('seed')} and data.eval_fraction = "
                        f"{index.get('eval_fraction')}, not this config's {data_cfg.seed} and "
                        f"{data_cfg.eval_fraction}: its split is used as prepared")
    docs = index.get("documents", {})
    n_train, n_eval = int(docs.get("train", 0)), int(docs.get("eval", 0))
    shards = sum(len(v) for v in (index.get("splits") or {}).values())
    description = (f"{directory} (prepared, {shards} shards, read from disk): {index.get('files', 0)} files, "
                   f"{n_train + n_eval} docs or segments ({n_train} train / {n_eval} eval), "
                   f"{index.get('bytes', 0) / 1e6:.1f} MB, {len(train):,} train + {len(eval_):,} eval tokens, "
                   f"{time.perf_counter() - start:.1f} s")
    return Corpus(train=train, eval=eval_, n_docs=n_train + n_eval, n_train_docs=n_train, n_eval_docs=n_eval,
                  n_files=int(index.get("files", 0)), skipped_lines=int(index.get("skipped_lines", 0)),
                  description=description, warnings=warnings)


def _split_single(doc: np.ndarray, eval_fraction: float, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_eval = max(1, round(len(doc) * eval_fraction))
    cut = max(1, len(doc) - n_eval)
    return _join([doc[:cut]], eos), _join([doc[cut:]], eos)


# ---------------------------------------------------------------------------------------------------
# Batches


def _mix_seed(*parts: int) -> int:
    """A 63-bit generator seed from integers; hashing avoids correlated streams of nearby seeds."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


class TrainBatches:
    """Random training windows from this worker's own contiguous shard of the train tokens.

    Shards are disjoint, so workers of a swarm see different data (what data-parallel averaging
    assumes); a batch depends only on (seed, rank, step), so training resumes from a step counter
    without saving sampler state.
    """

    def __init__(self, tokens: torch.Tensor, rank: int, world_size: int, batch_size: int, seq_len: int,
                 seed: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank = {rank} with world size {world_size}; need 0 <= rank < world size")
        n = len(tokens)
        self.start, self.end = rank * n // world_size, (rank + 1) * n // world_size
        if self.end - self.start < seq_len:
            raise UserError(f"the train shard of worker {rank}/{world_size} has {self.end - self.start} "
                            f"tokens, fewer than inner.seq_len = {seq_len}; add data, raise "
                            "data.max_bytes, lower inner.seq_len or use fewer workers")
        self.shard = tokens[self.start: self.end]
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self._offsets = torch.arange(seq_len)

    def starts(self, step: int) -> torch.Tensor:
        """Window starts (relative to the shard) of the batch of ``step``."""
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, self.rank, step))
        high = len(self.shard) - self.seq_len + 1
        return torch.randint(0, high, (self.batch_size,), generator=gen)

    def get(self, step: int) -> torch.Tensor:
        """The [batch_size, seq_len] int64 batch of ``step``."""
        index = self.starts(step)[:, None] + self._offsets
        return self.shard[index].long()


def eval_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, n_batches: int) -> list[torch.Tensor]:
    """Fixed, evenly spaced windows over the eval tokens: the same for every worker and method."""
    if len(tokens) < seq_len:
        raise UserError(f"the eval split has {len(tokens)} tokens, fewer than inner.seq_len = {seq_len}; "
                        "raise data.eval_fraction, add data or lower inner.seq_len")
    n_windows = batch_size * n_batches
    # float64: float32 cannot hold positions past 2**24 exactly, and a rounded-up last start would read
    # past the end of an eval split of more than 16M tokens
    starts = torch.linspace(0, len(tokens) - seq_len, n_windows, dtype=torch.float64).round().long()
    starts = starts.clamp(max=len(tokens) - seq_len)
    windows = tokens[starts[:, None] + torch.arange(seq_len)].long()
    return list(windows.split(batch_size))


def judge_batches(tokens: torch.Tensor, sequences: int, seq_len: int, n_batches: int = 8) -> list[torch.Tensor]:
    """Held-out batches of the effect check (``locoswarm.node.core.judge``): ``n_batches`` of ``sequences``
    windows each, spread over the eval split halfway between the starts :func:`eval_batches` uses, so the
    batches a node judges results on are not the ones it reports its eval loss on."""
    if len(tokens) < seq_len:
        raise UserError(f"the eval split has {len(tokens)} tokens, fewer than inner.seq_len = {seq_len}; "
                        "raise data.eval_fraction, add data or lower inner.seq_len")
    n_windows = sequences * n_batches
    span = len(tokens) - seq_len
    starts = ((torch.arange(n_windows, dtype=torch.float64) + 0.5) * span / n_windows).round().long()
    starts = starts.clamp(min=0, max=span)
    # interleave, so each batch holds windows from all over the split
    order = torch.arange(n_windows).reshape(sequences, n_batches).t().reshape(-1)
    windows = tokens[starts[order][:, None] + torch.arange(seq_len)].long()
    return list(windows.split(sequences))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[torch.Tensor], device: torch.device | str) -> float:
    """Mean loss over ``batches`` in eval mode; the model's train/eval mode is restored afterwards."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for batch in batches:
            x = batch.to(device)
            total += float(model(input_ids=x, labels=x).loss)
        return total / len(batches)
    finally:
        model.train(was_training)
