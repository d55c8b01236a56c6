"""Plan against run: the planner's host RAM and step time beside what real runs on this machine measure.

For each configuration of a matrix (tiny and small Llama models; the RAM and NVMe tiers; ``recompute`` block,
selective and none; 512 to 8192 tokens; ``32-true`` and ``bf16-mixed``; ``mlp_chunk_size``; one data-parallel run of
two processes over gloo) this script plans the run with :func:`megatrain_lightning.plan.plan` on the
``this_machine`` preset, then trains it for 3 optimizer steps with ``Trainer(strategy=MegaTrainStrategy(...),
accelerator="cpu")`` in a subprocess, and measures:

* peak host RAM: an independent sampler in this process reads ``/proc/<pid>/status`` of the run's process tree
  every 20 ms and sums ``RssAnon + RssFile`` over the processes, plus the largest ``RssShmem`` (the training state
  of a data-parallel run is shared memory, mapped by every process: counted once); the run's own ``VmHWM`` (peak
  RSS, from the kernel) is reported beside it, and the larger of the two is the measurement for one process;
* step time: seconds from one ``on_train_batch_start`` to the next (the second and third steps; the first
  includes warm-up), the median; and the CPU seconds other processes used meanwhile (``/proc/stat`` minus the
  run's own), so that contention on a shared machine shows.

The step time is planned twice: at the preset's compute rate ("plan s"), and at this machine's rate for the
configuration's own model, precision and batch ("rate plan s"): a plain PyTorch training step of the same Hugging
Face model measured in a subprocess just before the run (``planning.measure.model_step_tflops``, what the planner
tells users to run for their shapes, put in as ``hardware.fp32_tflops`` / ``hardware.bf16_tflops``). The second
asks whether the planner's model of the engine (recompute, copies, the host update, overlap) is right on this
machine, the first also whether the preset's one rate fits every shape (it does not: small shapes run far below
it). ``--no-rate`` skips the measurement.

It prints a table (plan, measured, measured / plan for both) and writes ``bench/results/plan_vs_run.json``.
Targets: measured peak host RAM within -10%/+5% of the plan, step time within +-25% of the plan at the measured
rate.
Units: GiB = 2**30 B, seconds.

    PYTHONPATH=. python bench/plan_vs_run.py            # the whole matrix (about 10 minutes on 2 cores)
    PYTHONPATH=. python bench/plan_vs_run.py --quick    # 3 configurations, a smoke test
    PYTHONPATH=. python bench/plan_vs_run.py --only m-nvme-fp32-block-1x1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 2**30
HERE = Path(__file__).resolve()
RAM_TOL = (-0.10, 0.05)   # measured / plan - 1, peak host RAM
TIME_TOL = 0.25           # |measured / plan - 1|, step time

#: Llama shapes (Hugging Face ``LlamaConfig`` fields; and SmolLM2-135M, ``CONF_MODELS``): "t" 0.9 M parameters (the long sequences), "s" 5.2 M, "m" 21 M
#: (its activations and MLP intermediates are 2-11 MiB tensors, in the range glibc's dynamic mmap threshold keeps)
MODELS = {
    "t": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, vocab_size=2048),
    "s": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=4096),
    "m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=8192),
    # 16 layers: bench/nvme_window.py's deeper model (the NVMe window's minimum is 3 of its 18 blocks)
    "d": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=16, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=4096),
}


def config(model: str, tier: str, precision: str, recompute: str, batch: int, seq: int, devices: int = 1,
         mlp_chunk: int | None = None) -> dict:
    name = f"{model}-{tier}-{'fp32' if precision == '32-true' else 'bf16'}-{recompute}-{batch}x{seq}"
    name += (f"-mlp{mlp_chunk}" if mlp_chunk else "") + (f"-dp{devices}" if devices > 1 else "")
    return dict(name=name, model=model, tier=tier, precision=precision, recompute=recompute, batch_size=batch,
                seq_len=seq, devices=devices, mlp_chunk_size=mlp_chunk)


MATRIX = [
    config("s", "ram", "32-true", "block", 1, 512),
    config("s", "ram", "bf16-mixed", "block", 1, 1024),
    config("s", "ram", "32-true", "block", 1, 2048),
    config("t", "ram", "32-true", "block", 1, 8192),
    config("t", "ram", "32-true", "block", 1, 8192, mlp_chunk=1024),
    config("s", "ram", "bf16-mixed", "selective", 2, 512),
    config("s", "ram", "32-true", "none", 1, 1024),
    config("t", "ram", "bf16-mixed", "none", 1, 2048),
    config("m", "ram", "32-true", "block", 1, 1024),
    config("m", "ram", "bf16-mixed", "block", 1, 1024),
    config("m", "ram", "32-true", "selective", 1, 1024),
    config("s", "nvme", "32-true", "block", 1, 512),
    config("m", "nvme", "bf16-mixed", "block", 1, 512),
    config("s", "ram", "32-true", "block", 1, 512, devices=2),
    config("smollm2", "ram", "32-true", "block", 4, 512),
]
QUICK = ["s-ram-fp32-block-1x512", "s-ram-fp32-none-1x1024", "s-nvme-fp32-block-1x512"]


#: real models of ``conf/model`` in the matrix: name -> the entry (its ``config`` is what the planner reads)
CONF_MODELS = {"smollm2": "smollm2_135m"}


def model_config(c: dict) -> dict:
    if c["model"] in CONF_MODELS:
        from megatrain_lightning.plan import load_model

        return {**load_model(CONF_MODELS[c["model"]])["config"], "use_cache": False}
    return {"model_type": "llama", **MODELS[c["model"]], "max_position_embeddings": max(2048, c["seq_len"]),
            "tie_word_embeddings": False, "use_cache": False}


def strategy_kwargs(c: dict, nvme_path: str | None) -> dict:
    kw = dict(recompute=c["recompute"], mlp_chunk_size=c["mlp_chunk_size"])
    if c["tier"] == "nvme":
        kw.update(offload_params="nvme", offload_optimizer="nvme", nvme_path=nvme_path)
    return kw


def plan_of(c: dict, tflops: float | None = None, host_memory_limit: int | None = None):
    """The planner's plan of configuration ``c`` on the ``this_machine`` preset, with the strategy's defaults for
    what ``c`` does not set (as the recipes' preflight plans a run); ``tflops``: the preset's compute rate for
    ``c``'s precision replaced by this one (``hardware.fp32_tflops`` / ``hardware.bf16_tflops``);
    ``host_memory_limit``: bytes (None: the strategy's default)."""
    import dataclasses

    from megatrain_lightning.plan import load_hardware
    from megatrain_lightning.planning.preflight import plan_for_run

    st = strategy_kwargs(c, None)
    st.pop("nvme_path", None)
    if host_memory_limit is not None:
        st["host_memory_limit"] = host_memory_limit
    hw = load_hardware("this_machine")
    if tflops is not None:
        hw = dataclasses.replace(hw, **{"fp32_tflops" if c["precision"] == "32-true" else "bf16_tflops": tflops})
    return plan_for_run({"name": c["name"], "config": model_config(c)}, hw, st,
                        batch_size=c["batch_size"], seq_len=c["seq_len"], precision=c["precision"],
                        devices=c["devices"])


# ---------------------------------------------------------------- the run (a subprocess)
def step_timer():
    """A Lightning callback whose ``t`` lists ``time.perf_counter()`` at every ``on_train_batch_start`` and at
    ``on_train_end``: the step times are the differences."""
    import lightning.pytorch as pl

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.t.append(time.perf_counter())

    return Timer()


def worker(c: dict, out: str) -> None:
    import lightning.pytorch as pl
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.testing import LM

    cfg = model_config(c)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (3 * c["batch_size"] * c["devices"], c["seq_len"]), generator=g)
    timer = step_timer()
    with tempfile.TemporaryDirectory(dir=os.environ.get("MEGATRAIN_NVME_PATH")) as d:
        trainer = pl.Trainer(strategy=MegaTrainStrategy(**strategy_kwargs(c, d)), accelerator="cpu",
                             devices=c["devices"], max_steps=3, precision=c["precision"], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[timer], use_distributed_sampler=True)
        trainer.fit(LM(model), DataLoader(TensorDataset(ids), batch_size=c["batch_size"]))
    if trainer.global_rank == 0:
        steps = [b - a for a, b in zip(timer.t, timer.t[1:])]
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        Path(out).write_text(json.dumps({"steps_s": steps, "vmhwm_bytes": hwm,
                                         "history": trainer.strategy.engine.history}))


def rate_worker(c: dict, out: str) -> None:
    """This machine's compute rate for ``c``'s model, precision and batch: a plain PyTorch training step of the same
    Hugging Face model (``planning.measure.model_step_tflops``, the tool the planner's docs tell users to run),
    median of 2 after a warm-up; TFLOP/s as the planner counts a plain step."""
    from megatrain_lightning.planning.measure import model_step_tflops

    r = model_step_tflops(c["seq_len"], 0, c["precision"] != "32-true", repeats=2, config=model_config(c),
                          batch_size=c["batch_size"])
    Path(out).write_text(json.dumps({"tflops": r}))


def measure_rate(c: dict, env: dict[str, str], timeout: float) -> float | None:
    """:func:`rate_worker` in a subprocess (its memory stays out of the run's); ``None`` if it fails."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rate.json")
        r = subprocess.run([sys.executable, str(HERE), "--rate-worker", json.dumps(c), "--out", out], env=env,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not os.path.exists(out):
            print(f"{c['name']}: rate measurement failed: {r.stdout[-500:]}{r.stderr[-1500:]}", flush=True)
            return None
        return float(json.loads(Path(out).read_text())["tflops"])


# ---------------------------------------------------------------- the sampler (this process)
def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return pids


class Sampler(threading.Thread):
    """Peak over time of the process tree's resident bytes (module docstring), every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period, self.peak, self.stop = pid, period, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            st = [_status(p) for p in _tree(self.pid)]
            total = sum(s.get("RssAnon", 0) + s.get("RssFile", 0) for s in st) + \
                max((s.get("RssShmem", 0) for s in st), default=0)
            self.peak = max(self.peak, total)
            time.sleep(self.period)


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of the run (its threads and its waited-for children): from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in s[11:15]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def measure(c: dict, env: dict[str, str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        cmd = [sys.executable, str(HERE), "--worker", json.dumps(c), "--out", out]
        busy0, t0 = _busy_s(), time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        own, last_cpu = 0.0, 0.0
        try:
            while proc.poll() is None:
                last_cpu = max(last_cpu, sum(_tree_cpu_s(p) for p in _tree(proc.pid)))
                time.sleep(0.2)
            log = proc.stdout.read() if proc.stdout else ""
        finally:
            if proc.poll() is None:
                proc.kill()
            sampler.stop.set()
            sampler.join()
        wall = time.perf_counter() - t0
        own = last_cpu
        other = max(0.0, _busy_s() - busy0 - own)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"exit {proc.returncode}", "log_tail": log[-3000:]}
        r = json.loads(Path(out).read_text())
    steps = r["steps_s"][1:] or r["steps_s"]
    peak = sampler.peak if c["devices"] > 1 else max(sampler.peak, r["vmhwm_bytes"])
    return {"peak_host_bytes": peak, "sampled_peak_bytes": sampler.peak, "vmhwm_bytes": r["vmhwm_bytes"],
            "step_s": statistics.median(steps), "steps_s": r["steps_s"], "wall_s": wall,
            "other_cpu_share": other / max(wall, 1e-9) / (os.cpu_count() or 1),
            "peak_device_bytes": max(h["megatrain/peak_device_bytes"] for h in r["history"]),
            # the engine's own phase times (median of steps 2 and 3): compute on the compute thread, the host
            # optimizer's updates on any thread, the compute thread's waits for copies and updates
            **{f"engine_{k}": statistics.median(h[f"megatrain/{k}"] for h in r["history"][1:] or r["history"])
               for k in ("compute_s", "optimizer_s", "wait_s")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--only", nargs="*", help="configuration names")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "plan_vs_run.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rate-worker", help=argparse.SUPPRESS)
    ap.add_argument("--no-rate", action="store_true",
                    help="skip measuring each configuration's compute rate (the step time is then judged against the "
                         "preset's rate only)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--no-malloc-tuning", action="store_true",
                    help="runs with MEGATRAIN_MALLOC_TUNING=0: glibc's default malloc thresholds (store/allocator.py)")
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker), a.out)
        return 0
    if a.rate_worker:
        rate_worker(json.loads(a.rate_worker), a.out)
        return 0
    todo = [c for c in MATRIX if (not a.quick or c["name"] in QUICK) and (not a.only or c["name"] in a.only)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent.parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    if a.no_malloc_tuning:
        env["MEGATRAIN_MALLOC_TUNING"] = "0"
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    head = (f"{'configuration':<34} {'plan GiB':>8} {'run GiB':>8} {'ratio':>6} {'plan s':>8} {'rate plan s':>11} "
            f"{'run s':>8} {'ratio':>6} {'other CPU':>9}  ok")
    print(head + "\n" + "-" * len(head), flush=True)
    rows = []
    for c in todo:
        p = plan_of(c)
        rate = None if a.no_rate else measure_rate(c, env, a.timeout)
        q = plan_of(c, rate) if rate is not None else p
        m = measure(c, env, a.timeout)
        row = {**c, "plan_host_bytes": p.host_bytes, "plan_host": dict(p.host), "plan_step_s": p.step_time_s,
               "plan_fastest_s": p.step_time_fastest_s, "plan_dominating": p.dominating,
               "measured_tflops": rate, "plan_step_measured_rate_s": q.step_time_s,
               "plan_dominating_measured_rate": q.dominating, **m}
        if "error" in m:
            print(f"{c['name']:<34} ERROR {m['error']}\n{m['log_tail']}", flush=True)
            rows.append(row)
            continue
        if m.get("engine_optimizer_s"):  # params updated per second inside the step (rank 0's share with 2 ranks)
            row["engine_update_gparams_per_s"] = p.counts.total / c["devices"] / m["engine_optimizer_s"] / 1e9
        rr = m["peak_host_bytes"] / p.host_bytes
        tr = m["step_s"] / q.step_time_s
        row.update(ram_ratio=rr, time_ratio=tr, time_ratio_preset_rate=m["step_s"] / p.step_time_s,
                   ram_ok=RAM_TOL[0] <= rr - 1 <= RAM_TOL[1], time_ok=abs(tr - 1) <= TIME_TOL)
        rows.append(row)
        ok = ("" if row["ram_ok"] else " RAM") + ("" if row["time_ok"] else " TIME")
        print(f"{c['name']:<34} {p.host_bytes / GIB:>8.2f} {m['peak_host_bytes'] / GIB:>8.2f} {rr:>6.2f} "
              f"{p.step_time_s:>8.2f} {q.step_time_s:>11.2f} {m['step_s']:>8.2f} {tr:>6.2f} "
              f"{m['other_cpu_share']:>8.0%}  "
              f"{'yes' if not ok else 'NO:' + ok}", flush=True)
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    done = [r for r in rows if "ram_ratio" in r]
    print(f"\nwithin targets: host RAM {sum(r['ram_ok'] for r in done)}/{len(done)} (-10%/+5%), step time "
          f"{sum(r['time_ok'] for r in done)}/{len(done)} (+-25%); load average before {' '.join(load0)}, after "
          f"{' '.join(load1)}; other CPU: share of all {os.cpu_count()} cores used by other processes during the run")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    import torch

    Path(a.out).write_text(json.dumps({"bench": "plan_vs_run", "torch": torch.__version__, "cpus": os.cpu_count(),
                                       "loadavg_before": load0, "loadavg_after": load1,
                                       "targets": {"ram": RAM_TOL, "step_time": TIME_TOL}, "rows": rows},
                                      indent=1, default=str) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
