"""The timings of ``locoswarm bench codecs`` (``locoswarm.node.bench.codecs``, whose docstring says what is measured
and against what): torch, so the command imports this module when it runs, not when the command line is built."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from locoswarm.node.core.codecs import CODECS, Codec, get_codec
from locoswarm.node.core.sparse import SparseCodec
from locoswarm.node.errors import UserError

SPARSE_CHUNK, SPARSE_TOPK = 4096, 64  # the paper's settings, the [outer] sparse_* defaults


def parse_devices(spec: str) -> list[torch.device]:
    """``--devices``: auto, or a comma-separated list of cpu and cuda (one-line :class:`UserError` otherwise)."""
    if spec == "auto":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name not in ("cpu", "cuda"):
            raise UserError(f"--devices value {name!r} is not allowed; use cpu, cuda or auto (e.g. --devices cpu,cuda)")
        if name == "cuda" and not torch.cuda.is_available():
            raise UserError("--devices cuda: this machine has no CUDA device; use --devices cpu or auto")
        out.append(torch.device(name))
    if not out:
        raise UserError(f"--devices {spec!r} names no device; use cpu, cuda or auto")
    return out


def _best_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: allocator, kernel caches
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(numel: int, repeats: int, devices: list[torch.device], block_size: int = 64,
            progress: Callable[[str], None] | None = None) -> dict:
    """MB/s (of fp32 data) of a memory pass and of each codec's encode and decode, per device."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen) * 1e-3  # a pseudo-gradient's scale; finite
    mb = 4 * numel / 1e6
    results: dict[str, dict] = {}
    for device in devices:
        x = base.to(device)
        memory = mb / _best_seconds(lambda x=x: x.clone(), repeats, device)
        buffer = torch.empty_like(x)
        copy = mb / _best_seconds(lambda x=x, buffer=buffer: buffer.copy_(x), repeats, device)
        references = _references(base, x, memory, repeats, device)
        acc = torch.zeros(numel, dtype=torch.float32, device=device)
        rows: dict[str, dict] = {}
        # SparseLoCo's codec at the paper's chunk 4096 / top-64, 2 bits (its encode includes the top-k)
        codecs: dict[str, Codec] = {name: get_codec(name, block_size) for name in CODECS}
        codecs["sparseloco"] = SparseCodec(SPARSE_CHUNK, SPARSE_TOPK)
        for name, codec in codecs.items():
            if progress is not None:
                progress(f"{device.type} {name}")
            data = codec.encode(x)
            enc = mb / _best_seconds(lambda codec=codec, x=x: codec.encode(x), repeats, device)
            if device.type == "cpu":
                dec = mb / _best_seconds(lambda codec=codec, data=data: codec.decode(data, numel), repeats, device)
            else:  # the receiver's path on a GPU: into the device's accumulator
                def into_acc(codec=codec, data=data, acc=acc) -> None:
                    codec.decode_accumulate(data, numel, acc)
                dec = mb / _best_seconds(into_acc, repeats, device)
            rows[name] = {"encode_mb_s": enc, "decode_mb_s": dec,
                          "encode_ratio": enc / references["encode"]["mb_s"],
                          "decode_ratio": dec / references["decode"]["mb_s"],
                          "encode_vs_memory": enc / memory, "decode_vs_memory": dec / memory,
                          "wire_bytes": len(data), "bits_per_element": 8 * len(data) / numel}
        results[device.type] = {"memory_pass_mb_s": memory, "copy_into_buffer_mb_s": copy,
                                "references": references, "codecs": rows}
    return results


def _references(base: torch.Tensor, x: torch.Tensor, memory: float, repeats: int,
                device: torch.device) -> dict[str, dict]:
    """What each direction is compared with: the memory pass on the CPU; on a GPU the fp32 tensor's own trip
    across the bus, which the wire (host bytes) makes unavoidable: device to host for encode, host to device
    for decode."""
    if device.type == "cpu":
        return {d: {"what": "memory pass (clone)", "mb_s": memory} for d in ("encode", "decode")}
    mb = 4 * x.numel() / 1e6
    host = base.clone()
    return {"encode": {"what": "device-to-host copy of the fp32 tensor (x.cpu())",
                       "mb_s": mb / _best_seconds(lambda: x.cpu(), repeats, device)},
            "decode": {"what": "host-to-device copy of the fp32 tensor (x.to(device))",
                       "mb_s": mb / _best_seconds(lambda: host.to(device), repeats, device)}}
