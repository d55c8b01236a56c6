"""The gradient sink: parameter gradients from the device to the fp32 host accumulators.

:meth:`GradientSink.send` queues a block's gradients per slab (``transport.stage_grads``); the D2H worker thread adds
each batch into the slab's fp32 ``grad_accum`` (docs/internals/streaming.md, "Gradients to the host"). With the
optimizer step in backward the D2H worker hands a slab's update to the host optimizer right after its last
gradient of the step (``HostAdamW.apply_now``; docs/internals/nvme.md, "Optimizer step in backward").
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from ..optim.host_adamw import HostAdamW
from ..store.host import HostStore
from ..store.regions import Region
from ..store.shared import SlabOwnership
from .accounting import ByteAccounting
from .shared_grads import SharedGradSums
from .threads import start_worker
from .hook_grads import HookGradViews
from .param_hooks import run_grad_hooks
from .reduce import GradReducer
from .row_grads import RowGrad, to_wire
from .transport import GradCopy


class GradientSink:
    """D2H gradient transfers, host accumulation, and the per-slab update plan of a backward.

    Args:
        acct: live-byte accounting (gradients in flight count until they are in the accumulator).
        transport: ``stage_grads``; CUDA: ``n_staging`` pinned staging buffers, at least ``max_inflight``.
        shared: per-backward sums of parameters read by several blocks (:mod:`.shared_grads`).
        max_inflight: gradient batches (one block's gradients of one slab) sent but not yet in the host
            accumulators, at most (one staging buffer each); :meth:`send` waits beyond it. This bounds the
            device memory of queued gradients whatever the depth, and on budgeted CPU runs prevents a deadlock
            (queued gradients taking the whole budget the worker waits for).
        reducer: data parallel: averages every batch over the ranks before it is added (:mod:`.reduce`); all
            ranks then send the same batches (``None`` gradients included).
        ownership: node-shared store: only a slab's owner adds its gradients; the others record the same flags.

    Raises:
        ValueError: ``max_inflight < 1``, or more than the transport's staging buffers.
    """

    def __init__(self, store: HostStore, acct: ByteAccounting, transport: Any,
                 shared: SharedGradSums, max_inflight: int = 2,
                 host_threads: int | None = None, reducer: GradReducer | None = None,
                 ownership: SlabOwnership | None = None):
        self.store = store
        self.reducer = reducer
        self.ownership = ownership
        self.shared = shared
        self.acct = acct
        self.transport = transport
        self.optimizer: HostAdamW | None = None  # set by StreamingEngine.attach_optimizer
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 gradient batch, got {max_inflight}.")
        staging = getattr(transport, "n_staging", None)
        if staging is not None and max_inflight > staging:
            raise ValueError(f"max_inflight={max_inflight} gradient batches need as many D2H staging buffers; "
                             f"the transport has {staging}.")
        self._pool = start_worker("megatrain-d2h", host_threads, getattr(transport, "device", None))
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._queued = 0  # batches (and in-backward updates) submitted and not yet done
        self._queued_lock = threading.Lock()
        self._futures: list[Future] = []
        self.wire_dtype = torch.float32  # dtype of gradients on the D2H link (accumulated in fp32)
        self.param_dtype = torch.float32  # dtype autograd produces them in (the bound parameters')
        # optimizer step in backward: per slab, the gradient batches still to come in this backward
        self.sends_left: dict[int, int] = {}
        self._hyper = None
        # data parallel with a node-shared store: param.grad shows copy-on-write views (hook_grads.py)
        self.hook_views = HookGradViews(store, ownership) if ownership is not None and store.shared is not None \
            and Region.grad_accum not in store.nvme_kinds else None

    # ------------------------------------------------------------------ plan
    def configure(self, wire: torch.dtype, param: torch.dtype) -> None:
        self.wire_dtype, self.param_dtype = wire, param

    def plan(self, calls_refs: Sequence[Sequence[Any]]) -> None:
        """Start of a backward that applies the AdamW updates as it goes: snapshot the hyper-parameters and count,
        per slab, the batches the backward will send (one per element of ``calls_refs``, each call's trainable
        parameter references, holding parameters of the slab). ``calls_refs`` empty: no update in this backward."""
        self.sends_left = {}
        opt = self.optimizer
        if not calls_refs or opt is None:
            return
        self._hyper = opt.snapshot()
        for refs in calls_refs:
            for si in {r.slab for r in refs}:
                self.sends_left[si] = self.sends_left.get(si, 0) + 1

    def step_partly_applied(self) -> bool:
        """An in-backward step (:meth:`plan`) has updated some slabs and not yet others (a checkpoint would mix)."""
        return self.updates_started() and any(n > 0 for n in self.sends_left.values())

    def updates_started(self) -> bool:
        """This step's backward has queued or applied a slab's update (:meth:`plan`): stopping now mixes two steps."""
        return any(n == 0 for n in self.sends_left.values())

    def close_plan(self) -> None:
        """The optimizer step is over (complete, or stopped by an exception)."""
        self.sends_left = {}

    def grad_bytes(self, refs: Sequence) -> int:
        """Bytes of the gradients of ``refs`` as autograd makes them (the bound parameters' dtype)."""
        return sum(self.store.slabs[r.slab].entries[r.index].numel for r in refs) * self.param_dtype.itemsize

    def new_backward(self) -> None:
        """A backward starts: the previous backward's sums of shared parameters go into their accumulators (on the
        D2H worker, after that backward's gradients)."""
        if self.shared.shared:
            self._futures.append(self._pool.submit(self.shared.close_all, self.store.slabs))

    # ------------------------------------------------------------------ send
    def send(self, refs: Sequence, grads: Sequence[torch.Tensor | None], reserved: int = 0) -> None:
        """Queue gradients (``grads[i]`` of parameter ``refs[i]``: a device tensor of its shape, or ``None``) for
        the D2H worker. ``reserved``: bytes already counted for them, exchanged here for their wire copies'. A
        sparse COO gradient (:mod:`.row_grads`) crosses as rows and row ids; with a reducer it is made dense."""
        grads = run_grad_hooks([r.param for r in refs], grads)  # the user's param.register_hook hooks
        by_slab: dict[int, list[tuple[int, list[torch.Tensor]]]] = {}
        red = self.reducer
        wire = self.wire_dtype
        for ref, g in zip(refs, grads):
            if g is not None and g.is_sparse:
                if red is None:
                    by_slab.setdefault(ref.slab, []).append((ref.index, to_wire(g, wire)))
                    continue
                g = g.to_dense()
            if g is not None or red is not None:
                by_slab.setdefault(ref.slab, []).append((ref.index, [g]))  # type: ignore[list-item]
        if red is not None:  # the same batches on every rank: None -> zeros + a presence flag per gradient
            for si, items in by_slab.items():
                slab = self.store.slabs[si]
                packed = red.pack([g for _, (g,) in items], [slab.entries[i].shape for i, _ in items],
                                  self.transport.device, self.param_dtype)
                by_slab[si] = [(i, [t]) for (i, _), t in zip(items, packed)] + [(-1, [packed[-1]])]
        total = sum(t.numel() * wire.itemsize for items in by_slab.values() for _, ts in items for t in ts)
        if total < reserved:
            self.acct.track(total - reserved)
        final: set[int] = set()
        for si in {r.slab for r in refs}:
            if si in self.sends_left:
                self.sends_left[si] -= 1
                if self.sends_left[si] == 0:
                    final.add(si)
        for si, items in by_slab.items():
            tensors = [t for _, ts in items for t in ts]
            nbytes = sum(t.numel() * wire.itemsize for t in tensors)
            take = min(nbytes, reserved)
            reserved -= take
            self._take_slot()  # a staging buffer is free once a slot is
            self.acct.track(nbytes - take)
            try:
                if red is not None and red.device_side:  # NCCL: reduced on the D2H stream before the copy
                    own = self.ownership
                    assert own is not None
                    n_flags, owner, mine = tensors[-1].numel(), own.owner[si], own.owns(si)
                    copy = self.transport.stage_grads(
                        tensors, wire, reduce=lambda flat: red.reduce_device(flat, n_flags, owner, mine))
                else:
                    copy = self.transport.stage_grads(tensors, wire)  # queued now, overlaps the adds
            except BaseException:  # nothing queued for the worker: its slot and bytes are given back here
                self.acct.track(-nbytes)
                self._give_slot()
                raise
            idx = [i for i, _ in items]
            parts = [len(ts) for _, ts in items]
            moved = nbytes
            if red is not None and red.device_side:  # reduced in fp32 (reduce.py); a non-owner copies the flags
                moved = (sum(t.numel() for t in tensors) if mine else n_flags) * 4
            self.acct.add(d2h_bytes=moved)
            self._futures.append(self._pool.submit(self._accumulate, si, idx, copy, nbytes, si in final, parts))
        for si in final - set(by_slab):  # its last batch had no gradient: the update still runs, in order
            self._take_slot()
            self._futures.append(self._pool.submit(self._update_now, si, True))

    def _take_slot(self) -> None:
        """Compute thread: wait until fewer than ``max_inflight`` batches are queued, then count one more."""
        self._slots.acquire()
        with self._queued_lock:
            self._queued += 1
            self.acct.peak(d2h_queue_peak=self._queued)

    def _give_slot(self) -> None:
        with self._queued_lock:
            self._queued -= 1
        self._slots.release()

    def _update_now(self, si: int, slot: bool = False) -> None:
        """D2H worker: the slab's gradients of this step are complete: its update starts now (``apply_now``)."""
        try:
            opt = self.optimizer
            assert opt is not None and self._hyper is not None
            self.shared.close_slab(self.store.slabs[si])
            opt.apply_now(si, self._hyper)
        finally:
            if slot:
                self._give_slot()

    def _accumulate(self, si: int, idx: list[int], copy: GradCopy, nbytes: int, final: bool,
                    parts: list[int]) -> None:
        """D2H worker: wait for one batch of slab ``si``'s gradients, add it into the fp32 accumulator, free the
        staging buffer and the slot, then (``final``: the slab's last batch of an in-backward step) apply its
        update. ``parts``: host tensors per gradient (1, or 2: a :class:`~.row_grads.RowGrad`'s).

        The update consumes the final batch while the accumulator is held, so it is never marked for write-back:
        with ``offload_optimizer="nvme"`` it never goes to disk (4 bytes/param/step less written)."""
        slab = self.store.slabs[si]
        done = [False]

        def release() -> None:  # the staging buffer, the batch's bytes and its D2H slot, exactly once
            if not done[0]:
                done[0] = True
                copy.release()
                self.acct.track(-nbytes)
                self._give_slot()

        try:
            t0 = time.perf_counter()
            host_grads = copy.wait()  # outside the slab's lock: the copy needs nothing of the slab
            if any(n != 1 for n in parts):  # one gradient per entry of idx: a host tensor, or a RowGrad from two
                it = iter(host_grads)
                host_grads = [next(it) if n == 1 else RowGrad([next(it) for _ in range(n)], slab.entries[i].shape)
                              for i, n in zip(idx, parts)]
            self.acct.add(d2h_copy_wait_s=time.perf_counter() - t0, d2h_busy_s=copy.busy_s)
            red, own = self.reducer, self.ownership
            if red is not None:  # averaged over the ranks onto the owner (gloo: here, on the worker; NCCL: already)
                assert own is not None
                if not red.device_side:
                    t0 = time.perf_counter()
                    host_grads = red.reduce_host(host_grads, own.owner[si], own.owns(si))
                    self.acct.add(grad_reduce_s=time.perf_counter() - t0)
                pairs = [(i, g) for i, g, p in zip(idx[:-1], host_grads[:-1], red.present(host_grads)) if p]
                idx, host_grads = [i for i, _ in pairs], [g for _, g in pairs]
            if own is not None and not own.owns(si):  # the owner adds them; keep the same flags
                with slab.lock:
                    slab.start_window()
                    for i in idx:
                        slab.got_grad(i)
                    release()
                    slab.filled()
                if final:
                    self._update_now(si)
                return
            with slab.lock:
                slab.start_window()
                # an empty accumulator is overwritten, not read (NVMe: no disk read)
                fresh = [Region.grad_accum] if slab.grad_accum_empty else []
                with self.store.hold(si, [Region.grad_accum], write=not final, fresh=fresh) as t:
                    t1 = time.perf_counter()
                    try:
                        for i, g in zip(idx, host_grads):
                            self.shared.add(slab, i, slab.view(t[Region.grad_accum], i), g)
                    finally:
                        self.acct.add(grad_add_s=time.perf_counter() - t1)
                        release()
                    slab.filled()
                    if final:
                        self._update_now(si)
                if final:
                    self.store.discard_grad_accum(si)  # consumed: free its window buffer now
        finally:
            release()

    # ------------------------------------------------------------------ the step's view
    def wait(self) -> None:
        """Block until every gradient sent so far is in the host accumulators."""
        t0 = time.perf_counter()
        futs, self._futures = self._futures, []
        for f in futs:
            f.result()
        self.shared.close_all(self.store.slabs)
        self.acct.add(wait_s=time.perf_counter() - t0)

    def attach(self) -> None:
        """Set ``param.grad`` to a view of its fp32 accumulator (``None`` where no gradient arrived).

        With accumulators on disk ``param.grad`` stays ``None`` (clipping still works: HostAdamW.clip_grad_norm).
        With a node-shared store the views are copy-on-write (every owner's adds must be in:
        ``StreamingEngine.attach_grads`` waits); :meth:`commit` brings the hooks' edits into them.

        Raises:
            RuntimeError: a ``param.grad`` that is not ``None`` or a view of an accumulator: ordinary autograd set
                it, for a parameter used outside its block's forward, and the gradient would be lost.
        """
        self.wait()
        bad = []
        for slab in self.store.slabs:
            acc = slab.grad_accum.untyped_storage().data_ptr() if slab.grad_accum is not None else None
            ours = {acc, self.hook_views.storage_ptr(slab.index) if self.hook_views is not None else None} - {None}
            for e in slab.entries:
                g = e.ref.param.grad
                if g is not None and g.untyped_storage().data_ptr() not in ours:
                    bad.append(e.ref.fqn)
        if bad:
            raise RuntimeError(
                f"megatrain: parameters {bad} got a gradient outside the streamed blocks: they were used "
                "outside the forward of the streamed block (or module) that owns them, where the engine does not "
                "bind them, so their gradient would be lost: their weight was read directly (self.net.pos instead "
                "of calling self.net), or a submodule of a block was called from outside that block's forward "
                "(e.g. self.pre = self.blocks[2].fc, then self.pre(h)). Use each parameter only inside the forward "
                "of the block that owns it, or move the computation that uses it into that forward."
            )
        if Region.grad_accum in self.store.nvme_kinds:
            return
        flats = self.hook_views.open() if self.hook_views is not None else None
        opt = self.optimizer
        stale = opt.pending if opt is not None else {}  # a previous step's gradients, kept for its pending update
        for slab in self.store.slabs:
            for i, e in enumerate(slab.entries):
                has = (slab.grad_accum is not None and not slab.grad_accum_empty and slab.has_grad[i]
                       and slab.index not in stale)
                if not has:
                    e.ref.param.grad = None
                else:
                    e.ref.param.grad = slab.grad_accum_view(i) if flats is None else slab.view(flats[slab.index], i)

    def commit(self) -> None:
        """Make the hooks' edits to ``param.grad`` the accumulators' (node-shared store: ``HookGradViews.commit``, a
        collective of the node's ranks; otherwise the views are the accumulators)."""
        if self.hook_views is not None:
            self.hook_views.commit()

    def detach(self) -> None:
        """``param.grad = None`` for every parameter (after the step)."""
        if self.hook_views is not None:
            self.hook_views.close()
        for slab in self.store.slabs:
            for e in slab.entries:
                e.ref.param.grad = None

    def zero(self) -> None:
        """``optimizer.zero_grad()``: forget gradients no step consumed."""
        self.wait()
        opt = self.optimizer
        if opt is not None:
            opt.discard_grads()
        else:
            for slab in self.store.slabs:
                slab.clear_grads()

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # after the queued transfers
