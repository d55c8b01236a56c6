"""The preference recipe (recipes/dpo.py) end to end on a tiny model: its steps, its results, bad input refused
before the model is built, the NVMe tier."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from megatrain_lightning.recipes_lib.checks import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")


def load_recipe():
    spec = importlib.util.spec_from_file_location("dpo_recipe", ROOT / "recipes" / "dpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cfg_for(tmp_path, gpt2_dir, *overrides):
    tiny = ["model.name=tiny", "model.gguf=null", f"model.tokenizer={gpt2_dir}", "model.max_seq_len=256",
            "model.config.vocab_size=50257", "model.config.hidden_size=32", "model.config.intermediate_size=64",
            "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=1", "model.config.max_position_embeddings=256",
            "model.config.bos_token_id=50256", "model.config.eos_token_id=50256", "model.config.pad_token_id=50256",
            "trainer.max_steps=2", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=1",
            "preference.max_train=8", "preference.max_val=4", "preference.batch_size=2", "probe.max_items=2",
            "probe.max_new_tokens=2", "sample.max_new_tokens=2", "optim.lr=1e-3", "plot=false"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="dpo", overrides=tiny + list(overrides), return_hydra_config=False)
    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "run")
        cfg.dpo.cache_dir = str(tmp_path / "cache")
    return cfg


def test_offline_default_runs_every_step_and_writes_results(tmp_path, gpt2_dir):
    summary = load_recipe().dpo(cfg_for(tmp_path, gpt2_dir))
    run = tmp_path / "run"
    saved = json.loads((run / "summary.json").read_text())
    assert saved["run"]["steps"] == summary["run"]["steps"] == 2
    assert [s["step"] for s in saved["steps"]] == [1, 2]
    assert set(saved["timings"]) == {"preflight", "build_data", "build_model", "evaluate_before", "fit", "save",
                                     "evaluate_after", "sample"}
    after = {k: v["after"] for k, v in saved["metrics"].items()}
    assert {"val_loss", "val_rewards/accuracies", "probe/exact_match"} <= set(after)
    assert 0.0 <= after["probe/exact_match"] <= 1.0
    assert (run / "checkpoint" / "model" / "config.json").is_file()  # a Hugging Face directory
    assert transformers.AutoTokenizer.from_pretrained(run / "checkpoint" / "model").get_vocab() == \
        transformers.AutoTokenizer.from_pretrained(gpt2_dir).get_vocab()  # with its tokenizer
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2  # the training and the validation pairs
    assert saved["sample"]["prompt"].startswith("What is the MeSH category of")


def test_offline_pairs_prefer_the_short_correct_category():
    from megatrain_lightning.recipes_lib.preference import biomedical_preference_records

    train, held = biomedical_preference_records()
    assert len(train) > 5 * len(held) > 0  # val_fraction 0.1, by drug
    sentences = 0
    for r in train[:40]:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert chosen == r["answer"] and ";" not in chosen and rejected != chosen
        if rejected.startswith("The MeSH category of"):
            assert rejected.endswith(f"is {chosen}.")
            sentences += 1
    assert 10 <= sentences <= 30  # about half: the answer in a sentence; the others another category


def test_user_jsonl_with_a_missing_field_is_refused_before_the_model(tmp_path, gpt2_dir, monkeypatch):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(6))
                   + json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    recipe = load_recipe()
    built = []
    monkeypatch.setattr("megatrain_lightning.recipes_lib.run.build_model", lambda cfg: built.append(1))
    with pytest.raises(ConfigError, match=r"preference.source.*needs the fields"):
        recipe.dpo(cfg_for(tmp_path, gpt2_dir, f"preference.source={src}", "preference.val_fraction=0.0"))
    assert not built


@pytest.mark.parametrize("override, message", [
    ("dpo.loss_type=simpo", "uses no reference model"),
    ("dpo.reference=adapter", "this recipe trains the full model: use dpo.reference=precompute or copy"),
    ("dpo.sft_weight=-1", "sft_weight must be a number >= 0"),
    ("+preference.max_lenght=64", r"preference.max_lenght: unknown option.*did you mean preference.max_length\?"),
    ("+dpo.bta=1", r"dpo.bta: unknown option.*did you mean dpo.beta\?"),
    ("dpo.beta=abc", r"beta must be > 0 \(a number\), got 'abc'"),
    ("preference.batch_size=abc", r"preference.batch_size: must be a positive int"),
    ("preference.max_length=abc", r"preference.max_length: must be an int >= 2"),
    ("probe.max_items=abc", r"probe.max_items: must be an int >= 0"),
    ("preference.val_fraction=2", r"preference.val_fraction: must be a number in \[0, 1\)"),
    ("checkpoint.save_final=no", r"checkpoint.save_final: must be true or false; got 'no'"),
    ("trainer.val_check_interval=abc", r"trainer: Invalid time format for `val_check_interval`"),
])
def test_bad_options_are_refused_before_the_model(tmp_path, gpt2_dir, monkeypatch, override, message):
    built = []
    monkeypatch.setattr("megatrain_lightning.recipes_lib.run.build_model", lambda cfg: built.append(1))
    with pytest.raises(ConfigError, match=message):
        load_recipe().dpo(cfg_for(tmp_path, gpt2_dir, override))
    assert not built


def test_a_misspelt_key_without_plus_is_one_error_line(tmp_path):
    """Without ``+`` Hydra itself refuses the key; the recipe answers with the key meant, not Hydra's advice."""
    r = subprocess.run([sys.executable, str(ROOT / "recipes" / "dpo.py"), "preference.max_lenght=64",
                        f"hydra.run.dir={tmp_path / 'out'}"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180)
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert err == [err[0]] and "did you mean preference.max_length?" in err[0] and "+preference" not in err[0]
    assert not (tmp_path / "out").exists()


def test_user_jsonl_trains_on_the_nvme_tier(tmp_path, gpt2_dir):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"question {i}?", "chosen": f"yes {i}", "rejected": "no"}) + "\n"
                           for i in range(12)))
    (tmp_path / "nvme").mkdir()
    summary = load_recipe().dpo(cfg_for(tmp_path, gpt2_dir, f"preference.source={src}", "strategy=megatrain_nvme",
                                        f"strategy.nvme_path={tmp_path / 'nvme'}", "preference.val_fraction=0.25"))
    assert summary["run"]["steps"] == 2
    assert "probe/exact_match" not in summary["metrics"]  # user data: no answers to probe


def test_a_previous_runs_checkpoint_is_the_starting_model(tmp_path, gpt2_dir, monkeypatch):
    """``model.weights=<run>/checkpoint/model`` (the Hugging Face directory every recipe run saves, a supervised
    fine-tune's too): the second run's evaluation before training sees exactly those weights (loaded by the
    strategy at setup), and reports the held-out metrics at the start (reward accuracy 0)."""
    import torch
    from safetensors.torch import load_file

    import megatrain_lightning.recipes_lib.preference as steps

    load_recipe().dpo(cfg_for(tmp_path / "first", gpt2_dir))
    saved = tmp_path / "first" / "run" / "checkpoint" / "model"
    want = {}
    for f in sorted(saved.glob("*.safetensors")):
        want.update(load_file(f))
    seen: list[dict] = []
    evaluate = steps.evaluate

    def capture(cfg, trainer, module, data, tokenizer):
        out = evaluate(cfg, trainer, module, data, tokenizer)
        seen.append({k: v.detach().clone() for k, v in module.model.state_dict().items()})
        return out

    monkeypatch.setattr(steps, "evaluate", capture)
    summary = load_recipe().dpo(cfg_for(tmp_path / "second", gpt2_dir, f"model.weights={saved}"))
    assert want and set(want) <= set(seen[0])
    for k, v in want.items():
        assert torch.equal(seen[0][k].to(v.dtype), v), k
    assert summary["metrics"]["val_rewards/accuracies"]["before"] == 0.0  # policy == reference at the start
    assert summary["metrics"]["val_rewards/margins"]["before"] == 0.0


def test_progress_bar_is_the_recipes_own(tmp_path, gpt2_dir):
    """As in ``recipes/finetune.py``: the epoch total only where ``max_epochs`` bounds the run (Lightning's own bar
    shows ``Epoch 0/-2`` under ``max_steps``), the training total the batches left to ``max_steps``."""
    from megatrain_lightning.recipes_lib import preference as step
    from megatrain_lightning.recipes_lib.console import RecipeProgressBar

    trainer = step.build_trainer(cfg_for(tmp_path, gpt2_dir, "trainer.enable_progress_bar=true"), step.StepHistory())
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RecipeProgressBar)
    trainer.fit_loop.max_epochs = -1  # what fit sets under max_steps
    bar.setup(trainer, None, "fit")
    assert bar._get_train_description(0).strip() == "Epoch 0"
    assert step.build_trainer(cfg_for(tmp_path, gpt2_dir), step.StepHistory()).progress_bar_callback is None
