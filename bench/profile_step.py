"""Where one streamed training step spends its time that plain PyTorch does not.

What: the SmolLM2-135M shape of bench/overhead.py (random init, fp32, batch 1 x 512) through
Trainer(strategy=MegaTrainStrategy(cpu_zero_copy=False, recompute=...)); after --warmup steps one step
runs under torch.profiler (CPU activities: aten ops, and the engine's record_function ranges if any)
and one under cProfile (Python functions by own time: the per-block Python work). Prints the top
ops and functions and writes bench/results/profile_step.json.

Run:
    python bench/profile_step.py                       # SmolLM2-135M shape, cpu_zero_copy=False, block
    python bench/profile_step.py --layers 8 --seq 256  # quicker
    python bench/profile_step.py --recompute selective
    python bench/profile_step.py --zero-copy --recompute auto --activation-memory-limit 173775360   # 25% of "none"
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import time
import warnings

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from megatrain_lightning import MegaTrainStrategy

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--layers", type=int, default=30)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--recompute", default="block")
p.add_argument("--zero-copy", action="store_true", help="cpu_zero_copy=True (default: False, copies as on CUDA)")
p.add_argument("--activation-memory-limit", default=None, help="recompute='auto''s budget (bytes, or '170MB')")
p.add_argument("--top", type=int, default=25)
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "profile_step.json"))
args = p.parse_args()
torch.set_num_threads(2)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                               tie_word_embeddings=True, rope_theta=100000, use_cache=False)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg)
n = args.warmup + 2
ids = torch.randint(0, cfg.vocab_size, (n, args.seq), generator=torch.Generator().manual_seed(1))


class LM(pl.LightningModule):
    def __init__(self, m):
        super().__init__()
        self.model = m

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class Profile(pl.Callback):
    """Step warmup: torch.profiler; step warmup + 1: cProfile."""

    def __init__(self):
        self.prof = self.cprof = None
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()
        if batch_idx == args.warmup:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        elif batch_idx == args.warmup + 1:
            self.cprof = cProfile.Profile()
            self.cprof.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == args.warmup:
            self.prof.__exit__(None, None, None)
        elif batch_idx == args.warmup + 1:
            self.cprof.disable()
        self.times.append(time.perf_counter() - self.t0)


cb = Profile()
trainer = pl.Trainer(strategy=MegaTrainStrategy(cpu_zero_copy=args.zero_copy, recompute=args.recompute,
                                                activation_memory_limit=args.activation_memory_limit), accelerator="cpu",
                     devices=1, max_steps=n, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[cb])
trainer.fit(LM(model), DataLoader(TensorDataset(ids), batch_size=1))
hist = trainer.strategy.engine.history

ka = cb.prof.key_averages()
ops = sorted(ka, key=lambda e: -e.self_cpu_time_total)[: args.top]
print(f"\ntorch.profiler, step {args.warmup} ({cb.times[args.warmup]:.3f} s; {args.layers} layers x {args.seq} tokens, "
      f"cpu_zero_copy={args.zero_copy}, recompute={args.recompute}): top ops by self CPU time")
print(f"{'op':50s} {'calls':>7s} {'self s':>8s}")
for e in ops:
    print(f"{e.key[:50]:50s} {e.count:7d} {e.self_cpu_time_total / 1e6:8.3f}")
s = io.StringIO()
st = pstats.Stats(cb.cprof, stream=s)
st.sort_stats("tottime").print_stats(args.top)
print(f"\ncProfile, step {args.warmup + 1} ({cb.times[args.warmup + 1]:.3f} s; profiled, so slower): top functions by own time")
print("\n".join(s.getvalue().splitlines()[:args.top + 12]))
funcs = [{"func": f"{k[0]}:{k[1]}({k[2]})", "calls": v[1], "tottime_s": v[2], "cumtime_s": v[3]}
         for k, v in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: args.top]]
os.makedirs(os.path.dirname(args.out), exist_ok=True)
with open(args.out, "w") as f:
    json.dump({"bench": "profile_step", "args": vars(args), "torch": torch.__version__, "step_s": cb.times,
               "engine": hist[args.warmup], "ops": [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6}
                                                   for e in ops], "python": funcs}, f, indent=1)
print(f"wrote {args.out}")
