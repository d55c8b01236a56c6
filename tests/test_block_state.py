"""Buffers a block's forward updates (BatchNorm running statistics) are updated once per forward, as in plain
PyTorch, although a recomputed block runs its forward again in backward, and the recompute runs with the
``training`` flags its forward saw when ``training_step`` switches modes in between (engine/block_state.py).

Reference: the same LightningModule trained by plain Lightning (``strategy="auto"``) from the same initial weights.
Before the fix, each recompute updated the statistics a second time (``num_batches_tracked`` 2x, running mean 65%
off, validation loss 5% off) while the training losses and weights stayed equal."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from megatrain_lightning import testing as T
from megatrain_lightning.strategy import MegaTrainStrategy


class Layer(nn.Module):
    """A block whose forward updates buffers: Linear -> BatchNorm1d -> tanh, residual; ``[B, D] -> [B, D]``."""

    def __init__(self, d: int):
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.fc(x)))


class Net(pl.LightningModule):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.out = nn.Linear(d, 3)
        self.val = []

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.val.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)), batch_size=4)


def fit(net: Net, strategy) -> Net:
    torch.manual_seed(1)  # the same dropout masks for both runs
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, limit_val_batches=2, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               accumulate_grad_batches=2, gradient_clip_val=1.0).fit(net, data(1), data(2))
    return net


@pytest.mark.parametrize("kw", [{}, {"recompute": "selective"}, {"recompute_every": 2}, {"offload_activations": True}],
                         ids=["block", "selective", "recompute_every", "offload"])
def test_batchnorm_statistics_updated_once_per_forward(kw):
    init = Net()
    plain = fit(copy.deepcopy(init), "auto")
    ours = fit(copy.deepcopy(init), MegaTrainStrategy(block_names=["layers.*"], **kw))
    for (name, a), (_, b) in zip(ours.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b) if not a.is_floating_point() else T.rel(a, b) <= 1e-5, (name, a, b)
    assert int(ours.layers[0].bn.num_batches_tracked) == 12  # 2 epochs x 6 micro-batches, once each
    for (name, a), (_, b) in zip(ours.named_parameters(), plain.named_parameters()):
        assert T.rel(a, b) <= 1e-5, name
    assert ours.val == pytest.approx(plain.val, rel=1e-5)


class DropLayer(Layer):
    """:class:`Layer` with dropout after the BatchNorm: a mode switch changes both the mask and the statistics."""

    def __init__(self, d: int):
        super().__init__(d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.bn(self.fc(x))))


class SwitchNet(Net):
    """``training_step`` switches modes around its forward: ``"eval_forward"`` runs the forward under ``eval()``
    and goes back to ``train()`` before returning the loss (a step without dropout); ``"eval_before_backward"``
    runs it in training mode and calls ``eval()`` before returning (backward then runs with eval flags);
    ``"bn_eval"`` sets only the BatchNorm layers to eval for the forward (frozen statistics), then back;
    ``"eval_then_train"`` adds the losses of an eval-mode and a train-mode forward (one backward). Without the
    clones of the running statistics between the two, plain PyTorch's backward of the first forward reads the
    statistics the second updated in place (BatchNorm's kernel does not bump their version counter, so autograd does
    not notice), the gradient of another function than the loss computed; the strategy's recompute reads what the
    forward read, with or without the clones."""

    def __init__(self, switch: str):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(DropLayer(16) for _ in range(4))
        self.switch = switch

    def training_step(self, batch, i):
        x, y = batch
        bns = [m for m in self.modules() if isinstance(m, nn.BatchNorm1d)]
        if self.switch == "eval_then_train":  # two forwards, one backward: the second updates what the first read
            self.eval()
            first = nn.functional.cross_entropy(self(x), y)
            for m in bns:  # new tensors for the update: plain autograd's saved statistics stay those the first read
                m.running_mean, m.running_var = m.running_mean.clone(), m.running_var.clone()
            self.train()
            return first + nn.functional.cross_entropy(self(x), y)
        if self.switch == "eval_forward":
            self.eval()
        elif self.switch == "bn_eval":
            for m in bns:
                m.eval()
        loss = nn.functional.cross_entropy(self(x), y)
        if self.switch == "eval_before_backward":
            self.eval()
        else:
            self.train()
        return loss

    def on_train_batch_end(self, *args):
        self.train()  # the next step starts in training mode (after eval_before_backward's backward)


@pytest.mark.parametrize("kw", [{}, {"recompute": "selective"}, {"recompute_every": 2}], ids=["block", "selective", "recompute_every"])
@pytest.mark.parametrize("switch", ["eval_forward", "eval_before_backward", "bn_eval", "eval_then_train"])
def test_mode_switched_between_forward_and_backward(switch, kw):
    """The recompute runs with the ``training`` flags the forward saw, not the backward-time ones (fails before:
    other dropout masks and BatchNorm statistics in the recompute, weights 13-20% off plain Lightning's)."""
    init = SwitchNet(switch)
    plain = fit(copy.deepcopy(init), "auto")
    ours = fit(copy.deepcopy(init), MegaTrainStrategy(block_names=["layers.*"], **kw))
    for (name, a), (_, b) in zip(ours.named_parameters(), plain.named_parameters()):
        assert T.rel(a, b) <= 1e-5, name
    for (name, a), (_, b) in zip(ours.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b) if not a.is_floating_point() else T.rel(a, b) <= 1e-5, (name, a, b)
    assert [m.training for m in ours.modules()] == [m.training for m in plain.modules()]  # the user's flags are back
