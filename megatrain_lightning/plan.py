"""Planner and preflight for the megatrain strategy (docs/architecture.md, "Planner and preflight").

From a model config alone (the real model built on the meta device, no memory) and a
hardware preset: the bytes in each memory tier (host RAM, device, NVMe, disk), the bytes
moved per optimizer step (H2D, D2H, NVMe), the step time by phase and its fastest estimate
(every term overlapping) with the term it rests on, the checkpoint size and write time, the batch size at which compute
dominates, the activation memory per token and the longest sequence that fits.
``preflight`` refuses a run that does not fit, with the numbers and what to change.
Formulas, units and sources: :mod:`megatrain_lightning.planning.terms` and
:mod:`megatrain_lightning.planning.activations`.

Command line (Hydra compose API over ``conf/``; primary config ``conf/plan.yaml``)::

    python -m megatrain_lightning.plan model=llama100b hardware=h200 batch_size=4 seq_len=4096
    python -m megatrain_lightning.plan model=llama70b hardware=all          # one row per preset
    python -m megatrain_lightning.plan model=llama8b hardware.h2d_gbps=25   # any field overridable
    python -m megatrain_lightning.plan model=/path/to/hf_model_dir          # or .../config.json (local only)
    python -m megatrain_lightning.plan model=llama8b seq_len=32768 loss_chunk_size=1024 offload_activations=true
    python -m megatrain_lightning.plan max_seq_len=true model=llama8b,llama70b hardware=h100,h200
    python -m megatrain_lightning.plan model=smollm2_135m hardware=this_machine preflight=true
    python -m megatrain_lightning.plan model=llama70b hardware=h200 trainer.devices=8 trainer.num_nodes=2
    python -m megatrain_lightning.plan model=smollm2_135m hardware=h200 block_group=10  # 10 layers per transfer
    python -m megatrain_lightning.plan model=llama100b hardware=h200 optim=adafactor     # conf/optim/<name>.yaml

``preflight=true`` also checks the plan against the machine running the command (exit 2 when
refused); ``json=true`` prints the plan as JSON (its ``tip:``/``change:`` lines as ``"advice"``);
``max_seq_len=true`` prints only the longest sequence at batch 1 for each model and hardware
(comma-separated lists), without and with the long-sequence options (a Markdown table). ``model=`` takes a
``conf/model`` preset name or the path of a Hugging Face model directory / ``config.json``. Measure a CPU
preset's rates with ``python -m megatrain_lightning.planning.measure``.

``trainer.devices`` (processes per node; ``batch_size`` is per process) and ``trainer.num_nodes`` plan
data parallel (:mod:`megatrain_lightning.planning.parallel`): host RAM and NVMe per node with the
training state once per node in ``/dev/shm``, the gradient traffic inside and between nodes, and the
resource that bounds the step when the node's GPUs share one host; tokens/s per node and cluster.

``optim=<name>`` (``conf/optim/``: adamw (default), adam, sgd, adafactor, lion, muon, adamw8bit; the recipes' names)
counts that optimizer's state in host RAM (:mod:`megatrain_lightning.planning.optimizers`); ``optim.<key>=`` sets a
hyper-parameter that changes it (``optim.momentum=0`` for SGD without a buffer), ``optim._target_=<class>`` measures
another class on CPU tensors.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from .planning import (CONF_DIR, GIB, PRECISIONS, Hardware, ParamCounts, Plan, PreflightError, compose,
                       count_module, count_params, format_comparison, format_plan, load_hardware, load_model,
                       mem_available_bytes, plan, preflight, presets, replan)
from .planning.config import is_model_path, load_hf_config, mark_overridden_sources
from .planning.estimate import max_seq_len
from .planning.report import advice, format_longest_table, longest_rows

__all__ = [
    "CONF_DIR", "GIB", "PRECISIONS", "Hardware", "ParamCounts", "Plan", "PreflightError", "compose",
    "count_module", "count_params", "format_comparison", "format_plan", "load_hardware", "load_model",
    "main", "max_seq_len", "mem_available_bytes", "plan", "plan_from_config", "preflight", "presets", "replan",
]

_SETTINGS = ("batch_size", "seq_len", "precision", "offload_params", "offload_optimizer", "offload_grads",
             "offload_activations", "lookahead", "block_group", "recompute_every", "grad_dtype", "keep_checkpoints",
             "pinned_round", "optimizer_in_backward", "cpu_zero_copy", "loss_chunk_size", "mlp_chunk_size", "recompute",
             "activation_memory_limit", "host_memory_limit", "reference", "optim")


def plan_from_config(cfg: Any) -> Plan:
    """Build a :class:`Plan` from a composed ``conf/plan.yaml`` (``model``, ``hardware``, settings, and
    ``trainer.devices`` / ``trainer.num_nodes`` for data parallel).

    Raises:
        ValueError: see :func:`~megatrain_lightning.planning.estimate.plan` (a bad ``trainer.devices`` or
            ``trainer.num_nodes`` is named); a key that is no setting (``+batchsize=4``), with the closest one.
    """
    _refuse_unknown(set(cfg.keys()))
    trainer = cfg.get("trainer") or {}
    unknown = sorted(set(trainer.keys()) - {"devices", "num_nodes"})
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join('trainer.' + k for k in unknown)}; the planner reads "
                         "trainer.devices and trainer.num_nodes.")
    dp = {k: trainer[k] for k in ("devices", "num_nodes") if k in trainer}
    return plan(cfg.model, cfg.hardware, **{k: cfg[k] for k in _SETTINGS if k in cfg}, **dp)


def _refuse_unknown(keys: set[str]) -> None:
    """Raises ValueError naming each top-level key of ``keys`` that is no setting, with the closest one."""
    unknown = sorted(keys - {*_SETTINGS, "model", "hardware", "trainer"})
    if unknown:
        import difflib

        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, _SETTINGS, 1)) else k
                 for k in unknown]
        raise ValueError(f"unknown setting(s) {', '.join(hints)}; the planner's settings: {', '.join(_SETTINGS)}, "
                         "model, hardware, trainer.devices, trainer.num_nodes "
                         "(python -m megatrain_lightning.plan --help).")


def _json(p: Plan) -> dict[str, Any]:
    """``json=true``'s output of one plan: :meth:`Plan.to_dict` with ``"advice"``
    (:func:`.planning.report.advice`)."""
    return {**p.to_dict(), "advice": advice(p)}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 refused by ``preflight=true`` or a bad setting: one
    ``error:`` line on stderr)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .recipes_lib.console import tidy_console

    tidy_console()  # the notices importing a model class's module logs (torchao's kernels), as in the recipes
    flags = [a for a in args if a.startswith("-")]
    if flags:
        print(f"error: {flags[0]}: the planner takes key=value overrides only (Hydra's own flags such as --cfg are "
              "not supported); json=true prints every setting it used, --help lists them.", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (ValueError, TypeError, OSError, HydraException, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_override(arg: str, key: str) -> None:
    """Refuse before composing a recipe key under ``strategy.`` (the planner's settings are top-level) and an added
    model field outside ``model.config``, which the planner would otherwise ignore.

    Raises:
        ValueError: naming the key and the spelling the planner reads; a top-level key that is no setting, with the
            closest one (not Hydra's advice to add ``+``).
    """
    if "." not in key:
        _refuse_unknown({key})
    if key.startswith("strategy."):
        raise ValueError(f"{key}: the planner's settings are top-level: {key.split('.', 1)[1]}={arg.partition('=')[2]} "
                         "(strategy.* is the recipe's spelling).")
    if arg.startswith("+") and key.startswith("model.") and not key.startswith("model.config."):
        raise ValueError(f"{key}: the planner reads the model's shape from model.config.<field> "
                         "(e.g. model.config.num_hidden_layers=2) or a local Hugging Face folder (model=<dir>).")


def _run(args: list[str]) -> int:
    flags = {"preflight": False, "json": False, "max_seq_len": False}
    rest: list[str] = []
    models: list[str | None] = [None]
    hardware: list[str] | None = None
    for a in args:
        k, _, val = a.partition("=")
        key = k.lstrip("+")
        if key in flags:
            flags[key] = val.lower() in ("1", "true", "yes")
        elif key == "model":
            models = [m.strip() for m in val.split(",")] if "," in val and not is_model_path(val) else [val]
        elif key == "hardware":
            hardware = presets("hardware") if val == "all" else [h.strip() for h in val.split(",")]
        else:
            _check_override(a, key)
            rest.append(a)

    def one(model: str | None, hw: str | None) -> Plan:
        over = list(rest) + ([f"hardware={hw}"] if hw else [])
        path = model is not None and is_model_path(model)
        if model is not None and not path:
            over.append(f"model={model}")
        cfg = compose(over)
        if path:  # a model directory or config.json replaces the preset with that HF config
            from omegaconf import OmegaConf, open_dict

            load_hf_config(model)  # a clear error now for a wrong path
            with open_dict(cfg):
                cfg.model = OmegaConf.create({"name": model, "config": model})
        mark_overridden_sources(cfg, over)  # the plan's assumptions name a figure set on the command line as such
        return plan_from_config(cfg)

    if flags["max_seq_len"]:
        plans = [one(m, h) for m in models for h in (hardware or [None])]
        print(f"longest seq_len at batch_size=1 ({plans[0].settings['precision']}; device and host memory; "
              f"chunk sizes in tokens)\n")
        print(format_longest_table(longest_rows(plans)))
        return 0
    if hardware is not None and len(hardware) > 1 or len(models) > 1:
        for m in models:
            plans = [one(m, h) for h in (hardware or [None])]
            print(json.dumps([_json(p) for p in plans], indent=1, default=str) if flags["json"]
                  else format_comparison(plans))
        return 0
    p = one(models[0], hardware[0] if hardware else None)
    print(json.dumps(_json(p), indent=1, default=str) if flags["json"] else format_plan(p))
    if flags["preflight"]:
        import warnings

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                have = preflight(p, keys=None)
        except PreflightError as e:
            print(f"\n{e}")
            return 2
        for w in caught:
            print(f"warning: {w.message}")
        print("\npreflight on this machine: ok (" + ", ".join(
            f"{k} need {n / GIB:,.1f} GiB have {'-' if h is None else f'{h / GIB:,.1f}'}" for k, (n, h) in have.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
