"""``param.grad`` in ``on_after_backward``: the accumulated gradients, readable and editable, as plain Lightning
shows them (before, it was ``None`` there: reads saw nothing, edits were lost). Reference: the same module and
callback under plain Lightning (``strategy="auto"``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, assert_parity, batch_inputs, make_data, make_model, rel


class EditAfterBackward(Callback):
    """Records every gradient's norm after each backward, then scales the gradients of the attention
    projections by 0.5 in place and replaces the MLP's with ``2 * grad`` (every micro-batch)."""

    def __init__(self):
        self.norms: list[torch.Tensor] = []

    def on_after_backward(self, trainer, pl_module):
        self.norms.append(torch.stack([p.grad.norm() if p.grad is not None else torch.zeros(())
                                       for p in pl_module.parameters()]))
        for name, p in pl_module.named_parameters():
            if p.grad is None:
                continue
            if "self_attn" in name:
                p.grad.mul_(0.5)
            elif "mlp" in name:
                p.grad = p.grad * 2.0


def _train(strategy, callback, opt_kwargs=None, **kw):
    lm = LM(make_model("llama"), lr=1e-2, opt_kwargs=opt_kwargs)
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, accumulate_grad_batches=2, enable_checkpointing=False,
               logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
               **kw).fit(lm, make_data(n=16))
    return lm


def test_on_after_backward_reads_and_edits_like_plain_lightning():
    """Accumulation 2 and norm clipping: the norms read after every micro-batch's backward (the running sums) and
    the trained weights match plain Lightning's."""
    ours_cb, plain_cb = EditAfterBackward(), EditAfterBackward()
    ours = _train("megatrain", ours_cb, gradient_clip_val=0.05)
    plain = _train("auto", plain_cb, gradient_clip_val=0.05)
    assert_parity(ours.model, plain.model, ours.losses, plain.losses)
    assert len(ours_cb.norms) == len(plain_cb.norms) == 8
    for a, b in zip(ours_cb.norms, plain_cb.norms):
        assert rel(a, b) <= 1e-5


def test_on_after_backward_with_the_16_mixed_loss_scale():
    """16-mixed (fp16 on the CPU, dynamic loss scale): ``on_after_backward`` sees the scaled gradients, as under
    Lightning's own 16-mixed; the edits still train like plain Lightning."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from megatrain_lightning import MegaTrainPrecision

    ours_cb, plain_cb = EditAfterBackward(), EditAfterBackward()
    fused = {"fused": True}  # the kernel HostAdamW runs: only the precision semantics are compared
    ours = _train(MegaTrainStrategy(), ours_cb, fused, plugins=[MegaTrainPrecision("16-mixed")])
    plain = _train("auto", plain_cb, fused, plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    assert_parity(ours.model, plain.model, ours.losses, plain.losses)
    for a, b in zip(ours_cb.norms, plain_cb.norms):
        assert rel(a, b) <= 1e-5
    assert float(ours_cb.norms[0].max()) > 100.0  # scaled by 2**16


class DiscardFirstBackward(LM):
    """Manual optimization: a first backward (of three times the loss of a second forward) whose gradients are
    dropped with ``module.zero_grad()`` (``how="module"``) or ``p.grad = None`` for every parameter (``"none"``),
    then the real backward and the step."""

    def __init__(self, model, how: str):
        super().__init__(model, lr=1e-2)
        self.automatic_optimization = False
        self.how = how

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.model(**batch_inputs(batch)).loss
        self.losses.append(loss.item())
        self.manual_backward(self.model(**batch_inputs(batch)).loss * 3)
        if self.how == "module":
            self.zero_grad()
        else:
            for p in self.parameters():
                p.grad = None
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["module", "none"])
def test_module_zero_grad_between_manual_backwards_drops_the_gradients(how):
    """``module.zero_grad()`` (or every ``p.grad = None``) after a ``manual_backward`` forgets its gradients, as
    ``opt.zero_grad()`` does (before, it was refused as a hook that set one parameter's gradient to ``None``)."""
    def run(strategy):
        lm = DiscardFirstBackward(make_model("llama"), how)
        pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, enable_checkpointing=False, logger=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(lm, make_data(n=8))
        return lm

    ours, plain = run("megatrain"), run("auto")
    assert_parity(ours.model, plain.model, ours.losses, plain.losses)
