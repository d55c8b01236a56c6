"""Reused compute buffers for a CPU device that copies (``cpu_zero_copy=False``), as CUDA's caching
allocator reuses device memory.

glibc maps every allocation above its mmap threshold (at most 32 MiB) afresh, so each fetch of a large
block page-faults all of its memory again: 40 ms per fetch of SmolLM2-135M's 113 MB tied embedding on the
2-core development machine, against 8.5 ms for the copy (per-phase timer around ``WeightFetcher.fetch``).

A pooled buffer is handed out as a view and is free again when torch's storage use count
(``torch._C._storage_Use_Count``, checked against torch 2.13 by tests/test_cpu_buffers.py) is back at its
value when the pool made it: views, autograd's saved tensors and storage objects all hold a use.
"""

from __future__ import annotations

import threading

import torch


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferPool:
    """Host buffers by ``(numel, dtype)``, reused once nothing refers to them (module docstring).

    Keeps every buffer it made (per size, at most as many as were in use at once) for the engine's
    lifetime. Thread-safe (the H2D worker takes, the compute thread drops its views).
    """

    def __init__(self):
        # (numel, dtype) -> every buffer made, with its storage use count when nothing else refers to it
        self._bufs: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``[numel]`` buffer of ``dtype``, contents undefined: a free pooled one, or a new one."""
        with self._lock:
            bufs = self._bufs.setdefault((numel, dtype), [])
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
