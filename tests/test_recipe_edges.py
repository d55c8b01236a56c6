"""The recipe at its edges (user probe 3): runs with no validation or no sample keep their checkpoint and summary,
the save comes right after fit, a local model directory is planned and checked from its own config.json, bad
``optim.*`` / ``model.*`` values and a missing ``model.weights`` directory are refused in preflight naming the key,
``exp(val_loss) == val_ppl``, and the data errors name the key and the fix. Reuses the helpers of
``tests/test_recipe.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from megatrain_lightning.recipes_lib import run as step
from test_recipe import cfg_for, finetune, no_build, refused, tiny, write_jsonl  # noqa: F401  (fixture)

PAIRS = [{"prompt": f"What is item {i}?", "response": f"It is number {i}."} for i in range(16)]


# ---------------------------------------------------------------------------------------------- after fit
@pytest.mark.parametrize("skip", [["data.val_fraction=0"], ["trainer.limit_val_batches=0", "eval.before=false"]])
def test_no_validation_and_no_sample_still_save_and_report(tmp_path, gpt2_dir, skip):
    """Regression: with no validation batch Lightning's validate() returns [] and the recipe's [0] raised after
    fit: no checkpoint/, no summary.json. sample.max_new_tokens=0 (allowed, >= 0) made generate() raise."""
    src = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = cfg_for(tmp_path, "data=instruction", f"data.source={src}", *tiny(gpt2_dir), *skip, "sample.max_new_tokens=0")
    out = finetune(cfg)
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "val_loss" not in summary["metrics"] and "val_ppl" not in summary["metrics"]
    assert summary["sample"] == {} and out["run"]["steps"] == 2
    assert (run_dir / "checkpoint" / "model").is_dir() and summary["checkpoint"] == str(run_dir / "checkpoint")
    assert "val_loss" not in (run_dir / "summary.md").read_text()


def test_checkpoint_is_saved_before_the_evaluation_after_fit(tmp_path, gpt2_dir, monkeypatch):
    """A failure in a step after fit (here the evaluation) no longer loses the training: save runs first."""
    src = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = cfg_for(tmp_path, "data=instruction", f"data.source={src}", "eval.before=false", *tiny(gpt2_dir))

    def failing(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(step, "evaluate", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        finetune(cfg)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint" / "model")
