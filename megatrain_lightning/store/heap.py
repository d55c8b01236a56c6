"""Keep the C heap from holding freed memory outside ``host_memory_limit`` (glibc only).

The host budget (:mod:`.budget`) counts the buffers the NVMe tier and, on CPU, the compute path
allocate, but freed memory only leaves the process if the C allocator gives it back. glibc does
not, by default, for the sizes a training step uses:

- its mmap threshold is *dynamic*: after a freed mmapped chunk it rises to that chunk's size, up
  to 32 MiB, so later tensors below 32 MiB (a 2048 x 2048 fp32 weight gradient is 16 MiB) come
  from the heap arenas instead of their own mappings;
- each thread that allocates gets an arena (up to 8 per core), and freed space in the middle of
  an arena stays resident until ``malloc_trim``.

Measured with ``bench/nvme.py`` (2.55B Llama, host_memory_limit 5.89 GiB, 2 cores): the arenas
held 1.2-1.9 GiB of resident free space during training (``mallinfo2``: arena 3.7 GiB, in use
0.2-0.7 GiB), which made peak RSS vary between 7.06 and 8.06 GiB from run to run. With a fixed
8 MiB threshold and at most 2 arenas, the arenas stay at 0.45 GiB and peak RSS at 7.15 GiB, with
the same compute time (57.5-58.1 s per step against 57.0-61.5 s). A 1 MiB threshold also maps the
2-6 MiB activations of that model and slowed compute by 20%.
"""

from __future__ import annotations

import logging

from .allocator import bound_retention, glibc

log = logging.getLogger(__name__)


def bound_heap() -> bool:
    """Make freed memory of at least ``allocator.MMAP_THRESHOLD_BYTES`` return to the OS at once, share at most
    ``allocator.ARENA_MAX`` arenas between threads (:func:`.allocator.bound_retention`, which the strategy also
    applies at setup; glibc's own environment variables win), and give back the free heap space there is now.

    Process-wide; called once by the engine when a ``host_memory_limit`` is in force. Returns ``False`` (and
    changes nothing) where the C library is not glibc (musl, macOS): there peak RSS may exceed the budget by more
    than measured here.
    """
    if glibc() is None:
        log.info("megatrain: not glibc; freed heap memory may stay resident beyond host_memory_limit.")
        return False
    bound_retention()
    trim()
    return True


def trim() -> None:
    """Return free heap pages of every arena to the OS (``malloc_trim(0)``; a no-op without glibc)."""
    lib = glibc()
    if lib is not None:
        lib.malloc_trim(0)
