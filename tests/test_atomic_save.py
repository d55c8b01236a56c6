"""Putting a checkpoint in place: over a directory, a file or a symlink of the same name; what killed saves
left next to it; a full disk (the previous checkpoint stays loadable, the error names the checkpoint)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections import namedtuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

import megatrain_lightning  # noqa: F401
from megatrain_lightning.checkpoint import atomic, directory
from megatrain_lightning.checkpoint.directory import verified_info
from megatrain_lightning.data import ResumableDataLoader
from megatrain_lightning.testing import LM, SEQ, VOCAB, make_model, rel


def loader():
    ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(1))
    return ResumableDataLoader(TensorDataset(ids), batch_size=2, shuffle=True, seed=5)


def trainer(steps, **kw):
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=steps, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    return pl.Trainer(**base)


@pytest.fixture
def fitted():
    """(trainer, module) after 2 steps on a tiny llama."""
    module = LM(make_model("llama"))
    t = trainer(2)
    t.fit(module, loader())
    return t, module


def hidden(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_plain_lightning_file_of_the_same_name_is_replaced_and_training_goes_on(tmp_path):
    """A run directory first used by plain Lightning (``last.ckpt`` a file) continued with megatrain: the file is
    replaced by the directory checkpoint, nothing is left beside it, and the checkpoint resumes."""
    d = tmp_path / "ckpts"
    d.mkdir()
    (d / "last.ckpt").write_bytes(b"a plain Lightning checkpoint file")
    module = LM(make_model("llama"))
    cb = ModelCheckpoint(dirpath=d, save_last=True, every_n_train_steps=2, save_top_k=0, enable_version_counter=False)
    trainer(4, enable_checkpointing=True, callbacks=[cb]).fit(module, loader())
    assert verified_info(d / "last.ckpt")["format"] >= 1
    assert hidden(d) == []
    again = LM(make_model("llama", seed=3))
    trainer(4).fit(again, loader(), ckpt_path=d / "last.ckpt")  # loads the weights of step 4, trains no more
    assert max(rel(a, b) for a, b in zip(again.model.parameters(), module.model.parameters())) == 0


def test_a_symlink_of_the_same_name_is_replaced_and_its_target_is_kept(tmp_path, fitted):
    """``save_last="link"`` leaves ``last.ckpt`` a symlink to another checkpoint: saving ``last.ckpt`` replaces
    the link, not the checkpoint it points to."""
    t, module = fitted
    t.save_checkpoint(tmp_path / "step2")
    os.symlink(tmp_path / "step2", tmp_path / "last.ckpt")
    t.save_checkpoint(tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and verified_info(tmp_path / "last.ckpt")
    assert verified_info(tmp_path / "step2") and hidden(tmp_path) == []
    t.strategy.remove_checkpoint(tmp_path / "last.ckpt")
    os.symlink(tmp_path / "step2", tmp_path / "last.ckpt")
    t.strategy.remove_checkpoint(tmp_path / "last.ckpt")  # removes the link only, as Lightning's pruning expects
    assert not os.path.lexists(tmp_path / "last.ckpt") and verified_info(tmp_path / "step2")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_overwriting_a_checkpoint_leaves_only_the_new_one(tmp_path, fitted, monkeypatch, exchange):
    """Over an existing checkpoint: the new one is in place, the old one gone, nothing hidden left; also where
    the filesystem has no ``RENAME_EXCHANGE`` (the two-rename fallback)."""
    t, module = fitted
    t.save_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "marker").write_text("old")
    if not exchange:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    t.save_checkpoint(tmp_path / "c")
    assert not (tmp_path / "c" / "marker").exists() and verified_info(tmp_path / "c")
    assert hidden(tmp_path) == []


def test_exchange_swaps_a_directory_and_a_file():
    """The system call the atomic replacement rests on, on this machine's filesystem."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(dir=".") as d:
        a, b = Path(d) / "a", Path(d) / "b"
        a.mkdir()
        b.write_text("file")
        assert atomic.exchange(a, b)
        assert a.read_text() == "file" and b.is_dir()


def test_what_killed_saves_left_is_cleaned_and_a_moved_aside_checkpoint_restored(tmp_path, fitted):
    """A killed save leaves ``.c.tmp-<pid>`` (half written) and, with the two-rename fallback, ``.c.old-<pid>``
    (the complete previous checkpoint) with no ``c``: the next save into the directory restores ``c`` from
    ``.old`` before anything else and removes the half-written one; a live process's entries are left alone."""
    t, module = fitted
    t.save_checkpoint(tmp_path / "c")
    dead = dead_pid()
    shutil.copytree(tmp_path / "c", tmp_path / f".c.tmp-{dead}")
    (tmp_path / f".c.tmp-{dead}" / "megatrain.json").unlink()  # half written
    shutil.copytree(tmp_path / "c", tmp_path / f".c.tmp-{dead}-0a1b2c3d")  # a data-parallel save's temporary
    os.rename(tmp_path / "c", tmp_path / f".c.old-{dead}")
    (tmp_path / ".c.tmp-1").mkdir()  # pid 1 runs: another save in progress
    done = atomic.clean_stale(tmp_path / "c")
    assert sorted(p.name for p in done) == sorted([f".c.old-{dead}", f".c.tmp-{dead}", f".c.tmp-{dead}-0a1b2c3d"])
    assert verified_info(tmp_path / "c") and hidden(tmp_path) == [".c.tmp-1"]
    shutil.copytree(tmp_path / "c", tmp_path / f".c.tmp-{dead}")
    t.save_checkpoint(tmp_path / "c")  # a save cleans up too
    assert hidden(tmp_path) == [".c.tmp-1"]


Usage = namedtuple("Usage", "total used free")


def _raise(err):
    def f(*a, **k):
        raise err
    return f


@pytest.mark.parametrize("where", ["trainer.pt", "optimizer shards"])
def test_a_full_disk_names_the_checkpoint_and_keeps_the_previous_one(tmp_path, fitted, monkeypatch, where):
    """The libraries report a full disk each their own way (``torch.save``: RuntimeError "unexpected pos";
    safetensors: SafetensorError "os error 28"): the save raises OSError(ENOSPC) naming the checkpoint and
    what to do, removes what it wrote, and the previous checkpoint of that name still loads."""
    t, module = fitted
    t.save_checkpoint(tmp_path / "c")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*")}
    if where == "trainer.pt":
        monkeypatch.setattr(torch, "save", _raise(RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                               "unexpected pos 64 vs 0")))
        monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 4096, 4096))
    else:
        from safetensors import SafetensorError

        monkeypatch.setattr(directory, "write_safetensors_shards", _raise(SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)")))
    with pytest.raises(OSError, match=r"checkpoint .*/c could not be written: its filesystem is full") as e:
        t.save_checkpoint(tmp_path / "c")
    assert e.value.errno == errno.ENOSPC and "previous checkpoint of that name, if any, is untouched" in str(e.value)
    monkeypatch.undo()
    assert hidden(tmp_path) == [] and verified_info(tmp_path / "c")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*")} == before


def test_another_write_error_is_not_called_a_full_disk(tmp_path, fitted, monkeypatch):
    """Also when the disk happens to be nearly full (the free-space rule is for torch.save's unexplained error)."""
    t, module = fitted
    monkeypatch.setattr(directory, "write_safetensors_shards", _raise(PermissionError(errno.EACCES, "denied")))
    with pytest.raises(PermissionError, match="denied"):
        t.save_checkpoint(tmp_path / "c")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 4096, 4096))
    monkeypatch.setattr(directory, "write_safetensors_shards", _raise(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        t.save_checkpoint(tmp_path / "c")
    monkeypatch.undo()
    assert hidden(tmp_path) == [] and not (tmp_path / "c").exists()
