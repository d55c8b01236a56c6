"""``MegaTrainConfig``: every option of ``MegaTrainStrategy``, with its one default, its unit and its check.

``MegaTrainStrategy(**options)`` builds one (``MegaTrainStrategy(config=MegaTrainConfig(...))`` passes it
whole); the strategy, the engine, the Hydra recipes (``conf/strategy/*.yaml``) and the planner take their options
and defaults from it (``tests/test_config.py`` fails when they drift). Every check runs when the config is built;
each error names the option and its Hydra key ``strategy.<option>``.

This module imports only ``store/``: the engine imports it.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.utils.checkpoint

from .store.budget import above_ram, parse_bytes, physical_ram_bytes
from .store.nvme import ALIGN, IO_BLOCK_SIZE, NVME_PATH_FROM_ENV, NVMeConfig
from .store.regions import Region

RECOMPUTE_MODES = ("block", "selective", "none", "auto")
"""Allowed values of the ``recompute`` option."""


def _warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line: the first caller outside this package, Lightning and the
    ``__init__`` that ``dataclass`` generates, whether the options come through ``MegaTrainStrategy(...)``,
    ``Trainer(strategy="megatrain_nvme")`` or ``MegaTrainConfig(...)``."""
    inside = [os.path.dirname(os.path.abspath(__file__))]
    inside += [os.path.dirname(os.path.abspath(m.__file__)) for m in map(sys.modules.get, ("lightning",))
               if m is not None and getattr(m, "__file__", None)]
    prefixes = tuple(d + os.sep for d in inside)
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(prefixes)
                                 or frame.f_code.co_filename == "<string>"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


@dataclass
class MegaTrainConfig:
    """The options of ``MegaTrainStrategy``, checked when built (each field: default, unit, what it does).

    Raises:
        ValueError: an option out of its range (each field's docstring; the checks below and :meth:`_nvme_settings`).
        RuntimeError: ``recompute="selective"``/``"auto"`` on a torch without the marker (:func:`check_recompute`).
        TypeError: ``recompute_every`` and ``checkpoint_every`` both given, with different values.
    """

    lookahead: int = 1
    """Fetches copied ahead of the one computing (1 = double buffering)."""
    block_group: int = 1
    """Consecutive decoder layers fetched as one transfer unit, for small blocks whose fixed cost per fetch is not
    hidden behind their compute (docs/internals/streaming.md, "Block groups"). The device then holds up to
    ``(lookahead + 1) x block_group`` decoder layers' weights."""
    recompute_every: int = 1
    """Block calls per recompute segment: keep the input of every K-th block call only and recompute the others
    in backward (saved activations / K, at most one extra forward of K-1 blocks per segment). 1: every block input
    is kept (measured: docs/benchmarks.md, "Recompute segments")."""
    checkpoint_every: int | None = None
    """Deprecated name of ``recompute_every`` (with a ``DeprecationWarning``); folded into it, then ``None``."""
    offload_activations: bool = False
    """Keep saved block inputs in host memory (device footprint flat in depth), prefetched back one call ahead in
    backward."""
    recompute: str = "block"
    """What each block's backward recomputes: ``"block"``, ``"selective"``, ``"none"`` or ``"auto"`` (per block,
    within ``activation_memory_limit``; the choice is logged once). docs/architecture.md, "Recompute policy"."""
    activation_memory_limit: int | str | None = None
    """Bytes (or ``"4GiB"``) of device memory that ``recompute="auto"`` lets the kept activations take (block
    inputs included; the last block's graph, e.g. the LM head's logits, is not counted: leave room for it).
    ``None``: half the free device memory. Held in bytes once checked; ignored, with a warning, by other modes."""
    overlap_optimizer: bool = True
    """Apply each block's AdamW update just before its next prefetch instead of all at once in
    ``optimizer.step()``. Both give identical results."""
    block_classes: Sequence[str | type] | None = None
    """Class names/classes of the repeated blocks. ``None``: every Hugging Face model's ``_no_split_modules``."""
    block_names: Sequence[str] | None = None
    """``fnmatch`` patterns of module paths that are blocks, e.g. ``["net.layers.*"]``."""
    pin_memory: bool | None = None
    """Page-lock host memory on CUDA (the RAM tier's masters and wire images, the NVMe window). ``None``: pin,
    falling back to pageable memory with a warning where pinning fails; ``True``: a failure raises
    ``HostPinningError``; ``False``: never pin (H2D copies at pageable speed). ``ulimit -l`` does not limit CUDA's
    pinned memory and is not checked."""
    cpu_zero_copy: bool = True
    """On CPU, compute on the fp32 master slabs instead of a host-to-host copy (schedule, deferred updates and
    accounting run the same either way; ``False`` copies as the CUDA path does). Mixed precision always streams
    converted copies."""
    log_stats: bool = True
    """Log per-step accounting (``megatrain/h2d_bytes`` ...) like ``self.log(..., on_step=True)``."""
    offload_params: str = "cpu"
    """Where fp32 master weights live: ``"cpu"`` (host RAM) or ``"nvme"`` (per-block files under ``nvme_path``,
    read through a host window)."""
    offload_optimizer: str = "cpu"
    """Where ``exp_avg``, ``exp_avg_sq`` and the gradient accumulators live: ``"cpu"`` or ``"nvme"``."""
    nvme_path: str | None = None
    """Directory on a fast local disk for the NVMe tier (the store is ``<nvme_path>/megatrain_store``).
    ``strategy="megatrain_nvme"`` reads it from the environment variable ``MEGATRAIN_NVME_PATH``."""
    host_memory_limit: int | str | None = None
    """Bytes (or ``"16GiB"``) the NVMe tier's host window may use, on CPU including the compute buffers (never
    exceeded). ``None``: half of the physical RAM. Ignored when nothing is on NVMe."""
    nvme_io_threads: int = 4
    """Threads issuing NVMe read/write requests, one each at a time: the queue depth (measured in
    bench/nvme.py)."""
    nvme_io_block_size: int | str = IO_BLOCK_SIZE
    """Bytes per NVMe request, a multiple of 4096 (or ``"16MiB"``-style); each region is split into requests of
    this size that run concurrently (16 MiB, measured in bench/nvme_requests.py)."""
    nvme_read_ahead: int = 4
    """Buffers read ahead at most at once."""
    direct_io: bool | str = "auto"
    """``"auto"`` (``O_DIRECT`` where the filesystem allows it), ``True`` or ``False``."""
    keep_nvme_files: bool = False
    """Keep the store's files when the engine closes (``False``: removed)."""
    optimizer_in_backward: bool | None = None
    """Start each block's optimizer update during backward, as soon as its gradients of the step are complete,
    instead of deferring it to the next forward; bitwise the same results. On the RAM tier the update runs on a
    host thread of its own, hidden behind the rest of the backward and the next forward; on the NVMe tier its
    reads and writes move into the backward, where the disk is otherwise idle, and the gradient accumulator never
    goes to disk. ``None``: on with the NVMe tier (:func:`optimizer_in_backward_on`). Used only on the last
    micro-batch of an accumulation window, in automatic optimization, without gradient clipping or fp16 loss
    scaling and when no user code sees the step's gradients before the step: the LightningModule does not override
    ``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping`` or ``optimizer_step`` and
    no callback overrides ``on_after_backward`` or ``on_before_optimizer_step``; otherwise the deferred schedule
    runs."""
    unfreeze_during_fit: bool | None = None
    """Keep gradient and AdamW state in the store for the parameters frozen at setup as well, so that they can
    be unfrozen (``requires_grad_(True)``, ``optimizer.add_param_group``) while fit runs: 12 bytes more per frozen
    element (the accumulator from the first backward, the moments from the first step). ``None``: on when a
    Lightning ``BaseFinetuning`` callback is in the Trainer. ``False``: unfreezing during fit raises."""
    host_threads: int | None = None
    """Intra-op CPU threads of the engine's two host workers (host AdamW, gradient adds, casts to the wire dtype).
    ``None``: on CUDA ``torch.get_num_threads() - 1``, leaving a core for the kernel-launching thread (derived, not
    measured: docs/architecture.md, "Threads, streams and locks"); on CPU 1 (measured: engine/threads.py)."""
    update_threads: int = 1
    """Slabs the host optimizer updates at once on the RAM tier: threads of the update worker, sharing its
    ``host_threads`` (``host_threads // update_threads`` each, at least 1). With one, updates still queued when a
    backward ends delay the next forward once a step's host update takes about as long as its forward and
    backward; more help only while one update leaves cores and memory bandwidth partly idle (measured:
    bench/update_overlap.py). Unused on the NVMe tier (its updates run one at a time in the host window)."""
    loss_chunk_size: int | str | None = "auto"
    """Tokens per chunk of the chunked LM head + cross-entropy in training calls
    ``model(input_ids=..., labels=...)`` of a Hugging Face causal LM (the full logits are never materialised).
    ``"auto"``: 256 MiB of fp32 logits per chunk (523 tokens of a 128,256-token vocabulary). ``None``: off. See
    docs/guide/long-sequences.md."""
    mlp_chunk_size: int | None = None
    """Tokens per chunk of each block's MLP (forward and recompute; each chunk checkpointed, so backward holds
    one chunk's MLP intermediates). ``None``: off."""
    process_group_backend: str | None = None
    """``torch.distributed`` backend of a run with several processes (``None``: NCCL on CUDA, gloo on CPU, as
    ``DDPStrategy``)."""
    timeout: timedelta | float | None = timedelta(minutes=30)
    """How long a collective, and the rendezvous, wait for the other ranks (30 minutes, as ``DDPStrategy``;
    seconds or a ``timedelta``, held as a ``timedelta``): a hung rank stops the others after at most about twice
    this; a dead one stops them at once with a ``PeerFailure`` (``parallel/faults.py``)."""
    nvme: NVMeConfig | None = field(init=False, repr=False, compare=False)
    """The NVMe tier's settings built from the ``offload_*``/``nvme_*``/``host_memory_limit``/``direct_io``/
    ``keep_nvme_files`` options, or ``None`` when everything stays in host RAM (not an option)."""

    def __post_init__(self) -> None:
        check_count("host_threads", self.host_threads, 1, "CPU threads of each host worker",
                    none_means="on CUDA one less than torch.get_num_threads(), on CPU 1")
        check_count("update_threads", self.update_threads, 1, "slabs the host optimizer updates at once")
        automatic = ("pin_memory", "optimizer_in_backward", "unfreeze_during_fit")  # None allowed: automatic
        for name in ("offload_activations", "overlap_optimizer", "pin_memory", "cpu_zero_copy", "log_stats",
                     "keep_nvme_files", "optimizer_in_backward", "unfreeze_during_fit"):
            value = getattr(self, name)  # a bool: a truthy string such as "false" is refused
            if not (isinstance(value, bool) or (value is None and name in automatic)):
                allowed = "True, False or None (automatic)" if name in automatic else "True or False"
                raise ValueError(f"megatrain: {name} must be {allowed}, got {value!r}. Set strategy option / Hydra "
                                 f"key strategy.{name} (true/false{'/null' if name in automatic else ''}).")
        self.timeout = check_timeout(self.timeout)
        check_count("lookahead", self.lookahead, 0, "fetches prefetched ahead of the one computing; 1 = double "
                    "buffering")
        check_block_group(self.block_group)
        if self.checkpoint_every is not None:  # the deprecated name (it collided with Lightning's model checkpoints)
            _warn("megatrain: checkpoint_every was renamed recompute_every (it sets recompute segments, not "
                  "model checkpoints); the old name will be removed in the next release.", DeprecationWarning)
            if self.recompute_every not in (1, self.checkpoint_every):
                raise TypeError(f"recompute_every={self.recompute_every} and checkpoint_every={self.checkpoint_every} "
                                "both given; pass only recompute_every.")
            self.recompute_every = self.checkpoint_every
        k = self.recompute_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"megatrain: recompute_every must be an int >= 1 (block calls per recompute segment), "
                             f"got {k!r}. Set strategy option / Hydra key strategy.recompute_every.")
        self.checkpoint_every = None
        given_limit = self.activation_memory_limit
        self.recompute, self.activation_memory_limit = check_recompute(self.recompute, given_limit)
        if given_limit is not None and self.recompute != "auto":  # only "auto" reads it
            _warn(f"megatrain: activation_memory_limit has no effect with recompute={self.recompute!r}; only "
                  "recompute='auto' chooses per block from that budget.", UserWarning)
        self.nvme = self._nvme_settings()
        if self.nvme is not None and self.update_threads != 1:
            _warn(f"megatrain: update_threads={self.update_threads} has no effect on the NVMe tier: its "
                  "updates run one at a time on the H2D or D2H worker, inside the host window. It applies "
                  "when everything stays in host RAM.", UserWarning)
        check_chunk_size("loss_chunk_size", self.loss_chunk_size, allow_auto=True)
        check_chunk_size("mlp_chunk_size", self.mlp_chunk_size, allow_auto=False)

    def _nvme_settings(self) -> NVMeConfig | None:
        """Check the NVMe options and build the tier's settings; ``None`` when everything stays in host RAM.
        ``nvme_path`` has ``~`` expanded, or with :data:`~.store.nvme.NVME_PATH_FROM_ENV` is read from
        ``MEGATRAIN_NVME_PATH``.

        Raises:
            ValueError: an unknown tier, ``nvme`` without a path, a bad ``host_memory_limit``, or bad I/O
                settings; each message names the option.

        Warns:
            UserWarning: ``nvme_path`` or ``host_memory_limit`` given while nothing is offloaded to NVMe;
                ``host_memory_limit`` above this machine's physical RAM.
        """
        for name, v in (("offload_params", self.offload_params), ("offload_optimizer", self.offload_optimizer)):
            if v not in ("cpu", "nvme"):
                raise ValueError(f"{name} must be 'cpu' or 'nvme', got {v!r}.")
        kinds = set()
        if self.offload_params == "nvme":
            kinds.add(Region.master)
        if self.offload_optimizer == "nvme":
            kinds |= {"exp_avg", Region.exp_avg_sq, Region.grad_accum}
        for name, v, low in (("nvme_io_threads", self.nvme_io_threads, 1), ("nvme_read_ahead", self.nvme_read_ahead, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}.")
        if self.direct_io not in ("auto", True, False):
            raise ValueError(f"direct_io must be 'auto', True or False, got {self.direct_io!r}.")
        if not kinds:
            given = [k for k in ("nvme_path", "host_memory_limit") if getattr(self, k) is not None]
            if given:
                _warn(f"megatrain: {' and '.join(given)} given but nothing is offloaded to NVMe, so "
                      f"{'it has' if len(given) == 1 else 'they have'} no effect: everything stays in host RAM. "
                      "Set offload_params='nvme' and/or offload_optimizer='nvme' (or use "
                      "strategy='megatrain_nvme') to use the NVMe tier.", UserWarning)
            return None
        path = self.nvme_path
        if path == NVME_PATH_FROM_ENV:
            path = os.environ.get("MEGATRAIN_NVME_PATH")
            if not path:
                raise ValueError(
                    "strategy='megatrain_nvme' reads the store directory from the environment variable "
                    "MEGATRAIN_NVME_PATH, which is not set. Set it to a directory on a fast local disk "
                    "(export MEGATRAIN_NVME_PATH=/mnt/nvme), or pass MegaTrainStrategy(offload_params='nvme', "
                    "offload_optimizer='nvme', nvme_path=...)."
                )
        if not path:
            raise ValueError("offload_params/offload_optimizer='nvme' needs nvme_path= (a directory on a fast local disk).")
        limit = self.host_memory_limit
        if limit is None:
            limit = physical_ram_bytes() // 2
        limit, block = _size("host_memory_limit", limit), _size("nvme_io_block_size", self.nvme_io_block_size)
        warning = above_ram(limit, physical_ram_bytes(), "this machine")
        if warning:
            _warn(f"megatrain: {warning}.", UserWarning)
        if block % ALIGN:
            raise ValueError(f"nvme_io_block_size must be a multiple of {ALIGN} bytes (O_DIRECT alignment), got {block}; "
                             "for example '16MiB'.")
        return NVMeConfig(path=os.path.expanduser(str(path)), kinds=frozenset(kinds), host_memory_limit=limit,
                          io_threads=self.nvme_io_threads, io_block_size=block, read_ahead=self.nvme_read_ahead,
                          direct_io=self.direct_io, keep_files=self.keep_nvme_files)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's default, by name (the Hydra recipes and the planner are tested against it)."""
        return {f.name: f.default for f in fields(cls) if f.init}


def optimizer_in_backward_on(option: bool | None, nvme_tier: bool) -> bool:
    """``optimizer_in_backward`` resolved: the option, or with ``None`` whether any state is on NVMe (``nvme_tier``).
    The strategy and the planner both decide by it (the strategy's further fallbacks: the option's docstring)."""
    return option if option is not None else nvme_tier


def _size(option: str, value: Any) -> int:
    """``parse_bytes`` with the option's name in the error."""
    try:
        return parse_bytes(value)
    except ValueError as err:
        raise ValueError(f"megatrain: {option}: {err}") from None


def check_timeout(timeout: Any) -> timedelta | None:
    """The strategy's ``timeout`` as a ``timedelta``: seconds (int/float > 0), a positive ``timedelta`` or ``None``.

    Raises:
        ValueError: anything else (zero or negative: every collective would fail at once), naming the Hydra key.
    """
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"megatrain: timeout must be a number of seconds > 0, a positive datetime.timedelta or None, "
                         f"got {timeout!r}. Set strategy option / Hydra key strategy.timeout.")
    return timeout


def check_count(name: str, value: object, minimum: int, what: str, none_means: str | None = None) -> Any:
    """Return ``value`` when it is an int >= ``minimum`` (or ``None``, where ``none_means`` says what that does).

    Raises:
        ValueError: anything else (a float, a string, ``True``, a smaller number), naming the option, ``what``
            and its Hydra key."""
    if value is None and none_means is not None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        alt = f" or None ({none_means})" if none_means else ""
        raise ValueError(f"megatrain: {name} must be an int >= {minimum} ({what}){alt}, got {value!r}. Set "
                         f"MegaTrainStrategy({name}=...) or the Hydra key strategy.{name}.")
    return value


def check_block_group(size: object) -> int:
    """Return ``size`` when it is a valid ``block_group`` (an int >= 1); raise ``ValueError`` otherwise."""
    return check_count("block_group", size, 1, "consecutive decoder layers fetched as one transfer")


def check_chunk_size(name: str, value: Any, allow_auto: bool) -> int | str | None:
    """Return a chunk-size option unchanged: a positive ``int`` of tokens, ``None`` (off) or, where
    ``allow_auto``, ``"auto"``.

    Raises:
        ValueError: anything else, naming the option and what to pass instead."""
    ok = value is None or (allow_auto and value == "auto") or (
        isinstance(value, int) and not isinstance(value, bool) and value > 0)
    if not ok:
        extra = ', "auto"' if allow_auto else ""
        raise ValueError(f"megatrain: {name} must be a positive int (tokens per chunk){extra} or None (no "
                         f"chunking); got {value!r}. Set strategy option / Hydra key strategy.{name}.")
    return value


def check_recompute(mode: Any, activation_memory_limit: int | str | None = None,
                    this_torch: bool = True) -> tuple[str, int | None]:
    """Validate the ``recompute`` and ``activation_memory_limit`` options (``this_torch=False``: for another
    machine, the planner's case: the installed torch is not checked).

    Returns:
        (mode, limit in bytes or ``None``: "auto" then takes half the free device memory).
    Raises:
        ValueError: ``mode`` not one of :data:`RECOMPUTE_MODES`, or the limit not a positive size.
        RuntimeError: ``"selective"`` or ``"auto"`` with a torch whose selective activation checkpointing has no
            recompute marker (``torch.utils.checkpoint._RECOMPUTE``; torch 2.11 lacks it, 2.13 has it): the kept
            op outputs cannot be dropped from its cache.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"megatrain: recompute={mode!r} is not a recompute policy; use one of "
                         f"{', '.join(repr(m) for m in RECOMPUTE_MODES)} (strategy option / Hydra key "
                         "strategy.recompute; the planner's setting recompute).")
    if this_torch and mode in ("selective", "auto") and not hasattr(torch.utils.checkpoint, "_RECOMPUTE"):
        raise RuntimeError(f"megatrain: recompute={mode!r} needs torch.utils.checkpoint._RECOMPUTE, which torch "
                           f"{torch.__version__} lacks (torch 2.13 has it): upgrade torch, or use recompute='block' "
                           "or 'none'.")
    limit = None if activation_memory_limit is None else _size("activation_memory_limit", activation_memory_limit)
    return mode, limit
