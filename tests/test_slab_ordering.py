"""Publish before copy: no write of a master overlaps an H2D copy still reading it.

On CUDA an H2D copy reads the pinned master after ``to_device`` returns; the fetcher publishes its
event in ``slab.last_read`` under the slab's lock, and every writer (the deferred and in-backward
AdamW updates, ``write_param``) takes the lock and waits on it. The CPU transport copies
synchronously, so these tests use a transport that copies asynchronously in a worker thread, with a
pause in the middle of every copy, and record when each copy and each write of a slab ran."""

from __future__ import annotations

import copy
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
import megatrain_lightning.engine.streaming as streaming
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.streaming import StreamingEngine
from megatrain_lightning.engine.transport import CPUTransport
from megatrain_lightning.optim.host_adamw import HostAdamW
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model, reference_train

PAUSE = 0.002


class _Done:
    """The event of an asynchronous copy (``synchronize()``, as a CUDA event)."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def synchronize(self) -> None:
        self.flag.wait()


class AsyncCPUTransport(CPUTransport):
    """Copies host -> "device" in order on one thread (a stream), pausing half-way through each, and
    records ``(storage pointer of the source, start, end)`` of every copy."""

    def __init__(self, device: torch.device):
        super().__init__(device, zero_copy=False)
        self._stream = ThreadPoolExecutor(1, thread_name_prefix="test-h2d-stream")
        self.reads: list[tuple[int, float, float]] = []
        self.events: list[_Done] = []

    def to_device(self, host, dtype=torch.float32, layout=None):
        assert layout is None or layout.dtype is not None
        buf, ev = torch.empty(host.shape, dtype=dtype), _Done()
        self.events.append(ev)

        def copy() -> None:
            t0 = time.perf_counter()
            half = host.numel() // 2
            buf[:half].copy_(host[:half])
            time.sleep(PAUSE)  # a writer that does not wait would land here
            buf[half:].copy_(host[half:])
            self.reads.append((host.untyped_storage().data_ptr(), t0, time.perf_counter()))
            ev.flag.set()

        self._stream.submit(copy)
        return buf, ev


def _overlaps(reads, writes) -> list:
    """Pairs of a copy and a write of the same storage (a slab's master) that ran at the same time."""
    return [(r, w) for r in reads for w in writes if r[0] == w[0] and r[1] < w[2] and w[1] < r[2]]


class _Recorded(torch.Tensor):
    """A value for ``write_param`` that records when it is copied into the master."""

    log: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            t0 = time.perf_counter()
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            cls.log.append((args[0].untyped_storage().data_ptr(), t0, time.perf_counter()))
            return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.fixture
def async_transport(monkeypatch):
    made: list[AsyncCPUTransport] = []

    def make(device, staging_numel, zero_copy_cpu=False, n_staging=2, pin=None, reuse_cpu_buffers=False):
        made.append(AsyncCPUTransport(device))
        return made[-1]

    monkeypatch.setattr(streaming, "make_transport", make)
    return made


def test_write_param_never_overlaps_a_copy_in_flight(async_transport):
    """A reader thread fetches blocks (the H2D worker's job) while a writer thread sets parameters;
    every write waits for the copies of its slab, and no fetched block mixes two writes."""
    model = make_model("llama", num_hidden_layers=2)
    eng = StreamingEngine(model, torch.device("cpu"))
    tr = async_transport[0]
    blocks = [b for b in eng.blocks if eng.store.slabs[b.index].numel > 0]
    params = [e.ref.param for b in blocks for e in eng.store.slabs[b.index].entries]
    for p in params:  # every parameter constant, so a torn copy shows as a non-constant one
        eng.write_param(p, torch.zeros(p.shape))
    _Recorded.log = []
    errors: list[str] = []

    def read() -> None:
        for _ in range(15):
            for b in blocks:
                got = eng.fetcher.fetch(b)
                for si, (buf, ev) in got.items():
                    tr.ready(buf, ev)
                    slab = eng.store.slabs[si]
                    for i in range(len(slab.entries)):
                        v = slab.view(buf, i)
                        if not torch.all(v == v.reshape(-1)[0]):
                            errors.append(slab.entries[i].ref.fqn)
                eng.acct.release({si: buf for si, (buf, _) in got.items()})

    def write() -> None:
        for k in range(1, 16):
            for p in params:
                eng.write_param(p, torch.full(p.shape, float(k)).as_subclass(_Recorded))

    threads = [threading.Thread(target=read), threading.Thread(target=write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eng.close()
    masters = {eng.store.slabs[si].master.untyped_storage().data_ptr() for b in blocks for si in b.slabs}
    assert len(_Recorded.log) == 15 * len(params) and {w[0] for w in _Recorded.log} == masters
    assert len(tr.reads) == 15 * sum(len(b.slabs) for b in blocks)
    assert not errors, errors[:5]
    assert not _overlaps(tr.reads, _Recorded.log)


@pytest.mark.parametrize("in_backward", [False, True])
def test_updates_never_overlap_a_copy_in_flight_and_training_is_unchanged(async_transport, monkeypatch, in_backward):
    """Training with asynchronous copies: the AdamW updates (deferred on the H2D worker, or in
    backward on the D2H worker, tied embeddings read by two blocks) never write a master while a copy
    reads it, and the weights match plain PyTorch."""
    writes: list[tuple[int, float, float]] = []
    update = HostAdamW._update

    def recorded(self, slab, pend):
        t0 = time.perf_counter()
        update(self, slab, pend)
        writes.append((slab.master.untyped_storage().data_ptr(), t0, time.perf_counter()))

    monkeypatch.setattr(HostAdamW, "_update", recorded)
    model = make_model("llama_tied", num_hidden_layers=3)
    ref = copy.deepcopy(model)
    lm = LM(model)
    steps = 4
    trainer = pl.Trainer(strategy=MegaTrainStrategy(optimizer_in_backward=in_backward), accelerator="cpu",
                         max_steps=steps, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(lm, make_data(n=steps * 2))
    reads = list(async_transport[0].reads)
    if in_backward:
        assert trainer.strategy.engine.optimizer.updates_in_backward > 0
    monkeypatch.undo()
    ref_losses = reference_train(ref, make_data(n=steps * 2), steps)
    assert_parity(lm.model, ref, lm.losses, ref_losses)
    assert writes and reads
    assert not _overlaps(reads, writes)


def test_a_dropped_prefetch_is_done_before_drop_returns(async_transport):
    model = make_model("llama", num_hidden_layers=3)
    eng = StreamingEngine(model, torch.device("cpu"), lookahead=2)
    tr = async_transport[0]
    order = [b.index for b in eng.blocks]
    buf = eng.prefetcher.get(eng.blocks[order[0]], order, 0)  # starts the next two fetches
    eng.acct.release(buf)
    eng.prefetcher.drop()
    assert tr.events and all(ev.flag.is_set() for ev in tr.events)
    assert eng.acct.live == 0
    eng.close()


def test_a_prefetch_the_schedule_discarded_is_done_before_drop_returns(async_transport, monkeypatch):
    """A prefetch dropped because the schedule changed (no longer in flight for the schedule) is still
    waited for by drop(): it may read a master or a wire image that the caller of drop() is about to change."""
    model = make_model("llama", num_hidden_layers=3)
    eng = StreamingEngine(model, torch.device("cpu"), lookahead=2)
    tr = async_transport[0]
    fetch = eng.fetcher.fetch

    def slow_fetch(blk):  # the H2D worker's work takes a while (a cast, an NVMe read)
        time.sleep(0.3)
        return fetch(blk)

    monkeypatch.setattr(eng.fetcher, "fetch", slow_fetch)
    order = [b.index for b in eng.blocks]
    eng.acct.release(eng.prefetcher.get(eng.blocks[order[0]], order, 0))  # queues order[1], order[2]
    eng.acct.release(eng.prefetcher.get(eng.blocks[order[1]], [order[1]], 0))  # order[2] discarded, still queued
    eng.prefetcher.drop()
    copies = len(tr.events)
    assert all(ev.flag.is_set() for ev in tr.events) and eng.acct.live == 0
    time.sleep(1.0)  # nothing of the discarded fetch may start or still run after drop() returned
    assert len(tr.events) == copies and eng.acct.live == 0
    eng.close()


def test_a_failed_copy_releases_the_slab_lock(async_transport, monkeypatch):
    model = make_model("llama", num_hidden_layers=2)
    eng = StreamingEngine(model, torch.device("cpu"))
    blk = next(b for b in eng.blocks if eng.store.slabs[b.index].numel > 0)

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(async_transport[0], "to_device", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        eng.fetcher.fetch(blk)
    lock = eng.store.slabs[blk.slabs[0]].lock
    got = []

    def other_thread() -> None:
        got.append(lock.acquire(timeout=5))
        if got[-1]:
            lock.release()

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert got == [True]
    eng.close()


class GatedTransport(AsyncCPUTransport):
    """Copies each on their own thread (no order between them); a copy from a storage in ``held`` waits for
    ``gate``. ``when_done`` runs its callback on a completion thread once the event is set, as
    ``CUDATransport`` does; ``settle`` waits for the callbacks."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._stream = ThreadPoolExecutor(8, thread_name_prefix="test-h2d-copies")
        self.held: set[int] = set()
        self.gate = threading.Event()
        self._done: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._run_done, daemon=True).start()

    def to_device(self, host, dtype=torch.float32, layout=None):
        buf, ev = torch.empty(host.shape, dtype=dtype), _Done()
        self.events.append(ev)
        wait = host.untyped_storage().data_ptr() in self.held

        def copy() -> None:
            if wait:
                self.gate.wait()
            buf.copy_(host)
            ev.flag.set()

        self._stream.submit(copy)
        return buf, ev

    def when_done(self, event, fn) -> None:
        if event is None:
            fn()
        else:
            self._done.put((event, fn))

    def _run_done(self) -> None:
        while True:
            event, fn = self._done.get()
            event.synchronize()
            fn()
            self._done.task_done()

    def settle(self) -> None:
        self._done.join()


def test_dropping_a_finished_prefetch_does_not_wait_for_its_copy(monkeypatch):
    """A prefetch whose fetch has returned but whose copy is still running is dropped by the schedule: the
    caller goes on at once (its bytes come back when the copy is done), and drop() then finds them returned."""
    made: list[GatedTransport] = []
    monkeypatch.setattr(streaming, "make_transport", lambda device, *a, **k: made.append(GatedTransport(device)) or made[-1])
    eng = StreamingEngine(make_model("llama", num_hidden_layers=3), torch.device("cpu"), lookahead=1)
    tr = made[0]
    try:
        order = [b.index for b in eng.blocks if eng.store.slabs[b.index].numel > 0]
        stuck = eng.blocks[order[1]]
        tr.held = {eng.store.slabs[si].master.untyped_storage().data_ptr() for si in stuck.slabs}
        eng.acct.release(eng.prefetcher.get(eng.blocks[order[0]], order, 0))  # prefetches order[1]: its copy waits
        (fetch,) = eng.prefetcher._inflight.values()
        for f in fetch.values():
            f.result(timeout=10)  # the fetch returned (the copy is queued, not done)
        assert not tr.gate.is_set()
        got: list = []
        t = threading.Thread(target=lambda: got.append(eng.prefetcher.get(eng.blocks[order[2]], [order[2]], 0)),
                             daemon=True)
        t.start()  # off the schedule: order[1]'s prefetch is dropped
        t.join(10)
        assert not t.is_alive(), "dropping the finished prefetch waited for its copy"
        eng.acct.release(got[0])
        assert eng.acct.live > 0  # the dropped block's bytes: its copy is still running
        tr.gate.set()
        eng.prefetcher.drop()
        assert eng.acct.live == 0
    finally:
        tr.gate.set()
        eng.close()
