"""``locoswarm bench codecs``: encode/decode speed of every payload codec next to a plain memory pass.

A sync encodes a whole fragment's pseudo-gradient and decodes every peer's part, on the training
thread's time, so a codec far slower than memory costs steps. This benchmark measures, per device and
codec, the throughput of ``encode`` (fp32 tensor in, wire bytes out) and of ``decode`` (wire bytes in,
fp32 tensor out) in MB/s of fp32 data, and divides it by a memory pass over the same tensor measured in
the same run (``clone``: read 4 bytes, write 4 bytes per element): a ratio of 1 is as fast as copying the
tensor once. On CUDA the wire bytes live in host memory, so an encode must bring its result to the host and
a decode into a device accumulator (``decode_accumulate``, the receiver's path) must take the bytes to the
device: there the references are the fp32 tensor's own copy across the bus (device to host for encode, host
to device for decode), and the device's memory pass is reported beside them. Each figure is the best of
``--repeats`` timed runs after a warm-up, with ``--threads`` intra-op threads (1 by default: the codecs run
beside training, which owns the other cores).

Writes ``results.json``, ``report.md`` and ``codecs.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from locoswarm.node.bench import write_png
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text
from locoswarm.node.helptext import describe

#: The issue's bar: every codec at least this fraction of a memory pass.
TARGET_RATIO = 0.5


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codecs", help="encode/decode MB/s of every codec next to a memory pass (JSON + md + PNG)",
                       description=describe(__doc__))
    p.add_argument("--out", required=True, help="report directory (results.json, report.md, codecs.png)")
    p.add_argument("--numel", type=int, default=10_000_000, help="elements of the test tensor (default 10M)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the best is kept (default 5)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--devices", default="auto",
                   help="comma-separated devices, e.g. cpu,cuda (default auto: cpu, and cuda where there is one)")
    p.add_argument("--block-size", type=int, default=64, help="elements per scale of the block codecs (default 64)")
    p.set_defaults(func=main)


def render_markdown(report: dict) -> str:
    s = report["setup"]
    lines = ["# Codec speed", "",
             f"{s['numel']:,} fp32 elements (a {4 * s['numel'] / 1e6:.0f} MB pseudo-gradient), best of "
             f"{s['repeats']} runs, {s['threads']} intra-op thread(s), block size {s['block_size']}; torch "
             f"{s['torch']} on {s['machine']}. MB/s are of fp32 data (4 bytes per element) in and out; the ratio "
             f"is to a reference measured over the same tensor in the same run: on the CPU a memory pass (`clone`: a "
             f"new tensor, read and written once); on a GPU, whose codecs turn a device tensor into host bytes and "
             f"host bytes into a device accumulator, the fp32 tensor's own copy across the bus. The bar is "
             f"{TARGET_RATIO:g}.", ""]
    for dev, r in report["results"].items():
        refs = r.get("references") or {d: {"what": "memory pass (clone)", "mb_s": r["memory_pass_mb_s"]}
                                       for d in ("encode", "decode")}  # a report written before references
        lines += [f"## {dev}: memory pass {r['memory_pass_mb_s']:.0f} MB/s", "",
                  f"(A copy into an existing buffer, no allocation: {r['copy_into_buffer_mb_s']:.0f} MB/s; every "
                  f"codec returns new memory, as `clone` does.) References: encode, {refs['encode']['what']}, "
                  f"{refs['encode']['mb_s']:.0f} MB/s; decode, {refs['decode']['what']}, "
                  f"{refs['decode']['mb_s']:.0f} MB/s.", "",
                  "| codec | bits/elem | encode MB/s | encode / reference | decode MB/s | decode / reference | "
                  "encode, decode / memory pass |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, c in r["codecs"].items():
            def mark(ratio: float) -> str:
                return f"{ratio:.2f}" + ("" if ratio >= TARGET_RATIO else " (below)")
            vs_memory = (f"{c['encode_vs_memory']:.2f}, {c['decode_vs_memory']:.2f}" if "encode_vs_memory" in c
                         else "-")
            lines.append(f"| {name} | {c['bits_per_element']:.2f} | {c['encode_mb_s']:.0f} | "
                         f"{mark(c['encode_ratio'])} | {c['decode_mb_s']:.0f} | {mark(c['decode_ratio'])} | "
                         f"{vs_memory} |")
        lines.append("")
    lines += ["![codec speed](codecs.png)", "",
              f"Reproduce: `locoswarm bench codecs --out DIR --numel {s['numel']} --threads {s['threads']}`", ""]
    return "\n".join(lines)


def plot(path: Path, report: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devs = list(report["results"])
    fig, axes = plt.subplots(1, len(devs), figsize=(6.5 * len(devs), 4.2), squeeze=False)
    for ax, dev in zip(axes[0], devs, strict=True):
        r = report["results"][dev]
        names = list(r["codecs"])
        pos = range(len(names))
        ax.bar([p - 0.2 for p in pos], [r["codecs"][n]["encode_ratio"] for n in names], 0.4, label="encode")
        ax.bar([p + 0.2 for p in pos], [r["codecs"][n]["decode_ratio"] for n in names], 0.4, label="decode")
        ax.axhline(1.0, color="k", lw=1, label="reference (cpu: memory pass; gpu: copy across the bus)")
        ax.axhline(TARGET_RATIO, color="tab:red", lw=1, ls="--", label=f"bar ({TARGET_RATIO:g})")
        ax.set_xticks(list(pos), names)
        ax.set_ylabel("throughput / reference")
        ax.set_title(f"{dev}: codec speed")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    write_png(fig, path)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    for flag, value, low in (("--numel", args.numel, 1), ("--repeats", args.repeats, 1), ("--threads", args.threads, 1),
                             ("--block-size", args.block_size, 1)):
        if value < low:
            raise UserError(f"{flag} {value} is not allowed; use a positive integer")
    # lazy: torch, and bench.codec_speed imports it (~1 s, measured); this module does not
    import torch

    from locoswarm.node.bench.codec_speed import measure, parse_devices

    devices = parse_devices(args.devices)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create the report directory ({exc.strerror}); choose a writable path") \
            from None
    console = Console(stderr=True)
    torch.set_num_threads(args.threads)
    with console.status("measuring") as status:
        results = measure(args.numel, args.repeats, devices, args.block_size,
                          progress=lambda what: status.update(f"measuring {what}"))
    report = {"setup": {"numel": args.numel, "repeats": args.repeats, "threads": args.threads,
                        "block_size": args.block_size, "torch": torch.__version__,
                        "machine": f"{platform.machine()} {platform.processor() or platform.system()}"},
              "target_ratio": TARGET_RATIO, "results": results}
    atomic_write_text(out / "results.json", json.dumps(report, indent=1) + "\n")
    atomic_write_text(out / "report.md", render_markdown(report))
    plot(out / "codecs.png", report)
    for dev, r in results.items():
        worst = min(min(c["encode_ratio"], c["decode_ratio"]) for c in r["codecs"].values())
        console.print(f"{dev}: memory pass {r['memory_pass_mb_s']:.0f} MB/s; slowest codec direction at "
                      f"{worst:.2f} of its reference")
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'codecs.png'}")
    return 0
