"""Further CUDA checks of strategy="megatrain", run by name through bench/gpu_check.py (not in its default set).

Each ``check_<name>(a)`` takes the runner's arguments (``a.cpu_dry_run``, ``a.results``: the results folder) and
returns ``{"result": "PASS" | "FAIL", "numbers": {...}, "details": ...}``; the runner writes it as one JSON row.
Several start a benchmark script of bench/ as a subprocess and read the JSON it writes.

* ``host_optim``: optimizers other than AdamW stepped on the host while the blocks compute on CUDA: tiny llama_tied,
                10 steps (accumulation 2, norm clipping 0.5) of Adafactor, SGD (momentum 0.9, Nesterov) and NAdam
                through the strategy (Adafactor also with its state on NVMe) against the plain-PyTorch reference
                loop with the same optimizer on CUDA. PASS: max relative loss and weight error <= 1e-5.
* ``pytest``:   the CPU test suite (``python -m pytest tests -x -q``) still passes.
* ``parity``:   llama, llama_tied, mixtral, gemma2, gpt2 (tiny configs of megatrain_lightning/testing.py),
                20 steps of Trainer(strategy="megatrain", accelerator="gpu") against the plain-PyTorch
                reference loop (megatrain_lightning.testing.reference_train) on CUDA (TF32 off, eager
                attention, attention key biases frozen as in tests/test_parity.py), plus llama_tied with
                offload_activations=True and with recompute_every=2. PASS: max relative loss and weight
                error <= 1e-5 and the engine really ran on the requested device.
* ``precision``: mixed precision on CUDA (the wire images converted on the H2D stream): for llama,
                llama_tied and gpt2 (use_cache=False) under bf16-mixed and 16-mixed, the parameter gradients
                of one step through the strategy against a plain autocast step of the same fp32 model on the
                GPU (16-mixed: loss x 2**16, gradients x 2**-16, as GradScaler), and 10 steps of 16-mixed
                llama (loss scaling: finite losses, no skipped step, scale still 2**16). PASS: every
                gradient within 1e-5 relative (bitwise reported) and the 16-mixed run clean.
* ``memory``:   bench/memory_depth.py --device cuda (device peak flat in depth with offload); its own verdict.
* ``overlap``:  Llama 24 layers, hidden 1024, batch 4 x 512, fp32, 6 steps through the strategy with
                (lookahead, overlap_optimizer) = (1, True), (0, True), (1, False), (0, False). Step time is
                measured with torch.cuda.synchronize() at every batch end (the engine's wait_s/compute_s
                are host-side times: on CUDA they miss stalls of the compute stream on copy events).
                Reports median step, achieved H2D GB/s (h2d_bytes / step), wait_s fraction, peak device
                memory against the model's fp32 size, the raw pinned H2D link speed, and the speedups
                lookahead 1 over 0 and overlap_optimizer True over False.
                PASS: lookahead=1 is faster and waits less than lookahead=0, overlap_optimizer=True is not
                slower than False (5% noise allowed).
* ``d2h``:      overlapped gradient copies: Llama 6 layers, hidden 2048, MLP 8192, batch
                1 x 128 tokens, fp32 (host adds of a layer's 268 MB of gradients take longer than its backward),
                5 steps as configured (2 gradient batches in flight: the copy of batch k+1 runs while the D2H
                worker adds batch k) and with 1 in flight (copy and add serialized).
                From the step statistics: d2h_busy_s (copies running), d2h_copy_wait_s (the worker waiting for
                a copy), grad_add_s, d2h_queue_peak; hidden = 1 - copy_wait / busy.
                PASS: statistics present, queue peak <= 2, and where the adds dominate (grad_add_s > d2h_busy_s)
                at least half the copy time hidden and less copy wait than with 1 in flight.
* ``overhead``: bench/overhead.py --device cuda (megatrain / HF-checkpointing step-time ratio); its own verdict.
* ``long``:     long sequences on CUDA: llama, gemma2 and llama_tied 10 steps with
                loss_chunk_size=5 + mlp_chunk_size=4 against the plain reference on the GPU (1e-5); llama_tied 6 layers
                with offload_activations: no activation restore misses after the first step (the H2D copy of the
                next call's inputs was started one call ahead on the H2D stream) and at most 2 calls' inputs
                restored at once; the bench/long_context.py shape (vocab 128,256, hidden 512, 4 layers) at 8k and
                32k tokens: device peak of a step with the chunked head + loss (+ mlp_chunk_size 2048) against the
                full logits at 8k. PASS: parity, no misses, and the chunked 32k peak below one 16k logits tensor.
* ``recompute``: bench/recompute_policy.py --device cuda: recompute="block"/"selective"/"none"/"auto" against
                plain PyTorch + HF checkpointing + fused AdamW and plain PyTorch without checkpointing, same
                model and batch on the same GPU, for the SmolLM2-135M shape at batch 1 x 512 and (time
                allowing) the 0.9B shape at batch 8 x 1024; step time, ratios, kept bytes per token, device
                peak; at the small shape also block_group=4 (recompute block and none) against single blocks.
                PASS: every row ran; the ratio targets are reported, not gated.
* ``pinned``:   pinned memory inside host_memory_limit: llama with regions of awkward
                sizes (vocabulary 32003, MLP width 688, 4 layers; dry run: 1021 / 70 / 5), 6 steps of the NVMe
                tier (masters and optimizer on disk) under bf16-mixed (wire images through the H2D staging
                ring) and 32-true (copies straight from the window), each against the RAM tier. Pinned bytes
                are measured, not taken from the budget: the window's arena (one cudaHostRegister-ed mapping,
                ``arena.buf.is_pinned()``), the 2 exactly pinned D2H staging buffers, and the growth of torch's
                caching host allocator (``torch.cuda.host_memory_stats``) over the run. Also reports
                ``ulimit -l`` (not a limit for CUDA's pinned memory) and the ring's peak slots in flight.
                PASS: losses and weights bitwise equal to the RAM tier, the arena pinned, pinned total <=
                host_memory_limit, the ring used with at most 2 slots out.

* ``scaling``:  bench/scaling.py --accelerator gpu --devices 2 --process-group-backend gloo: data parallel
                on CUDA, 1 process then 2 processes; with one GPU the 2 ranks share it (gloo: NCCL
                refuses two ranks on one GPU), which exercises the CUDA data-parallel path (pinned node-shared
                store in /dev/shm, per-rank D2H of gradients, gloo reduce on the host) but is no scaling
                measurement. The model shrinks when /dev/shm has under 4 GiB free (docker's default is 64 MiB:
                then the 2-process run must fail with SharedMemoryTooSmall, which is reported). PASS: both runs
                finished, 2 ranks on gloo, the shared state file holds 16 B/param (+-3%).

* ``peer``:     bench/peer.py: ours fp32 and bf16-mixed (RAM tier), plain PyTorch +
                HF checkpointing + fused AdamW, one existing offload trainer (DeepSpeed ZeRO-3 CPU offload if its
                CPU Adam loads, else torchao's CPUOffloadOptimizer) and ours on the NVMe tier, same model and batch:
                the 0.9B shape, --steps 3 --warmup 1, under a --time-budget of this check's limit less 100 s (no
                row starts after it; the NVMe row, slowest, runs last; peer.json is rewritten after every row);
                ``PEER_SHAPES=0p9b,max`` adds the largest Llama whose fp32 state fits 0.6 x host RAM (then give it
                time: PEER_SHAPES with max allows 400 s). Step time, tokens/s, model TFLOPS, the engine's H2D/D2H GB/s
                against the raw pinned-copy bandwidth, device peak. Also records what an offline DeepSpeed build
                needs on the image (g++, ninja, Python.h) and whether torchao/deepspeed import. PASS: our rows ran
                and no row crashed (plain may not fit; the offload row may be skipped, with its reason).

* ``update_overlap``: bench/update_overlap.py --device cuda --rounds 2 --schedules in_backward: the host update
                hidden behind the backward and the next forward on the CUDA path, ``optimizer_in_backward=True``,
                each slab update made ``d`` longer (``N*d`` = 0.5, 1, 2 x the step), with ``update_threads`` 1 and
                2; the step without delay for each count shows what a second update thread does with the real
                updates on this host. PASS: the script ran and with 2 threads every row is within its target
                (``max(0, N*d - base) + 0.10 x base``).

``--cpu-dry-run``: every check on the CPU with tiny sizes, to exercise this script without a GPU
(timings, and the memory/overlap/overhead verdicts, mean nothing at those sizes).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: these checks and the seconds each may take on the H200 (the dry run fits them on 2 CPU cores too)
LIMITS_S = {"host_optim": 90, "pytest": 90, "parity": 120, "precision": 60, "memory": 90, "overlap": 150, "d2h": 90, "overhead": 120,
            "recompute": 240, "pinned": 60, "long": 120, "scaling": 150, "peer": 240,
            "update_overlap": 150}
TOL = 1e-5
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS


def sh(cmd: list[str]) -> tuple[int, list[str]]:
    """Run ``cmd`` in the repo root, echoing its output; returns (rc, lines)."""
    print("$", " ".join(cmd), flush=True)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:  # type: ignore[union-attr]
        print(line, end="", flush=True)
        lines.append(line)
    return p.wait(), lines


def device(a) -> str:
    return "cpu" if a.cpu_dry_run else "cuda"


def sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def trainer(dev: str, steps: int, callbacks=(), **strategy_kwargs):
    import lightning.pytorch as pl

    from megatrain_lightning import MegaTrainStrategy

    return pl.Trainer(strategy=MegaTrainStrategy(**strategy_kwargs), accelerator="gpu" if dev == "cuda" else "cpu",
                      devices=1, max_steps=steps, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=list(callbacks))


# ---------------------------------------------------------------- checks
def check_host_optim(a) -> dict:
    import tempfile

    import torch
    import lightning.pytorch as pl
    from gpu_check import deterministic
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.testing import LM, freeze_key_biases, make_data, make_model, reference_train, rel

    dev = device(a)
    deterministic()
    steps = 3 if a.cpu_dry_run else 10
    configs = {"adafactor": (torch.optim.Adafactor, {"lr": 1e-2}), "sgd_nesterov": (torch.optim.SGD, {
        "lr": 0.05, "momentum": 0.9, "nesterov": True}), "nadam": (torch.optim.NAdam, {"lr": 2e-3})}
    rows = []
    for name, (cls, kw) in list(configs.items()) + [("adafactor_nvme", configs["adafactor"])]:
        t0 = time.perf_counter()
        ref = make_model("llama_tied")
        freeze_key_biases(ref)
        ref.to(dev)
        torch.manual_seed(0)
        lr = kw["lr"]
        extra = {k: v for k, v in kw.items() if k != "lr"}
        ref_losses = reference_train(ref, OnDevice(make_data(n=4 * steps), dev), steps, lr=lr, accumulate=2, clip=0.5,
                                     optimizer=cls, opt_kwargs=extra)
        model = make_model("llama_tied")
        freeze_key_biases(model)
        lm = LM(model, lr=lr, optimizer=cls, opt_kwargs=extra)
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            nvme = dict(offload_optimizer="nvme", nvme_path=tmp, host_memory_limit=1_500_000) if name.endswith("nvme") else {}
            tr = pl.Trainer(strategy=MegaTrainStrategy(**nvme), accelerator="gpu" if dev == "cuda" else "cpu", devices=1,
                            max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=0.5, enable_checkpointing=False,
                            logger=False, enable_progress_bar=False, enable_model_summary=False)
            tr.fit(lm, make_data(n=4 * steps))
            host = type(tr.strategy.engine.optimizer).__name__
            ran_on = tr.strategy.engine.device.type
            tr.strategy.close()
        loss_err = max(abs(x - y) / abs(y) for x, y in zip(lm.losses, ref_losses)) if len(lm.losses) == len(ref_losses) else float("inf")
        w_err = max(rel(p.detach().float().cpu(), q.detach().float().cpu())
                    for p, q in zip(lm.model.parameters(), ref.parameters()))
        row = {"config": name, "host_optimizer": host, "loss_rel_err": loss_err, "weight_rel_err": w_err,
               "ran_on": ran_on, "seconds": round(time.perf_counter() - t0, 1)}
        row["pass"] = loss_err <= TOL and w_err <= TOL and ran_on == dev and host == "HostTorchOptimizer"
        rows.append(row)
        print(f"  {name:16s} loss {loss_err:.2e} weight {w_err:.2e} {'ok' if row['pass'] else 'FAIL'}", flush=True)
    nums = {"configs_passed": f"{sum(r['pass'] for r in rows)}/{len(rows)}",
            "max_loss_rel_err": max(r["loss_rel_err"] for r in rows),
            "max_weight_rel_err": max(r["weight_rel_err"] for r in rows), "steps": steps}
    return {"result": "PASS" if all(r["pass"] for r in rows) else "FAIL", "numbers": nums, "details": rows}


def check_pytest(a) -> dict:
    # the engine tests only (the data/recipe tests need packages the offline GPU image lacks); on CPU there,
    # they check the engine under that image's torch/transformers versions
    target = ["tests/test_errors.py"] if a.cpu_dry_run else ["tests/test_parity.py", "tests/test_precision.py"]
    # pyproject's addopts already has -q; a second -q would drop the "N passed" line
    rc, lines = sh([sys.executable, "-m", "pytest", *target, "-x", "-p", "no:cacheprovider"])
    last = next((ln.strip() for ln in reversed(lines) if " in " in ln and ("passed" in ln or "failed" in ln or "error" in ln)), "")
    return {"result": "PASS" if rc == 0 else "FAIL", "numbers": {"rc": rc, "pytest": last}}


class OnDevice:
    """A DataLoader whose batches are moved to ``dev`` (for the reference loop)."""

    def __init__(self, loader, dev):
        self.loader, self.dev = loader, dev

    def __iter__(self):
        for batch in self.loader:
            yield [t.to(self.dev) for t in batch]


def check_parity(a) -> dict:
    import torch
    from megatrain_lightning.testing import LM, freeze_key_biases, make_data, make_model, reference_train, rel

    dev = device(a)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # both runs use the deterministic kernels where torch has them (index_add_ of the MoE, scatter-adds):
    # atomics would add run-to-run noise that is not the strategy's
    torch.use_deterministic_algorithms(True, warn_only=True)
    steps = 5 if a.cpu_dry_run else 20
    runs = [(arch, {}) for arch in ("llama", "llama_tied", "mixtral", "gemma2", "gpt2")]
    runs += [("llama_tied", {"offload_activations": True}), ("llama_tied", {"recompute_every": 2})]
    runs += [("llama_tied", {"recompute": "selective"}), ("mixtral", {"recompute": "none"}),
             ("gpt2", {"recompute": "selective", "offload_activations": True}),
             ("llama_tied", {"recompute": "none", "offload_activations": True})]
    rows = []
    for arch, kw in runs:
        name = arch + "".join(f" {k}={v}" for k, v in kw.items())
        t0 = time.perf_counter()
        model = make_model(arch)
        freeze_key_biases(model)
        ref = copy.deepcopy(model)
        lm = LM(model, total_steps=steps)
        torch.manual_seed(0)
        tr = trainer(dev, steps, **kw)
        tr.fit(lm, make_data(n=2 * steps))
        eng = tr.strategy.engine
        ran_on = eng.device.type
        peak = max(h["megatrain/peak_device_bytes"] for h in eng.history)
        eng.close()
        torch.manual_seed(0)
        ref.to(dev)
        ref_losses = reference_train(ref, OnDevice(make_data(n=2 * steps), dev), steps)
        loss_err = max(abs(x - y) / abs(y) for x, y in zip(lm.losses, ref_losses)) if len(lm.losses) == len(ref_losses) else float("inf")
        refp = dict(ref.named_parameters())
        w_err, w_worst = 0.0, ""
        for k, p in lm.model.named_parameters():
            r = rel(p.detach().cpu(), refp[k].detach().cpu())
            if r > w_err:
                w_err, w_worst = r, k
        ok = loss_err <= TOL and w_err <= TOL and ran_on == dev and len(lm.losses) == steps
        rows.append({"run": name, "loss_rel_err": loss_err, "weight_rel_err": w_err, "worst_param": w_worst,
                     "engine_device": ran_on, "peak_device_bytes": peak, "steps": len(lm.losses), "pass": ok,
                     "seconds": time.perf_counter() - t0})
        print(f"  {name:36s} loss {loss_err:.2e} weight {w_err:.2e} ({w_worst}) on {ran_on}: {'ok' if ok else 'FAIL'}", flush=True)
        del model, ref, lm, tr, eng
        gc.collect()
    nums = {"max_loss_rel_err": max(r["loss_rel_err"] for r in rows), "max_weight_rel_err": max(r["weight_rel_err"] for r in rows),
            "runs_passed": f"{sum(r['pass'] for r in rows)}/{len(rows)}", "steps": steps}
    return {"result": "PASS" if all(r["pass"] for r in rows) else "FAIL", "numbers": nums, "details": rows}


def check_precision(a) -> dict:
    import lightning.pytorch as pl
    import torch
    from megatrain_lightning.testing import LM, make_data, make_model, rel

    from megatrain_lightning import MegaTrainPrecision, MegaTrainStrategy

    dev = device(a)
    torch.backends.cuda.matmul.allow_tf32 = False
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    rows = []
    for precision in ("bf16-mixed", "16-mixed"):
        for arch in ("llama", "llama_tied", "gpt2"):
            model = make_model(arch, use_cache=False)
            ref = copy.deepcopy(model).to(dev)
            grads: dict = {}

            class Grab(LM):
                def on_before_optimizer_step(self, optimizer):
                    grads.update({n.removeprefix("model."): p.grad.detach().cpu().clone() for n, p in self.named_parameters()})

            torch.manual_seed(0)
            tr = pl.Trainer(strategy=MegaTrainStrategy(), accelerator="gpu" if dev == "cuda" else "cpu", devices=1,
                            max_steps=1, plugins=[MegaTrainPrecision(precision, device_type=dev)], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            tr.fit(Grab(model), make_data())
            tr.strategy.close()
            (ids,) = next(iter(make_data()))
            ids = ids.to(dev)
            scale = 2.0**16 if precision == "16-mixed" else 1.0
            with torch.autocast(dev, dtype=half[precision]):
                loss = ref(input_ids=ids, labels=ids).loss
            (loss * scale).backward()
            errs = {n: rel(grads[n], (p.grad * (1 / scale)).cpu()) for n, p in ref.named_parameters()}
            worst = max(errs, key=errs.get)
            bitwise = all(torch.equal(grads[n], (p.grad * (1 / scale)).cpu()) for n, p in ref.named_parameters())
            ok = errs[worst] <= TOL
            rows.append({"precision": precision, "arch": arch, "grad_rel_err": errs[worst], "worst_param": worst,
                         "bitwise": bitwise, "pass": ok})
            print(f"  {precision} {arch:10s} one-step gradients: max rel err {errs[worst]:.2e} ({worst}), "
                  f"bitwise {bitwise}: {'ok' if ok else 'FAIL'}", flush=True)
    plugin = MegaTrainPrecision("16-mixed", device_type=dev)
    lm = LM(make_model("llama", use_cache=False), lr=3e-3)
    torch.manual_seed(0)
    pl.Trainer(strategy=MegaTrainStrategy(), accelerator="gpu" if dev == "cuda" else "cpu", devices=1, max_steps=10,
               plugins=[plugin], logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(lm, make_data(n=20))
    import math

    fp16_ok = all(math.isfinite(x) for x in lm.losses) and plugin.skipped_steps == 0 and plugin.scale == 2.0**16
    print(f"  16-mixed 10 steps: losses {lm.losses[0]:.4f} -> {lm.losses[-1]:.4f}, skipped {plugin.skipped_steps}, "
          f"scale {plugin.scale}: {'ok' if fp16_ok else 'FAIL'}", flush=True)
    nums = {"max_grad_rel_err": max(r["grad_rel_err"] for r in rows), "bitwise": f"{sum(r['bitwise'] for r in rows)}/{len(rows)}",
            "fp16_run_ok": fp16_ok}
    return {"result": "PASS" if all(r["pass"] for r in rows) and fp16_ok else "FAIL", "numbers": nums, "details": rows}


def _bench(script: str, a, dry_args: list[str], args_: tuple[str, ...] = ()) -> tuple[int, dict | None]:
    tag = "dryrun" if a.cpu_dry_run else "cuda"
    out = os.path.join(a.results, f"{script}_{tag}.json")
    if os.path.exists(out):
        os.remove(out)
    args = ["--device", device(a), "--out", out, *args_] + (dry_args if a.cpu_dry_run else [])
    rc, _ = sh([sys.executable, os.path.join(ROOT, "bench", script + ".py"), *args])
    if not os.path.exists(out):
        return rc, None
    with open(out) as f:
        return rc, json.load(f)


def check_memory(a) -> dict:
    rc, res = _bench("memory_depth", a, ["--warmup", "1"])
    if res is None:
        return {"result": "FAIL", "numbers": {"rc": rc, "error": "no result JSON"}}
    mib = lambda r: round(r.get("device_peak_bytes", 0) / 2**20, 2)  # noqa: E731
    peaks = {f"L{r['layers']}_{'offload' if r['offload'] else 'keep'}_MiB": mib(r) for r in res.get("rows", [])}
    nums = {"growth_4_to_32_offload": res.get("growth_4_to_32_offload"), "target": res.get("target_growth"), **peaks}
    return {"result": "PASS" if rc == 0 and res.get("pass") else "FAIL", "numbers": nums}


def check_overhead(a) -> dict:
    rc, res = _bench("overhead", a, ["--steps", "2", "--warmup", "1", "--seq", "32", "--layers", "2"])
    if res is None:
        return {"result": "FAIL", "numbers": {"rc": rc, "error": "no result JSON"}}
    med = {r["name"]: r.get("median_s") for r in res.get("rows", [])}
    nums = {"ratio": res.get("ratio"), "target": res.get("target_ratio"), "median_s": med}
    return {"result": "PASS" if rc == 0 and res.get("pass") else "FAIL", "numbers": nums}


SHAPES = {"smollm2_135m_b1": ["--batch", "1", "--seq", "512",  # small blocks (14 MB): block groups next to single blocks
                               "--configs", "baseline,plain,block,selective,none,auto,auto25,block_g4,none_g4"],
          "llama_0p9b_b8": ["--layers", "16", "--hidden", "2048", "--intermediate", "5632", "--heads", "16",
                            "--kv-heads", "16", "--vocab", "32000", "--batch", "8", "--seq", "1024",
                            "--configs", "baseline,plain,block,selective,none"]}  # the 0.9B model builds slowly


def check_recompute(a) -> dict:
    dry = ["--layers", "2", "--seq", "32", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
           "--vocab", "256"]
    nums, ok = {}, True
    for name, shape in SHAPES.items():
        tag = "dryrun" if a.cpu_dry_run else "cuda"
        out = os.path.join(a.results, f"recompute_policy_{name}_{tag}.json")
        if os.path.exists(out):
            os.remove(out)
        configs = shape[shape.index("--configs"):][:2] if "--configs" in shape else []
        args = ["--device", device(a), "--out", out, "--steps", "3", "--warmup", "1"] + (dry + configs if a.cpu_dry_run else shape)
        rc, _ = sh([sys.executable, os.path.join(ROOT, "bench", "recompute_policy.py"), *args])
        if not os.path.exists(out):
            nums[name] = {"rc": rc, "error": "no result JSON"}
            ok = False
            break  # out of time: the next shape would not finish either
        with open(out) as f:
            res = json.load(f)
        nums[name] = {"rows": {r["row"]: {k: r[k] for k in ("step_s", "ratio_ckpt", "ratio_plain", "saved_bytes_per_token")}
                               for r in res.get("table", [])},
                      "block_group_ratios": res.get("block_group_ratios"),
                      "peak_GiB": {r["name"]: round((r.get("peak_device_bytes") or 0) / 2**30, 2) for r in res["rows"]},
                      "targets": res.get("targets")}  # the key recompute_policy.py writes
        ok = ok and rc == 0
        if a.cpu_dry_run:
            break  # one shape exercises the logic
    return {"result": "PASS" if ok else "FAIL", "numbers": nums}


def _host_cached_bytes(dev: str) -> int:
    """Bytes torch's caching host allocator holds (pinned blocks, cached ones included); 0 without CUDA."""
    import torch

    if dev != "cuda":
        return 0
    st = torch.cuda.host_memory_stats()  # key names differ across torch versions: reserved, else owned blocks
    return int(st.get("reserved_bytes.current", st.get("allocated_bytes.current", 0)) or 0)


def check_pinned(a) -> dict:
    import resource
    import tempfile

    import lightning.pytorch as pl
    import torch
    from megatrain_lightning.engine.window import d2h_staging_bytes
    from megatrain_lightning.testing import LM, make_data, make_model

    from megatrain_lightning import MegaTrainStrategy

    dev = device(a)
    torch.backends.cuda.matmul.allow_tf32 = False
    shape = (dict(num_hidden_layers=5, vocab_size=1021, intermediate_size=70) if a.cpu_dry_run else
             dict(num_hidden_layers=4, vocab_size=32003, intermediate_size=688, hidden_size=256,
                  num_attention_heads=4, num_key_value_heads=2))
    limit = 2_500_000 if a.cpu_dry_run else 400 * 10**6
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    rows = []
    for precision in ("bf16-mixed", "32-true"):
        out = []
        for tier in ("ram", "nvme"):
            kw = dict(offload_params="nvme", offload_optimizer="nvme", nvme_path=tempfile.mkdtemp(),
                      host_memory_limit=limit) if tier == "nvme" else {}
            lm = LM(make_model("llama", **shape), total_steps=6)
            torch.manual_seed(0)
            cached0 = _host_cached_bytes(dev)
            tr = pl.Trainer(strategy=MegaTrainStrategy(**kw), accelerator="gpu" if dev == "cuda" else "cpu", devices=1,
                            max_steps=6, precision=precision, enable_checkpointing=False, logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
            tr.fit(lm, make_data(n=12))
            eng = tr.strategy.engine
            row = None
            if tier == "nvme":
                arena, ring = eng.store.nvme.arena, eng.fetcher.ring
                layout = [(sl.numel, sl.trainable_numel) for sl in eng.store.slabs]
                staging = d2h_staging_bytes(layout, torch.device(dev))  # the transport's 2 D2H buffers, pinned exactly
                cached = _host_cached_bytes(dev) - cached0
                pinned_total = (arena.capacity if arena.pinned else 0) + staging + max(cached, 0)
                row = {"precision": precision, "limit": limit, "arena_bytes": arena.capacity, "arena_pinned": arena.pinned,
                       "arena_is_pinned": bool(arena.buf.is_pinned()) if dev == "cuda" else None,
                       "arena_peak_used": arena.peak, "d2h_staging_bytes": staging, "host_allocator_growth": cached,
                       "pinned_total": pinned_total, "ring_slots_used": len(ring.acquired),
                       "ring_peak_inflight": ring.peak_inflight,
                       "budget_peak": max(h.get("megatrain/host_budget_peak_bytes", 0) for h in eng.history),
                       "wait_s_median": statistics.median(h.get("megatrain/wait_s", 0) for h in eng.history),
                       "cast_s_median": statistics.median(h.get("megatrain/cast_s", 0) for h in eng.history)}
            out.append((lm, row))
            tr.strategy.close()
        (a_lm, _), (b_lm, row) = out
        row["losses_equal"] = a_lm.losses == b_lm.losses
        row["weights_equal"] = all(torch.equal(p.detach().cpu(), q.detach().cpu())
                                   for p, q in zip(a_lm.parameters(), b_lm.parameters()))
        rows.append(row)
        print(f"  pinned {precision}: {row}", flush=True)

    def ok(r):
        ring_ok = (r["ring_slots_used"] > 0 and r["ring_peak_inflight"] <= 2) if r["precision"] != "32-true" else True
        pinned_ok = r["arena_pinned"] and r["arena_is_pinned"] if dev == "cuda" else True
        return r["losses_equal"] and r["weights_equal"] and r["pinned_total"] <= r["limit"] and ring_ok and pinned_ok

    nums = {"memlock_soft_limit": None if memlock == resource.RLIM_INFINITY else memlock, "runs": rows}
    os.makedirs(a.results, exist_ok=True)
    with open(os.path.join(a.results, f"pinned_{'dryrun' if a.cpu_dry_run else 'cuda'}.json"), "w") as f:
        json.dump(nums, f, indent=1, default=str)
    return {"result": "PASS" if all(ok(r) for r in rows) else "FAIL", "numbers": nums}


def check_long(a) -> dict:
    import torch
    import transformers

    from megatrain_lightning.engine.streaming import StreamingEngine
    from megatrain_lightning.testing import LM, freeze_key_biases, make_data, make_model, reference_train, rel

    dev = device(a)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    steps, rows = (3 if a.cpu_dry_run else 10), []
    runs = [("llama", {"loss_chunk_size": 5, "mlp_chunk_size": 4}), ("gemma2", {"loss_chunk_size": 5, "mlp_chunk_size": 4}),
            ("llama_tied", {"loss_chunk_size": 5}), ("llama_tied", {"offload_activations": True})]
    for arch, kw in runs:
        model = make_model(arch, **({"num_hidden_layers": 6} if "offload_activations" in kw else {}))
        freeze_key_biases(model)
        ref = copy.deepcopy(model)
        lm = LM(model, total_steps=steps)
        tr = trainer(dev, steps, **kw)
        tr.fit(lm, make_data(n=2 * steps))
        hist = tr.strategy.engine.history
        tr.strategy.engine.close()
        ref.to(dev)
        ref_losses = reference_train(ref, OnDevice(make_data(n=2 * steps), dev), steps)
        loss_err = max(abs(x - y) / abs(y) for x, y in zip(lm.losses, ref_losses))
        refp = dict(ref.named_parameters())
        w_err = max(rel(p.detach().cpu(), refp[k].detach().cpu()) for k, p in lm.model.named_parameters())
        misses = sum(h["megatrain/activation_restore_misses"] for h in hist[1:])
        restored = max(h["megatrain/activation_restored_peak_bytes"] for h in hist)
        ok = loss_err <= TOL and w_err <= TOL and (misses == 0 and restored <= 2 * 2 * 16 * 32 * 4
                                                   if "offload_activations" in kw else True)
        rows.append({"run": arch + "".join(f" {k}={v}" for k, v in kw.items()), "loss_rel_err": loss_err,
                     "weight_rel_err": w_err, "restore_misses_after_step_1": misses, "restored_peak_bytes": restored,
                     "pass": ok})
        print(f"  {rows[-1]['run']:44s} loss {loss_err:.2e} weight {w_err:.2e} misses {misses} restored {restored:.0f} B: "
              f"{'ok' if ok else 'FAIL'}", flush=True)
        del model, ref, lm, tr
        gc.collect()
    V, seqs = (128256, (8192, 32768)) if not a.cpu_dry_run else (1024, (64, 256))
    peaks = {}
    for mode, seq in [("chunked", seqs[0]), ("chunked", seqs[1]), ("full", seqs[0])]:
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq,
                                       tie_word_embeddings=False, use_cache=False)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        chunk = ("auto" if not a.cpu_dry_run else 32) if mode == "chunked" else None
        eng = StreamingEngine(model, torch.device(dev), loss_chunk_size=chunk,
                              mlp_chunk_size=2048 if mode == "chunked" else None)
        eng.install()
        eng.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))
        ids = torch.randint(0, V, (1, seq), device=dev)
        t0 = time.perf_counter()
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            eng.attach_grads()
            eng.step()
            eng.end_step()
        sync(dev)
        peaks[f"{mode}_{seq}"] = {"peak_device_bytes": eng.history[-1]["megatrain/peak_device_bytes"],
                                  "two_steps_s": time.perf_counter() - t0}
        print(f"  {mode} {seq}: device peak {peaks[f'{mode}_{seq}']['peak_device_bytes'] / 2**30:.2f} GiB", flush=True)
        eng.close()
        del model, eng
        gc.collect()
    below = peaks[f"chunked_{seqs[1]}"]["peak_device_bytes"] < seqs[1] // 2 * V * 4
    ok = all(r["pass"] for r in rows) and (below or a.cpu_dry_run)  # dry run: the memory verdict means nothing
    return {"result": "PASS" if ok else "FAIL", "numbers": {"runs_passed": f"{sum(r['pass'] for r in rows)}/{len(rows)}",
            "max_loss_rel_err": max(r["loss_rel_err"] for r in rows), "max_weight_rel_err": max(r["weight_rel_err"] for r in rows),
            **{k + "_gib": v["peak_device_bytes"] / 2**30 for k, v in peaks.items()}, "chunked_long_below_one_half_logits": below},
            "details": {"runs": rows, "peaks": peaks}}


def _link_gbps(dev: str) -> float | None:
    """Raw pinned host -> device copy speed (256 MiB, best of 5)."""
    import torch

    if dev != "cuda":
        return None
    src = torch.empty(64 * 2**20, dtype=torch.float32, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best / 1e9


def check_overlap(a) -> dict:
    import lightning.pytorch as pl
    import torch
    import transformers
    from megatrain_lightning.testing import LM
    from torch.utils.data import DataLoader, TensorDataset

    dev = device(a)
    if a.cpu_dry_run:
        size = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        batch, seq, steps, warm = 2, 32, 4, 1
    else:
        size = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16)
        batch, seq, steps, warm = 4, 512, 6, 2
    cfg = transformers.LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=seq,
                                   tie_word_embeddings=False, use_cache=False)
    ids = torch.randint(0, cfg.vocab_size, (batch * steps, seq), generator=torch.Generator().manual_seed(1))

    class Timer(pl.Callback):
        def __init__(self):
            self.t: list[float] = []

        def on_train_batch_end(self, *args):
            sync(dev)
            self.t.append(time.perf_counter())

    configs = [("lookahead=1", dict(lookahead=1)), ("lookahead=0", dict(lookahead=0)),
               ("lookahead=1 overlap_optimizer=False", dict(lookahead=1, overlap_optimizer=False)),
               ("lookahead=0 overlap_optimizer=False", dict(lookahead=0, overlap_optimizer=False))]
    rows, n_params = {}, 0
    med = statistics.median
    for name, kw in configs:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        n_params = sum(p.numel() for p in model.parameters())
        lm, timer = LM(model), Timer()
        tr = trainer(dev, steps, callbacks=[timer], **kw)
        tr.fit(lm, DataLoader(TensorDataset(ids), batch_size=batch))
        hist = tr.strategy.engine.history
        tr.strategy.engine.close()
        # step i (i >= 1) = batch end i-1 -> batch end i; history[i] accounts the same step
        step = [timer.t[i] - timer.t[i - 1] for i in range(warm, len(timer.t))]
        h = hist[warm : len(timer.t)]
        g = lambda k: [x["megatrain/" + k] for x in h]  # noqa: E731
        rows[name] = {
            "median_step_s": med(step),
            "h2d_GBps": med([b / s / 1e9 for b, s in zip(g("h2d_bytes"), step)]),
            "d2h_GBps": med([b / s / 1e9 for b, s in zip(g("d2h_bytes"), step)]),
            "wait_frac": med([w / s for w, s in zip(g("wait_s"), step)]),
            "wait_s": med(g("wait_s")), "optimizer_s": med(g("optimizer_s")), "compute_s": med(g("compute_s")),
            "prefetch_misses": med(g("prefetch_misses")), "blocks_fetched": med(g("blocks_fetched")),
            "peak_device_GiB": max(g("peak_device_bytes")) / 2**30, "step_s": step,
        }
        r = rows[name]
        print(f"  {name:36s} step {r['median_step_s']:.3f}s h2d {r['h2d_GBps']:.1f} GB/s wait {100 * r['wait_frac']:.1f}% "
              f"optim {r['optimizer_s']:.3f}s misses {r['prefetch_misses']:.0f}/{r['blocks_fetched']:.0f} "
              f"peak {r['peak_device_GiB']:.2f} GiB", flush=True)
        del model, lm, tr, hist
        gc.collect()
    la1, la0 = rows["lookahead=1"], rows["lookahead=0"]
    nums = {
        "median_step_s": la1["median_step_s"], "h2d_GBps": la1["h2d_GBps"], "wait_frac": la1["wait_frac"],
        "speedup_lookahead_1_over_0": la0["median_step_s"] / la1["median_step_s"],
        "speedup_lookahead_1_over_0_no_opt_overlap": rows["lookahead=0 overlap_optimizer=False"]["median_step_s"]
        / rows["lookahead=1 overlap_optimizer=False"]["median_step_s"],
        "wait_frac_lookahead_0": la0["wait_frac"],
        "speedup_overlap_optimizer": rows["lookahead=1 overlap_optimizer=False"]["median_step_s"] / la1["median_step_s"],
        "h2d_link_GBps": _link_gbps(dev), "model_fp32_GiB": 4 * n_params / 2**30, "peak_device_GiB": la1["peak_device_GiB"],
        "n_params": n_params,
    }
    ok = (nums["speedup_lookahead_1_over_0"] > 1.0 and la1["wait_s"] < la0["wait_s"]
          and nums["speedup_overlap_optimizer"] >= 0.95)
    return {"result": "PASS" if ok else "FAIL", "numbers": nums, "details": rows}


def check_d2h(a) -> dict:
    import torch
    import transformers
    import megatrain_lightning.engine.streaming as streaming
    from megatrain_lightning.testing import LM
    from torch.utils.data import DataLoader, TensorDataset

    dev = device(a)
    if a.cpu_dry_run:
        size = dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4)
        seq, steps, warm = 32, 3, 1
    else:
        size = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=6, num_attention_heads=16)
        seq, steps, warm = 128, 5, 1
    cfg = transformers.LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=seq,
                                   tie_word_embeddings=False, use_cache=False)
    ids = torch.randint(0, cfg.vocab_size, (steps, seq), generator=torch.Generator().manual_seed(1))
    sink = streaming.GradientSink
    rows = {}
    for inflight in (2, 1):
        # the engine builds its sink with max_inflight=2; 1 in flight serializes copy and add
        streaming.GradientSink = lambda *args, **kw: sink(*args, **{**kw, "max_inflight": inflight})  # noqa: E731
        try:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            tr = trainer(dev, steps)
            tr.fit(LM(model), DataLoader(TensorDataset(ids), batch_size=1))
            hist = tr.strategy.engine.history[warm:]
            tr.strategy.engine.close()
        finally:
            streaming.GradientSink = sink
        tot = {k: sum(h["megatrain/" + k] for h in hist) for k in ("d2h_busy_s", "d2h_copy_wait_s", "grad_add_s")}
        r = {**{k: v / len(hist) for k, v in tot.items()}, "d2h_queue_peak": max(h["megatrain/d2h_queue_peak"] for h in hist),
             "d2h_GB_per_step": sum(h["megatrain/d2h_bytes"] for h in hist) / len(hist) / 1e9,
             "hidden_frac": 1 - tot["d2h_copy_wait_s"] / tot["d2h_busy_s"] if tot["d2h_busy_s"] > 0 else None}
        rows[f"inflight={inflight}"] = r
        print(f"  in flight {inflight}: busy {r['d2h_busy_s']:.3f}s copy wait {r['d2h_copy_wait_s']:.3f}s "
              f"add {r['grad_add_s']:.3f}s peak {r['d2h_queue_peak']:.0f} hidden {_fmt(r['hidden_frac'])}", flush=True)
        del model, tr, hist
        gc.collect()
    two, one = rows["inflight=2"], rows["inflight=1"]
    add_bound = two["grad_add_s"] > two["d2h_busy_s"]
    ok = two["grad_add_s"] > 0 and two["d2h_queue_peak"] <= 2 and one["d2h_queue_peak"] <= 1
    if not a.cpu_dry_run:  # CPU "copies" are conversions on the compute thread: nothing to hide
        ok = ok and two["d2h_busy_s"] > 0 and add_bound and (two["hidden_frac"] or 0) >= 0.5 \
            and two["d2h_copy_wait_s"] < one["d2h_copy_wait_s"]
    nums = {"hidden_frac": two["hidden_frac"], "hidden_frac_inflight_1": one["hidden_frac"], "add_bound": add_bound,
            "d2h_busy_s": two["d2h_busy_s"], "d2h_copy_wait_s": two["d2h_copy_wait_s"], "grad_add_s": two["grad_add_s"],
            "d2h_copy_wait_s_inflight_1": one["d2h_copy_wait_s"], "d2h_queue_peak": two["d2h_queue_peak"]}
    return {"result": "PASS" if ok else "FAIL", "numbers": nums, "details": rows}


def check_update_overlap(a) -> dict:
    dry = ["--layers", "2", "--hidden", "64", "--batch", "2", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    rc, res = _bench("update_overlap", a, dry, ("--rounds", "2", "--schedules", "in_backward"))
    if res is None:
        return {"result": "FAIL", "numbers": {"rc": rc, "error": "no result JSON"}}
    rows = res.get("rows", [])
    nums = {f"t{r['update_threads']}_x{r['factor']}": {"growth_over_base": round(r["growth_s"] / r["base_step_s"], 3),
                                                       "target": round(r["bound_s"] / r["base_step_s"], 3),
                                                       "base_step_s": round(r["base_step_s"], 4)} for r in rows}
    two = [r for r in rows if r["update_threads"] == 2]
    ok = rc == 0 and bool(two) and (a.cpu_dry_run or all(r["pass"] for r in two))
    return {"result": "PASS" if ok else "FAIL", "numbers": nums}


def check_scaling(a) -> dict:
    st = os.statvfs("/dev/shm")
    shm_free = st.f_bavail * st.f_frsize
    small = ["--layers", "2", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "4", "--vocab", "1024"]
    if a.cpu_dry_run:
        shape = small + ["--seq", "32", "--steps", "2", "--warmup", "1", "--accelerator", "cpu", "--sweep", "--share-device"]
    elif shm_free < 4 * 2**30:  # the default shape's state is 0.94 GB
        shape = ["--layers", "4", "--hidden", "256", "--intermediate", "704", "--heads", "4", "--kv-heads", "4",
                 "--vocab", "8000", "--seq", "512", "--accelerator", "gpu"]
    else:
        shape = ["--seq", "512", "--accelerator", "gpu"]
    out = os.path.join(a.results, "scaling_" + ("dryrun" if a.cpu_dry_run else "gpu") + ".json")
    if os.path.exists(out):
        os.remove(out)
    rc, _ = sh([sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--devices", "2", "--process-group-backend",
                "gloo", "--no-baseline", "--out", out, *shape])
    nums = {"rc": rc, "shm_free_GiB": round(shm_free / 2**30, 2)}
    if not os.path.exists(out):
        return {"result": "FAIL", "numbers": {**nums, "error": "no result JSON (see the log)"}}
    with open(out) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        k = r["processes"]
        nums[f"tokens_per_s_{k}"] = round(r["tokens_per_s"], 1)
        nums[f"pss_sum_GiB_{k}"] = round(r["train_pss_sum_bytes"] / 2**30, 3)
        nums[f"shm_B_per_param_{k}"] = round(r["shm_bytes_per_param"], 2)
    two = [r for r in rows if r["processes"] == 2]
    nums["efficiency_2"] = round(two[0]["efficiency"], 3) if two else None
    nums["shared_device"] = bool(two and two[0]["shared_device"])
    ok = rc == 0 and len(two) == 1 and two[0]["backend"] == "gloo" and abs(two[0]["shm_bytes_per_param"] - 16) <= 0.5
    return {"result": "PASS" if ok else "FAIL", "numbers": nums,
            "details": [{k: v for k, v in r.items() if k != "timeline"} for r in rows]}


def _toolchain() -> dict:
    """What DeepSpeed's JIT build of its CPU Adam op needs on this image, and which offload packages import."""
    import importlib.util
    import shutil
    import sysconfig

    inc = sysconfig.get_paths().get("include") or ""
    return {"gxx": shutil.which("g++") or shutil.which("c++"), "ninja": shutil.which("ninja"),
            "python_h": os.path.exists(os.path.join(inc, "Python.h")), "nvcc": shutil.which("nvcc"),
            "torchao": importlib.util.find_spec("torchao") is not None,
            "deepspeed": importlib.util.find_spec("deepspeed") is not None}


def check_peer(a) -> dict:
    tool = _toolchain()
    if a.cpu_dry_run:
        out = os.path.join(a.results, "peer_cpu_dry_run.json")
        args = ["--cpu-dry-run"]
    else:
        out = os.path.join(a.results, "peer.json")
        limit = float(os.environ.get("GPU_CHECK_LIMIT_S", "240"))
        args = ["--shapes", os.environ.get("PEER_SHAPES", "0p9b"), "--steps", "3", "--warmup", "1",
                "--rows", "fp32,bf16,plain,offload,nvme", "--time-budget", str(max(30.0, limit - 100))]
    if os.path.exists(out):
        os.remove(out)
    rc, _ = sh([sys.executable, os.path.join(ROOT, "bench", "peer.py"), *args, "--out", out])
    nums = {"rc": rc, "toolchain": tool}
    if not os.path.exists(out):
        return {"result": "FAIL", "numbers": {**nums, "error": "no result JSON (see the log)"}}
    with open(out) as f:
        res = json.load(f)
    nums["raw_pinned_GBps"] = {k: round(v, 1) for k, v in (res.get("raw_pinned") or {}).items() if k.endswith("GBps")}
    for name, shape in res.get("shapes", {}).items():
        nums[name] = {r["row"]: (r["status"] if "step_s" not in r else
                                 {"step_s": round(r["step_s"], 3), "TFLOPS": round(r["model_TFLOPS"], 1),
                                  "h2d_GBps": None if r.get("h2d_GBps") is None else round(r["h2d_GBps"], 1),
                                  "peak_GiB": None if r.get("peak_device_bytes") is None else round(r["peak_device_bytes"] / 2**30, 2)})
                      for r in shape.get("rows", [])}
        off = next((r for r in shape.get("rows", []) if r["row"] == "offload"), None)
        if off is not None:
            nums[name + "_offload"] = {"ran": off.get("trainer"), "why_not": off.get("why_not")}
    return {"result": "PASS" if rc == 0 and res.get("pass") else "FAIL", "numbers": nums}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)
