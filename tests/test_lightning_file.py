"""A directory checkpoint converted to one Lightning .ckpt file: load_from_checkpoint gives back every
tensor and the hyper-parameters, and strategy="auto" resumes from it as from its own checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning.checkpoint.errors import CheckpointError
from megatrain_lightning.checkpoint.lightning_file import convert_to_lightning_checkpoint
from megatrain_lightning.testing import LM, assert_parity, make_model
from test_checkpoint import lm_for, loader, trainer

ROOT = Path(__file__).resolve().parents[1]


class HP(LM):
    def __init__(self, model, lr: float = 1e-3, note: str = "x"):
        super().__init__(model, lr=lr, sched="cosine", total_steps=10)
        self.save_hyperparameters(ignore=["model"])


def test_cli_lightning_ckpt_loads_with_load_from_checkpoint(tmp_path):
    lm = HP(make_model("llama_tied"), lr=2e-3, note="converted")
    t = trainer(2)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    with pytest.raises(IsADirectoryError):  # what Lightning does with the directory itself
        HP.load_from_checkpoint(tmp_path / "c", model=make_model("llama_tied"))
    res = subprocess.run([sys.executable, "-m", "megatrain_lightning.export", str(tmp_path / "c"),
                          "--lightning-ckpt", str(tmp_path / "out.ckpt")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    assert "out.ckpt" in res.stdout and "AdamW" in res.stdout
    torch.load(tmp_path / "out.ckpt", weights_only=True)  # plain types only

    loaded = HP.load_from_checkpoint(tmp_path / "out.ckpt", model=make_model("llama_tied", seed=7))
    assert loaded.hparams.lr == 2e-3 and loaded.hparams.note == "converted"
    a, b = loaded.state_dict(), lm.state_dict()
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), k
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight  # still tied


def test_strategy_auto_resumes_from_the_converted_file(tmp_path):
    """Weights, AdamW state, LR schedule, loops and data position all carry over to another strategy."""
    model = make_model("llama")
    full = lm_for(model)
    trainer(4, strategy="auto").fit(full, loader())
    first = lm_for(model)
    t = trainer(2)
    t.fit(first, loader())
    t.save_checkpoint(tmp_path / "c")
    summary = convert_to_lightning_checkpoint(tmp_path / "c", tmp_path / "c.ckpt")
    assert summary["optimizer"] and summary["tensors"] == len(first.state_dict())
    second = lm_for(model)
    trainer(4, strategy="auto").fit(second, loader(), ckpt_path=tmp_path / "c.ckpt")
    assert_parity(second.model, full.model, first.losses + second.losses, full.losses, tol=1e-5)


def test_convert_refuses_what_it_cannot_convert(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_to_lightning_checkpoint(tmp_path / "nope", tmp_path / "x.ckpt")
    lm = LM(make_model("llama"))
    t = trainer(1)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    with pytest.raises(IsADirectoryError, match="path of the .ckpt file"):
        convert_to_lightning_checkpoint(tmp_path / "c", tmp_path)
    (tmp_path / "c" / "trainer.pt").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="trainer.pt does not belong"):
        convert_to_lightning_checkpoint(tmp_path / "c", tmp_path / "x.ckpt")


def test_export_refuses_an_out_dir_that_is_not_empty(tmp_path, capsys):
    """Regression: OUT_DIR is documented "new or empty", yet a non-empty directory (an earlier export, the
    checkpoint itself) was written into, mixing files. It is refused (exit 2, nothing written); an empty or new
    directory is taken, and the source model directory keeps its own refusal."""
    from megatrain_lightning.export import main

    lm = lm_for(make_model("llama"))
    t = trainer(1)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    ckpt = tmp_path / "c"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (tmp_path / "other", ckpt):
        capsys.readouterr()
        assert main([str(ckpt), str(out)]) == 2
        err = capsys.readouterr().err
        assert f"OUT_DIR {out} is not empty" in err and "nothing was written" in err, err
    assert main([str(ckpt), str(ckpt / "model")]) == 2
    assert "is the source model directory" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    (tmp_path / "empty").mkdir()
    assert main([str(ckpt), str(tmp_path / "empty")]) == 0 and main([str(ckpt), str(tmp_path / "new")]) == 0


def test_lightning_ckpt_of_a_weights_only_checkpoint_says_it_cannot_resume(tmp_path, capsys):
    """Regression: --lightning-ckpt on a weights-only checkpoint said only "wrote x.ckpt"; a resume from the file
    then failed in Lightning. The output now says the file holds the weights only and why it cannot resume."""
    from megatrain_lightning.export import main

    lm = lm_for(make_model("llama"))
    t = trainer(1)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "w", weights_only=True)
    t.save_checkpoint(tmp_path / "full")
    capsys.readouterr()
    assert main([str(tmp_path / "w"), "--lightning-ckpt", str(tmp_path / "w.ckpt")]) == 0
    out = capsys.readouterr()
    assert "(weights only)" in out.out and "holds no AdamW state" in out.err and "cannot resume" in out.err, out
    assert "optimizer_states" not in torch.load(tmp_path / "w.ckpt", weights_only=True)
    assert main([str(tmp_path / "full"), "--lightning-ckpt", str(tmp_path / "full.ckpt")]) == 0
    out = capsys.readouterr()
    assert "+ AdamW state" in out.out and "warning" not in out.err
    assert main([str(tmp_path / "full"), "--lightning-ckpt", str(tmp_path / "n.ckpt"), "--no-optimizer"]) == 0
    out = capsys.readouterr()
    assert "(weights only)" in out.out and "warning" not in out.err  # asked for: no warning
