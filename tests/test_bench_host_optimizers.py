"""bench/host_optimizers.py in its ``--quick`` mode: a row per optimizer, host state bytes equal to plain PyTorch's,
and the host masters bitwise equal to the plain parameters after the timed steps; the planner column picks up a
per-optimizer state-bytes function when the planner has one."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# torchao's AdamW8bit compiles its kernel (torch.compile, one graph per shape): tens of seconds on a cold cache
FAST = ["adamw", "adam", "sgd_nesterov", "adafactor", "rmsprop", "adagrad", "nadam", "radam", "adamax", "muon_2d",
        "lion"]
OPTIONAL = {"lion"}  # rows that may say why they did not run (the package is not installed)


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
        if r["status"] == "skipped" and name in OPTIONAL:
            assert r["reason"], r
            continue
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


def test_planner_column_uses_a_per_optimizer_state_bytes_function(monkeypatch):
    bench = _bench_module()
    name = "megatrain_lightning.planning.optimizers"
    if importlib.util.find_spec(name) is None:
        fake = types.ModuleType(name)
        fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
        fake.state_bytes_per_param = lambda opt: {"SGD": 4.0, "AdamW": 8.0}[type(opt).__name__]
        monkeypatch.setitem(sys.modules, name, fake)
    per_optimizer, note = bench.planner_hook()
    assert per_optimizer is not None, note
    p = torch.nn.Parameter(torch.zeros(2))
    sgd = per_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9))
    adamw = per_optimizer(torch.optim.AdamW([p]))
    assert adamw["llama100b_host_bytes"] == adamw["llama100b_host_bytes_adamw"], adamw
    assert 0 < sgd["llama100b_host_bytes"] < adamw["llama100b_host_bytes"], sgd
