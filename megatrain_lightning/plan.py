"""Planner and preflight for the megatrain strategy (docs/architecture.md, "Planner and preflight").

From a model config alone (the real model built on the meta device, no memory) and a
hardware preset: the bytes in each memory tier (host RAM, device, NVMe, disk), the bytes
moved per optimizer step (H2D, D2H, NVMe), a lower bound on the step time with its
dominating term, the checkpoint size and write time, and the batch size at which compute
dominates. ``preflight`` refuses a run that does not fit, with the numbers and what to change.
Formulas, units and sources: :mod:`megatrain_lightning.planning.estimate`.

Command line (Hydra compose API over the repository's ``conf/``; primary config ``conf/plan.yaml``)::

    python -m megatrain_lightning.plan model=llama100b hardware=h200 batch_size=4 seq_len=4096
    python -m megatrain_lightning.plan model=llama70b hardware=all          # one row per preset
    python -m megatrain_lightning.plan model=llama8b hardware.h2d_gbps=25   # any field overridable
    python -m megatrain_lightning.plan model=smollm2_135m hardware=this_machine preflight=true

``preflight=true`` also checks the plan against the machine running the command (exit 2 when
refused); ``json=true`` prints the plan as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from .planning import (CONF_DIR, GIB, PRECISIONS, Hardware, ParamCounts, Plan, PreflightError, compose,
                       count_module, count_params, format_comparison, format_plan, load_hardware, load_model,
                       mem_available_bytes, plan, preflight, presets, replan)

__all__ = [
    "CONF_DIR", "GIB", "PRECISIONS", "Hardware", "ParamCounts", "Plan", "PreflightError", "compose",
    "count_module", "count_params", "format_comparison", "format_plan", "load_hardware", "load_model",
    "main", "mem_available_bytes", "plan", "plan_from_config", "preflight", "presets", "replan",
]

_SETTINGS = ("batch_size", "seq_len", "precision", "offload_params", "offload_optimizer", "offload_grads",
             "offload_activations", "lookahead", "recompute_every", "grad_dtype", "keep_checkpoints", "cpu_zero_copy")


def plan_from_config(cfg: Any) -> Plan:
    """Build a :class:`Plan` from a composed ``conf/plan.yaml`` (``model``, ``hardware`` + settings)."""
    return plan(cfg.model, cfg.hardware, **{k: cfg[k] for k in _SETTINGS if k in cfg})


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 refused by ``preflight=true``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    flags = {"preflight": False, "json": False}
    rest = []
    for a in args:
        key, _, val = a.partition("=")
        if key in flags:
            flags[key] = val.lower() in ("1", "true", "yes")
        else:
            rest.append(a)
    hw_all = [a for a in rest if a in ("hardware=all", "+hardware=all")]
    if hw_all:
        rest = [a for a in rest if a not in hw_all]
        plans = [plan_from_config(compose([*rest, f"hardware={h}"])) for h in presets("hardware")]
        print(json.dumps([p.to_dict() for p in plans], indent=1, default=str) if flags["json"]
              else format_comparison(plans))
        return 0
    p = plan_from_config(compose(rest))
    print(json.dumps(p.to_dict(), indent=1, default=str) if flags["json"] else format_plan(p))
    if flags["preflight"]:
        try:
            have = preflight(p)
        except PreflightError as e:
            print(f"\n{e}")
            return 2
        print("\npreflight on this machine: ok (" + ", ".join(
            f"{k} need {n / GIB:,.1f} GiB have {'-' if h is None else f'{h / GIB:,.1f}'}" for k, (n, h) in have.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
