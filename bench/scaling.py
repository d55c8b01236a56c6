"""Data-parallel scaling of strategy="megatrain": tokens/s and the node's host memory, 1 vs N processes.

What: the same Llama-shaped model (random init, fp32; default hidden 512, MLP 1408, 8 layers, vocabulary 32000,
untied head: 58.5M parameters, so the training state of 16 bytes/param, 0.94 GB = 0.87 GiB, dominates memory) trained
through ``Trainer(strategy="megatrain")`` by real processes started as a user starts them: this script runs
``python bench/scaling.py --worker ...`` and Lightning's subprocess script launcher re-runs that command for the
other local ranks (as for a user's ``python train.py``; tests/dp_worker.py is launched the same way).

CPU mode (default, ``--accelerator cpu --devices 2``), same GLOBAL batch (``--batch`` sequences of ``--seq``
tokens per optimizer step) and the same cores in both rows:
  (a) 1 process with ``--cores`` (default: every core, 2 here) intra-op threads, micro-batch ``--batch``;
  (b) ``--devices`` processes with ``cores / devices`` threads each, micro-batch ``batch / devices`` per rank.
Lightning's launcher sets ``torch.set_num_threads(cores // processes)`` and ``OMP_NUM_THREADS`` only where
``OMP_NUM_THREADS`` is unset (lightning.fabric.utilities.distributed._set_num_threads_if_needed); this script
sets ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` explicitly and records what every rank really ran with
(column "thr/rank"; ``--lightning-threads`` leaves the choice to Lightning instead).
Memory, the point of the CPU rows: the node's fp32 masters, gradient accumulators and AdamW moments live ONCE per
node in a ``/dev/shm`` file that every local rank maps (megatrain_lightning/store/shared.py), so 2 processes do not
double the state. A sampler thread of this script reads every ``--sample-s`` seconds, for every process of the
run (the launched rank 0 and its descendants), ``/proc/PID/smaps_rollup``: ``Pss`` (proportional set size:
each shared page divided among the processes that map it, so the sum over the processes counts the shared state
once) and ``Rss`` (which counts a shared page once PER PROCESS: the RSS sum double counts the shared state and is
shown only for comparison), and from ``/proc/PID/maps`` the size of the mapped ``/dev/shm/megatrain-*`` file
(unlinked once mapped, so it is not listed in ``/dev/shm``; its size is the shared state). The table shows the
max and the median, over the samples taken during the measured steps, of the sum at one sampling instant (the
JSON also has the peak of the whole run, start-up included, and a timeline). Each configuration is also run with
a tiny model (hidden 64, 1 layer, vocabulary 256: the same processes without the model; ``--no-baseline`` skips
it); "model B/param" = (PSS sum - the baseline's) / parameters: everything the model adds (state, streamed windows, activations, logits, allocator
slack), next to the 16 B/param of the state alone (fp32 master 4 + gradient accumulator 4 + exp_avg 4 +
exp_avg_sq 4; MegaTrain, arXiv 2604.05091).

GPU mode (``--accelerator gpu --devices N``): runs 1, 2, ..., N processes with one GPU each and a fixed
micro-batch of ``--batch`` sequences PER RANK (weak scaling, as DDP is used) and reports the scaling efficiency
``tokens/s at k / (k * tokens/s at 1)``. This needs a machine with N GPUs. On a machine with fewer GPUs than
processes (the project's H200 machine has one) the ranks share GPU 0 (``MegaTrainStrategy(parallel_devices=
[cuda:0] * k)``; Lightning refuses ``devices=[0, 0]``: "Device ID's (GPU) must be unique"), which NCCL refuses
too, so pass ``--process-group-backend gloo``: that exercises the CUDA code path of data parallel (pinned shared
store, D2H of each rank's gradients, gloo reduce on the host) but the processes share one GPU, so the
"efficiency" is not a scaling measurement (the output says so).

Throughput: rank 0 times the ``--steps`` optimizer steps after ``--warmup`` unmeasured ones, from
on_train_batch_start of the first to on_train_batch_end of the last (CUDA synchronised; every step ends with
the gradient all-reduce, so rank 0's time is the run's); tokens/s = global tokens per step x steps / that time.
This 2-core machine is shared: the column "other cores" is the CPU that processes outside the run used
meanwhile (from /proc/stat), in cores; with 2 cores, any of it slows the run and the tokens/s comparison is
only indicative then (the memory comparison is not affected).

Run:
    python bench/scaling.py                                   # CPU: 1 x 2 threads vs 2 x 1 thread (1-3 min here)
    python bench/scaling.py --layers 2 --hidden 128 --intermediate 256 --vocab 1024 --steps 2 --warmup 1  # smoke
    python bench/scaling.py --accelerator gpu --devices 8     # GPU scaling 1..8 on an 8-GPU machine
    python bench/scaling.py --accelerator gpu --devices 2 --process-group-backend gloo   # 2 ranks on 1 GPU
    python bench/scaling.py --sweep --share-device --no-baseline ...   # the GPU mode's logic on the CPU (dry run)
Writes bench/results/scaling.json (GPU mode: bench/results/scaling_gpu.json). ``bash bench/gpu_check.sh scaling``
runs the one-GPU variant (bench/gpu_check.py, check ``scaling``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE_BYTES_PER_PARAM = 16  # fp32 master + gradient accumulator + exp_avg + exp_avg_sq (4 bytes each)
TINY = {"hidden": 64, "intermediate": 128, "layers": 1, "heads": 4, "kv_heads": 4, "vocab": 256}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--devices", type=int, default=2, help="processes of the data-parallel row (GPU mode: the sweep's largest)")
    p.add_argument("--cores", type=int, default=None,
                   help="CPU mode: intra-op threads in all (1 process: all of them; N processes: cores // N each); "
                        "default: the CPUs this process may run on")
    p.add_argument("--batch", type=int, default=4,
                   help="CPU mode: global batch (sequences per optimizer step, split over the ranks); GPU mode: per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--process-group-backend", default=None, help="torch.distributed backend (default: gloo on CPU, NCCL on CUDA)")
    p.add_argument("--no-baseline", action="store_true", help="skip the tiny-model runs (no 'model B/param' column)")
    p.add_argument("--lightning-threads", action="store_true",
                   help="do not set OMP_NUM_THREADS / torch threads: let Lightning's launcher choose (recorded per rank)")
    p.add_argument("--share-device", action="store_true",
                   help="all ranks on device 0 through MegaTrainStrategy(parallel_devices=[dev0] * k) (automatic on GPU "
                        "when k exceeds the GPUs; on CPU it exercises that code path)")
    p.add_argument("--sweep", action="store_true",
                   help="run 1..--devices processes with --batch per rank and report efficiency (what GPU mode does; "
                        "with --accelerator cpu: a dry run of that logic)")
    p.add_argument("--sample-s", type=float, default=0.2, help="memory sampling period (seconds)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one configuration may take")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one run's result folder
    p.add_argument("--procs", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--micro", type=int, default=1, help=argparse.SUPPRESS)  # micro-batch per rank
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.devices < 1 or a.batch < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--devices, --batch and --steps must be >= 1 and --warmup >= 0")
    return a


# ====================================================================== worker: one training run (every rank)
def worker(a) -> None:
    import logging
    import warnings

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import lightning.pytorch as pl
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from megatrain_lightning import MegaTrainStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    cuda = a.accelerator == "gpu"
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_steps = a.warmup + a.steps
    global_batch = a.micro * a.procs
    ids = torch.randint(0, a.vocab, (n_steps * global_batch, a.seq), generator=torch.Generator().manual_seed(1))

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Timer(pl.Callback):
        def __init__(self):
            self.t0 = self.t1 = self.w0 = self.w1 = None
            self.step_s, self.threads = [], None

        def on_train_start(self, trainer, pl_module):
            self.threads = torch.get_num_threads()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sync()
            self.s0 = time.perf_counter()
            if batch_idx == a.warmup:
                self.t0, self.w0 = self.s0, time.time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sync()
            self.t1, self.w1 = time.perf_counter(), time.time()
            if batch_idx >= a.warmup:
                self.step_s.append(self.t1 - self.s0)

    timer = Timer()
    kw = {"process_group_backend": a.process_group_backend} if a.process_group_backend else {}
    if a.share_device and a.procs > 1:
        dev0 = torch.device("cuda", 0) if cuda else torch.device("cpu")
        kw["parallel_devices"] = [dev0] * a.procs
        devices = 1  # Lightning parses `devices` before it takes the strategy's parallel_devices
    else:
        devices = a.procs
    trainer = pl.Trainer(strategy=MegaTrainStrategy(**kw), accelerator=a.accelerator, devices=devices, max_steps=n_steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer])
    trainer.fit(LM(), DataLoader(TensorDataset(ids), batch_size=a.micro))
    rank = trainer.global_rank
    engine = trainer.strategy.engine
    hist = engine.history[a.warmup:]
    med = {k: statistics.median(h[k] for h in hist) for k in (hist[0] if hist else {})}
    with open("/proc/self/status") as f:
        hwm = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    res = {"rank": rank, "pid": os.getpid(), "world_size": trainer.world_size, "threads": timer.threads,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "n_params": n_params,
           "device": str(trainer.strategy.root_device), "sampler": type(trainer.train_dataloader.sampler).__name__,
           "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
           "measured_s": timer.t1 - timer.t0, "window_unix_s": [timer.w0, timer.w1], "step_s": timer.step_s,
           "tokens_per_step": global_batch * a.seq, "vm_hwm_bytes": hwm, "engine_median": med}
    engine.close()
    with open(os.path.join(a.worker, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


# ====================================================================== parent: launch, sample, report
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(root: int) -> list[int]:
    """``root`` and its descendants (from every /proc/PID/stat's parent pid)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def rollup(pid: int) -> dict[str, int]:
    """``Rss``, ``Pss``, ``Pss_Anon``, ``Pss_Shmem`` of one process (bytes) and its mapped /dev/shm/megatrain-* files {name: bytes}."""
    r: dict = {"shm": {}}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Pss_Anon", "Pss_Shmem"):
                r[k] = int(v.split()[0]) * 1024
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/dev/shm/megatrain-" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                name = line.split("/dev/shm/", 1)[1].split()[0]
                r["shm"][name] = r["shm"].get(name, 0) + hi - lo
    return r


def cpu_jiffies(pids: list[int]) -> tuple[int, int]:
    """(busy jiffies of the whole machine, utime + stime of ``pids``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(v) - v[3] - v[4]
    own = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read().rsplit(")", 1)[1].split()
            own += int(s[11]) + int(s[12])
        except (OSError, IndexError, ValueError):
            pass
    return busy, own


class Sampler(threading.Thread):
    """Samples the memory of a process tree every ``period`` seconds until :meth:`stop`."""

    def __init__(self, root: int, period: float):
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            pids = tree(self.root)
            tot = {"t": time.time(), "pss": 0, "rss": 0, "pss_anon": 0, "pss_shmem": 0, "procs": 0, "shm": {}}
            for p in pids:
                try:
                    r = rollup(p)
                except (OSError, ValueError):
                    continue
                tot["pss"] += r.get("Pss", 0)
                tot["rss"] += r.get("Rss", 0)
                tot["pss_anon"] += r.get("Pss_Anon", 0)
                tot["pss_shmem"] += r.get("Pss_Shmem", 0)
                tot["procs"] += 1
                tot["shm"].update(r["shm"])
            tot["jiffies"] = cpu_jiffies(pids)
            self.samples.append(tot)
            self.done.wait(self.period)

    def stop(self) -> None:
        self.done.set()
        self.join()


def launch(a, procs: int, micro: int, threads: int, shape: dict, tag: str, share: bool) -> dict:
    """One configuration: start rank 0 (Lightning starts the others), sample memory until it ends, gather."""
    out = tempfile.mkdtemp(prefix=f"scaling-{tag}-")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", out, "--procs", str(procs), "--micro", str(micro),
           "--accelerator", a.accelerator, "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--layers", str(shape["layers"]), "--hidden", str(shape["hidden"]), "--intermediate", str(shape["intermediate"]),
           "--heads", str(shape["heads"]), "--kv-heads", str(shape["kv_heads"]), "--vocab", str(shape["vocab"])]
    if a.process_group_backend:
        cmd += ["--process-group-backend", a.process_group_backend]
    if share:
        cmd += ["--share-device"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS"):
        env.pop(k, None)
    if threads and not a.lightning_threads:  # GPU mode (threads 0): Lightning's choice, cores // processes
        env["OMP_NUM_THREADS"] = str(threads)
        cmd += ["--threads", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid, a.sample_s)
    sampler.start()
    try:
        log, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        log += f"\n[scaling] timed out after {a.timeout:.0f} s"
    sampler.stop()
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(procs):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0 or len(ranks) != procs:
        print(log[-6000:])
        raise SystemExit(f"[scaling] {tag}: run failed (exit {proc.returncode}, {len(ranks)}/{procs} rank results)")
    r0 = ranks[0]
    s = sampler.samples
    # CPU used by processes outside the run during the measured window (interpolated to the nearest samples)
    w0, w1 = r0["window_unix_s"]
    inside = [x for x in s if w0 <= x["t"] <= w1] or s
    other = None
    if len(inside) >= 2:
        (b0, o0), (b1, o1) = inside[0]["jiffies"], inside[-1]["jiffies"]
        dt = inside[-1]["t"] - inside[0]["t"]
        other = max(0.0, (b1 - b0) - (o1 - o0)) / os.sysconf("SC_CLK_TCK") / dt if dt > 0 else None
    peak = lambda k, xs: max((x[k] for x in xs), default=0)  # noqa: E731
    return {"tag": tag, "processes": procs, "micro_batch_per_rank": micro, "threads_requested": threads if threads and not a.lightning_threads else None,
            "threads_per_rank": [r["threads"] for r in ranks], "omp_num_threads": [r["omp_num_threads"] for r in ranks],
            "devices": [r["device"] for r in ranks], "sampler": r0["sampler"], "backend": r0["backend"],
            "n_params": r0["n_params"], "tokens_per_step": r0["tokens_per_step"],
            "tokens_per_s": r0["tokens_per_step"] * a.steps / r0["measured_s"], "step_s": r0["step_s"],
            "peak_pss_sum_bytes": peak("pss", s), "peak_rss_sum_bytes": peak("rss", s),
            "peak_pss_anon_sum_bytes": peak("pss_anon", s), "peak_pss_shmem_sum_bytes": peak("pss_shmem", s),
            # the same during the measured steps only (steady state: after the store is built, the init weights freed)
            "train_pss_sum_bytes": peak("pss", inside), "train_rss_sum_bytes": peak("rss", inside),
            "train_median_pss_sum_bytes": statistics.median(x["pss"] for x in inside) if inside else 0,
            "train_median_rss_sum_bytes": statistics.median(x["rss"] for x in inside) if inside else 0,
            "train_pss_anon_sum_bytes": peak("pss_anon", inside), "train_pss_shmem_sum_bytes": peak("pss_shmem", inside),
            "shm_state_bytes": max((sum(x["shm"].values()) for x in s), default=0),
            "shm_files": sorted({k for x in s for k in x["shm"]}),
            "vm_hwm_sum_bytes": sum(r["vm_hwm_bytes"] for r in ranks), "samples": len(s), "wall_s": wall,
            "other_cores": other, "engine_median_rank0": r0["engine_median"],
            "timeline": {"t_s": [round(x["t"] - s[0]["t"], 2) for x in s], "pss": [x["pss"] for x in s],
                         "rss": [x["rss"] for x in s], "pss_shmem": [x["pss_shmem"] for x in s],
                         "measured_window_s": [w0 - s[0]["t"], w1 - s[0]["t"]]} if s else None}


def main() -> None:
    a = parse_args()
    if a.worker:
        worker(a)
        return
    gpu = a.accelerator == "gpu"
    sweep = gpu or a.sweep
    out = a.out or os.path.join(ROOT, "bench", "results", "scaling_gpu.json" if gpu else "scaling.json")
    shape = {"layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads,
             "kv_heads": a.kv_heads, "vocab": a.vocab}
    n_gpus = 0
    if gpu:
        import torch

        n_gpus = torch.cuda.device_count()
        if n_gpus == 0:
            raise SystemExit("[scaling] --accelerator gpu: no CUDA device visible; run on a GPU machine or drop the option")
        if a.devices > n_gpus and (a.process_group_backend or "nccl") == "nccl":
            raise SystemExit(f"[scaling] --devices {a.devices} > {n_gpus} visible GPU(s): the ranks would share GPU 0, "
                             "which NCCL refuses; add --process-group-backend gloo (exercises the CUDA code path, "
                             "not a scaling measurement) or run on a machine with enough GPUs")
    if gpu or a.sweep:
        plan = [(k, a.batch, None) for k in range(1, a.devices + 1)]  # weak scaling: micro-batch per rank fixed
    else:
        cores = a.cores or len(os.sched_getaffinity(0))
        if a.batch % a.devices or cores % a.devices:
            raise SystemExit(f"[scaling] --batch {a.batch} and the {cores} cores must divide by --devices {a.devices} "
                             "(same global batch and same cores in both rows)")
        plan = [(1, a.batch, cores), (a.devices, a.batch // a.devices, cores // a.devices)]
    rows = []
    for procs, micro, threads in plan:
        share = a.share_device or (gpu and procs > n_gpus)
        th = threads if threads is not None else 0
        name = f"{procs} proc x {threads} thr" if threads else f"{procs} {'GPU' if gpu else 'proc'}{'s' if procs > 1 else ''}"
        if share and procs > 1:
            name += " (one device)"
        if not a.no_baseline:
            print(f"[scaling] {name}: baseline (tiny model)", flush=True)
            base = launch(a, procs, micro, th, TINY, f"base{procs}", share)
        print(f"[scaling] {name}: {shape}", flush=True)
        row = launch(a, procs, micro, th, shape, f"run{procs}", share)
        row["name"], row["shared_device"] = name, bool(share and procs > 1)
        for when in ("peak", "train", "train_median"):  # whole run / measured steps (max, median)
            for kind in ("pss", "rss"):
                mine = row[f"{when}_{kind}_sum_bytes"]
                if not a.no_baseline:
                    row[f"baseline_{when}_{kind}_sum_bytes"] = base[f"{when}_{kind}_sum_bytes"]
                    row[f"model_{when}_{kind}_bytes_per_param"] = (mine - base[f"{when}_{kind}_sum_bytes"]) / row["n_params"]
        row["shm_bytes_per_param"] = row["shm_state_bytes"] / row["n_params"]
        rows.append(row)

    t1 = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / t1
        r["efficiency"] = r["tokens_per_s"] / (r["processes"] * t1) if sweep else None
    n = rows[0]["n_params"]
    gib = lambda b: b / 2**30  # noqa: E731
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"\nscaling: Llama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab} ({n / 1e6:.1f}M params; state "
          f"{STATE_BYTES_PER_PARAM} B/param = {gib(STATE_BYTES_PER_PARAM * n):.2f} GiB), fp32, {a.accelerator}, "
          + (f"global batch {a.batch} x {a.seq} tokens" if not sweep else f"batch {a.batch} x {a.seq} tokens per rank")
          + f", {a.warmup} warm-up + {a.steps} measured steps")
    hdr = (f"{'config':26s} {'thr/rank':>8s} {'tokens/s':>9s} {'speedup':>7s} {'eff':>5s} {'step s':>6s} {'reduce s':>8s} "
           f"{'PSS max':>7s} "
           f"{'PSS med':>7s} {'RSS max':>7s} {'shm':>5s} {'shm B/p':>7s} {'model B/p max':>13s} "
           f"{'model B/p med':>13s} {'(RSS max)':>9s} {'other cores':>11s}")
    print(hdr)
    for r in rows:
        print(f"{r['name']:26s} {','.join(str(t) for t in r['threads_per_rank']):>8s} {r['tokens_per_s']:9.1f} "
              f"{r['speedup']:7.2f} {fmt(r['efficiency'], '5.2f'):>5s} {statistics.median(r['step_s']):6.2f} "
              f"{r['engine_median_rank0'].get('megatrain/grad_reduce_s', 0.0):8.3f} {gib(r['train_pss_sum_bytes']):7.2f} "
              f"{gib(r['train_median_pss_sum_bytes']):7.2f} {gib(r['train_rss_sum_bytes']):7.2f} "
              f"{gib(r['shm_state_bytes']):5.2f} {r['shm_bytes_per_param']:7.1f} "
              f"{fmt(r.get('model_train_pss_bytes_per_param'), '13.1f'):>13s} "
              f"{fmt(r.get('model_train_median_pss_bytes_per_param'), '13.1f'):>13s} "
              f"{fmt(r.get('model_train_rss_bytes_per_param'), '9.1f'):>9s} {fmt(r['other_cores'], '11.2f'):>11s}")
    print("step s: median step time; reduce s: rank 0's time in the gradient all-reduce per step (engine statistic "
          "grad_reduce_s; gloo over loopback on CPU).")
    print("Host memory in GiB during the measured steps (max and median over the samples), summed over the node's "
          "processes at one sampling instant. PSS: proportional set size (a page shared by k processes counts 1/k in "
          "each: the sum counts the shared state once); RSS counts a shared page in every process that maps it (double "
          "counts; shown for comparison). shm: the node's shared state file (fp32 master, grad accumulator, exp_avg, "
          "exp_avg_sq; none with 1 process: private memory). model B/p: (PSS sum - the same processes with a tiny "
          f"model) / params, vs {STATE_BYTES_PER_PARAM} B/param of state; (RSS max): the same from the RSS sums.")
    for r in rows:
        if r["peak_pss_sum_bytes"] > 1.05 * r["train_pss_sum_bytes"]:
            print(f"NOTE {r['name']}: PSS sum peaked at {gib(r['peak_pss_sum_bytes']):.2f} GiB outside the measured steps "
                  "(start-up: the model's init weights and the store coexist)")
    if not sweep and len(rows) == 2 and not a.no_baseline:
        one, many = rows
        for when in ("train", "train_median"):
            extra = (many[f"model_{when}_pss_bytes_per_param"] - one[f"model_{when}_pss_bytes_per_param"]) * n
            print(f"{many['processes']} processes vs 1 ({'max' if when == 'train' else 'median'}): the model adds {gib(extra):+.2f} GiB ({extra / n:+.1f} "
                  f"B/param) to the node; a private state per process would add "
                  f"{gib((many['processes'] - 1) * STATE_BYTES_PER_PARAM * n):.2f} GiB "
                  f"({(many['processes'] - 1) * STATE_BYTES_PER_PARAM} B/param).")
    if sweep:
        if any(r["shared_device"] for r in rows):
            print("NOTE: the ranks shared one device" + (" (fewer GPUs than processes): this exercises the CUDA "
                  "data-parallel path; " if gpu else ": ") + "the efficiency column is NOT a scaling measurement "
                  "(that needs one GPU per process).")
        else:
            print(("" if gpu else "(--sweep on the CPU: a dry run of the GPU mode; the processes share the cores) ") +
                  "efficiency = tokens/s at k GPUs / (k x tokens/s at 1 GPU), fixed micro-batch per GPU (weak scaling).")
    busy = [r["other_cores"] for r in rows if r["other_cores"] is not None]
    if busy and max(busy) > 0.1:
        print(f"WARNING: other processes used up to {max(busy):.2f} cores during the measured steps: tokens/s are "
              "indicative only (memory columns are unaffected); rerun on an idle machine")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    import torch
    import transformers

    with open(out, "w") as f:
        json.dump({"bench": "scaling", "args": vars(a), "torch": torch.__version__, "transformers": transformers.__version__,
                   "cpu_count": os.cpu_count(), "gpus": n_gpus, "n_params": n,
                   "state_bytes_per_param_expected": STATE_BYTES_PER_PARAM, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
