"""``optimizer_in_backward`` and user code that sees the step's gradients.

Regression: only the LightningModule's ``on_before_optimizer_step`` / ``configure_gradient_clipping`` /
``optimizer_step`` overrides turned the update-in-backward off. A callback's ``on_before_optimizer_step`` (a
gradient clipper or norm logger) or an ``on_after_backward`` override ran after the AdamW update had been applied
in the backward: its edits were lost (weights 0.89 relative off plain Lightning with the gradients zeroed, also
on the NVMe tier, where the schedule is on by default) and it read zero gradients. Such code now keeps the deferred
schedule, and the numbers are plain Lightning's.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, make_data, make_model, rel


def _grads(module):
    return [p.grad for p in module.parameters() if p.grad is not None]


class ScaleBeforeStep(pl.Callback):
    """Halves every gradient before the optimizer step and records the gradient norm it saw."""

    def __init__(self):
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        g = _grads(pl_module)
        if g:  # none with the gradients on NVMe
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))))
        for x in g:
            x.mul_(0.5)


class NoiseAfterBackward(pl.Callback):
    """Adds seeded noise to the gradients after each backward."""

    def on_after_backward(self, trainer, pl_module):
        gen = torch.Generator().manual_seed(trainer.global_step)
        for x in _grads(pl_module):
            x.add_(1e-3 * torch.randn(x.shape, generator=gen))


class ScaledLM(LM):
    """A LightningModule whose ``on_after_backward`` rescales the gradients."""

    def on_after_backward(self):
        for x in _grads(self):
            x.mul_(0.25)


class RecordSchedule(pl.Callback):
    """Records, per training batch, whether the engine applied the AdamW updates in the backward."""

    def __init__(self):
        self.in_backward: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.in_backward.append(bool(trainer.strategy.engine.update_in_backward))


def _fit(strategy, module, callbacks):
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks
               ).fit(module, make_data(n=8, batch_size=2))


@pytest.mark.parametrize("case", ["callback_before_step", "callback_after_backward", "module_after_backward",
                                  "nvme_params_only"])
def test_code_that_sees_the_gradients_gets_plain_lightnings_numbers(case, tmp_path):
    model = make_model("llama")
    module_cls = ScaledLM if case == "module_after_backward" else LM
    make_cb = {"callback_before_step": ScaleBeforeStep, "nvme_params_only": ScaleBeforeStep,
               "callback_after_backward": NoiseAfterBackward}.get(case)
    # masters on NVMe, optimizer state and gradients in RAM: param.grad is shown, the update-in-backward is on
    strategy = (MegaTrainStrategy(offload_params="nvme", offload_optimizer="cpu", nvme_path=str(tmp_path),
                                  optimizer_in_backward=True)
                if case == "nvme_params_only" else MegaTrainStrategy(optimizer_in_backward=True))
    out = []
    for s in ("auto", strategy):
        module = module_cls(copy.deepcopy(model), lr=1e-2)
        cbs = [make_cb()] if make_cb else []
        _fit(s, module, cbs)
        out.append((module, cbs))
    (plain, plain_cbs), (ours, our_cbs) = out
    assert ours.losses == pytest.approx(plain.losses, rel=1e-6)
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours.parameters(), plain.parameters()))
    assert worst <= 1e-6, worst
    if isinstance(plain_cbs[0] if plain_cbs else None, ScaleBeforeStep):
        assert our_cbs[0].norms == pytest.approx(plain_cbs[0].norms, rel=1e-6) and min(plain_cbs[0].norms) > 0


def test_without_such_code_the_update_still_runs_in_the_backward():
    rec = RecordSchedule()
    _fit(MegaTrainStrategy(optimizer_in_backward=True), LM(make_model("llama"), lr=1e-2), [rec])
    assert rec.in_backward == [True] * 4


def test_gradient_hooks_with_the_gradients_on_nvme_are_warned_about(tmp_path):
    """With the optimizer (and the gradient accumulators) on NVMe, param.grad is None in those hooks (documented):
    a warning at setup names them instead of letting their edits be silent no-ops."""
    with pytest.warns(UserWarning, match=r"param.grad is None in ScaleBeforeStep.on_before_optimizer_step"):
        _fit(MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path)),
             LM(make_model("llama"), lr=1e-2), [ScaleBeforeStep()])


def test_explicit_optimizer_in_backward_says_why_it_steps_aside():
    """``optimizer_in_backward=True`` with ``gradient_clip_val`` (or code that sees the step's gradients) runs the
    deferred schedule (same numbers): asked for explicitly, that is said at setup, not silent."""
    rec = RecordSchedule()
    with pytest.warns(UserWarning, match=r"optimizer_in_backward=True is not used with gradient_clip_val.*"
                                         r"code that sees the step's gradients"):
        pl.Trainer(strategy=MegaTrainStrategy(optimizer_in_backward=True), accelerator="cpu", max_steps=2, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   gradient_clip_val=1.0, callbacks=[rec, ScaleBeforeStep()]).fit(LM(make_model("llama"), lr=1e-2),
                                                                                  make_data(n=4, batch_size=2))
    assert rec.in_backward == [False] * 2
