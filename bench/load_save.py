"""Streaming load and checkpoint save of a model larger than the host budget.

What: a Llama-architecture model (default 1.47B params, 5.9 GB of fp32 safetensors) is written
as a Hugging Face directory (tensor by tensor, never whole in RAM). Then, in a fresh process
with the NVMe tier and host_memory_limit (default 3 GiB, half of the weights; the smallest
budget this shape allows is 2.56 GiB):
  * load: megatrain_lightning.checkpoint.hf_io.meta_model_from_pretrained + the strategy's
    setup, which reads each tensor into the store (time, peak RSS while loading, bytes read
    against the raw sequential read bandwidth of the disk, measured in the same run);
  * save: one training step, then trainer.save_checkpoint(dir) of model/ (HF) + optimizer/
    (time, peak RSS during the save; 12 B/param written).
Peak RSS is sampled every 20 ms from /proc/self/statm during each phase; the target
is peak RSS <= host budget + one block (+ the interpreter's own ~0.4 GiB baseline, reported).

Run:
    python bench/load_save.py --dir /path/on/fast/disk     # ~5 minutes on the 2-core dev machine
    python bench/load_save.py --dir /tmp/x --quick         # tiny: exercises the script only
Writes bench/results/load_save.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS every 20 ms while active."""

    def __enter__(self):
        self.peak, self._stop = rss(), False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss())


def config(a):
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                    num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=16,
                                    tie_word_embeddings=False, use_cache=False)


def write_model(a, out: str) -> int:
    """Write a random-init HF directory tensor by tensor; returns bytes of weights."""
    from megatrain_lightning.checkpoint.hf_io import meta_model_from_config, write_safetensors_shards

    meta = meta_model_from_config(config(a))
    src = meta._megatrain_source
    items = ((n, src.get(meta._megatrain_key_map[n])) for n, _ in meta.named_parameters())
    write_safetensors_shards(out, items, max_shard_bytes=2 * 2**30)
    config(a).save_pretrained(out)
    return sum(p.numel() for p in meta.parameters()) * 4


def child(a) -> None:
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.checkpoint.hf_io import meta_model_from_pretrained

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(2)
    base = rss()

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = meta_model_from_pretrained(a.model_dir, attn_implementation="sdpa")

        def training_step(self, batch, i):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    store = os.path.join(a.dir, "nvme")
    os.makedirs(store, exist_ok=True)
    strat = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=store,
                              host_memory_limit=a.limit, cpu_zero_copy=False)
    lm = LM()
    times = {}

    class Phases(pl.Callback):
        def on_train_start(self, trainer, pl_module):  # the store is built (weights loaded) by now
            load.__exit__(None, None, None)
            times["load_s"] = time.perf_counter() - t0

    ids = torch.randint(0, 32000, (1, 64))
    tr = pl.Trainer(strategy=strat, accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[Phases()])
    t0 = time.perf_counter()
    load = PeakRSS().__enter__()
    tr.fit(lm, DataLoader(TensorDataset(ids), batch_size=1))
    eng = tr.strategy.engine
    read = eng.store.nvme.meter.read_bytes
    ckpt = os.path.join(a.dir, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    import gc

    gc.collect()
    rss_before_save = rss()  # the window as training left it (up to the budget) + the baseline
    with PeakRSS() as save:
        t1 = time.perf_counter()
        tr.save_checkpoint(ckpt)
        times["save_s"] = time.perf_counter() - t1
    saved = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    out = {**times, "base_rss": base, "load_peak_rss": load.peak, "save_peak_rss": save.peak,
           "rss_before_save": rss_before_save,
           "budget_peak": eng.budget.peak, "store_bytes_read_during_setup_and_step": read, "saved_bytes": saved,
           "largest_block_bytes": 4 * max(s.numel for s in eng.store.slabs)}
    tr.strategy.close()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--limit", type=int, default=3 * 2**30)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "load_save.json"))
    p.add_argument("--child", action="store_true")
    p.add_argument("--model-dir", default=None)
    a = p.parse_args()
    if a.quick:
        a.layers, a.hidden, a.intermediate, a.limit = 2, 256, 688, 512 * 2**20
    if a.child:
        return child(a)
    os.makedirs(a.dir, exist_ok=True)
    model_dir = os.path.join(a.dir, "hf_model")
    shutil.rmtree(model_dir, ignore_errors=True)
    t0 = time.perf_counter()
    weights = write_model(a, model_dir)
    print(f"wrote {weights / 1e9:.2f} GB of fp32 weights in {time.perf_counter() - t0:.0f} s", flush=True)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from nvme import raw_bandwidth  # noqa: E402

    raw = raw_bandwidth(a.dir, min(8 * 2**30, weights), 4)
    os.system("sync")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", a.dir, "--model-dir", model_dir,
           "--layers", str(a.layers), "--hidden", str(a.hidden), "--intermediate", str(a.intermediate),
           "--limit", str(a.limit)] + (["--quick"] if a.quick else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(r.stdout[-3000:], r.stderr[-5000:])
        raise SystemExit("child failed")
    res = json.loads(line[7:])
    gib = 2**30
    bound_rss = a.limit + res["largest_block_bytes"] + res["base_rss"]
    load_min_s = weights / (raw["read"] * 1e9)
    rows = [("load (safetensors -> NVMe store)", res["load_s"], res["load_peak_rss"]),
            ("save (model/ + optimizer/)", res["save_s"], res["save_peak_rss"])]
    print(f"\nload/save: {weights / 1e9:.2f} GB fp32 weights, host_memory_limit {a.limit / gib:.2f} GiB, largest block "
          f"{res['largest_block_bytes'] / gib:.2f} GiB, interpreter baseline {res['base_rss'] / gib:.2f} GiB; raw read "
          f"{raw['read']:.2f} GB/s, write {raw['write']:.2f} GB/s")
    print(f"{'phase':34s} {'seconds':>8s} {'peak RSS GiB':>12s} {'<= budget+block+base':>21s}")
    for name, s, peak in rows:
        print(f"{name:34s} {s:8.1f} {peak / gib:12.2f} {'yes' if peak <= bound_rss else 'NO':>21s}")
    print(f"RSS when the save starts (the window training left, then dropped by the save): "
          f"{res['rss_before_save'] / gib:.2f} GiB")
    print(f"load time / (weights / raw read) = {res['load_s'] / load_min_s:.2f} (the store also writes them: "
          f"{weights / 1e9:.2f} GB read + written); saved {res['saved_bytes'] / 1e9:.2f} GB")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"bench": "load_save", "args": vars(a), "weights_bytes": weights, "raw_gbps": raw, **res,
                   "rss_bound": bound_rss, "load_over_raw_read": res["load_s"] / load_min_s,
                   "load_rss_ok": res["load_peak_rss"] <= bound_rss, "save_rss_ok": res["save_peak_rss"] <= bound_rss},
                  fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
