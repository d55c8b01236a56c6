"""Checkpoints asked for at moments, places and with contents a strategy of our own must handle.

Before the fixes: with ``optimizer_in_backward`` a save from inside the backward (a module backward hook, a signal
handler such as Lightning's SLURM auto-requeue) wrote a checkpoint whose weights were half at the next step, resumed
with that step applied twice to part of the model (weights 40% off); saving to a folder of other files deleted them;
fsspec URLs became local folders named ``memory:`` / ``s3:``; a checkpoint saved after ``validate`` could not start a
fit; a CheckpointIO plugin was silently ignored; a callback's OrderedDict/set/dtype/device state came back as
dict/list/str. Reference: plain Lightning (``strategy="auto"``) doing the same.
"""

from __future__ import annotations

from collections import OrderedDict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from megatrain_lightning import CheckpointError, MegaTrainStrategy
from megatrain_lightning.data.resumable import ResumableDataLoader
from megatrain_lightning.testing import LM, SEQ, VOCAB, make_model, rel

STEPS = 6


def _data() -> ResumableDataLoader:
    ids = torch.randint(0, VOCAB, (2 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    return ResumableDataLoader(TensorDataset(ids), batch_size=2)


class SaveInBackward(Callback):
    """At batch ``at``, saves from a backward hook on the middle decoder layer: the layers after it (and the head)
    already went through backward and, with ``optimizer_in_backward``, were updated."""

    def __init__(self, path, at: int = 2):
        self.path, self.at, self.handle = path, at, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            def save(module, grad_in, grad_out):
                self.handle.remove()
                trainer.save_checkpoint(self.path)
            self.handle = pl_module.model.model.layers[1].register_full_backward_hook(save)


def _trainer(**kw) -> pl.Trainer:
    return pl.Trainer(strategy=MegaTrainStrategy(optimizer_in_backward=True), accelerator="cpu", devices=1,
                      max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


def test_save_in_the_middle_of_an_in_backward_update_is_written_after_the_step(tmp_path):
    path = tmp_path / "mid_backward.ckpt"
    straight = LM(make_model("llama"), lr=1e-2)
    with pytest.warns(UserWarning, match="written at the end of this optimizer step"):
        _trainer(callbacks=[SaveInBackward(path)]).fit(straight, _data())
    assert path.is_dir()

    resumed = LM(make_model("llama", seed=5), lr=1e-2)
    trainer = _trainer()
    trainer.fit(resumed, _data(), ckpt_path=path)
    assert len(resumed.losses) == STEPS - 3  # the checkpoint is the state after step 3 (index 2), complete
    assert resumed.losses == straight.losses[3:]
    theirs = dict(straight.named_parameters())
    for name, p in resumed.named_parameters():
        assert rel(p.detach(), theirs[name].detach()) == 0.0, name


def test_two_saves_in_one_backward_are_both_written(tmp_path):
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    with pytest.warns(UserWarning, match="written at the end of this optimizer step"):
        _trainer(callbacks=[SaveInBackward(first), SaveInBackward(second)]).fit(LM(make_model("llama"), lr=1e-2), _data())
    assert first.is_dir() and second.is_dir()
    weights = [{k: v for f in sorted((p / "model").glob("*.safetensors")) for k, v in load_file(f).items()}
               for p in (first, second)]
    assert weights[0] and weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_emergency_save_after_an_error_mid_update_is_refused(tmp_path):
    class Boom(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                def fail(module, grad_in, grad_out):
                    raise RuntimeError("boom")
                pl_module.model.model.layers[0].register_full_backward_hook(fail)

    lm = LM(make_model("llama"), lr=1e-2)
    trainer = _trainer(callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(lm, _data())
    with pytest.raises(CheckpointError, match="mix two steps"):
        trainer.save_checkpoint(tmp_path / "emergency.ckpt")
    assert not (tmp_path / "emergency.ckpt").exists()


def _fit_once(strategy="megatrain", **kw) -> tuple[LM, pl.Trainer]:
    lm = LM(make_model("llama"), lr=1e-2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(lm, _data())
    return lm, trainer


def test_save_into_a_directory_of_other_files_is_refused_and_keeps_them(tmp_path):
    """A directory checkpoint replaces the entry at its path whole: a folder of the user's files was deleted."""
    folder = tmp_path / "project"
    (folder / "logs").mkdir(parents=True)
    (folder / "notes.txt").write_text("keep me")
    _, trainer = _fit_once(enable_checkpointing=False)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        trainer.save_checkpoint(folder)
    assert (folder / "notes.txt").read_text() == "keep me" and (folder / "logs").is_dir()
    trainer.save_checkpoint(folder / "last.ckpt")  # what the message suggests; saving over it again replaces it
    trainer.save_checkpoint(folder / "last.ckpt")
    assert (folder / "last.ckpt" / "megatrain.json").is_file() and (folder / "notes.txt").is_file()


def test_remote_urls_are_refused_and_file_urls_are_local_paths(tmp_path):
    """fsspec URLs were taken as relative local paths (``memory://x`` became the folder ``./memory:/x``)."""
    _, trainer = _fit_once(enable_checkpointing=False)
    with pytest.raises(CheckpointError, match="remote filesystem"):
        trainer.save_checkpoint("memory://ckpts/model.ckpt")
    trainer.save_checkpoint(f"file://{tmp_path}/url.ckpt")
    assert (tmp_path / "url.ckpt" / "megatrain.json").is_file()
    trainer.save_checkpoint(f"local://{tmp_path}/local.ckpt")  # fsspec's other name of the local filesystem
    assert (tmp_path / "local.ckpt" / "megatrain.json").is_file()

    lm = LM(make_model("llama"), lr=1e-2)
    with pytest.raises(CheckpointError, match="remote filesystem"):  # at setup, before any step
        pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=2, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[pl.callbacks.ModelCheckpoint(dirpath="memory://run/ckpts")]).fit(lm, _data())
    assert lm.losses == []


def test_plain_lightning_file_on_a_remote_filesystem_resumes():
    """A plain ``.ckpt`` (another strategy's) is read with Lightning's loader, which reads fsspec URLs."""
    _, plain = _fit_once("auto", enable_checkpointing=False)
    plain.save_checkpoint("memory://store/plain.ckpt")
    ref = LM(make_model("llama"), lr=1e-2)
    pl.Trainer(strategy="auto", accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(ref, _data(), ckpt_path="memory://store/plain.ckpt")
    ours = LM(make_model("llama"), lr=1e-2)
    pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(ours, _data(), ckpt_path="memory://store/plain.ckpt")
    assert len(ours.losses) == 2 and ours.losses == pytest.approx(ref.losses, rel=1e-6)


def test_checkpoint_saved_without_an_optimizer_starts_a_fit(tmp_path):
    """Saved after ``trainer.validate`` (no optimizer): plain Lightning trains from it with a fresh optimizer; ours
    raised Lightning's "contains only the model ... save_weights_only" error."""
    losses = {}
    for strategy in ("auto", "megatrain"):
        lm = LM(make_model("llama"), lr=1e-2)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.validate(lm, _data())
        trainer.save_checkpoint(tmp_path / f"{strategy}.ckpt")
        fresh = LM(make_model("llama", seed=7), lr=1e-2)
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False
                   ).fit(fresh, _data(), ckpt_path=tmp_path / f"{strategy}.ckpt")
        losses[strategy] = fresh.losses
    assert len(losses["megatrain"]) == 3 and losses["megatrain"] == pytest.approx(losses["auto"], rel=1e-6)


def test_a_checkpoint_io_plugin_is_refused_before_training():
    class Uploading(TorchCheckpointIO):
        pass

    lm = LM(make_model("llama"), lr=1e-2)
    with pytest.raises(CheckpointError, match="Uploading.*would not be used"):
        pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=2, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, plugins=[Uploading()]).fit(lm, _data())
    assert lm.losses == []


class TypedState(Callback):
    """A callback whose state holds types torch's weights_only loader restores as they are."""

    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"order": OrderedDict(b=2, a=1), "seen": {3, 1}, "dtype": torch.bfloat16, "device": torch.device("cpu"),
                "size": torch.Size([2, 3]), "pair": (1, (2, 3)), "keys": {0.5: "lr", (1, 2): "span", None: "none", True: 1}}

    def load_state_dict(self, state):
        self.loaded = state


def test_callback_state_types_come_back_as_saved(tmp_path):
    """They came back as dict, list and strings (``.to(state["dtype"])`` then failed after a resume); dict keys other
    than str/int came back as strings."""
    _, trainer = _fit_once(enable_checkpointing=False, callbacks=[TypedState()])
    trainer.save_checkpoint(tmp_path / "typed.ckpt")
    cb = TypedState()
    pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, callbacks=[cb]
               ).fit(LM(make_model("llama"), lr=1e-2), _data(), ckpt_path=tmp_path / "typed.ckpt")
    want = TypedState().state_dict()
    assert cb.loaded == want
    assert [type(v) for v in cb.loaded.values()] == [type(v) for v in want.values()]
    assert list(cb.loaded["order"]) == ["b", "a"]
