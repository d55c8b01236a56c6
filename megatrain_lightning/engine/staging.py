"""The H2D staging ring: wire images of on-disk masters, cast on the H2D worker into slots of the window's pinned
arena, each given back when its copy's event completes (docs/internals/nvme.md, "Masters to the device").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..store.pinned import page_up

RING_SLOTS = 2  # casts in flight: one being copied while the next is cast (double buffering)
_RUN_PAD = 16  # bytes: a wire image pads each run to this (wire.py's _ALIGN)


def ring_bytes_bound(slabs: list[tuple[int, int]], slots: int = RING_SLOTS) -> int:
    """Most bytes the ring holds at once: ``slots`` page-rounded images of the largest slab at 4 bytes per element
    plus a run's padding per entry (a mixed image is never larger). ``slabs``: per slab, ``(numel, entries)``."""
    return slots * max((page_up(4 * n + _RUN_PAD * k) for n, k in slabs), default=0)


@dataclass
class Slot:
    """One staging buffer in flight: ``raw`` is its uint8 memory ``[nbytes]``; ``key`` what gives it back."""

    key: object
    raw: torch.Tensor
    nbytes: int
    seq: int


class StagingRing:
    """At most ``slots`` staging buffers in flight, each given back once its copy's event completed.

    Args:
        alloc: ``nbytes -> (key, uint8 tensor [nbytes])``, counted in the host budget; may wait for room.
        free: ``(key, nbytes) -> None``: gives it back.
        when_done: ``(event, fn) -> None``: runs ``fn`` once ``event`` completed (the transport's).

    Attributes:
        acquired / released: slots handed out / given back, in order (their ``seq``), for tests and stats.
        peak_inflight: most slots in flight at once.
    """

    def __init__(self, alloc: Callable[[int], tuple[object, torch.Tensor]], free: Callable[[object, int], None],
                 when_done: Callable[[object, Callable[[], None]], None], slots: int = RING_SLOTS):
        if slots < 1:
            raise ValueError(f"a staging ring needs at least 1 slot, got {slots}.")
        self._alloc, self._free, self._when_done = alloc, free, when_done
        self.slots = slots
        self._cond = threading.Condition()
        self._inflight = 0
        self._seq = 0
        self.acquired: list[int] = []
        self.released: list[int] = []
        self.peak_inflight = 0

    def acquire(self, nbytes: int) -> Slot:
        """A staging buffer of ``nbytes``; waits while ``slots`` are in flight (their copies still run)."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight < self.slots)
            self._inflight += 1
            self.peak_inflight = max(self.peak_inflight, self._inflight)
            seq = self._seq
            self._seq += 1
        try:
            key, raw = self._alloc(nbytes)
        except BaseException:
            self._done()
            raise
        with self._cond:
            self.acquired.append(seq)
        return Slot(key, raw, nbytes, seq)

    def release_after(self, slot: Slot, event: object) -> None:
        """Give ``slot`` back once ``event`` completed (``None``: now)."""
        def give_back() -> None:
            try:
                self._free(slot.key, slot.nbytes)
                with self._cond:
                    self.released.append(slot.seq)
            finally:
                self._done()  # the slot counts as free even if giving its bytes back failed: never a hang

        self._when_done(event, give_back)

    def _done(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    @property
    def inflight(self) -> int:
        with self._cond:
            return self._inflight
