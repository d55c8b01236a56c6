"""A training step stopped at any point leaves a model that saves, resumes and trains on as plain Lightning's does,
or one that is refused.

Stops: Ctrl-C (a real ``SIGINT`` to this process) and an injected exception, in the forward, at three points of the
backward (after the first, the middle and the last decoder layer's backward) and in the step (after the backward,
where the precision plugin runs the pre-step hooks). Tiers: RAM with and without ``optimizer_in_backward``, NVMe with
it (its default) and without. After each stop: a save, resumed in a new Trainer to the end, and a second ``fit`` on
the same Trainer, each compared bitwise (losses and final weights) with plain Lightning (``strategy="auto"``) doing
the same.

With ``optimizer_in_backward`` an exception after the backward started updating leaves the weights half at the
next step: that save and that second fit are refused (naming the step), and loading a checkpoint makes the model
usable again. Ctrl-C there waits for the step to complete and stops at the next batch's start.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from megatrain_lightning import CheckpointError, MegaTrainStrategy
from megatrain_lightning.data.resumable import ResumableDataLoader
from megatrain_lightning.testing import LM, SEQ, VOCAB, make_model


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Ctrl-C as a fresh ``python`` process has it (``KeyboardInterrupt``), whatever an earlier test left installed;
    restored after."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)

STEPS = 4
AT = 2  # the batch whose step is stopped
WHERE = ("forward", "backward_first", "backward_mid", "backward_last", "step")


def _data() -> ResumableDataLoader:
    ids = torch.randint(0, VOCAB, (2 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    return ResumableDataLoader(TensorDataset(ids), batch_size=2)


class Injected(RuntimeError):
    pass


class StopAt(Callback):
    """At batch ``AT``, stops the step at ``where`` with ``how``: ``"sigint"`` sends this process SIGINT (Ctrl-C),
    ``"raise"`` raises :class:`Injected`."""

    def __init__(self, where: str, how: str):
        self.where, self.how, self.fired = where, how, False

    def _stop(self) -> None:
        if self.fired:
            return
        self.fired = True
        if self.how == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            raise Injected(f"injected at {self.where}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.where == "next_batch" and batch_idx == AT + 1:
            self._stop()
        if batch_idx != AT or self.fired or self.where == "next_batch":
            return
        layers = pl_module.model.model.layers
        if self.where == "forward":
            layers[1].register_forward_hook(lambda *a: self._stop())
        elif self.where.startswith("backward"):
            layer = layers[{"backward_first": 2, "backward_mid": 1, "backward_last": 0}[self.where]]
            layer.register_full_backward_hook(lambda *a: self._stop())
        else:  # after the backward, where the precision plugin calls the pre-step hooks and clips
            plugin = trainer.precision_plugin
            orig = plugin._after_closure

            def after_closure(*args, **kwargs):
                plugin._after_closure = orig
                out = orig(*args, **kwargs)
                self._stop()
                return out
            plugin._after_closure = after_closure


def _trainer(strategy, callbacks=()) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=list(callbacks))


def _weights(lm: LM, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer.strategy, MegaTrainStrategy):
        with trainer.strategy.summon_full_params(lm, writeback=False):
            return {n: p.detach().clone() for n, p in lm.named_parameters()}
    return {n: p.detach().clone() for n, p in lm.named_parameters()}


def _nvme(tmp, **kw) -> MegaTrainStrategy:
    tmp.mkdir(parents=True, exist_ok=True)
    return MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp), **kw)


STRATEGIES = {
    "auto": lambda tmp: "auto",
    "ram": lambda tmp: MegaTrainStrategy(),
    "ram_in_backward": lambda tmp: MegaTrainStrategy(optimizer_in_backward=True),
    "nvme": _nvme,  # optimizer_in_backward is on by default on the NVMe tier
    "nvme_no_in_backward": lambda tmp: _nvme(tmp, optimizer_in_backward=False),
}
IN_BACKWARD = ("ram_in_backward", "nvme")
# every stop with the updates in backward; the deferred schedule updates nothing before the step (one backward stop)
CASES = ([(name, where, how) for name in IN_BACKWARD for where in WHERE if where != "backward_mid"
          for how in ("sigint", "raise")]
         + [(name, "backward_mid", how) for name in ("ram", "nvme_no_in_backward") for how in ("sigint", "raise")])
_PLAIN: dict = {}


def _plain(where: str, how: str, tmp_path_factory) -> dict:
    """Plain Lightning's results for one stop (computed once per stop, shared by the cases)."""
    if (where, how) not in _PLAIN:
        _PLAIN[where, how] = _stop_save_resume_refit("auto", where, how, tmp_path_factory.mktemp("plain"))
    return _PLAIN[where, how]


def _stop_save_resume_refit(name: str, where: str, how: str, tmp) -> dict:
    """Stop a fit at ``where``; save; resume the save in a new Trainer; fit the stopped Trainer again. Returns the
    losses and final weights of each, or the error of a refused save / second fit."""
    make = STRATEGIES[name]
    lm = LM(make_model("llama"), lr=1e-2)
    trainer = _trainer(make(tmp / "store_a"), [StopAt(where, how)])
    with pytest.raises((Injected, SystemExit)):  # Lightning turns KeyboardInterrupt into SystemExit
        trainer.fit(lm, _data())
    out: dict = {"stopped_losses": list(lm.losses)}
    path = tmp / "stopped.ckpt"
    try:
        trainer.save_checkpoint(path)
    except CheckpointError as err:
        out["save"] = err
        with pytest.raises(RuntimeError) as refused:
            trainer.fit(lm, _data())
        out["refit"] = refused.value
        return out
    else:
        resumed = LM(make_model("llama", seed=7), lr=1e-2)
        second = _trainer(make(tmp / "store_b"))
        second.fit(resumed, _data(), ckpt_path=path)
        out["save"] = (resumed.losses, _weights(resumed, second))
    lm.losses.clear()
    trainer.fit(lm, _data())
    out["refit"] = (list(lm.losses), _weights(lm, trainer))
    return out


def _assert_same(ours, plain, what: str) -> None:
    losses, weights = ours
    assert losses == plain[0], what
    assert weights.keys() == plain[1].keys()
    for k, w in weights.items():
        assert torch.equal(w, plain[1][k]), f"{what}: {k}"


@pytest.mark.parametrize("name,where,how", CASES)
def test_a_stopped_step_saves_resumes_and_refits_like_plain_lightning(name, where, how, tmp_path, tmp_path_factory):
    plain = _plain(where, how, tmp_path_factory)
    ours = _stop_save_resume_refit(name, where, how, tmp_path)
    if name in IN_BACKWARD and how == "raise" and where != "forward":
        # the backward had updated part of the model: saving and training on are refused, naming the step
        assert isinstance(ours["save"], CheckpointError)
        assert "optimizer step 3 " in str(ours["save"]) and "mix two steps" in str(ours["save"])
        assert isinstance(ours["refit"], RuntimeError) and "training is refused" in str(ours["refit"])
        return
    if name in IN_BACKWARD and how == "sigint" and where != "forward":
        # Ctrl-C waited for the step to complete and stopped at the next batch's start: plain Lightning stopped there
        plain = _plain("next_batch", how, tmp_path_factory)
        assert len(ours["stopped_losses"]) == AT + 1
    assert ours["stopped_losses"] == plain["stopped_losses"]
    _assert_same(ours["save"], plain["save"], "save + resume")
    _assert_same(ours["refit"], plain["refit"], "second fit")


def test_loading_a_checkpoint_makes_a_half_updated_model_usable_again(tmp_path):
    """After the refusal, ``fit(ckpt_path=...)`` on the same Trainer restores a consistent state and trains on
    exactly as plain Lightning resumed from that checkpoint; evaluation was refused before the load too."""
    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == AT - 1:
                trainer.save_checkpoint(tmp_path / f"{trainer.strategy.__class__.__name__}.ckpt")

    results = {}
    for name in ("auto", "nvme"):
        lm = LM(make_model("llama"), lr=1e-2)
        trainer = _trainer(STRATEGIES[name](tmp_path / name), [SaveAt(), StopAt("backward_mid", "raise")])
        with pytest.raises(Injected):
            trainer.fit(lm, _data())
        ckpt = tmp_path / f"{trainer.strategy.__class__.__name__}.ckpt"
        if name == "nvme":
            with pytest.raises(RuntimeError, match="validation is refused"):
                trainer.validate(lm, _data())
        lm.losses.clear()
        trainer.fit(lm, _data(), ckpt_path=ckpt)
        results[name] = (list(lm.losses), _weights(lm, trainer))
    _assert_same(results["nvme"], results["auto"], "fit from the checkpoint after the refusal")
