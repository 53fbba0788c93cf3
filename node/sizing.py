"""Expected memory and step time of a node per model preset and GPU class (estimates, not measurements).

Used by ``locoswarm plan --preset P --gpu G`` (step time from the GPU instead of ``--step-time``) and
``locoswarm plan --sizes`` (the table of every preset on every GPU class). The model:

*Step time*: ``S = flops / (peak * mfu)`` with ``flops = tokens * (6 N + 6 L d T)``: 6 flops per
parameter per token for the forward and backward matmuls, plus causal attention's scores and values
(``6 L d T`` per token, half of the full ``12 L d T`` since the mask skips half). ``peak`` is the
GPU's dense bf16 tensor throughput from its datasheet and ``mfu`` (model flops utilization, default
``DEFAULT_MFU``) how much of it a training step reaches; small models and small batches reach less.

*Memory* (bytes on the training device, mixed precision with fp32 master weights):
weights 4N, gradients 4N, AdamW moments 8N; the outer state (phi, momentum, error-feedback residual:
12N) only with ``[outer] offload = "off"`` (by default a CUDA node keeps it in pinned host memory);
activations ``B T L (10 d + k d_ff)`` bytes with 16-bit
activations and no recomputation (Korthikanti et al. 2022 count ``34 s b h`` per layer for a 4h MLP,
i.e. ``10 h + 6 d_ff``; SwiGLU keeps one more d_ff-wide tensor, k = 8), plus the fp32 logits.
Allocator fragmentation and the CUDA context (~0.5-1 GiB) come on top.

None of this was measured on a GPU by this project (no GPU was available to it): treat the figures
as the order of magnitude to choose a preset and a batch by, and measure before relying on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from locoswarm.node.config import ModelSection
from locoswarm.node.errors import UserError

DEFAULT_MFU = 0.35
DEFAULT_TOKENS_PER_STEP = 32_768
GIB = 1024**3


@dataclass(frozen=True)
class GpuClass:
    name: str
    peak_tflops: float   # dense bf16 (fp16 where the GPU has no bf16) tensor throughput, datasheet
    memory_gib: float


GPUS: dict[str, GpuClass] = {g.name: g for g in (
    GpuClass("t4", 65.0, 16.0),
    GpuClass("l4", 121.0, 24.0),
    GpuClass("rtx4090", 165.0, 24.0),
    GpuClass("a100-40g", 312.0, 40.0),
    GpuClass("a100-80g", 312.0, 80.0),
    GpuClass("h100", 989.0, 80.0),
    GpuClass("h200", 989.0, 141.0),
)}


@dataclass(frozen=True)
class Sizing:
    preset: str
    arch: str
    params: int
    gpu: str
    tokens_per_step: int
    seq_len: int
    step_time_s: float
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    outer_gib: float          # 0 when the outer state is off the device (the default on CUDA)
    activations_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.outer_gib + self.activations_gib

    def fits(self) -> bool:
        """Fits the GPU with 10% to spare (context, fragmentation)."""
        return self.total_gib <= 0.9 * GPUS[self.gpu].memory_gib


def gpu_class(name: str) -> GpuClass:
    key = name.strip().lower()
    if key not in GPUS:
        raise UserError(f"--gpu {name!r} is not a GPU class this planner knows; choose one of {', '.join(GPUS)}")
    return GPUS[key]


def preset_params(preset: str, arch: str = "llama", vocab_size: int = 257) -> int:
    """Parameter count of ``preset`` (built on the meta device: no memory, no init)."""
    # lazy: locoswarm.node.model imports torch (~1 s, measured); this module does not
    from locoswarm.node.model import build_meta_model, count_params

    return count_params(build_meta_model(ModelSection(arch=arch, preset=preset), vocab_size))


def estimate(preset: str, gpu: str, *, arch: str = "llama", tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
             seq_len: int = 1024, mfu: float = DEFAULT_MFU, outer_on_device: bool = False,
             vocab_size: int = 257) -> Sizing:
    """The expected step time and memory of ``preset`` on ``gpu`` (see the module docstring)."""
    # lazy: locoswarm.node.model imports torch (~1 s, measured); this module does not
    from locoswarm.node.model import resolved_shape

    g = gpu_class(gpu)
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu} is not allowed; use a fraction in (0, 1], e.g. 0.35")
    if tokens_per_step < seq_len:
        raise UserError(f"--tokens-per-step {tokens_per_step} is less than one sequence of {seq_len}; "
                        "use at least seq_len tokens")
    section = ModelSection(arch=arch, preset=preset, max_seq_len=max(seq_len, 16))
    n_layers, d_model, _, d_ff = resolved_shape(section)
    n = preset_params(preset, arch, vocab_size)
    flops = tokens_per_step * (6.0 * n + 6.0 * n_layers * d_model * seq_len)
    step = flops / (g.peak_tflops * 1e12 * mfu)
    k = 8 if arch == "llama" else 6
    act = tokens_per_step * n_layers * (10 * d_model + k * d_ff) + tokens_per_step * vocab_size * 4
    return Sizing(preset=preset, arch=arch, params=n, gpu=g.name, tokens_per_step=tokens_per_step, seq_len=seq_len,
                  step_time_s=step, weights_gib=4 * n / GIB, grads_gib=4 * n / GIB, optimizer_gib=8 * n / GIB,
                  outer_gib=12 * n / GIB if outer_on_device else 0.0, activations_gib=act / GIB)


def sizes_table(presets: list[str], gpus: list[str], **kw) -> list[Sizing]:
    return [estimate(p, g, **kw) for p in presets for g in gpus]


__all__ = ["DEFAULT_MFU", "DEFAULT_TOKENS_PER_STEP", "GPUS", "GpuClass", "Sizing", "estimate", "gpu_class",
           "preset_params", "sizes_table"]
