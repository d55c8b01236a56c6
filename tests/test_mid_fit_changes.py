"""Changes users make to weights and optimizers during fit.

Reference: the same LightningModule and callbacks under plain Lightning (``strategy="auto"``), same seed. Before the
fixes: an in-place weight write in ``on_train_batch_end`` hit the weights before the step's deferred update (weights
19% off, no error); under ``bf16-mixed`` a write in a validation hook was not seen by the cached 16-bit copies (19%
off); ``trainer.strategy.setup_optimizers(trainer)`` mid-fit was ignored (old lr and moments kept: 56% off);
``optimizer.state.clear()`` did nothing (65% off) and ``optimizer.state[p]`` gave a bare ``KeyError``; a param group's
``decoupled_weight_decay=False`` lost to the optimizer's default (weights 6x off); ``EMAWeightAveraging`` checkpoints
saved the raw weights instead of the average and could not be resumed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model


def _fit(lm, strategy, callbacks=(), steps=None, epochs=None, precision="32-true", val=False, **kw):
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps or -1, max_epochs=epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks), precision=precision,
                         num_sanity_val_steps=0, **kw)
    trainer.fit(lm, make_data(n=16), make_data(n=4, seed=5) if val else None)
    return lm


class Scale(Callback):
    """Scales every weight by 0.9 in place after each optimizer step, optionally after ``flush()``."""

    def __init__(self, flush: bool):
        self.flush = flush

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.flush and not isinstance(trainer.strategy, pl.strategies.SingleDeviceStrategy):
            trainer.strategy.flush()
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.9)


def test_write_after_the_step_needs_flush_and_is_refused_without_it():
    ref = _fit(LM(make_model("llama"), lr=1e-2), "auto", [Scale(False)], steps=4)
    ours = _fit(LM(make_model("llama"), lr=1e-2), "megatrain", [Scale(True)], steps=4)
    assert_parity(ours, ref, ours.losses, ref.losses)
    with pytest.raises(RuntimeError, match=r"written in place after optimizer.step\(\).*trainer.strategy.flush\(\)"):
        _fit(LM(make_model("llama"), lr=1e-2), "megatrain", [Scale(False)], steps=4)


class HalveAtValidationEnd(Callback):
    def on_validation_epoch_end(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.5)


class ValLM(LM):
    def __init__(self):
        super().__init__(make_model("llama"), lr=1e-2)
        self.val_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.val_losses.append(loss.item())
        return loss


def test_bf16_write_in_a_validation_hook_reaches_the_16_bit_copies():
    ref = _fit(ValLM(), "auto", [HalveAtValidationEnd()], epochs=2, precision="bf16-mixed", val=True)
    ours = _fit(ValLM(), "megatrain", [HalveAtValidationEnd()], epochs=2, precision="bf16-mixed", val=True)
    assert ours.val_losses == ref.val_losses
    assert_parity(ours, ref, ours.losses, ref.losses)


class NewOptimizerAtEpoch1(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.lr = 2e-3
            trainer.strategy.setup_optimizers(trainer)


class ClearStateAtEpoch1(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            trainer.optimizers[0].state.clear()


@pytest.mark.parametrize("callback", [NewOptimizerAtEpoch1, ClearStateAtEpoch1])
def test_new_optimizer_or_cleared_state_mid_fit_as_plain_lightning(callback):
    ref = _fit(LM(make_model("llama"), lr=1e-2), "auto", [callback()], epochs=2)
    ours = _fit(LM(make_model("llama"), lr=1e-2), "megatrain", [callback()], epochs=2)
    assert_parity(ours, ref, ours.losses, ref.losses)


class ReadState(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        trainer.optimizers[0].state[next(pl_module.parameters())]["exp_avg"]


def test_reading_optimizer_state_names_state_dict():
    with pytest.raises(KeyError, match=r"optimizer.state is empty.*optimizer.state_dict\(\)"):
        _fit(LM(make_model("llama")), "megatrain", [ReadState()], steps=1)


class CoupledDecayLM(LM):
    """Adam with decoupled decay by default, and one group (the decoder layers) with L2 decay instead."""

    def configure_optimizers(self):
        layers = [p for n, p in self.named_parameters() if ".layers." in n]
        rest = [p for n, p in self.named_parameters() if ".layers." not in n]
        return torch.optim.Adam([{"params": rest}, {"params": layers, "decoupled_weight_decay": False}],
                                lr=self.lr, weight_decay=0.1, decoupled_weight_decay=True)


def test_param_group_decoupled_weight_decay_flag_wins_over_the_default():
    ref = _fit(CoupledDecayLM(make_model("llama"), lr=1e-2), "auto", steps=4)
    ours = _fit(CoupledDecayLM(make_model("llama"), lr=1e-2), "megatrain", steps=4)
    assert_parity(ours, ref, ours.losses, ref.losses)


def test_weight_averaging_checkpoint_is_refused_before_writing(tmp_path):
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from megatrain_lightning.checkpoint.errors import CheckpointError

    lm = LM(make_model("llama"))
    trainer = pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[EMAWeightAveraging()])
    trainer.fit(lm, make_data(n=8))
    with pytest.raises(CheckpointError, match="averaged weights.*WeightAveraging"):
        trainer.save_checkpoint(tmp_path / "ema")
    assert not (tmp_path / "ema").exists()


class DataScale(Callback):
    """Scales every weight by 0.9 through ``param.data`` (no version counter moves) and says so."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        for p in pl_module.parameters():
            p.data.mul_(0.9)
        trainer.strategy.weights_written()


def test_weights_written_with_an_update_still_pending_is_refused():
    with pytest.raises(RuntimeError, match=r"weights_written\(\) was called while optimizer updates were still"):
        _fit(LM(make_model("llama"), lr=1e-2), "megatrain", [DataScale()], steps=2)


class SwapAtValidationStart(Callback):
    """Swaps a snapshot of the weights in at ``on_validation_start`` and back at ``on_validation_end``."""

    def on_validation_start(self, trainer, pl_module):
        self.saved = [p.detach().clone() for p in pl_module.parameters()]
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.5)

    def on_validation_end(self, trainer, pl_module):
        with torch.no_grad():
            for p, s in zip(pl_module.parameters(), self.saved):
                p.copy_(s)


def test_weights_written_in_on_validation_start_mid_epoch_as_plain_lightning():
    ref = _fit(ValLM(), "auto", [SwapAtValidationStart()], epochs=2, val=True, val_check_interval=0.5)
    ours = _fit(ValLM(), "megatrain", [SwapAtValidationStart()], epochs=2, val=True, val_check_interval=0.5)
    assert ours.val_losses == pytest.approx(ref.val_losses, rel=1e-6) and len(ref.val_losses) == 8
    assert_parity(ours, ref, ours.losses, ref.losses)


def test_weight_averaging_with_checkpointing_is_refused_at_setup():
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from megatrain_lightning.checkpoint.errors import CheckpointError

    lm = LM(make_model("llama"))
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[EMAWeightAveraging()])
    with pytest.raises(CheckpointError, match="enable_checkpointing=False"):
        trainer.fit(lm, make_data(n=8))
    assert lm.losses == []  # refused before the first step


class AccumulateMoreMidEpoch(Callback):
    """From optimizer step 2 on, 3 micro-batches per step, set at batch 2: mid-epoch, at a batch index that is not
    a multiple of 3."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2 and trainer.accumulate_grad_batches == 1:
            trainer.accumulate_grad_batches = 3


class ZeroGradientsAfterEachStep(Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step > self.steps:
            self.steps = trainer.global_step
            for p in pl_module.parameters():
                p.grad = None


def test_accumulation_changed_mid_epoch_starts_from_zero_gradients():
    """A callback raising ``accumulate_grad_batches`` mid-epoch: megatrain's first longer step holds only its own
    micro-batches' gradients, as plain Lightning does with the gradients zeroed after each step. Plain Lightning as
    it is skips ``zero_grad`` at that batch (its index is not a multiple of the new count) and adds the gradient it
    already applied once more (the documented difference, docs/compatibility.md)."""
    ours = _fit(LM(make_model("llama"), lr=1e-2), "megatrain", [AccumulateMoreMidEpoch()], steps=5)
    ref = _fit(LM(make_model("llama"), lr=1e-2), "auto", [AccumulateMoreMidEpoch(), ZeroGradientsAfterEachStep()],
               steps=5)
    assert_parity(ours, ref, ours.losses, ref.losses)
    plain = _fit(LM(make_model("llama"), lr=1e-2), "auto", [AccumulateMoreMidEpoch()], steps=5)
    assert plain.losses[:3] == ref.losses[:3] and plain.losses[3:] != ref.losses[3:]


def test_accumulation_scheduled_by_epoch_trains_like_plain_lightning():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    ours = _fit(LM(make_model("llama"), lr=1e-2), "megatrain", [GradientAccumulationScheduler({1: 2})], epochs=2)
    ref = _fit(LM(make_model("llama"), lr=1e-2), "auto", [GradientAccumulationScheduler({1: 2})], epochs=2)
    assert_parity(ours, ref, ours.losses, ref.losses)
