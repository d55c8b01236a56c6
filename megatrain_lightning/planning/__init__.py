"""Planner and preflight (docs/architecture.md, "Planner and preflight"); the public entry point
is :mod:`megatrain_lightning.plan`.

``counts``       parameter counts per block from the real model on the meta device (and which
                 travel in bf16: the wire rule of engine/wire.py)
``config``       hardware presets, conf/ lookup, Hydra composition of conf/plan.yaml, HF config paths,
                 chunk-size settings
``activations``  activation bytes per token by option (sources: HF's layer structure)
``optimizers``   each optimizer's state bytes per parameter tensor (the ``optim`` setting; sources in its docstring)
``terms``        the formulas (units and sources): tiers, bytes moved, FLOPs, seconds per term
``estimate``     the Plan: runs the terms, compute-bound batch size, fits/why/headroom, longest sequence
``advice``       what to change when a tier is short (NVMe tier, activation options), with numbers
``preflight``    refuse to start when a tier is short, with numbers and what to change
``report``       the CLI's tables
``measure``      measure a CPU preset's compute rates (python -m megatrain_lightning.planning.measure)
"""

from .config import CONF_DIR, GIB, Hardware, compose, load_hardware, load_model, presets
from .counts import ParamCounts, count_module, count_params
from .estimate import PRECISIONS, Plan, max_seq_len, plan, replan
from .preflight import PreflightError, device_free_bytes, mem_available_bytes, plan_for_run, preflight
from .report import format_comparison, format_plan

__all__ = [
    "CONF_DIR", "GIB", "PRECISIONS", "Hardware", "ParamCounts", "Plan", "PreflightError", "compose",
    "count_module", "count_params", "device_free_bytes", "format_comparison", "format_plan", "load_hardware",
    "load_model", "max_seq_len", "mem_available_bytes", "plan", "plan_for_run", "preflight", "presets", "replan",
]
