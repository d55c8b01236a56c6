"""glibc ``malloc`` settings that keep a training process from holding on to the host memory it frees.

A streamed step allocates and frees the same large buffers again and again (each layer's activations, the
recompute's graph, the gradient batches). glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with
its own ``mmap`` and gives it back to the kernel on ``free``; but the threshold is dynamic: each such block freed
raises it to that block's size (up to 32 MiB on 64-bit), so the next buffers of that size come from the heap,
whose freed memory stays resident (fragmented, or in one of the per-thread arenas). Measured on the CPU device
(``bench/plan_vs_run.py``): these settings lower the peak RSS by up to 8% (``plan_vs_run_glibc_defaults.json`` is
the matrix without them). Allocations under the threshold still come from the heap and their freed space stays
there: the planner counts that on a CPU device (``planning/activations.py``, ``heap_keeps_layer_phase``).

:func:`bound_retention` sets those two with ``mallopt`` (``M_MMAP_THRESHOLD`` = 8 MiB, fixed: setting it turns
the dynamic adjustment off; ``M_ARENA_MAX`` = 2) when the strategy sets up, on glibc only, unless the environment
already sets ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` (glibc's own variables, which win) or
``MEGATRAIN_MALLOC_TUNING=0`` turns it off. Allocations of 8 MiB or more then cost an ``mmap``/``munmap`` each
(page faults on first touch): a few percent of a CPU step at most in the matrix of ``bench/plan_vs_run.py``.
Source: glibc ``malloc/malloc.c`` (``mallopt``, ``DEFAULT_MMAP_THRESHOLD_MAX``, the ``mp_.no_dyn_threshold``
flag) and mallopt(3).
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
    """This process's C library when it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``), else None
    (musl, macOS, Windows)."""
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
