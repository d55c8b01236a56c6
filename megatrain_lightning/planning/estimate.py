"""The planner: :func:`plan` returns a :class:`Plan` (bytes per memory tier, bytes moved and
a lower bound on time per optimizer step, checkpoint size, compute-bound batch size, fit).

The formulas, their units and sources are in :mod:`.terms`; this module runs them for one
configuration, finds the batch sizes where compute dominates and where device memory runs
out, and states the shortfalls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .config import GIB, Hardware
from .counts import ParamCounts, count_params
from .terms import (CKPT_METADATA, GRAD_BYTES, PRECISION_ALIASES, PRECISIONS, TERM_LABELS,  # noqa: F401
                    TIERS, _estimate)


@dataclass
class Plan:
    """Result of :func:`plan`. Byte dicts are ordered breakdowns (label -> bytes).

    Attributes:
        host, device, nvme, disk: bytes per term of each tier (``device`` is host RAM too when
            ``hardware.is_gpu`` is false; it is then also listed in ``host``).
        capacity: bytes available per tier on the preset (``device`` None without a GPU).
        moved: bytes per optimizer step: ``h2d``, ``h2d_forward``, ``h2d_backward``, ``d2h``,
            ``nvme_read``, ``nvme_write``.
        flops: compute per step (FLOP); ``flops_parts`` its terms (8 x N_matmul x tokens,
            attention, minus the LM head's recompute that does not happen, K > 1 chains).
        times: seconds per term (``compute``, ``h2d``, ``d2h``, ``nvme_read``, ``nvme_write``,
            ``host_adamw``); ``step_time_s`` their max, named by ``dominating``;
            ``step_time_pessimistic_s`` / ``dominating_pessimistic`` the half-duplex variant.
        checkpoint_bytes, checkpoint_write_s: one directory checkpoint and its write time at
            ``nvme_drives x nvme_write_gbps``.
        compute_bound_batch_size: smallest batch size (sequences of ``seq_len``) at which
            compute time >= every other term (None: never, a term grows as fast as compute).
        max_device_batch_size: largest batch size whose device bytes fit (None: no GPU).
        fits, reasons: whether every tier fits, and one line per shortfall.
    """

    model: str
    hardware: Hardware
    counts: ParamCounts
    settings: dict[str, Any]
    host: dict[str, int]
    device: dict[str, int]
    nvme: dict[str, int]
    disk: dict[str, int]
    capacity: dict[str, int | None]
    moved: dict[str, int]
    flops: float
    flops_parts: dict[str, float]
    times: dict[str, float]
    step_time_s: float
    dominating: str
    step_time_pessimistic_s: float
    dominating_pessimistic: str
    checkpoint_bytes: int
    checkpoint_write_s: float
    compute_bound_batch_size: int | None = None
    max_device_batch_size: int | None = None
    fits: bool = True
    reasons: list[str] = field(default_factory=list)
    source: Any = field(default=None, repr=False)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def nvme_bytes(self) -> int:
        return sum(self.nvme.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk.values())

    @property
    def tokens(self) -> int:
        return self.settings["batch_size"] * self.settings["seq_len"]

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("model", "settings", "host", "device", "nvme", "disk", "capacity",
                                            "moved", "flops", "flops_parts", "times", "step_time_s", "dominating",
                                            "step_time_pessimistic_s", "dominating_pessimistic",
                                            "checkpoint_bytes", "checkpoint_write_s", "compute_bound_batch_size",
                                            "max_device_batch_size", "fits", "reasons")}
        d.update(hardware=self.hardware.to_dict(), counts=self.counts.to_dict(), host_bytes=self.host_bytes,
                 device_bytes=self.device_bytes, disk_bytes=self.disk_bytes)
        return d


def _model_name_and_config(model_cfg: Any) -> tuple[str, Any]:
    """Accept a ``conf/model`` mapping, an AutoConfig kwargs mapping, a PretrainedConfig or a module."""
    from .config import _plain

    if isinstance(model_cfg, Mapping) or type(model_cfg).__name__ == "DictConfig":
        d = _plain(model_cfg)
        if "config" in d:
            return str(d.get("name", d["config"].get("model_type"))), d["config"]
        return str(d.get("model_type", "model")), d
    return str(getattr(getattr(model_cfg, "config", model_cfg), "model_type", type(model_cfg).__name__)), model_cfg


def _crossover(c: ParamCounts, hw: Hardware, s: dict[str, Any], e1: dict[str, Any]) -> tuple[int | None, int | None]:
    """Batch size where compute >= every other term, and the largest batch the device holds.

    All terms are affine in the batch size at fixed ``seq_len``; two evaluations give them.
    """
    e2 = _estimate(c, hw, {**s, "batch_size": s["batch_size"] + 1})
    b0 = s["batch_size"]
    comp = e2["times"]["compute"] - e1["times"]["compute"]  # seconds per extra sequence
    need = 1.0
    for k, t1 in e1["times"].items():
        if k == "compute":
            continue
        slope = e2["times"][k] - t1
        fixed = t1 - slope * b0
        if fixed <= 0:
            continue
        if comp <= slope:
            need = math.inf
            break
        need = max(need, fixed / (comp - slope))
    bound = None if math.isinf(need) else max(1, math.ceil(need - 1e-9))
    max_dev = None
    if hw.is_gpu:
        d1, d2 = sum(e1["device"].values()), sum(e2["device"].values())
        slope, cap = d2 - d1, hw.hbm_gib * GIB
        fixed = d1 - slope * b0
        max_dev = max(0, int((cap - fixed) // slope)) if slope > 0 else None
    return bound, max_dev


def plan(model_cfg: Any, hw: Hardware | Mapping[str, Any], *, batch_size: int = 1, seq_len: int = 2048,
         precision: str = "bf16-mixed", offload_params: str = "cpu", offload_optimizer: str = "cpu",
         offload_grads: str = "cpu", offload_activations: bool = False, lookahead: int = 1,
         recompute_every: int = 1, grad_dtype: str | None = None, keep_checkpoints: int = 2,
         cpu_zero_copy: bool = True) -> Plan:
    """Plan one training configuration on one hardware preset (see the module docstring).

    Args:
        model_cfg: a ``conf/model/*.yaml`` mapping (``name``, ``config``...), AutoConfig kwargs
            with ``model_type``, a ``PretrainedConfig`` or a built model.
        hw: a :class:`Hardware` or a ``conf/hardware/*.yaml`` mapping.
        batch_size, seq_len: sequences per optimizer step and tokens per sequence.
        precision: ``32-true``, ``bf16-mixed``, ``16-mixed`` or ``bf16-true`` (Lightning's aliases
            ``32``, ``16``, ``bf16`` are accepted).
        offload_params, offload_optimizer, offload_grads: ``"cpu"`` (host RAM) or ``"nvme"``.
        offload_activations: saved block inputs in host RAM instead of device memory.
        lookahead: blocks prefetched ahead of the computing one (>= 0).
        recompute_every: K, keep every K-th block input and recompute the rest (>= 1).
        grad_dtype: ``fp32``/``bf16``/``fp16`` gradients on the D2H link (default fp32, bf16 for
            ``bf16-true``).
        keep_checkpoints: directory checkpoints on disk at the peak of a save.
        cpu_zero_copy: without an accelerator and with fp32 compute, blocks bind the fp32 masters
            (``MegaTrainStrategy(cpu_zero_copy=True)``, its default): no weight copies, no H2D.

    Raises:
        ValueError: an unknown precision, tier or grad dtype, or a non-positive size.
    """
    precision = PRECISION_ALIASES.get(precision, precision)  # type: ignore[call-overload]
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    for name, v in (("offload_params", offload_params), ("offload_optimizer", offload_optimizer),
                    ("offload_grads", offload_grads)):
        if v not in TIERS:
            raise ValueError(f"{name} must be one of {TIERS}, got {v!r}")
    if grad_dtype is not None and grad_dtype not in GRAD_BYTES:
        raise ValueError(f"grad_dtype must be one of {sorted(GRAD_BYTES)} or None, got {grad_dtype!r}")
    if batch_size < 1 or seq_len < 1 or recompute_every < 1 or lookahead < 0 or keep_checkpoints < 0:
        raise ValueError("batch_size, seq_len and recompute_every must be >= 1; lookahead, keep_checkpoints >= 0")
    hw = Hardware.from_mapping(hw)
    name, cfg = _model_name_and_config(model_cfg)
    counts = count_params(cfg)
    s = dict(batch_size=int(batch_size), seq_len=int(seq_len), precision=precision, offload_params=offload_params,
             offload_optimizer=offload_optimizer, offload_grads=offload_grads,
             offload_activations=bool(offload_activations), lookahead=int(lookahead),
             recompute_every=int(recompute_every), keep_checkpoints=int(keep_checkpoints),
             cpu_zero_copy=bool(cpu_zero_copy),
             grad_bytes=GRAD_BYTES[grad_dtype] if grad_dtype else PRECISIONS[precision][2])
    e = _estimate(counts, hw, s)
    dom = max(e["times"], key=e["times"].get)
    dom_p = max(e["pess"], key=e["pess"].get)
    bound, max_dev = _crossover(counts, hw, s, e)
    cap = {"host": int(hw.host_ram_gib * GIB), "device": int(hw.hbm_gib * GIB) if hw.is_gpu else None,
           "disk": int(hw.nvme_drives * hw.nvme_capacity_gib * GIB)}
    p = Plan(model=name, hardware=hw, counts=counts, settings=s, host=e["host"], device=e["device"],
             nvme=e["nvme"], disk=e["disk"], capacity=cap, moved=e["moved"], flops=e["flops"],
             flops_parts=e["flops_parts"], times=e["times"], step_time_s=e["times"][dom], dominating=dom,
             step_time_pessimistic_s=e["pess"][dom_p], dominating_pessimistic=dom_p, checkpoint_bytes=e["ckpt"],
             checkpoint_write_s=e["ckpt"] / (hw.nvme_drives * hw.nvme_write_gbps * 1e9),
             compute_bound_batch_size=bound, max_device_batch_size=max_dev, source=model_cfg)
    p.reasons = shortfalls(p, cap["host"], cap["device"], cap["disk"], where="preset")
    p.fits = not p.reasons
    return p


def replan(p: Plan, **changes: Any) -> Plan:
    """The same model and hardware with some settings changed (used for advice)."""
    s = dict(p.settings)
    changes.setdefault("grad_dtype", {4: "fp32", 2: "bf16"}[s.pop("grad_bytes")])
    s.update(changes)
    return plan(p.source, p.hardware, **s)


def gib(n: float | None) -> str:
    """Bytes as GiB text: 1 decimal, 2 below 10 GiB ("-" for None)."""
    if n is None:
        return "-"
    return f"{n / GIB:,.1f}" if n >= 10 * GIB else f"{n / GIB:.2f}"


def shortfalls(p: Plan, host: int | None, device: int | None, disk: int | None, where: str) -> list[str]:
    """One line per tier whose need exceeds what is available (``None`` = not checked)."""
    out = []
    what = "" if where == "preset" else f" ({where})"
    if host is not None and p.host_bytes > host:
        out.append(f"host RAM short: need {gib(p.host_bytes)} GiB, have {gib(host)} GiB{what}")
    if device is not None and p.hardware.is_gpu and p.device_bytes > device:
        out.append(f"device memory short: need {gib(p.device_bytes)} GiB, have {gib(device)} GiB{what}")
    if disk is not None and p.disk_bytes > disk:
        out.append(f"disk short: need {gib(p.disk_bytes)} GiB, have {gib(disk)} GiB{what}")
    return out
