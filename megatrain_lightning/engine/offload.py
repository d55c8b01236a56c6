"""Offloaded block inputs (``offload_activations=True``): to host memory in forward, back to the
device one block call ahead of backward.

A call that keeps its inputs keeps those that need gradients as :class:`Offloaded` host copies
(CUDA: pinned memory, copied on the D2H stream). Backward consumes them in descending call order
(each call's own backward, or the recompute chain of its segment, runs from the last call to the
first), so when a call's inputs are taken the engine starts the H2D copy of the next call's
(:meth:`ActivationOffload.prefetch`), which then overlaps this call's recompute and backward. The op
outputs a ``"selective"`` call keeps, offloaded too, are brought back the same way, one call ahead
(``ForwardRecord.next_saved_ops``, :meth:`~.saved_ops.SavedOps.prefetch`). On
CUDA the copy runs on the H2D stream after the D2H copy's event, records its own event, and the
compute stream waits on it when the input is taken (``record_stream`` tells the caching allocator
the buffer is used there). The CPU path runs the same bookkeeping (its "copy" is the host tensor).
The device therefore holds the restored inputs of at most two calls (the one in backward and the
next), whatever the depth: ``StepStats.activation_restore_misses`` counts inputs that had to be
copied on demand, ``activation_restored_peak_bytes`` the most restored bytes alive at once.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .accounting import ByteAccounting


@dataclass(eq=False)
class Offloaded:
    """One saved input in host memory: ``host`` (its copy), ``d2h`` (the D2H copy's event, CUDA),
    and while a restore is in flight ``device`` / ``h2d`` (the device copy and its event)."""

    host: torch.Tensor
    d2h: Any = None
    device: torch.Tensor | None = None
    h2d: Any = None

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class ActivationOffload:
    """Moves saved inputs to host memory and back, one call ahead.

    Args:
        transport: ``offload(t) -> (host, event)``, ``restore_async(host, event) -> (device, event)``,
            ``ready(device, event)`` (:mod:`.transport`).
        acct: the step statistics (bytes moved, restore misses, restored bytes peak).
    """

    def __init__(self, transport: Any, acct: ByteAccounting):
        self.transport, self.acct = transport, acct
        self._lock = threading.Lock()
        self._alive = 0  # bytes of restored inputs not yet released
        self._tracked: "weakref.WeakKeyDictionary[torch.Tensor, int]" = weakref.WeakKeyDictionary()

    def offload(self, t: torch.Tensor) -> Offloaded:
        """Start the D2H copy of ``t`` (a saved input); returns its record."""
        self.acct.add(d2h_bytes=t.numel() * t.element_size())
        host, ev = self.transport.offload(t)
        return Offloaded(host, ev)

    def prefetch(self, entries: Iterable[Offloaded]) -> None:
        """Start the H2D copies of ``entries`` not yet in flight (the next call's inputs)."""
        for e in entries:
            if e.device is None:
                self._start(e)

    def take(self, e: Offloaded, keep: bool = False) -> torch.Tensor:
        """The device copy of ``e`` for the compute stream (started now if it was not prefetched: a miss).
        Unless ``keep`` (a recompute chain: the call's own backward takes it again), the record drops its
        reference, so the copy is freed once the caller's use of it ends."""
        if e.device is None:
            self.acct.add(activation_restore_misses=1)
            self._start(e)
        dev, ev = e.device, e.h2d
        if not keep:
            e.device, e.h2d = None, None
        self.transport.ready(dev, ev)
        return dev

    def _start(self, e: Offloaded) -> None:
        e.device, e.h2d = self.transport.restore_async(e.host, e.d2h)
        if e.device is not e.host:  # a CPU device uses the host copy in place: nothing copied
            self.acct.add(h2d_bytes=e.nbytes)
        self._count(e.device, e.nbytes)

    def _count(self, t: torch.Tensor, nbytes: int) -> None:
        """Track ``nbytes`` of restored input alive until ``t`` is garbage (peak statistic)."""
        with self._lock:
            self._alive += nbytes
            alive = self._alive
        self.acct.peak(activation_restored_peak_bytes=alive)
        weakref.finalize(t, self._uncount, nbytes)

    def _uncount(self, nbytes: int) -> None:
        with self._lock:
            self._alive -= nbytes

