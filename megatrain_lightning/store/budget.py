"""Strict host-memory accounting for the NVMe tier (``host_memory_limit``).

Every host buffer the NVMe tier holds (window buffers and, on CPU, the compute buffers) is reserved here before it
is allocated and released after it is freed; a reservation that does not fit waits, never overshoots
(docs/internals/nvme.md, "Window, read-ahead, write-behind").
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``"16GiB"``, ``"1.5 GB"``, ``2**30`` -> bytes (int). KiB..TiB are powers of 1024; KB..TB and bare K, M, G, T
    powers of 1000; case is ignored.

    Raises:
        ValueError: not a positive, finite size (``inf``/``nan`` are not "no limit"), or an unknown unit.
    """
    if isinstance(value, bool):
        raise ValueError(f"Not a memory size: {value!r}.")
    if isinstance(value, (int, float)):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"Not a memory size: {value!r}. Write it as bytes or with a unit, e.g. '16GiB' or '500MB'.")
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if isinstance(size, float) and not math.isfinite(size):
        raise ValueError(f"A memory size must be a finite number of bytes, got {value!r}. Give a size such as "
                         "'16GiB', or leave the option unset for its default.")
    n = int(size)
    if n <= 0:
        raise ValueError(f"A memory size must be positive, got {value!r}.")
    return n


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class HostMemoryBudgetError(RuntimeError):
    """A reservation can never be satisfied (larger than the limit, or every byte held for too long)."""


class HostBudget:
    """Byte counter with a hard limit, shared by the threads of one engine.

    Args:
        limit: the most bytes reserved at any time (``host_memory_limit``).

    Attributes:
        used: bytes reserved now.
        peak: the most bytes ever reserved at once (for benchmarks and tests).
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.used = 0
        self.peak = 0
        self.cond = threading.Condition(threading.RLock())

    @property
    def free(self) -> int:
        return self.limit - self.used

    def try_reserve(self, n: int) -> bool:
        """Reserve ``n`` bytes if they fit now; never waits."""
        with self.cond:
            if self.used + n > self.limit:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def reserve(self, n: int, make_room=None, timeout_s: float = 300.0, what: str = "a buffer") -> None:
        """Reserve ``n`` bytes, calling ``make_room(missing_bytes)`` (may evict) and waiting while they do not fit.

        Raises:
            HostMemoryBudgetError: ``n`` exceeds the limit, or they did not fit within ``timeout_s`` seconds.
        """
        if n > self.limit:
            raise HostMemoryBudgetError(
                f"megatrain: {what} needs {fmt_bytes(n)} but host_memory_limit is {fmt_bytes(self.limit)}. "
                "Raise host_memory_limit."
            )
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not self.try_reserve(n):
                if make_room is not None and make_room(self.used + n - self.limit):
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HostMemoryBudgetError(
                        f"megatrain: waited {timeout_s:.0f} s for {fmt_bytes(n)} of host memory for {what}; "
                        f"{fmt_bytes(self.used)} of host_memory_limit={fmt_bytes(self.limit)} stay in use. "
                        "Raise host_memory_limit or lower lookahead."
                    )
                self.cond.wait(min(left, 0.5))

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            assert self.used >= 0, "host budget released more than it reserved"
            self.cond.notify_all()


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or ``None`` where the file is unreadable (not Linux)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file reports kB (KiB)
    except OSError:
        return None
    return None


def physical_ram_bytes() -> int:
    """This machine's physical RAM (``SC_PHYS_PAGES`` x ``SC_PAGE_SIZE``), the base of the default limit (half)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def above_ram(limit: int, ram: int, where: str) -> str | None:
    """Why a ``host_memory_limit`` of ``limit`` bytes (the node's) above the ``ram`` bytes of physical RAM of
    ``where`` (``"this machine"``, ``"the preset h200"``) bounds nothing, with what to set; ``None`` when it is not
    above (warned by the strategy's options and by the planner)."""
    if limit <= ram:
        return None
    return (f"host_memory_limit={limit} bytes ({limit / 2**30:,.2f} GiB) is more than the {ram / 2**30:,.1f} GiB of "
            f"physical RAM of {where}: the NVMe tier's window would never be bounded by it and the machine would "
            f"swap or kill the run first; set host_memory_limit below the RAM (the default is half of it)")
