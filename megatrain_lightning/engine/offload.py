"""Offloaded block inputs (``offload_activations=True``): to host memory in forward, back to the
device one block call ahead of backward.

Backward takes the :class:`Offloaded` inputs in descending call order, so when a call's inputs are taken
the H2D copy of the next call's starts (:meth:`ActivationOffload.prefetch`) and overlaps this call's recompute
and backward; a ``"selective"`` call's kept op outputs come back the same way
(:meth:`~.saved_ops.SavedOps.prefetch`). The device holds the restored inputs of at most two calls, whatever
the depth. Streams and events: docs/internals/recompute.md, "Offloaded inputs".
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

    def offload(self, t: torch.Tensor) -> Offloaded:
        self.acct.add(d2h_bytes=t.numel() * t.element_size())
        host, ev = self.transport.offload(t)
        return Offloaded(host, ev)

    def prefetch(self, entries: Iterable[Offloaded]) -> None:
        """Start the H2D copies of ``entries`` not yet in flight (the next call's inputs)."""
        for e in entries:
            if e.device is None:
                self._start(e)

    def take(self, e: Offloaded, keep: bool = False) -> torch.Tensor:
        """The device copy of ``e`` for the compute stream (started now if not prefetched: a miss). Unless
        ``keep`` (a recompute chain: the call's own backward takes it again), the record drops its reference."""
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
        with self._lock:  # the restored bytes stay alive until the device copy is garbage (peak statistic)
            self._alive += e.nbytes
            alive = self._alive
        self.acct.peak(activation_restored_peak_bytes=alive)
        weakref.finalize(e.device, self._uncount, e.nbytes)

    def _uncount(self, nbytes: int) -> None:
        with self._lock:
            self._alive -= nbytes

