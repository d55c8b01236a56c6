"""NVMe tier: per-block files on disk and a host-memory window bounded by ``host_memory_limit``.

One file per block, ``block_00012.bin``, of four regions, each at a 4 KiB boundary and padded to 4 KiB::

    master (fp32, slab numel) | exp_avg (fp32, trainable) | exp_avg_sq (fp32, trainable) | grad_accum (fp32, trainable)

Every window buffer is reserved in a :class:`~megatrain_lightning.store.budget.HostBudget` before it is allocated,
so the bytes held never exceed the limit. ``O_DIRECT``, the ``flock`` on ``LOCK``, eviction, read-ahead,
write-behind and faults (an ``OSError`` becomes :class:`NVMeIOError`; a failed write-behind is raised at the next
operation): docs/internals/nvme.md, "Files" and "Window, read-ahead, write-behind".
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import gc
import itertools
import logging
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from .budget import HostBudget, HostMemoryBudgetError, fmt_bytes
from .pinned import PinnedArena
from .regions import Region
from .shared import owners

log = logging.getLogger(__name__)

ALIGN = 4096  # bytes: O_DIRECT alignment of offsets, lengths and buffers
KINDS = (Region.master, Region.exp_avg, Region.exp_avg_sq, Region.grad_accum)
STORE_DIR = "megatrain_store"
KEPT = "kept"  # what LOCK holds after a clean close with keep_files (instead of the owner's pid)
IO_BLOCK_SIZE = 16 * 2**20  # bytes per request; measured: docs/benchmarks.md, "NVMe tier" (request size)
DISK_MARGIN = 0.05  # preflight: free disk must exceed the store's size by 5% + 1 GiB
DISK_MARGIN_BYTES = 2**30


class NVMeIOError(OSError):
    """A read or write of the NVMe store failed (the message names file, operation and offset)."""


class NVMeStoreLockedError(RuntimeError):
    """Another live run holds the store directory."""


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def store_bytes(layout: Sequence[tuple[int, int]]) -> int:
    """Disk bytes of a store for ``layout = [(slab numel, trainable numel), ...]`` (fp32, aligned regions)."""
    return sum(align_up(4 * n) + 3 * align_up(4 * t) for n, t in layout)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` (a multiple of 4096) whose data starts at a 4 KiB boundary
    (pageable: the O_DIRECT probe; window buffers come from the store's :class:`PinnedArena`)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off : off + nbytes]


# module-level so tests can inject faults (ENOSPC, EIO) without mounting a filesystem
def _pread(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


def _pwrite(fd: int, buf: memoryview, offset: int) -> int:
    return os.pwritev(fd, [buf], offset)


@dataclass
class IOMeter:
    """Bytes moved, and seconds with at least one transfer of a direction running: ``read_bytes / read_busy_s``
    is the achieved read throughput (concurrent transfers are not double counted); likewise for writes."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    io_busy_s: float = 0.0  # wall time with any transfer running (reads and writes share one disk)
    _active: dict = field(default_factory=lambda: {"read": [0, 0.0], "write": [0, 0.0], "io": [0, 0.0]})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def measure(self, op: str, nbytes: int) -> Iterator[None]:
        with self._lock:
            for k in (op, "io"):
                a = self._active[k]
                if a[0] == 0:
                    a[1] = time.perf_counter()
                a[0] += 1
        try:
            yield
        finally:
            with self._lock:
                now = time.perf_counter()
                for k in (op, "io"):
                    a = self._active[k]
                    a[0] -= 1
                    if a[0] == 0:
                        setattr(self, f"{k}_busy_s", getattr(self, f"{k}_busy_s") + now - a[1])
                setattr(self, f"{op}_bytes", getattr(self, f"{op}_bytes") + nbytes)  # op: "read" or "write"

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"nvme_read_bytes": self.read_bytes, "nvme_write_bytes": self.write_bytes,
                    "nvme_read_busy_s": self.read_busy_s, "nvme_write_busy_s": self.write_busy_s,
                    "nvme_io_busy_s": self.io_busy_s}


NVME_PATH_FROM_ENV = "$MEGATRAIN_NVME_PATH"  # nvme_path value meaning: read MEGATRAIN_NVME_PATH


@dataclass
class NVMeConfig:
    """Settings of the NVMe tier (built and checked by ``MegaTrainConfig``).

    Attributes:
        path: ``nvme_path``.
        kinds: regions on disk: ``Region.master`` (``offload_params="nvme"``), ``Region.exp_avg``, ``Region.exp_avg_sq``
            and ``Region.grad_accum`` (``offload_optimizer="nvme"``).
        host_memory_limit: bytes the host window (and, on CPU, the compute buffers) may use.
        io_threads: threads issuing read/write requests (the queue depth).
        io_block_size: bytes per request (a multiple of 4096).
        read_ahead: buffers read ahead at most at once.
        direct_io: ``"auto"``, ``True`` or ``False`` (see :class:`NVMeStore`).
        keep_files: keep the store's files after the run.
        store_dir: the store's directory under ``path`` (one per process of a data-parallel run).
        share: data parallel: ``(local rank, local ranks)``; this process stores the slabs it owns
            (``store.shared.owners``) and ``host_memory_limit`` is its share of the node's (:meth:`own`,
            :meth:`remote_files`). ``None``: one process, every slab.
        peer_dirs: with ``share``, the store directory (under ``path``) of each local rank of the node.
        run_dirs: the store directories of every process of this run, left alone by :func:`sweep_stale_stores`.
    """

    path: str
    kinds: frozenset
    host_memory_limit: int
    io_threads: int = 4
    io_block_size: int = IO_BLOCK_SIZE
    read_ahead: int = 4
    direct_io: bool | str = "auto"
    keep_files: bool = False
    store_dir: str = STORE_DIR
    share: tuple[int, int] | None = None
    peer_dirs: tuple[str, ...] = ()
    run_dirs: tuple[str, ...] = ()

    @property
    def ranks_sharing(self) -> int:
        """Processes of the node splitting its ``host_memory_limit`` (1: one process)."""
        return self.share[1] if self.share is not None else 1

    def own(self, layout: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``layout`` (per slab ``(numel, trainable numel)``) as this process stores it: with :attr:`share`, the
        slabs another local rank owns become ``(0, 0)``, or ``(numel, 0)`` with the masters on disk (read from
        the owner's file through this window)."""
        if self.share is None:
            return list(layout)
        rank, ranks = self.share
        masters = Region.master in self.kinds
        return [(n, t) if o == rank else (n if masters else 0, 0) for o, (n, t) in zip(owners(layout, ranks), layout)]

    def remote_files(self, layout: Sequence[tuple[int, int]]) -> dict[int, Path]:
        """With :attr:`share` and the masters on disk: slab index -> the block file of its owner (another local
        rank), whose master region this process reads. Empty otherwise."""
        if self.share is None or Region.master not in self.kinds:
            return {}
        rank, ranks = self.share
        return {i: block_file(Path(self.path) / self.peer_dirs[o], i)
                for i, o in enumerate(owners(layout, ranks)) if o != rank and layout[i][0]}  # an empty slab: no file

    def min_window(self, layout: Sequence[tuple[int, int]]) -> int:
        """Bytes the store's own regions of ``layout`` (per slab ``(numel, trainable numel)``) need in the host window
        at least: the largest slab's on-disk regions and one more accumulator being filled (the engine adds its own
        buffers, e.g. compute buffers on CPU)."""
        if not layout:
            return 0
        p = max(align_up(4 * n) for n, _ in layout)
        t = max(align_up(4 * t) for _, t in layout)
        need = p if Region.master in self.kinds else 0
        if Region.grad_accum in self.kinds:
            need += 4 * t  # exp_avg, exp_avg_sq, grad_accum of the update + the accumulator being filled
        return need + 2**16

    def window_bytes(self, layout: Sequence[tuple[int, int]], reserved: int = 0, staging: int = 0) -> int:
        """Bytes of the window's :class:`~megatrain_lightning.store.pinned.PinnedArena`: ``host_memory_limit``
        less ``reserved``, at most every on-disk region plus ``staging`` (more would never be used).

        Args:
            layout: per slab, ``(numel, trainable numel)``.
            reserved: bytes of the limit used outside the arena (CUDA: D2H staging; CPU: compute buffers).
            staging: bytes of the arena's buffers outside the cache at most (the engine's H2D staging ring)."""
        regions = sum((align_up(4 * n) if Region.master in self.kinds else 0)
                      + (3 * align_up(4 * t) if Region.grad_accum in self.kinds else 0) for n, t in layout)
        return max(0, min(self.host_memory_limit - reserved, regions + staging))


class _BackOff(Exception):
    """No contiguous range can open while the caller keeps its own buffers pinned (see ``_pin_all``)."""


@dataclass(slots=True, eq=False)
class _Entry:
    nbytes: int
    off: int  # byte offset of its buffer in the store's arena
    buf: torch.Tensor | None = None
    t: torch.Tensor | None = None
    pins: int = 0
    dirty: bool = False
    io: Future | None = None
    io_kind: str = ""
    last: int = 0
    stale: bool = False  # another process rewrote the file region: reload once no one uses the buffer


def block_file(directory: Path, i: int) -> Path:
    return directory / f"block_{i:05d}.bin"


def sweep_stale_stores(nvme_path: str | os.PathLike, keep: Iterable[str]) -> list[str]:
    """Remove the store directories (``megatrain_store*``) under ``nvme_path`` left by runs that did not finish
    (e.g. a killed 2-process run's ``megatrain_store_rank1``), other than ``keep`` (this run's own). A locked or kept
    (``keep_nvme_files=True``) one is left alone; several processes may sweep at once (the lock decides). Never
    raises: an unreadable directory is skipped. Returns the names removed; each is logged."""
    removed, keep = [], set(keep)
    for d in sorted(Path(nvme_path).glob(f"{STORE_DIR}*")):
        if d.name in keep or not d.is_dir():
            continue
        try:
            fd = os.open(d / "LOCK", os.O_RDWR)  # no O_CREAT: a directory another sweeper emptied is skipped
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run's
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip()
            if owner == KEPT:
                continue
            files = list(d.glob("block_*.bin"))
            with contextlib.suppress(OSError):
                for f in files:
                    f.unlink(missing_ok=True)
                (d / "LOCK").unlink(missing_ok=True)
                d.rmdir()
            log.warning("megatrain: removed the NVMe store %s, left by a run that did not finish (pid %s; %d files).",
                        d, owner or "?", len(files))
            removed.append(d.name)
        finally:
            os.close(fd)
    return removed


def probe_odirect(directory: Path) -> bool:
    """``True`` if ``directory``'s filesystem accepts ``O_DIRECT`` reads and writes of 4 KiB."""
    if not hasattr(os, "O_DIRECT"):
        return False
    p = directory / f".odirect_probe_{os.getpid()}"
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_empty(ALIGN)
        buf.fill_(7)
        mv = memoryview(buf.numpy())
        return os.pwritev(fd, [mv], 0) == ALIGN and os.preadv(fd, [mv], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            p.unlink()


class NVMeStore:
    """Per-block files plus the budgeted host window over them.

    Args:
        nvme_path: directory on the fast disk.
        layout: ``[(slab numel, trainable numel)]`` per block (elements, fp32).
        budget: the run's host budget (shared with the engine's compute buffers on CPU).
        io_threads, io_block_size, read_ahead, keep_files, store_dir: as :class:`NVMeConfig`'s.
        direct_io: ``"auto"`` (``O_DIRECT`` if the filesystem takes it), ``True`` (required) or ``False``.
        arena: the memory window buffers are carved from (default: a pageable one of ``min(budget.limit, every
            region's bytes)``).
        place_timeout_s: seconds a buffer may wait for a contiguous free range of the arena.
        remote: data parallel with the masters on disk: slab index -> its owner's block file, whose master is
            read (:meth:`open_remote`), never written; those slabs' other regions are empty here.

    Raises:
        NVMeStoreLockedError: another live process holds the store directory.
        OSError: the directory cannot be created, or ``direct_io=True`` and ``O_DIRECT`` is refused.
        NVMeIOError: the files cannot be allocated (ENOSPC included).
    """

    def __init__(self, nvme_path: str | os.PathLike, layout: Sequence[tuple[int, int]], budget: HostBudget, *,
                 io_threads: int = 4, io_block_size: int = IO_BLOCK_SIZE, read_ahead: int = 4, direct_io: bool | str = "auto",
                 keep_files: bool = False, arena: PinnedArena | None = None,
                 place_timeout_s: float = 300.0, store_dir: str = STORE_DIR, remote: dict[int, Path] | None = None):
        self.dir = Path(nvme_path) / store_dir
        self.remote = dict(remote or {})
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock()
        self.layout = list(layout)
        self.budget = budget
        self.cond = budget.cond
        self.keep_files = keep_files
        self.read_ahead_max = read_ahead
        self.meter = IOMeter()
        self.direct = direct_io in ("auto", True) and probe_odirect(self.dir)
        if direct_io is True and not self.direct:
            raise OSError(f"direct_io=True but the filesystem of {self.dir} refuses O_DIRECT; use direct_io='auto'.")
        if not self.direct and direct_io == "auto":
            log.warning("megatrain: %s does not support O_DIRECT; the NVMe store uses buffered I/O "
                        "(the page cache then holds extra copies outside host_memory_limit).", self.dir)
        self._off: list[dict[str, int]] = []
        self._nbytes: list[dict[str, int]] = []
        self._numel: list[dict[str, int]] = []
        for n, t in self.layout:
            numel = {k: n if k == Region.master else t for k in KINDS}
            sizes = {k: align_up(4 * numel[k]) for k in KINDS}
            self._off.append(dict(zip(KINDS, itertools.accumulate((sizes[k] for k in KINDS[:-1]), initial=0))))
            self._nbytes.append(sizes)
            self._numel.append(numel)
        self.valid: list[dict[str, bool]] = [{k: False for k in KINDS} for _ in self.layout]
        if arena is None:
            arena = PinnedArena(max(ALIGN, min(budget.limit, store_bytes(self.layout))))
        self.arena = arena
        self._at: dict[int, tuple[int, str]] = {}  # arena offset -> the entry whose buffer starts there
        self._place_timeout_s = place_timeout_s
        self.entries: dict[tuple[int, str], _Entry] = {}
        self._clock = itertools.count()
        self._protected: dict[tuple[int, str], int] = {}  # buffers the schedule wants -> rank (0: needed next)
        self._error: BaseException | None = None
        # region transfers (each waits for its requests) and the requests themselves (the disk's queue)
        self._io = ThreadPoolExecutor(max(1, io_threads) + read_ahead, thread_name_prefix="megatrain-nvme")
        self._req = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="megatrain-nvme-req")
        self.io_block_size = io_block_size
        self._fds: list[int] = []
        self.closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda st: st.close() if st is not None else None)(ref()))  # files go at exit
        try:
            for i in range(len(self.layout)):
                self._fds.append(self._create(i))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ files
    def _lock(self, collected: bool = False) -> int:
        lock = self.dir / "LOCK"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if owner == str(os.getpid()) and not collected:
                # an earlier run's store, dropped but not yet collected (reference cycles): collecting closes it,
                # which removes LOCK and the directory, so make them again and retry once
                gc.collect()
                self.dir.mkdir(parents=True, exist_ok=True)
                return self._lock(collected=True)
            if owner == str(os.getpid()):
                raise NVMeStoreLockedError(
                    f"megatrain: the NVMe store {self.dir} is still open in this process, by the strategy of an earlier "
                    "run (its store stays open after fit so that trainer.save_checkpoint works). Call "
                    "trainer.strategy.close() on that run first (after saving what you need), or give this run "
                    "another nvme_path."
                ) from None
            raise NVMeStoreLockedError(
                f"megatrain: the NVMe store {self.dir} is in use by another live run (pid {owner}). Give each run "
                "its own nvme_path, or wait for that run to end."
            ) from None
        old = os.pread(fd, 64, 0).decode(errors="replace").strip()
        stale = sorted(self.dir.glob("block_*.bin"))
        if stale and old == KEPT:
            log.warning("megatrain: the NVMe store %s holds files an earlier run kept (keep_nvme_files=True); "
                        "replacing them (%d files removed).", self.dir, len(stale))
        elif stale:
            log.warning("megatrain: the NVMe store %s was left by a run that did not finish (pid %s); resetting it "
                        "(%d files removed).", self.dir, old or "?", len(stale))
        for p in stale:
            p.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def open_remote(self) -> None:
        """Open the owners' files of :attr:`remote` read-only, once every owner wrote them (an open file stays
        readable after its owner removes it)."""
        for i, p in self.remote.items():
            if self._fds[i] < 0:
                self._fds[i] = os.open(p, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            self.valid[i][Region.master] = True

    def _create(self, i: int) -> int:
        size = sum(self._nbytes[i].values())
        if i in self.remote or not size:
            return -1  # open_remote; or nothing to store (no file)
        p = block_file(self.dir, i)
        fd = os.open(p, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0), 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            os.close(fd)
            raise NVMeIOError(err.errno, f"megatrain NVMe store: allocating {fmt_bytes(size)} for {p} failed: "
                              f"{os.strerror(err.errno or 0)}. Free disk space under {self.dir.parent} or "
                              "point nvme_path at a larger disk.") from err
        return fd

    def _transfer(self, op: str, i: int, kind: str, buf: torch.Tensor) -> None:
        """Move one region between ``buf`` and its file as requests of at most ``io_block_size`` bytes on the
        request threads; blocks until all are done, then raises the first failure (:class:`NVMeIOError`)."""
        if op == "write" and i in self.remote:
            raise RuntimeError(f"megatrain NVMe store: block {i}'s master belongs to another process; only its "
                               "owner writes it.")
        mv = memoryview(buf.numpy())
        n, step = len(mv), self.io_block_size
        with self.meter.measure(op, n):
            if n <= step:
                self._request(op, i, kind, mv, 0)
                return
            futs = [self._req.submit(self._request, op, i, kind, mv[lo : lo + step], lo) for lo in range(0, n, step)]
            err = None
            for f in futs:  # wait for all: a buffer must not be freed while a request still uses it
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001 - re-raised below, the first one
                    err = err or e
            if err is not None:
                raise err

    def _request(self, op: str, i: int, kind: str, mv: memoryview, start: int) -> None:
        """One ``pread``/``pwrite`` of ``mv`` at byte ``start`` of the region (looping on short transfers)."""
        fd, off = self._fds[i], self._off[i][kind] + start
        n, done = len(mv), 0
        while done < n:
            try:
                got = (_pread if op == "read" else _pwrite)(fd, mv[done:], off + done)
            except OSError as err:
                raise NVMeIOError(err.errno, f"megatrain NVMe store: {op} of {kind} of block {i} "
                                  f"({block_file(self.dir, i)}, offset {off + done}, {n - done} bytes) failed: "
                                  f"{os.strerror(err.errno or 0)}") from err
            if got <= 0:
                raise NVMeIOError(errno.EIO, f"megatrain NVMe store: {op} of {kind} of block {i} "
                                  f"({block_file(self.dir, i)}, offset {off + done}) returned {got} bytes")
            done += got

    # ------------------------------------------------------------------ window
    def region_bytes(self, i: int, kind: str) -> int:
        """Bytes of block ``i``'s ``kind`` region (and of its window buffer): 4 KiB-aligned fp32."""
        return self._nbytes[i][kind]

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def reserve(self, nbytes: int, what: str = "compute buffers") -> None:
        """Reserve ``nbytes`` of the budget for a buffer outside the window (CPU compute buffers), evicting clean
        window buffers first, else waiting.

        Raises:
            HostMemoryBudgetError: see :meth:`~megatrain_lightning.store.budget.HostBudget.reserve`."""
        self.budget.reserve(nbytes, self._make_room, what=what)

    def _make_room(self, missing: int, protect_all: bool = False) -> bool:
        """Evict unpinned clean buffers (under ``cond``); ``True`` if anything was freed."""
        self.raise_error()
        cands = [(k in self._protected, self._protected.get(k, 0), e.last, k) for k, e in self.entries.items()
                 if e.pins == 0 and not e.dirty and e.io is None]
        if protect_all:
            cands = [c for c in cands if not c[0]]
        # unprotected first (least recently used first), then protected ones, those needed last first
        cands.sort(key=lambda c: (c[0], -c[1] if c[0] else c[2]))
        freed = 0
        for _, _, _, k in cands:
            if freed >= missing:
                break
            freed += self._free(self.entries.pop(k))
        return freed > 0

    def _free(self, e: _Entry) -> int:
        """Give an entry's buffer back to the arena and its bytes to the budget (under ``cond``); returns them."""
        e.buf = e.t = None
        self._at.pop(e.off, None)
        self.arena.free(e.off)
        self.budget.release(e.nbytes)
        return e.nbytes

    def _evict_cost(self, off: int) -> float | None:
        """Cost of evicting the buffer at arena offset ``off``: its bytes, x1000 if the schedule wants it;
        ``None`` if it cannot go now (in use, dirty, in I/O, or not a window buffer)."""
        key = self._at.get(off)
        e = self.entries.get(key) if key is not None else None
        if e is None or e.pins or e.dirty or e.io is not None:
            return None
        return e.nbytes * (1000.0 if key in self._protected else 1.0)

    def _place(self, n: int, what: str, back_off: bool = False) -> int:
        """Reserve ``n`` bytes of the budget and return an arena offset for them (under ``cond``); on failure
        the bytes are released.

        When no free range fits, evicts the cheapest neighbours (:meth:`PinnedArena.eviction_plan`), else waits
        (with ``back_off``, raises :class:`_BackOff` instead).

        Raises:
            HostMemoryBudgetError: see :meth:`~megatrain_lightning.store.budget.HostBudget.reserve`; or no
                contiguous range opened for ``place_timeout_s`` seconds."""
        self.budget.reserve(n, self._make_room, what=what)
        deadline = time.monotonic() + self._place_timeout_s
        try:
            while True:
                self.raise_error()
                off = self.arena.alloc(n)
                if off is not None:
                    return off
                plan = self.arena.eviction_plan(n, self._evict_cost)
                if plan:
                    for o in plan:
                        self._free(self.entries.pop(self._at[o]))
                    continue
                if back_off:
                    raise _BackOff
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HostMemoryBudgetError(
                        f"megatrain: waited {self._place_timeout_s:.0f} s for a contiguous {fmt_bytes(n)} of the host "
                        f"window ({fmt_bytes(self.arena.capacity)}, {fmt_bytes(self.arena.used)} in use, fragmented by "
                        f"buffers in use) for {what}. Raise host_memory_limit or lower lookahead.")
                self.cond.wait(min(left, 0.5))
        except BaseException:
            self.budget.release(n)
            raise

    def alloc_staging(self, nbytes: int, what: str) -> tuple[int, torch.Tensor]:
        """A buffer of ``nbytes`` in the arena outside the cache (the H2D staging ring), reserved in the budget
        until :meth:`free_staging`; returns ``(offset, uint8 tensor [nbytes])``.

        Raises:
            HostMemoryBudgetError: it does not fit."""
        with self.cond:
            off = self._place(align_up(nbytes), what)
        return off, self.arena.view(off, nbytes)

    def free_staging(self, off: int, nbytes: int) -> None:
        """Return a buffer of :meth:`alloc_staging`."""
        with self.cond:
            self.arena.free(off)
            self.budget.release(align_up(nbytes))
            self.cond.notify_all()

    def _start_read(self, i: int, kind: str, e: _Entry, fresh: bool) -> None:
        """Allocate and fill ``e`` (caller reserved its bytes and set ``e.io``)."""
        try:
            buf = self.arena.view(e.off, e.nbytes)
            if self.valid[i][kind] and not fresh:
                self._transfer("read", i, kind, buf)
            elif not fresh:
                buf.zero_()  # never written: AdamW states and accumulators start at zero
            with self.cond:
                e.buf, e.t = buf, buf.view(torch.float32)[: self._numel[i][kind]]
                fut, e.io = e.io, None
                self.cond.notify_all()
            fut.set_result(None)  # type: ignore[union-attr]
        except BaseException as err:
            with self.cond:
                self.entries.pop((i, kind), None)
                self._free(e)
                fut, e.io = e.io, None
            fut.set_exception(err)  # type: ignore[union-attr]

    def _pin(self, i: int, kind: str, write: bool, fresh: bool, back_off: bool = False) -> torch.Tensor:
        key = (i, kind)
        while True:
            with self.cond:
                self.raise_error()
                e = self.entries.get(key)
                if e is None:
                    n = self._nbytes[i][kind]
                    off = self._place(n, f"{kind} of block {i}", back_off)
                    if key in self.entries:  # loaded by another thread while we waited
                        self.arena.free(off)
                        self.budget.release(n)
                        continue
                    e = self.entries[key] = _Entry(n, off)
                    self._at[off] = key
                    e.io, e.io_kind, e.pins, e.last = Future(), "read", 1, next(self._clock)
                    fut = e.io
                    break  # load it, outside the lock
                if e.stale:  # another process rewrote it: reload once the old buffer is free
                    if e.pins == 0 and e.io is None:
                        self._free(self.entries.pop(key))
                    else:
                        self.cond.wait(0.05)
                    continue
                fut = e.io
                if fut is None or not (e.io_kind == "read" or write):
                    e.pins += 1
                    e.last = next(self._clock)
                    return e.t  # type: ignore[return-value]
            # wait outside the lock, then look again (a failed read-ahead: load again; a persistent error resurfaces)
            with contextlib.suppress(BaseException):
                fut.result()  # type: ignore[union-attr]
        self._start_read(i, kind, e, fresh)
        fut.result()  # type: ignore[union-attr]
        return e.t  # type: ignore[return-value]

    def _unpin(self, i: int, kind: str, write: bool) -> None:
        with self.cond:
            e = self.entries[(i, kind)]
            e.pins -= 1
            if write:
                e.dirty = True
            if e.pins == 0 and e.dirty and e.io is None:
                e.io, e.io_kind = self._io.submit(self._write_back, i, kind, e), "write"
            elif e.pins == 0 and e.stale and e.io is None:
                self._free(self.entries.pop((i, kind)))
            self.cond.notify_all()

    def invalidate(self, i: int, kind: str) -> None:
        """Another process rewrote block ``i``'s ``kind`` (a :attr:`remote` master): drop its buffer now, or
        once it is free; the next hold reads the file again."""
        with self.cond:
            e = self.entries.get((i, kind))
            if e is None:
                return
            if e.pins == 0 and e.io is None:
                self._free(self.entries.pop((i, kind)))
            else:
                e.stale = True
            self.cond.notify_all()

    def wait_written(self, i: int, kind: str) -> None:
        """Block until block ``i``'s ``kind`` is on disk (data parallel: before the owner lets others read it).

        Raises:
            NVMeIOError: the write failed."""
        with self.cond:
            while True:
                self.raise_error()
                e = self.entries.get((i, kind))
                if e is None or (not e.dirty and e.io is None):
                    return
                self.cond.wait(0.05)

    def _write_back(self, i: int, kind: str, e: _Entry) -> None:
        try:
            self._transfer("write", i, kind, e.buf)  # type: ignore[arg-type]
            ok = True
        except BaseException as err:  # noqa: BLE001 - surfaced at the next operation
            ok = False
            with self.cond:
                if self._error is None:
                    self._error = err
        with self.cond:
            if ok:
                e.dirty = False
                self.valid[i][kind] = True
            e.io = None
            self.cond.notify_all()

    @contextlib.contextmanager
    def hold(self, i: int, kinds: Iterable[str], write: bool = False, fresh: Iterable[str] = ()) -> Iterator[dict[str, torch.Tensor]]:
        """Pin block ``i``'s ``kinds`` in host memory for the ``with`` body; arguments as
        :meth:`~megatrain_lightning.store.host.HostStore.hold`'s (``write``: written back when unpinned).

        Yields:
            kind -> fp32 host tensor ``[numel]``, valid until the body ends.

        Raises:
            NVMeIOError: a read failed now, or an earlier write-behind failed.
            HostMemoryBudgetError: the buffers never fit in ``host_memory_limit``.

        An empty region is an empty tensor outside the window (a 0-byte buffer would share the next one's offset).
        """
        kinds = tuple(kinds)
        got = self._pin_all(i, tuple(k for k in kinds if self._nbytes[i][k]), write, set(fresh))
        pinned = list(got)
        got.update({k: torch.zeros(0, dtype=torch.float32) for k in kinds if not self._nbytes[i][k]})
        try:
            yield got
        finally:
            for k in pinned:
                self._unpin(i, k, write)

    def _pin_all(self, i: int, kinds: tuple[str, ...], write: bool, fresh: set[str]) -> dict[str, torch.Tensor]:
        """Pin ``kinds`` of block ``i``; if the ones already pinned split the arena so a later one cannot be
        placed, let them go (nothing written yet), take them out of the window and place all again."""
        deadline = time.monotonic() + self._place_timeout_s
        while True:
            got: dict[str, torch.Tensor] = {}
            try:
                for k in kinds:
                    got[k] = self._pin(i, k, write, k in fresh, back_off=bool(got) and time.monotonic() < deadline)
                return got
            except BaseException as err:
                for k in got:
                    self._unpin(i, k, False)
                if not isinstance(err, _BackOff):
                    raise
                with self.cond:  # out of the window, so the retry places them anew
                    for k in got:
                        e = self.entries.get((i, k))
                        if e is not None and e.pins == 0 and not e.dirty and e.io is None:
                            self._free(self.entries.pop((i, k)))
                    self.cond.wait(0.05)

    def discard(self, i: int, kind: str) -> None:
        """Forget block ``i``'s ``kind`` buffer without writing it (a consumed gradient accumulator)."""
        with self.cond:
            e = self.entries.get((i, kind))
            if e is not None and e.pins == 0 and e.io is None:
                self._free(self.entries.pop((i, kind)))
                self.cond.notify_all()
            elif e is not None and e.io is None:
                e.dirty = False

    def read_ahead(self, wanted: Sequence[tuple[int, str]]) -> None:
        """Start reads of ``wanted`` (ordered by when needed) while they fit in free budget or clean unwanted
        buffers: read-ahead never waits and never evicts something needed sooner."""
        with self.cond:
            if self._error is not None or self.closed:
                return
            self._protected = {k: r for r, k in enumerate(wanted)}
            inflight = sum(1 for e in self.entries.values() if e.io is not None and e.io_kind == "read")
            for key in wanted:
                if inflight >= self.read_ahead_max:
                    break
                i, kind = key
                if key in self.entries or not self.valid[i][kind]:
                    continue
                n = self._nbytes[i][kind]
                if self.budget.free < n:
                    self._make_room(n - self.budget.free, protect_all=True)
                if not self.budget.try_reserve(n):
                    break
                off = self.arena.alloc(n)  # read-ahead never evicts for contiguity
                if off is None:
                    self.budget.release(n)
                    break
                e = self.entries[key] = _Entry(n, off)
                self._at[off] = key
                e.io, e.io_kind, e.last = Future(), "read", next(self._clock)
                self._io.submit(self._start_read, i, kind, e, False)
                inflight += 1

    def wait_io(self) -> None:
        """Block until no read or write is in flight; raise a failed write's error."""
        with self.cond:
            while any(e.io is not None for e in self.entries.values()):
                self.cond.wait(0.5)
        self.raise_error()

    def drop_clean(self) -> None:
        """Write back everything dirty, then free every unpinned buffer (shrinks the window to what is in use)."""
        self.wait_io()
        with self.cond:
            for key in [k for k, e in self.entries.items() if e.pins == 0 and not e.dirty and e.io is None]:
                self._free(self.entries.pop(key))
            self.cond.notify_all()

    def resident_bytes(self) -> int:
        with self.cond:
            return sum(e.nbytes for e in self.entries.values())

    # ------------------------------------------------------------------ teardown
    def close(self, wait: bool = True) -> None:
        """Stop I/O, free the window and (unless ``keep_files``) delete the files; release the lock.

        Args:
            wait: join the I/O threads (``False``: from a finalizer, where a join can deadlock; an unreachable
                store has no I/O queued, and its idle threads end on their own)."""
        if self.closed:
            return
        self.closed = True
        self._io.shutdown(wait=wait, cancel_futures=not wait)
        self._req.shutdown(wait=wait, cancel_futures=not wait)
        with self.cond:
            for e in list(self.entries.values()):
                self._free(e)
            self.entries.clear()
            self.cond.notify_all()
        self.arena.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        if not self.keep_files:
            for i in range(len(self.layout)):
                with contextlib.suppress(OSError):
                    block_file(self.dir, i).unlink()
        with contextlib.suppress(OSError):
            os.ftruncate(self._lock_fd, 0)
            if self.keep_files:
                os.pwrite(self._lock_fd, KEPT.encode(), 0)
        os.close(self._lock_fd)
        if not self.keep_files:
            with contextlib.suppress(OSError):
                (self.dir / "LOCK").unlink()
                self.dir.rmdir()

    def __del__(self):  # pragma: no cover - best effort
        # no join: a collection inside threading's bookkeeping (holding threading._shutdown_locks_lock) may run
        # this finalizer, and joining the I/O threads there deadlocks
        with contextlib.suppress(Exception):
            self.close(wait=False)


def preflight_nvme(nvme_path: str | os.PathLike, layout: Sequence[tuple[int, int]], host_memory_limit: int,
                   min_window: int, store_dir: str = STORE_DIR, ranks_sharing: int = 1) -> dict[str, int]:
    """Check, before any allocation, that the NVMe tier can run (docs/internals/nvme.md, "Preflight").

    Args:
        nvme_path: the store's parent directory.
        layout: ``[(slab numel, trainable numel)]`` per block.
        host_memory_limit: bytes (this process's share when ``ranks_sharing`` > 1).
        min_window: bytes the host window needs at least.
        store_dir: the store's directory under ``nvme_path``.
        ranks_sharing: processes of the node splitting its ``host_memory_limit``.

    Returns:
        ``{"disk_needed": ..., "disk_free": ..., "min_window": ...}`` (bytes).

    Raises:
        ValueError: with the numbers and what to change, when the path is missing or not a writable
            directory, the disk is too small, or the budget is below ``min_window``.
    """
    p = Path(nvme_path)
    if refusal := path_refusal(p):
        raise ValueError(refusal)
    need = store_bytes(layout)
    existing = sum(f.stat().st_size for f in (p / store_dir).glob("block_*.bin")) if (p / store_dir).is_dir() else 0
    free = shutil.disk_usage(p).free + existing
    want = int(need * (1 + DISK_MARGIN)) + DISK_MARGIN_BYTES
    if free < want:
        raise ValueError(
            f"nvme_path {p} has {fmt_bytes(free)} free; the NVMe store needs {fmt_bytes(need)} (16 bytes per trainable "
            f"parameter, 4 per frozen one) plus a margin of 5% + 1 GiB = {fmt_bytes(want)}. Free disk space or point "
            "nvme_path at a larger disk."
        )
    if refusal := window_refusal(host_memory_limit, min_window, ranks_sharing):
        raise ValueError(refusal)
    return {"disk_needed": need, "disk_free": free, "min_window": min_window}


def path_refusal(p: Path) -> str | None:
    """Why ``p`` cannot hold the NVMe store (missing, not a directory, read-only or not writable by this user), with
    what to do; ``None`` when it can (raised by :func:`preflight_nvme`, and by the recipes' checks before a run)."""
    if not p.exists():
        return f"nvme_path {p} does not exist. Create it (on a fast local disk) or point nvme_path elsewhere."
    if not p.is_dir():
        return f"nvme_path {p} is not a directory."
    if not os.access(p, os.W_OK | os.X_OK):
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return (f"nvme_path {p} is on a read-only filesystem (mounted ro): remount it read-write or choose another "
                    "path.")
        return f"nvme_path {p} is not writable by this user. Fix its permissions or choose another path."
    return None


def window_refusal(host_memory_limit: int, min_window: int, ranks_sharing: int = 1) -> str | None:
    """Why ``host_memory_limit`` (bytes; with ``ranks_sharing`` > 1 this process's share of the node's) is below
    ``min_window`` (bytes, the engine's ``engine/window.py`` ``window_sizes``), with what to set; ``None`` when it
    is not (raised by :func:`preflight_nvme`, reported by the planner)."""
    if host_memory_limit < min_window and ranks_sharing > 1:
        return (
            f"host_memory_limit is the node's, split between its {ranks_sharing} processes: this process's share, "
            f"{host_memory_limit} bytes ({fmt_bytes(host_memory_limit)}), is below the {min_window} bytes "
            f"({fmt_bytes(min_window)}) its NVMe window needs for the blocks in flight (the largest block it updates: "
            "gradients and AdamW states; its compute buffers on CPU). Raise host_memory_limit to at least "
            f"{min_window * ranks_sharing} bytes, or lower lookahead or block_group."
        )
    if host_memory_limit < min_window:
        return (
            f"host_memory_limit={host_memory_limit} bytes ({fmt_bytes(host_memory_limit)}) is below the {min_window} bytes "
            f"({fmt_bytes(min_window)}) the NVMe tier needs for the blocks in flight (the largest block's weights, "
            "gradients and AdamW states, and its compute buffers). Raise host_memory_limit to at least "
            f"{min_window} bytes (2x that lets read-ahead work), or lower lookahead or block_group."
        )
    return None
