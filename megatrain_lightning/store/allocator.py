"""glibc ``malloc`` settings that keep a training process from holding on to the host memory it frees.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, returned on ``free``, but
the threshold is dynamic: each such block freed raises it to that size (up to 32 MiB on 64-bit), so the next
buffers of that size come from the heap, whose freed memory stays resident (fragmented, or in per-thread arenas).
Source: glibc ``malloc/malloc.c`` (``mallopt``, ``DEFAULT_MMAP_THRESHOLD_MAX``, ``mp_.no_dyn_threshold``) and
mallopt(3).

:func:`bound_retention` sets ``M_MMAP_THRESHOLD`` = 8 MiB (fixed, which turns the dynamic adjustment off) and
``M_ARENA_MAX`` = 2, on glibc only, unless ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` (which win) are set or
``MEGATRAIN_MALLOC_TUNING=0``. Measured on the CPU device (``bench/plan_vs_run.py``; ``plan_vs_run_glibc_defaults.json``
is the matrix without them): peak RSS up to 8% lower, a few percent of a CPU step at most for the ``mmap``/``munmap``
of each allocation of 8 MiB or more. Freed space under the threshold stays in the heap: the planner counts it on a
CPU device (``planning/activations.py``, ``heap_keeps_layer_phase``).
"""

from __future__ import annotations

import ctypes
import os
import threading

M_MMAP_THRESHOLD = -3   # mallopt parameter numbers (glibc malloc.h)
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 8 * 2**20
ARENA_MAX = 2
ENV_OFF = "MEGATRAIN_MALLOC_TUNING"

_lock = threading.Lock()
_applied: dict[str, int] | None = None


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (AttributeError off glibc)
        libc.mallopt  # noqa: B018
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def bound_retention() -> dict[str, int]:
    """Set glibc's ``M_MMAP_THRESHOLD`` (8 MiB) and ``M_ARENA_MAX`` (2) for this process (module docstring), once.

    Returns:
        What was set, ``{"M_MMAP_THRESHOLD": bytes, "M_ARENA_MAX": arenas}`` (those the environment leaves
        unset); empty off glibc, with ``MEGATRAIN_MALLOC_TUNING=0``, or when ``mallopt`` refuses."""
    global _applied
    with _lock:
        if _applied is not None:
            return dict(_applied)
        out: dict[str, int] = {}
        libc = None if os.environ.get(ENV_OFF, "1").strip().lower() in ("0", "false", "no", "off") else glibc()
        if libc is not None:
            for name, param, value, env in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES,
                                             "MALLOC_MMAP_THRESHOLD_"),
                                            ("M_ARENA_MAX", M_ARENA_MAX, ARENA_MAX, "MALLOC_ARENA_MAX")):
                if env not in os.environ and libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
                    out[name] = value
        _applied = out
        return dict(out)
