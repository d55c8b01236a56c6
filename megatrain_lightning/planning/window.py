"""The NVMe tier's ``host_memory_limit`` in a plan: the engine's minimum host window for the planned model, the
limit the run will use, and the engine's refusal of a limit below that minimum, before any weight exists.

The minimum is the engine's own number: the real model is built on the meta device (no memory), split into the
engine's blocks (:func:`~megatrain_lightning.blocks.discover_blocks`, :func:`~megatrain_lightning.engine.block_groups.form_groups`),
and sized by :func:`~megatrain_lightning.engine.window.window_sizes`, which the engine itself calls before its
:func:`~megatrain_lightning.store.nvme.preflight_nvme` check; the refusal is that check's message
(:func:`~megatrain_lightning.store.nvme.window_refusal`). Units: bytes.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from ..store.budget import above_ram, physical_ram_bytes
from .config import GIB
from .counts import _hf_config


def parse_limit(value: Any) -> int | None:
    """``host_memory_limit`` as bytes (``None``/``"null"``: the strategy's default, half of physical RAM), parsed as
    the strategy parses it (``store/budget.py`` ``parse_bytes``: ``"3GiB"``, ``"8GB"`` or an integer).

    Raises:
        ValueError: naming ``host_memory_limit`` and what it takes."""
    from ..config import _size

    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "")):
        return None
    return _size("host_memory_limit", value)


def nvme_kinds(s: dict[str, Any]) -> frozenset:
    """The regions the strategy puts on NVMe for these settings (``MegaTrainConfig._nvme_settings``)."""
    from ..store.regions import Region

    kinds = {Region.master} if s.get("offload_params") == "nvme" else set()
    if s.get("offload_optimizer") == "nvme":
        kinds |= {Region.exp_avg, Region.exp_avg_sq, Region.grad_accum}
    return frozenset(kinds)


def _config(source: Any) -> Any:
    """The model config of a plan's ``source``, or the built ``nn.Module`` it is or holds."""
    from .estimate import _model_name_and_config

    return source if isinstance(source, torch.nn.Module) else _model_name_and_config(source)[1]


def _meta_model(source: Any) -> Any:
    """The model of a plan's ``source`` on the meta device (a built ``nn.Module`` as is)."""
    cfg = _config(source)
    if isinstance(cfg, torch.nn.Module):
        return cfg
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_hf_config(cfg))


def _key(source: Any) -> str | None:
    cfg = _config(source)
    if isinstance(cfg, torch.nn.Module):
        return None
    return cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else json.dumps(cfg, sort_keys=True,
                                                                                                default=str)


@functools.lru_cache(maxsize=64)
def _min_window_cached(key: str, kinds: frozenset, device: str, lookahead: int, group: int, ranks: int) -> int:
    return _min_window(_meta_model(json.loads(key)), kinds, device, lookahead, group, ranks)


def _min_window(model: Any, kinds: frozenset, device: str, lookahead: int, group: int, ranks: int) -> int:
    from ..blocks import discover_blocks
    from ..engine.block_groups import form_groups
    from ..engine.window import window_sizes
    from ..store.nvme import NVMeConfig

    blocks = discover_blocks(model)
    groups = form_groups(blocks, group)
    ahead = (lookahead + 1) * max(map(len, groups)) - 1  # as engine/streaming.py passes it
    nvme = NVMeConfig(path="", kinds=kinds, host_memory_limit=0, share=(0, ranks) if ranks > 1 else None)
    return window_sizes(blocks, nvme, device, ahead)[0]


def min_window(source: Any, s: dict[str, Any], is_gpu: bool) -> int | None:
    """Bytes the engine requires of ``host_memory_limit`` per process: its ``window_sizes(...)[0]`` on a meta-device
    copy (``None`` when nothing is on NVMe). ``source``: :attr:`~.estimate.Plan.source`; ``is_gpu``: CUDA (D2H
    staging in the budget) or CPU (the compute buffers in the budget)."""
    kinds = nvme_kinds(s)
    if not kinds:
        return None
    args = (kinds, "cuda" if is_gpu else "cpu", int(s["lookahead"]), int(s.get("block_group", 1)),
            int(s.get("devices", 1)))
    key = None
    try:
        key = _key(source)
    except (TypeError, ValueError):
        pass
    if key is not None and key.startswith("{"):
        return _min_window_cached(key, *args)
    return _min_window(_meta_model(source), *args)


def limit_check(source: Any, s: dict[str, Any], is_gpu: bool, limit: int | None, ram: int,
                where: str) -> tuple[int | None, int | None, str | None, str | None]:
    """The limit the run will use and what the engine would say of it.

    Args:
        source, s, is_gpu: as :func:`min_window`.
        limit: ``host_memory_limit`` in bytes (the node's), or ``None``: the strategy's default, half of ``ram``.
        ram: physical RAM of the machine the check is for (bytes; the preset's ``host_ram_gib`` in a plan, this
            machine's in preflight).
        where: how to name that machine in the warning (``"the preset h200"``, ``"this machine"``).

    Returns:
        ``(limit used, minimum window per process, refusal or None, warning or None)``; all ``None`` when nothing
        is on NVMe. The refusal is the engine's message; the warning says a limit above physical RAM is not a
        limit."""
    from ..store.nvme import window_refusal

    mw = min_window(source, s, is_gpu)
    if mw is None:
        return None, None, None, None
    used = limit if limit is not None else ram // 2
    ranks = int(s.get("devices", 1))
    refusal = window_refusal(used // ranks, mw, ranks)
    if refusal and limit is None:
        refusal = f"the default host_memory_limit (half of the {ram / GIB:,.1f} GiB of RAM of {where}): " + refusal
    return used, mw, refusal, above_ram(limit, ram, where) if limit is not None else None
