"""The host update schedule on the RAM tier: each slab's update runs on the update worker thread, from the moment its
gradients are complete (``optimizer_in_backward``) or from the start of the next forward (the deferred schedule),
and a fetch waits only for its own slab's update; the numbers stay bitwise plain PyTorch.

The tests gate one slab's update on an event that only a later point of the training loop sets (the step's
``on_train_batch_end``): a schedule that made the step wait for every update would never reach that point while
the update waits, so the gate would time out (recorded, and asserted against) instead of hanging.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.optim.host_adamw import HostAdamW
from megatrain_lightning.testing import LM, make_data, make_model, reference_train

GATE_TIMEOUT_S = 30.0


class _StepEnd(pl.Callback):
    """Sets ``event`` in every ``on_train_batch_end`` (after ``before(trainer)``)."""

    def __init__(self, event: threading.Event, before=None):
        self.event, self.before = event, before

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.before is not None:
            self.before(trainer)
        self.event.set()


def _fit(strategy: MegaTrainStrategy, steps: int, callbacks=(), clip: float | None = None):
    torch.manual_seed(0)
    model = make_model("llama", num_hidden_layers=3)
    ref = copy.deepcopy(model)
    lm = LM(model)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks), gradient_clip_val=clip)
    trainer.fit(lm, make_data(n=steps * 2))
    return lm, ref, trainer


def _assert_bitwise_plain(lm, ref, steps: int, clip: float | None = None) -> None:
    ref_losses = reference_train(ref, make_data(n=steps * 2), steps, clip=clip)
    assert lm.losses == ref_losses
    for (name, a), b in zip(lm.model.named_parameters(), ref.parameters()):
        assert torch.equal(a.detach(), b.detach()), name


def test_in_backward_updates_run_past_the_step_until_the_next_forward_needs_them(monkeypatch):
    """optimizer_in_backward: the first block's update (its gradients complete last) is still running when the step
    ends and Lightning calls on_train_batch_end; the next forward's fetch of that block waits for it. The updates
    run on the update worker (or on the H2D worker, for a block whose fetch comes first); weights and losses bitwise
    plain PyTorch."""
    step_end = threading.Event()
    timed_out, threads = [], []
    first: set[int] = set()
    ended = threading.Event()  # the last step is over: Lightning's on_train_end flush may run what is left itself
    update = HostAdamW._update

    def gated(self, slab, pend):
        if not ended.is_set():
            threads.append(threading.current_thread().name)
        if slab.index in first:
            timed_out.append(not step_end.wait(GATE_TIMEOUT_S))
            step_end.clear()
        update(self, slab, pend)

    monkeypatch.setattr(HostAdamW, "_update", gated)
    strategy = MegaTrainStrategy(optimizer_in_backward=True)

    class First(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            eng = trainer.strategy.engine
            first.update(eng.blocks[0].slabs)  # the embedding: first in the forward, last in the backward

    steps = 3

    def last_step_over(trainer):
        if trainer.global_step == steps:
            ended.set()

    lm, ref, trainer = _fit(strategy, steps, callbacks=[First(), _StepEnd(step_end, before=last_step_over)])
    monkeypatch.undo()
    assert timed_out == [False] * steps, "the step waited for the first block's update"
    # during the steps: on the update worker, or on the H2D worker when the next forward's fetch came before the
    # worker reached it (after the last step, the flush at the end of fit runs what the worker has not reached)
    assert any(t.startswith("megatrain-update") for t in threads), set(threads)
    assert all(t.startswith(("megatrain-update", "megatrain-h2d")) for t in threads), set(threads)
    _assert_bitwise_plain(lm, ref, steps)


def test_deferred_updates_run_on_the_update_worker(monkeypatch):
    """Gradient clipping keeps the deferred schedule: the updates run on the update worker from the next forward
    on (a fetch runs one itself only when the worker has not reached it); bitwise plain PyTorch."""
    threads = []
    update = HostAdamW._update

    def recorded(self, slab, pend):
        threads.append(threading.current_thread().name)
        update(self, slab, pend)

    monkeypatch.setattr(HostAdamW, "_update", recorded)
    steps = 3
    lm, ref, trainer = _fit(MegaTrainStrategy(), steps, clip=0.5)
    monkeypatch.undo()
    assert trainer.strategy.engine.optimizer.updates_in_backward == 0
    assert any(t.startswith("megatrain-update") for t in threads), set(threads)
    assert all(t.startswith(("megatrain-update", "megatrain-h2d", "MainThread")) for t in threads), set(threads)
    _assert_bitwise_plain(lm, ref, steps, clip=0.5)


def test_a_write_before_the_update_on_the_worker_fails_the_next_forward(monkeypatch):
    """optimizer_in_backward: a parameter written in place between steps (user code in on_train_batch_end without
    trainer.strategy.flush()) while its block's update waits in the update worker's queue fails the next forward
    with the message that says to flush (the error raised on the worker reaches the fetch), rather than training on
    weights plain PyTorch never has."""
    step_end = threading.Event()
    gate: set[int] = set()
    update = HostAdamW._update

    def gated(self, slab, pend):
        if slab.index in gate:  # the first decoder layer: its update runs just before the embedding's
            step_end.wait(GATE_TIMEOUT_S)
            step_end.clear()
        update(self, slab, pend)

    monkeypatch.setattr(HostAdamW, "_update", gated)

    def write(trainer):
        if trainer.global_step == 1:
            with torch.no_grad():
                trainer.lightning_module.model.model.embed_tokens.weight.mul_(0.5)

    class Gate(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            gate.update(trainer.strategy.engine.blocks[1].slabs)

    with pytest.raises(RuntimeError, match=r"written in place after optimizer.step\(\).*trainer.strategy.flush\(\)"):
        _fit(MegaTrainStrategy(optimizer_in_backward=True), 3, callbacks=[Gate(), _StepEnd(step_end, write)])


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_backward", "deferred"])
def test_update_threads_update_that_many_slabs_at_once_bitwise(monkeypatch, in_backward):
    """``update_threads=2``: two threads of the update worker update different slabs at the same time (each update
    made 30 ms longer, so that the worker's queue holds several slabs); with ``update_threads=1`` the worker never
    runs two at once. Both schedules stay bitwise plain PyTorch."""
    update = HostAdamW._update
    for want in (1, 2):
        lock, running, most = threading.Lock(), [0], [0]

        def timed(self, slab, pend):
            mine = threading.current_thread().name.startswith("megatrain-update")
            if mine:
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
            try:
                time.sleep(0.03)
                update(self, slab, pend)
            finally:
                if mine:
                    with lock:
                        running[0] -= 1

        monkeypatch.setattr(HostAdamW, "_update", timed)
        steps = 3
        clip = None if in_backward else 0.5
        lm, ref, trainer = _fit(MegaTrainStrategy(optimizer_in_backward=in_backward, update_threads=want), steps,
                                clip=clip)
        monkeypatch.undo()
        assert most[0] == want, f"update_threads={want}: at most {most[0]} slab updates at once on the worker"
        _assert_bitwise_plain(lm, ref, steps, clip=clip)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_update_threads_option_is_checked_when_the_strategy_is_built(bad):
    with pytest.raises(ValueError, match=r"update_threads .*strategy\.update_threads"):
        MegaTrainStrategy(update_threads=bad)


def test_update_threads_on_the_nvme_tier_warns_that_it_has_no_effect(tmp_path):
    with pytest.warns(UserWarning, match=r"update_threads=2 has no effect on the NVMe tier"):
        MegaTrainStrategy(update_threads=2, offload_optimizer="nvme", nvme_path=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MegaTrainStrategy(update_threads=2)
        MegaTrainStrategy(offload_optimizer="nvme", nvme_path=str(tmp_path))


class _Manual(LM):
    """The same step under manual optimization (``manual_backward``, then the optimizer's ``step``)."""

    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()


@pytest.mark.parametrize("manual", [False, True])
def test_setup_announces_updates_in_backward_only_when_they_run(tmp_path, caplog, manual):
    """The NVMe tier's default updates in backward under automatic optimization, and the setup line says so; manual
    optimization runs the deferred schedule (``MegaTrainStrategy._update_in_backward_now``), so no line announces
    updates in backward there."""
    import logging

    strategy = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    model = make_model("llama")
    lm = _Manual(model) if manual else LM(model)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        trainer.fit(lm, make_data(8))
    strategy.close()
    announced = [r for r in caplog.records if "optimizer_in_backward: each block's update starts" in r.getMessage()]
    assert len(announced) == (0 if manual else 1), caplog.text
