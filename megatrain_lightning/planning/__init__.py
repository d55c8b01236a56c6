"""Planner and preflight (docs/architecture.md, "Planner and preflight"); the public entry point
is :mod:`megatrain_lightning.plan`.

``counts``     parameter counts per block from the real model on the meta device
``config``     hardware presets, Hydra composition of conf/plan.yaml
``terms``      the formulas (units and sources): tiers, bytes moved, FLOPs, seconds per term
``estimate``   the Plan: runs the terms, compute-bound batch size, fits/why
``preflight``  refuse to start when a tier is short, with numbers and what to change
``report``     the CLI's tables
"""

from .config import CONF_DIR, GIB, Hardware, compose, load_hardware, load_model, presets
from .counts import ParamCounts, count_module, count_params
from .estimate import PRECISIONS, Plan, plan, replan
from .preflight import PreflightError, device_free_bytes, mem_available_bytes, preflight
from .report import format_comparison, format_plan

__all__ = [
    "CONF_DIR", "GIB", "PRECISIONS", "Hardware", "ParamCounts", "Plan", "PreflightError", "compose",
    "count_module", "count_params", "device_free_bytes", "format_comparison", "format_plan", "load_hardware",
    "load_model", "mem_available_bytes", "plan", "preflight", "presets", "replan",
]
