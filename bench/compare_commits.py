"""Step time of this checkout against another commit, side by side in one run (refactor check).

What: this checkout's ``bench/overhead.py`` (median megatrain step / median plain-PyTorch step with
activation checkpointing, in one process) run alternately with this checkout's package and with
REF's (a git worktree of REF first on ``PYTHONPATH``), ``--rounds`` times each, so both see the same
machine state and the same benchmark code. Each run measures its own plain-PyTorch baseline, so
machine-speed drift cancels in the ratio.

Target: the new code within noise of the old: the median megatrain step time of the new package over
the old one's within the larger relative spread (max - min over median) of either package's rounds,
and at most 5% slower. (The ratio to plain PyTorch is printed too; on a shared 2-core machine its
baseline varies by 10-20% from run to run, so the step medians of the same benchmark code are the
steadier comparison.)

Run:
    python bench/compare_commits.py 717e6fa                     # the commit before the engine split
    python bench/compare_commits.py REF --rounds 3 -- --layers 8 --seq 256 --steps 3 --warmup 1
    python bench/compare_commits.py c95ac1e --out bench/results/compare_commits_copy.json -- --configs baseline,copy
                                          # the second row compared (here cpu_zero_copy=False)
Writes bench/results/compare_commits.json (REF, per-round ratios and step medians, verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_overhead(tree: Path, extra: list[str], out: Path) -> dict:
    """One run of this checkout's ``bench/overhead.py`` with ``tree``'s package first on the path;
    returns its JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(ROOT / "bench" / "overhead.py"), "--out", str(out), *extra]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref", help="the other commit (e.g. the one before a refactor)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare_commits.json"))
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.overhead_args = extra  # everything after -- goes to bench/overhead.py
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.ref], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            rows: dict[str, list[dict]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for name, tree in (("old", old), ("new", ROOT)):  # alternate: both see the same drift
                    res = run_overhead(tree, args.overhead_args, Path(tmp) / f"{name}{r}.json")
                    rows[name].append(res)
                    steps = ", ".join(f"{row['name']}: {row['median_s']:.3f} s" for row in res["rows"])
                    print(f"round {r} {name}: ratio {res['rows'][1]['ratio']:.3f} ({steps}; reliable: {res['reliable']})",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    ratio = {k: [r["rows"][1]["ratio"] for r in v] for k, v in rows.items()}  # the compared row / the baseline
    med = {k: statistics.median(v) for k, v in ratio.items()}
    step_runs = {k: [r["rows"][1]["median_s"] for r in v] for k, v in rows.items()}
    step = {k: statistics.median(v) for k, v in step_runs.items()}
    noise = max((max(v) - min(v)) / statistics.median(v) for v in step_runs.values())
    slower = step["new"] / step["old"] - 1
    ok = abs(slower) <= max(noise, 0.01) and slower <= 0.05
    print("\n| code | megatrain step medians (s) | median | ratios to plain + checkpointing | median |\n|---|---|---|---|---|")
    for k in ("old", "new"):
        print(f"| {k} ({args.ref if k == 'old' else 'HEAD'}) | {', '.join(f'{x:.3f}' for x in step_runs[k])} | "
              f"{step[k]:.3f} | {', '.join(f'{x:.3f}' for x in ratio[k])} | {med[k]:.3f} |")
    print(f"\nnew / old step = {1 + slower:.3f} (run-to-run spread {noise:.1%}): {'PASS' if ok else 'FAIL'} (within noise)")
    Path(args.out).write_text(json.dumps({"ref": args.ref, "overhead_args": args.overhead_args, "rows": rows,
                                          "median_ratio": med, "median_step_s": step, "step_spread": noise, "pass": ok}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
