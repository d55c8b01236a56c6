"""The recipe at its edges: runs with no validation or no sample keep their checkpoint and summary,
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


# ---------------------------------------------------------------------------------------------- preflight: the model
def _local_gpt2(path: Path, n_positions: int = 64) -> Path:
    """A local model directory as preflight reads it: only its config.json (a 2-layer GPT-2, hidden 32)."""
    transformers.GPT2Config(n_positions=n_positions, n_embd=32, n_layer=2, n_head=2).save_pretrained(path)
    return path


def test_local_model_dir_is_planned_and_checked_from_its_config_json(tmp_path, no_build, monkeypatch):
    """Regression: model.weights=<dir> was planned as the preset's SmolLM2 (134.5M parameters) and its seq_len
    limit taken from the preset (8192), so data.seq_len=128 on a model of 64 positions died inside fit."""
    local = _local_gpt2(tmp_path / "gpt2")
    over = [f"model.weights={local}", "model.gguf=null"]
    msg = refused(tmp_path, *over, "data.seq_len=128", key="data.seq_len", match="maximum of 64 positions")
    assert str(local / "config.json") in msg and "data.seq_len=64 or less" in msg
    planned = []
    real = step.plan_for_run
    monkeypatch.setattr(step, "plan_for_run", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    step.preflight(cfg_for(tmp_path, *over, "data.seq_len=64"))
    model = transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(local))
    assert planned[0].counts.total == sum(p.numel() for p in model.parameters())


def test_local_weights_win_over_the_presets_gguf(tmp_path, gpt2_dir, no_build, monkeypatch):
    """``model.weights=<dir>`` on a preset that reads a GGUF (the default SmolLM2) trains the directory's weights
    with its tokenizer, as if ``model.gguf=null`` were given: the model, the tokenizer and the plan are the
    directory's, the same in preflight and in the build."""
    from megatrain_lightning.recipes_lib.models import causal_lm, tokenizer_for

    local = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(local)
    transformers.AutoTokenizer.from_pretrained(gpt2_dir).save_pretrained(local)
    cfg = cfg_for(tmp_path, f"model.weights={local}", "data.seq_len=64")
    assert cfg.model.gguf  # the preset's GGUF is still set
    planned = []
    real = step.plan_for_run
    monkeypatch.setattr(step, "plan_for_run", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    step.preflight(cfg)
    want = sum(p.numel() for p in transformers.GPT2LMHeadModel.from_pretrained(local).parameters())
    assert planned[0].counts.total == want
    keys = {k: v for k, v in cfg.model.items() if k != "_target_" and k != "_convert_"}
    model, tok = causal_lm(**keys)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_layer == 2
    vocab = transformers.AutoTokenizer.from_pretrained(local).get_vocab()
    assert tok.get_vocab() == tokenizer_for(**keys).get_vocab() == vocab


def test_model_config_overrides_with_local_weights_are_refused(tmp_path):
    """``model.config.*`` overrides beside ``model.weights`` were ignored (the weights' config.json builds the
    model), so the run trained another model than asked; the command line is refused, exit 2, naming the key."""
    import os
    import subprocess
    import sys

    from megatrain_lightning.recipes_lib.checks import ConfigError, refuse_config_with_weights

    local = _local_gpt2(tmp_path / "gpt2")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "recipes" / "finetune.py"), f"model.weights={local}",
                        "model.config.hidden_size=64", f"hydra.run.dir={tmp_path / 'out'}"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: model.config.hidden_size: does not apply with model.weights={local}" in r.stderr
    assert not (tmp_path / "out").exists()
    refuse_config_with_weights({"weights": None}, ["model.config.hidden_size=64"])  # a random init takes them
    refuse_config_with_weights({"weights": str(local)}, ["trainer.max_steps=3"])
    with pytest.raises(ConfigError, match="model.config.num_hidden_layers: does not apply"):
        refuse_config_with_weights({"weights": "org/name"}, ["+model.config.num_hidden_layers=3"])


def test_refuses_a_missing_local_weights_directory(tmp_path, no_build):
    """Regression: a missing model.weights path was a Hydra traceback after preflight (exit 1, run dir left)."""
    refused(tmp_path, f"model.weights={tmp_path}/nonexistent", "model.gguf=null", key="model.weights",
            match="not an existing directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path, f"model.weights={tmp_path}/empty", "model.gguf=null", key="model.weights", match="no config.json")
    # a hub id cannot be checked offline: left to the model load
    from megatrain_lightning.recipes_lib.checks import local_model_config

    assert local_model_config({"weights": "HuggingFaceTB/SmolLM2-135M", "gguf": None}) is None


def test_refuses_bad_optim_and_model_values_naming_the_key(tmp_path, no_build):
    """Regression: optim.lr=abc / -1 and model.max_seq_len=null passed preflight and failed after the model load."""
    refused(tmp_path, "optim.lr=abc", key="optim.lr", match="number > 0")
    refused(tmp_path, "optim.lr=-1", key="optim.lr")
    refused(tmp_path, "optim.lr=0", key="optim.lr")
    refused(tmp_path, "optim.weight_decay=-0.1", key="optim.weight_decay")
    refused(tmp_path, "optim.betas=[0.9]", key="optim.betas", match=r"two numbers in \[0, 1\)")
    refused(tmp_path, "optim.betas=[0.9,1.0]", key="optim.betas")
    refused(tmp_path, "optim.betas=[0.9,abc]", key="optim.betas")
    refused(tmp_path, "optim.warmup_steps=1.5", key="optim.warmup_steps")
    refused(tmp_path, "model.max_seq_len=null", key="model.max_seq_len", match="positive int")


# ---------------------------------------------------------------------------------------------- metrics
def test_val_loss_is_the_token_mean_so_exp_of_it_is_val_ppl(tmp_path, gpt2_dir):
    """Regression: val_loss was a mean of per-batch means weighted by sequences while val_ppl is per token, so
    exp(val_loss) != val_ppl when batches hold different numbers of answer tokens (as here)."""
    rows = [{"prompt": f"Q{i}?", "response": "word " * (1 + 7 * (i % 3))} for i in range(24)]
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = cfg_for(tmp_path, "data=instruction", f"data.source={src}", *tiny(gpt2_dir), "data.val_fraction=0.5",
                  "eval.max_batches=4", "data.batch_size=1", "trainer.max_steps=1", "sample.max_new_tokens=0")
    out = finetune(cfg)
    for when in ("before", "after"):
        m = {k: out["metrics"][k][when] for k in ("val_loss", "val_ppl")}
        assert math.exp(m["val_loss"]) == pytest.approx(m["val_ppl"], rel=1e-5), (when, m)


# ---------------------------------------------------------------------------------------------- data messages
def test_data_errors_name_the_key_the_file_and_the_fix(tmp_path, no_build):
    """Regression: a bad txt_mode was reported as data.source, duplicate ids named no file and no fix, and the
    "no instruction documents" message listed .txt, which instruction data skips."""
    text = write_jsonl(tmp_path / "corpus.jsonl", [{"text": f"Document {i}."} for i in range(16)])
    refused(tmp_path, "data=text", f"data.source={text}", "data.source_options.txt_mode=para",
            key="data.source_options.txt_mode", match="'file' or 'line'")
    rows = [{"id": str(i % 8), "prompt": f"Q{i}?", "response": f"A{i}"} for i in range(16)]
    dup = write_jsonl(tmp_path / "dup.jsonl", rows)
    msg = refused(tmp_path, "data=instruction", f"data.source={dup}", key="data.source_options.id_field",
                  match="two records have the id '0'")
    assert "dup.jsonl" in msg and "data.source_options.id_field=null" in msg
    step.preflight(cfg_for(tmp_path, "data=instruction", f"data.source={dup}", "data.source_options.id_field=null"))
    (tmp_path / "txts").mkdir()
    (tmp_path / "txts" / "a.txt").write_text("some text")
    write_jsonl(tmp_path / "txts" / "b.jsonl", [{"prompt": "", "response": ""}])
    msg = refused(tmp_path, "data=instruction", f"data.source={tmp_path / 'txts'}", key="data.source")
    assert "no non-empty instruction documents" in msg and ".txt" not in msg.split("file types")[1]
