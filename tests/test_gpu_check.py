"""bench/gpu_check.py, the GPU acceptance runner, in its CPU dry run: the cheapest check writes its JSON row to
``$OUT/gpu_check.jsonl`` as it ends, and the rows of a check past the budget are SKIP rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    e = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
         "GPU_CHECK_START": "", "GPU_CHECK_BUDGET_S": "420", **env}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-dry-run",
                        "--results", str(tmp_path / "results"), *args],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    lines = (tmp_path / "gpu_check.jsonl").read_text().splitlines()
    return p, [json.loads(x) for x in lines]


def test_dry_run_writes_a_pass_row_per_check(tmp_path):
    t0 = time.time()
    p, rows = _run(tmp_path, "nccl_group")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert [r["check"] for r in rows] == ["nccl_group"]
    row = rows[0]
    assert row["result"] == "PASS", row
    assert row["numbers"]["backend"] == "gloo" and all(r["bitwise"] and r["flags_ok"] for r in row["numbers"]["runs"])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["mode"] == "cpu-dry-run" and [r["check"] for r in doc["rows"]] == ["nccl_group"]
    assert time.time() - t0 < 90


def test_check_that_does_not_fit_the_budget_is_a_skip_row(tmp_path):
    # a budget already spent at the start: every check is written as SKIP with its reason, none runs
    p, rows = _run(tmp_path, "nccl_group", "depth", GPU_CHECK_BUDGET_S="1")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert [(r["check"], r["result"]) for r in rows] == [("nccl_group", "SKIP"), ("depth", "SKIP")]
    assert "budget" in rows[0]["why"]
