"""Sample the process's RSS against the NVMe tier's HostBudget and glibc's heap, for bench/nvme.py.

Every ``every`` seconds a daemon thread records (seconds, RSS bytes, HostBudget.used bytes, glibc
``mallinfo2`` mmapped / arena / in-use / free bytes). RSS - budget is the memory the budget does not
count: the interpreter and libraries (~0.35 GiB), activations and autograd temporaries, and free
heap space glibc has not returned (see megatrain_lightning/store/heap.py).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from typing import Callable


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> Callable[[], tuple[int, int, int, int]]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return lambda: (0, 0, 0, 0)

    def get() -> tuple[int, int, int, int]:
        m = libc.mallinfo2()
        return m.hblkhd, m.arena, m.uordblks, m.fordblks

    return get


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemTrace:
    """``start()``, then ``stop()`` -> summary dict (GiB): RSS - budget over the samples taken in
    training (``get_phase()`` starting with "train", a budget live), and the phase at the peak RSS of
    the whole run (setup and teardown included)."""

    def __init__(self, get_budget: Callable[[], object], get_phase: Callable[[], str] = lambda: "", every: float = 0.05):
        self.get_budget, self.get_phase, self.every = get_budget, get_phase, every
        self.rows: list[tuple] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._mallinfo = _mallinfo()

    def start(self) -> "MemTrace":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            b = self.get_budget()
            self.rows.append((time.perf_counter() - t0, rss_bytes(), getattr(b, "used", 0), *self._mallinfo(),
                              self.get_phase()))
            time.sleep(self.every)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        if os.environ.get("MEMTRACE_OUT"):  # the whole timeline, for a closer look
            import json

            with open(os.environ["MEMTRACE_OUT"], "w") as f:
                json.dump(self.rows, f)
        live = [r for r in self.rows if r[2] > 0 and str(r[7]).startswith("train")]
        if not live:
            return {}
        g = 2**30
        over = [(r[1] - r[2]) / g for r in live]
        peak = max(self.rows, key=lambda r: r[1])
        worst = max(live, key=lambda r: r[1] - r[2])
        return {"rss_over_budget_median_gib": statistics.median(over), "rss_over_budget_max_gib": max(over),
                "at_max_over": {"phase": worst[7], "rss_gib": worst[1] / g, "budget_gib": worst[2] / g},
                "at_peak_rss": {"phase": peak[7], "rss_gib": peak[1] / g, "budget_gib": peak[2] / g,
                                "mmapped_gib": peak[3] / g, "arena_gib": peak[4] / g, "arena_in_use_gib": peak[5] / g}}
