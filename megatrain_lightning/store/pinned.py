"""Page-locked (pinned) host memory whose size is exactly what was asked for, and an arena over it.

Not ``torch.empty(..., pin_memory=True)``: its caching allocator rounds to a power of two and keeps freed blocks
pinned (a 2.10 GB region pins 4 GiB; docs/internals/nvme.md, "Pinned memory"). Here an anonymous page-aligned
``mmap`` of the bytes wanted is registered with ``cudaHostRegister`` and unregistered when its last tensor view
dies. :class:`PinnedArena` carves one such allocation for the NVMe window and the H2D staging ring, so the bytes
pinned are fixed at start. ``RLIMIT_MEMLOCK`` does not limit CUDA's pinned memory: pinning is tried, never checked
against that limit.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
from typing import Callable

import torch

from .budget import fmt_bytes

log = logging.getLogger(__name__)

PAGE = 4096  # bytes: alignment of every buffer and sub-buffer (O_DIRECT, page size)
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class HostPinningError(RuntimeError):
    """Page-locking host memory failed (not enough free RAM to lock, or the container forbids it)."""


def page_up(n: int) -> int:
    return (int(n) + PAGE - 1) // PAGE * PAGE


def cuda_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``ptr`` through the CUDA driver (``cudaHostRegister``, portable).

    Raises:
        HostPinningError: the driver refused (the CUDA error's text is in the message)."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        # reset the CUDA runtime's last error (else PyTorch's next launch check reports it); best effort
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(name).cudaGetLastError()
                break
        raise HostPinningError(str(cudart.cudaGetErrorString(err)))


def cuda_unregister(ptr: int) -> None:
    """Undo :func:`cuda_register` (errors ignored: this runs while memory is being freed)."""
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(ptr)


# module-level so tests can replace them (CPU builds of torch cannot pin)
REGISTER: Callable[[int, int], None] = cuda_register
UNREGISTER: Callable[[int], None] = cuda_unregister


class _Mapping(mmap.mmap):
    """A mapping that unregisters its pages before they are unmapped (after its last tensor view is gone)."""

    pinned_ptr: int | None = None
    unregister: Callable[[int], None] | None = None

    def __del__(self) -> None:
        if self.pinned_ptr is not None and self.unregister is not None:
            self.unregister(self.pinned_ptr)
            self.pinned_ptr = None


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A page-aligned uint8 host tensor of ``page_up(nbytes)`` bytes, page-locked exactly when ``pin``; its
    memory returns to the system with its last view.

    Raises:
        HostPinningError: ``pin`` and the driver refused to lock the memory."""
    n = max(page_up(nbytes), PAGE)
    m = _Mapping(-1, n)
    t = torch.frombuffer(m, dtype=torch.uint8)
    if pin:
        try:
            REGISTER(t.data_ptr(), n)
        except Exception as err:
            raise HostPinningError(
                f"megatrain: page-locking {fmt_bytes(n)} of host memory (pinned memory for the NVMe window and "
                f"H2D/D2H staging) failed: {err}. The machine or container may not have that much free RAM to "
                "lock. Lower host_memory_limit, free host memory, or pass pin_memory=False (pageable host memory: "
                "H2D copies run synchronously, at pageable speed). ulimit -l does not apply to CUDA's pinned memory."
            ) from err
        m.pinned_ptr, m.unregister = t.data_ptr(), UNREGISTER
    return t


def shared_file_mapping(path: str, nbytes: int, pin: bool | None, create: bool = False) -> mmap.mmap:
    """A ``MAP_SHARED`` mapping of ``nbytes`` of the file ``path``, page-locked when ``pin`` (``None``: try, else
    warn and stay pageable). Each ``torch.frombuffer`` tensor over it has its own storage and version counter.
    ``create``: create the file (``O_EXCL``) and ``ftruncate`` it to ``nbytes`` (pages take memory only when written).

    Raises:
        FileExistsError: ``create`` and the file exists.
        HostPinningError: ``pin`` is ``True`` and the driver refused to lock the memory."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        m = _Mapping(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if pin:
        ptr = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
        try:
            REGISTER(ptr, page_up(nbytes))
        except Exception as err:
            msg = (f"megatrain: page-locking the node's shared training state ({fmt_bytes(nbytes)}) failed: {err}. "
                   "Free host memory or pass pin_memory=False (H2D copies then run at pageable speed).")
            if pin is True:
                raise HostPinningError(msg) from err
            log.warning("%s Using pageable memory.", msg)
            return m
        m.pinned_ptr, m.unregister = ptr, UNREGISTER
    return m


def try_host_buffer(nbytes: int, pin: bool | None, what: str) -> tuple[torch.Tensor, bool]:
    """:func:`host_buffer` with the ``pin_memory`` rule: ``True`` pins or raises, ``False`` never pins, ``None``
    pins or falls back to pageable memory with a warning. Returns ``(buffer, pinned)``.

    Raises:
        HostPinningError: ``pin is True`` and pinning failed."""
    if pin is False:
        return host_buffer(nbytes, False), False
    try:
        return host_buffer(nbytes, True), True
    except HostPinningError as err:
        if pin is True:
            raise
        log.warning("%s Using pageable memory for %s instead (pin_memory=None: pinning is tried, not required).",
                    err, what)
        return host_buffer(nbytes, False), False


class PinnedArena:
    """One host allocation of ``capacity`` bytes (pinned on CUDA) handing out page-aligned sub-buffers.

    Best fit over the free ranges; a freed sub-buffer merges with free neighbours. ``alloc``, ``free`` and the
    snapshot :meth:`eviction_plan` reads are under the arena's own lock.

    Args:
        capacity: bytes (rounded up to :data:`PAGE`).
        pin: ``True`` / ``False`` / ``None`` as in :func:`try_host_buffer`.

    Attributes:
        capacity: bytes of the allocation (what the process holds for the arena, pinned or not).
        pinned: whether it is page-locked.
        used / peak: bytes of live sub-buffers now / at most (page-rounded sizes).

    Raises:
        HostPinningError: ``pin is True`` and pinning failed.
    """

    def __init__(self, capacity: int, pin: bool | None = False):
        self.buf, self.pinned = try_host_buffer(page_up(capacity), pin, "the NVMe window")
        self.capacity = self.buf.numel()
        self._starts: list[int] = []  # sorted offsets of live sub-buffers
        self._size: dict[int, int] = {}  # offset -> bytes
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges ``(offset, bytes)`` in address order."""
        out, pos = [], 0
        for s in self._starts:
            if s > pos:
                out.append((pos, s - pos))
            pos = s + self._size[s]
        if pos < self.capacity:
            out.append((pos, self.capacity - pos))
        return out

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new sub-buffer of ``page_up(nbytes)`` bytes (best fit), or ``None`` if none fits."""
        n = page_up(nbytes)
        with self._lock:
            fits = [(size, off) for off, size in self.holes() if size >= n]
            if not fits:
                return None
            _, off = min(fits)
            bisect.insort(self._starts, off)
            self._size[off] = n
            self.used += n
            self.peak = max(self.peak, self.used)
            return off

    def free(self, off: int) -> None:
        """Return the sub-buffer at ``off`` (its neighbours' free ranges merge with it)."""
        with self._lock:
            n = self._size.pop(off)
            self._starts.pop(bisect.bisect_left(self._starts, off))
            self.used -= n

    def view(self, off: int, nbytes: int) -> torch.Tensor:
        """The uint8 tensor ``[nbytes]`` of the sub-buffer at ``off``."""
        return self.buf[off : off + nbytes]

    def eviction_plan(self, nbytes: int, cost: Callable[[int], float | None]) -> list[int] | None:
        """The cheapest set of live sub-buffers (offsets) whose freeing leaves a contiguous free range
        of ``page_up(nbytes)`` bytes, or ``None`` when none does.

        Args:
            cost: sub-buffer offset -> cost of freeing it, ``None`` if it cannot be freed now.
        """
        n = page_up(nbytes)
        with self._lock:
            starts = list(self._starts)
            sizes = dict(self._size)
        best: tuple[float, list[int]] | None = None
        costs = [cost(s) for s in starts]
        # candidate windows begin at 0 or right after a sub-buffer that stays, and grow over the following ones
        begins = [(0, 0)] + [(s + sizes[s], k + 1) for k, s in enumerate(starts)]
        for lo, k0 in begins:
            total, chosen, k = 0.0, [], k0
            while True:
                end = starts[k] if k < len(starts) else self.capacity
                if end - lo >= n:
                    if best is None or total < best[0]:
                        best = (total, list(chosen))
                    break
                if k >= len(starts) or costs[k] is None:
                    break
                total += costs[k]  # type: ignore[operator]
                chosen.append(starts[k])
                k += 1
        return best[1] if best is not None else None

    def close(self) -> None:
        """Drop the arena's own reference (the memory goes, and is unpinned, with the last view)."""
        self.buf = torch.empty(0, dtype=torch.uint8)
