"""One copy of the training state per node: the host store's regions in shared memory, and who updates them.

With several processes on a node, the fp32 master, accumulator and both moments (16 bytes/param) are allocated
once per node in a ``MAP_SHARED`` file under ``/dev/shm``, unlinked once every local rank mapped it. Each slab has
one *owner* local rank (:func:`owners`) that adds its reduced gradients and applies its update; the others keep
the same bookkeeping, skip the tensor work, and wait for the owner's update (:meth:`SlabOwnership.wait`) before
reading the master. Ordering: docs/architecture.md, "Several GPUs and nodes"; docs/internals/data-parallel.md.

Layout of the file (fp32 elements, each slab's regions contiguous, 64-byte aligned): per slab ``master[numel]``,
``grad_accum[t]``, ``exp_avg[t]``, ``exp_avg_sq[t]`` (``t`` = trainable numel), then one int64 update count per
slab.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from .budget import fmt_bytes
from .pinned import shared_file_mapping

_ALIGN = 16  # fp32 elements (64 bytes)
_PAGE = mmap.PAGESIZE


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def shared_state_bytes(layout: Sequence[tuple[int, int]]) -> int:
    """Bytes of the shared file for slabs ``layout = [(numel, trainable numel)]`` (module docstring's layout)."""
    return 4 * sum(_round(n) + 3 * _round(t) for n, t in layout) + 8 * len(layout)


class SharedMemoryTooSmall(RuntimeError):
    """The shared-memory filesystem cannot hold the node's training state."""


def check_shm(nbytes: int, directory: str = "/dev/shm") -> None:
    """Preflight: ``directory`` (a tmpfs) has ``nbytes`` free.

    Raises:
        SharedMemoryTooSmall: with the numbers and what to change.
    """
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise SharedMemoryTooSmall(
            f"megatrain: the node's training state needs {fmt_bytes(nbytes)} of shared memory in {directory}, "
            f"which has {fmt_bytes(free)} free (of {fmt_bytes(st.f_blocks * st.f_frsize)}). Enlarge it "
            "(docker run --shm-size=..., or mount -o remount,size=... /dev/shm), or train on one device per node.")


@dataclass
class SharedRegions:
    """The mapped shared file of a node: flat fp32 views per slab and the update counts.

    Attributes:
        path: the file (already unlinked once every local rank mapped it).
        writer: this process writes the initial weights (local rank 0); the others only map.
    """

    path: str
    writer: bool
    _mapping: mmap.mmap
    _offsets: list[tuple[int, int, int]]  # per slab: offset, numel, trainable numel (elements)
    counts: torch.Tensor  # int64 [n_slabs], in the same mapping
    _fd: int = -1  # read-only descriptor of the file, kept for copy-on-write mappings once it is unlinked

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @classmethod
    def map(cls, path: str, layout: Sequence[tuple[int, int]], create: bool, pin: bool | None = False) -> "SharedRegions":
        """Map (``create``: create and ``ftruncate``, pages taking memory only when written) the file for
        ``layout``; ``pin``: page-lock the mapping (``None``: try, pageable with a warning if that fails).

        Raises:
            FileExistsError: ``create`` and the file exists (another run's name).
            HostPinningError: ``pin`` is ``True`` and the driver refused."""
        m = shared_file_mapping(path, shared_state_bytes(layout), pin, create)
        fd = os.open(path, os.O_RDONLY)
        offsets, off = [], 0
        for n, t in layout:
            offsets.append((off, n, t))
            off += _round(n) + 3 * _round(t)
        counts = torch.frombuffer(m, dtype=torch.int64, count=len(layout), offset=4 * off) if layout else \
            torch.zeros(0, dtype=torch.int64)
        return cls(path, create, m, offsets, counts, fd)

    def private_mapping(self) -> mmap.mmap:
        """A copy-on-write (``MAP_PRIVATE``) mapping of the whole file, for :meth:`region`'s ``mapping``.

        Unwritten pages show the file (later writes of other processes included); this process's writes go to
        private copies (4 KiB per page written, until the mapping is freed or ``madvise(MADV_DONTNEED)``), never
        to the file (:meth:`written_privately` finds them)."""
        return mmap.mmap(self._fd, len(self._mapping), mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)

    def written_privately(self, region: torch.Tensor) -> bool:
        """Whether this process wrote any page of ``region`` (a :meth:`region` of a :meth:`private_mapping`): a page
        is a private copy or swapped out, by ``/proc/self/pagemap`` (Linux, Documentation/admin-guide/mm/pagemap.rst:
        bit 63 present, 62 swapped, 61 file page; 8 bytes read per 4 KiB page). ``True`` where pagemap cannot be
        read (correct, only slower)."""
        if region.numel() == 0:
            return False
        first = region.data_ptr() // _PAGE
        last = (region.data_ptr() + 4 * region.numel() - 1) // _PAGE
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                f.seek(8 * first)
                flags = torch.frombuffer(bytearray(f.read(8 * (last - first + 1))), dtype=torch.int64)
        except OSError:
            return True
        present, swapped, file_page = (flags >> 63) & 1, (flags >> 62) & 1, (flags >> 61) & 1
        return bool(((present.bool() & ~file_page.bool()) | swapped.bool()).any())

    def region(self, i: int, kind: str, mapping: mmap.mmap | None = None) -> torch.Tensor:
        """Slab ``i``'s flat fp32 region ``kind`` (``master`` ``[numel]``; ``grad_accum``, ``exp_avg``,
        ``exp_avg_sq`` ``[trainable numel]``), in the shared mapping or in ``mapping`` (a
        :meth:`private_mapping`)."""
        off, n, t = self._offsets[i]
        if kind == "master":
            start, count = off, n
        else:
            start, count = off + _round(n) + ("grad_accum", "exp_avg", "exp_avg_sq").index(kind) * _round(t), t
        if count == 0:
            return torch.zeros(0, dtype=torch.float32)
        # a storage of its own: autograd's version counter of a master is not bumped by writes to other regions
        return torch.frombuffer(self._mapping if mapping is None else mapping, dtype=torch.float32, count=count,
                                offset=4 * start)


def balance(sizes: Sequence[int], ranks: int) -> list[int]:
    """Owner rank of each slab: largest first to the least loaded rank (greedy longest-processing-time).

    Args:
        sizes: per slab, its work (trainable elements; frozen slabs count their elements).
        ranks: local ranks (>= 1).
    """
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def owners(layout: Sequence[tuple[int, int]], ranks: int) -> list[int]:
    """Owner local rank of each slab of ``layout`` (per slab ``(numel, trainable numel)``): :func:`balance` by
    trainable elements (frozen slabs by their elements). The one rule every part uses."""
    return balance([t or n for n, t in layout], ranks)


class OwnerTimeout(RuntimeError):
    """A slab's owner did not publish its update in time (it died, or hangs)."""


class SlabOwnership:
    """Which local rank updates each slab, and the per-slab update counts that order the others' reads.

    Args:
        owner: per slab, its owner's local rank.
        local_rank: this process's local rank.
        counts: int64 ``[n_slabs]`` update counts in shared memory (:attr:`SharedRegions.counts`).
        timeout_s: seconds :meth:`wait` waits before raising :class:`OwnerTimeout`.
        global_rank_of: local rank -> global rank (for error messages).
        all_reduce: ``all_reduce(tensor, op)`` over the node's ranks (``op``: ``"sum"`` or ``"max"``), in place.
        sync: a barrier of the node's ranks (once per step, before ``param.grad`` is shown to hooks).
        exited: ``exited(global_rank)``: whether that rank's process has ended (see :func:`wait_for`); default:
            never.
        failure: the exception :meth:`wait` raises (the data-parallel setup passes its ``PeerFailure``).
    """

    def __init__(self, owner: Sequence[int], local_rank: int, counts: torch.Tensor, timeout_s: float,
                 global_rank_of: Callable[[int], int], all_reduce: Callable[[torch.Tensor, str], None],
                 sync: Callable[[], None], exited: Callable[[int], bool] | None = None,
                 failure: type[Exception] = OwnerTimeout):
        self.sync = sync
        self.failure = failure
        self.exited = exited if exited is not None else (lambda rank: False)
        self.owner = list(owner)
        self.local_rank = local_rank
        self.counts = counts
        self.timeout_s = timeout_s
        self.global_rank_of = global_rank_of
        self.all_reduce = all_reduce
        self.expected = [0] * len(self.owner)  # updates of each slab this process has seen or made

    def owns(self, i: int) -> bool:
        return self.owner[i] == self.local_rank

    def published(self, i: int) -> None:
        """Owner: slab ``i``'s update is written; count it where the other local ranks look."""
        self.expected[i] += 1
        self.counts[i] = self.expected[i]

    def wait(self, i: int) -> None:
        """Non-owner: wait (:func:`wait_for`) until slab ``i``'s owner has published as many updates as expected.

        Raises:
            OwnerTimeout (``failure``): not within ``timeout_s`` seconds, or the owner's process has exited.
        """
        self.expected[i] += 1
        want = self.expected[i]
        owner = self.global_rank_of(self.owner[i])
        wait_for(lambda: int(self.counts[i]) >= want, self.timeout_s, lambda: self.exited(owner),
                 f"rank {owner} (local rank {self.owner[i]}), which updates slab {i}, did not publish update {want}",
                 self.failure)


def wait_for(ready: Callable[[], bool], timeout_s: float, exited: Callable[[], bool], what: str,
             failure: type[Exception] = OwnerTimeout) -> None:
    """Poll ``ready()`` (sleeping 50 us -> 5 ms between looks) until it is true.

    Raises:
        OwnerTimeout (``failure``): ``exited()`` (looked at about once a second) says the process that should make it true has
            ended, or ``timeout_s`` seconds passed; the message says ``what`` did not happen.
    """
    t0 = last_look = time.monotonic()
    pause = 5e-5
    while not ready():
        now = time.monotonic()
        if now - last_look > 1.0:
            last_look = now
            if exited():
                raise failure(f"megatrain: {what}: its process has exited. Stopping; resume from the last "
                              "checkpoint.")
        if now - t0 > timeout_s:
            raise failure(f"megatrain: {what} within {timeout_s:.0f} s: it has died or hangs. Stopping; resume "
                          "from the last checkpoint (the strategy's timeout= sets this limit).")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)


class NodeShare(Protocol):
    """What the engine needs from the data-parallel setup (``parallel/node_share.py`` builds it): the node's
    shared file for a store layout, and the slab owners."""

    def regions(self, layout: list[tuple[int, int]]) -> SharedRegions:
        """Create (local rank 0) or map (the others) the node's shared file for ``layout`` (collective)."""

    def wire_images(self, nbytes: list[int]) -> SharedWireImages:
        """Create (local rank 0) or map the node's wire-image file, ``nbytes`` per slab (collective)."""

    def setup(self, store) -> SlabOwnership:
        """After :func:`~.host.build_store` (collective): wait for the writer's initial weights, make every
        node's copy the first node's, and return the slab owners."""


class SharedWireImages:
    """The node's wire images (bf16/fp16 copies of the masters sent to the device) in a shared file: one per node
    instead of 2 bytes/param per process. Only a slab's owner writes its image, counting a *generation*; the others
    wait for a newer one (docs/internals/data-parallel.md).

    Args:
        path / create / pin: as :meth:`SharedRegions.map`.
        nbytes: per slab, its image's bytes (0: none).
        timeout_s, failure: as :class:`SlabOwnership`'s.
    """

    def __init__(self, path: str, nbytes: Sequence[int], create: bool, pin: bool | None, timeout_s: float,
                 failure: type[Exception] = OwnerTimeout):
        offs, off = [], 0
        for n in nbytes:
            offs.append(off)
            off += (n + 63) // 64 * 64
        self._mapping = shared_file_mapping(path, max(off + 8 * len(nbytes), 8), pin, create)
        self.images = [torch.frombuffer(self._mapping, dtype=torch.uint8, count=n, offset=o) if n else
                       torch.zeros(0, dtype=torch.uint8) for n, o in zip(nbytes, offs)]
        self.generations = torch.frombuffer(self._mapping, dtype=torch.int64, count=len(nbytes), offset=off) \
            if nbytes else torch.zeros(0, dtype=torch.int64)
        self.seen = [0] * len(nbytes)
        self.timeout_s = timeout_s
        self.failure = failure

    def written(self, i: int) -> None:
        """Owner: image ``i`` was rewritten from the current master."""
        self.seen[i] = int(self.generations[i]) + 1
        self.generations[i] = self.seen[i]

    def wait_newer(self, i: int, owner_rank: int, exited: Callable[[], bool] = lambda: False) -> None:
        """Non-owner: wait for a generation of image ``i`` newer than the last one this process used.

        Raises:
            OwnerTimeout (``failure``): none within ``timeout_s``, or ``exited()``."""
        wait_for(lambda: int(self.generations[i]) > self.seen[i], self.timeout_s, exited,
                 f"rank {owner_rank}, which writes the wire image of slab {i}, did not write it", self.failure)
        self.seen[i] = int(self.generations[i])
