"""The strided fragment partition."""

from __future__ import annotations

import argparse
import json

import pytest

from locoswarm.node.config import ModelSection
from locoswarm.node.errors import UserError
from locoswarm.node.model import build_meta_model, build_model
from locoswarm.node.partition import (
    block_index,
    fragment_params,
    partition,
    partition_json,
    partition_table,
)

VOCAB = 257


def _model(arch: str, n_layers: int = 6):
    return build_meta_model(ModelSection(arch=arch, preset="tiny", n_layers=n_layers), VOCAB)


def test_block_index() -> None:
    assert block_index("model.layers.12.self_attn.q_proj.weight") == 12
    assert block_index("transformer.h.3.attn.c_attn.bias") == 3
    assert block_index("module.model.layers.0.mlp.up_proj.weight") == 0
    assert block_index("model.embed_tokens.weight") is None
    assert block_index("lm_head.weight") is None
    assert block_index("transformer.ln_f.weight") is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("n_fragments", [1, 2, 3, 4, 6])
def test_partition_covers_every_parameter_once(arch: str, n_fragments: int) -> None:
    model = _model(arch)
    fragments = partition(model, n_fragments)
    named = list(model.named_parameters())
    names = [n for f in fragments for n in f.names]
    assert sorted(names) == sorted(n for n, _ in named) and len(set(names)) == len(names)
    assert sum(f.numel for f in fragments) == sum(p.numel() for _, p in named)
    order = {n: i for i, (n, _) in enumerate(named)}
    for f in fragments:
        assert [order[n] for n in f.names] == sorted(order[n] for n in f.names)
        # strided: block l in fragment l mod F
        assert all(block_index(n) % n_fragments == f.index for n in f.names if block_index(n) is not None)
        assert f.blocks == tuple(range(f.index, 6, n_fragments))
        params = fragment_params(model, f)
        assert [p.shape for p in params] == [dict(named)[n].shape for n in f.names]


@pytest.mark.parametrize(("arch", "embeddings", "tail"), [
    ("llama", ["model.embed_tokens.weight"], ["model.norm.weight", "lm_head.weight"]),
    ("gpt2", ["transformer.wte.weight", "transformer.wpe.weight"],
     ["transformer.ln_f.weight", "transformer.ln_f.bias"]),
])
@pytest.mark.parametrize("n_fragments", [2, 4])
def test_non_block_placement(arch: str, embeddings: list[str], tail: list[str], n_fragments: int) -> None:
    n_layers = 6
    fragments = partition(_model(arch, n_layers), n_fragments)
    where = {n: f.index for f in fragments for n in f.names}
    assert all(where[n] == 0 for n in embeddings)
    assert all(where[n] == (n_layers - 1) % n_fragments for n in tail)
    assert "lm_head.weight" not in where or arch == "llama"  # gpt2 ties the head to wte


@pytest.mark.parametrize("bad", [0, -1, 7])
def test_bad_fragment_count(bad: int) -> None:
    with pytest.raises(UserError, match=rf"outer.fragments = {bad} .* 6 decoder blocks; choose 1..6"):
        partition(_model("llama"), bad)


def test_table_and_json() -> None:
    model = build_model(ModelSection(preset="tiny"), VOCAB)
    fragments = partition(model, 2)
    table = partition_table(model, fragments)
    assert table.row_count == 3  # two fragments and the total
    data = json.loads(json.dumps(partition_json(fragments)))
    assert [d["blocks"] for d in data] == [[0, 2], [1, 3]]
    assert data[1]["names"][-1] == "lm_head.weight"


def test_cli_partition(capsys) -> None:
    from locoswarm.node.commands.partition import _handler

    args = argparse.Namespace(config=None, overrides=["outer.fragments=2"], json=True)
    assert _handler(args) == 0
    assert [d["index"] for d in json.loads(capsys.readouterr().out)] == [0, 1]
