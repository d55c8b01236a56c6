"""A streamed block's training forward runs in grad mode keeping its saved tensors only while the call runs
(``engine/boundary/forward.py``): what plain PyTorch lets a block's forward do must give plain PyTorch's numbers.

Trying the product found two regressions of the first grad-mode forward (which saved nothing at all): a module
returning its own parameter (the README's soft-prompt advice) returned zeros, and a ``torch.autograd.grad``
inside a block's forward (gradient features, fast weights) raised. Reference: the same LightningModule trained
with ``strategy="auto"`` (plain PyTorch), fp32, compared per step and on the final weights.
"""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, freeze_key_biases, make_data, make_model, rel


def _fit(lm: LM, strategy, steps: int, n: int) -> LM:
    torch.manual_seed(0)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
               ).fit(lm, make_data(n=n))
    return lm


def _assert_same(a: LM, b: LM, tol: float) -> None:
    assert len(a.losses) == len(b.losses) > 0
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert abs(x - y) <= tol * abs(y), f"step {i}: loss {x} vs plain {y}"
    ref = dict(b.named_parameters())
    for k, p in a.named_parameters():
        assert rel(p.detach(), ref[k].detach()) <= tol, k


class Prompt(nn.Module):
    """A soft prompt: a module whose forward returns its own parameter (``[4, 32]`` fp32)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * 0.5)

    def forward(self) -> torch.Tensor:
        return self.p


class PromptLM(LM):
    def __init__(self):
        super().__init__(make_model("llama", num_hidden_layers=2))
        freeze_key_biases(self.model)
        self.prompt = Prompt()
        self.first_sum = None

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        p = self.prompt()
        if self.first_sum is None:
            self.first_sum = float(p.sum())
        emb = torch.cat([p.expand(ids.shape[0], 4, 32), self.model.get_input_embeddings()(ids)], 1)
        labels = torch.cat([torch.full((ids.shape[0], 4), -100), ids], 1)
        loss = self.model(inputs_embeds=emb, labels=labels).loss
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("recompute", ["block", "none"])
def test_a_module_returning_its_parameter_trains_as_plain(recompute):
    """The prompt's value reaches the loss (it was zeros: 0.0 against 2.87) and trains as in plain PyTorch."""
    ours = _fit(PromptLM(), MegaTrainStrategy(recompute=recompute), steps=4, n=8)
    plain = _fit(PromptLM(), "auto", steps=4, n=8)
    assert ours.first_sum == plain.first_sum != 0.0
    _assert_same(ours, plain, 1e-6)


class GradFeatureMLP(nn.Module):
    """An MLP plus a feature computed by ``torch.autograd.grad`` of a detached sub-graph inside the forward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            xx = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(torch.tanh(xx * 1.3).pow(2).sum(), xx)
        return self.inner(x) + 0.1 * g


def _grad_feature_lm() -> LM:
    m = make_model("llama", num_hidden_layers=4)
    freeze_key_biases(m)
    for layer in m.model.layers:
        layer.mlp = GradFeatureMLP(layer.mlp)
    return LM(m)


@pytest.mark.parametrize("recompute,every", [("block", 1), ("selective", 2), ("none", 1)])
def test_autograd_grad_inside_a_block_forward_trains_as_plain(recompute, every):
    """It raised in the forward under ``"block"`` and in the recompute chains of ``recompute_every=2``."""
    ours = _fit(_grad_feature_lm(), MegaTrainStrategy(recompute=recompute, recompute_every=every), steps=3, n=6)
    plain = _fit(_grad_feature_lm(), "auto", steps=3, n=6)
    _assert_same(ours, plain, 1e-6)


class SteerLM(LM):
    """A steering vector owned by the LightningModule (``[32]``), added by a forward hook on layer 0's MLP (inside a
    streamed block, ``inner=True``) or on layer 0 itself."""

    def __init__(self, inner: bool):
        super().__init__(make_model("llama", num_hidden_layers=2))
        freeze_key_biases(self.model)
        self.steer = nn.Linear(32, 32)
        layer = self.model.model.layers[0]
        target = layer.mlp if inner else layer

        def hook(module, args, out):
            if isinstance(out, tuple):
                return (out[0] + self.steer(out[0]),) + tuple(out[1:])
            return out + self.steer(out)
        target.register_forward_hook(hook)


@pytest.mark.parametrize("recompute", ["block", "none"])
def test_a_parameter_from_outside_the_block_read_inside_it_is_refused(recompute):
    """Its gradient was lost silently (2.9e-2 off plain after 6 steps): refused in the first training forward,
    naming the block and the parameter; the same hook on the block itself trains as plain PyTorch."""
    refusing = MegaTrainStrategy(recompute=recompute)
    with pytest.raises(RuntimeError, match="streamed block model.model.layers.0 used parameter steer\\.(weight|bias).*register "
                                           "the hook on the block itself"):
        _fit(SteerLM(inner=True), refusing, steps=2, n=4)
    assert refusing.engine.acct.live == 0  # the refused block's device buffers are not counted as live
    torch.manual_seed(7)
    ours = _fit(SteerLM(inner=False), MegaTrainStrategy(recompute=recompute), steps=3, n=6)
    torch.manual_seed(7)
    plain = _fit(SteerLM(inner=False), "auto", steps=3, n=6)
    _assert_same(ours, plain, 1e-6)


class _HookLater(pl.Callback):
    """Registers a steering hook on layer 0's MLP (inside the streamed block) after the first training step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            steer = pl_module.steer
            pl_module.model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out + steer(out))


def test_a_parameter_from_outside_the_block_read_by_a_hook_added_mid_fit_is_refused():
    """The check ran at a block's first training call only: a hook added by a callback after step 0 trained without
    the steering gradient silently. Registering any hook makes every block be checked again at its next call."""
    lm = SteerLM(inner=False)
    lm.model.model.layers[0]._forward_hooks.clear()  # start with no steering hook at all
    trainer = pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", devices=1, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[_HookLater()])
    with pytest.raises(RuntimeError, match="streamed block model.model.layers.0 used parameter steer\\.(weight|bias)"):
        trainer.fit(lm, make_data(n=6))
    assert len(lm.losses) == 1  # the first step trained; the second (first with the hook) was refused
