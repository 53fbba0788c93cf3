"""Prepared token shards: ``locoswarm data prepare`` and the loader that reads them a window at a time."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from swarm_util import REPO

from locoswarm.node.config import DataSection
from locoswarm.node.data import ByteTokenizer, TrainBatches, eval_batches, load_corpus
from locoswarm.node.errors import UserError
from locoswarm.node.shards import INDEX, SHARD_TOKENS, ShardedTokens, prepare

pytestmark = pytest.mark.timeout(300)

WORDS = ["the", "swarm", "trains", "a", "model", "while", "peers", "come", "and", "go", "with", "ünïcödé", "✓"]


def _corpus(root: Path, docs: int, size: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        words, n = [], 0
        while n < size:
            w = rng.choice(WORDS)
            words.append(w + ("\n" if rng.random() < 0.1 else " "))
            n += len(w.encode()) + 1
        (root / f"doc{i:03d}.txt").write_text(f"document {i}\n" + "".join(words))
    return root


def _cfg(**kw) -> DataSection:
    return DataSection(**{"eval_fraction": 0.25, "seed": 3, "max_bytes": 10**9, **kw})


def test_prepared_shards_hold_exactly_the_in_memory_split(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", 24, 3000)
    cfg = _cfg()
    result = prepare([str(src)], tmp_path / "out", cfg, ByteTokenizer(), "bytes", shard_tokens=4096)
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["dtype"] == "uint16" and len(index["splits"]["train"]) > 5  # many shards of 4096 tokens
    memory = load_corpus([str(src)], cfg, ByteTokenizer())
    disk = load_corpus([str(tmp_path / "out")], cfg, ByteTokenizer())
    assert isinstance(disk.train, ShardedTokens) and "prepared" in disk.description
    assert 0 < memory.n_eval_docs < 24  # the natural split, no forced adjustment: the same rule on both
    assert (len(disk.train), len(disk.eval)) == (len(memory.train), len(memory.eval))
    assert (result.train_tokens, result.eval_tokens) == (len(memory.train), len(memory.eval))
    assert np.array_equal(disk.train.read(0, len(disk.train)), memory.train.numpy())
    assert np.array_equal(disk.eval.read(0, len(disk.eval)), memory.eval.numpy())
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_a_prepared_directorys_tuning_split_is_the_tail_of_its_training_tokens(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", 10, 5000)
    prepare([str(src)], tmp_path / "out", _cfg(), ByteTokenizer(), "bytes", shard_tokens=1024)
    plain = load_corpus([str(tmp_path / "out")], _cfg(), ByteTokenizer())
    tuned = load_corpus([str(tmp_path / "out")], _cfg(), ByteTokenizer(), tune_fraction=0.1)
    n = len(plain.train)
    assert len(tuned.tune) == round(0.1 * n) and len(tuned.train) + len(tuned.tune) == n
    assert np.array_equal(tuned.tune.read(0, len(tuned.tune)), plain.train.read(len(tuned.train), len(tuned.tune)))
    assert len(tuned.eval) == len(plain.eval) and "tune = the last" in tuned.description


def test_windows_across_shard_boundaries_and_batches_match_the_tensor(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", 10, 5000)
    prepare([str(src)], tmp_path / "out", _cfg(eval_fraction=0.2), ByteTokenizer(), "bytes", shard_tokens=1024)
    disk = load_corpus([str(tmp_path / "out")], _cfg(eval_fraction=0.2), ByteTokenizer())
    flat = torch.from_numpy(disk.train.read(0, len(disk.train)))
    starts = torch.tensor([0, 1000, 1023, 1024, 2040, len(flat) - 64])  # several cross a shard boundary
    index = starts[:, None] + torch.arange(64)
    assert torch.equal(disk.train[index], flat[index])
    view = disk.train[500:3000]
    assert len(view) == 2500 and torch.equal(view[index[:3]], flat[500:3000][index[:3]])
    for rank in range(3):  # a worker's batches are the same from disk as from memory: resumable by step
        a = TrainBatches(disk.train, rank, 3, 4, 32, seed=7)
        b = TrainBatches(flat, rank, 3, 4, 32, seed=7)
        assert all(torch.equal(a.get(s), b.get(s)) for s in (0, 1, 99))
    assert all(torch.equal(x, y) for x, y in zip(eval_batches(disk.eval, 2, 16, 3),
                                                  eval_batches(torch.from_numpy(disk.eval.read(0, len(disk.eval))),
                                                               2, 16, 3), strict=True))


def test_jsonl_sources_binary_skipped_and_bad_lines_counted(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    lines = [json.dumps({"text": f"record {i} " * 40}) for i in range(40)] + ["not json", json.dumps({"x": 1})]
    (src / "a.jsonl").write_text("\n".join(lines) + "\n")
    (src / "blob.txt").write_bytes(bytes(range(256)) * 64)
    result = prepare([str(src)], tmp_path / "out", _cfg(), ByteTokenizer(), "bytes")
    assert (result.files, result.skipped_binary, result.skipped_lines) == (2, 1, 2)
    assert result.train_docs + result.eval_docs == 40


def test_an_interrupted_prepare_leaves_no_index_and_no_temp_files(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", 12, 3000)

    class Failing(ByteTokenizer):
        calls = 0

        def encode_bytes(self, data: bytes) -> np.ndarray:
            Failing.calls += 1
            if Failing.calls == 8:
                raise KeyboardInterrupt
            return super().encode_bytes(data)

    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], tmp_path / "out", _cfg(), Failing(), "bytes", shard_tokens=2048)
    assert not (tmp_path / "out" / INDEX).exists()
    assert not list((tmp_path / "out").glob(".*.tmp"))
    with pytest.raises(UserError, match="has no files"):  # nothing there pretends to be a prepared corpus
        load_corpus([str(tmp_path / "out")], _cfg(), ByteTokenizer())


def test_a_corpus_too_small_for_its_eval_fraction_gives_its_last_document_to_eval(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", 3, 2000)
    result = prepare([str(src)], tmp_path / "out", _cfg(eval_fraction=0.001), ByteTokenizer(), "bytes")
    assert (result.train_docs, result.eval_docs) == (2, 1)
    disk = load_corpus([str(tmp_path / "out")], _cfg(eval_fraction=0.001), ByteTokenizer())
    assert ByteTokenizer().decode(disk.eval.read(0, 20)).startswith("document 2")


def test_refusals_are_clear(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", 8, 2000)
    prepare([str(src)], tmp_path / "out", _cfg(), ByteTokenizer(), "bytes")
    with pytest.raises(UserError, match="already holds prepared data"):
        prepare([str(src)], tmp_path / "out", _cfg(), ByteTokenizer(), "bytes")

    class Other(ByteTokenizer):
        vocab_size = 300

    with pytest.raises(UserError, match="prepared with tokenizer 'bytes'"):
        load_corpus([str(tmp_path / "out")], _cfg(), Other())
    shard = next((tmp_path / "out").glob("train-*.bin"))
    with open(shard, "ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(UserError, match=r"not the .* tokens its index says"):
        load_corpus([str(tmp_path / "out")], _cfg(), ByteTokenizer())


def test_eval_windows_stay_inside_an_eval_split_past_float32_precision() -> None:
    class Long:  # a 43.7M-token split: float32 positions round the last window past its end
        def __len__(self) -> int:
            return 43_700_791

        def __getitem__(self, index):
            assert int(index.max()) < len(self), int(index.max())
            return torch.zeros(index.shape, dtype=torch.int32)

    batches = eval_batches(Long(), 8, 128, 4)
    assert len(batches) == 4 and batches[0].shape == (8, 128)


def test_cli_default_shard_size_is_the_librarys() -> None:
    from locoswarm.node.commands.data import SHARD_TOKENS as CLI_DEFAULT

    assert CLI_DEFAULT == SHARD_TOKENS


def _prepare_cli(src: Path, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
    res = subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "data", "prepare", str(src), "--out", str(out),
                          "--shard-tokens", str(1 << 20)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr
    return res, float(res.stdout.split("peak memory ")[1].split(" MB")[0])


def test_memory_stays_flat_as_the_corpus_grows(tmp_path: Path) -> None:
    small = _corpus(tmp_path / "small", 4, 1_000_000)
    big = tmp_path / "big"
    big.mkdir()
    block = (small / "doc000.txt").read_bytes()
    for i in range(40):  # 10x the small corpus, one 40 MB file and a few more
        with open(big / f"part{i % 4}.txt", "ab") as fh:
            fh.write(block)
    _, rss_small = _prepare_cli(small, tmp_path / "out-small")
    res_big, rss_big = _prepare_cli(big, tmp_path / "out-big")
    assert res_big.stdout.startswith(f"prepared {tmp_path / 'out-big'}: 4 files")
    total = sum(s["tokens"] for s in json.loads((tmp_path / "out-big" / INDEX).read_text())["splits"]["train"])
    assert total > 25_000_000
    # 36 MB more text (290 MB more as int64 tokens) and not 20 MB more memory
    assert rss_big - rss_small < 20, (rss_small, rss_big)
    res = subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "data", "prepare", str(tmp_path / "nowhere"),
                          "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "nowhere" in res.stderr
