"""The planner: :func:`plan` runs the formulas of :mod:`.terms` (units and sources there) for one configuration
and returns a :class:`Plan`, with the batch sizes where compute dominates and where device memory runs out, and
the shortfalls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import check_block_group, check_recompute
from .config import (GIB, SUGGESTED_CHUNK, Hardware, as_plain_dict, is_model_path, load_hf_config, loss_chunk_tokens,
                     resolve_chunk)
from .counts import ParamCounts, count_params
from .optimizers import resolve
from .parallel import positive_count
from .phases import chains, phase_model
from .terms import (CKPT_METADATA, GRAD_BYTES, PRECISION_ALIASES, PRECISIONS, REFERENCES, TIERS,  # noqa: F401
                    _estimate, transfer_bytes, update_in_backward)
from .window import limit_check, parse_limit

TIGHT_HEADROOM = 0.05  # a tier that fits with less free than this is flagged "tight"


@dataclass
class Plan:
    """Result of :func:`plan`. Byte dicts are ordered breakdowns (label -> bytes).

    Attributes:
        host, device, nvme, disk: bytes per term of each tier (without a GPU ``device`` is host RAM, also
            listed in ``host``).
        capacity: bytes available per tier on the preset (``device`` None without a GPU).
        moved: bytes per optimizer step: ``h2d``, ``h2d_forward``, ``h2d_backward``, ``d2h``,
            ``nvme_read``, ``nvme_write``...
        flops: compute per step (FLOP); ``flops_parts`` its terms (:func:`.terms.recompute_flops` for the
            recompute's).
        times: seconds per term (``compute``, ``h2d``, ``d2h``, ``nvme_read``, ``nvme_write``,
            ``host_adamw``, ``grad_add``; data parallel adds ``host_memory``, ``intra_node``, ``inter_node``).
        phases: ``{"forward": (seconds, bound), "backward": (seconds, bound)}``, ``bound`` the key of the chain
            that bounds the phase (:mod:`.phases`; :func:`.terms.term_label` names it).
        step_time_s: the sum of the phases for the plan's AdamW schedule (:func:`.terms.update_in_backward`);
            ``dominating`` the bound of the longer phase.
        exposed: seconds of each bounding chain not hidden behind compute (sum: step time - compute time).
        step_time_fastest_s, dominating_fastest: the fastest estimate (seconds), the largest term, and that term
            (an estimate at the preset's rates, not a lower bound).
        step_time_pessimistic_s, dominating_pessimistic: the phase model with the backward's H2D copies at
            half bandwidth while D2H copies run.
        nvme_window: with state on NVMe, ``{"limit": bytes, "min_window": bytes}``: the ``host_memory_limit`` the run
            uses (given, else half the preset's RAM) and the engine's minimum host window per process
            (:mod:`.window`); a limit below it is in ``reasons``. ``None`` without NVMe.
        other_schedule: the other AdamW schedule (``optimizer_in_backward``: its value, ``step_time_s``,
            ``phases``, ``dominating``).
        checkpoint_bytes, checkpoint_write_s: one directory checkpoint and its write time at
            ``nvme_drives x nvme_write_gbps``.
        compute_bound_batch_size: smallest batch size at which compute bounds both phases (None: never).
        max_device_batch_size: largest batch size whose device bytes fit (None: no GPU).
        fits, reasons: whether every tier fits, and one line per shortfall.
        headroom: per checked tier (``host``, ``device``, ``disk``), (capacity - need) / capacity.
        warnings: settings the plan accepts but the model may not take (:func:`position_warnings`, the NVMe
            limit's); printed as ``warning:`` lines.
        tight: the tiers that fit with under ``TIGHT_HEADROOM`` (5%) of headroom: the estimate's
            assumptions (runtime reserve, working-set factor, allocator fragmentation) are larger
            than that margin, so such a "fits" may not.
        parallel: ``None`` for one process; else data parallel details (:func:`.parallel.scale_out`). Then
            ``host``, ``disk``, ``nvme_*`` and the ``host_adamw``/``host_memory``/``inter_node`` terms are per
            node, ``device``, ``h2d``, ``d2h``, ``compute``, ``intra_node`` per rank, and ``step_time_s`` the
            step of every rank.
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
    headroom: dict[str, float] = field(default_factory=dict)
    tight: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    parallel: dict[str, Any] | None = None
    phases: dict[str, tuple[float, str]] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    step_time_fastest_s: float = 0.0
    dominating_fastest: str = "compute"
    other_schedule: dict[str, Any] | None = None
    nvme_window: dict[str, int] | None = None
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
        """Tokens per step of one process (``batch_size`` x ``seq_len``)."""
        return self.settings["batch_size"] * self.settings["seq_len"]

    @property
    def node_tokens(self) -> int:
        """Tokens per step of one node: ``devices`` x :attr:`tokens`."""
        return self.settings.get("devices", 1) * self.tokens

    @property
    def cluster_tokens(self) -> int:
        """Tokens per step of all nodes: ``num_nodes`` x :attr:`node_tokens`."""
        return self.settings.get("num_nodes", 1) * self.node_tokens

    @property
    def transfer_bytes(self) -> int:
        """Bytes of one decoder-layer fetch on the H2D link (:func:`.terms.transfer_bytes`)."""
        return transfer_bytes(self.counts, self.settings)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("model", "settings", "host", "device", "nvme", "disk", "capacity",
                                            "moved", "flops", "flops_parts", "times", "step_time_s", "dominating",
                                            "step_time_pessimistic_s", "dominating_pessimistic",
                                            "phases", "exposed", "step_time_fastest_s",
                                            "dominating_fastest", "other_schedule", "checkpoint_bytes", "checkpoint_write_s", "compute_bound_batch_size",
                                            "max_device_batch_size", "fits", "reasons", "headroom", "tight",
                                            "warnings", "parallel", "nvme_window")}
        d.update(hardware=self.hardware.to_dict(), counts=self.counts.to_dict(), host_bytes=self.host_bytes,
                 device_bytes=self.device_bytes, disk_bytes=self.disk_bytes, transfer_bytes=self.transfer_bytes,
                 max_seq_len={"these options": max_seq_len(self),
                              **{lab: max_seq_len(self, **ch) for lab, ch in long_sequence_variants(self)}})
        return d


def _model_name_and_config(model_cfg: Any) -> tuple[str, Any]:
    """``(name, config)`` of a ``model_cfg`` as :func:`plan` takes it; Hydra's ``_target_`` keys are ignored."""
    if isinstance(model_cfg, (str, bytes)) or hasattr(model_cfg, "__fspath__"):
        if not is_model_path(model_cfg):
            raise ValueError(f"model {model_cfg!r} is neither a conf/model preset mapping nor a path to a Hugging Face "
                             "model directory or config.json")
        return str(model_cfg), load_hf_config(model_cfg)
    if isinstance(model_cfg, Mapping) or type(model_cfg).__name__ == "DictConfig":
        d = {k: v for k, v in as_plain_dict(model_cfg).items() if k != "_target_"}
        if isinstance(d.get("config"), Mapping):
            cfg = {k: v for k, v in d["config"].items() if k != "_target_"}
            return str(d.get("name", cfg.get("model_type"))), cfg
        if isinstance(d.get("config"), str) and is_model_path(d["config"]):  # config: /path/to/hf_dir
            return str(d.get("name", d["config"])), load_hf_config(d["config"])
        return str(d.get("model_type", "model")), d
    return str(getattr(getattr(model_cfg, "config", model_cfg), "model_type", type(model_cfg).__name__)), model_cfg


def _crossover(c: ParamCounts, hw: Hardware, s: dict[str, Any], e1: dict[str, Any]) -> tuple[int | None, int | None]:
    """Batch size from which compute bounds both phases, and the largest batch the device holds.

    Every chain's time is affine in the batch size at fixed ``seq_len``: two evaluations give it. Device bytes
    are piecewise (chunk caps, the larger phase): binary search.
    """
    e2 = _estimate(c, hw, {**s, "batch_size": s["batch_size"] + 1})
    b0 = s["batch_size"]
    r1, r2 = chains(e1), chains(e2)
    need = 1.0
    for ph, row in r1.items():
        comp = r2[ph][0][1] - row[0][1]  # compute seconds per extra sequence
        for (_, t1), (_, t2) in zip(row[1:], r2[ph][1:]):
            slope = t2 - t1
            fixed = t1 - slope * b0
            if fixed <= 0:
                continue
            if comp <= slope:
                need = math.inf
                break
            need = max(need, fixed / (comp - slope))
    bound = None if math.isinf(need) else max(1, math.ceil(need - 1e-9))
    if not hw.is_gpu:
        return bound, None
    cap = hw.hbm_gib * GIB
    return bound, _largest(lambda b: sum(_estimate(c, hw, {**s, "batch_size": b})["device"].values()) <= cap, 1 << 20)


def _largest(ok: Any, limit: int) -> int:
    """The largest ``n`` >= 1 with ``ok(n)`` (``ok`` true up to some ``n``, then false), 0 when none: doubling up to
    ``limit`` (returned when it passes), then a binary search."""
    lo, hi = 0, 1
    while ok(hi) and hi < limit:
        lo, hi = hi, hi * 2
    return hi if ok(hi) else _bisect(ok, lo, hi)


def _bisect(ok: Any, lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi)`` with ``ok(n)`` (``lo`` if none above it), given not ``ok(hi)`` (``ok`` true
    up to some ``n``, then false)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def plan(model_cfg: Any, hw: Hardware | Mapping[str, Any], **options: Any) -> Plan:
    """Plan one training configuration on one hardware preset; the options are keywords with :func:`settings`'
    defaults.

    Args:
        model_cfg: a ``conf/model/*.yaml`` mapping (``name``, ``config``...), AutoConfig kwargs
            with ``model_type``, a ``PretrainedConfig``, a built model, or the path of a Hugging
            Face model directory or its ``config.json`` (read with ``AutoConfig``, local files only).
        hw: a :class:`Hardware` or a ``conf/hardware/*.yaml`` mapping.
        batch_size, seq_len: sequences per optimizer step and tokens per sequence.
        precision: ``32-true``, ``bf16-mixed``, ``16-mixed`` or ``bf16-true`` (Lightning's aliases
            ``32``, ``16``, ``bf16`` are accepted).
        offload_params, offload_optimizer, offload_grads: ``"cpu"`` (host RAM) or ``"nvme"``; ``offload_grads``
            ``None`` (default): as ``offload_optimizer``, which moves the gradient accumulators in the strategy too
            (another value plans a setup the strategy does not offer, with a warning).
        offload_activations, lookahead, recompute_every, cpu_zero_copy, block_group, loss_chunk_size,
            mlp_chunk_size, recompute, activation_memory_limit, optimizer_in_backward: the strategy options
            (:class:`~megatrain_lightning.config.MegaTrainConfig`; a chunk size ``"default"``: the strategy's
            default); :attr:`Plan.transfer_bytes` is one ``block_group`` fetch's size; without
            ``activation_memory_limit``, ``"auto"``'s budget is :func:`.terms.resolve_auto`'s
            (``settings["recompute_mix"]``, ``settings["activation_budget"]``).
        grad_dtype: ``fp32``/``bf16``/``fp16`` gradients on the D2H link (default fp32, bf16 for
            ``bf16-true``).
        keep_checkpoints: directory checkpoints on disk at the peak of a save.
        pinned_round: count the power-of-two rounding of the offloaded block inputs' pinned buffers (GPU presets)
            by torch's caching host allocator (``ATen/core/CachingHostAllocator.h``), unless
            ``PYTORCH_CUDA_ALLOC_CONF=pinned_max_round_threshold_mb:<MB>`` (torch >= 2.9) says otherwise.
        devices, num_nodes: data parallel, as ``Trainer(devices=, num_nodes=)``: processes per node and nodes;
            ``batch_size`` is per process (:mod:`.parallel`).
        host_memory_limit: the strategy option (bytes or ``"3GiB"``; ``None``: half the RAM), checked as the
            engine checks it (:mod:`.window`).
        reference: preference training's reference model (``DPOModule(reference=...)``): ``None``,
            ``"precompute"`` or ``"adapter"`` add nothing; ``"copy"``: a frozen fp32 copy of the weights, 4
            B/param more where the masters live (and its wire shadow), and per step one more forward of every
            block (H2D, NVMe reads, forward FLOPs).
        optim: the optimizer whose state the RAM tier holds: a name (``conf/optim/<name>.yaml``; ``None``:
            ``"adamw"``) or a mapping with ``_target_`` and hyper-parameters (:func:`.optimizers.resolve`).

    Raises:
        ValueError: a bad setting (the message names it): a ``recompute`` that is not a policy, a bad
            ``activation_memory_limit``, ``block_group``, precision, tier, grad dtype, size, chunk size,
            ``devices``/``num_nodes``, ``reference``, ``optimizer_in_backward`` or ``optim``
            (:func:`.optimizers.resolve`); ``num_nodes`` > 1 on hardware without ``network_gbps``.
    """
    hw = Hardware.from_mapping(hw)
    name, cfg = _model_name_and_config(model_cfg)
    counts = count_params(cfg)
    s = settings(**options)
    return _plan_from_counts(name, counts, hw, s, model_cfg if not isinstance(model_cfg, (str, bytes)) else cfg)


def settings(*, batch_size: int = 1, seq_len: int = 2048, precision: str = "bf16-mixed", offload_params: str = "cpu",
             offload_optimizer: str = "cpu", offload_grads: str | None = None, offload_activations: bool = False,
             lookahead: int = 1, recompute_every: int = 1, grad_dtype: str | None = None, keep_checkpoints: int = 2,
             pinned_round: bool = True, cpu_zero_copy: bool = True, loss_chunk_size: int | str | None = "default",
             mlp_chunk_size: int | str | None = "default", devices: int = 1, num_nodes: int = 1,
             recompute: str = "block", activation_memory_limit: int | str | None = None, block_group: int = 1,
             optimizer_in_backward: bool | str | None = None,
             host_memory_limit: int | str | None = None, reference: str | None = None,
             optim: Any = None) -> dict[str, Any]:
    """Validated settings of a plan (:func:`plan`'s arguments); ``grad_dtype`` becomes ``grad_bytes``.

    Raises:
        ValueError: see :func:`plan`.
    """
    recompute, limit = check_recompute(recompute, activation_memory_limit, this_torch=False)
    optim = optim_setting(optim)
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {', '.join(str(r).lower() for r in REFERENCES)} (the preference "
                         f"reference model, megatrain_lightning.preference.DPOModule), got {reference!r}")
    host_limit = parse_limit(host_memory_limit)
    block_group = check_group(block_group)
    in_bwd = {"true": True, "false": False, "null": None, "none": None}.get(str(optimizer_in_backward).lower(), "?")
    if in_bwd == "?":
        raise ValueError(f"optimizer_in_backward must be true, false or null (the strategy's default), "
                         f"got {optimizer_in_backward!r}")

    devices = positive_count(devices, "trainer.devices")
    num_nodes = positive_count(num_nodes, "trainer.num_nodes")
    offload_grads = offload_optimizer if offload_grads is None else offload_grads
    precision = PRECISION_ALIASES.get(precision, precision)  # type: ignore[call-overload]
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    for name, v in (("offload_params", offload_params), ("offload_optimizer", offload_optimizer),
                    ("offload_grads", offload_grads)):
        if v not in TIERS:
            raise ValueError(f"{name} must be one of {TIERS}, got {v!r}")
    if grad_dtype is not None and grad_dtype not in GRAD_BYTES:
        raise ValueError(f"grad_dtype must be one of {sorted(GRAD_BYTES)} or None, got {grad_dtype!r}")
    for name, v, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("recompute_every", recompute_every, 1),
                         ("lookahead", lookahead, 0), ("keep_checkpoints", keep_checkpoints, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return dict(batch_size=int(batch_size), seq_len=int(seq_len), precision=precision, offload_params=offload_params,
                offload_optimizer=offload_optimizer, offload_grads=offload_grads,
                offload_activations=bool(offload_activations), lookahead=int(lookahead),
                recompute_every=int(recompute_every), keep_checkpoints=int(keep_checkpoints),
                pinned_round=bool(pinned_round), cpu_zero_copy=bool(cpu_zero_copy),
                loss_chunk_size=resolve_chunk(loss_chunk_size, "loss_chunk_size"),
                mlp_chunk_size=resolve_chunk(mlp_chunk_size, "mlp_chunk_size"),
                grad_bytes=GRAD_BYTES[grad_dtype] if grad_dtype else PRECISIONS[precision][2],
                devices=devices, num_nodes=num_nodes, recompute=recompute, activation_memory_limit=limit,
                block_group=block_group, optimizer_in_backward=in_bwd, host_memory_limit=host_limit,
                reference=reference, optim=optim)


def optim_setting(optim: Any) -> str | dict[str, Any]:
    """``optim`` as a plan keeps it: a :data:`.optimizers.OPTIMIZERS` name (``None``: ``"adamw"``), else a plain
    dict of ``_target_`` and hyper-parameters without :data:`RECIPE_ONLY_OPTIM_KEYS`.

    Raises:
        ValueError: see :func:`.optimizers.resolve`.
    """
    if optim is None or isinstance(optim, str):
        return resolve(optim)[0].name
    d = {k: v for k, v in as_plain_dict(optim).items() if k not in RECIPE_ONLY_OPTIM_KEYS}
    resolve(d)
    return d


#: keys of a recipe's ``optim`` section that are not the optimizer's (the warm-up of ``CausalLMModule``'s schedule)
RECIPE_ONLY_OPTIM_KEYS = ("warmup_steps",)


def check_group(value: Any) -> int:
    """``block_group`` as an integer >= 1 (the engine's ``check_block_group``; a string of digits is accepted).

    Raises:
        ValueError: anything else; names ``block_group`` and ``strategy.block_group``.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    try:
        return check_block_group(value)
    except ValueError as e:
        raise ValueError(f"{e} Set block_group=<int >= 1> (planner) or strategy.block_group=<int >= 1> (recipes); "
                         "1 fetches one decoder layer at a time.") from None


def _plan_from_counts(name: str, counts: ParamCounts, hw: Hardware, s: dict[str, Any], source: Any) -> Plan:
    cap = capacity(hw)
    s = {**s, "loss_chunk_size": loss_chunk_tokens(s["loss_chunk_size"], counts.vocab_size)}
    used, mw, refusal, warning = limit_check(source, s, hw.is_gpu, s.get("host_memory_limit"), cap["host"],
                                             f"the preset {hw.name}")
    spare = window_spare(used, mw, cap["host"], s)
    # the window's cache counts in host RAM for any number of processes, its saved reads for one only
    s = {**s, "nvme_window_spare": spare, "nvme_window_limit": min(used, cap["host"]) if mw is not None else 0}
    e = _estimate(counts, hw, s)
    s = e["settings"]  # with "auto"'s budget and mix
    dom = max(e["times"], key=e["times"].get)
    ph, pess = phase_model(e), phase_model(e, pessimistic=True)
    flip = not update_in_backward(s)
    alt = phase_model(_estimate(counts, hw, {**s, "optimizer_in_backward": flip}))
    bound, max_dev = _crossover(counts, hw, s, e)
    p = Plan(model=name, hardware=hw, counts=counts, settings=s, host=e["host"], device=e["device"],
             nvme=e["nvme"], disk=e["disk"], capacity=cap, moved=e["moved"], flops=e["flops"],
             flops_parts=e["flops_parts"], times=e["times"], step_time_s=ph["step_time_s"],
             dominating=ph["dominating"], step_time_pessimistic_s=pess["step_time_s"],
             dominating_pessimistic=pess["dominating"], checkpoint_bytes=e["ckpt"],
             checkpoint_write_s=e["ckpt"] / (hw.nvme_drives * hw.nvme_write_gbps * 1e9),
             compute_bound_batch_size=bound, max_device_batch_size=max_dev, parallel=e["parallel"],
             phases=ph["phases"], exposed=ph["exposed"], step_time_fastest_s=e["times"][dom],
             dominating_fastest=dom, other_schedule=dict(optimizer_in_backward=flip, **{
                 k: alt[k] for k in ("step_time_s", "phases", "dominating")}), source=source)
    p.reasons = shortfalls(p, cap["host"], cap["device"], cap["disk"], where="preset")
    if s["offload_params"] == "nvme" and s.get("devices", 1) * s.get("num_nodes", 1) > 1 and \
            (s.get("num_nodes", 1) > 1 or "cpu" in (s["offload_optimizer"], s["offload_grads"])):
        p.reasons.append("the strategy keeps the fp32 masters on NVMe with several processes only on one node with "
                         "the optimizer on NVMe (offload_optimizer=nvme offload_grads=nvme): "
                         + ("set those, or " if "cpu" in (s["offload_optimizer"], s["offload_grads"]) else "")
                         + "offload_params=cpu (masters once per node in /dev/shm), or num_nodes=1")
    if mw is not None:
        p.nvme_window = {"limit": used, "min_window": mw}
    if refusal:
        p.reasons.append(refusal)
    p.fits = not p.reasons
    needs = (("host", p.host_bytes, cap["host"]), ("device", p.device_bytes, cap["device"]),
             ("disk", p.disk_bytes, cap["disk"]))
    p.headroom = {k: (have - need) / have for k, need, have in needs if have}
    p.tight = [k for k, h in p.headroom.items() if 0 <= h < TIGHT_HEADROOM]
    p.warnings = position_warnings(counts, s) + ([warning] if warning else [])
    if s["offload_grads"] != s["offload_optimizer"]:
        p.warnings.append(f"offload_grads={s['offload_grads']} with offload_optimizer={s['offload_optimizer']}: the "
                          "strategy keeps the gradient accumulators with the optimizer state (its offload_optimizer "
                          "moves both); this plans a setup MegaTrainStrategy does not offer")
    return p


def window_spare(limit: int | None, min_window: int | None, ram: int, s: dict[str, Any]) -> int:
    """Bytes of ``host_memory_limit`` (capped at ``ram``) beyond the engine's minimum window, in one process; 0
    without NVMe, below the minimum, or with several processes (per-rank windows are not modelled)."""
    if limit is None or min_window is None or s.get("devices", 1) * s.get("num_nodes", 1) > 1:
        return 0
    return max(0, min(limit, ram) - min_window)


def position_warnings(c: ParamCounts, s: dict[str, Any]) -> list[str]:
    """A warning when ``seq_len`` exceeds the config's ``max_position_embeddings`` (0: unknown). Not a refusal:
    RoPE scaling lets a model run past it (the recipes refuse it; a model without it degrades there)."""
    mp, T = c.max_position_embeddings, s["seq_len"]
    if not mp or T <= mp:
        return []
    return [f"seq_len={T:,} is beyond the model's max_position_embeddings={mp:,} (its config): the model was not "
            f"trained on positions that far; use seq_len <= {mp:,}, or a config with RoPE scaling (rope_scaling) "
            f"that extends it (the memory above is counted for seq_len={T:,} either way)"]


def capacity(hw: Hardware) -> dict[str, int | None]:
    """Bytes per tier on a preset: host RAM, device (None without a GPU), disk (all NVMe drives)."""
    return {"host": int(hw.host_ram_gib * GIB), "device": int(hw.hbm_gib * GIB) if hw.is_gpu else None,
            "disk": int(hw.nvme_drives * hw.nvme_capacity_gib * GIB)}


def fits_memory(p: Plan, host: int | None = None, device: int | None = None) -> bool:
    """Whether host RAM and device memory fit (the preset's capacities unless given; disk not checked)."""
    host = p.capacity["host"] if host is None else host
    device = p.capacity["device"] if device is None else device
    return p.host_bytes <= host and (not p.hardware.is_gpu or device is None or p.device_bytes <= device)


def max_seq_len(p: Plan, host: int | None = None, device: int | None = None, limit: int = 1 << 24,
                batch_size: int = 1, **changes: Any) -> int:
    """Longest ``seq_len`` at ``batch_size`` whose host RAM and device memory fit (binary search: every memory term
    grows with the sequence).

    Args:
        p: the plan whose model, hardware and settings are used.
        host, device: bytes available (default: the preset's capacities).
        limit: the largest length tried (tokens).
        batch_size: sequences per step.
        changes: settings changed for this answer (``loss_chunk_size=1024``).

    Returns:
        Tokens; 0 when not even one token fits.
    """
    s = {**p.settings, **changes, "batch_size": int(batch_size)}

    def ok(t: int) -> bool:
        return fits_memory(_plan_memory(p, {**s, "seq_len": t}), host, device)

    if not ok(1):
        return 0
    return limit if ok(limit) else _bisect(ok, 1, limit)


def max_batch_size(p: Plan, host: int | None = None, device: int | None = None, limit: int = 1 << 20,
                   **changes: Any) -> int:
    """Largest ``batch_size`` whose host RAM and device memory fit; 0 when none; arguments as :func:`max_seq_len`."""
    s = {**p.settings, **changes}
    return _largest(lambda b: fits_memory(_plan_memory(p, {**s, "batch_size": b}), host, device), limit)


def _plan_memory(p: Plan, s: dict[str, Any]) -> Plan:
    """A Plan with only the memory tiers filled (no crossover search): what :func:`max_seq_len` probes."""
    e = _estimate(p.counts, p.hardware, s)
    return Plan(model=p.model, hardware=p.hardware, counts=p.counts, settings=s, host=e["host"], device=e["device"],
                nvme=e["nvme"], disk=e["disk"], capacity=p.capacity, moved=e["moved"], flops=e["flops"],
                flops_parts=e["flops_parts"], times=e["times"], step_time_s=0.0, dominating="compute",
                step_time_pessimistic_s=0.0, dominating_pessimistic="compute", checkpoint_bytes=e["ckpt"],
                checkpoint_write_s=0.0, parallel=e["parallel"], source=p.source)


#: the options the longest-sequence answer turns on one after another (planner names)
LONG_SEQUENCE_STEPS = ("loss_chunk_size", "mlp_chunk_size", "offload_activations")


def long_sequence_variants(p: Plan) -> list[tuple[str, dict[str, Any]]]:
    """Settings for the longest-sequence table: none of :data:`LONG_SEQUENCE_STEPS`, then each added in turn (a
    chunk option at the plan's value, else its suggested size)."""
    s = p.settings
    on = {"loss_chunk_size": s["loss_chunk_size"] or SUGGESTED_CHUNK["loss_chunk_size"],
          "mlp_chunk_size": s["mlp_chunk_size"] or SUGGESTED_CHUNK["mlp_chunk_size"], "offload_activations": True}
    off = {"loss_chunk_size": None, "mlp_chunk_size": None, "offload_activations": False}
    out = [("none of the options", dict(off))]
    cur = dict(off)
    for k in LONG_SEQUENCE_STEPS:
        cur = {**cur, k: on[k]}
        out.append(("+ " + (f"{k}={on[k]}" if k != "offload_activations" else "offload_activations=true"), dict(cur)))
    return out


def replan(p: Plan, **changes: Any) -> Plan:
    """The same model and hardware with some settings changed; the gradient dtype stays unless ``grad_dtype``
    is given."""
    s = dict(p.settings)
    s["grad_dtype"] = {4: "fp32", 2: "bf16"}[s.pop("grad_bytes")]
    for k in ("recompute_mix", "activation_budget", "nvme_window_spare", "nvme_window_limit"):  # derived by the plan
        s.pop(k, None)
    s.update(changes)
    return _plan_from_counts(p.model, p.counts, p.hardware, settings(**s), p.source)


def gib(n: float | None) -> str:
    """Bytes as GiB text: 1 decimal, 2 below 10 GiB ("-" for None)."""
    if n is None:
        return "-"
    return f"{n / GIB:,.1f}" if n >= 10 * GIB else f"{n / GIB:.2f}"


def shortfalls(p: Plan, host: int | None, device: int | None, disk: int | None, where: str) -> list[str]:
    """One line per tier whose need exceeds what is available (``None`` = not checked)."""
    out = []
    what = "" if where == "preset" else f" ({where})"
    node = " per node" if p.parallel else ""
    if host is not None and p.host_bytes > host:
        out.append(f"host RAM short: need {gib(p.host_bytes)} GiB{node}, have {gib(host)} GiB{what}")
    if device is not None and p.hardware.is_gpu and p.device_bytes > device:
        out.append(f"device memory short: need {gib(p.device_bytes)} GiB, have {gib(device)} GiB{what}")
    if disk is not None and p.disk_bytes > disk:
        out.append(f"disk short: need {gib(p.disk_bytes)} GiB{node}, have {gib(disk)} GiB{what}")
    return out
