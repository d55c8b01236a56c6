"""bench/host_optimizers.py in its ``--quick`` mode: a row per optimizer, host state bytes equal to plain PyTorch's,
and the host masters bitwise equal to the plain parameters after the timed steps; the planner column picks up a
per-optimizer state-bytes function when the planner has one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# torchao's AdamW8bit compiles its kernel (torch.compile, one graph per shape): tens of seconds on a cold cache
FAST = ["adamw", "adam", "sgd_nesterov", "adafactor", "rmsprop", "adagrad", "nadam", "radam", "adamax", "muon_2d",
        "lion"]


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_host_optimizers", ROOT / "bench" / "host_optimizers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_has_a_passing_row_per_optimizer(tmp_path):
    t0 = time.time()
    out = tmp_path / "host_optimizers.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "host_optimizers.py"), "--quick", "--steps", "2",
                        "--only", ",".join(FAST), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {r["optimizer"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(FAST)
    for name, r in rows.items():
        assert r["status"] == "ok", r
        assert r["numbers"] == "PASS", (name, r["mismatched"])
        assert r["state_bytes_equal"] and r["state_bytes_host"] == r["state_bytes_plain"] > 0, r
        assert r["steps"] == 2 and len(r["host_s_all"]) == len(r["plain_s_all"]) == 2
        assert r["host_params_per_s"] > 0 and r["plain_params_per_s"] > 0
    assert rows["adamw"]["host_impl"] == "HostAdamW" and rows["sgd_nesterov"]["host_impl"] == "HostTorchOptimizer"
    # AdamW's state is the store's moments (+ a 4-byte step per parameter); SGD's one momentum buffer
    assert rows["adamw"]["store_adamw_region_bytes"] == 8 * rows["adamw"]["params"]
    assert rows["sgd_nesterov"]["state_bytes_host"] == 4 * rows["sgd_nesterov"]["params"]
    assert rows["muon_2d"]["params"] < rows["adamw"]["params"]  # 2-D weights only
    assert time.time() - t0 < 90


def test_planner_column_is_the_planners_host_ram_for_each_optimizer():
    """The llama100b column: the planner with that optimizer, AdamW's state in RAM above Adafactor's and SGD's."""
    bench = _bench_module()
    ram = {k: bench.planner_row(k)["llama100b_host_bytes"] for k in ("adamw", "sgd_nesterov", "adafactor", "rmsprop")}
    assert ram["adafactor"] < ram["sgd_nesterov"] <= ram["rmsprop"] < ram["adamw"]  # RMSprop: + a step per tensor
    # AdamW's 8 B/param against SGD's momentum, 4 B/param (each within a 4-byte step per tensor)
    from megatrain_lightning.plan import plan_from_config
    from megatrain_lightning.planning import compose

    counts = plan_from_config(compose(["model=llama100b", "hardware=h200"])).counts
    assert abs(ram["adamw"] - ram["sgd_nesterov"] - 4 * counts.total) <= 4 * len(counts.shapes)
