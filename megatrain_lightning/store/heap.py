"""Keep the C heap from holding freed memory outside ``host_memory_limit`` (glibc only).

The host budget (:mod:`.budget`) counts buffers, but freed memory leaves the process only if glibc gives it back,
which by default it does not for a step's sizes (dynamic mmap threshold: :mod:`.allocator`; an arena per thread,
up to 8 per core, whose freed space stays resident until ``malloc_trim``).

Measured with ``bench/nvme.py`` (2.55B Llama, host_memory_limit 5.89 GiB, 2 cores): the arenas held 1.2-1.9 GiB
of resident free space (``mallinfo2``: arena 3.7 GiB, in use 0.2-0.7 GiB), peak RSS 7.06-8.06 GiB from run to run.
With a fixed 8 MiB threshold and at most 2 arenas: arenas 0.45 GiB, peak RSS 7.15 GiB, same compute time
(57.5-58.1 s per step against 57.0-61.5 s). A 1 MiB threshold also maps that model's 2-6 MiB activations and
slowed compute by 20%.
"""

from __future__ import annotations

import logging

from .allocator import bound_retention, glibc

log = logging.getLogger(__name__)


def bound_heap() -> bool:
    """:func:`.allocator.bound_retention`, then :func:`trim`. Process-wide; called once by the engine when a
    ``host_memory_limit`` is in force. Returns ``False`` (changing nothing) off glibc, where peak RSS may exceed the
    budget by more than measured here.
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
