"""Precision benchmark: what each MegaTrainPrecision mode moves and costs, measured in one run.

For a small Llama trained on a learnable synthetic task (the test suite's), per precision:
final loss after --steps steps against fp32 and against plain Lightning (``strategy="auto"``) in
the same precision (fp32 weights under autocast, GradScaler for 16-mixed; both sides with torch's
fused AdamW, the kernel HostAdamW runs, so only the precision semantics differ), H2D/D2H bytes per
step and their ratio to fp32, the share of parameters that travel in fp32 under the mixed modes
(embeddings and norms: only the weights autocast casts travel in bf16/fp16), host cast seconds per
step (fp32 master -> wire image, once per slab per step), and the median step time. A second
table measures where the host-side cast runs best: the cast throughput of fp32 -> bf16 on this
host (GB/s of fp32 read) for (a) one cast per step after the optimizer update (what the engine
does: a shadow of 2 bytes per castable param), against (b) a cast at every fetch (no shadow, no
extra memory, but each block is fetched twice per step).

    python bench/precision.py            # 100 steps
    python bench/precision.py --steps 20 # quicker

Writes bench/results/precision.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainPrecision, MegaTrainStrategy
from megatrain_lightning.testing import LM, learnable_data, make_model


class StepTimer(pl.Callback):
    def __init__(self):
        self.times, self._t = [], 0.0

    def on_train_batch_start(self, *a):
        self._t = time.perf_counter()

    def on_train_batch_end(self, *a):
        self.times.append(time.perf_counter() - self._t)


def _trainer_kwargs(precision: str, strategy: str) -> dict:
    if precision == "16-mixed":  # on CPU Lightning turns precision="16-mixed" into bf16: build the fp16 plugins
        return {"plugins": [MegaTrainPrecision(precision) if strategy == "megatrain"
                            else MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    return {"precision": precision}


def run(precision: str, steps: int, layers: int, hidden: int, strategy: str = "megatrain"):
    torch.manual_seed(0)
    model = make_model("llama", num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 2,
                       use_cache=False)
    lm = LM(model, lr=3e-3, opt_kwargs={"fused": True})
    timer = StepTimer()
    # cpu_zero_copy=False: every block is copied as on an accelerator, so h2d_bytes counts the wire bytes (with the
    # CPU default a 32-true run binds the fp32 masters and copies nothing: h2d_bytes 0)
    strat = MegaTrainStrategy(cpu_zero_copy=False) if strategy == "megatrain" else strategy
    trainer = pl.Trainer(strategy=strat, accelerator="cpu", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer], **_trainer_kwargs(precision, strategy))
    trainer.fit(lm, learnable_data(n=256))
    if strategy != "megatrain":
        return lm
    engine = trainer.strategy.engine
    hist = engine.history[2:]
    mean = lambda k: statistics.mean(h[k] for h in hist)  # noqa: E731
    n_fp32 = 0  # parameters whose bytes travel in fp32
    for slab, layout, flags in zip(engine.store.slabs, engine.wire_layouts, engine.autocast_castable):
        if layout.dtype is None:  # a mixed slab: castable entries in bf16/fp16, the rest in fp32
            n_fp32 += sum(e.numel for e, c in zip(slab.entries, flags) if not c)
        elif layout.dtype == torch.float32:
            n_fp32 += slab.numel
    return lm, {
        "precision": precision,
        "final_loss": statistics.mean(lm.losses[-10:]),
        "h2d_bytes": mean("megatrain/h2d_bytes"),
        "d2h_bytes": mean("megatrain/d2h_bytes"),
        "cast_s": mean("megatrain/cast_s"),
        "step_s": statistics.median(timer.times[2:]),
        "n_params": sum(p.numel() for p in lm.parameters()),
        "fp32_wire_share": n_fp32 / sum(p.numel() for p in lm.parameters()),
    }


def vs_lightning(ours, precision: str, steps: int, layers: int, hidden: int) -> dict:
    """Largest per-step relative loss difference and largest relative weight difference against plain
    Lightning in the same precision (``None`` for bf16-true: Lightning's keeps bf16 master weights)."""
    if precision == "bf16-true":
        return {"loss_vs_lightning": None, "weights_vs_lightning": None}
    ref = run(precision, steps, layers, hidden, strategy="auto")
    loss = max(abs(a - b) / abs(b) for a, b in zip(ours.losses, ref.losses))
    weights = max((torch.linalg.vector_norm((p - q).double()) / torch.linalg.vector_norm(q.double())).item()
                  for p, q in zip(ours.parameters(), ref.parameters()))
    return {"loss_vs_lightning": loss, "weights_vs_lightning": weights}


def cast_throughput(n: int = 50_000_000, repeat: int = 5):
    src = torch.randn(n)
    dst = torch.empty(n, dtype=torch.bfloat16)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"params": n, "seconds": t, "fp32_GBps": 4 * n / t / 1e9, "params_per_s": n / t}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "precision.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for p in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        lm, row = run(p, args.steps, args.layers, args.hidden)
        row.update(vs_lightning(lm, p, args.steps, args.layers, args.hidden))
        rows.append(row)
    base = rows[0]
    fmt = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
    print(f"{'precision':<11} {'final loss':>10} {'vs fp32':>8} {'vs Lightning (loss/weights)':>27} {'H2D/step':>10} "
          f"{'ratio':>6} {'fp32 wire':>9} {'D2H/step':>10} {'cast s/step':>11} {'step s':>7}")
    for r in rows:
        r["loss_vs_fp32"] = r["final_loss"] / base["final_loss"] - 1
        r["h2d_ratio"] = r["h2d_bytes"] / base["h2d_bytes"]
        vs = f"{fmt(r['loss_vs_lightning'])} / {fmt(r['weights_vs_lightning'])}"
        print(f"{r['precision']:<11} {r['final_loss']:>10.4f} {r['loss_vs_fp32']:>+8.2%} {vs:>27} "
              f"{r['h2d_bytes'] / 2**20:>8.2f}Mi {r['h2d_ratio']:>6.3f} {r['fp32_wire_share']:>9.1%} "
              f"{r['d2h_bytes'] / 2**20:>8.2f}Mi {r['cast_s']:>11.5f} {r['step_s']:>7.3f}")
    c = cast_throughput()
    print(f"\nhost cast fp32->bf16: {c['params_per_s'] / 1e9:.2f} G params/s ({c['fp32_GBps']:.2f} GB/s of fp32 read)")
    print("shadow (engine): 1 cast per param per step, +2 bytes per castable param of host RAM;"
          " cast at every fetch: 2 casts per param per step (forward + backward fetch), no extra RAM")
    per_100b = 100e9 / c["params_per_s"]
    print(f"for 100B params: {per_100b:.0f} s/step with the shadow vs {2 * per_100b:.0f} s/step casting at each fetch")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bench": "precision", "args": vars(args), "rows": rows, "cast": c,
                                          "torch": torch.__version__, "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
