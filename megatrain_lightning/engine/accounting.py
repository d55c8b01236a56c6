"""Per-step statistics and the live-byte accounting every part of the engine reports to.

The engine counts the bytes of the compute buffers (block weights on the device, their gradients
before they reach the host) it has alive at once. On CPU with the NVMe tier those buffers are host
memory, so the same counts are reserved in the :class:`~megatrain_lightning.store.budget.HostBudget`
that bounds everything the tier holds (docs/internals/nvme.md, "Window, read-ahead, write-behind").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..blocks import Block
from ..store.nvme import align_up



@dataclass
class StepStats:
    """Per-optimizer-step accounting (reset after each step).

    Attributes:
        h2d_bytes: bytes copied host -> device (weights and restored activations); what a CPU device
            binds or uses in place is not copied and not counted (``cpu_zero_copy``: 0 for ``32-true``).
        d2h_bytes: bytes copied device -> host (gradients and offloaded activations).
        wait_s: seconds the compute thread waited for weights or gradients (stall time).
        optimizer_s: seconds spent in AdamW updates (mostly on the H2D worker, overlapped).
        compute_s: seconds the compute thread spent inside block forward/backward calls, waits excluded.
        peak_device_bytes: CUDA: ``torch.cuda.max_memory_allocated`` since the previous step (the
            engine resets CUDA's peak statistics at every step: read them in ``on_before_optimizer_step``
            if you measure over several steps); CPU: peak bytes of block weight/gradient buffers
            the engine had alive at once.
        blocks_fetched: number of block fetches (forward + backward + evaluation).
        weight_transfers: fetches handed to the H2D worker: one per block fetch, or per block group
            (``block_group``: the consecutive members one fetch serves).
        prefetch_misses: fetches that were not prefetched (the compute thread had to start the copy).
        activation_restore_misses: offloaded block inputs whose H2D copy was not started one call ahead
            (``offload_activations``; the compute thread started it when backward needed it).
        activation_restored_peak_bytes: most bytes of restored (offloaded) block inputs alive at once.
        cast_s: seconds the H2D worker spent casting fp32 masters to the bf16/fp16 wire copies.
        d2h_queue_peak: most gradient batches queued for the D2H worker at once (bounded by the
            gradient sink's ``max_inflight``: each keeps its gradients on the device until copied).
        d2h_busy_s: seconds gradient copies device -> host were running (CUDA: between events recorded
            on the D2H stream around each copy; CPU: the conversion to the wire dtype, if any). They
            overlap the host adds of earlier batches (docs/architecture.md, "Engine layout").
        d2h_copy_wait_s: seconds the D2H worker waited for a gradient copy to finish before adding it
            (the copy time not hidden behind host adds; on CUDA it includes waiting for the block's
            backward that produces the gradients).
        grad_add_s: seconds the D2H worker spent adding gradients into the fp32 host accumulators.
        grad_reduce_s: data parallel with gloo: seconds the D2H worker spent averaging gradient batches
            over the ranks (``engine/reduce.py``; includes waiting for the slowest rank). NCCL reduces on
            the device, asynchronously: 0 there (the time shows in ``d2h_copy_wait_s``).
        recompute_s: seconds the compute thread spent recomputing block forwards in backward (part of
            ``compute_s``; with ``recompute="selective"``/``"none"`` kept op outputs are not recomputed).
        saved_activation_bytes: most bytes of activations kept on the device at once between forward
            and backward (saved block inputs that need gradients, plus op outputs the recompute
            policy keeps; offloaded ones excluded). Not counted: the graph the last block of a forward
            keeps until its backward right after (the LM head's logits, ``[B, T, V]``, when the loss is
            not chunked or the user computes it from ``out.logits``).
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    wait_s: float = 0.0
    optimizer_s: float = 0.0
    compute_s: float = 0.0
    peak_device_bytes: int = 0
    blocks_fetched: int = 0
    weight_transfers: int = 0
    prefetch_misses: int = 0
    activation_restore_misses: int = 0
    activation_restored_peak_bytes: int = 0
    cast_s: float = 0.0
    grad_reduce_s: float = 0.0
    d2h_queue_peak: int = 0
    d2h_busy_s: float = 0.0
    d2h_copy_wait_s: float = 0.0
    grad_add_s: float = 0.0
    recompute_s: float = 0.0
    saved_activation_bytes: int = 0

    def as_dict(self, prefix: str = "megatrain/") -> dict[str, float]:
        """The statistics as ``{prefix + name: float}``, what the strategy logs."""
        return {prefix + k: float(v) for k, v in self.__dict__.items()}


class ByteAccounting:
    """Live bytes of compute buffers and in-flight gradients, and the step's statistics.

    Args:
        reserve / unreserve: reserve and give back bytes in the host budget (CPU device with the NVMe
            tier, where the compute buffers are host memory: ``NVMeStore.reserve``, which evicts clean
            window buffers or waits, and ``HostBudget.release``), or ``None`` to count only.
        on_release: called after a block's buffers are released (CUDA: records the compute stream's
            progress, which bounds how far the H2D worker may run ahead).

    Thread-safe: the H2D and D2H workers report through it too; the step's statistics change only
    through :meth:`add` and :meth:`peak` (under the same lock), never by ``stats.x += ...``.
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
        """Count ``nbytes`` more (negative: fewer) live bytes; with a budget, reserve them first
        (may wait for room) or release them."""
        if self._reserve is not None and nbytes > 0:
            self._reserve(nbytes)
        elif self._unreserve is not None and nbytes < 0:
            self._unreserve(-nbytes)
        with self._lock:
            self.live += nbytes
            self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.live)

    def add(self, **deltas: float) -> None:
        """Add to the current step's statistics, e.g. ``add(h2d_bytes=n, cast_s=dt)`` (any thread).

        Raises:
            AttributeError: a name that is not a :class:`StepStats` field."""
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def peak(self, **values: float) -> None:
        """Raise the current step's statistics to at least ``values``, e.g. ``peak(d2h_queue_peak=2)``."""
        with self._lock:
            for k, v in values.items():
                setattr(self.stats, k, max(getattr(self.stats, k), v))

    def set(self, **values: float) -> None:
        """Set statistics of the current step (end-of-step figures: ``optimizer_s``, the CUDA peak)."""
        with self._lock:
            for k, v in values.items():
                getattr(self.stats, k)  # AttributeError for an unknown name, as add() and peak()
                setattr(self.stats, k, v)

    def release(self, bufs: dict[int, torch.Tensor]) -> None:
        """A block's buffers (slab index -> tensor) are no longer used by the compute thread."""
        self.track(-sum(b.numel() * b.element_size() for b in bufs.values()))
        bufs.clear()
        if self._on_release is not None:
            self._on_release()

    def saw_activations(self, nbytes: int) -> None:
        """``nbytes`` of activations are kept now (the step's ``saved_activation_bytes`` is the most seen)."""
        self.peak(saved_activation_bytes=nbytes)

    def new_step(self) -> None:
        """Start the statistics of the next optimizer step (peak starts at what is alive now)."""
        with self._lock:
            self.stats = StepStats(peak_device_bytes=self.live)


def compute_window_bytes(layout: Sequence[tuple[int, int]], blocks: Sequence[Block], lookahead: int) -> int:
    """Host bytes the engine's compute buffers take at most on a CPU device, where they share the NVMe
    tier's ``host_memory_limit``: the weights of ``lookahead + 3`` blocks (computing, prefetched, the
    last block kept for backward, one in backward), two gradient batches queued for the D2H worker
    (the gradient sink never queues more), a wire image (mixed precision: up to the fp32 size of
    the block), and the buffers and gradients of containers' own parameters (bound for the whole
    forward and backward).

    Args:
        layout: per slab, ``(numel, trainable numel)`` (fp32 elements)."""
    if not layout:
        return 0
    p = max(align_up(4 * n) for n, _ in layout)
    t = max(align_up(4 * t) for _, t in layout)
    direct = sum(8 * n for (n, _), b in zip(layout, blocks) if b.direct)
    return p * (lookahead + 3) + 2 * t + p + direct
