"""Peer benchmark: strategy="megatrain" against plain PyTorch and an existing offload trainer.

What: one process, one device, the same Llama model (random init) and the same batch for every row:
  fp32     ours, Trainer(strategy=MegaTrainStrategy(), precision="32-true"), RAM tier (masters + AdamW in host RAM);
  bf16     ours, precision="bf16-mixed" (bf16 wire images and autocast, fp32 masters), RAM tier;
  nvme     ours, fp32, NVMe tier: MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme",
           nvme_path=--nvme-path) (masters, gradient accumulators, exp_avg, exp_avg_sq on disk: 16 B/param);
  plain    plain PyTorch loop: model on the device, Hugging Face activation checkpointing on every decoder
           layer, torch.optim.AdamW(fused=True), fp32; "does not fit" (with the bytes it needed) on CUDA OOM;
  offload  one existing offload trainer, fp32 + HF activation checkpointing: DeepSpeed ZeRO-3 with parameter and
           optimizer CPU offload through Lightning's DeepSpeedStrategy (DeepSpeedCPUAdam, AdamW mode) if
           `import deepspeed` works and its CPU Adam op builds/loads; otherwise torchao's CPUOffloadOptimizer
           (wrapping torch.optim.AdamW(fused=True) on the host, model on the device) in a plain loop. The JSON
           ("offload_choice") and the table say which ran and why the other did not (its exception text).
Every row uses AdamW lr 1e-4 and fp32 matmuls as torch defaults them (no TF32 unless --tf32).

Shapes: "0p9b" is bench/overhead.py's 0.9B shape (Llama, 16 layers, hidden 2048, intermediate 5632, 16 heads,
16 kv heads, vocab 32000, tied embeddings, 0.888B params, batch 8 x 1024 tokens). "max" is the largest Llama with
Llama-3-70B's layer shape (hidden 8192, intermediate 28672, 64 heads, 8 kv heads, vocab 128256, untied LM head)
whose fp32 training state (16 B/param: master, gradient, exp_avg, exp_avg_sq) fits --ram-fraction (0.6) of this
machine's host RAM (MemTotal of /proc/meminfo): layers = floor((0.6 x MemTotal / 16 B - non-layer params) /
params per layer), batch 8 x 1024. The chosen layer count and params are printed.

Reported per row (medians over --steps measured steps after --warmup unmeasured ones):
  step_s         seconds per optimizer step (forward + backward + AdamW), timed from the start to the end of each
                 batch with the device synchronised (ours and DeepSpeed: a Lightning Callback, as bench/overhead.py;
                 plain and torchao: around each loop iteration);
  tokens_per_s   batch x seq / step_s;
  model_TFLOPS   6 x params x tokens per step / step_s / 1e12, all parameters counted (embedding and LM head
                 included, tied ones once); the recompute of activation checkpointing is NOT counted (model FLOPs,
                 as the MegaTrain paper, arXiv 2604.05091, reports them; 6 = 2 forward + 4 backward FLOPs per
                 parameter per token, Kaplan et al. 2020); the JSON's model_TFLOPS_no_input_embedding leaves out
                 an untied input embedding (a lookup: 22% of the max shape's params);
  h2d_GBps/d2h_GBps  ours only: the engine's megatrain/h2d_bytes and megatrain/d2h_bytes of the step
                 (trainer.strategy.engine.history) / step_s / 1e9, against the raw pinned-copy bandwidth measured
                 in the same run (a 1 GiB pinned host tensor copied to the device and back, non_blocking, timed
                 with CUDA events, best of 5; GB = 1e9 bytes);
  /plain         step_s / the plain row's step_s (JSON: ratio_plain);
  peak_device_GiB  torch.cuda.max_memory_allocated over the row (statistics reset between rows; ours: read in
                 on_before_optimizer_step and at each batch end, because the engine resets them every step).
Each row runs in its own try/except (a failing row is reported, the others still run); memory is freed between
rows. The JSON is rewritten after every row, so a run stopped by a time limit keeps the rows it finished.

Run:
    python bench/peer.py                                  # CUDA: both shapes, every row (max shape: many minutes)
    python bench/peer.py --shapes 0p9b --steps 3 --warmup 1 --rows fp32,bf16,plain,offload,nvme
    python bench/peer.py --cpu-dry-run                    # every row on CPU at a tiny size (under 2 minutes)
Writes bench/results/peer.json (--out); the dry run writes bench/results/peer_cpu_dry_run.json.
"""

import argparse
import gc
import json
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
import traceback
import warnings

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from megatrain_lightning import MegaTrainStrategy

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROWS = {"fp32": "ours fp32, RAM tier", "bf16": "ours bf16-mixed, RAM tier", "nvme": "ours fp32, NVMe tier",
        "plain": "plain PyTorch + HF ckpt + fused AdamW", "offload": "offload trainer"}
SHAPES = {
    "0p9b": dict(layers=16, hidden=2048, intermediate=5632, heads=16, kv_heads=16, vocab=32000, tied=True, batch=8, seq=1024),
    "max": dict(layers=None, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256, tied=False, batch=8, seq=1024),
    "tiny": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, tied=False, batch=2, seq=32),
}
STATE_BYTES_PER_PARAM = 16  # fp32 master + gradient + exp_avg + exp_avg_sq

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--shapes", "--shape", default="0p9b,max", help="comma-separated: 0p9b, max (in that order by default)")
p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, run in this order: {','.join(ROWS)}")
p.add_argument("--steps", type=int, default=5, help="measured steps per row")
p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
p.add_argument("--batch", type=int, default=None, help="micro-batch size (default: the shape's, 8)")
p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the shape's, 1024)")
p.add_argument("--nvme-path", default=None, help="directory of the NVMe row's store (default: a new temporary directory)")
p.add_argument("--ram-fraction", type=float, default=0.6, help="share of MemTotal the max shape's 16 B/param may take")
p.add_argument("--time-budget", type=float, default=None, help="seconds: rows that would start after it are skipped")
p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls in every row (default: torch's fp32 default)")
p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: every core on CUDA, 1 on CPU)")
p.add_argument("--cpu-dry-run", action="store_true", help="tiny shape on the CPU: exercises every row, measures nothing")
p.add_argument("--out", default=None, help="JSON path (default bench/results/peer.json or peer_cpu_dry_run.json)")
args = p.parse_args()
assert args.steps >= 1 and args.warmup >= 0, "--steps must be >= 1 and --warmup >= 0"
rows_wanted = [r for r in args.rows.split(",") if r]
bad = [r for r in rows_wanted if r not in ROWS]
if bad:
    p.error(f"--rows: unknown {bad}; choose from {','.join(ROWS)}")
shapes_wanted = ["tiny"] if args.cpu_dry_run else [s for s in args.shapes.split(",") if s]
bad = [] if args.cpu_dry_run else [s for s in shapes_wanted if s not in ("0p9b", "max")]
if bad:
    p.error(f"--shapes: unknown {bad}; choose from 0p9b,max")
if not args.cpu_dry_run and not torch.cuda.is_available():
    p.error("no CUDA device: this benchmark compares trainers on a GPU; use --cpu-dry-run to exercise it on the CPU")
out_path = args.out or os.path.join(RESULTS, "peer_cpu_dry_run.json" if args.cpu_dry_run else "peer.json")

dev = torch.device("cpu" if args.cpu_dry_run else "cuda")
cuda = dev.type == "cuda"
# the dry run uses 1 thread: on a busy 2-core machine 2 OpenMP threads stall tiny ops (the plain row took 1.1 s/step)
torch.set_num_threads(args.threads or (1 if not cuda else os.cpu_count() or 1))
if args.tf32:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
T0 = time.perf_counter()


# ---------------------------------------------------------------- shapes
def llama_config(s: dict, layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=layers,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=max(2048, s["seq"]),
        tie_word_embeddings=s["tied"], rope_theta=500000 if s["vocab"] == 128256 else 100000, use_cache=False)


def count_params(cfg) -> int:
    with torch.device("meta"):
        return sum(t.numel() for t in transformers.AutoModelForCausalLM.from_config(cfg).parameters())


def mem_total_bytes() -> int:
    """MemTotal of /proc/meminfo in bytes (Linux)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def max_layers(s: dict) -> dict:
    """Largest layer count whose 16 B/param fits --ram-fraction x MemTotal (params from meta-device models)."""
    one, two = count_params(llama_config(s, 1)), count_params(llama_config(s, 2))
    per_layer, rest = two - one, 2 * one - two
    budget = args.ram_fraction * mem_total_bytes()
    layers = int((budget / STATE_BYTES_PER_PARAM - rest) // per_layer)
    if layers < 1:
        raise RuntimeError(f"--ram-fraction {args.ram_fraction} x MemTotal = {budget / 2**30:.1f} GiB holds no "
                           f"decoder layer of the max shape ({(rest + per_layer) * 16 / 2**30:.1f} GiB with one)")
    return {"layers": layers, "params": rest + layers * per_layer, "params_per_layer": per_layer, "non_layer_params": rest,
            "ram_budget_bytes": int(budget), "mem_total_bytes": mem_total_bytes()}


# ---------------------------------------------------------------- helpers
def sync():
    if cuda:
        torch.cuda.synchronize(dev)


def free():
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned blocks cached by torch's host allocator
            torch._C._host_emptyCache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak():
    return torch.cuda.max_memory_allocated(dev) if cuda else None


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


def pinned_bandwidth(nbytes: int = 2**30) -> dict | None:
    """Raw pinned-copy speed in GB/s (1e9 B/s): one ``nbytes`` pinned host tensor to the device and back,
    non_blocking copies timed with CUDA events, best of 5 each way. None on CPU."""
    if not cuda:
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    devt = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = {"h2d": float("inf"), "d2h": float("inf")}
    for _ in range(5):
        for way, (dst, src) in (("h2d", (devt, host)), ("d2h", (host, devt))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best[way] = min(best[way], start.elapsed_time(end) / 1e3)
    del host, devt
    free()
    return {"bytes": nbytes, "h2d_GBps": nbytes / best["h2d"] / 1e9, "d2h_GBps": nbytes / best["d2h"] / 1e9}


class LM(pl.LightningModule):
    def __init__(self, model, make_optimizer):
        super().__init__()
        self.model, self.make_optimizer = model, make_optimizer

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


class StepTimer(pl.Callback):
    """Seconds of every batch after the warm-up (device synchronised), and the device peak over them."""

    def __init__(self):
        self.times, self.peak, self.t0 = [], 0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync()
        self.t0 = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if cuda:  # the megatrain engine resets CUDA's peak statistics at every step: read them before
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(dev))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync()
        if batch_idx >= args.warmup:
            self.times.append(time.perf_counter() - self.t0)
        if cuda:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(dev))


def checkpointing(model):
    # transformers >= 5.20 names it activation_checkpointing_enable (gradient_checkpointing_enable: the older alias)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


# ---------------------------------------------------------------- rows
def run_trainer(make_model, strategy, precision: str, make_optimizer, engine: bool) -> dict:
    """Warm-up + measured steps through lightning.Trainer; engine history for ours."""
    lm = LM(make_model(), make_optimizer)
    timer = StepTimer()
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=1, precision=precision,
                         max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    try:
        trainer.fit(lm, DataLoader(TensorDataset(IDS), batch_size=BATCH))
        hist = trainer.strategy.engine.history[args.warmup:] if engine else []
    finally:
        eng = getattr(trainer.strategy, "engine", None) if engine else None
        if eng is not None:
            eng.close()
    return {"times": timer.times, "peak": timer.peak if cuda else None, "hist": hist}


def run_loop(make_model, make_optimizer) -> dict:
    """Plain PyTorch: model on the device, HF checkpointing, the given optimizer, timed around each iteration."""
    model = checkpointing(make_model().to(dev))
    model.train()
    opt = make_optimizer(model.parameters())
    times = []
    for i in range(args.warmup + args.steps):
        ids = IDS[i * BATCH:(i + 1) * BATCH].to(dev)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times, "peak": peak(), "hist": []}


def oom_row(e: BaseException) -> dict:
    """A CUDA out-of-memory error as a "does not fit" row: bytes allocated when it failed + the failed request."""
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)", str(e))
    tried = float(m.group(1)) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)] if m else None
    held = torch.cuda.memory_allocated(dev) if cuda else 0
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else None
    return {"status": "does not fit", "why": err(e)[:400], "needed_bytes_at_least": None if tried is None else int(held + tried),
            "device_total_bytes": total, "state_bytes_16_per_param": STATE_BYTES_PER_PARAM * N_PARAMS}


def deepspeed_ready() -> None:
    """Raises unless DeepSpeed imports and its CPU Adam op builds/loads (JIT: needs ninja, a C++ compiler, Python.h)."""
    import deepspeed  # noqa: F401
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load(verbose=False)


def run_deepspeed(make_model) -> dict:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    make_opt = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, adamw_mode=True)  # noqa: E731
    try:
        return run_trainer(lambda: checkpointing(make_model()), strategy, "32-true", make_opt, engine=False)
    finally:  # the rows after it run without a process group, as before it
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_torchao(make_model) -> dict:
    from torchao.optim import CPUOffloadOptimizer

    # probe the constructor on a tiny parameter first: on a CPU-only machine it refuses (CUDA/XPU only) before
    # the model is built
    CPUOffloadOptimizer([torch.nn.Parameter(torch.zeros(8192, device=dev))], torch.optim.AdamW, lr=1e-4, fused=True)
    return run_loop(make_model, lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, lr=1e-4, fused=True))


def run_offload(make_model) -> dict:
    """DeepSpeed ZeRO-3 + CPU offload if its CPU Adam loads, else torchao's CPUOffloadOptimizer."""
    why_not = {}
    try:
        deepspeed_ready()
    except Exception as e:  # noqa: BLE001 - the reason goes into the report
        why_not["deepspeed"] = err(e)
    for name, fn in (("deepspeed", run_deepspeed), ("torchao", run_torchao)):
        if name in why_not:
            continue
        try:
            res = fn(make_model)
            return {**res, "trainer": name, "why_not": why_not}
        except torch.cuda.OutOfMemoryError as e:
            return {**oom_row(e), "trainer": name, "why_not": why_not}
        except Exception as e:  # noqa: BLE001
            why_not[name] = err(e)
            if cuda:  # on the CPU both refuse by design (CUDA only): the reason line says it
                traceback.print_exc()
            free()
    return {"status": "skipped", "trainer": None, "why_not": why_not,
            "why": "; ".join(f"{k}: {v}" for k, v in why_not.items())}


def run_row(key: str, make_model) -> dict:
    if key == "fp32":
        return run_trainer(make_model, MegaTrainStrategy(), "32-true", adamw, engine=True)
    if key == "bf16":
        return run_trainer(make_model, MegaTrainStrategy(), "bf16-mixed", adamw, engine=True)
    if key == "nvme":
        path = args.nvme_path or tempfile.mkdtemp(prefix="peer_nvme_")
        os.makedirs(path, exist_ok=True)
        need, free_b = STATE_BYTES_PER_PARAM * N_PARAMS, shutil.disk_usage(path).free
        if free_b < 1.05 * need:
            if args.nvme_path is None:
                shutil.rmtree(path, ignore_errors=True)
            return {"status": "does not fit", "why": f"the NVMe store needs {need / 2**30:.1f} GiB (16 B/param) under "
                    f"{path}, {free_b / 2**30:.1f} GiB free: pass --nvme-path on a larger disk", "needed_bytes_at_least": need}
        try:
            strategy = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=path)
            res = run_trainer(make_model, strategy, "32-true", adamw, engine=True)
        finally:
            if args.nvme_path is None:
                shutil.rmtree(path, ignore_errors=True)
        return {**res, "nvme_path": path}
    if key == "plain":
        return run_loop(make_model, adamw)
    return run_offload(make_model)


def summarise(key: str, res: dict, seconds: float) -> dict:
    times, hist = res.pop("times", None), res.pop("hist", None) or []
    pk = res.pop("peak", None)
    row = {"row": key, "name": ROWS[key], "status": res.pop("status", "ok"), "seconds": seconds,
           "torch_threads": torch.get_num_threads(), **res}
    if key == "offload" and row.get("trainer"):
        row["name"] = {"deepspeed": "DeepSpeed ZeRO-3 CPU offload", "torchao": "torchao CPUOffloadOptimizer"}[row["trainer"]]
    if not times:
        return row
    step = statistics.median(times)
    row.update(step_s_all=times, step_s=step, tokens_per_s=TOKENS / step, model_TFLOPS=6 * N_PARAMS * TOKENS / step / 1e12,
               model_TFLOPS_no_input_embedding=6 * (N_PARAMS - N_LOOKUP) * TOKENS / step / 1e12, peak_device_bytes=pk)
    if hist:
        for k in ("h2d_bytes", "d2h_bytes", "peak_device_bytes", "wait_s", "optimizer_s", "compute_s", "recompute_s"):
            row["engine_" + k] = statistics.median(h["megatrain/" + k] for h in hist)
        row["h2d_GBps"] = row["engine_h2d_bytes"] / step / 1e9
        row["d2h_GBps"] = row["engine_d2h_bytes"] / step / 1e9
        if cuda:
            row["peak_device_bytes"] = max(pk or 0, max(h["megatrain/peak_device_bytes"] for h in hist))
    return row


def fmt(v, f):
    return "-" if v is None else format(v, f)


def table(name: str, sh: dict) -> None:
    s = sh["shape"]
    print(f"\npeer [{name}]: Llama {s['layers']} layers, hidden {s['hidden']}, {sh['n_params'] / 1e6:,.2f}M params, batch "
          f"{s['batch']} x {s['seq']}, {dev.type}"
          + (f", raw pinned H2D {RAW['h2d_GBps']:.1f} GB/s, D2H {RAW['d2h_GBps']:.1f} GB/s" if RAW else ""))
    print(f"{'row':38s} {'status':12s} {'step s':>8s} {'/plain':>6s} {'tok/s':>9s} {'TFLOPS':>7s} {'H2D GB/s':>9s} {'D2H GB/s':>9s} "
          f"{'peak GiB':>8s}  note")
    for r in sh["rows"]:
        pk = r.get("peak_device_bytes")
        note = r.get("why", "")
        if r["row"] == "offload" and r.get("why_not"):
            note = (f"ran {r['trainer']}; " if r.get("trainer") else "") + "; ".join(f"{k}: {v}" for k, v in r["why_not"].items())
        print(f"{r['name'][:38]:38s} {r['status']:12s} {fmt(r.get('step_s'), '8.3f'):>8s} {fmt(r.get('ratio_plain'), '6.2f'):>6s} "
              f"{fmt(r.get('tokens_per_s'), '9.0f'):>9s} "
              f"{fmt(r.get('model_TFLOPS'), '7.2f'):>7s} {fmt(r.get('h2d_GBps'), '9.2f'):>9s} {fmt(r.get('d2h_GBps'), '9.2f'):>9s} "
              f"{fmt(None if pk is None else pk / 2**30, '8.2f'):>8s}  {note[:160]}")


def write(report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(out_path + ".tmp", out_path)


# ---------------------------------------------------------------- main
report = {"bench": "peer", "args": vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
          "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "threads": torch.get_num_threads(),
          "tf32": args.tf32, "shapes": {}}
try:
    report["max_shape_plan"] = max_layers(SHAPES["max"])
    mp = report["max_shape_plan"]
    print(f"max shape on this machine: {mp['layers']} layers of Llama-3-70B's shape, {mp['params'] / 1e9:.2f}B params, "
          f"{STATE_BYTES_PER_PARAM * mp['params'] / 2**30:.1f} GiB of fp32 state <= {args.ram_fraction} x MemTotal "
          f"({mp['mem_total_bytes'] / 2**30:.1f} GiB)", flush=True)
except (OSError, RuntimeError) as e:
    report["max_shape_plan"] = {"error": err(e)}
    print(f"max shape: {err(e)}", flush=True)
RAW = None
try:
    RAW = pinned_bandwidth()
except Exception as e:  # noqa: BLE001
    report["raw_pinned_error"] = err(e)
report["raw_pinned"] = RAW

for shape_name in shapes_wanted:
    s = dict(SHAPES[shape_name])
    if shape_name == "max":
        if "layers" not in report["max_shape_plan"]:
            report["shapes"]["max"] = {"error": report["max_shape_plan"]["error"]}
            continue
        s["layers"] = report["max_shape_plan"]["layers"]
    s["batch"], s["seq"] = args.batch or s["batch"], args.seq or s["seq"]
    BATCH, TOKENS = s["batch"], s["batch"] * s["seq"]
    cfg = llama_config(s, s["layers"])
    N_PARAMS = count_params(cfg)
    N_LOOKUP = 0 if s["tied"] else s["vocab"] * s["hidden"]  # an untied input embedding is a lookup, not a matmul
    IDS = torch.randint(0, s["vocab"], ((args.warmup + args.steps) * BATCH, s["seq"]), generator=torch.Generator().manual_seed(1))

    def make_model(cfg=cfg):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    sh = report["shapes"][shape_name] = {"shape": s, "n_params": N_PARAMS, "tokens_per_step": TOKENS, "rows": []}
    print(f"\n== shape {shape_name}: {s['layers']} layers, {N_PARAMS / 1e6:,.2f}M params, batch {BATCH} x {s['seq']}", flush=True)
    for key in rows_wanted:
        t0 = time.perf_counter()
        if args.time_budget is not None and t0 - T0 > args.time_budget:
            row = {"row": key, "name": ROWS[key], "status": "skipped", "why": f"--time-budget {args.time_budget:.0f}s spent"}
        else:
            free()
            try:
                res = run_row(key, make_model)
            except torch.cuda.OutOfMemoryError as e:
                res = oom_row(e)
            except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                traceback.print_exc()
                res = {"status": "failed", "why": err(e)}
            row = summarise(key, res, time.perf_counter() - t0)
            res = None
            free()
        sh["rows"].append(row)
        print(f"  {row['name']}: {row['status']}"
              + (f", median step {row['step_s']:.3f} s" if "step_s" in row else f" ({row.get('why', '')[:200]})")
              + f" [{row.get('seconds', 0):.0f} s]", flush=True)
        write(report)
    by = {r["row"]: r for r in sh["rows"]}
    if "plain" in by and by["plain"].get("step_s"):
        for r in sh["rows"]:
            if r.get("step_s"):
                r["ratio_plain"] = r["step_s"] / by["plain"]["step_s"]

ours_ok = all(r["status"] == "ok" for sh in report["shapes"].values() for r in sh.get("rows", [])
              if r["row"] in ("fp32", "bf16", "nvme") and not r.get("why", "").startswith("--time-budget"))
no_crash = all(r["status"] != "failed" for sh in report["shapes"].values() for r in sh.get("rows", []))
ran_any = any(r["status"] == "ok" for sh in report["shapes"].values() for r in sh.get("rows", []))
report["pass"] = ours_ok and no_crash and ran_any
report["total_s"] = time.perf_counter() - T0
for name, sh in report["shapes"].items():
    if "rows" in sh:
        table(name, sh)
print(f"\npeer: {'PASS' if report['pass'] else 'FAIL'} (ours ran every row: {ours_ok}; no row crashed: {no_crash}; "
      f"some row ran: {ran_any}); "
      f"{report['total_s']:.0f} s" + (" [cpu dry run: the numbers mean nothing]" if args.cpu_dry_run else ""))
write(report)
print(f"wrote {out_path}")
