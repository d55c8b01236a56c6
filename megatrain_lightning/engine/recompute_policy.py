"""What a streamed block keeps from its forward for its backward: the recompute policy.

The modes (``"block"``, ``"selective"``, ``"none"``, ``"auto"``): docs/architecture.md, "Recompute policy";
``"selective"`` saving is :class:`~.saved_ops.SavedOps`, ``"none"``'s kept graph ``engine/boundary/kept.py``,
``"auto"``'s choice :func:`decide`. An embedding lookup (:func:`is_lookup`) keeps its graph under every mode: it
saves only the token indices, which ``"block"`` keeps anyway, and recomputing it would fetch the whole table
(113 MB fp32 for SmolLM2-135M, the largest block of a small model) for nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..config import check_recompute
from ..store.budget import fmt_bytes
from .boundary.forward import SavedBoxes
from .boundary.kept import ParamLocator
from .op_kinds import cheap, expensive, flops, storage_bytes
from .saved_ops import SavedOps

log = logging.getLogger(__name__)


def _log_once(msg: str, *args: Any) -> None:
    """At INFO from global rank 0 (every rank decides the same), at DEBUG from the others."""
    rank0 = not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0
    log.log(logging.INFO if rank0 else logging.DEBUG, msg, *args)

def is_lookup(module: torch.nn.Module) -> bool:
    """``module`` is an embedding lookup whose graph saves only its indices (any ``nn.Embedding``, Gemma's scaled
    subclass too; not one with ``max_norm``, which renormalises the weight in place)."""
    return isinstance(module, torch.nn.Embedding) and module.max_norm is None


class _Measure:
    """Per block, over one training forward: bytes each policy would keep (``"selective"`` as :class:`SavedOps`,
    ``"none"`` as :mod:`.boundary.kept`) and FLOPs it would recompute."""

    def __init__(self):
        self.blocks: dict[int, dict[str, float]] = {}

    @contextlib.contextmanager
    def context(self, block: int, seqs: frozenset[int], bufs: dict[int, torch.Tensor]) -> Iterator[None]:
        """Measure one call of ``block`` whose hidden-state inputs have the sequence lengths ``seqs``. Its row also
        counts, as ``selective_sq``/``none_sq``, the bytes of :func:`_square` tensors, which grow with the product of
        two lengths (:func:`growth`)."""
        row = self.blocks.setdefault(block, dict(selective=0, none=0, flops=0, flops_selective=0, selective_sq=0,
                                                 none_sq=0))
        seen_s: set = set()
        seen_n: set = set()
        alive: list = []  # outputs held for the call, so freed storage is not reused under a counted address
        locator = ParamLocator(bufs)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            out = ctx.op_output
            f = flops(func, args, kwargs, out)
            row["flops"] += f
            if not cheap(func, args, kwargs) and expensive(func, args, kwargs):
                alive.append(out)
                for t in tree_flatten(out)[0]:
                    n = storage_bytes(t, seen_s)
                    row["selective"] += n
                    row["selective_sq"] += n if _square(t, seqs) else 0
            else:
                row["flops_selective"] += f
            return CheckpointPolicy.PREFER_RECOMPUTE

        def pack(t: torch.Tensor) -> torch.Tensor:
            if locator.find(t) is None and not _weight_cast(t, locator) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen_n:
                    seen_n.add(ptr)
                    alive.append(t)
                    row["none"] += t.untyped_storage().nbytes()
                    row["none_sq"] += t.untyped_storage().nbytes() if _square(t, seqs) else 0
            return boxes.pack(t)

        # boxed (boundary.forward.SavedBoxes): these hooks are the innermost, so unboxed, a graph node outliving this
        # forward would hold every measured activation for the whole run (1 GiB more resident than "selective" at 2048
        # tokens)
        boxes = SavedBoxes()
        try:
            with create_selective_checkpoint_contexts(policy)[0], \
                    torch.autograd.graph.saved_tensors_hooks(pack, SavedBoxes.unpack):
                yield
        finally:
            boxes.clear()
            alive.clear()
            seen_s.clear()
            seen_n.clear()


def _square(t: Any, seqs: frozenset[int]) -> bool:
    """``t`` is a ``[..., Tq, Tk]`` tensor with both lengths among the block's input lengths ``seqs`` (attention
    scores or probabilities of eager attention)."""
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in seqs and t.shape[-2] in seqs


def hidden_shapes(tensors: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes ``[B, T, D]`` of a block call's 3-d floating-point inputs that require grad (hidden states,
    encoder states), in order; else the first input's shape alone. Input of :func:`growth`."""
    shapes = tuple(tuple(t.shape) for t in tensors if t.is_floating_point() and t.requires_grad and t.dim() == 3)
    return shapes or ((tuple(tensors[0].shape),) if len(tensors) else ())


def growth(shapes: tuple[tuple[int, ...], ...], measured: tuple[tuple[int, ...], ...]) -> tuple[float, float]:
    """How a block call's kept activations grow from its measured input shapes ``measured`` to ``shapes``
    (:func:`hidden_shapes`): ``(linear, square)``, the factors of tensors proportional to B x T (hidden states, MLP
    intermediates, SDPA's outputs) and to B x Tq x Tk (eager attention's scores, :func:`_square`). With several
    inputs, ``linear`` is the largest growth of one input's elements and ``square`` that times the largest growth of
    a length, an upper bound of both (a decoder layer whose source grows 32x: 32x and 32x, where the first input
    alone says 1x). Inputs of another number or rank, or empty ones: their total elements, for both."""
    pairs = list(zip(shapes, measured))
    if len(shapes) != len(measured) or not pairs or any(len(a) != len(b) or not math.prod(a) or not math.prod(b)
                                                         for a, b in pairs):
        n, n0 = sum(math.prod(s) for s in shapes), sum(math.prod(s) for s in measured)
        return (n / n0, n / n0) if n and n0 else (1.0, 1.0)
    lin = max(math.prod(a) / math.prod(b) for a, b in pairs)
    seq = max((a[1] / b[1] for a, b in pairs if len(a) >= 3 and b[1]), default=1.0)
    return lin, lin * seq


def _weight_cast(t: torch.Tensor, locator: ParamLocator) -> bool:
    """``t`` is (a view of) autocast's cast of a trainable weight in the block's buffers, which ``"none"`` does not
    keep (:mod:`.boundary.kept`). A frozen weight's cast has no history and is counted (an overestimate)."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    leaf = getattr(fn.next_functions[0][0], "variable", None)
    return isinstance(leaf, torch.Tensor) and locator.find(leaf) is not None


def decide(measured: dict[int, dict[str, float]], budget: int) -> dict[int, str]:
    """Per block, the policy of ``"auto"``: ``"block"`` everywhere, then blocks upgraded to ``"selective"`` in
    order of recompute FLOPs saved per kept byte while the kept bytes fit ``budget``, then to ``"none"`` the same
    way with what is left (only where that saves recompute FLOPs).

    Args:
        measured: block index -> ``selective``/``none`` (bytes kept), ``flops`` (forward FLOPs),
            ``flops_selective`` (FLOPs ``"selective"`` still recomputes).
        budget: bytes the kept op outputs may take in all (block inputs excluded).
    """
    choice = {b: "block" for b in measured}
    left = budget
    gain_s = {b: (m["flops"] - m["flops_selective"]) / max(m["selective"], 1) for b, m in measured.items()}
    for b in sorted(measured, key=lambda b: -gain_s[b]):
        if measured[b]["selective"] <= left and measured[b]["flops"] > measured[b]["flops_selective"]:
            choice[b], left = "selective", left - measured[b]["selective"]
    gain_n = {b: m["flops_selective"] / max(m["none"] - m["selective"], 1) for b, m in measured.items()}
    for b in sorted(measured, key=lambda b: -gain_n[b]):
        extra = measured[b]["none"] - (measured[b]["selective"] if choice[b] == "selective" else 0)
        if extra <= left and measured[b]["flops_selective"] > 0:
            choice[b], left = "none", left - extra
    return choice


def default_activation_limit(device: torch.device) -> int:
    """Half the free device memory, in bytes (CUDA: ``mem_get_info`` plus what torch's caching
    allocator holds unused; CPU: half of ``MemAvailable`` in /proc/meminfo)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free // 2
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail // 2


class ActivationMeter:
    """Bytes of activations kept on the device between a forward and its backward.

    ``add(owner, n)`` counts ``n`` bytes until ``owner`` is garbage-collected or the returned handle is
    called (idempotent); ``on_change(live)`` gets the new total after every add. ``peak``: the most ever."""

    def __init__(self, on_change: Callable[[int], None] | None = None):
        self.live = 0
        self.peak = 0
        self.on_change = on_change
        self._lock = threading.Lock()  # _sub runs in weakref finalizers, on whichever thread frees the tensor

    def add(self, owner: Any, n: int) -> Callable[[], Any]:
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)
            live = self.live
        if self.on_change is not None:
            self.on_change(live)
        return weakref.finalize(owner, self._sub, n)

    def _sub(self, n: int) -> None:
        with self._lock:
            self.live -= n


class RecomputePolicy:
    """The recompute policy of the engine's block calls (module docstring).

    Args:
        mode: one of :data:`~megatrain_lightning.config.RECOMPUTE_MODES` (checked by
            :func:`~megatrain_lightning.config.check_recompute`).
        device: the compute device (``"auto"``'s default budget).
        activation_memory_limit: bytes ``"auto"``'s kept activations may take, block inputs included
            (``None``: :func:`default_activation_limit` when it decides).
    """

    def __init__(self, mode: str = "block", device: torch.device | None = None,
                 activation_memory_limit: int | None = None):
        self.mode, self.limit = check_recompute(mode, activation_memory_limit)
        self.device = device or torch.device("cpu")
        self.choice: dict[int, str] | None = None if self.mode == "auto" else {}
        self._measure: _Measure | None = None
        self._measured_fwd: Any = None
        self.meter = ActivationMeter()
        # "auto": per measured block, its hidden-state input shapes and the bytes kept when its call started
        self._size: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._live_at: dict[int, int] = {}
        self._budget = self._inputs = 0
        self._warned_guard = False

    def report_to(self, on_change: Callable[[int], None]) -> None:
        """Call ``on_change(live_bytes)`` after every activation the meter counts (:class:`ActivationMeter`)."""
        self.meter.on_change = on_change

    def _guarded(self, block: int, size: tuple[tuple[int, ...], ...]) -> str:
        """``"auto"``'s choice for a call, or ``"block"`` where the kept bytes would exceed
        ``activation_memory_limit``: this block's measured bytes plus the inputs the rest of the measured forward
        keeps, scaled to this call's shape (:func:`growth`: a longer batch, a batch-size finder's trial), on top of
        what is kept now (an earlier forward whose backward has not run). Never changes the choice for the measured
        shape and one forward at a time."""
        choice = self.choice.get(block, "block")  # type: ignore[union-attr]
        if choice == "block" or block not in self._size:
            return choice
        scale, square = growth(size, self._size[block])
        kept, kept_sq = self._kept[block]
        need = (kept - kept_sq + self._inputs - self._live_at[block]) * scale + kept_sq * square
        if self.meter.live + need <= self._budget:
            return choice
        if not self._warned_guard:
            self._warned_guard = True
            _log_once("megatrain: recompute='auto': a forward %.2fx the measured size (or kept next to another "
                     "forward's activations) would exceed activation_memory_limit %s; its blocks recompute whole "
                     "('block') where needed.", scale, fmt_bytes(self._budget))
        return "block"

    def start(self, block: int, fwd: Any, lookup: bool = False, size: tuple[tuple[int, ...], ...] = ()
              ) -> tuple[SavedOps | None, Callable[[dict], Any] | None, bool]:
        """``(saved_ops, measure, keep_graph)`` for a call of ``block`` in training forward ``fwd`` (any object
        identifying it): its :class:`SavedOps` (``"selective"``) or ``None``; when it only measures (``"auto"``'s
        first forward), ``measure(bufs)`` -> the context its forward runs under (``bufs``: the block's device
        buffers), else ``None``; ``True`` under ``"none"``. ``lookup``: :func:`is_lookup`, ``"none"`` always.
        ``size``: :func:`hidden_shapes` of the call."""
        if lookup:
            mode = "none"
        elif self.choice is not None:
            mode = self.choice.get(block, self.mode) if self.mode != "auto" else self._guarded(block, size)
        elif self._measured_fwd is not None and fwd is not self._measured_fwd:
            self._decide()
            mode = self._guarded(block, size)
        else:
            if self._measured_fwd is None:
                self._measured_fwd, self._measure = fwd, _Measure()
            self._size.setdefault(block, size)
            self._live_at.setdefault(block, self.meter.live)
            seqs = frozenset(s[1] for s in size if len(s) >= 3 and s[1] > 0)
            return None, functools.partial(self._measure.context, block, seqs), False  # type: ignore[union-attr]
        return (SavedOps(mode) if mode == "selective" else None), None, mode == "none"

    def _decide(self) -> None:
        m = self._measure.blocks  # type: ignore[union-attr]
        budget = self.limit if self.limit is not None else default_activation_limit(self.device)
        inputs = self.meter.peak  # the measured forward kept block inputs (and the embedding's indices) only
        if budget < inputs:
            log.warning("megatrain: recompute='auto': activation_memory_limit %s is below what the block inputs "
                        "alone keep (%s), which no policy drops: every block recomputes whole (as 'block'). Raise "
                        "the limit, or keep fewer inputs on the device (offload_activations=True, recompute_every=K).",
                        fmt_bytes(budget), fmt_bytes(inputs))
        self.choice = decide(m, max(budget - inputs, 0))
        self._budget, self._inputs = budget, inputs
        self._kept = {b: (m[b][c], m[b][c + "_sq"]) if c != "block" else (0, 0) for b, c in self.choice.items()}
        counts = {k: sum(v == k for v in self.choice.values()) for k in ("none", "selective", "block")}
        kept = sum(m[b][c] for b, c in self.choice.items() if c != "block")
        _log_once("megatrain: recompute='auto' with activation_memory_limit %s, from the next forward on (the first "
                 "training forward measured each block and recomputed it whole): %s (blocks none/selective/block: "
                 "%d/%d/%d; per forward: block inputs %s, op outputs %s)", fmt_bytes(budget),
                 ", ".join(f"{b}:{c}" for b, c in sorted(self.choice.items())), counts["none"], counts["selective"],
                 counts["block"], fmt_bytes(inputs), fmt_bytes(kept))
        self._measure = self._measured_fwd = None  # the measured forward's record (its calls, their graphs) is not kept
