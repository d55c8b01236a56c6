"""Step time and kept activations of each recompute policy against plain PyTorch.

What: bench/overhead.py's rows for the recompute policies, in one process on the same model and batch
(SmolLM2-135M shape, fp32, batch 1 x 512 by default; every overhead.py option passes through):
plain PyTorch + Hugging Face activation checkpointing + fused AdamW (the standard recipe when memory
is short), plain PyTorch without checkpointing, and strategy="megatrain" with recompute="block",
"selective", "none", "auto" and "auto" with activation_memory_limit = 25% of what "none" kept. Per row: median step seconds, ratio to the checkpointed baseline and to
plain without checkpointing, activations kept per token (bytes), and the engine's recompute seconds.

Targets: selective or auto <= 0.95 x the checkpointed baseline; none <= 1.05 x
plain without checkpointing; auto at 25% of none within its limit (the engine's meter; on CUDA compare
the device peaks) and no slower than block (printed by overhead.py as PASS/FAIL).

Run:
    python bench/recompute_policy.py                                  # full size, CPU (several minutes)
    python bench/recompute_policy.py --rounds 3 --isolate --configs baseline,plain,block,copy,selective,none,auto,auto25,block_g4,copy_g4,none_g4
                                          # the recorded run: 3 interleaved rounds, a fresh process per row (~30 min)
    python bench/recompute_policy.py --layers 4 --seq 128 --steps 2 --warmup 1   # smoke run
    python bench/recompute_policy.py --device cuda --batch 8 --seq 1024 --layers 16 --hidden 2048 \\
        --intermediate 5632 --heads 16 --kv-heads 16 --vocab 32000
Writes bench/results/recompute_policy.json (overhead.py's JSON plus a compact table).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(HERE, "results", "recompute_policy.json")
argv = sys.argv[1:]
if "--out" in argv:
    out = argv[argv.index("--out") + 1]
else:
    argv += ["--out", out]
if "--configs" not in argv:
    argv += ["--configs", "baseline,plain,block,selective,none,auto,auto25"]
sys.argv = [os.path.join(HERE, "overhead.py"), *argv]
runpy.run_path(sys.argv[0], run_name="__main__")

with open(out) as f:
    res = json.load(f)
tok = res["args"]["batch"] * res["args"]["seq"]
print(f"\nrecompute policies ({tok} tokens/step): step time and activations kept between forward and backward")
print(f"{'row':40s} {'step s':>7s} {'vs ckpt':>7s} {'vs plain':>8s} {'kept B/token':>12s} {'recompute s':>11s}")
table = []
for r in res["rows"]:
    row = {"row": r["name"], "step_s": r["median_s"], "ratio_ckpt": r["ratio"], "ratio_plain": r.get("ratio_plain"),
           "saved_bytes_per_token": r["saved_bytes_per_token"], "recompute_s": r["engine_recompute_s"]}
    table.append(row)
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{row['row']:40s} {row['step_s']:7.3f} {row['ratio_ckpt']:7.3f} {f(row['ratio_plain'], '8.3f'):>8s} "
          f"{f(row['saved_bytes_per_token'], '12.0f'):>12s} {f(row['recompute_s'], '11.3f'):>11s}")
res["bench"], res["table"] = "recompute_policy", table
with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
print(f"wrote {out}")
