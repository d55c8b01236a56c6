"""Preflight: refuse to start, with the numbers and what to change, when a tier is short.

What is available is measured on the machine that runs the check unless given (:func:`preflight`); a GPU plan
checked without CUDA skips the device check unless ``device_bytes`` is given. Units: bytes in, GiB (2**30 B) in
messages.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

from ..store.budget import mem_available_bytes
from .advice import RECIPE_KEYS, device_advice, host_short_advice, key
from .config import GIB, as_plain_dict, strategy_default
from .estimate import Plan, gib, plan, shortfalls
from .window import limit_check, physical_ram_bytes


class PreflightError(ValueError):
    """The planned run does not fit this machine. ``shortfalls`` lists one line per short tier."""

    def __init__(self, message: str, shortfalls: list[str]) -> None:
        super().__init__(message)
        self.shortfalls = shortfalls


def device_free_bytes() -> int | None:
    """Free accelerator memory (``torch.cuda.mem_get_info``) or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:  # pragma: no cover - a broken driver means "cannot measure"
        return None
    return None


def preflight(p: Plan, *, host_ram_bytes: int | None = None, disk_free_bytes: int | None = None,
              device_bytes: int | None = None, path: str | Path = ".", checkpoint_path: str | Path | None = None,
              keys: Mapping[str, str] | None = RECIPE_KEYS) -> dict[str, tuple[int, int | None]]:
    """Check a :class:`Plan` against this machine (or the given numbers).

    Args:
        p: the plan (its ``host``/``device``/``disk`` needs are compared).
        host_ram_bytes: available host RAM; default ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can
            hand out without swapping).
        disk_free_bytes: free disk; default ``shutil.disk_usage(path).free``.
        device_bytes: free accelerator memory; default ``torch.cuda.mem_get_info()[0]`` (CUDA only).
        path: where the NVMe store and checkpoints go (for the disk measurement).
        checkpoint_path: where the checkpoints go when that is not ``path`` (an existing directory): on another
            volume the NVMe store is checked against ``path``'s free space and the checkpoints against this one's.
        keys: how the message names settings (:func:`.advice.key`): the recipe's Hydra keys (the default) or
            ``None`` for the planner's command line.

    Returns:
        ``{"host"|"device"|"disk": (need_bytes, have_bytes or None)}`` when everything fits.

    Raises:
        PreflightError: one or more tiers are short; the message gives need and have in GiB for each and what to
            change (:mod:`.advice`).
    """
    host = host_ram_bytes if host_ram_bytes is not None else mem_available_bytes()
    disk = disk_free_bytes if disk_free_bytes is not None else shutil.disk_usage(path).free
    dev = device_bytes if device_bytes is not None else (device_free_bytes() if p.hardware.is_gpu else None)
    split = disk_free_bytes is None and checkpoint_path is not None and \
        os.stat(checkpoint_path).st_dev != os.stat(path).st_dev
    lines = shortfalls(p, host, dev, None if split else disk, where="measured here" if host_ram_bytes is None else "given")
    if split:  # the store and the checkpoints on two volumes: each against its own
        store = p.disk.get("NVMe store", 0)
        for need, where in ((store, Path(path)), (p.disk_bytes - store, Path(checkpoint_path))):  # type: ignore[arg-type]
            have = shutil.disk_usage(where).free
            if need > have:
                lines.append(f"disk short: need {gib(need)} GiB, have {gib(have)} GiB (measured here) on the "
                             f"volume mounted at {_mount_point(where)}")
    # the NVMe tier's host_memory_limit, as the engine will check it on this machine
    ram = physical_ram_bytes() if host_ram_bytes is None else host_ram_bytes
    _, mw, refusal, warning = limit_check(p.source, p.settings, p.hardware.is_gpu, p.settings.get("host_memory_limit"),
                                         ram, "this machine" if host_ram_bytes is None else "the given host")
    if warning:
        warnings.warn(f"megatrain preflight: {warning}", UserWarning, stacklevel=2)
    if refusal:
        lines.append(refusal)
    if lines:
        s = p.settings
        msg = [f"megatrain preflight refused {p.model} (planned for {p.hardware.name}; precision={s['precision']}, "
               f"batch_size={s['batch_size']}, seq_len={s['seq_len']}, offload params/optimizer/grads="
               f"{s['offload_params']}/{s['offload_optimizer']}/{s['offload_grads']}, "
               f"recompute={s.get('recompute', 'block')}):"]
        for line in lines:
            msg.append(f"  - {line}")
            if "host_memory_limit" in line:
                least = -(-int(mw or 0) * int(s.get("devices", 1)) // GIB)  # whole GiB, every process's window
                advice = [f"change: set {key('host_memory_limit', keys)}={least}GiB (the engine's minimum window, "
                          f"rounded up to whole GiB)"]
                if s["lookahead"] > 0 or s.get("block_group", 1) > 1:
                    advice.append(f"change: or set {key('lookahead', keys)}=0 {key('block_group', keys)}=1 "
                                  f"(fewer blocks in flight: a smaller minimum window)")
            elif line.startswith("host"):
                top = sorted(p.host.items(), key=lambda kv: -kv[1])[:4]
                msg.append("      needed for: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in top))
                advice = ["change: " + a for a in host_short_advice(p, host, keys)]
            elif line.startswith("device"):
                advice = device_advice(p, dev, host, keys)
            else:  # the disk: the volume the line names, else the one of ``path``
                volume = line.split("on the volume mounted at ")[1] if "on the volume mounted at " in line \
                    else f"{_mount_point(path)} (where {path} is)"
                advice = [f"needed for: NVMe store {gib(p.disk.get('NVMe store', 0))} GiB + {s['keep_checkpoints']} "
                          f"checkpoint(s) of {gib(p.checkpoint_bytes)} GiB",
                          f"change: free space on the volume mounted at {volume}, point "
                          "the store/checkpoint directory at a larger volume, or keep fewer checkpoints"]
            msg.extend(f"      {a}" for a in advice)
        raise PreflightError("\n".join(msg), lines)
    return {"host": (p.host_bytes, host), "device": (p.device_bytes, dev), "disk": (p.disk_bytes, disk)}


def _mount_point(path: str | Path) -> Path:
    """The mount point of the volume that holds ``path`` (an existing path; the run directory may be removed when
    the run is refused, its volume stays)."""
    p = Path(path).absolute()
    while not os.path.ismount(p):
        p = p.parent
    return p


def plan_for_run(model: Any, hardware: Any, strategy: Mapping[str, Any], *, batch_size: int, seq_len: int,
                 precision: str, devices: int = 1, num_nodes: int = 1,
                 gradient_clip_val: float | None = None, optim: Any = None, keep_checkpoints: int = 2) -> Plan:
    """The plan of a recipe run from its composed config sections (``cfg.model``, ``cfg.hardware``,
    ``cfg.strategy``; DictConfigs or mappings), reading every strategy option the planner models
    (``offload_optimizer`` moves the gradient accumulators too); unset options take ``MegaTrainConfig``'s
    defaults. ``devices``/``num_nodes``: ``trainer.devices``/``trainer.num_nodes``. ``gradient_clip_val``
    (``None`` or 0: no clipping) and ``precision="16-mixed"`` (loss scaling) need every gradient of the step before
    any update, so the strategy runs the deferred AdamW schedule whatever ``optimizer_in_backward`` says
    (``MegaTrainStrategy._update_in_backward_now``), and so does the plan. ``optim``: the recipe's ``cfg.optim``
    (``None``: AdamW). ``keep_checkpoints``: full checkpoints on disk at once (:func:`.estimate.plan`'s). Pass the
    plan to :func:`preflight`."""
    st = as_plain_dict(strategy) if strategy is not None else {}

    def opt(name: str) -> Any:
        return st[name] if name in st else strategy_default(name)

    in_bwd = opt("optimizer_in_backward")
    if gradient_clip_val or str(precision) in ("16-mixed", "16"):
        in_bwd = False
    return plan(as_plain_dict(model), as_plain_dict(hardware), batch_size=int(batch_size), seq_len=int(seq_len),
                precision=str(precision), lookahead=int(opt("lookahead")), block_group=opt("block_group"),
                recompute_every=int(opt("recompute_every")), offload_activations=bool(opt("offload_activations")),
                offload_params=str(opt("offload_params")), offload_optimizer=str(opt("offload_optimizer")),
                offload_grads=str(opt("offload_optimizer")), loss_chunk_size=opt("loss_chunk_size"),
                mlp_chunk_size=opt("mlp_chunk_size"), devices=devices, num_nodes=num_nodes,
                recompute=str(opt("recompute")), activation_memory_limit=opt("activation_memory_limit"),
                optimizer_in_backward=in_bwd, host_memory_limit=opt("host_memory_limit"),
                optim=as_plain_dict(optim) if optim is not None else None, keep_checkpoints=int(keep_checkpoints))
