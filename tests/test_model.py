"""Model presets, deterministic init and device resolution."""

from __future__ import annotations

import pytest
import torch

from locoswarm.node.config import ModelSection
from locoswarm.node.errors import UserError
from locoswarm.node.model import (
    ARCHS,
    PRESET_TARGETS,
    build_meta_model,
    build_model,
    count_params,
    model_summary,
    resolve_device,
)

VOCAB = 257


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("preset", list(PRESET_TARGETS))
def test_preset_sizes_near_targets(arch: str, preset: str) -> None:
    # The meta device gives names and shapes without allocating 125M parameters.
    n = count_params(build_meta_model(ModelSection(arch=arch, preset=preset), VOCAB))
    target = PRESET_TARGETS[preset]
    assert 0.7 * target <= n <= 1.3 * target, (arch, preset, n)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_backward(arch: str) -> None:
    model = build_model(ModelSection(arch=arch, preset="tiny", max_seq_len=64), VOCAB, seed=1)
    x = torch.randint(0, VOCAB, (2, 32))
    loss = model(input_ids=x, labels=x).loss
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # ~ln(257) = 5.55 at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_init_is_deterministic_and_keeps_caller_rng(arch: str) -> None:
    cfg = ModelSection(arch=arch, preset="tiny")
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(cfg, VOCAB, seed=7)
    after = torch.rand(3)
    b = build_model(cfg, VOCAB, seed=7)
    c = build_model(cfg, VOCAB, seed=8)
    assert torch.equal(after, expected_next)  # caller's RNG stream untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_overrides_and_summary() -> None:
    cfg = ModelSection(arch="llama", preset="tiny", n_layers=2, d_model=64, n_heads=2, d_ff=96,
                       max_seq_len=256)
    model = build_model(cfg, VOCAB)
    summary = model_summary(model)
    assert summary == {"arch": "llama", "n_layers": 2, "d_model": 64, "n_params": count_params(model)}
    assert model.config.max_position_embeddings == 256
    assert model.config.intermediate_size == 96
    assert not model.config.tie_word_embeddings
    gpt = build_model(ModelSection(arch="gpt2", preset="tiny", max_seq_len=128), VOCAB)
    assert model_summary(gpt)["arch"] == "gpt2" and gpt.config.n_positions == 128


def test_bad_head_count() -> None:
    with pytest.raises(UserError, match="n_heads"):
        build_meta_model(ModelSection(preset="tiny", n_heads=3), VOCAB)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match="'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_every_model_preset_can_be_chosen_in_peers_toml(tmp_path) -> None:
    """The config's preset choices are the model's presets: a preset that the planner sizes (350m, 1b) is one a
    user can train, and a name the model lacks is refused by the config, not deep in the build."""
    from locoswarm.node.config import PRESET_NAMES, load_config
    from locoswarm.node.model import PRESETS

    assert tuple(PRESETS) == PRESET_NAMES
    for preset in PRESET_NAMES:
        (tmp_path / "peers.toml").write_text(f'[model]\npreset = "{preset}"\n')
        assert load_config(tmp_path / "peers.toml").model.preset == preset
    (tmp_path / "peers.toml").write_text('[model]\npreset = "7b"\n')
    with pytest.raises(Exception, match="7b"):
        load_config(tmp_path / "peers.toml")
