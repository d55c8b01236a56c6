"""Subprocess for test_crash.py: trains with a checkpoint every optimizer step and can be told to
hang inside a checkpoint save or inside a training step, so the parent can SIGKILL it there.

    python tests/kill_worker.py OUT_DIR {save|step} HANG_AT_STEP
"""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import megatrain_lightning  # noqa: F401
import megatrain_lightning.checkpoint.directory as directory
from crash_common import TOTAL, lm, loader  # next to this script: on sys.path when it runs

out, mode, hang_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
saves = {"n": 0}
real_write = directory.write_safetensors_shards


def slow_write(path, items, **kw):
    result = real_write(path, items, **kw)
    if mode == "save" and Path(path).name == "optimizer":
        saves["n"] += 1
        if saves["n"] == hang_at:  # model/ and optimizer/ written, not yet renamed into place
            (out / "HANGING").write_text("save")
            time.sleep(600)
    return result


directory.write_safetensors_shards = slow_write


class Hang(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if mode == "step" and trainer.global_step == hang_at:
            (out / "HANGING").write_text("step")
            time.sleep(600)


module = lm()
ckpt = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=1, save_top_k=-1, save_last=True)
trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=TOTAL, logger=False, callbacks=[ckpt, Hang()],
                     enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
trainer.fit(module, loader())
