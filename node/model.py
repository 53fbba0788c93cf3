"""Model construction: size presets for Llama and GPT-2, deterministic init, device resolution.

Models are always built from ``transformers`` config classes, never downloaded: every peer of a swarm
must be able to build the exact same network offline from ``[model]`` alone. Initial weights depend
only on (config, vocab size, seed), so all workers start bit-identical without exchanging weights.

Parameter counts with the byte vocabulary (257), ``max_seq_len`` 1024 (GPT-2 counts include the
learned position table, 1024 x d_model):

=======  ===========  ===========  =======================================
preset   llama        gpt2         shape (layers / d_model / heads / d_ff)
=======  ===========  ===========  =======================================
tiny      1,115,520      957,312   4 / 128 / 4 / 512
small    25,961,984   25,875,968   8 / 512 / 8 / 1408 (llama), 2048 (gpt2)
125m    127,825,152  128,567,040   18 / 768 / 12 / 2048 (llama), 3072 (gpt2)
350m    360,246,272  354,008,064   28 / 1024 / 16 / 2816 (llama), 4096 (gpt2)
1b    1,028,741,120 1,009,793,024  20 / 2048 / 16 / 5632 (llama), 8192 (gpt2)
=======  ===========  ===========  =======================================

"125m" has 18 blocks rather than GPT-2 small's 12: with a 257-token vocabulary the embeddings are
almost free (0.2M instead of 38.6M), so the missing ~40M parameters have to come from depth. 18 blocks
also divide evenly into 1, 2, 3, 6, 9 or 18 fragments. "350m" is GPT-2 medium's width with 28 blocks
(1, 2, 4, 7, 14 or 28 fragments); "1b" is 20 blocks of width 2048 (head size 128; 1, 2, 4, 5, 10 or 20
fragments). ``locoswarm plan --preset P --gpu G`` estimates each preset's memory and step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from locoswarm.node.config import ModelSection
from locoswarm.node.errors import UserError


@dataclass(frozen=True)
class Shape:
    """The size of one preset; ``d_ff`` is per architecture (SwiGLU Llama uses ~8/3 x d_model)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff_llama: int
    d_ff_gpt2: int


PRESETS: dict[str, Shape] = {
    "tiny": Shape(n_layers=4, d_model=128, n_heads=4, d_ff_llama=512, d_ff_gpt2=512),
    "small": Shape(n_layers=8, d_model=512, n_heads=8, d_ff_llama=1408, d_ff_gpt2=2048),
    "125m": Shape(n_layers=18, d_model=768, n_heads=12, d_ff_llama=2048, d_ff_gpt2=3072),
    "350m": Shape(n_layers=28, d_model=1024, n_heads=16, d_ff_llama=2816, d_ff_gpt2=4096),
    "1b": Shape(n_layers=20, d_model=2048, n_heads=16, d_ff_llama=5632, d_ff_gpt2=8192),
}
ARCHS = ("llama", "gpt2")
# Target sizes of the presets, used by tests and docs.
PRESET_TARGETS: dict[str, int] = {"tiny": 1_000_000, "small": 25_000_000, "125m": 125_000_000,
                                  "350m": 350_000_000, "1b": 1_000_000_000}


def resolved_shape(cfg: ModelSection) -> tuple[int, int, int, int]:
    """(n_layers, d_model, n_heads, d_ff) after applying the non-zero overrides of ``cfg``."""
    if cfg.preset not in PRESETS:
        raise UserError(f"model.preset = {cfg.preset!r}; choose one of {', '.join(PRESETS)}")
    if cfg.arch not in ARCHS:
        raise UserError(f"model.arch = {cfg.arch!r}; choose one of {', '.join(ARCHS)}")
    shape = PRESETS[cfg.preset]
    n_layers = cfg.n_layers or shape.n_layers
    d_model = cfg.d_model or shape.d_model
    n_heads = cfg.n_heads or shape.n_heads
    d_ff = cfg.d_ff or (shape.d_ff_llama if cfg.arch == "llama" else shape.d_ff_gpt2)
    if d_model % n_heads:
        raise UserError(f"model.d_model = {d_model} is not divisible by model.n_heads = {n_heads}; "
                        "choose n_heads that divides d_model")
    return n_layers, d_model, n_heads, d_ff


def model_config(cfg: ModelSection, vocab_size: int):
    """The ``transformers`` config for ``cfg``: no dropout (every worker must see the same function),
    SDPA attention, no special token ids (the data pipeline owns eos; we never generate here)."""
    from transformers import GPT2Config, LlamaConfig

    n_layers, d_model, n_heads, d_ff = resolved_shape(cfg)
    common = {"vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": None,
              "pad_token_id": None, "attn_implementation": "sdpa"}
    if cfg.arch == "llama":
        return LlamaConfig(hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=n_layers,
                           num_attention_heads=n_heads, num_key_value_heads=n_heads,
                           max_position_embeddings=cfg.max_seq_len, attention_dropout=0.0,
                           tie_word_embeddings=False, **common)
    return GPT2Config(n_embd=d_model, n_inner=d_ff, n_layer=n_layers, n_head=n_heads,
                      n_positions=cfg.max_seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      **common)


def _instantiate(cfg: ModelSection, vocab_size: int) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    hf_cfg = model_config(cfg, vocab_size)
    cls = LlamaForCausalLM if cfg.arch == "llama" else GPT2LMHeadModel
    model = cls(hf_cfg)
    # GPT2LMHeadModel's class name does not map to a loss type; say it explicitly (same loss, no
    # "loss_type=None" warning on the first forward pass).
    model.loss_type = "ForCausalLM"
    return model


def build_model(cfg: ModelSection, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """Build the model on CPU in fp32 with weights that depend only on (cfg, vocab_size, seed).

    The global RNG is seeded inside ``fork_rng`` so that the caller's RNG stream (data sampling, other
    models of a simulation) is left exactly as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _instantiate(cfg, vocab_size)
    return model.float().train()


def build_meta_model(cfg: ModelSection, vocab_size: int) -> torch.nn.Module:
    """The same network on the ``meta`` device: names and shapes without memory or init cost
    (for partition tables and parameter counts of large presets)."""
    with torch.device("meta"):
        return _instantiate(cfg, vocab_size)


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def model_summary(model: torch.nn.Module) -> dict:
    """arch, n_layers, d_model and n_params of a model built here."""
    config = model.config
    arch = "gpt2" if config.model_type == "gpt2" else "llama"
    return {"arch": arch, "n_layers": int(config.num_hidden_layers), "d_model": int(config.hidden_size),
            "n_params": count_params(model)}


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda if available else cpu; 'cpu'; 'cuda' / 'cuda:N' (needs CUDA)."""
    allowed = "auto, cpu, cuda, cuda:N"
    value = (spec or "").strip().lower()
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if value == "cpu":
        return torch.device("cpu")
    if value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"device = {spec!r} but CUDA is not available on this machine; "
                            f"use one of {allowed} (e.g. 'cpu' or 'auto')")
        index = int(value[5:]) if ":" in value else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device = {spec!r} but only {torch.cuda.device_count()} CUDA device(s) "
                            f"exist; use one of {allowed}")
        return torch.device(value)
    raise UserError(f"device = {spec!r} is not a device; use one of {allowed}")
