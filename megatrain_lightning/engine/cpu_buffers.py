"""Reused compute buffers for a CPU device that copies (``cpu_zero_copy=False``), as CUDA's caching
allocator reuses device memory.

A fetch on a CPU device that copies allocates a buffer per slab. glibc maps every allocation above
its mmap threshold (at most 32 MiB) afresh and unmaps it when freed, so each fetch of a large block
page-faults all of its memory again: 40 ms per fetch of SmolLM2-135M's 113 MB tied embedding on the
2-core development machine (two per step), against 8.5 ms for the copy itself (measured with a
per-phase timer around ``WeightFetcher.fetch``). On CUDA the caching allocator hands a freed block of
device memory to the next fetch of the same size without any such cost; :class:`BufferPool` does the
same for the CPU "device", so the emulation pays for the copy, not for the allocation.

A pooled buffer is handed out as a view; it is free again when no tensor or storage object refers to
its memory besides the pool's own tensor: torch's use count of the storage
(``torch._C._storage_Use_Count``, checked against torch 2.13 by tests/test_cpu_buffers.py) is back at
the value it had when the pool made it. Views of views, autograd's saved tensors and storage objects
all hold a use, so a buffer still read anywhere is never handed out again.
"""

from __future__ import annotations

import threading

import torch


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferPool:
    """Host buffers by ``(numel, dtype)``, reused once nothing refers to them (module docstring).

    The pool keeps every buffer it made (at most as many of one size as were in use at once: the
    compute window, a few blocks), for the engine's lifetime. Thread-safe (the H2D worker takes, the
    compute thread drops its views).
    """

    def __init__(self):
        # (numel, dtype) -> every buffer made, with its storage use count when nothing else refers to it
        self._bufs: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``dtype`` (shape ``[numel]``, contents undefined): a
        pooled one nothing refers to any more, or a new one."""
        key = (numel, dtype)
        with self._lock:
            bufs = self._bufs.setdefault(key, [])
            for base, idle in bufs:
                if _storage_uses(base) == idle:
                    return base.view(numel)
            base = torch.empty(numel, dtype=dtype)
            bufs.append((base, _storage_uses(base)))
            return base.view(numel)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (in use or not)."""
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._bufs.values() for b, _ in bufs)
