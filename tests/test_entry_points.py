"""State carried across Trainer entry points follows plain Lightning.

Plain Lightning calls ``configure_optimizers`` at every ``fit`` and starts a fresh AdamW (step 0,
zero ``exp_avg``/``exp_avg_sq``); ``ckpt_path`` restores the saved state. Each sequence below runs
twice, once with ``strategy="auto"`` and once with ours, from the same weights, data and seed, and
compares every weight (and the AdamW state) afterwards.
"""

from __future__ import annotations


import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.tuner import Tuner

import megatrain_lightning  # noqa: F401
from megatrain_lightning.testing import LM, make_data, make_model, rel

TOL = 1e-5


def _trainer(strategy: str, tmp_path, **kw):
    base = dict(strategy=strategy, accelerator="cpu", max_steps=3, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                default_root_dir=str(tmp_path))
    base.update(kw)
    return pl.Trainer(**base)


def _strategy(name: str, tmp_path):
    if name == "megatrain_nvme":
        from megatrain_lightning import MegaTrainStrategy

        tmp_path.mkdir(parents=True, exist_ok=True)
        return MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                                 host_memory_limit="256MiB")
    return name


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        r = rel(pa[k].detach(), pb[k].detach())
        assert r <= TOL, f"{what}: {k} differs from plain Lightning by {r:.2e} (relative)"


def _fit_twice(strategy, tmp_path, optimizer=torch.optim.AdamW):
    lm = LM(make_model("llama"), optimizer=optimizer)
    data = make_data(n=16)
    trainer = _trainer(strategy, tmp_path)
    trainer.fit(lm, data)
    trainer.fit_loop.epoch_loop.max_steps = 5  # continue on the same Trainer: a fresh AdamW
    trainer.fit(lm, data)
    return lm


@pytest.mark.parametrize("ours,optimizer", [("megatrain", torch.optim.AdamW), ("megatrain_nvme", torch.optim.AdamW),
                                            ("megatrain", torch.optim.Adafactor), ("megatrain_nvme", torch.optim.NAdam)])
def test_second_fit_on_same_trainer_starts_a_fresh_optimizer(ours, optimizer, tmp_path):
    ref = _fit_twice("auto", tmp_path / "ref", optimizer)
    got = _fit_twice(_strategy(ours, tmp_path / "store"), tmp_path / "ours", optimizer)
    _assert_same_weights(got, ref, f"{ours}, {optimizer.__name__}: fit, then fit again")


def _lr_find_then_fit(strategy, tmp_path, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    lm = LM(make_model("llama"), lr=1e-3, optimizer=optimizer)
    data = make_data(n=32)
    trainer = _trainer(strategy, tmp_path, max_steps=4)
    Tuner(trainer).lr_find(lm, train_dataloaders=data, num_training=6, min_lr=1e-4, max_lr=1e-2, update_attr=False)
    trainer.fit(lm, data)
    return lm


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_lr_find_then_fit_matches_plain_lightning(tmp_path, optimizer):
    ref = _lr_find_then_fit("auto", tmp_path / "ref", optimizer)
    got = _lr_find_then_fit("megatrain", tmp_path / "ours", optimizer)
    _assert_same_weights(got, ref, f"{optimizer.__name__}: lr_find, then fit")


class BatchLM(LM):
    """An ``LM`` with a ``batch_size`` attribute its own training loader uses (what the batch-size finders tune)."""

    def __init__(self, model):
        super().__init__(model)
        self.batch_size = 2

    def train_dataloader(self):
        return make_data(n=32, batch_size=self.batch_size)

    validation_step = None  # no validation loop: the finders then tune the training loop


def _scale_batch_size_then_fit(strategy, tmp_path):
    lm = BatchLM(make_model("llama"))
    trainer = _trainer(strategy, tmp_path, max_steps=3)
    Tuner(trainer).scale_batch_size(lm, mode="power", steps_per_trial=1, init_val=2, max_trials=2)
    trainer.fit(lm)
    return lm


def test_scale_batch_size_then_fit_matches_plain_lightning(tmp_path):
    ref = _scale_batch_size_then_fit("auto", tmp_path / "ref")
    got = _scale_batch_size_then_fit("megatrain", tmp_path / "ours")
    assert got.batch_size == ref.batch_size
    _assert_same_weights(got, ref, "scale_batch_size, then fit")


def _validate_test_predict_between_fits(strategy, tmp_path):
    lm = LM(make_model("llama"))
    lm.test_step = lm.validation_step
    lm.predict_step = lambda batch, batch_idx: lm.model(input_ids=batch[0]).logits
    data = make_data(n=16)
    trainer = _trainer(strategy, tmp_path)
    trainer.fit(lm, data)
    trainer.validate(lm, make_data(n=4, seed=5))
    trainer.test(lm, make_data(n=4, seed=5))
    preds = trainer.predict(lm, make_data(n=2, seed=5))
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(lm, data)
    return lm, preds


def test_validate_test_predict_between_two_fits(tmp_path):
    ref, ref_preds = _validate_test_predict_between_fits("auto", tmp_path / "ref")
    got, got_preds = _validate_test_predict_between_fits("megatrain", tmp_path / "ours")
    assert rel(got_preds[0], ref_preds[0]) <= TOL
    _assert_same_weights(got, ref, "fit, validate, test, predict, fit")


def _second_trainer(strategy, tmp_path):
    lm = LM(make_model("llama"))
    data = make_data(n=16)
    _trainer(strategy, tmp_path / "a").fit(lm, data)
    _trainer(strategy, tmp_path / "b", max_steps=2).fit(lm, data)
    return lm


def test_second_trainer_on_same_module(tmp_path):
    ref = _second_trainer("auto", tmp_path / "ref")
    got = _second_trainer("megatrain", tmp_path / "ours")
    _assert_same_weights(got, ref, "two Trainers on one module")


def test_second_fit_with_ckpt_path_restores_the_optimizer(tmp_path):
    """fit 3 steps, save; fit again on the same Trainer with ckpt_path: the saved moments come back
    (same as one Trainer resuming in plain Lightning from its own .ckpt file)."""
    def run(strategy, root):
        lm = LM(make_model("llama"))
        data = make_data(n=16)
        trainer = _trainer(strategy, root)
        trainer.fit(lm, data)
        trainer.save_checkpoint(str(root / "ck"))
        trainer.fit_loop.epoch_loop.max_steps = 5
        trainer.fit(lm, data)  # fresh optimizer: moves the weights on
        trainer2 = _trainer(strategy, root / "t2", max_steps=5)
        trainer2.fit(lm, data, ckpt_path=str(root / "ck"))  # back to step 3 weights + state, 2 more steps
        return lm

    ref = run("auto", tmp_path / "ref")
    got = run("megatrain", tmp_path / "ours")
    _assert_same_weights(got, ref, "resume from ckpt_path after a second fit")


def test_fresh_optimizer_state_is_zero(tmp_path):
    """After the second fit's first step the AdamW state is that of a fresh optimizer: exp_avg equals
    (1 - beta1) * grad of that step, as torch.optim.AdamW would hold it."""
    lm = LM(make_model("llama"))
    data = make_data(n=16)
    trainer = _trainer("megatrain", tmp_path)
    trainer.fit(lm, data)
    grads = {}

    class Grab(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for n, p in pl_module.named_parameters():
                if p.grad is not None:
                    grads[n] = p.grad.detach().clone()

    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.callbacks.append(Grab())
    trainer.fit(lm, data)
    opt = trainer.strategy.engine.optimizer
    for n, p in lm.named_parameters():
        st = opt.param_state(p)
        assert st is not None and float(st["step"]) == 1.0, n
        assert rel(st["exp_avg"], 0.1 * grads[n]) < 1e-6, n


def _finder_callback_fit(strategy, tmp_path, finder):
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    lm = BatchLM(make_model("llama"))
    cb = (BatchSizeFinder(mode="power", steps_per_trial=2, max_trials=2) if finder == "batch_size"
          else LearningRateFinder(min_lr=1e-4, max_lr=1e-2, num_training_steps=5, update_attr=False))
    _trainer(strategy, tmp_path, max_steps=3, callbacks=[cb]).fit(lm)
    return lm


@pytest.mark.parametrize("finder", ["batch_size", "lr"])
def test_finder_callbacks_inside_fit_start_the_fit_with_a_fresh_optimizer(finder, tmp_path):
    """``BatchSizeFinder`` / ``LearningRateFinder`` as callbacks run their trials inside ``fit`` with its optimizer,
    then restore a checkpoint saved before any step: the fit's first update is a first one, as plain Lightning's
    (before, the AdamW steps and moments of the trials were kept: the checkpoint had no state for them)."""
    ref = _finder_callback_fit("auto", tmp_path / "ref", finder)
    got = _finder_callback_fit("megatrain", tmp_path / "ours", finder)
    assert got.batch_size == ref.batch_size
    assert len(got.losses) == len(ref.losses)
    for a, b in zip(got.losses, ref.losses):
        assert abs(a - b) <= TOL * abs(b)
    _assert_same_weights(got, ref, f"{finder} finder callback, then fit")


def _fit_resize_fit(strategy, tmp_path):
    lm = LM(make_model("llama"))
    trainer = _trainer(strategy, tmp_path, max_steps=2)
    trainer.fit(lm, make_data(n=8))
    lm.model.resize_token_embeddings(104, mean_resizing=False)  # new embedding and head parameters
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(lm, make_data(n=8))
    return lm


def test_parameters_replaced_between_two_fits_train_like_plain_lightning(tmp_path):
    """``resize_token_embeddings`` between two ``fit`` calls on one Trainer: the second fit trains the new
    parameters (before, the store built for the old ones was kept, and the optimizer was refused as holding
    parameters "not part of the LightningModule")."""
    torch.manual_seed(0)
    ref = _fit_resize_fit("auto", tmp_path / "ref")
    torch.manual_seed(0)
    got = _fit_resize_fit("megatrain", tmp_path / "ours")
    assert got.model.get_input_embeddings().weight.shape[0] == 104
    _assert_same_weights(got, ref, "fit, resize_token_embeddings, fit")
