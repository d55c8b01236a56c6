"""Per-step statistics and the live bytes of compute buffers (block weights on the device, their gradients
before they reach the host). On CPU with the NVMe tier these are host memory, reserved in the
:class:`~megatrain_lightning.store.budget.HostBudget` (docs/internals/nvme.md, "Window, read-ahead, write-behind").
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..blocks import Block
from ..store.nvme import align_up


@dataclass
class StepStats:
    """Per-optimizer-step accounting (reset after each step); names ending in ``_s`` are seconds, ``_bytes`` bytes
    (the logged metrics: docs/guide/library.md)."""

    h2d_bytes: int = 0  # copied host -> device (weights, restored activations); not a CPU's in-place use (zero copy)
    d2h_bytes: int = 0  # copied device -> host (gradients and offloaded activations)
    wait_s: float = 0.0  # the compute thread waited for weights or gradients (stall time)
    optimizer_s: float = 0.0  # in AdamW updates (mostly on the H2D worker, overlapped)
    compute_s: float = 0.0  # the compute thread inside block forward/backward calls, waits excluded
    # CUDA: torch.cuda.max_memory_allocated since the previous step (reset every step: read it in
    # on_before_optimizer_step to measure over several); CPU: peak bytes of block weight/gradient buffers alive at once
    peak_device_bytes: int = 0
    blocks_fetched: int = 0  # block fetches (forward + backward + evaluation)
    weight_transfers: int = 0  # fetches handed to the H2D worker (one per block, or per block_group)
    prefetch_misses: int = 0  # fetches not prefetched (the compute thread started the copy)
    activation_restore_misses: int = 0  # offloaded block inputs whose H2D copy was not started one call ahead
    activation_restored_peak_bytes: int = 0  # most bytes of restored (offloaded) block inputs alive at once
    cast_s: float = 0.0  # the H2D worker casting fp32 masters to the bf16/fp16 wire copies
    # data parallel with gloo: the D2H worker averaging gradient batches over the ranks, slowest rank's wait included
    # (engine/reduce.py); NCCL: 0 (the time shows in d2h_copy_wait_s)
    grad_reduce_s: float = 0.0
    # most gradient batches queued for the D2H worker at once (at most the gradient sink's max_inflight; each keeps
    # its gradients on the device until copied)
    d2h_queue_peak: int = 0
    d2h_busy_s: float = 0.0  # gradient copies ran (CUDA: between events on the D2H stream; CPU: the wire dtype cast)
    # the D2H worker waited for a gradient copy before adding it (CUDA: includes waiting for the backward that
    # produces the gradients)
    d2h_copy_wait_s: float = 0.0
    grad_add_s: float = 0.0  # the D2H worker adding gradients into the fp32 host accumulators
    recompute_s: float = 0.0  # recomputing block forwards in backward (part of compute_s)
    # most activations kept on the device at once between forward and backward (saved block inputs needing
    # gradients, op outputs the recompute policy keeps; offloaded ones excluded). Not counted: the last block's
    # graph, kept until its backward right after (the LM head's [B, T, V] logits when the loss is not chunked)
    saved_activation_bytes: int = 0

    def as_dict(self, prefix: str = "megatrain/") -> dict[str, float]:
        """The statistics as ``{prefix + name: float}``, what the strategy logs."""
        return {prefix + k: float(v) for k, v in self.__dict__.items()}


class ByteAccounting:
    """Live bytes of compute buffers and in-flight gradients, and the step's statistics.

    Args:
        reserve / unreserve: reserve and give back bytes in the host budget (CPU + NVMe tier:
            ``NVMeStore.reserve``, which may evict or wait, and ``HostBudget.release``), or ``None`` to count only.
        on_release: called after a block's buffers are released (CUDA: records the compute stream's
            progress, which bounds how far the H2D worker may run ahead).

    Thread-safe: the statistics change only through :meth:`add` / :meth:`peak` / :meth:`set` (one lock),
    never by ``stats.x += ...``.
    """

    def __init__(self, reserve: Callable[[int], None] | None = None, unreserve: Callable[[int], None] | None = None,
                 on_release: Callable[[], None] | None = None):
        self._reserve, self._unreserve = reserve, unreserve
        self._on_release = on_release
        self.live = 0  # bytes counted now
        self._lock = threading.Lock()
        self.stats = StepStats()
        self.history: list[dict[str, float]] = []

    def track(self, nbytes: int) -> None:
        """Count ``nbytes`` more (negative: fewer) live bytes; with a budget, reserve (may wait) or release."""
        if self._reserve is not None and nbytes > 0:
            self._reserve(nbytes)
        elif self._unreserve is not None and nbytes < 0:
            self._unreserve(-nbytes)
        with self._lock:
            self.live += nbytes
            self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.live)

    def _update(self, values: dict[str, float], fn: Callable[[float, float], float]) -> None:
        """``stats.k = fn(stats.k, v)`` for each ``k=v`` (any thread).

        Raises:
            AttributeError: a name that is not a :class:`StepStats` field."""
        with self._lock:
            for k, v in values.items():
                setattr(self.stats, k, fn(getattr(self.stats, k), v))

    def add(self, **deltas: float) -> None:
        """Add to the current step's statistics, e.g. ``add(h2d_bytes=n, cast_s=dt)``."""
        self._update(deltas, operator.add)

    def peak(self, **values: float) -> None:
        """Raise the current step's statistics to at least ``values``, e.g. ``peak(d2h_queue_peak=2)``."""
        self._update(values, max)

    def set(self, **values: float) -> None:
        """Set statistics of the current step (end-of-step figures: ``optimizer_s``, the CUDA peak)."""
        self._update(values, lambda old, new: new)

    def release(self, bufs: dict[int, torch.Tensor]) -> None:
        """A block's buffers (slab index -> tensor) are no longer used by the compute thread."""
        self.track(-sum(b.numel() * b.element_size() for b in bufs.values()))
        bufs.clear()
        if self._on_release is not None:
            self._on_release()

    def new_step(self) -> None:
        """Start the statistics of the next optimizer step (peak starts at what is alive now)."""
        with self._lock:
            self.stats = StepStats(peak_device_bytes=self.live)


def compute_window_bytes(layout: Sequence[tuple[int, int]], blocks: Sequence[Block], lookahead: int) -> int:
    """Most host bytes of the engine's compute buffers on a CPU device (they share the NVMe tier's
    ``host_memory_limit``): the weights of ``lookahead + 3`` blocks (computing, prefetched, last one kept
    for backward, one in backward), two gradient batches (the sink's limit), a wire image (up to fp32 size),
    and the buffers and gradients of containers' own parameters (bound for the whole step).

    Args:
        layout: per slab, ``(numel, trainable numel)`` (fp32 elements)."""
    if not layout:
        return 0
    p = max(align_up(4 * n) for n, _ in layout)
    t = max(align_up(4 * t) for _, t in layout)
    direct = sum(8 * n for (n, _), b in zip(layout, blocks) if b.direct)
    return p * (lookahead + 3) + 2 * t + p + direct
