"""Peak GPU memory of a 1-worker simulate run (inner steps + outer syncs) per preset and offload setting."""
import contextlib
import io
import json
import sys
import time

import torch

from node.cli import main

preset, offload, steps = sys.argv[1], sys.argv[2], sys.argv[3]
device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats()
t = time.time()
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = main(["simulate", "--workers", "1", "--steps", steps, "--device", device, "--data", "node",
               "--eval-every", steps, "--eval-batches", "2", "--set", f"model.preset={preset}",
               "--set", f"outer.offload={offload}", "--set", "outer.h=10", "--set", "outer.fragments=2"])
peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
print(json.dumps({"preset": preset, "offload": offload, "rc": rc, "steps": int(steps), "peak_gib": peak,
                  "wall_s": round(time.time() - t, 1)}))
print(buf.getvalue()[-600:], file=sys.stderr)
