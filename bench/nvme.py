"""NVMe tier benchmark: disk speed, bigger-than-RAM training, peak RSS flat in model size.

What, in one run (each training run in its own subprocess, so its peak RSS is its own):
  1. Raw sequential O_DIRECT write and read bandwidth of the disk under --nvme-path (a 16 GiB
     file, 64 MiB requests, 1 and --io-threads streams, best of both; and "mixed": half the
     streams reading while half write) against the store's achieved throughput during training.
     Reads and writes share the disk in training, so the target (>= 85%) is on both together:
     efficiency = (read_bytes / raw_read + write_bytes / raw_write) / (wall time with any store
     transfer running), i.e. the time the raw disk needs for the store's bytes over the time the
     store took. (read + write bytes) / that time against the raw 50/50 "mixed" rate, and each
     direction's bytes / its own busy time, are reported too; training reads about twice what it
     writes, so the 50/50 rate overstates what the disk can do for training's mix. The raw test
     runs before and again right after the 2.55B run (the reference is their mean): the virtual
     disk of the dev machine drifts by up to +-30% within minutes.
  2. Bigger than RAM: a Llama-architecture model whose 16 B/param training state is >= 1.5x the
     machine's RAM (2.55B params here: 40.8 GB on a 24 GiB machine), random init built straight
     into the store (megatrain_lightning.checkpoint.hf_io.meta_model_from_config), trained with
     host_memory_limit = 25% of RAM for 1 warm-up + 3 measured optimizer steps. Targets: peak RSS
     <= limit + 1.5 GiB; median step <= 1.25 x max(compute, read_bytes / raw_read + write_bytes /
     raw_write). compute = the engine's compute_s (time the compute thread spent running blocks),
     cross-checked on the 0.5B model against an in-RAM run (strategy="megatrain") of the same model.
  3. Peak RSS flat in model size: 0.5B, 1B and 2B parameters under the same limit.
The check of free disk comes first and says what it needs.

Run:
    python bench/nvme.py --nvme-path /path/on/fast/disk            # ~15-20 minutes on the 2-core dev machine
    python bench/nvme.py --nvme-path /tmp/x --quick                # tiny sizes: exercises the script only
Writes bench/results/nvme.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Llama shapes: hidden 2048, intermediate 5632, 16 heads, vocab 32000 (untied): 51.4M params per
# decoder layer, 65.5M per embedding/head -> layers for each size
SIZES = {"0.5B": 7, "1B": 17, "2B": 36, "2.55B": 47}
QUICK = {"0.5B": 1, "1B": 2, "2B": 4, "2.55B": 5}


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---------------------------------------------------------------- raw disk bandwidth
def raw_bandwidth(path: str, total: int, threads: int) -> dict[str, float]:
    """O_DIRECT sequential write then read of a ``total``-byte file in 64 MiB requests, by 1 and by
    ``threads`` concurrent streams (each a contiguous part), then ``threads`` streams of which half
    read and half write at once ("mixed": reads and writes sharing the disk, as in training).
    The file is large (default 16 GiB) so that caches below the filesystem cannot hold it: a short
    test measures the cache, not the disk. Returns GB/s (1e9 bytes/s)."""
    from megatrain_lightning.store.nvme import aligned_empty

    chunk = 64 * 2**20
    total = total // (chunk * threads) * chunk * threads
    f = os.path.join(path, f".raw_bw_{os.getpid()}")
    out = {}
    fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)

    def timed(jobs):  # jobs: [(op, start, stop)], one thread each; returns seconds
        bufs = [aligned_empty(chunk) for _ in jobs]
        for b in bufs:
            b.fill_(1)

        def run(k):
            op, lo, hi = jobs[k]
            mv = memoryview(bufs[k].numpy())
            for off in range(lo, hi, chunk):
                (os.pwritev if op == "write" else os.preadv)(fd, [mv], off)
        t0 = time.perf_counter()
        ts = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if any(op == "write" for op, _, _ in jobs):
            os.fsync(fd)
        return time.perf_counter() - t0

    try:
        os.posix_fallocate(fd, 0, total)
        for n in (1, threads):
            part = total // n
            for op in ("write", "read"):
                out[f"{op}_{n}"] = total / timed([(op, k * part, (k + 1) * part) for k in range(n)]) / 1e9
        half = total // 2
        n = max(1, threads // 2)
        part = half // n
        jobs = [("read", k * part, (k + 1) * part) for k in range(n)] + \
               [("write", half + k * part, half + (k + 1) * part) for k in range(n)]
        out["mixed"] = 2 * n * part / timed(jobs) / 1e9
    finally:
        os.close(fd)
        os.unlink(f)
    out["read"] = max(out["read_1"], out[f"read_{threads}"])
    out["write"] = max(out["write_1"], out[f"write_{threads}"])
    return out


# ---------------------------------------------------------------- one training run (child)
def child(a) -> None:
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.checkpoint.hf_io import meta_model_from_config

    from memtrace import MemTrace

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(a.threads)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                   num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=16,
                                   max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False, use_cache=False)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = meta_model_from_config(cfg, attn_implementation="sdpa")

        def training_step(self, batch, i):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    class Timer(pl.Callback):
        def __init__(self):
            self.t, self.setup_s = [], None

        def on_train_start(self, trainer, pl_module):
            self.setup_s = time.perf_counter() - t_start
            phase.name = "train"

        def on_train_end(self, trainer, pl_module):
            phase.name = "teardown"

        def on_train_batch_start(self, *args):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.t.append(time.perf_counter() - self.t0)

    t_start = time.perf_counter()
    phase = argparse.Namespace(name="setup")
    lm = LM()
    n_params = sum(p.numel() for p in lm.parameters())
    if a.tier == "nvme":
        strat = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=a.nvme_path,
                                  host_memory_limit=a.limit, nvme_io_threads=a.io_threads,
                                  nvme_io_block_size=a.io_block_size, cpu_zero_copy=False)
    else:
        strat = MegaTrainStrategy(cpu_zero_copy=False)
    timer = Timer()
    ids = torch.randint(0, 32000, (a.steps, a.seq), generator=torch.Generator().manual_seed(0))
    tr = pl.Trainer(strategy=strat, accelerator="cpu", devices=1, max_steps=a.steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[timer])
    engine = lambda: getattr(tr.strategy, "engine", None)  # noqa: E731
    trace = MemTrace(lambda: getattr(engine(), "budget", None), lambda: phase.name + ":" + getattr(engine(), "_phase", "")).start()
    tr.fit(lm, DataLoader(TensorDataset(ids), batch_size=1))
    mem = trace.stop()
    hist = tr.strategy.engine.history
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    keys = ("compute_s", "wait_s", "optimizer_s", "nvme_read_bytes", "nvme_write_bytes", "nvme_read_busy_s",
            "nvme_write_busy_s", "nvme_io_busy_s", "host_budget_peak_bytes", "h2d_bytes")
    out = {"n_params": n_params, "tier": a.tier, "layers": a.layers, "limit": a.limit, "step_s": timer.t,
           "setup_s": timer.setup_s, "peak_rss_bytes": rss, "memory": mem,
           "history": [{k: h.get("megatrain/" + k) for k in keys} for h in hist]}
    tr.strategy.close()
    print("RESULT " + json.dumps(out), flush=True)


def run_child(a, tier: str, layers: int, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tier", tier, "--layers", str(layers),
           "--steps", str(steps), "--limit", str(a.limit), "--nvme-path", a.nvme_path, "--seq", str(a.seq),
           "--hidden", str(a.hidden), "--intermediate", str(a.intermediate), "--threads", str(a.threads),
           "--io-threads", str(a.io_threads), "--io-block-size", str(a.io_block_size)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        print(p.stdout[-3000:], p.stderr[-5000:])
        raise SystemExit(f"child run {tier} L={layers} failed (rc {p.returncode})")
    res = json.loads(line[7:])
    res["wall_s"] = time.perf_counter() - t0
    return res


def summarize(r: dict, raw: dict, warm: int) -> dict:
    """Medians over the measured steps (after ``warm`` warm-up steps) and the targets."""
    hs, st = r["history"][warm:], r["step_s"][warm:]
    med = lambda k: statistics.median(h[k] for h in hs)  # noqa: E731
    s = {"n_params": r["n_params"], "tier": r["tier"], "step_s": statistics.median(st), "compute_s": med("compute_s"),
         "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "setup_s": r["setup_s"],
         "rss_over_budget_max_gib": r["memory"].get("rss_over_budget_max_gib"),
         "rss_over_budget_median_gib": r["memory"].get("rss_over_budget_median_gib")}
    if r["tier"] == "nvme":
        rb, wb = med("nvme_read_bytes"), med("nvme_write_bytes")
        io = sum(h.get("nvme_io_busy_s") or 0.0 for h in hs)
        s.update({"read_gb": rb / 1e9, "write_gb": wb / 1e9,
                  "combined_gbps": sum(h["nvme_read_bytes"] + h["nvme_write_bytes"] for h in hs) / max(1e-9, io) / 1e9,
                  # the time the raw disk needs for the bytes the store moved / the time the store had
                  # transfers running: the fraction of the disk's raw speed the store achieved on its own
                  # read/write mix (1.0 = raw speed; above 1.0 when reads and writes overlap well)
                  "efficiency": sum(h["nvme_read_bytes"] / (raw["read"] * 1e9) + h["nvme_write_bytes"] / (raw["write"] * 1e9)
                                    for h in hs) / max(1e-9, io),
                  "read_gbps": sum(h["nvme_read_bytes"] for h in hs) / max(1e-9, sum(h["nvme_read_busy_s"] for h in hs)) / 1e9,
                  "write_gbps": sum(h["nvme_write_bytes"] for h in hs) / max(1e-9, sum(h["nvme_write_busy_s"] for h in hs)) / 1e9,
                  "io_bound_s": rb / (raw["read"] * 1e9) + wb / (raw["write"] * 1e9),
                  "budget_peak_gib": max(h["host_budget_peak_bytes"] for h in r["history"]) / 2**30})
        s["bound_s"] = max(s["compute_s"], s["io_bound_s"])
        s["step_over_bound"] = s["step_s"] / s["bound_s"]
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--quick", action="store_true", help="tiny models (checks the script, numbers mean nothing)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--io-block-size", type=int, default=16 * 2**20, help="nvme_io_block_size, bytes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--limit", type=int, default=ram_bytes() // 4, help="host_memory_limit, bytes (default 25%% of RAM)")
    p.add_argument("--raw-gib", type=float, default=16.0)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "nvme.json"))
    # child-only
    p.add_argument("--child", action="store_true")
    p.add_argument("--tier", default="nvme")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    if a.child:
        return child(a)

    sizes = QUICK if a.quick else SIZES
    if a.quick:
        a.hidden, a.intermediate, a.seq, a.raw_gib = 256, 688, 64, 0.25
        a.limit = 512 * 2**20
    os.makedirs(a.nvme_path, exist_ok=True)
    per_layer = 4 * a.hidden**2 + 3 * a.hidden * a.intermediate
    need = 16 * (sizes["2.55B"] * per_layer + 2 * 32000 * a.hidden) * 1.1 + a.raw_gib * 2**30
    for name in os.listdir(a.nvme_path):  # raw-test files of killed runs (16 GiB each)
        if name.startswith(".raw_bw_") and not os.path.exists(f"/proc/{name[8:]}"):
            os.unlink(os.path.join(a.nvme_path, name))
    free = shutil.disk_usage(a.nvme_path).free
    print(f"disk: {free / 2**30:.1f} GiB free under {a.nvme_path}; this benchmark needs {need / 2**30:.1f} GiB "
          f"(the largest model's 16 B/param store + 10% + the raw-bandwidth file)", flush=True)
    if free < need:
        raise SystemExit(f"not enough free disk under {a.nvme_path}: {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB needed")

    raw = raw_bandwidth(a.nvme_path, int(a.raw_gib * 2**30), a.io_threads)
    print(f"raw O_DIRECT ({a.raw_gib:.0f} GiB): write {raw['write']:.2f} GB/s, read {raw['read']:.2f} GB/s, "
          f"mixed {raw['mixed']:.2f} GB/s ({raw})", flush=True)
    ram = ram_bytes()
    results = {}
    raw_before = raw
    for name, steps in (("2.55B", 4), ("2B", 3), ("1B", 3), ("0.5B", 3)):
        r = run_child(a, "nvme", sizes[name], steps)
        if name == "2.55B":
            # this virtual disk's speed drifts by up to +-30% within minutes: measure it again right
            # after the big run and judge that run against the mean of the two measurements
            raw_after = raw_bandwidth(a.nvme_path, int(a.raw_gib * 2**30), a.io_threads)
            raw = {k: (raw_before[k] + raw_after[k]) / 2 for k in raw_before}
            print(f"raw O_DIRECT again: write {raw_after['write']:.2f} GB/s, read {raw_after['read']:.2f} GB/s, "
                  f"mixed {raw_after['mixed']:.2f} GB/s; the mean of both is the reference", flush=True)
        results[name] = summarize(r, raw, warm=1)
        print(f"  {name} nvme: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results[name].items()})}", flush=True)
    r = run_child(a, "ram", sizes["0.5B"], 3)
    results["0.5B ram"] = summarize(r, raw, warm=1)
    print(f"  0.5B ram: {results['0.5B ram']}", flush=True)

    big = results["2.55B"]
    limit_gib = a.limit / 2**30
    checks = {
        "state_over_ram": 16 * big["n_params"] / ram,
        "rss_ok": big["peak_rss_gib"] <= limit_gib + 1.5,
        "step_ok": big["step_over_bound"] <= 1.25,
        "read_ratio": big["read_gbps"] / raw["read"],
        "write_ratio": big["write_gbps"] / raw["write"],
        "combined_ratio": big["combined_gbps"] / raw["mixed"],
        "efficiency": big["efficiency"],
        "rss_flat_spread_gib": max(results[k]["peak_rss_gib"] for k in ("0.5B", "1B", "2B"))
        - min(results[k]["peak_rss_gib"] for k in ("0.5B", "1B", "2B")),
        "compute_nvme_over_ram_0.5B": results["0.5B"]["compute_s"] / results["0.5B ram"]["compute_s"],
    }
    # reads and writes share one disk during training, so the store's throughput is judged on both
    # together (bytes / time with any transfer running) against the raw mixed read+write rate
    checks["throughput_ok"] = checks["efficiency"] >= 0.85
    checks["rss_flat_ok"] = all(results[k]["peak_rss_gib"] <= limit_gib + 1.5 for k in ("0.5B", "1B", "2B"))

    print(f"\nNVMe tier: {os.cpu_count()} cores, RAM {ram / 2**30:.1f} GiB, host_memory_limit {limit_gib:.2f} GiB, "
          f"batch 1 x {a.seq}, fp32, io_threads {a.io_threads}, io_block_size {a.io_block_size >> 20} MiB; raw O_DIRECT write {raw['write']:.2f} / read {raw['read']:.2f} / "
          f"mixed {raw['mixed']:.2f} GB/s")
    print(f"{'model':10s} {'params':>7s} {'step s':>7s} {'compute s':>9s} {'io bound s':>10s} {'step/bound':>10s} "
          f"{'read GB':>8s} {'write GB':>8s} {'read GB/s':>9s} {'write GB/s':>10s} {'peak RSS GiB':>12s} {'budget peak':>11s} "
          f"{'RSS-budget max':>14s}")
    for k, s in results.items():
        f = lambda key, fmt: format(s[key], fmt) if s.get(key) is not None else "-"  # noqa: E731
        print(f"{k:10s} {s['n_params'] / 1e9:6.2f}B {s['step_s']:7.1f} {s['compute_s']:9.1f} {f('io_bound_s', '10.1f'):>10s} "
              f"{f('step_over_bound', '10.2f'):>10s} {f('read_gb', '8.1f'):>8s} {f('write_gb', '8.1f'):>8s} "
              f"{f('read_gbps', '9.2f'):>9s} {f('write_gbps', '10.2f'):>10s} {s['peak_rss_gib']:12.2f} {f('budget_peak_gib', '11.2f'):>11s} "
              f"{f('rss_over_budget_max_gib', '14.2f'):>14s}")
    print(f"2.55B state / RAM = {checks['state_over_ram']:.2f} (>= 1.5); peak RSS {big['peak_rss_gib']:.2f} GiB <= limit + 1.5 = "
          f"{limit_gib + 1.5:.2f}: {'PASS' if checks['rss_ok'] else 'FAIL'}; step / bound {big['step_over_bound']:.2f} <= 1.25: "
          f"{'PASS' if checks['step_ok'] else 'FAIL'}")
    print(f"store throughput vs raw: the raw disk would need {big['efficiency']:.0%} of the time the store had transfers "
          f"running for the same read and write bytes (>= 85%): {'PASS' if checks['throughput_ok'] else 'FAIL'}; "
          f"read+write {big['combined_gbps']:.2f} GB/s = {checks['combined_ratio']:.0%} of raw 50/50 mixed {raw['mixed']:.2f} GB/s; "
          f"per direction while busy: read {checks['read_ratio']:.0%}, write {checks['write_ratio']:.0%}; RSS spread 0.5B..2B {checks['rss_flat_spread_gib']:.2f} GiB: "
          f"{'PASS' if checks['rss_flat_ok'] else 'FAIL'}; compute_s NVMe/RAM at 0.5B {checks['compute_nvme_over_ram_0.5B']:.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"bench": "nvme", "args": vars(a), "cores": os.cpu_count(), "ram_bytes": ram, "raw_gbps": raw,
                   "raw_gbps_before": raw_before, "raw_gbps_after": raw_after,
                   "results": results, "checks": checks}, fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
