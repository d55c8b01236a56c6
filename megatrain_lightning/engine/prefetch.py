"""The read-ahead schedule: block copies started ``lookahead`` fetches ahead, NVMe reads further ahead
(docs/architecture.md, "Prefetch schedule"; the engine asks :meth:`Prefetcher.get` at every fetch of the step's
sequence)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from ..blocks import Block
from ..optim.host_adamw import HostAdamW
from ..store.host import HostStore
from ..store.regions import Region
from .accounting import ByteAccounting
from .block_groups import GroupSchedule
from .threads import start_worker


class Prefetcher:
    """Block copies in flight on the H2D worker, in schedule order.

    Args:
        blocks: the model's blocks (indexed by block index).
        acct: live-byte accounting (a dropped prefetch gives its bytes back).
        fetch: ``WeightFetcher.fetch`` (run on the H2D worker).
        lookahead: fetches started ahead of the one computing (1 = double buffering); further fetches
            start while they fit the elements of ``lookahead + 1`` largest fetches (:meth:`wanted`).
        read_ahead_bytes: NVMe tier: bytes the read-ahead may use beside the blocks in flight
            (``host_memory_limit`` - the minimum window), or ``None`` without the NVMe tier.
        read_ahead_depth: NVMe tier: fetches beyond the lookahead whose regions are read ahead.
        groups: transfer units (:func:`~.block_groups.form_groups`); ``lookahead`` counts group fetches.
    """

    def __init__(self, blocks: Sequence[Block], store: HostStore, transport: Any, acct: ByteAccounting,
                 fetch: Callable[[Block], dict[int, tuple[torch.Tensor, Any]]], lookahead: int,
                 read_ahead_bytes: int | None = None,
                 read_ahead_depth: int = 0, host_threads: int | None = None, *,
                 groups: Sequence[tuple[int, ...]]):
        self.blocks, self.store, self.transport, self.acct = blocks, store, transport, acct
        self._fetch = fetch
        self.lookahead = lookahead
        self.optimizer: HostAdamW | None = None  # its pending updates tell what to read ahead
        self._spare = read_ahead_bytes
        self._depth = read_ahead_depth
        self._pool = start_worker("megatrain-h2d", host_threads, getattr(transport, "device", None))
        self.schedule = GroupSchedule(groups)
        # elements a block's fetch brings to the device (tied slabs included)
        self._numel = {b.index: sum(store.slabs[si].numel for si in b.slabs) for b in blocks}
        self._cap = (lookahead + 1) * max((sum(self._numel[bi] for bi in g) for g in groups), default=0)
        # blocks of one fetch (run_at) -> per block, the future of its part of the fetch
        self._inflight: dict[tuple[int, ...], dict[int, Future]] = {}
        self._open: dict[int, dict[int, Future]] = {}  # group -> its fetch's members not used yet
        self._discarded: dict[int, Future] = {}  # dropped prefetches still running (drop() waits for them)
        self._discard_lock = threading.Lock()

    def get(self, blk: Block, seq: Sequence[int], pos: int | None, backward: bool = False,
            updates_in_backward: bool = False, held: int = 0) -> dict[int, torch.Tensor]:
        """The block's slabs on the device, waiting for its copy if needed; starts the fetches :meth:`wanted`
        after position ``pos`` of ``seq`` (``None``: off the schedule). Group members fetched with the block
        (:mod:`.block_groups`) are served when they come, or released unused once the schedule moves on.

        Args:
            backward / updates_in_backward: the fetch is in a backward (applying AdamW updates as it goes): what
                the NVMe read-ahead wants besides the masters.
            held: elements of other blocks' buffers still on the device (a kept last block's graph).
        Returns:
            slab index -> device buffer (compute dtype, shape ``[slab numel]``).
        """
        t0 = time.perf_counter()
        sched = self.schedule
        g = sched.group_of[blk.index]
        for other in [k for k in self._open if k != g]:
            self._discard_all(self._open.pop(other))  # their turn has passed
        opened = self._open.pop(g, None)
        fut = opened.pop(blk.index, None) if opened is not None else None
        if fut is None:
            if opened:  # a member is fetched again: the rest of that fetch is not used
                self._discard_all(opened)
            run = sched.run_at(seq, pos) if pos is not None else (blk.index,)
            opened = self._inflight.pop(run, None)
            if opened is None:
                self.acct.add(prefetch_misses=1)
                opened = self._submit(run)
            fut = opened.pop(blk.index)
        if opened:
            self._open[g] = opened
        if self.lookahead > 0 and pos is not None:
            want = self.wanted(seq, pos, set(opened or ()), held)
            for stale in [k for k in self._inflight if k not in want]:
                self._discard_all(self._inflight.pop(stale))
            for run in want:
                if run not in self._inflight:
                    self._inflight[run] = self._submit(run)
        if self._spare is not None and pos is not None:
            la = (self.lookahead + 1) * sched.size - 1  # blocks in flight ahead
            self._read_ahead(seq[pos + 1 : pos + 2 + 2 * la + self._depth], backward, updates_in_backward)
        got = fut.result()
        for buf, ev in got.values():
            self.transport.ready(buf, ev)
        self.acct.add(wait_s=time.perf_counter() - t0)
        return {s: buf for s, (buf, _) in got.items()}

    def wanted(self, seq: Sequence[int], pos: int, left: set[int], held: int = 0) -> list[tuple[int, ...]]:
        """The fetches to have in flight while ``seq[pos]`` computes: the next ``lookahead`` ones, then further
        ones while the elements of the block computing, of its fetch's members not used yet (``left``), of
        ``held`` and of every fetch in flight stay within those of the ``lookahead + 1`` largest fetches. A run
        fetched twice counts at each position (docs/internals/streaming.md, "Prefetch schedule")."""
        room = self._cap - self._numel[seq[pos]] - sum(self._numel[b] for b in left) - held
        want: list[tuple[int, ...]] = []
        for run in self.schedule.iter_upcoming(seq, pos, left):
            n = sum(self._numel[b] for b in run)
            if len(want) >= self.lookahead and n > room:
                break
            if run not in want:
                want.append(run)
            room -= n
        return want

    def _submit(self, run: tuple[int, ...]) -> dict[int, Future]:
        """Hand one fetch of the blocks ``run`` to the H2D worker; per block, the future of its part (the first
        computes while the worker fetches the next)."""
        parts = {bi: Future() for bi in run}
        self._pool.submit(self._fetch_run, run, dict(parts))
        return parts

    def _fetch_run(self, run: tuple[int, ...], parts: dict[int, Future]) -> None:
        """H2D worker: fetch the blocks of ``run`` in order; an error fails this block's future and the rest."""
        self.acct.add(weight_transfers=1)
        for i, bi in enumerate(run):
            try:
                got = self._fetch(self.blocks[bi])
            except BaseException as e:
                for rest in run[i:]:
                    parts[rest].set_exception(e)
                return
            parts[bi].set_result(got)

    def _read_ahead(self, upcoming: Sequence[int], backward: bool, updates_in_backward: bool) -> None:
        """Tell the NVMe store what the schedule reads next (masters; AdamW states and accumulator of slabs whose
        update runs before their fetch), up to the spare bytes beside the blocks in flight: buffers read further
        ahead would be evicted before their use and read a second time."""
        kinds = self.store.nvme_kinds
        nvme = self.store.nvme
        spare = self._spare
        assert nvme is not None and spare is not None
        wanted: list[tuple[int, str]] = []
        opt = self.optimizer
        pending = opt.pending if opt is not None else {}
        for bi in upcoming:
            for si in self.blocks[bi].slabs:
                want = [Region.master]
                if si in pending:
                    want = [Region.exp_avg, Region.exp_avg_sq, Region.grad_accum, Region.master]
                elif backward and updates_in_backward:
                    want = [Region.master, Region.exp_avg, Region.exp_avg_sq]  # the update runs right after this backward
                elif backward and not self.store.slabs[si].grad_accum_empty:
                    want = [Region.master, Region.grad_accum]  # gradient accumulation adds into the stored accumulator
                for k in want:
                    if k in kinds and (si, k) not in wanted:
                        spare -= nvme.region_bytes(si, k)
                        if spare < 0:
                            return nvme.read_ahead(wanted)
                        wanted.append((si, k))
        nvme.read_ahead(wanted)

    def _discard_all(self, parts: dict[int, Future]) -> None:
        """Drop fetched (or still fetching) blocks the schedule no longer wants (block index -> future) without
        waiting: :meth:`_release_discarded` releases each (:meth:`drop` waits)."""
        for fut in parts.values():
            with self._discard_lock:
                self._discarded[id(fut)] = fut
            fut.add_done_callback(self._release_discarded)

    def _release_discarded(self, f: Future) -> None:
        """A dropped prefetch's fetch ended: its bytes are given back on the transport's completion thread once its
        copies are done (``when_done``), so neither the compute thread nor the H2D worker waits for the copy."""
        with self._discard_lock:
            if self._discarded.pop(id(f), None) is None:
                return  # drop() took it over
        if f.exception() is not None:
            return
        for buf, ev in f.result().values():
            nbytes = buf.numel() * buf.element_size()
            # the buffer stays referenced until its copy is done
            self.transport.when_done(ev, lambda buf=buf, nbytes=nbytes: self.acct.track(-nbytes))

    def drop(self) -> None:
        """Wait for and discard the copies in flight, the dropped prefetches still running and the unused group
        members (they predate an optimizer update or a dtype change)."""
        with self._discard_lock:  # dropped earlier and still running: they may read what is about to change
            discarded, self._discarded = list(self._discarded.values()), {}
        pending = [f for parts in [*self._inflight.values(), *self._open.values()] for f in parts.values()]
        self._inflight.clear()
        self._open.clear()
        for fut in [*pending, *discarded]:
            try:
                got = fut.result()
            except Exception:  # the error resurfaces on the next synchronous fetch
                continue
            for _, ev in got.values():  # nobody will use it: its bytes go back once its copies are done
                self.transport.last_read_done(ev)
            self.acct.track(-sum(b.numel() * b.element_size() for b, _ in got.values()))
        self.transport.settle()  # window holds and staging slots of finished copies are given back

    def close(self) -> None:
        """Stop the H2D worker (after the submitted copies) and wait until their sources are given back."""
        self._pool.shutdown(wait=True)
        self.transport.settle()
