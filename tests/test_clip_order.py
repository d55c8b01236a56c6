"""Gradient clipping where user code runs after it (a ``configure_gradient_clipping`` override, manual optimization):
``param.grad`` shows the clipped gradients and edits after the clip come after it, as in plain Lightning.

Regression: the clip was only recorded and applied inside each slab's AdamW update, so an edit after
``clip_gradients`` (DP-SGD noise, a rescale) landed before the clip (weights 0.1-0.8 relative off plain Lightning
after 4 steps), a second clip measured unclipped gradients, and a logged norm after clipping was the unclipped one.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning.testing import LM, batch_inputs, make_data, make_model, rel


class ClipThenEdit(LM):
    """``configure_gradient_clipping``: ``ops`` in order, each ``("norm"|"value", limit)`` or ``("add"|"mul", x)``."""

    def __init__(self, model, ops):
        super().__init__(model, lr=1e-2)
        self.ops = ops

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        for op, x in self.ops:
            if op in ("norm", "value"):
                self.clip_gradients(optimizer, gradient_clip_val=x, gradient_clip_algorithm=op)
            else:
                for p in self.parameters():
                    if p.grad is not None:
                        p.grad.add_(x) if op == "add" else p.grad.mul_(x)


class ManualClipNoise(LM):
    """Manual optimization: clip by norm, log the clipped norm, add seeded noise (DP-SGD style), step."""

    def __init__(self, model):
        super().__init__(model, lr=1e-2)
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.model(**batch_inputs(batch)).loss
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        g = torch.Generator().manual_seed(batch_idx)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.add_(1e-3 * torch.randn(p.grad.shape, generator=g))
        opt.step()
        opt.zero_grad()
        return loss


def fit_both(make_module, **kw):
    model = make_model("llama")
    out = []
    for strategy in ("auto", "megatrain"):
        module = make_module(copy.deepcopy(model))
        pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kw).fit(module, make_data(n=8, batch_size=2))
        out.append(module)
    return out


@pytest.mark.parametrize("ops", [[("norm", 0.3), ("add", 1e-3)], [("value", 0.005), ("mul", 2.0)],
                                 [("value", 0.005), ("norm", 0.3)]], ids=["norm-then-add", "value-then-mul",
                                                                            "value-then-norm"])
def test_edits_after_a_clip_in_configure_gradient_clipping_come_after_it(ops):
    plain, ours = fit_both(lambda m: ClipThenEdit(m, ops))
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours.parameters(), plain.parameters()))
    assert worst <= 1e-6, worst


def test_manual_optimization_sees_and_edits_the_clipped_gradients():
    plain, ours = fit_both(ManualClipNoise)
    assert ours.norms == pytest.approx(plain.norms, rel=1e-6) and max(plain.norms) <= 0.3 + 1e-5
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours.parameters(), plain.parameters()))
    assert worst <= 1e-6, worst
