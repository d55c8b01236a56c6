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


def sized_stem(size: int, char: str = "a") -> str:
    """A ``ModelCheckpoint(filename=...)`` whose saved entry (``<filename>.ckpt``) is ``size`` bytes long in UTF-8,
    filled with ``char`` (padded with ASCII where ``char``'s bytes do not divide the room)."""
    room = size - len(".ckpt")
    n = room // len(char.encode())
    stem = char * n + "a" * (room - n * len(char.encode()))
    assert len((stem + ".ckpt").encode()) == size
    return stem


NAMES = [(240, "a"), (245, "a"), (250, "a"), (255, "a"), (255, "é"), (254, "日")]


@pytest.mark.parametrize("size,char", NAMES, ids=[f"{s}-bytes-{c}" for s, c in NAMES])
def test_every_name_plain_lightning_saves_is_saved_and_resumes(tmp_path, size, char):
    """``ModelCheckpoint`` names up to the filesystem's 255 bytes (also multi-byte UTF-8): plain Lightning saves
    them, and so does megatrain (its hidden temporary names stay short whatever the checkpoint's name); the
    checkpoint resumes and nothing hidden is left beside it."""
    stem = sized_stem(size, char)
    module = LM(make_model("llama"))
    cb = ModelCheckpoint(dirpath=tmp_path / "mt", filename=stem, every_n_train_steps=2, enable_version_counter=False)
    trainer(2, enable_checkpointing=True, callbacks=[cb]).fit(module, loader())
    saved = tmp_path / "mt" / f"{stem}.ckpt"
    assert len(os.fsencode(saved.name)) == size and verified_info(saved)
    assert os.listdir(tmp_path / "mt") == [saved.name]
    again = LM(make_model("llama", seed=3))
    trainer(2).fit(again, loader(), ckpt_path=saved)  # loads the weights of step 2, trains no more
    assert max(rel(a, b) for a, b in zip(again.model.parameters(), module.model.parameters())) == 0

    cb = ModelCheckpoint(dirpath=tmp_path / "auto", filename=stem, every_n_train_steps=2, enable_version_counter=False)
    trainer(2, strategy="auto", enable_checkpointing=True, callbacks=[cb]).fit(LM(make_model("llama")), loader())
    assert (tmp_path / "auto" / saved.name).is_file()  # the reference: plain Lightning saves this name


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_longest_name_is_replaced_in_place(tmp_path, fitted, monkeypatch, exchange):
    """Saving again over a 255-byte name: also with the two-rename fallback, whose moved-aside name stays short."""
    t, module = fitted
    final = tmp_path / ("b" * 250 + ".ckpt")
    t.save_checkpoint(final)
    (final / "marker").write_text("old")
    if not exchange:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    t.save_checkpoint(final)
    assert not (final / "marker").exists() and verified_info(final)
    assert os.listdir(tmp_path) == [final.name]


@pytest.mark.parametrize("name", ["c", "x" * 250 + ".ckpt", "é" * 125 + ".ckpt"], ids=["short", "255-bytes",
                                                                                        "255-bytes-utf8"])
def test_what_killed_saves_of_any_name_left_is_cleaned(tmp_path, fitted, name):
    """The hidden entries of a killed save (half-written temporaries, one per process or data-parallel token; a
    complete checkpoint moved aside by the two-rename fallback) are recognised for names of every length: the
    moved-aside one is put back under the name, the others removed; a live process's entries are left alone."""
    t, module = fitted
    final = tmp_path / name
    t.save_checkpoint(final)
    dead = dead_pid()
    half = atomic.temporary_path(final, str(dead))
    shutil.copytree(final, half)
    (half / "megatrain.json").unlink()
    shutil.copytree(final, atomic.temporary_path(final, f"{dead}-0a1b2c3d"))
    os.rename(final, atomic.aside_path(final, dead))
    live = atomic.temporary_path(final, "1")  # pid 1 runs: another save in progress
    live.mkdir()
    assert all(len(os.fsencode(p.name)) <= 110 for p in (half, live, atomic.aside_path(final, dead)))
    done = atomic.clean_stale(final)
    assert sorted(p.name for p in done) == sorted(
        [half.name, atomic.temporary_path(final, f"{dead}-0a1b2c3d").name, atomic.aside_path(final, dead).name])
    assert verified_info(final) and hidden(tmp_path) == [live.name]
    shutil.copytree(final, half)
    t.save_checkpoint(final)  # a save cleans up too
    assert hidden(tmp_path) == [live.name]


def test_entries_named_after_the_whole_name_are_cleaned_too(tmp_path, fitted):
    """``.<name>.tmp-<pid>`` and ``.<name>.old-<pid>`` next to a checkpoint are handled as the shorter hidden names
    are; an entry of another checkpoint whose name starts the same is left alone."""
    t, module = fitted
    t.save_checkpoint(tmp_path / "c")
    dead = dead_pid()
    shutil.copytree(tmp_path / "c", tmp_path / f".c.tmp-{dead}")
    shutil.copytree(tmp_path / "c", tmp_path / f".c.tmp-{dead}-0a1b2c3d")
    os.rename(tmp_path / "c", tmp_path / f".c.old-{dead}")
    (tmp_path / f".c.old-{dead}.x.tmp-{dead}").mkdir()  # a temporary of the checkpoint "c.old-<dead>.x"
    done = atomic.clean_stale(tmp_path / "c")
    assert sorted(p.name for p in done) == sorted([f".c.old-{dead}", f".c.tmp-{dead}", f".c.tmp-{dead}-0a1b2c3d"])
    assert verified_info(tmp_path / "c") and hidden(tmp_path) == [f".c.old-{dead}.x.tmp-{dead}"]


@pytest.mark.parametrize("name", ["a" * 251 + ".ckpt", "é" * 126 + "a.ckpt"], ids=["256-bytes", "258-bytes-utf8"])
def test_a_name_longer_than_the_filesystem_allows_is_refused_clearly(tmp_path, name):
    """A name over NAME_MAX (255 bytes on Linux) cannot be saved by any strategy (plain Lightning also fails, with
    ``OSError(ENAMETOOLONG)``); megatrain says so before writing anything: the name's byte length, the limit, and
    to pass a shorter ``filename=``. Nothing is left in the checkpoint directory."""
    stem = name[:-len(".ckpt")]
    module = LM(make_model("llama"))
    d = tmp_path / "mt"
    cb = ModelCheckpoint(dirpath=d, filename=stem, every_n_train_steps=2, enable_version_counter=False)
    with pytest.raises(OSError) as e:
        trainer(2, enable_checkpointing=True, callbacks=[cb]).fit(module, loader())
    size = len(name.encode())
    assert e.value.errno == errno.ENAMETOOLONG
    for part in (f"is {size} bytes long", "at most 255 bytes (NAME_MAX)", "Nothing was written", "`filename=`"):
        assert part in str(e.value)
    assert not d.exists() or os.listdir(d) == []

    cb = ModelCheckpoint(dirpath=tmp_path / "auto", filename=stem, every_n_train_steps=2, enable_version_counter=False)
    with pytest.raises(OSError) as e:  # the reference fails too
        trainer(2, strategy="auto", enable_checkpointing=True, callbacks=[cb]).fit(LM(make_model("llama")), loader())
    assert e.value.errno == errno.ENAMETOOLONG


def test_converting_to_a_longest_file_name(tmp_path, fitted):
    """``convert_to_lightning_checkpoint`` writes a 255-byte file name; a longer one is refused before anything
    is read or written."""
    from megatrain_lightning.checkpoint.lightning_file import convert_to_lightning_checkpoint

    t, module = fitted
    t.save_checkpoint(tmp_path / "c")
    out = tmp_path / "out" / ("é" * 125 + ".ckpt")
    convert_to_lightning_checkpoint(tmp_path / "c", out)
    assert torch.load(out, weights_only=True)["global_step"] == 2 and os.listdir(out.parent) == [out.name]
    with pytest.raises(OSError, match=r"is 256 bytes long .* at most 255 bytes \(NAME_MAX\)") as e:
        convert_to_lightning_checkpoint(tmp_path / "c", out.with_name("a" + out.name))
    assert e.value.errno == errno.ENAMETOOLONG and os.listdir(out.parent) == [out.name]
