"""Gradient batches queued for the D2H worker are bounded whatever the depth.

Each queued batch keeps its packed gradients on the device until the D2H worker copies them; when the
host add is slower than a block's backward (the normal case for large layers), an unbounded queue
would keep every layer's gradients on the device. The CPU path shares the queue and the accounting,
so a slowed host add shows the bound here."""

from __future__ import annotations

import queue
import threading
import time

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning.engine.grads import GradientSink
from megatrain_lightning.engine.streaming import StreamingEngine
from megatrain_lightning.testing import LM, make_data, make_model


def _fit(deep: int) -> tuple[LM, list[dict]]:
    lm = LM(make_model("llama", num_hidden_layers=deep))
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=3, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    trainer.fit(lm, make_data(n=16))
    return lm, trainer.strategy.engine.history


def test_queue_stays_within_its_bound_with_a_slow_host_add(monkeypatch):
    fast, _ = _fit(deep=8)
    add = GradientSink._accumulate

    def slow_add(self, *args, **kwargs):  # the host add of a large layer: slower than its backward
        time.sleep(0.02)
        return add(self, *args, **kwargs)

    monkeypatch.setattr(GradientSink, "_accumulate", slow_add)
    slow, history = _fit(deep=8)
    peaks = [h["megatrain/d2h_queue_peak"] for h in history]
    assert max(peaks) == 2, peaks  # the queue filled up to its bound (the slow add is real) and never beyond
    for (name, a), b in zip(slow.named_parameters(), fast.parameters()):
        assert torch.equal(a, b), name  # the wait changes nothing in the numbers


def _send_in_thread(fn, timeout: float = 20.0):
    """Run ``fn`` on a thread; return its exception (``None`` if it returned). A call still blocked after
    ``timeout`` seconds fails the test instead of hanging it."""
    out: list = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the send blocked: a failed send kept its D2H slot"
    return out[0]


def test_a_send_whose_copy_fails_gives_its_slot_back_and_later_sends_raise_or_complete(monkeypatch):
    """Queueing a batch's copy raises (a device error, a peer's failure in the reduce): the slot taken for it is
    given back, so more sends than the queue's bound still raise the error instead of blocking, and once the fault
    is gone a send lands in the accumulator exactly."""
    eng = StreamingEngine(make_model("llama", num_hidden_layers=2), torch.device("cpu"))
    try:
        sink = eng.grads
        blk = next(b for b in eng.blocks if b.params and all(r.param.requires_grad for r in b.params))
        refs = list(blk.params)
        live = eng.acct.live
        stage = eng.transport.stage_grads
        failures = [0]

        def failing(*args, **kwargs):
            failures[0] += 1
            raise RuntimeError("copy failed")

        monkeypatch.setattr(eng.transport, "stage_grads", failing)
        grads = [torch.randn(r.param.shape) for r in refs]
        for _ in range(3 * 2):  # three times the queue's bound (max_inflight=2)
            err = _send_in_thread(lambda: sink.send(refs, [g.clone() for g in grads]))
            assert isinstance(err, RuntimeError) and "copy failed" in str(err)
        assert failures[0] == 6 and eng.acct.live == live
        monkeypatch.setattr(eng.transport, "stage_grads", stage)
        assert _send_in_thread(lambda: sink.send(refs, [g.clone() for g in grads])) is None
        sink.wait()
        slab = eng.store.slabs[refs[0].slab]
        for r, g in zip(refs, grads):
            assert torch.equal(slab.view(slab.grad_accum, r.index).view(g.shape), g), r.fqn
        assert eng.acct.live == live
    finally:
        eng.close()


class _FakeStream:
    def wait_event(self, ev) -> None:
        pass

    def wait_stream(self, s) -> None:
        pass


class _FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def test_cuda_staging_buffer_is_given_back_when_the_reduce_raises(monkeypatch):
    """``CUDATransport.stage_grads`` with the reduce (a collective) raising: its pinned staging buffer goes back to
    the free ones, so the next batches still find one. Runs the real method on CPU tensors, with torch.cuda's
    streams and events replaced by inert stand-ins (their ordering needs a GPU)."""
    import contextlib

    from megatrain_lightning.engine.transport import CUDATransport

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    tr = CUDATransport.__new__(CUDATransport)
    tr.device, tr.n_staging, tr.d2h_stream = torch.device("cpu"), 2, _FakeStream()
    tr._staging = queue.Queue()
    for _ in range(2):
        tr._staging.put(torch.zeros(16))
    grads = [torch.arange(6.0).view(2, 3), torch.ones(2)]

    def failing(flat):
        raise RuntimeError("peer died")

    for _ in range(3):
        with pytest.raises(RuntimeError, match="peer died"):
            tr.stage_grads(grads, torch.float32, reduce=failing)
        assert tr._staging.qsize() == 2
    copy = tr.stage_grads(grads, torch.bfloat16, reduce=lambda flat: (flat.float() * 2, None))
    host = copy.wait()
    assert [h.dtype for h in host] == [torch.float32] * 2  # the reduce's fp32 result is what crosses
    assert torch.equal(host[0], grads[0] * 2) and torch.equal(host[1], grads[1] * 2)
    copy.release()
    assert tr._staging.qsize() == 2
