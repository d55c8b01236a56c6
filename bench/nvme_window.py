"""NVMe reads per step against ``host_memory_limit``: what the engine reads back, against what the planner says.

What: two Llamas on the NVMe tier (every region on NVMe, the default ``optimizer_in_backward``), on CPU, each trained
for 5 steps at ``host_memory_limit`` = the engine's minimum window + ``x`` times the region bytes a step rewrites
(``x`` in ``--spares``; the plan's ``moved["nvme_write"]``). The host window is a cache of those regions: what it
keeps is not read again. Per run: the planner's reads per step (``moved["nvme_read"]``, which counts the share
``min(1, spare / rewritten)`` as kept: ``planning/terms.py`` ``nvme_kept_share``), the schedule's reads without a
cache (``moved["nvme_read_uncached"]``) and the engine's measured reads (``megatrain/nvme_read_bytes``, the median of
steps 2-5); and the run's peak RSS (``VmHWM``) against the plan's host RAM total (which counts what the window
caches up to the limit: ``planning/terms.py`` ``window_fill``).

Run:
    PYTHONPATH=. python bench/nvme_window.py            # ~4 minutes on 2 cores
Writes bench/results/nvme_window.json (``--out`` to change); the table is in docs/guide/planner.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import plan_vs_run as pvr  # noqa: E402  (the harness's model shapes, configurations and plan function)

CONFIGS = [pvr.config("d", "nvme", "32-true", "block", 1, 256), pvr.config("m", "nvme", "bf16-mixed", "block", 1, 512)]
SPARES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)


def worker(c: dict, limit: int, out: str) -> None:
    import lightning.pytorch as pl
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.testing import LM

    cfg = pvr.model_config(c)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation="sdpa")
    ids = torch.randint(0, cfg["vocab_size"], (5 * c["batch_size"], c["seq_len"]), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(dir=os.environ.get("MEGATRAIN_NVME_PATH")) as d:
        trainer = pl.Trainer(strategy=MegaTrainStrategy(**pvr.strategy_kwargs(c, d), host_memory_limit=limit),
                             accelerator="cpu", devices=1, max_steps=5, precision=c["precision"], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LM(model), DataLoader(TensorDataset(ids), batch_size=c["batch_size"]))
        hist = trainer.strategy.engine.history
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    Path(out).write_text(json.dumps({"reads": [h["megatrain/nvme_read_bytes"] for h in hist],
                                     "writes": [h["megatrain/nvme_write_bytes"] for h in hist], "vmhwm_bytes": hwm}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spares", type=float, nargs="*", default=list(SPARES),
                    help="host_memory_limit above the minimum window, as multiples of the bytes a step rewrites")
    ap.add_argument("--out", default=str(HERE / "results" / "nvme_window.json"))
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        name, limit, out = a.worker
        worker(next(c for c in CONFIGS if c["name"] == name), int(limit), out)
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    rows = []
    print(f"{'configuration':28} {'spare':>6} {'limit MB':>9} {'plan MB':>8} {'uncached MB':>11} {'run MB':>7} "
          f"{'run/plan':>8} {'plan GiB':>8} {'RSS GiB':>8} {'RSS/plan':>8}")
    for c in CONFIGS:
        base = pvr.plan_of(c)
        mw, rewritten = base.nvme_window["min_window"], base.moved["nvme_write"]
        for x in a.spares:
            limit = mw + int(x * rewritten) + (1 << 20 if x == 0 else 0)  # at the minimum: 1 MiB of slack
            p = pvr.plan_of(c, host_memory_limit=limit)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, __file__, "--worker", c["name"], str(limit), f.name], env=env,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
                got = json.loads(Path(f.name).read_text())
            run = statistics.median(got["reads"][1:])
            plan = p.moved["nvme_read"]
            ratio = run / plan if plan else (1.0 if run == 0 else float("inf"))
            rows.append(dict(name=c["name"], spare=x, limit_bytes=limit, min_window_bytes=mw, rewritten_bytes=rewritten,
                             plan_read_bytes=plan, uncached_read_bytes=p.moved["nvme_read_uncached"],
                             run_read_bytes=run, run_reads=got["reads"], run_write_bytes=statistics.median(got["writes"][1:]),
                             plan_write_bytes=p.moved["nvme_write"], ratio=ratio,
                             plan_host_bytes=p.host_bytes, peak_host_bytes=got["vmhwm_bytes"],
                             ram_ratio=got["vmhwm_bytes"] / p.host_bytes))
            print(f"{c['name']:28} {x:6.2f} {limit / 1e6:9.1f} {plan / 1e6:8.1f} {p.moved['nvme_read_uncached'] / 1e6:11.1f} "
                  f"{run / 1e6:7.1f} {ratio:8.2f} {p.host_bytes / 2**30:8.3f} {got['vmhwm_bytes'] / 2**30:8.3f} "
                  f"{got['vmhwm_bytes'] / p.host_bytes:8.2f}", flush=True)
    Path(a.out).write_text(json.dumps({"bench": "nvme_window", "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
