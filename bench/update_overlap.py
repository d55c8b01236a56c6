"""Host update hidden behind the backward and the next forward: step time with an injected delay per slab update.

What: a small Llama (``make_model("llama")``, ``--layers`` decoder layers, hidden ``--hidden``) trained with
``Trainer(strategy="megatrain")`` on CPU (RAM tier). Each slab's host update (``HostAdamW._update``) is made
``d`` seconds longer by a ``time.sleep(d)`` before it (the injected delay stands for a host update slower than the
device's compute, as for a 70B model on one GPU; a sleep takes no CPU, so the measurement is of the schedule, not of
CPU contention). With N slab updates per step and a step of ``base`` seconds without delay (forward + backward +
Lightning's own work), a schedule that hides the updates behind the backward and the next forward grows the step by
at most ``max(0, N*d - base)`` plus what cannot be hidden (the first block's update: its gradients complete last and
the next forward needs it first); a schedule that waits for every update grows it by ``N*d``.

Rows: for each schedule (``deferred``: the default, updates from the next forward on, clipping-compatible;
``in_backward``: ``optimizer_in_backward=True``, updates from the moment a slab's gradients are complete), each
``update_threads`` (1 and 2: slabs updated at once; the base step of each shows what a second thread costs or saves
with the real updates on this machine) and each delay (``N*d`` = 0.5, 1.0 and 2.0 x base, ``d`` from the median
of three base runs first): ``--rounds`` rounds of a base run and one run per delay, each run the median step time
over ``--steps`` steps after ``--warmup``. The growth is the median over rounds of a run's step time less its
round's base run (the machine's speed drifts by up to a third over a minute here); the bound is
``max(0, N*d - base) + 0.10 x base`` (base: the median base run), PASS when the growth is within it. ``deferred``
can hide the updates only behind the forward and is listed for comparison. docs/benchmarks.md, "Host update
overlap", has the table and why ``N*d`` = base exceeds the bound with one update thread.

Run:
    python bench/update_overlap.py              # ~12 minutes on 2 cores
    python bench/update_overlap.py --device cuda --rounds 2 --schedules in_backward   # bench/gpu_check_extra.py
Writes bench/results/update_overlap.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.optim.host_adamw import HostAdamW
from megatrain_lightning.testing import LM, make_data, make_model

HIDE_MARGIN = 0.10  # of the base step
FACTORS = (0.5, 1.0, 2.0)  # N*d / base
CONFIGS = (("in_backward", 1), ("in_backward", 2), ("deferred", 1), ("deferred", 2))  # schedule, update_threads


class StepTimer(pl.Callback):
    """Seconds between consecutive ``on_train_batch_start`` calls (one optimizer step each, no accumulation); with
    ``cuda`` the device is synchronized first, so a step's queued GPU work counts in it."""

    def __init__(self, cuda: bool = False) -> None:
        self.starts: list[float] = []
        self.cuda = cuda

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.cuda:
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def steps(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])][warmup:]


def run(schedule: str, threads: int, delay: float, args: argparse.Namespace) -> tuple[float, int]:
    """Median step time (s) of one training run and the slab updates per step."""
    updates = [0]
    original = HostAdamW._update

    def delayed(self, slab, pend):
        updates[0] += 1
        if delay:
            time.sleep(delay)
        original(self, slab, pend)

    HostAdamW._update = delayed  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        model = make_model("llama", num_hidden_layers=args.layers, hidden_size=args.hidden,
                           intermediate_size=args.hidden * 11 // 4)
        timer = StepTimer(cuda=args.device == "cuda")
        steps = args.warmup + args.steps + 1
        strategy = MegaTrainStrategy(optimizer_in_backward=schedule == "in_backward", update_threads=threads)
        trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
                             max_steps=steps, enable_checkpointing=False,
                             logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
        trainer.fit(LM(model), make_data(n=steps * args.batch, batch_size=args.batch))
    finally:
        HostAdamW._update = original  # type: ignore[method-assign]
    return statistics.median(timer.steps(args.warmup)), updates[0] // steps  # the last step's are flushed at the end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of a base run and one run per delay; medians")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the blocks compute (cuda: the GPU path's streams; the updates stay on the host)")
    ap.add_argument("--schedules", default="in_backward,deferred", help="comma list of in_backward, deferred")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "update_overlap.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'schedule':<12} {'thr':>3} {'N':>3} {'d ms':>7} {'N*d s':>7} {'base s':>7} {'step s':>7} {'growth s':>8} "
          f"{'bound s':>8} {'N*d/growth':>10}  result")
    for schedule, threads in [c for c in CONFIGS if c[0] in args.schedules.split(",")]:
        calibration = [run(schedule, threads, 0.0, args) for _ in range(3)]
        first, n = statistics.median(t for t, _ in calibration), calibration[0][1]
        delays = [f * first / n for f in FACTORS]
        steps: dict[float, list[float]] = {}
        for r in range(args.rounds):  # a base run, then each delay: drift on a shared machine hits a round alike
            for d in [0.0] + delays:
                steps.setdefault(d, []).append(run(schedule, threads, d, args)[0])
        base = statistics.median(steps[0.0])
        for factor, d in zip(FACTORS, delays):
            step = statistics.median(steps[d])
            growth = statistics.median(t - b for t, b in zip(steps[d], steps[0.0]))  # against the round's base
            bound = max(0.0, n * d - base) + HIDE_MARGIN * base
            ok = growth <= bound
            rows.append(dict(schedule=schedule, update_threads=threads, slab_updates=n, factor=factor, delay_s=d,
                             total_delay_s=n * d,
                             base_step_s=base, step_s=step, growth_s=growth, bound_s=bound, pass_=ok,
                             base_runs=steps[0.0], step_runs=steps[d]))
            print(f"{schedule:<12} {threads:>3} {n:>3} {d * 1e3:>7.1f} {n * d:>7.3f} {base:>7.3f} {step:>7.3f} {growth:>8.3f} "
                  f"{bound:>8.3f} {n * d / max(growth, 1e-9):>10.1f}  {'PASS' if ok else 'over'}")
    out = dict(model=f"llama {args.layers} layers, hidden {args.hidden}, batch {args.batch}", device=args.device,
               threads=args.threads,
               steps=args.steps, warmup=args.warmup, rounds=args.rounds, margin=HIDE_MARGIN,
               rows=[{("pass" if k == "pass_" else k): v for k, v in r.items()} for r in rows])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
