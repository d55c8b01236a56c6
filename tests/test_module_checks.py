"""Models whose blocks pass state in unusual ways.

Reference: the same LightningModule under plain Lightning (``strategy="auto"``), same initial weights. Before the
fixes: a block called with (or returning) its hidden state inside a plain ``@dataclass`` trained the embedding and
every block but the last not at all, silently (weights 100% off); two parameters sharing memory (one made from the
other's ``.data``) stopped being tied (17% off); an fp64 model was trained in fp32 without a word; a block that
edits one of its parameters in place after using another failed with autograd's version-counter error naming the
wrong tensor; ``model.forward = torch.compile(model.forward)`` crashed inside Dynamo instead of the documented
refusal.
"""

from __future__ import annotations

import copy
import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from megatrain_lightning import testing as T
from megatrain_lightning.strategy import MegaTrainStrategy


@dataclasses.dataclass
class State:
    h: torch.Tensor


class Block(nn.Module):
    """``h + tanh(lin(norm(h)))`` on ``[B, T, 16]``; ``wrap``: takes and returns a :class:`State`; ``clamp``: clamps
    its own ``scale`` parameter in place after its Linear ran (a constraint inside the forward)."""

    def __init__(self, wrap: bool = False, clamp: bool = False):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(16), nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.full((16,), 0.9))
        self.wrap, self.clamp = wrap, clamp

    def forward(self, x):
        h = x.h if self.wrap else x
        y = torch.tanh(self.lin(self.norm(h)))
        if self.clamp:
            with torch.no_grad():
                self.scale.clamp_(0.0, 0.8)
        out = h + y * self.scale
        return State(out) if self.wrap else out


class Net(pl.LightningModule):
    def __init__(self, wrap: bool = False, clamp: bool = False, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(Block(wrap, clamp) for _ in range(n))
        self.head = nn.Linear(16, 32)
        self.wrap = wrap
        self.losses: list[float] = []

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(State(h) if self.wrap else h)
            h = h.h if self.wrap else h
        return self.head(h)

    def training_step(self, batch, i):
        (ids,) = batch
        loss = nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(module, strategy, steps: int = 4):
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(module, DataLoader(TensorDataset(ids), 2))
    return module


def _streamed(**kw):
    return MegaTrainStrategy(block_names=["layers.*"], **kw)


@pytest.mark.parametrize("recompute", ["block", "none"])
def test_tensors_inside_a_dataclass_are_refused_then_train_once_registered(recompute):
    with pytest.raises(RuntimeError, match=r"layers.0 was called with tensors inside an object.*\(State.h\)"):
        _fit(Net(wrap=True), _streamed(recompute=recompute))
    torch.utils._pytree.register_dataclass(State)  # what the message says to do
    try:
        ref = _fit(Net(wrap=True), "auto")
        ours = _fit(Net(wrap=True), _streamed(recompute=recompute))
        T.assert_parity(ours, ref, ours.losses, ref.losses)
    finally:
        torch.utils._pytree._deregister_pytree_node(State)


class Returns(Block):
    def forward(self, x):
        return State(super().forward(x))


def test_a_block_returning_a_dataclass_is_refused():
    net = Net()
    net.layers = nn.ModuleList(Returns() for _ in range(3))
    net.forward = lambda ids: net.head(_chain(net, ids))
    with pytest.raises(RuntimeError, match=r"layers.0 returned tensors inside an object.*\(State.h\)"):
        _fit(net, _streamed())


def _chain(net, ids):
    h = net.emb(ids)
    for layer in net.layers:
        h = layer(h).h
    return h


def test_in_place_constraint_on_a_parameter_inside_a_block_matches_plain():
    ref = _fit(Net(clamp=True), "auto")
    for rc in ("block", "selective", "none"):
        ours = _fit(Net(clamp=True), _streamed(recompute=rc))
        T.assert_parity(ours, ref, ours.losses, ref.losses)


def test_parameters_sharing_memory_are_refused():
    net = Net()
    net.layers[2].lin.weight = nn.Parameter(net.layers[0].lin.weight.data)  # tied through .data: one storage
    with pytest.raises(RuntimeError, match=r"layers.0.lin.weight and layers.2.lin.weight share memory"):
        _fit(net, _streamed())
    ok = Net()
    ok.layers[2].lin.weight = ok.layers[0].lin.weight  # tied as one parameter object: fine
    _fit(ok, _streamed(), steps=1)
    big = torch.randn(16, 32)
    ref, ours = Net(), Net()
    for net in (ref, ours):  # interleaved views of one tensor share no element: not refused, trained as plain
        b = big.clone()
        net.layers[0].lin.weight = nn.Parameter(b[:, 0::2])
        net.layers[1].lin.weight = nn.Parameter(b[:, 1::2])
    _fit(ref, "auto")
    _fit(ours, _streamed())
    T.assert_parity(ours, ref, ours.losses, ref.losses)


def test_float64_parameters_are_refused():
    with pytest.raises(RuntimeError, match=r"parameters are float64 .*model.float\(\)"):
        _fit(Net().double(), _streamed(), steps=1)


def test_compiled_forward_attribute_is_refused():
    net = Net()
    plain = copy.deepcopy(net)
    plain.forward = torch.compile(plain.forward, backend="eager")
    _fit(plain, "auto", steps=1)  # the reference: plain Lightning trains it
    net.forward = torch.compile(net.forward, backend="eager")
    with pytest.raises(RuntimeError, match=r"its forward is torch.compile"):
        _fit(net, _streamed(), steps=1)


class InPlaceInput(Block):
    def forward(self, x):
        x += 1.0  # plain PyTorch allows it: x is the caller's non-leaf activation
        return super().forward(x)


@pytest.mark.parametrize("recompute", ["block", "none"])
def test_in_place_write_to_a_block_input_is_explained(recompute):
    net = Net()
    net.layers = nn.ModuleList(InPlaceInput() for _ in range(3))
    _fit(copy.deepcopy(net), "auto", steps=1)
    with pytest.raises(RuntimeError, match=r"streamed block layers.\d modifies one of its tensor inputs in place"):
        _fit(net, _streamed(recompute=recompute), steps=1)
