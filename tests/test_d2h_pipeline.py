"""Overlapped D2H and the host workers' threads and statistics.

The compute thread queues each gradient batch's copy as soon as a staging slot is free, and the D2H
worker adds batch k while batch k+1 is being copied. The CPU path shares the queue, the slots and the
accounting with CUDA (its "copy" is the conversion to the wire dtype, on the compute thread as a CUDA
copy is queued there), so a slowed copy and a slowed host add show the pipeline here; the GPU
numbers are bench/gpu_check.py's ``d2h`` check."""

from __future__ import annotations

import copy
import sys
import threading
import time

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.accounting import ByteAccounting
from megatrain_lightning.engine.shared_grads import SharedGradSums
from megatrain_lightning.engine.threads import resolve_host_threads
from megatrain_lightning.engine.transport import CPUTransport
from megatrain_lightning.optim.host_adamw import HostAdamW
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model, reference_train

STEPS, ACC, SLEEP = 3, 2, 0.002


def _trainer(**strategy_kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=MegaTrainStrategy(**strategy_kwargs), accelerator="cpu", max_steps=STEPS,
                      enable_checkpointing=False, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accumulate_grad_batches=ACC)


def test_copies_overlap_slow_host_adds_and_training_matches_plain_pytorch(monkeypatch):
    """Slowed copies (2 ms per gradient) and slowed host adds (2 ms per gradient): a copy runs while the
    worker adds an earlier batch, the queue stays within its bound, the per-step statistics account
    for the slowed work, and the trained weights match plain PyTorch."""
    copies: list[tuple[float, float]] = []
    adds: list[tuple[float, float]] = []
    grad_to_host, add = CPUTransport.grad_to_host, SharedGradSums.add

    def slow_copy(g, wire):
        t0 = time.perf_counter()
        time.sleep(SLEEP)
        out = grad_to_host(g, wire)
        copies.append((t0, time.perf_counter()))
        return out

    def slow_add(self, *args):
        t0 = time.perf_counter()
        time.sleep(SLEEP)
        add(self, *args)
        adds.append((t0, time.perf_counter()))

    monkeypatch.setattr(CPUTransport, "grad_to_host", staticmethod(slow_copy))
    monkeypatch.setattr(SharedGradSums, "add", slow_add)
    model = make_model("llama", num_hidden_layers=6)
    ref = copy.deepcopy(model)
    lm = LM(model)
    trainer = _trainer()
    trainer.fit(lm, make_data(n=STEPS * ACC * 2))
    hist = trainer.strategy.engine.history
    monkeypatch.undo()
    ref_losses = reference_train(ref, make_data(n=STEPS * ACC * 2), STEPS, accumulate=ACC)
    assert_parity(lm.model, ref, lm.losses, ref_losses)

    assert any(c0 < a1 and a0 < c1 for c0, c1 in copies for a0, a1 in adds)  # copy k+1 during add k
    assert len(hist) == STEPS
    for h in hist:
        assert h["megatrain/d2h_queue_peak"] == 2  # filled (the adds are slow) and never beyond
        assert h["megatrain/d2h_copy_wait_s"] >= 0.0
    # every copy and every add of the run is in some step's statistics (the slowed part at least)
    assert sum(h["megatrain/d2h_busy_s"] for h in hist) >= len(copies) * SLEEP
    assert sum(h["megatrain/grad_add_s"] for h in hist) >= len(adds) * SLEEP
    assert sum(h["megatrain/grad_add_s"] for h in hist) <= sum(a1 - a0 for a0, a1 in adds) + 1.0


def test_host_threads_option_is_checked_when_the_strategy_is_built():
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"host_threads .*strategy\.host_threads"):
            MegaTrainStrategy(host_threads=bad)
    assert MegaTrainStrategy(host_threads=3).host_threads == 3


def test_host_threads_default_leaves_a_core_on_cuda_and_one_thread_per_worker_on_cpu():
    n = torch.get_num_threads()
    assert resolve_host_threads(None, torch.device("cuda", 0)) == max(1, n - 1)
    assert resolve_host_threads(None, torch.device("cpu")) == 1  # the compute thread's kernels use every core
    assert resolve_host_threads(5, torch.device("cpu")) == 5


def test_host_workers_run_with_host_threads_and_the_compute_thread_keeps_its_own(monkeypatch):
    main_threads = torch.get_num_threads()
    want = main_threads + 1  # differs from the compute thread's whatever the machine
    seen: dict[str, set[int]] = {"update": set(), "d2h": set()}
    add, update = SharedGradSums.add, HostAdamW._update

    def add_seen(self, *args):
        seen["d2h"].add(torch.get_num_threads())
        return add(self, *args)

    def update_seen(self, *args):
        name = threading.current_thread().name
        if "update" in name:  # deferred updates run on the update worker (RAM tier)
            seen["update"].add(torch.get_num_threads())
        return update(self, *args)

    monkeypatch.setattr(SharedGradSums, "add", add_seen)
    monkeypatch.setattr(HostAdamW, "_update", update_seen)
    _trainer(host_threads=want).fit(LM(make_model("llama")), make_data(n=STEPS * ACC * 2))
    assert seen == {"update": {want}, "d2h": {want}}
    assert torch.get_num_threads() == main_threads
    # update_threads=2: the update worker's two threads share host_threads (4 -> 2 each); the D2H worker keeps 4
    seen = {"update": set(), "d2h": set()}
    _trainer(host_threads=4, update_threads=2).fit(LM(make_model("llama")), make_data(n=STEPS * ACC * 2))
    assert seen == {"update": {2}, "d2h": {4}}
    assert torch.get_num_threads() == main_threads


def test_statistics_add_up_under_concurrent_updates():
    """Eight threads add to the same statistics with a tiny switch interval (a plain ``+=`` on an
    attribute loses updates there): every update is counted."""
    acct = ByteAccounting()
    n = 2000
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work(k: int) -> None:
            for _ in range(n):
                acct.add(h2d_bytes=1, grad_add_s=0.5)
                acct.peak(d2h_queue_peak=k)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert acct.stats.h2d_bytes == 8 * n
    assert acct.stats.grad_add_s == 8 * n * 0.5
    assert acct.stats.d2h_queue_peak == 7
    with pytest.raises(AttributeError):
        acct.add(no_such_stat=1)
