"""The engine's fixed CPU time per block call and per step, outside the compute: what the planner's step time adds
on a CPU device (``hardware.block_call_ms``, ``hardware.step_overhead_ms``; ``conf/hardware/this_machine.yaml``).

What: Llama models too small to compute anything (hidden 32, 16 tokens) of ``--shallow`` and ``--deep`` decoder
layers, trained with ``Trainer(strategy=MegaTrainStrategy(), accelerator="cpu")`` (RAM tier, ``recompute="block"``,
fp32, or ``--precision bf16-mixed``) for ``--steps`` steps after 2 warm-up steps; the step time is the median of the steps (one
``on_train_batch_start`` to the next). A step of L layers makes L + 2 forward block calls (embedding, layers, LM
head), L recomputes and L + 2 backward calls. The difference of the two depths' step times over the difference of
their block calls is the cost of one block call (acquire, bind, run, record, release, the workers' hand-offs:
Python, with the compute ~0); the shallow step minus its calls at that cost is the per-step cost (Lightning's loop,
the optimizer step's bookkeeping, the hooks). Each depth runs ``--rounds`` times, interleaved, each in a fresh
process; medians. Units: milliseconds.

    PYTHONPATH=. python bench/block_overhead.py            # writes bench/results/block_overhead.json
    PYTHONPATH=. python bench/block_overhead.py --precision bf16-mixed   # block_overhead_bf16-mixed.json

Measured on the 2-core development box: fp32 1.09 ms per call and 12.4 ms per step; bf16-mixed 1.59 ms and 5.0 ms
(per step of 16 calls about the same, 30 ms; the preset keeps the fp32 figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def calls(layers: int) -> int:
    """Block calls of one ``recompute="block"`` step: forward L + 2, recompute L, backward L + 2."""
    return 3 * layers + 4


def worker(layers: int, steps: int, out: str, precision: str = "32-true") -> None:
    import lightning.pytorch as pl
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.testing import LM
    from plan_vs_run import step_timer  # bench/, the script's own folder

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type="llama", hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                            vocab_size=64, use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (steps + 2, 16))
    timer = step_timer()
    trainer = pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", max_steps=steps + 2, logger=False,
                         precision=precision,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer])
    trainer.fit(LM(model), DataLoader(TensorDataset(ids), batch_size=1))
    dt = [b - a for a, b in zip(timer.t, timer.t[1:])][2:]
    Path(out).write_text(json.dumps({"step_s": statistics.median(dt), "steps_s": dt}))


def run(layers: int, steps: int, precision: str = "32-true") -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent.parent),
                                                                          os.environ.get("PYTHONPATH")]))}
        r = subprocess.run([sys.executable, str(HERE), "--worker", str(layers), "--steps", str(steps), "--out", out,
                            "--precision", precision],
                           env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{layers} layers: {r.stderr[-2000:]}")
        return json.loads(Path(out).read_text())["step_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shallow", type=int, default=2)
    ap.add_argument("--deep", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="32-true", help="Trainer(precision=...): 32-true or bf16-mixed")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="default: bench/results/block_overhead[_<precision>].json")
    a = ap.parse_args(argv)
    if a.out is None:
        suffix = "" if a.precision == "32-true" else f"_{a.precision}"
        a.out = str(HERE.parent / "results" / f"block_overhead{suffix}.json")
    if a.worker is not None:
        worker(a.worker, a.steps, a.out, a.precision)
        return 0
    times: dict[int, list[float]] = {a.shallow: [], a.deep: []}
    for _ in range(a.rounds):
        for layers in times:
            times[layers].append(run(layers, a.steps, a.precision))
    ts, td = (statistics.median(times[k]) for k in (a.shallow, a.deep))
    per_call = (td - ts) / (calls(a.deep) - calls(a.shallow))
    per_step = ts - calls(a.shallow) * per_call
    import torch

    res = {"bench": "block_overhead", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "args": vars(a), "step_s": {str(k): v for k, v in times.items()},
           "block_call_ms": 1e3 * per_call, "step_overhead_ms": 1e3 * per_step}
    print(f"{a.shallow} layers: {ts * 1e3:.1f} ms/step ({calls(a.shallow)} block calls); {a.deep} layers: "
          f"{td * 1e3:.1f} ms/step ({calls(a.deep)} calls)")
    print(f"block_call_ms: {per_call * 1e3:.2f}    step_overhead_ms: {per_step * 1e3:.1f}")
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
