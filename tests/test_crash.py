"""SIGKILL during a checkpoint save and in the middle of a step: the newest complete checkpoint
loads and the run resumes exactly (losses and weights of the uninterrupted run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

import megatrain_lightning  # noqa: F401
from crash_common import TOTAL, lm, loader
from megatrain_lightning.parallel.lifetime import dies_with_this_process
from megatrain_lightning.testing import assert_parity


def _trainer(**kw):
    return pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=TOTAL, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2, **kw)


@pytest.fixture(scope="module")
def uninterrupted():
    module = lm()
    _trainer(enable_checkpointing=False).fit(module, loader())
    return module


@pytest.mark.parametrize("mode,hang_at,expect_last", [("save", 3, 1), ("step", 4, 4)])
def test_sigkill_then_resume_exactly(tmp_path, uninterrupted, mode, hang_at, expect_last):
    # the worker imports the same megatrain_lightning as this process (crash_common.py sits next to it)
    root = str(Path(megatrain_lightning.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "kill_worker.py"), str(tmp_path), mode,
                             str(hang_at)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=dies_with_this_process())
    deadline = time.time() + 240
    while not (tmp_path / "HANGING").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "worker never reached the kill point"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpts = tmp_path / "ckpts"
    # a half-written save leaves only a hidden temporary directory, never a checkpoint name
    complete = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    if mode == "save":  # each step saves step=N then last: the 3rd save is step=2's, killed before its rename
        assert any(p.name.startswith(".") for p in ckpts.iterdir()), "the interrupted save left no temporary"
    assert f"epoch=0-step={expect_last}.ckpt" in complete
    assert f"epoch=0-step={expect_last + 1}.ckpt" not in complete

    resumed = lm()
    from lightning.pytorch.callbacks import ModelCheckpoint

    _trainer(callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)]).fit(resumed, loader(), ckpt_path="last")
    n_done = 2 * expect_last  # micro-batches before the checkpoint
    assert_parity(resumed.model, uninterrupted.model, resumed.losses, uninterrupted.losses[n_done:], tol=1e-6)
