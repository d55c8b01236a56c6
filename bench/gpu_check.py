"""CUDA acceptance checks of strategy="megatrain", run in sequence in one Python process (bench/gpu_check.sh).

torch and Lightning are imported once. Every check ends in one JSON row ``{"check", "result": PASS | FAIL | SKIP,
"seconds", "limit_s", "elapsed_s", "numbers", ...}`` appended to ``gpu_check.jsonl`` (flushed and fsync-ed) as soon
as the check ends, and ``gpu_check.json`` (every row so far) is rewritten then: a run stopped at its limit keeps
what it measured. Both go to ``$OUT`` when it is set, else to the results folder (``bench/results/`` on a GPU,
``${TMPDIR:-/tmp}/gpu_check_dryrun`` for ``--cpu-dry-run``). A check that raises is a FAIL row with the tail of its
traceback, and the run goes on. ``gpu_check.jsonl`` holds this run's rows; ``gpu_check.json`` also keeps the
rows an earlier run of the same mode wrote for checks this run did not select. Every check has its own time limit
(seconds, ``LIMITS_S``; x 2 in the dry run) inside the global budget (``GPU_CHECK_BUDGET_S``, default 420 s,
counted from ``GPU_CHECK_START``, the wrapper's start, so the imports count); a check is a SKIP row when less than
``NEED_S`` seconds are left. Past its limit a check gets a
``TimeoutError`` (SIGALRM); one that does not return to Python within ``HANG_GRACE_S`` more (blocked in CUDA or
NCCL) is written FAIL with every thread's stack, the remaining checks SKIP, and the process exits.

Default checks, in priority order:

* ``env``:          torch / CUDA / device name, transformers and Lightning versions.
* ``stream_parity``: the tiny ``llama_tied`` model (megatrain_lightning.testing) trained through the strategy
                    against plain PyTorch on the same device (megatrain_lightning.testing.reference_train; TF32 off,
                    eager attention, deterministic cuBLAS), 10 steps (dry run 3), with ``recompute="block"``,
                    ``recompute="none"`` + ``offload_activations``, ``recompute="selective"`` +
                    ``offload_activations``, and ``bf16-mixed``. Each configuration runs twice: plain, and with
                    delays queued by ``torch.cuda._sleep`` on the H2D stream before every H2D copy
                    (``to_device``, ``restore_async``), on the D2H stream before every D2H copy (``stage_grads``,
                    ``offload``) and on the compute stream before the compute stream waits for a copy or produces
                    gradients and activations for one (dry run: ``time.sleep`` of 2 ms in the same wrappers). On
                    CUDA every run is under ``torch.cuda.set_sync_debug_mode("warn")``: the synchronizing calls that
                    reach Python's warnings are counted per source line (reported, not gated). PASS: fp32 runs within 1e-5 relative of plain PyTorch (every loss,
                    every weight), the bf16-mixed run with delays within 1e-5 of the one without (bitwise
                    reported), and the delays really queued.
* ``nccl_group``:   a one-rank process group (NCCL bound to cuda:0; dry run: gloo) on a free TCP port of 127.0.0.1,
                    ``ProcessGroups.create`` on it, and one gradient batch (fp32 wire, then bf16) through the
                    transport's ``stage_grads`` with the engine's ``GradReducer`` as its reduce, called from a
                    thread that is not the main one while the compute stream is delayed by ``torch.cuda._sleep``
                    before it writes the gradients (dry run: the host reduce on the gloo group, as a CPU device
                    does). PASS: done within its limit, the reduced batch bitwise the gradients (the mean over one
                    rank) and the presence flags right.
* ``phases``:       phase timing of a Llama 16 layers x hidden 2048 (0.9B parameters; dry run: 2 x 64) in fp32
                    and bf16-mixed at batch 1 x 512 and 8 x 1024 tokens (dry run: 1 x 16, 2 x 32): per step the
                    forward and backward seconds (host clock, CUDA synchronized at the phase boundaries), the
                    engine's ``optimizer_s``, ``grad_add_s``, ``d2h_busy_s``, model TFLOPS (6 x params x tokens / step
                    seconds) and the planner's step-time estimate for the same shape on the h200 preset
                    (dry run: this_machine); one step under ``torch.profiler`` saved as ``phases_trace.json``
                    (gzipped when over 8 MB; CPU activity only in the dry run). PASS: every step ran.
* ``nvme``:         the NVMe tier: llama 8 layers, 10 steps (dry run: 4 layers, 2 steps), RAM tier vs ``offload_params="nvme",
                    offload_optimizer="nvme"`` under a ``host_memory_limit`` of 600,000 bytes that forces eviction,
                    without and with accumulation 3 + norm clipping. PASS: losses and weights bitwise equal.
* ``depth``:        device peak of one step of the StreamingEngine vs depth, bench/memory_depth.py's ``run``
                    (imported) and shape (Llama hidden 256, batch 2 x 256, fp32) at 4, 16, 40 and 80 layers with
                    ``offload_activations`` and at 4 and 80 without (dry run: hidden 64, batch 2 x 32, 2, 4 and 8
                    layers, its CPU meter: the profiler's allocation events less the offloaded copies). PASS: with
                    offload the peak grows < 10% from the shallowest to the deepest model.

Further checks, by name only (bench/gpu_check_extra.py): pytest, parity, precision, memory, overlap, d2h,
overhead, recompute, pinned, long, scaling, peer.

Usage: ``python bench/gpu_check.py [--cpu-dry-run] [CHECK ...]`` (normally through bench/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import gzip
import io
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: gpu_check_extra
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

DEFAULT = ["env", "stream_parity", "nccl_group", "phases", "nvme", "depth"]
#: seconds each default check may take on the H200 (and on 2 CPU cores in the dry run)
LIMITS_S = {"env": 15, "stream_parity": 100, "nccl_group": 45, "phases": 120, "nvme": 50, "depth": 50}
DRY_RUN_SCALE = 2  # the dry run's limits: these x 2 (2 CPU cores, often shared with other work)
#: seconds of its limit a check needs left to be started (else SKIP)
NEED_S = {"env": 5, "stream_parity": 60, "nccl_group": 20, "phases": 60, "nvme": 30, "depth": 25}
HANG_GRACE_S = 20  # seconds past its limit before a check that ignores SIGALRM is declared hung
END_MARGIN_S = 8  # seconds of the budget kept for writing the last rows and exiting
TOL = 1e-5


# ---------------------------------------------------------------- rows
class Rows:
    """The rows of this run: each appended to ``<out>/gpu_check.jsonl`` (flush + fsync) as it ends, and
    ``<out>/gpu_check.json`` rewritten after each (this run's rows, plus the rows an earlier run of the same
    mode wrote for checks this run does not select)."""

    def __init__(self, out: str, mode: str, budget_s: float, start: float):
        self.out, self.mode, self.budget_s, self.start = out, mode, budget_s, start
        os.makedirs(out, exist_ok=True)
        self.jsonl = os.path.join(out, "gpu_check.jsonl")
        self.json = os.path.join(out, "gpu_check.json")
        self.rows: list[dict] = []
        self.lock = threading.Lock()
        self.earlier: list[dict] = []
        try:
            with open(self.json) as f:
                old = json.load(f)
            if old.get("mode") == mode:
                self.earlier = old.get("rows", [])
        except (OSError, ValueError):
            pass
        open(self.jsonl, "w").close()

    def write(self, row: dict) -> None:
        with self.lock:
            row = {"check": row.pop("check"), **row, "elapsed_s": round(time.time() - self.start, 1)}
            line = json.dumps(row, default=str)
            with open(self.jsonl, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.rows.append(json.loads(line))
            names = {r["check"] for r in self.rows}
            doc = {"mode": self.mode, "budget_s": self.budget_s, "elapsed_s": row["elapsed_s"],
                   "rows": [r for r in self.earlier if r["check"] not in names] + self.rows}
            tmp = self.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1, default=str)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.json)
            print(f"[{row['check']}] {row['result']} in {row.get('seconds', 0):.1f}s "
                  f"({row['elapsed_s']:.0f}s of {self.budget_s:.0f}s)", flush=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def table(rows: list[dict]) -> str:
    lines = [f"{'check':14s} {'result':6s} {'sec':>6s}  key numbers"]
    for r in rows:
        nums = r.get("numbers") or {k: r[k] for k in ("why", "error") if k in r}
        lines.append(f"{r['check']:14s} {r['result']:6s} {r.get('seconds', 0):6.1f}  {_fmt(nums)[:400]}")
    return "\n".join(lines)


# ---------------------------------------------------------------- helpers
def device(a) -> str:
    return "cpu" if a.cpu_dry_run else "cuda"


def sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def make_trainer(dev: str, steps: int, precision: str = "32-true", callbacks=(), **strategy_kwargs):
    import lightning.pytorch as pl

    from megatrain_lightning import MegaTrainStrategy

    return pl.Trainer(strategy=MegaTrainStrategy(**strategy_kwargs), accelerator="gpu" if dev == "cuda" else "cpu",
                      devices=1, max_steps=steps, precision=precision, enable_checkpointing=False, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))


def deterministic() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


class StreamDelays:
    """Delays queued on the transport's streams before its copies, to widen any race between them.

    While active, the methods of :class:`CUDATransport` / :class:`CPUTransport` (engine/transport.py) that issue
    copies are wrapped: before ``to_device`` and ``restore_async`` the H2D stream sleeps ``copy_cycles`` GPU clock
    cycles (``torch.cuda._sleep``); before ``stage_grads`` the compute stream sleeps ``compute_cycles`` (the
    gradients are packed after it) and the D2H stream ``copy_cycles``; before ``offload`` the compute and D2H
    streams sleep; before ``ready`` (the compute stream waits for an H2D copy) the compute stream sleeps. On CPU
    each delay is a ``time.sleep`` of ``cpu_s`` seconds in the same place.

    Attributes:
        counts: delays queued per stream (``h2d``, ``d2h``, ``compute``).
    """

    def __init__(self, copy_cycles: int = 2_000_000, compute_cycles: int = 5_000_000, cpu_s: float = 0.002):
        self.copy_cycles, self.compute_cycles, self.cpu_s = copy_cycles, compute_cycles, cpu_s
        self.counts = {"h2d": 0, "d2h": 0, "compute": 0}
        self._saved: list = []
        self._lock = threading.Lock()

    def delay(self, transport, stream: str) -> None:
        import torch

        with self._lock:
            self.counts[stream] += 1
        if transport.device.type != "cuda":
            time.sleep(self.cpu_s)
            return
        s = {"h2d": getattr(transport, "h2d_stream", None), "d2h": getattr(transport, "d2h_stream", None),
             "compute": None}[stream]
        if s is None:  # the compute stream: the calling thread's current stream
            s = torch.cuda.current_stream(transport.device)
        with torch.cuda.device(transport.device), torch.cuda.stream(s):
            torch.cuda._sleep(self.compute_cycles if stream == "compute" else self.copy_cycles)

    def __enter__(self) -> "StreamDelays":
        from megatrain_lightning.engine import transport as tmod

        plan = {"to_device": ("h2d",), "restore_async": ("h2d",), "stage_grads": ("compute", "d2h"),
                "offload": ("compute", "d2h"), "ready": ("compute",)}
        for cls in (tmod.CUDATransport, tmod.CPUTransport):
            for name, streams in plan.items():
                orig = cls.__dict__[name]

                def wrapped(self_, *args, _orig=orig, _streams=streams, **kw):
                    for s in _streams:
                        self.delay(self_, s)
                    return _orig(self_, *args, **kw)

                self._saved.append((cls, name, orig))
                setattr(cls, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, orig in reversed(self._saved):
            setattr(cls, name, orig)
        self._saved.clear()


@contextmanager
def sync_warnings(dev: str):
    """On CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` inside, and the synchronizing calls it reports counted
    per source line (``{"total": n, "by_line": {"file:line": n}}``, yielded, filled on exit). On CPU: ``None``."""
    import warnings

    import torch

    if dev != "cuda":
        yield None
        return
    out: dict = {"total": 0, "by_line": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield out
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" not in str(w.message):
            continue
        key = f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}"
        out["total"] += 1
        out["by_line"][key] = out["by_line"].get(key, 0) + 1
    out["by_line"] = dict(sorted(out["by_line"].items(), key=lambda kv: -kv[1])[:8])


# ---------------------------------------------------------------- checks
def check_env(a) -> dict:
    import lightning
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    env = {"torch": torch.__version__, "cuda_available": cuda, "torch_cuda": torch.version.cuda,
           "device_name": torch.cuda.get_device_name(0) if cuda else None, "transformers": transformers.__version__,
           "lightning": lightning.__version__, "cpu_threads": torch.get_num_threads(),
           "import_s": round(a.import_s, 1)}
    return {"result": "PASS" if cuda or a.cpu_dry_run else "FAIL", "numbers": env}


PARITY_CONFIGS = {
    "block": ("32-true", {"recompute": "block"}),
    "none_offload": ("32-true", {"recompute": "none", "offload_activations": True}),
    "selective_offload": ("32-true", {"recompute": "selective", "offload_activations": True}),
    "bf16": ("bf16-mixed", {}),
}


def _train(dev: str, steps: int, precision: str, kw: dict, delays: bool):
    """One strategy run of the tiny llama_tied model; returns (LM, delay counts or None, sync warnings or None)."""
    import torch
    from megatrain_lightning.testing import LM, freeze_key_biases, make_data, make_model

    model = make_model("llama_tied")
    freeze_key_biases(model)
    lm = LM(model, total_steps=steps)
    torch.manual_seed(0)
    tr = make_trainer(dev, steps, precision, **kw)
    d = StreamDelays() if delays else None
    with sync_warnings(dev) as sw:
        if d is not None:
            with d:
                tr.fit(lm, make_data(n=2 * steps))
        else:
            tr.fit(lm, make_data(n=2 * steps))
        sync(dev)
    ran_on = tr.strategy.engine.device.type
    tr.strategy.engine.close()
    if ran_on != dev:
        raise RuntimeError(f"the engine ran on {ran_on}, not {dev}")
    return lm, (d.counts if d else None), sw


def _errors(lm, losses_ref: list[float], params_ref: dict) -> tuple[float, float, bool]:
    """(max relative loss error, max relative weight error, bitwise) of ``lm`` against the reference."""
    import torch
    from megatrain_lightning.testing import rel

    if len(lm.losses) != len(losses_ref):
        return float("inf"), float("inf"), False
    loss_err = max(abs(x - y) / abs(y) for x, y in zip(lm.losses, losses_ref))
    w_err, bitwise = 0.0, lm.losses == losses_ref
    for k, p in lm.model.named_parameters():
        q = params_ref[k]
        w_err = max(w_err, rel(p.detach().float().cpu(), q.float()))
        bitwise = bitwise and torch.equal(p.detach().cpu(), q)
    return loss_err, w_err, bitwise


def check_stream_parity(a) -> dict:
    import torch
    import torch.utils.checkpoint
    from megatrain_lightning.testing import freeze_key_biases, make_data, make_model, reference_train

    from gpu_check_extra import OnDevice

    dev = device(a)
    deterministic()
    steps = 3 if a.cpu_dry_run else 10
    names = a.parity_configs.split(",") if a.parity_configs else list(PARITY_CONFIGS)
    ref = make_model("llama_tied")
    freeze_key_biases(ref)
    ref.to(dev)
    torch.manual_seed(0)
    ref_losses = reference_train(ref, OnDevice(make_data(n=2 * steps), dev), steps)
    ref_params = {k: p.detach().cpu().clone() for k, p in ref.named_parameters()}
    del ref
    rows, sync_total, not_run = [], 0, {}
    for name in names:
        precision, kw = PARITY_CONFIGS[name]
        if kw.get("recompute") in ("selective", "auto") and not hasattr(torch.utils.checkpoint, "_RECOMPUTE"):
            # the strategy refuses it at setup on this torch (config.check_recompute): reported, not run
            not_run[name] = f"torch {torch.__version__} lacks torch.utils.checkpoint._RECOMPUTE"
            print(f"  {name:18s} not run: {not_run[name]}", flush=True)
            continue
        t0 = time.perf_counter()
        plain, _, sw_plain = _train(dev, steps, precision, kw, delays=False)
        delayed, counts, sw_delayed = _train(dev, steps, precision, kw, delays=True)
        row = {"config": name, "precision": precision, **kw, "delays": counts}
        if precision == "32-true":
            lp, wp, _ = _errors(plain, ref_losses, ref_params)
            ld, wd, _ = _errors(delayed, ref_losses, ref_params)
            row.update(loss_rel_err=max(lp, ld), weight_rel_err=max(wp, wd), against="plain PyTorch")
        else:  # against the same strategy run without delays
            plain_params = {k: p.detach().cpu().clone() for k, p in plain.model.named_parameters()}
            ld, wd, bitwise = _errors(delayed, plain.losses, plain_params)
            lr_, wr, _ = _errors(plain, ref_losses, ref_params)
            row.update(loss_rel_err=ld, weight_rel_err=wd, bitwise=bitwise, against="the run without delays",
                       loss_rel_err_vs_fp32_pytorch=lr_, weight_rel_err_vs_fp32_pytorch=wr)
        for tag, sw in (("plain", sw_plain), ("delayed", sw_delayed)):
            if sw is not None:
                row[f"sync_warnings_{tag}"] = sw
                sync_total += sw["total"]
        row["pass"] = (row["loss_rel_err"] <= TOL and row["weight_rel_err"] <= TOL and len(delayed.losses) == steps
                       and counts["h2d"] > 0 and counts["d2h"] > 0 and counts["compute"] > 0)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"  {name:18s} loss {row['loss_rel_err']:.2e} weight {row['weight_rel_err']:.2e} delays {counts} "
              f"{'ok' if row['pass'] else 'FAIL'}", flush=True)
        del plain, delayed
        gc.collect()
    nums = {"configs_passed": f"{sum(r['pass'] for r in rows)}/{len(rows)}",
            "max_loss_rel_err": max(r["loss_rel_err"] for r in rows),
            "max_weight_rel_err": max(r["weight_rel_err"] for r in rows), "steps": steps,
            "sync_warnings": sync_total if dev == "cuda" else None, "not_run": not_run or None}
    return {"result": "PASS" if rows and all(r["pass"] for r in rows) else "FAIL", "numbers": nums, "details": rows}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_nccl_group(a) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from megatrain_lightning.engine.reduce import GradReducer
    from megatrain_lightning.engine.transport import make_transport
    from megatrain_lightning.parallel.groups import ProcessGroups

    dev = torch.device(device(a), 0) if not a.cpu_dry_run else torch.device("cpu")
    cuda = dev.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    port = _free_port()
    kw = {"device_id": dev} if cuda else {}
    t0 = time.perf_counter()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60), **kw)
    try:
        groups = ProcessGroups.create(0, 1, 0, 1, timeout=timedelta(seconds=30))
        red = GradReducer(groups.grads, groups.node_grads, groups.cross_grads, 0, 1,
                          device_side=groups.backend == "nccl", guard=groups.guard)
        init_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(3)
        shapes = [torch.Size([64, 48]), torch.Size([300]), torch.Size([16, 8])]
        src = [torch.randn(s, generator=g).to(dev) for s in shapes]
        tr = make_transport(dev, staging_numel=sum(s.numel() for s in shapes) + len(shapes))
        runs = []
        for wire in (torch.float32, torch.bfloat16):
            # the gradients: a NaN-filled buffer, then (compute stream delayed) overwritten with the values; a copy
            # or reduce not ordered after the compute stream reads NaN
            grads = []
            for s in src[:2]:
                buf = torch.full_like(s, float("nan"))
                if cuda:
                    torch.cuda._sleep(20_000_000)  # ~10 ms of the compute stream before the values land
                else:
                    time.sleep(0.01)
                buf.copy_(s)
                grads.append(buf)
            grads.append(None)  # no gradient on this rank: zeros + presence flag 0
            packed = red.pack(grads, shapes, dev, torch.float32)
            n_flags = packed[-1].numel()
            got: dict = {}

            def reduce_batch(packed=packed, wire=wire, n_flags=n_flags, got=got):
                th0 = time.perf_counter()
                try:
                    if red.device_side:
                        copy_ = tr.stage_grads(packed, wire, reduce=lambda flat: red.reduce_device(flat, n_flags, 0, True))
                        host = copy_.wait()
                    else:  # a CPU device: copy (conversion) first, the reduce on the host tensors
                        copy_ = tr.stage_grads(packed, wire)
                        host = red.reduce_host(copy_.wait(), 0, True)
                    got["host"] = [h.clone() for h in host]
                    got["busy_s"] = copy_.busy_s
                    copy_.release()
                except BaseException as e:  # noqa: BLE001 - reported by the main thread
                    got["error"] = "".join(traceback.format_exception(e))[-1500:]
                got["thread_s"] = time.perf_counter() - th0
                got["thread"] = threading.current_thread().name

            th = threading.Thread(target=reduce_batch, name="gpu-check-reduce", daemon=True)
            th.start()
            th.join(timeout=30)
            if th.is_alive():
                raise TimeoutError("the reduce thread did not finish within 30 s (a collective hangs)")
            if "error" in got:
                raise RuntimeError("reduce thread: " + got["error"])
            sync(dev.type)
            want = [t.to(wire).float().cpu() for t in packed]
            bitwise = all(torch.equal(h.float().cpu(), w) for h, w in zip(got["host"], want))
            flags = GradReducer.present(got["host"])
            runs.append({"wire": str(wire).removeprefix("torch."), "bitwise": bitwise, "present": flags,
                         "flags_ok": flags == [True, True, False], "thread": got["thread"],
                         "thread_s": round(got["thread_s"], 4), "d2h_busy_s": got["busy_s"]})
            print(f"  {runs[-1]}", flush=True)
        ok = all(r["bitwise"] and r["flags_ok"] for r in runs)
        nums = {"backend": groups.backend, "device_side_reduce": red.device_side, "world_size": groups.world_size,
                "init_s": round(init_s, 2), "port": port, "runs": runs}
        return {"result": "PASS" if ok else "FAIL", "numbers": nums,
                "note": "stage_grads driven directly (no Trainer fit)"}
    finally:
        dist.destroy_process_group()


def _phase_model(a):
    import torch
    import transformers

    if a.cpu_dry_run:
        size = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
        shapes = [(1, 16), (2, 32)]
    else:
        size = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                    num_attention_heads=16)
        shapes = [(1, 512), (8, 1024)]
    cfg = transformers.LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"],
                                   max_position_embeddings=max(t for _, t in shapes), tie_word_embeddings=False,
                                   use_cache=False)
    torch.manual_seed(0)
    return cfg, transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), shapes


def _planner_estimate(cfg, hw_name: str, batch: int, seq: int, precision: str) -> dict:
    try:
        from megatrain_lightning.planning import load_hardware, plan

        p = plan(cfg, load_hardware(hw_name), batch_size=batch, seq_len=seq, precision=precision)
        return {"step_s": round(p.step_time_s, 4), "dominating": p.dominating,
                "terms_s": {k: round(v, 4) for k, v in p.times.items()}, "hardware": hw_name}
    except Exception as e:  # noqa: BLE001 - the estimate is reported, not required
        return {"step_s": None, "why": f"{type(e).__name__}: {e}"[:200]}


def check_phases(a) -> dict:
    import statistics

    import lightning.pytorch as pl
    import torch
    from megatrain_lightning.testing import LM
    from torch.utils.data import DataLoader

    dev = device(a)
    torch.use_deterministic_algorithms(False)  # stream_parity's setting: the fastest kernels here (TF32 stays off)
    t0 = time.perf_counter()
    cfg, base, shapes = _phase_model(a)
    n_params = sum(p.numel() for p in base.parameters())
    build_s = time.perf_counter() - t0
    warm, measured = 1, 2
    per_shape = warm + measured
    g = torch.Generator().manual_seed(1)
    trace_path = os.path.join(a.out, "phases_trace.json")

    class Phases(pl.Callback):
        """Host times (s) of batch start, before backward, after backward and batch end; CUDA synchronized at each."""

        def __init__(self, profile_step: int | None):
            self.t: list[dict] = []
            self.profile_step, self.prof = profile_step, None

        def _now(self):
            sync(dev)
            return time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == self.profile_step:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()
            self.t.append({"start": self._now()})

        def on_before_backward(self, trainer, pl_module, loss):
            self.t[-1]["fwd_end"] = self._now()

        def on_after_backward(self, trainer, pl_module):
            self.t[-1]["bwd_end"] = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.t[-1]["end"] = self._now()
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                self.prof.export_chrome_trace(trace_path)
                self.prof = None

    rows, trace = [], None
    for precision in ("32-true", "bf16-mixed"):
        profile = precision == "bf16-mixed"  # one extra step of the last shape, profiled, not timed
        batches = [(torch.randint(0, cfg.vocab_size, (b, s), generator=g),) for b, s in shapes for _ in range(per_shape)]
        if profile:
            batches.append(batches[-1])
        model = copy.deepcopy(base)
        cb = Phases(len(batches) - 1 if profile else None)
        tr = make_trainer(dev, len(batches), precision, callbacks=[cb])
        tr.fit(LM(model), DataLoader(batches, batch_size=None))
        hist = tr.strategy.engine.history
        tr.strategy.engine.close()
        for i, (b, s) in enumerate(shapes):
            idx = range(i * per_shape + warm, (i + 1) * per_shape)
            med = lambda xs: statistics.median(xs)  # noqa: E731
            step = med([cb.t[j]["end"] - cb.t[j]["start"] for j in idx])
            stat = lambda k: med([hist[j].get("megatrain/" + k, 0.0) for j in idx])  # noqa: E731
            tokens = b * s
            est = _planner_estimate(cfg, "this_machine" if a.cpu_dry_run else "h200", b, s, precision)
            row = {"precision": precision, "batch": b, "seq": s, "tokens": tokens, "step_s": round(step, 4),
                   "forward_s": round(med([cb.t[j]["fwd_end"] - cb.t[j]["start"] for j in idx]), 4),
                   "backward_s": round(med([cb.t[j]["bwd_end"] - cb.t[j]["fwd_end"] for j in idx]), 4),
                   "optimizer_s": round(stat("optimizer_s"), 4), "grad_add_s": round(stat("grad_add_s"), 4),
                   "d2h_busy_s": round(stat("d2h_busy_s"), 4), "wait_s": round(stat("wait_s"), 4),
                   "peak_device_GiB": round(max(hist[j]["megatrain/peak_device_bytes"] for j in idx) / 2**30, 3),
                   "TFLOPS": float(f"{6 * n_params * tokens / step / 1e12:.4g}"), "planner": est}
            if est.get("step_s"):
                row["planner_over_measured"] = round(est["step_s"] / step, 3)
            rows.append(row)
            print(f"  {precision:10s} {b} x {s}: step {row['step_s']:.3f}s fwd {row['forward_s']:.3f}s "
                  f"bwd {row['backward_s']:.3f}s optim {row['optimizer_s']:.3f}s add {row['grad_add_s']:.3f}s "
                  f"d2h {row['d2h_busy_s']:.3f}s {row['TFLOPS']:.2f} TFLOPS, planner {est.get('step_s')}s", flush=True)
        del model, tr, hist
        gc.collect()
    if os.path.exists(trace_path):
        size = os.path.getsize(trace_path)
        if size > 8 * 2**20:
            with open(trace_path, "rb") as f, gzip.open(trace_path + ".gz", "wb", compresslevel=6) as z:
                z.write(f.read())
            os.remove(trace_path)
            trace_path += ".gz"
        trace = {"path": trace_path, "bytes": os.path.getsize(trace_path), "raw_bytes": size}
    nums = {"n_params": n_params, "build_s": round(build_s, 1), "trace": trace,
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if dev == "cuda" else None,
            **{f"{r['precision']}_{r['batch']}x{r['seq']}": {k: r[k] for k in ("step_s", "TFLOPS", "optimizer_s")}
               | {"planner_s": r["planner"].get("step_s")} for r in rows}}
    ok = len(rows) == 2 * len(shapes) and all(r["step_s"] > 0 for r in rows)
    return {"result": "PASS" if ok else "FAIL", "numbers": nums, "details": rows}


def check_nvme(a) -> dict:
    import torch
    from megatrain_lightning.testing import LM, make_data, make_model

    import lightning.pytorch as pl
    from megatrain_lightning import MegaTrainStrategy

    dev = device(a)
    deterministic()
    steps, layers = (2, 4) if a.cpu_dry_run else (10, 8)
    rows = []
    for acc, clip in ((1, None), (3, 0.5)):
        out = []
        for tier in ("ram", "nvme"):
            lm = LM(make_model("llama", num_hidden_layers=layers), total_steps=steps)
            kw = dict(offload_params="nvme", offload_optimizer="nvme", nvme_path=tempfile.mkdtemp(),
                      host_memory_limit=600_000) if tier == "nvme" else {}
            extra = {"accumulate_grad_batches": acc} if acc > 1 else {}
            if clip:
                extra["gradient_clip_val"] = clip
            torch.manual_seed(0)
            tr = pl.Trainer(strategy=MegaTrainStrategy(**kw), accelerator="gpu" if dev == "cuda" else "cpu", devices=1,
                            max_steps=steps, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, **extra)
            tr.fit(lm, make_data(n=2 * steps * acc))
            hist = tr.strategy.engine.history
            out.append((lm, hist, tr.strategy.engine.store.nvme.direct if tier == "nvme" else None))
            tr.strategy.close()
        (a_lm, _, _), (b_lm, hist, direct) = out
        same_l = a_lm.losses == b_lm.losses
        same_w = all(torch.equal(p.detach().cpu(), q.detach().cpu()) for p, q in zip(a_lm.parameters(), b_lm.parameters()))
        rows.append({"accumulate": acc, "clip": clip, "losses_equal": same_l, "weights_equal": same_w,
                     "o_direct": direct, "read_bytes_last_step": hist[-1].get("megatrain/nvme_read_bytes"),
                     "budget_peak": max(h.get("megatrain/host_budget_peak_bytes", 0) for h in hist)})
        print(f"  nvme accumulate={acc} clip={clip}: losses equal {same_l}, weights equal {same_w}, O_DIRECT {direct}",
              flush=True)
    ok = all(r["losses_equal"] and r["weights_equal"] for r in rows)
    return {"result": "PASS" if ok else "FAIL", "numbers": {"steps": steps, "layers": layers, "runs": rows}}


def check_depth(a) -> dict:
    import torch

    import memory_depth

    dev = torch.device(device(a))
    cuda = dev.type == "cuda"
    if a.cpu_dry_run:
        shape = dict(hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=256, batch=2, seq=32)
        runs = [(2, True), (4, True), (8, True), (2, False), (8, False)]
    else:
        shape = dict(memory_depth.SHAPE)
        runs = [(4, True), (16, True), (40, True), (80, True), (4, False), (80, False)]
    check = None if cuda else memory_depth.self_check()
    rows = []
    for layers, offload in runs:
        gc.collect()  # the previous engine's reference cycles still hold its buffers
        r = memory_depth.run(layers, offload, dev, shape=shape)
        rows.append({k: r[k] for k in ("layers", "offload", "raw_peak_bytes", "offloaded_host_bytes",
                                       "device_peak_bytes", "saved_inputs_bytes", "engine_peak_device_bytes")})
        print(f"  layers {layers:3d} offload {offload!s:5s}: device peak {r['device_peak_bytes'] / 2**20:.2f} MiB",
              flush=True)
    off = [r for r in rows if r["offload"]]
    keep = [r for r in rows if not r["offload"]]
    growth = off[-1]["device_peak_bytes"] / off[0]["device_peak_bytes"] - 1
    mib = lambda r: round(r["device_peak_bytes"] / 2**20, 3)  # noqa: E731
    nums = {"meter": "torch.cuda.max_memory_allocated" if cuda else "torch.profiler CPU allocation events",
            "meter_self_check_ok": None if check is None else check["ok"], "shape": shape,
            "growth_offload": round(growth, 4), "target": memory_depth.TARGET,
            **{f"L{r['layers']}_{'offload' if r['offload'] else 'keep'}_MiB": mib(r) for r in rows}}
    if len(keep) == 2:
        nums["growth_keep"] = round(keep[1]["device_peak_bytes"] / keep[0]["device_peak_bytes"] - 1, 4)
    ok = growth < memory_depth.TARGET and (check is None or check["ok"])
    return {"result": "PASS" if ok else "FAIL", "numbers": nums, "details": rows}


# ---------------------------------------------------------------- runner
def _extra():
    import gpu_check_extra

    return gpu_check_extra


def limit_of(name: str, dry: bool = False) -> float:
    """Seconds check ``name`` may take (``dry``: in the dry run)."""
    if name in LIMITS_S:
        s = LIMITS_S[name]
    elif name == "peer" and "max" in os.environ.get("PEER_SHAPES", ""):
        s = 400
    else:
        s = _extra().LIMITS_S[name]
    return s * DRY_RUN_SCALE if dry else s


def run_one(name: str, a, rows: Rows, remaining: "list[str]") -> bool:
    """Run one check under its limit; write its row. False: the process must stop (the check hung)."""
    left = a.budget_s - (time.time() - a.start) - END_MARGIN_S
    limit = min(limit_of(name, a.cpu_dry_run), left)
    need = NEED_S.get(name, min(30, limit_of(name)))
    if left < need:
        rows.write({"check": name, "result": "SKIP", "seconds": 0, "limit_s": limit_of(name, a.cpu_dry_run),
                    "why": f"{left:.0f} s of the {a.budget_s:.0f} s budget left, the check needs {need} s"})
        return True
    print(f"\n== {name} (limit {limit:.0f} s, {time.time() - a.start:.0f} s elapsed)", flush=True)
    fn = globals().get("check_" + name) or getattr(_extra(), "check_" + name)
    os.environ["GPU_CHECK_LIMIT_S"] = str(int(limit))
    finished = threading.Event()
    t0 = time.perf_counter()

    def watchdog():
        if finished.wait(limit + HANG_GRACE_S):
            return
        buf = io.StringIO()
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            buf.write(f.read())
        sys.stderr.write(buf.getvalue())
        rows.write({"check": name, "result": "FAIL", "seconds": round(time.perf_counter() - t0, 1), "limit_s": limit,
                    "error": f"hung: still running {HANG_GRACE_S} s past its {limit:.0f} s limit",
                    "traceback": buf.getvalue()[-3000:]})
        for rest in remaining:
            rows.write({"check": rest, "result": "SKIP", "seconds": 0, "limit_s": limit_of(rest, a.cpu_dry_run),
                        "why": f"{name} hung; the process exits"})
        print(table(rows.rows), flush=True)
        os._exit(3)

    def alarm(signum, frame):
        raise TimeoutError(f"{name} ran past its limit of {limit:.0f} s")

    threading.Thread(target=watchdog, name="gpu-check-watchdog", daemon=True).start()
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(limit, 1.0))
    try:
        res = fn(a)
    except BaseException as e:  # noqa: BLE001 - a failed check is a result; KeyboardInterrupt too
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        res = {"result": "FAIL", "error": f"{type(e).__name__}: {e}"[:300], "traceback": tb[-3000:]}
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        finished.set()
    rows.write({"check": name, **res, "seconds": round(time.perf_counter() - t0, 1), "limit_s": limit})
    gc.collect()
    return True


def main() -> int:
    t_import0 = time.time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checks", nargs="*", help=f"checks to run, in order (default: {' '.join(DEFAULT)})")
    p.add_argument("--cpu-dry-run", action="store_true", help="every check on the CPU with tiny sizes")
    p.add_argument("--results", default=None, help="results folder (default: bench/results, dry run: "
                   "${TMPDIR:-/tmp}/gpu_check_dryrun)")
    p.add_argument("--parity-configs", default="", help=f"stream_parity: comma-separated subset of {','.join(PARITY_CONFIGS)}")
    a = p.parse_args()
    a.checks = a.checks or DEFAULT
    known = set(DEFAULT) | set(_extra().LIMITS_S)
    bad = [c for c in a.checks if c not in known]
    if bad:
        p.error(f"unknown check(s) {bad}; known: {sorted(known)}")
    if a.results is None:
        a.results = (os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_check_dryrun") if a.cpu_dry_run
                     else os.path.join(ROOT, "bench", "results"))
    os.makedirs(a.results, exist_ok=True)
    a.out = os.environ.get("OUT") or a.results
    a.start = float(os.environ.get("GPU_CHECK_START") or t_import0)
    a.budget_s = float(os.environ.get("GPU_CHECK_BUDGET_S", "420"))
    import lightning  # noqa: F401 - once, here: counted in the env row
    import torch

    import megatrain_lightning  # noqa: F401
    import transformers  # noqa: F401

    a.import_s = time.time() - t_import0
    if a.cpu_dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = Rows(a.out, "cpu-dry-run" if a.cpu_dry_run else "cuda", a.budget_s, a.start)
    print(f"imports {a.import_s:.1f} s; rows to {rows.jsonl}", flush=True)
    for i, name in enumerate(a.checks):
        run_one(name, a, rows, a.checks[i + 1 :])
    print("\n" + table(rows.rows), flush=True)
    print(f"wrote {rows.jsonl} and {rows.json}; total {time.time() - a.start:.0f} s", flush=True)
    return 1 if any(r["result"] == "FAIL" for r in rows.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
