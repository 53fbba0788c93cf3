"""Peak GPU memory of a 1-worker simulate run (inner steps + outer syncs) per preset and offload setting."""
import contextlib, io, json, sys, time
import torch
from node.cli import main

preset, offload, steps = sys.argv[1], sys.argv[2], sys.argv[3]
torch.cuda.is_available() and torch.cuda.reset_peak_memory_stats()
t = time.time()
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = main(["simulate", "--workers", "1", "--steps", steps, "--device", (sys.argv[4] if len(sys.argv) > 4 else "cuda"), "--data", "node",
               "--eval-every", steps, "--eval-batches", "2", "--set", f"model.preset={preset}",
               "--set", f"outer.offload={offload}", "--set", "outer.h=10", "--set", "outer.fragments=2"])
print(json.dumps({"preset": preset, "offload": offload, "rc": rc, "steps": int(steps),
                  "peak_gib": (torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None), "wall_s": round(time.time() - t, 1)}))
print(buf.getvalue()[-600:], file=sys.stderr)
