"""Preflight: refuse to start, with the numbers and what to change, when a tier is short.

What is available is measured on the machine that runs the check unless given:
host RAM = ``MemAvailable`` of ``/proc/meminfo`` (bytes the kernel can hand out without
swapping; psutil is not a dependency), disk = ``shutil.disk_usage(path).free``, device =
free bytes of ``torch.cuda.mem_get_info()`` when CUDA is available. A GPU plan checked on a
machine without CUDA skips the device check (nothing to measure) unless ``device_bytes`` is
given. Units: bytes in, GiB (2**30 B) in messages.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .config import GIB
from .estimate import TERM_LABELS, Plan, gib, replan, shortfalls


class PreflightError(ValueError):
    """The planned run does not fit this machine. ``shortfalls`` lists one line per short tier."""

    def __init__(self, message: str, shortfalls: list[str]) -> None:
        super().__init__(message)
        self.shortfalls = shortfalls


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or None where ``/proc/meminfo`` is unreadable (not Linux)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file reports kB (KiB)
    except OSError:
        return None
    return None


def device_free_bytes() -> int | None:
    """Free accelerator memory (``torch.cuda.mem_get_info``) or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:  # pragma: no cover - a broken driver means "cannot measure"
        return None
    return None


def _host_advice(p: Plan, have: int) -> list[str]:
    s = p.settings
    limit = max(1, int(have * 0.9 / GIB))
    out = []
    if s["offload_optimizer"] == "cpu":
        q = replan(p, offload_optimizer="nvme")
        if q.host_bytes <= have:
            out.append(f"offload_optimizer=nvme: AdamW moments ({gib(8 * p.counts.total)} GiB) go to NVMe; host then "
                       f"needs {gib(q.host_bytes)} GiB, disk {gib(q.disk_bytes)} GiB; step bound {q.step_time_s:,.1f} s "
                       f"({TERM_LABELS[q.dominating]})")
    if "nvme" not in (s["offload_params"], s["offload_optimizer"], s["offload_grads"]) or out == []:
        q = replan(p, offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
        if q.host_bytes <= have:
            out.append(f"use strategy=megatrain_nvme with host_memory_limit={limit}GiB: masters, shadow, gradients and "
                       f"moments ({gib(q.nvme_bytes)} GiB) go to NVMe; host then needs {gib(q.host_bytes)} GiB "
                       f"(a window of {s['lookahead'] + 2} blocks), disk {gib(q.disk_bytes)} GiB, and the step is "
                       f"bounded by {TERM_LABELS[q.dominating]} at {q.step_time_s:,.1f} s")
        else:
            out.append(f"even with every state on NVMe (strategy=megatrain_nvme) the host needs {gib(q.host_bytes)} GiB "
                       f"(window {s['lookahead'] + 2} blocks + overhead): use a machine with more RAM")
    out.append(f"or a machine with >= {gib(p.host_bytes)} GiB of free RAM")
    return ["change: " + a for a in out]


def _device_advice(p: Plan) -> list[str]:
    big = sorted(p.device.items(), key=lambda kv: -kv[1])[:3]
    info = "needed for: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in big)
    return [info] + ["change: " + a for a in _device_changes(p, p.device.get("saved block inputs", 0))]


def _device_changes(p: Plan, act: int) -> list[str]:
    s = p.settings
    out = []
    if p.max_device_batch_size:
        out.append(f"reduce batch_size/seq_len (batch_size <= {p.max_device_batch_size} fits at seq_len={s['seq_len']})")
    else:
        out.append("reduce batch_size/seq_len (even batch_size=1 does not fit at this seq_len)")
    if act and not s["offload_activations"]:
        out.append(f"enable offload_activations (moves {gib(act)} GiB of saved block inputs to host RAM)")
    if act and s["recompute_every"] == 1:
        out.append(f"recompute_every=4 (saved block inputs {gib(act)} -> {gib(replan(p, recompute_every=4).device['saved block inputs'])} GiB, "
                   "+3/4 of a forward recomputed)")
    if s["lookahead"] > 1:
        out.append("lookahead=1 (one block prefetched instead of {})".format(s["lookahead"]))
    if s["precision"] == "32-true":
        out.append("precision=bf16-mixed (halves the streamed block buffers)")
    return out


def _disk_advice(p: Plan, path: Any) -> list[str]:
    k = p.settings["keep_checkpoints"]
    return [f"needed for: NVMe store {gib(p.disk.get('NVMe store', 0))} GiB + {k} checkpoint(s) of {gib(p.checkpoint_bytes)} GiB",
            f"change: free space at {path}, point the store/checkpoint directory at a larger volume, or keep fewer checkpoints"]


def preflight(p: Plan, *, host_ram_bytes: int | None = None, disk_free_bytes: int | None = None,
              device_bytes: int | None = None, path: str | Path = ".") -> dict[str, tuple[int, int | None]]:
    """Check a :class:`Plan` against this machine (or the given numbers).

    Args:
        p: the plan (its ``host``/``device``/``disk`` needs are compared).
        host_ram_bytes: available host RAM; default ``MemAvailable``.
        disk_free_bytes: free disk; default ``shutil.disk_usage(path).free``.
        device_bytes: free accelerator memory; default ``torch.cuda.mem_get_info()[0]`` (CUDA only).
        path: where the NVMe store and checkpoints go (for the disk measurement).

    Returns:
        ``{"host"|"device"|"disk": (need_bytes, have_bytes or None)}`` when everything fits.

    Raises:
        PreflightError: one or more tiers are short; the message gives need and have in GiB
            for each and what to change.
    """
    host = host_ram_bytes if host_ram_bytes is not None else mem_available_bytes()
    disk = disk_free_bytes if disk_free_bytes is not None else shutil.disk_usage(path).free
    dev = device_bytes if device_bytes is not None else (device_free_bytes() if p.hardware.is_gpu else None)
    lines = shortfalls(p, host, dev, disk, where="measured here" if host_ram_bytes is None else "given")
    if lines:
        s = p.settings
        msg = [f"megatrain preflight refused {p.model} (planned for {p.hardware.name}; precision={s['precision']}, "
               f"batch_size={s['batch_size']}, seq_len={s['seq_len']}, offload params/optimizer/grads="
               f"{s['offload_params']}/{s['offload_optimizer']}/{s['offload_grads']}):"]
        for line in lines:
            msg.append(f"  - {line}")
            if line.startswith("host"):
                top = sorted(p.host.items(), key=lambda kv: -kv[1])[:4]
                msg.append("      needed for: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in top))
                advice = _host_advice(p, host)  # type: ignore[arg-type]
            elif line.startswith("device"):
                advice = _device_advice(p)
            else:
                advice = _disk_advice(p, path)
            msg.extend(f"      {a}" for a in advice)
        raise PreflightError("\n".join(msg), lines)
    return {"host": (p.host_bytes, host), "device": (p.device_bytes, dev), "disk": (p.disk_bytes, disk)}
