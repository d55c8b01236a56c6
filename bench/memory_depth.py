"""Peak memory of one streamed training step vs model depth, with and without activation offload.

What: Llama models with 4, 8, 16 and 32 decoder layers (hidden 256, intermediate 688,
8 heads, 4 kv heads, vocab 4096, untied, fp32, batch 2 x 256 tokens) trained by the
StreamingEngine directly (no Lightning), offload_activations False and True. For each
run: the peak memory allocated during one training step (forward, backward, gradient
accumulation, AdamW scheduling). The device holds one computing block, `lookahead`
prefetched blocks and the saved block inputs, so without offload the peak grows by the
saved inputs, L x B x T x H x 4 bytes, and with offload it should stay flat in depth.

How: 2 warm-up steps (the first allocates the host gradient accumulators, the second
applies the first AdamW update during its forward and so allocates exp_avg/exp_avg_sq;
--warmup below 2 is raised to 2), then one measured step, metered independently of the engine's own accounting:
  * cuda: torch.cuda.max_memory_allocated(), reset before the step;
  * cpu:  torch.profiler.profile(activities=[CPU], profile_memory=True) around the step;
          the peak of the running sum of the raw allocator events ("[memory]" records of
          prof.profiler.kineto_results, +bytes = alloc, -bytes = free, sorted by time).
          prof.events() is not used: it folds each allocation into every enclosing op's
          cpu_memory_usage. Frees of memory allocated before the step are not events
          (PyTorch warns once: "Memory block of unknown size..."), so the peak is the
          step's own high-water mark. A self-check on known allocations is printed first.
          The profiler records allocations only on the thread it was started on, and the
          engine allocates block copies on its H2D worker and frees gradients on its D2H
          worker; on CPU both workers are therefore replaced by inline executors (same
          schedule: a prefetch still allocates when the previous block is acquired).
          Pass --async-workers to keep the threads and see the meter go wrong.
On CPU the offloaded copies of block inputs are host memory, indistinguishable from the
"device" for the profiler; their bytes are counted (wrapping engine.boundary.offload.offload) and
subtracted: "device" = raw peak - offloaded bytes (the peak is at the loss, when every
offloaded copy is alive). On CUDA they are pinned host memory and "device" = raw peak.

Target: device peak grows < 10% from 4 to 32 layers with offload_activations=True
(PASS/FAIL printed; exit code 0).

Run:
    python bench/memory_depth.py                  # CPU, ~1 minute
    python bench/memory_depth.py --device cuda
bench/gpu_check.py's ``depth`` check imports this module and calls :func:`run` (deeper models).
Writes bench/results/memory_depth.json.
"""

import argparse
import gc
import json
import os
from concurrent.futures import Future

import torch
import transformers
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from megatrain_lightning.engine.streaming import StreamingEngine

TARGET = 0.10
DEPTHS = (4, 8, 16, 32)
B, T, H = 2, 256, 256
MiB = 2**20

#: the model and batch of the sweep: Llama hidden 256, intermediate 688, 8 heads, 4 kv heads, vocab 4096, batch 2 x 256
SHAPE = dict(hidden=H, intermediate=688, heads=8, kv_heads=4, vocab=4096, batch=B, seq=T)


def profiled_peak(fn):
    """Peak of the running sum of CPU allocations made by fn() on this thread (bytes), and the net."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    cur = peak = 0
    for e in sorted(evs, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, cur


def meter(fn, dev):
    """Peak bytes allocated by ``fn()``: CUDA's peak statistics on a CUDA ``dev``, else :func:`profiled_peak`."""
    cuda = dev.type == "cuda"
    if not cuda:
        return profiled_peak(fn)[0]
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev)


class Inline:
    """Stand-in for the engine's ThreadPoolExecutors: runs work on the calling thread."""

    def submit(self, fn, *a, **kw):
        f = Future()
        try:
            f.set_result(fn(*a, **kw))
        except BaseException as exc:  # noqa: BLE001 - re-raised by f.result() like a real executor
            f.set_exception(exc)
        return f

    def shutdown(self, wait=True):
        pass


def self_check():
    """Known allocations: 10 MiB, +5 MiB, free 10, +1 MiB -> peak 15 MiB, net 0."""
    def fn():
        a = torch.empty(10 * MiB, dtype=torch.uint8)
        b = torch.empty(5 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(1 * MiB, dtype=torch.uint8)
        del b, c
    peak, net = profiled_peak(fn)
    ok = peak == 15 * MiB and net == 0
    print(f"meter self-check: peak {peak / MiB:.2f} MiB (expect 15.00), net {net / MiB:.2f} MiB (expect 0.00): {'ok' if ok else 'WRONG'}")
    return {"peak_bytes": peak, "net_bytes": net, "ok": ok}


def run(layers, offload, dev, warmup=2, async_workers=False, shape=None):
    """One row of the sweep: the peak memory (bytes) of one training step of a ``layers``-deep Llama on ``dev``
    after ``max(2, warmup)`` warm-up steps. ``shape``: :data:`SHAPE`'s keys (default :data:`SHAPE`);
    ``async_workers``: on CPU keep the engine's worker threads (the meter then misses their allocations)."""
    sh = {**SHAPE, **(shape or {})}
    B, T, H = sh["batch"], sh["seq"], sh["hidden"]
    cuda = dev.type == "cuda"
    warmup = max(2, warmup)  # fewer would put the host AdamW state allocation into the measured step (CPU meter)
    cfg = transformers.LlamaConfig(vocab_size=sh["vocab"], hidden_size=H, intermediate_size=sh["intermediate"],
                                   num_hidden_layers=layers, num_attention_heads=sh["heads"],
                                   num_key_value_heads=sh["kv_heads"], max_position_embeddings=T,
                                   tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    engine = StreamingEngine(model, dev, offload_activations=offload)
    if not cuda and not async_workers:
        for part in (engine.prefetcher, engine.grads):  # run the H2D/D2H work inline on the compute thread
            part._pool.shutdown()
            part._pool = Inline()
    engine.install()
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    offloaded = [0]
    orig_offload = engine.boundary.offload.offload

    def counting_offload(t):
        offloaded[0] += t.numel() * t.element_size()
        return orig_offload(t)

    engine.boundary.offload.offload = counting_offload
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1)).to(dev)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
        engine.attach_grads()
        engine.step()

    for _ in range(warmup):
        step()
        engine.end_step()
    offloaded[0] = 0
    raw = meter(step, dev)
    engine.end_step()  # outside the meter: on CUDA it resets the peak statistics
    host = offloaded[0] if not cuda else 0
    row = {"layers": layers, "offload": offload, "raw_peak_bytes": raw, "offloaded_host_bytes": offloaded[0],
           "device_peak_bytes": raw - host, "saved_inputs_bytes": layers * B * T * H * 4,
           "offloaded_blocks": offloaded[0] / (B * T * H * 4),
           "engine_peak_device_bytes": engine.history[-1]["megatrain/peak_device_bytes"],
           "n_blocks": len(engine.blocks), "n_params": sum(p.numel() for p in model.parameters())}
    engine.close()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps; at least 2 are run (see the docstring)")
    p.add_argument("--async-workers", action="store_true", help="cpu: keep the engine's worker threads (meter misses their allocations)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_depth.json"))
    args = p.parse_args()
    warmup = max(2, args.warmup)  # fewer would put the host AdamW state allocation into the measured step (CPU meter)

    torch.set_num_threads(2)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    check = None if cuda else self_check()
    rows = []
    for offload in (False, True):
        for L in DEPTHS:
            gc.collect()  # the previous engine's reference cycles still hold its buffers
            rows.append(run(L, offload, dev, warmup, args.async_workers))
            r = rows[-1]
            print(f"  layers {L:2d} offload {offload!s:5s}: raw peak {r['raw_peak_bytes'] / MiB:8.2f} MiB", flush=True)

    for r in rows:
        ref = next(x for x in rows if x["offload"] == r["offload"] and x["layers"] == DEPTHS[0])
        r["growth_vs_4"] = r["device_peak_bytes"] / ref["device_peak_bytes"] - 1
        r["delta_peak_vs_4_bytes"] = r["device_peak_bytes"] - ref["device_peak_bytes"]
        r["delta_saved_inputs_vs_4_bytes"] = r["saved_inputs_bytes"] - ref["saved_inputs_bytes"]

    growth = next(r["growth_vs_4"] for r in rows if r["offload"] and r["layers"] == DEPTHS[-1])
    passed = growth < TARGET
    meter_name = "torch.cuda.max_memory_allocated" if cuda else "torch.profiler CPU allocation events" + (" (async workers)" if args.async_workers else "")
    print(f"\nmemory vs depth: Llama h{H} i688 8h/4kv v4096 untied, batch {B} x {T}, fp32, {args.device}, meter: {meter_name}")
    print(f"{'layers':>6s} {'offload':>7s} {'raw peak':>9s} {'offl host':>9s} {'device':>8s} {'growth':>7s} {'L*B*T*H*4':>9s} "
          f"{'d peak':>8s} {'d saved':>8s}   (MiB; growth and d = vs {DEPTHS[0]} layers)")
    for r in rows:
        print(f"{r['layers']:6d} {str(r['offload']):>7s} {r['raw_peak_bytes'] / MiB:9.2f} {r['offloaded_host_bytes'] / MiB:9.2f} "
              f"{r['device_peak_bytes'] / MiB:8.2f} {100 * r['growth_vs_4']:6.1f}% "
              + (f"{r['saved_inputs_bytes'] / MiB:9.2f} " if not r["offload"] else f"{'-':>9s} ")
              + f"{r['delta_peak_vs_4_bytes'] / MiB:8.2f} "
              + (f"{r['delta_saved_inputs_vs_4_bytes'] / MiB:8.2f}" if not r["offload"] else f"{'-':>8s}"))
    print(f"offload_activations=True: device peak growth {DEPTHS[0]} -> {DEPTHS[-1]} layers = {100 * growth:.1f}% "
          f"(target < {100 * TARGET:.0f}%): {'PASS' if passed else 'FAIL'}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "memory_depth", "args": vars(args), "warmup_steps": warmup, "torch": torch.__version__, "transformers": transformers.__version__,
                   "meter": meter_name, "meter_self_check": check, "batch": B, "seq": T, "hidden": H, "target_growth": TARGET,
                   "growth_4_to_32_offload": growth, "pass": passed, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
