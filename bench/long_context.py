"""Peak compute-side memory and step time of long sequences: chunked LM head + loss and chunked MLP
against the full computation and against plain PyTorch + Hugging Face gradient checkpointing.

What: a Llama shape with the Llama 3 vocabulary (128,256 tokens), hidden 512, intermediate 1792,
4 layers, 8 heads / 2 KV heads, untied head, fp32, SDPA attention, batch 1, on the CPU. Modes:

* ``chunked``: ``StreamingEngine(loss_chunk_size="auto", mlp_chunk_size=2048)`` (the strategy's
  engine; "auto" = 523 tokens of logits per chunk, 256 MiB);
* ``full``: the same engine with ``loss_chunk_size=None`` (the full logits, HF's own loss);
* ``plain``: the unmodified model, ``gradient_checkpointing_enable()``, ``torch.optim.AdamW``.

How: each (mode, sequence) runs in its own subprocess. Two warm-up steps at 256 tokens allocate
everything that persists (host masters, gradient accumulators, AdamW moments; plain PyTorch keeps
its ``.grad`` tensors: ``zero_grad(set_to_none=False)``); glibc's heap is bounded as the engine does
under a host budget (``store/heap.py``: fixed 8 MiB mmap threshold, so freed activations leave the
process) and trimmed; then one training step at the measured length (forward, backward, optimizer
step). Meter, independent of the engine's own accounting: a thread samples the process RSS
(``/proc/self/statm``) every 2 ms; "compute peak" = max RSS during the step - RSS just before it
(the host store and the interpreter are in that baseline). On CPU the "device" is host memory, so
this is what an accelerator would hold for the step, plus allocator slack. Step time: wall time of
that one step (the machine is shared: +-10%).

Targets: the chunked peak grows linearly in the sequence length with a small slope, and
stays below one full logits tensor (T x 128,256 x 4 bytes) at 16k tokens; chunked step time
reported against full.

Run:
    python bench/long_context.py                        # chunked at 2k..32k, full and plain up to 4k
    python bench/long_context.py --seqs 2048 4096 8192 --full-max 4096
Writes bench/results/long_context.json (and prints a table). ``--full-max``: the longest sequence
run in the full/plain modes (their logits alone take T x 128,256 x 4 bytes, ~3-4 such tensors at
once: 8k would need about 17 GB on this 24 GB machine shared with other jobs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

V, H, I, L, HEADS, KV = 128256, 512, 1792, 4, 8, 2
GiB = 2**30


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples RSS every ``every`` seconds on a daemon thread; ``peak`` is the maximum seen."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.every)

    def __enter__(self) -> "PeakRSS":
        self.peak = rss()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def one(mode: str, seq: int, threads: int) -> dict:
    """Run one (mode, seq) measurement in this process; returns its row."""
    import torch
    import transformers

    from megatrain_lightning.store import heap

    torch.set_num_threads(threads)
    heap.bound_heap()
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=seq,
                                   tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    if mode == "plain":
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        close = lambda: None  # noqa: E731
    else:
        from megatrain_lightning.engine.streaming import StreamingEngine

        engine = StreamingEngine(model, torch.device("cpu"), loss_chunk_size="auto" if mode == "chunked" else None,
                                 mlp_chunk_size=2048 if mode == "chunked" else None)
        engine.install()
        model.train()
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            engine.attach_grads()
            engine.step()
            engine.end_step()

        close = engine.close
    for _ in range(2):
        step(torch.randint(0, V, (1, 256), generator=gen))
    ids = torch.randint(0, V, (1, seq), generator=gen)
    heap.trim()
    base = rss()
    t0 = time.perf_counter()
    with PeakRSS() as meter:
        step(ids)
    dt = time.perf_counter() - t0
    close()
    return {"mode": mode, "seq": seq, "baseline_rss_bytes": base, "peak_rss_bytes": meter.peak,
            "compute_peak_bytes": meter.peak - base, "step_s": dt, "logits_bytes": seq * V * 4,
            "threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--full-max", type=int, default=4096, help="longest sequence run in the full and plain modes")
    p.add_argument("--modes", nargs="+", default=["chunked", "full", "plain"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--append", action="store_true", help="add to the rows already in --out (same mode/seq replaced)")
    p.add_argument("--one", nargs=2, metavar=("MODE", "SEQ"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "long_context.json"))
    args = p.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(args.one[0], int(args.one[1]), args.threads)), flush=True)
        return
    rows, skipped = [], []
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        rows = [r for r in old["rows"] if r["seq"] not in args.seqs]
        skipped = [s for s in old["not_run"] if s["seq"] not in args.seqs]
    for seq in args.seqs:
        for mode in args.modes:
            if mode != "chunked" and seq > args.full_max:
                skipped.append({"mode": mode, "seq": seq, "why": f"--full-max {args.full_max}: needs ~4 x "
                                f"{seq * V * 4 / GiB:.1f} GiB of logits"})
                continue
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
            out = subprocess.run([sys.executable, __file__, "--one", mode, str(seq), "--threads", str(args.threads)],
                                 capture_output=True, text=True, env=env)
            row = next((json.loads(x[4:]) for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
            if row is None:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                skipped.append({"mode": mode, "seq": seq, "why": f"failed (exit {out.returncode})"})
                continue
            rows.append(row)
            print(f"  {mode:8s} {seq:6d} tokens: compute peak {row['compute_peak_bytes'] / GiB:6.2f} GiB, "
                  f"step {row['step_s']:7.1f} s", flush=True)
    chunked = sorted((r for r in rows if r["mode"] == "chunked"), key=lambda r: r["seq"])
    slope = None
    if len(chunked) >= 2:  # least squares bytes per token
        n = len(chunked)
        mx = sum(r["seq"] for r in chunked) / n
        my = sum(r["compute_peak_bytes"] for r in chunked) / n
        slope = (sum((r["seq"] - mx) * (r["compute_peak_bytes"] - my) for r in chunked)
                 / sum((r["seq"] - mx) ** 2 for r in chunked))
    at16 = next((r for r in chunked if r["seq"] == 16384), None)
    below = at16 is not None and at16["compute_peak_bytes"] < at16["logits_bytes"]
    print(f"\nlong context: Llama h{H} i{I} {L} layers {HEADS}h/{KV}kv vocab {V}, batch 1, fp32, CPU "
          f"({rows[0]['threads'] if rows else args.threads} threads); compute peak = max RSS in the step - RSS before it")
    print(f"{'seq':>6s} | {'chunked GiB':>11s} {'s':>7s} | {'full GiB':>8s} {'s':>7s} | {'plain+ckpt GiB':>14s} {'s':>7s} | "
          f"{'1 logits GiB':>12s}")
    for seq in sorted({r["seq"] for r in rows} | {s["seq"] for s in skipped}):
        cell = {}
        for mode in ("chunked", "full", "plain"):
            r = next((x for x in rows if x["mode"] == mode and x["seq"] == seq), None)
            cell[mode] = (f"{r['compute_peak_bytes'] / GiB:.2f}", f"{r['step_s']:.1f}") if r else ("-", "-")
        print(f"{seq:6d} | {cell['chunked'][0]:>11s} {cell['chunked'][1]:>7s} | {cell['full'][0]:>8s} {cell['full'][1]:>7s} | "
              f"{cell['plain'][0]:>14s} {cell['plain'][1]:>7s} | {seq * V * 4 / GiB:12.2f}")
    if slope is not None:
        print(f"chunked: {slope / 1024:.1f} KiB per token (least squares over {len(chunked)} lengths)")
    if at16 is not None:
        print(f"chunked peak at 16k below one full logits tensor ({at16['logits_bytes'] / GiB:.2f} GiB): "
              f"{'PASS' if below else 'FAIL'}")
    for s in sorted(skipped, key=lambda s: (s["seq"], s["mode"])):
        print(f"not run: {s['mode']} at {s['seq']}: {s['why']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"shape": {"vocab": V, "hidden": H, "intermediate": I, "layers": L, "heads": HEADS, "kv_heads": KV,
                             "batch": 1, "dtype": "fp32", "attn": "sdpa"},
                   "chunked_bytes_per_token": slope, "below_one_logits_at_16k": below if at16 else None,
                   "rows": rows, "not_run": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
