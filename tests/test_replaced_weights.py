"""Parameters whose ``.data`` is replaced behind the engine's back: by user code (``param.data = tensor`` in a
hook), or by another Trainer that trained the same module since this Trainer last ran.

Regressions: an assignment ``param.data = zeros`` in ``on_train_start`` was silently ignored,
also after the documented ``trainer.strategy.weights_written()`` (weights 1.01 relative off plain Lightning); and
``tr1.fit(lm); tr2.fit(lm); tr1.fit(lm)`` restarted from tr1's own store, discarding tr2's training and
overwriting the module (``tr1.validate`` likewise evaluated the stale weights). Plain Lightning is the reference.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, learnable_data, make_model, rel


def _trainer(strategy, **kw):
    return pl.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _strategy(tier, tmp_path):
    if tier == "ram":
        return MegaTrainStrategy()
    return MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))


class AssignOnTrainStart(LM):
    """Replaces one weight's tensor in ``on_train_start`` (and, optionally, tells the strategy)."""

    def __init__(self, model, tell: bool):
        super().__init__(model, lr=1e-2)
        self.tell = tell

    def on_train_start(self):
        w = self.model.model.layers[1].mlp.up_proj.weight
        w.data = torch.full_like(w.data, 0.01)
        if self.tell and hasattr(self.trainer.strategy, "weights_written"):  # megatrain's (plain has none)
            self.trainer.strategy.weights_written()


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("tell", [False, True], ids=["assigned", "assigned_weights_written"])
def test_a_tensor_assigned_to_param_data_is_trained_like_plain_lightning(tier, tell, tmp_path):
    model = make_model("llama")
    out = []
    for strategy in ("auto", _strategy(tier, tmp_path)):
        m = AssignOnTrainStart(copy.deepcopy(model), tell)
        _trainer(strategy, max_steps=4).fit(m, learnable_data(n=8, batch_size=2))
        out.append(m)
    plain, ours = out
    assert ours.losses == pytest.approx(plain.losses, rel=1e-6)
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours.parameters(), plain.parameters()))
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_going_back_to_an_earlier_trainer_continues_from_the_modules_weights(tier, tmp_path):
    """tr1.fit, tr2.fit, tr1.validate and tr1.fit again: both see the weights tr2 left, as with plain Lightning."""
    model = make_model("llama")
    data = learnable_data(n=8, batch_size=2)
    results = {}
    for d in ("tr1", "tr2"):  # each Trainer's NVMe store has its own directory (a store is locked while open)
        (tmp_path / d).mkdir()
    for name in ("auto", "megatrain"):
        lm = LM(copy.deepcopy(model), lr=1e-2)
        s = (lambda d: "auto") if name == "auto" else (lambda d: _strategy(tier, tmp_path / d))
        tr1, tr2 = _trainer(s("tr1"), max_epochs=1), _trainer(s("tr2"), max_epochs=1)
        tr1.fit(lm, data)
        tr2.fit(lm, data)
        after2 = [p.detach().clone() for p in lm.parameters()]
        (val,) = tr1.validate(lm, data, verbose=False)
        tr1.fit_loop.max_epochs = 2
        tr1.fit(lm, data)
        results[name] = (lm, after2, val["val_loss"])
    (plain, plain2, plain_val), (ours, ours2, our_val) = results["auto"], results["megatrain"]
    assert max(rel(a, b) for a, b in zip(ours2, plain2)) <= 1e-6
    assert our_val == pytest.approx(plain_val, rel=1e-6)
    assert ours.losses == pytest.approx(plain.losses, rel=1e-6) and len(ours.losses) == 12
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours.parameters(), plain.parameters()))
    assert worst <= 1e-6, worst


def test_model_pruning_is_refused_before_training():
    from lightning.pytorch.callbacks import ModelPruning

    lm = LM(make_model("llama"), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"ModelPruning callback prunes during fit.*Prune before trainer.fit"):
        _trainer(MegaTrainStrategy(), max_epochs=2, callbacks=[ModelPruning("l1_unstructured", amount=0.3)]).fit(
            lm, learnable_data(n=8, batch_size=2))
    assert lm.losses == []  # before any step


def test_a_parameter_pruned_during_fit_is_named_not_a_key_error():
    """Pruning by hand in a hook (what ModelPruning does): the first block call after it names the parameter."""
    from torch.nn.utils import prune

    class PruneAfterFirstStep(LM):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:
                prune.l1_unstructured(self.model.model.layers[0].mlp.up_proj, "weight", amount=0.3)

    lm = PruneAfterFirstStep(make_model("llama"), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.up_proj\.weight was re-registered as 'weight_orig'"):
        _trainer(MegaTrainStrategy(), max_steps=3).fit(lm, learnable_data(n=8, batch_size=2))
