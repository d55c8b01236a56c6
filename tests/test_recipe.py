"""The Hydra recipe: configs compose and the data group's values win, every bad config is refused
before the model is built with the Hydra key to change, each data format trains a 2-step run of a tiny model,
results are written, resume continues the step count, and a short real SmolLM2-135M run goes end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import transformers
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

import megatrain_lightning  # noqa: F401
from megatrain_lightning.planning import PreflightError
from megatrain_lightning.recipes_lib import run as step
from megatrain_lightning.recipes_lib.checks import ConfigError, check_values
from megatrain_lightning.recipes_lib.checkpoints import RecordRunIdentity, resolve_resume, run_identity
from megatrain_lightning.recipes_lib.results import SUMMARY_KEYS
from megatrain_lightning.testing import LM, make_data, make_model

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
MODELS = sorted(p.stem for p in Path(CONF, "model").glob("*.yaml"))
DATA = sorted(p.stem for p in Path(CONF, "data").glob("*.yaml"))
_spec = importlib.util.spec_from_file_location("finetune_recipe", ROOT / "recipes" / "finetune.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)
finetune = recipe.finetune


def cfg_for(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=list(overrides), return_hydra_config=False)
    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "run")
        cfg.data.cache_dir = str(tmp_path / "cache")
        if cfg.model.get("gguf"):  # the dequantised SmolLM2, shared by this session's tests (not the user's cache)
            cfg.model.gguf.cache_dir = str(tmp_path.parent / "gguf-cache")
        if not any(o.startswith("checkpoint.search_dir=") for o in overrides):
            cfg.checkpoint.search_dir = str(tmp_path)  # its default interpolates Hydra's runtime.cwd
    return cfg


def tiny(gpt2_dir):
    """Overrides for a random 2-layer Llama (hidden 32) with the GPT-2 tokenizer: a recipe run in seconds."""
    return ["model.name=tiny", "model.gguf=null", f"model.tokenizer={gpt2_dir}", "model.max_seq_len=256",
            "model.config.vocab_size=50257", "model.config.hidden_size=32", "model.config.intermediate_size=64",
            "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=1", "model.config.max_position_embeddings=256",
            "model.config.bos_token_id=50256", "model.config.eos_token_id=50256", "model.config.pad_token_id=50256",
            "trainer.max_steps=2", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=1",
            "data.seq_len=32", "data.batch_size=2", "data.val_fraction=0.25", "sample.max_new_tokens=2",
            "optim.lr=3e-3", "optim.warmup_steps=0", "plot=false"]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PAIRS = [{"question": f"What is item {i}?", "answer": f"It is number {i}."} for i in range(16)]


# ---------------------------------------------------------------------------------------------- config as data
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATA)
def test_every_group_composes(tmp_path, model, data):
    cfg = cfg_for(tmp_path, f"model={model}", f"data={data}")
    assert cfg.model.name == model and cfg.data._target_.endswith("make_datamodule")
    assert cfg.strategy._target_.endswith("MegaTrainStrategy") and cfg.model._target_.endswith("causal_lm")


@pytest.mark.parametrize("data", DATA)
def test_data_group_values_win_over_the_recipe(tmp_path, data):
    """Regression: finetune.yaml once overrode seq_len/batch_size/probe of every data group."""
    declared = yaml.safe_load((ROOT / "conf" / "data" / f"{data}.yaml").read_text())
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[f"data={data}"])
    got = OmegaConf.to_container(cfg.data, resolve=False)
    assert got == declared


def test_model_entries_instantiate_what_the_planner_reads(tmp_path, gpt2_dir):
    from megatrain_lightning.planning import plan

    cfg = cfg_for(tmp_path, *tiny(gpt2_dir))
    model, tok = step.build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) > 0 and tok.eos_token_id == 50256
    counted = plan(OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.hardware), batch_size=1,
                   seq_len=32).counts.total
    assert counted == sum(p.numel() for p in model.parameters())


def test_overrides_apply(tmp_path):
    cfg = cfg_for(tmp_path, "trainer.max_steps=7", "optim.lr=3e-5", "data.seq_len=128", "strategy.lookahead=2")
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.data.seq_len, cfg.strategy.lookahead) == (7, 3e-5, 128, 2)


def test_log_every_adapts_to_short_runs():
    assert [step.log_every(5, n) for n in (2, 7, 20, 1000)] == [1, 1, 5, 5]


# ---------------------------------------------------------------------------------------------- refused before the build
@pytest.fixture
def no_build(monkeypatch):
    """The model build fails the test: a refusal must come before it."""
    def built(cfg):
        raise AssertionError("the model was built before the config was refused")
    monkeypatch.setattr(step, "build_model", built)


def refused(tmp_path, *overrides, key, match=None):
    cfg = cfg_for(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=match) as err:
        finetune(cfg)
    assert err.value.key == key, str(err.value)
    assert str(err.value).startswith(key)
    assert not (tmp_path / "run").exists()  # nothing written
    return str(err.value)


@pytest.mark.parametrize("override, key, match", [
    ("eval.before=off", "eval.before", "must be true or false; got 'off'"),
    ("checkpoint.save_optimizer=no", "checkpoint.save_optimizer", "must be true or false; got 'no'"),
    ("trainer.log_every_n_steps=x", "trainer.log_every_n_steps", "must be a positive int"),
])
def test_refuses_words_for_yes_no_and_numbers(tmp_path, no_build, override, key, match):
    """Hydra reads only true/false as booleans: ``eval.before=off`` stayed the string "off", which counted as true."""
    refused(tmp_path, override, key=key, match=match)


def test_refuses_a_trainer_value_lightning_refuses_before_the_build(tmp_path, no_build):
    """``trainer.*`` values are Lightning's to check; the Trainer is built before the model, so its refusal costs
    no model load and is one line naming ``trainer``."""
    refused(tmp_path, "trainer.gradient_clip_val=abc", key="trainer", match="`gradient_clip_val` should be an int")


@pytest.mark.parametrize("recipe, conf, names", [
    ("finetune", ["finetune.yaml", "data/*.yaml", "trainer/*.yaml"], "FINETUNE_BOOLEANS"),
    ("dpo", ["dpo.yaml", "trainer/*.yaml"], "DPO_BOOLEANS"),
])
def test_the_checked_yes_no_keys_are_the_configs(recipe, conf, names):
    """Every key whose value in ``conf/`` is true or false is checked as one (and no other)."""
    from megatrain_lightning.recipes_lib import checks, preference

    found = set()

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, bool):
                found.add(f"{prefix}{k}")

    for pattern in conf:
        for path in Path(CONF).glob(pattern):
            prefix = "" if "/" not in pattern else pattern.split("/")[0] + "."
            walk(OmegaConf.to_container(OmegaConf.load(path)), prefix)
    assert found == set(getattr(checks if recipe == "finetune" else preference, names))


def test_refuses_unknown_strategy_option(tmp_path, no_build):
    msg = refused(tmp_path, "+strategy.lookahaed=2", key="strategy.lookahaed")
    assert "did you mean strategy.lookahead" in msg


def test_refuses_bad_values_before_the_build_naming_the_key(tmp_path, no_build):
    """Wrong values (a word for a number, a negative size, a misspelt mode) are one ConfigError naming the key,
    before the model loads; the strategy group is built to check its options."""
    refused(tmp_path, "trainer.max_steps=abc", key="trainer.max_steps", match="positive int")
    refused(tmp_path, "trainer.max_steps=0", key="trainer.max_steps")
    refused(tmp_path, "trainer.accumulate_grad_batches=0", key="trainer.accumulate_grad_batches")
    refused(tmp_path, "data.seq_len=0", key="data.seq_len")
    refused(tmp_path, "data.batch_size=-1", key="data.batch_size")
    refused(tmp_path, "data.seq_len=10000", key="data.seq_len", match="longer than the model's maximum of 8192 "
                                                                     "positions .* use data.seq_len=8192 or less")
    refused(tmp_path, "data.val_fraction=1.5", key="data.val_fraction", match=r"in \[0, 1\)")
    refused(tmp_path, "optim.warmup_steps=-2", key="optim.warmup_steps")
    refused(tmp_path, "checkpoint.every_n_steps=0", key="checkpoint.every_n_steps")
    refused(tmp_path, "sample.max_new_tokens=-1", key="sample.max_new_tokens")
    refused(tmp_path, "eval.max_batches=0", key="eval.max_batches", match="eval.before=false")
    refused(tmp_path, "strategy.lookahead=-1", key="strategy", match="strategy.lookahead")
    refused(tmp_path, "strategy.lookahead=abc", key="strategy", match="lookahead must be an int")
    refused(tmp_path, "strategy.recompute=selctive", key="strategy", match="'selctive' is not a recompute policy")
    refused(tmp_path, "strategy.offload_activations=yes", key="strategy", match="offload_activations must be True or False")
    refused(tmp_path, "trainer.precision=fp16", key="trainer.precision", match="supports precision in")
    # also without the planner (before, a Lightning traceback after the model load)
    refused(tmp_path, "trainer.precision=fp16", "preflight=false", key="trainer.precision", match="bf16-mixed")


def test_refuses_unknown_keys_of_each_group(tmp_path, no_build):
    refused(tmp_path, "+trainer.max_stepz=3", key="trainer.max_stepz", match="did you mean trainer.max_steps")
    refused(tmp_path, "+optim.learning_rate=1", key="optim.learning_rate")
    refused(tmp_path, "+data.seqlen=3", key="data.seqlen", match="did you mean data.seq_len")
    refused(tmp_path, "+data.probe.max_item=3", key="data.probe.max_item", match="did you mean data.probe.max_items")
    refused(tmp_path, "+data.source_options.max_filez=3", "data=code", key="data.source_options.max_filez")
    refused(tmp_path, "+model.weigths=x", key="model.weigths", match="did you mean model.weights")
    refused(tmp_path, "+evall.before=false", key="evall", match="did you mean eval")
    refused(tmp_path, "+eval.befor=false", key="eval.befor", match="did you mean eval.before")
    refused(tmp_path, "+trainer.logger=false", key="trainer.logger", match="set by the recipe")


def test_refuses_instruction_shape_on_a_text_corpus(tmp_path, no_build):
    msg = refused(tmp_path, "data=legal", "data.shape=instruction", key="data.shape")
    assert "data=instruction data.source=" in msg


def test_refuses_wrong_field_names_with_the_override(tmp_path, no_build):
    src = write_jsonl(tmp_path / "qa.jsonl", PAIRS)
    msg = refused(tmp_path, "data=instruction", f"data.source={src}", key="data.source_options.prompt_field")
    # both fields are missing: one error names both overrides
    assert msg.endswith("Run with data.source_options.prompt_field=question data.source_options.response_field=answer.")
    msg = refused(tmp_path, "data=instruction", f"data.source={src}", "data.source_options.prompt_field=question",
                  key="data.source_options.response_field")
    assert "data.source_options.response_field=answer" in msg


def test_refuses_bad_records_anywhere_in_the_source_before_the_build(tmp_path, no_build):
    """Regression: preflight read the first 8 records only; a malformed record further on, an empty file, too few
    records for the validation split or chat records without an answer failed after the model load (85 s for
    SmolLM2-135M) with a traceback and exit 1."""
    rows = [{"prompt": f"Q{i}?", "response": f"A{i}"} for i in range(30)]
    src = write_jsonl(tmp_path / "late.jsonl", rows)
    with open(src, "a") as f:
        f.write("{not json\n")
    refused(tmp_path, "data=instruction", f"data.source={src}", key="data.source", match=r"late.jsonl:31: not valid JSON")
    src = write_jsonl(tmp_path / "missing.jsonl", rows[:20] + [{"prompt": "Q?"}] + rows[20:])
    refused(tmp_path, "data=instruction", f"data.source={src}", key="data.source_options.response_field",
            match=r"missing.jsonl:21")
    (tmp_path / "empty.jsonl").write_text("")
    refused(tmp_path, "data=instruction", f"data.source={tmp_path / 'empty.jsonl'}", key="data.source",
            match="has no non-empty instruction documents")
    src = write_jsonl(tmp_path / "few.jsonl", rows[:2])
    refused(tmp_path, "data=instruction", f"data.source={src}", key="data.val_fraction",
            match=r"No document fell into the validation split \(2 documents, val_fraction=0.05\)")
    big = tmp_path / "with_logs"  # files the source does not read do not count toward the 1 GiB of the full check
    big.mkdir()
    write_jsonl(big / "a.jsonl", rows[:16] + [{"prompt": None, "response": "A"}])
    with open(big / "huge.log", "wb") as f:
        f.truncate(2**30 + 2**27)  # sparse
    refused(tmp_path, "data=instruction", f"data.source={big}", key="data.source", match=r"a.jsonl:17: field 'prompt' is null")
    chat = [{"messages": [{"role": "user", "content": f"Hi {i}"}]} for i in range(20)]
    src = write_jsonl(tmp_path / "noanswer.jsonl", chat)
    refused(tmp_path, "data=instruction", f"data.source={src}", key="data.source", match="no record has an assistant turn")


def test_refuses_text_group_on_instruction_records(tmp_path, no_build):
    src = write_jsonl(tmp_path / "qa.jsonl", PAIRS)
    msg = refused(tmp_path, "data=text", f"data.source={src}", key="data.shape")
    assert "data.shape=instruction" in msg


def test_refuses_a_json_list_named_jsonl(tmp_path, no_build):
    (tmp_path / "list.jsonl").write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    refused(tmp_path, "data=text", f"data.source={tmp_path / 'list.jsonl'}", key="data.source",
            match="is it a .json file")
    (tmp_path / "line.jsonl").write_text(json.dumps([{"text": "a"}, {"text": "b"}]))  # json.dump: one line
    refused(tmp_path, "data=text", f"data.source={tmp_path / 'line.jsonl'}", key="data.source",
            match="a JSON list, not one JSON object per line .is it a .json file")


def test_refuses_missing_or_absent_source(tmp_path, no_build):
    refused(tmp_path, "data=instruction", key="data.source", match="is required")
    refused(tmp_path, "data=instruction", f"data.source={tmp_path / 'nope.jsonl'}", key="data.source",
            match="does not exist")


def test_refuses_missing_nvme_path_naming_key_and_variable(tmp_path, no_build, monkeypatch):
    monkeypatch.delenv("MEGATRAIN_NVME_PATH", raising=False)
    msg = refused(tmp_path, "strategy=megatrain_nvme", key="strategy.nvme_path")
    assert "MEGATRAIN_NVME_PATH" in msg
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path / "absent"))
    refused(tmp_path, "strategy=megatrain_nvme", key="strategy.nvme_path", match="absent.*MEGATRAIN_NVME_PATH")


def test_refuses_an_unwritable_nvme_path_before_the_build(tmp_path, no_build, monkeypatch):
    """A directory the store cannot write to is refused by the recipe's checks (exit 2, the key named), not by the
    strategy after the model has loaded; a read-only mount is named as such."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: Path(p) != nvme and real_access(p, mode, *a, **k))
    refused(tmp_path, "strategy=megatrain_nvme", f"strategy.nvme_path={nvme}", key="strategy.nvme_path",
            match="is not writable by this user")
    real_statvfs = os.statvfs

    class ReadOnly:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, k):
            return os.ST_RDONLY | self._st.f_flag if k == "f_flag" else getattr(self._st, k)

    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly(real_statvfs(p)) if Path(p) == nvme else real_statvfs(p))
    refused(tmp_path, "strategy=megatrain_nvme", f"strategy.nvme_path={nvme}", key="strategy.nvme_path",
            match=r"read-only filesystem \(mounted ro\): remount it")


def test_refuses_missing_logger_package_and_resume(tmp_path, no_build, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard",
                        "tensorboardX") else real_find_spec(name, *a))  # as if the loggers extra were not installed
    refused(tmp_path, "logger=wandb", key="logger", match=r"megatrain-lightning\[loggers\]")
    refused(tmp_path, "logger=[csv,tensorboard]", key="logger", match=r"logger=tensorboard needs .*\[loggers\]")
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    refused(tmp_path, "logger=comet", key="logger", match="unknown logger")
    refused(tmp_path, "logger=[csv,comet]", key="logger", match="unknown logger .comet.")
    refused(tmp_path, "logger=[csv,csv]", key="logger", match="more than once")
    refused(tmp_path, "resume=last", f"checkpoint.search_dir={tmp_path}", key="resume", match="found no last.ckpt")
    refused(tmp_path, f"resume={tmp_path}", key="resume", match="not a checkpoint directory")
    refused(tmp_path, f"resume={tmp_path / 'gone' / 'last.ckpt'}", key="resume", match="gone/last.ckpt does not exist")


def test_preflight_refuses_llama100b_here_before_allocating(tmp_path, no_build):
    cfg = cfg_for(tmp_path, "model=llama100b", "data=legal")
    with pytest.raises(PreflightError, match="host RAM short"):
        finetune(cfg)
    assert not (tmp_path / "run").exists()


def test_preflight_refuses_llama100b_on_nvme_for_disk(tmp_path, monkeypatch, no_build):
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    cfg = cfg_for(tmp_path, "model=llama100b", "strategy=megatrain_nvme")
    with pytest.raises(PreflightError, match="disk"):
        finetune(cfg)
    assert not (tmp_path / "run").exists()


def test_preflight_refuses_a_host_memory_limit_below_the_nvme_window_before_the_build(tmp_path, monkeypatch,
                                                                                       gpt2_dir, no_build):
    """``strategy.host_memory_limit`` below the window the engine needs was ignored by preflight: the run built the
    model, evaluated it, then failed when fit set up the NVMe tier. Now it is refused first, with the engine's
    numbers (the minimum it names is the limit the engine takes: a run at it passes preflight)."""
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    cfg = cfg_for(tmp_path, *tiny(gpt2_dir), "strategy=megatrain_nvme", "strategy.host_memory_limit=1MiB")
    with pytest.raises(PreflightError, match=r"host_memory_limit=1048576 bytes \(1.00 MiB\) is below the (\d+) bytes"):
        finetune(cfg)
    assert not (tmp_path / "run").exists()
    try:
        step.preflight(cfg)
    except PreflightError as e:
        minimum = int(str(e).split("Raise host_memory_limit to at least ")[1].split()[0])
    ok = cfg_for(tmp_path, *tiny(gpt2_dir), "strategy=megatrain_nvme", f"strategy.host_memory_limit={minimum}")
    step.preflight(ok)


def test_command_line_refusal_is_one_line_exit_2_and_no_run_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune.py"), "+strategy.lookahaed=2",
                        f"hydra.run.dir={tmp_path / 'outputs' / 'day' / 'time'}"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "error: strategy.lookahaed: unknown option" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*"))


def test_help_does_not_import_torch(tmp_path):
    code = ("import runpy, sys; sys.argv = ['finetune.py', '--help']\n"
            "try:\n    runpy.run_path(%r, run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'finetune.py --help imported torch'\n") % str(ROOT / "recipes" / "finetune.py")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "finetune is powered by Hydra" in r.stdout


# ---------------------------------------------------------------------------------------------- own data, every format
def _formats(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (data group, source path) of 16+ records in each format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [{"text": f"Clause {i}. The licensee shall keep this notice number {i} in every copy."} for i in range(16)]
    pr = [{"prompt": f"What is {i} plus one?", "response": f"{i + 1}"} for i in range(16)]
    alpaca = [{"instruction": "Add one.", "input": f"{i}", "output": f"{i + 1}"} for i in range(16)]
    chat = [{"messages": [{"role": "user", "content": f"Name {i}"}, {"role": "assistant", "content": f"N{i}"}]}
            for i in range(16)]
    sharegpt = [{"conversations": [{"from": "human", "value": f"Say {i}"}, {"from": "gpt", "value": f"{i}"}]}
                for i in range(16)]
    (tmp / "dir").mkdir()
    for i, t in enumerate(texts):
        (tmp / "dir" / f"doc{i}.txt").write_text(t["text"])
    (tmp / "lines.txt").write_text("\n".join(t["text"] for t in texts))
    (tmp / "list.json").write_text(json.dumps(pr))
    pq.write_table(pa.Table.from_pylist(alpaca), tmp / "alpaca.parquet")
    return {
        "text-jsonl": ("text", write_jsonl(tmp / "text.jsonl", texts)),
        "text-txt-lines": ("text", str(tmp / "lines.txt")),
        "text-directory": ("text", str(tmp / "dir")),
        "prompt-response-json": ("instruction", str(tmp / "list.json")),
        "alpaca-parquet": ("instruction", str(tmp / "alpaca.parquet")),
        "alpaca-jsonl": ("instruction", write_jsonl(tmp / "alpaca.jsonl", alpaca)),
        "chat-messages": ("instruction", write_jsonl(tmp / "chat.jsonl", chat)),
        "sharegpt": ("instruction", write_jsonl(tmp / "sharegpt.jsonl", sharegpt)),
    }


FORMATS = ["text-jsonl", "text-txt-lines", "text-directory", "prompt-response-json", "alpaca-parquet", "alpaca-jsonl",
           "chat-messages", "sharegpt"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_trains_two_steps(tmp_path, gpt2_dir, fmt):
    group, src = _formats(tmp_path)[fmt]
    extra = ["data.source_options.txt_mode=line"] if fmt == "text-txt-lines" else []
    cfg = cfg_for(tmp_path, f"data={group}", f"data.source={src}", "eval.before=false", *extra, *tiny(gpt2_dir))
    out = finetune(cfg)
    assert out["run"]["steps"] == 2 and [p["step"] for p in out["loss"]] == [1, 2]
    assert all(v["before"] is None for v in out["metrics"].values())  # eval.before=false
    prompts = {"chat-messages": "Name ", "sharegpt": "Say ", "alpaca-jsonl": "Add one.\n\n", "text-jsonl": "Clause "}
    if fmt in prompts:  # the sample's prompt is a record of the user's data
        assert out["sample"]["prompt"].startswith(prompts[fmt])
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(out["checkpoint"]) / "model")
    assert model.config.num_hidden_layers == 2
    assert not (Path(out["checkpoint"]) / "optimizer").exists()  # checkpoint.save_optimizer=false (default)


def test_examples_left_out_by_seq_len_are_reported(tmp_path, gpt2_dir, capsys, caplog):
    """Regression: records whose prompt fills data.seq_len were dropped without a word (half the data here)."""
    rows = [{"prompt": "word " * 60 if i % 2 else f"Q{i}?", "response": f"A{i}"} for i in range(16)]
    src = write_jsonl(tmp_path / "half.jsonl", rows)
    with caplog.at_level("WARNING"):
        out = finetune(cfg_for(tmp_path, "data=instruction", f"data.source={src}", "eval.before=false", *tiny(gpt2_dir)))
    n = out["run"]["examples_left_out"]
    assert n > 0 and out["run"]["examples_cut"] == 0
    assert re.search(rf"data: {n} of \d+ train examples are left out: the prompt alone fills seq_len=32", caplog.text)
    assert re.search(rf"train examples left out \(no answer within seq_len\)\s+{n}\n", capsys.readouterr().out)


def test_data_that_cannot_train_once_tokenized_is_one_error_naming_data(tmp_path, gpt2_dir):
    """Every prompt fills data.seq_len: found only once tokenized (after the model is built), it is a ConfigError
    (one `error:` line, exit 2), not a traceback from inside fit."""
    src = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 60, "response": f"A{i}"} for i in range(16)])
    cfg = cfg_for(tmp_path, "data=instruction", f"data.source={src}", "eval.before=false", *tiny(gpt2_dir))
    with pytest.raises(ConfigError, match=r"^data: The train split has no example with an answer token within "
                                          r"seq_len=32 .*raise seq_len") as e:
        finetune(cfg)
    assert e.value.key == "data"


def test_summary_files_and_loss_plot(tmp_path, gpt2_dir):
    group, src = _formats(tmp_path)["alpaca-jsonl"]
    cfg = cfg_for(tmp_path, f"data={group}", f"data.source={src}", *tiny(gpt2_dir), "plot=true", "logger=csv",
                  "eval.max_batches=1")
    out = finetune(cfg)
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary)
    assert set(summary["metrics"]) == {"val_loss", "val_ppl"}
    assert all(isinstance(v["before"], float) and isinstance(v["after"], float) for v in summary["metrics"].values())
    assert {"steps", "seconds", "tokens_per_s", "peak_rss_bytes", "h2d_bytes", "d2h_bytes"} <= set(summary["run"])
    assert {"preflight", "build_model", "evaluate_before", "fit", "evaluate_after", "save", "sample"} <= set(summary["timings"])
    assert [p["step"] for p in summary["loss"]] == [1, 2] and summary["config"]["data"]["source"] == src
    assert summary["metrics"]["val_loss"]["after"] == pytest.approx(out["metrics"]["val_loss"]["after"])
    md = (run_dir / "summary.md").read_text()
    assert "| val_loss |" in md and "![loss](loss.png)" in md
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the engine's statistics reach the logger, and a 2-step run logs its training loss (log_every_n_steps adapted)
    import csv

    rows = list(csv.DictReader(next((run_dir / "logs").rglob("metrics.csv")).open()))
    assert any(r.get("train_loss") for r in rows) and any(r.get("megatrain/h2d_bytes") for r in rows)


def test_tensorboard_logger_gets_the_engine_statistics(tmp_path, gpt2_dir):
    """logger=[csv,tensorboard] (the test extra installs tensorboard): TensorBoard's event files hold the training
    loss, the validation loss before and after, and every megatrain/* statistic with the values the CSV logger got."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    group, src = _formats(tmp_path)["alpaca-jsonl"]
    finetune(cfg_for(tmp_path, f"data={group}", f"data.source={src}", *tiny(gpt2_dir), "logger=[csv,tensorboard]",
                     "eval.max_batches=1"))
    logs = tmp_path / "run" / "logs"
    events = sorted(logs.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {logs}"
    scalars: dict[str, dict[int, float]] = {}
    for f in events:  # one file per trainer call (validate, fit, validate)
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    assert sorted(scalars["train_loss"]) == [0, 1] and sorted(scalars["val_loss"]) == [0, 2]  # before, after
    rows = list(csv.DictReader(next(logs.rglob("metrics.csv")).open()))
    engine = {k for k in rows[0] if k.startswith("megatrain/")}
    assert {"megatrain/h2d_bytes", "megatrain/d2h_bytes", "megatrain/compute_s"} <= engine
    assert engine <= set(scalars)
    for k in ("megatrain/h2d_bytes", "megatrain/d2h_bytes", "megatrain/blocks_fetched"):
        from_csv = {int(r["step"]): float(r[k]) for r in rows if r.get(k)}
        # a 32-true run on a CPU binds the fp32 masters (cpu_zero_copy): no H2D copies, h2d_bytes 0
        assert from_csv and scalars[k] == pytest.approx(from_csv) and all(
            v == 0 if k == "megatrain/h2d_bytes" else v > 0 for v in from_csv.values())


def test_without_matplotlib_the_plot_is_skipped_with_a_log_line(tmp_path, monkeypatch, caplog):
    from megatrain_lightning.recipes_lib.checks import check_environment
    from megatrain_lightning.recipes_lib.results import plot_loss

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else object())
    check_environment({"logger": "csv", "plot": True, "strategy": {}})  # a warning, not a refusal
    assert plot_loss(tmp_path / "loss.png", [{"step": 1, "loss": 2.0}], {}, {"val_loss": 1.0}) is False
    assert not (tmp_path / "loss.png").exists()
    assert "matplotlib is not installed" in caplog.text and "no loss.png" in caplog.text


def test_resume_last_continues_the_step_count(tmp_path, gpt2_dir, monkeypatch):
    group, src = _formats(tmp_path)["text-jsonl"]
    common = [f"data={group}", f"data.source={src}", "eval.before=false", *tiny(gpt2_dir),
              f"checkpoint.search_dir={tmp_path}"]
    first = finetune(cfg_for(tmp_path / "a", *common, "checkpoint.every_n_steps=2"))
    last = tmp_path / "a" / "run" / "checkpoints" / "last.ckpt"
    assert first["run"]["steps"] == 2 and (last / "optimizer").is_dir()
    resolved = []  # `resume` is resolved once (its choice and warning in preflight), not once per step
    monkeypatch.setattr(step, "resolve_resume", lambda cfg: resolved.append(resolve_resume(cfg)) or resolved[-1])
    second = finetune(cfg_for(tmp_path / "b", *common, "resume=last", "trainer.max_steps=4", "eval.before=true"))
    assert resolved == [last] and second["run"]["resumed_from"] == str(last)
    assert second["run"]["steps"] == 4 and [p["step"] for p in second["loss"]] == [3, 4]
    assert second["run"]["steps_run"] == 2 and first["run"]["steps_run"] == 2
    table = (tmp_path / "b" / "run" / "summary.md").read_text()
    assert re.search(r"\| optimizer steps \|  \| 4 \(2 in this run\) \|", table), table
    # "before" is of the weights the run continues from (it was the fresh model's), i.e. the first run's "after"
    assert second["metrics"]["val_loss"]["before"] == first["metrics"]["val_loss"]["after"]


def test_resume_last_takes_the_newest_run_of_the_same_model_and_data(tmp_path, gpt2_dir, no_build, monkeypatch):
    """Regression: resume=last took the newest last.ckpt of any run, e.g. of an unrelated data set, and continued
    its step count, optimizer state and data position silently. It now skips runs of other model/data and, when
    only those exist, refuses naming the newest and what differs."""
    group, src = _formats(tmp_path)["text-jsonl"]
    common = [f"data={group}", "eval.before=false", *tiny(gpt2_dir), f"checkpoint.search_dir={tmp_path}"]
    mine = cfg_for(tmp_path / "a", *common, f"data.source={src}", "resume=last")
    ckpt = tmp_path / "a" / "run" / "checkpoints" / "last.ckpt"
    t = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                   callbacks=[RecordRunIdentity(run_identity(mine))], enable_checkpointing=False)
    t.fit(LM(make_model("llama")), make_data(n=4))
    t.save_checkpoint(ckpt)
    other_src = write_jsonl(tmp_path / "other.jsonl", [{"text": f"Another corpus, line {i}."} for i in range(16)])
    msg = refused(tmp_path / "b", *common, f"data.source={other_src}", "resume=last", key="resume",
                  match="none from a run of this model on this data")
    assert f"the newest, {ckpt}, differs in data.source: '{src}' there, '{other_src}' here" in msg
    newer = tmp_path / "c" / "run" / "checkpoints" / "last.ckpt"  # a newer run of the other data
    shutil.copytree(ckpt, newer)
    meta = torch.load(newer / "trainer.pt", weights_only=True)
    meta["recipe"]["data"]["source"] = other_src
    torch.save(meta, newer / "trainer.pt")
    assert resolve_resume(mine) == ckpt and resolve_resume(cfg_for(tmp_path / "d", *common, f"data.source={other_src}",
                                                                   "resume=last")) == newer
    # a run directory that already held a last.ckpt gets Lightning's last-v1.ckpt: found too (not other names)
    versioned, other_name = tmp_path / "g" / "last-v1.ckpt", tmp_path / "g" / "last-old.ckpt"
    shutil.copytree(ckpt, versioned)
    os.utime(versioned)  # copytree copies the directory's time: make it the newest
    assert resolve_resume(mine) == versioned
    shutil.rmtree(versioned)
    shutil.copytree(ckpt, other_name)
    os.utime(other_name)  # newest, but no name ModelCheckpoint gives its "last"
    assert resolve_resume(mine) == ckpt
    # the same file by a relative path is the same data; the same relative path from elsewhere is not
    monkeypatch.chdir(tmp_path)
    assert resolve_resume(cfg_for(tmp_path / "e", *common, "data.source=text.jsonl", "resume=last")) == ckpt
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "text.jsonl", [{"text": f"Yet another corpus, line {i}."} for i in range(16)])
    monkeypatch.chdir(tmp_path / "sub")
    refused(tmp_path / "f", *common, "data.source=text.jsonl", "resume=last", key="resume",
            match="none from a run of this model on this data")


def test_resume_refuses_a_weights_only_checkpoint_and_its_advice_works(tmp_path, gpt2_dir):
    """Regression: resume=<run>/checkpoint (the final save, weights only with checkpoint.save_optimizer=false)
    passed preflight, loaded the model, evaluated, then fit died with Lightning's raw KeyError. It is refused in
    preflight (key resume) saying what to do, and its model.weights= override starts a new run from those weights."""
    group, src = _formats(tmp_path)["text-jsonl"]
    common = [f"data={group}", f"data.source={src}", *tiny(gpt2_dir), f"checkpoint.search_dir={tmp_path}"]
    first = finetune(cfg_for(tmp_path / "a", *common, "eval.before=false"))
    ckpt = Path(first["checkpoint"])
    assert json.loads((ckpt / "megatrain.json").read_text())["has_optimizer"] is False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step, "build_model", lambda cfg: pytest.fail("the model was built before resume was refused"))
        msg = refused(tmp_path / "b", *common, f"resume={ckpt}", key="resume", match="no AdamW state")
    assert "checkpoints/last.ckpt" in msg and "checkpoint.save_optimizer=true" in msg
    weights = re.search(r"model\.weights=(\S+)", msg).group(1)
    assert weights == str(ckpt / "model") and "model.gguf=null" in msg
    again = finetune(cfg_for(tmp_path / "c", *common, f"model.weights={weights}", "trainer.max_steps=1"))
    assert again["metrics"]["val_loss"]["before"] == pytest.approx(first["metrics"]["val_loss"]["after"], rel=1e-5)


def test_loss_history_under_accumulation_is_the_module_loss_as_logged(tmp_path, gpt2_dir, monkeypatch):
    """Regression: with trainer.accumulate_grad_batches=2 the history (summary.json, loss.png) recorded
    Lightning's outputs["loss"], divided by 2. It now has one entry per optimizer step: the mean of the losses
    training_step returned for its micro-batches, the train_loss that logs/metrics.csv holds for that step."""
    import csv

    from megatrain_lightning.recipes_lib.module import CausalLMModule

    returned: dict[int, list[float]] = {}
    original = CausalLMModule.training_step

    def recording(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        returned.setdefault(self.trainer.global_step + 1, []).append(float(loss))
        return loss

    monkeypatch.setattr(CausalLMModule, "training_step", recording)
    group, src = _formats(tmp_path)["text-jsonl"]
    out = finetune(cfg_for(tmp_path, f"data={group}", f"data.source={src}", "eval.before=false", *tiny(gpt2_dir),
                           "trainer.accumulate_grad_batches=2", "logger=csv"))
    assert [p["step"] for p in out["loss"]] == [1, 2] and all(len(v) == 2 for v in returned.values())
    expected = [sum(returned[s]) / 2 for s in (1, 2)]
    assert [p["loss"] for p in out["loss"]] == pytest.approx(expected, rel=1e-5)
    rows = list(csv.DictReader(next((tmp_path / "run" / "logs").rglob("metrics.csv")).open()))
    logged = {int(r["step"]) + 1: float(r["train_loss"]) for r in rows if r.get("train_loss")}
    assert logged == pytest.approx({1: expected[0], 2: expected[1]}, rel=1e-5)


# ---------------------------------------------------------------------------------------------- real model
def test_short_real_run_end_to_end(tmp_path, capsys):
    cfg = cfg_for(tmp_path, "data=legal", "trainer.max_steps=2", "trainer.limit_val_batches=2", "data.seq_len=64",
                  "data.batch_size=2", "data.probe.max_items=2", "sample.max_new_tokens=4",
                  "trainer.enable_progress_bar=false", "optim.lr=3e-4")
    out = finetune(cfg)
    assert out["run"]["steps"] == 2
    assert out["metrics"]["val_loss"]["after"] < out["metrics"]["val_loss"]["before"]
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(out["checkpoint"]) / "model")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    printed = capsys.readouterr().out
    assert "val_ppl" in printed and "sample" in printed and "probe/clause_loss" in printed


def test_instruction_sample_uses_the_chat_template(tmp_path):
    """The biomedical sample once printed nothing: the raw prompt made the instruct model end its turn at once.
    Instruction data is now asked in its training format (SmolLM2's chat template), and the completion is the new
    tokens only."""
    from types import SimpleNamespace

    import torch
    from megatrain_lightning.checkpoint.gguf import SMOLLM2_GGUF, smollm2_gguf_dir
    from megatrain_lightning.recipes_lib.module import CausalLMModule

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_dir()), gguf_file=SMOLLM2_GGUF)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512))
    seen = []
    real_generate = model.generate

    def generate(ids, **kw):
        seen.append(tok.decode(ids[0]))
        return real_generate(ids, **kw)

    model.generate = generate
    cfg = OmegaConf.create({"sample": {"prompt": None, "max_new_tokens": 3}, "data": {"source": "pairs.jsonl"}})
    dm = SimpleNamespace(shape="instruction", use_chat_template=True,
                         documents={"val": [{"id": "a", "prompt": "What is the MeSH category of aspirin?",
                                             "response": "Organic Chemicals"}]})
    trainer = SimpleNamespace(strategy=SimpleNamespace(engine=None))
    out = step.sample(cfg, trainer, CausalLMModule(model, tokenizer=tok), tok, dm)
    assert out["prompt"] == "What is the MeSH category of aspirin?"  # the held-out record, not a built-in prompt
    assert seen[0].startswith("<|im_start|>") and seen[0].endswith("<|im_start|>assistant\n")
    assert "MeSH" not in out["completion"] or len(tok(out["completion"]).input_ids) <= 3  # new tokens only


def test_nvme_strategy_group_composes_and_needs_a_path(tmp_path, monkeypatch):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    monkeypatch.delenv("MEGATRAIN_NVME_PATH", raising=False)
    cfg = cfg_for(tmp_path, "strategy=megatrain_nvme", "strategy.host_memory_limit=2GiB")
    with pytest.raises(InstantiationException, match="needs nvme_path"):  # hydra wraps the strategy's ValueError
        instantiate(cfg.strategy)
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    s = instantiate(cfg_for(tmp_path, "strategy=megatrain_nvme", "strategy.host_memory_limit=2GiB").strategy)
    assert s.nvme.path == str(tmp_path) and s.nvme.host_memory_limit == 2 * 2**30


def test_short_real_run_on_the_nvme_tier(tmp_path, monkeypatch):
    store = tmp_path / "nvme"
    store.mkdir()
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(store))
    cfg = cfg_for(tmp_path, "data=legal", "strategy=megatrain_nvme", "strategy.host_memory_limit=2GiB",
                  "trainer.max_steps=2", "trainer.limit_val_batches=2", "data.seq_len=64", "data.batch_size=2",
                  "data.probe.max_items=2", "sample.max_new_tokens=4", "trainer.enable_progress_bar=false",
                  "optim.lr=3e-4", "plot=false")
    out = finetune(cfg)
    assert out["metrics"]["val_loss"]["after"] < out["metrics"]["val_loss"]["before"]
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(out["checkpoint"]) / "model")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_schedule_spans_an_epoch_based_run():
    """trainer.max_steps=-1 with max_epochs (the recipe then passes total_steps=None): the cosine schedule spans
    Lightning's estimated optimizer steps, so the learning rate stays above 0 to the last step (it fell to 0
    after the warm-up when the length -1 was clamped to 1)."""
    import math

    import lightning.pytorch as pl
    import torch

    from megatrain_lightning.recipes_lib.module import CausalLMModule
    from megatrain_lightning.testing import make_data, make_model

    batches = [{"input_ids": ids, "labels": ids} for (ids,) in make_data(n=20, batch_size=2)]  # 10 steps per epoch
    lrs = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    lm = CausalLMModule(make_model("llama"), lr=1e-3, warmup_steps=2, total_steps=None)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_epochs=1, max_steps=-1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Record()])
    trainer.fit(lm, torch.utils.data.DataLoader(batches, batch_size=None))
    want = [1e-3 * ((s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / 8))) for s in range(10)]
    assert lrs == pytest.approx(want) and min(lrs) > 0
    with pytest.raises(ValueError, match="needs a length"):
        lm2 = CausalLMModule(make_model("llama"), total_steps=None)
        pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_epochs=-1, max_steps=-1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False).fit(
            lm2, torch.utils.data.DataLoader(batches, batch_size=None))


def test_summary_rows_keep_metrics_measured_only_after():
    """eval.before=false: the validation rows stay, with an empty "before" cell (not nan, not dropped)."""
    from megatrain_lightning.recipes_lib.results import summary_rows

    rows = summary_rows({}, {"val_loss": 2.5, "val_ppl": 12.18}, {"steps": 2})
    assert rows[:2] == [("val_loss", "", "2.5000"), ("val_ppl", "", "12.1800")]
    assert summary_rows({"val_loss": 3.0}, {"val_loss": 2.5}, {})[0] == ("val_loss", "3.0000", "2.5000")


def test_refuses_bad_data_parallel_settings_before_the_build(tmp_path, no_build, monkeypatch):
    """trainer.devices=abc reached Lightning's TypeError after the model load, trainer.num_nodes was not a key of
    the trainer group (Hydra: "Key 'num_nodes' is not in struct"), and the NVMe tier with 2 processes was the
    strategy's NotImplementedError after the model load: now each is one ConfigError naming the key, before it
    (the masters on NVMe with the optimizer in RAM, or on several nodes; the rest runs with several processes)."""
    refused(tmp_path, "trainer.devices=abc", key="trainer.devices", match="positive int .* got 'abc'")
    refused(tmp_path, "trainer.devices=0", key="trainer.devices")
    refused(tmp_path, "trainer.devices=[0,-1]", key="trainer.devices")
    refused(tmp_path, "trainer.num_nodes=0", key="trainer.num_nodes", match="positive int")
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    refused(tmp_path, "strategy=megatrain_nvme", "strategy.offload_optimizer=cpu", "trainer.devices=2", key="strategy",
            match=r"offload_params=nvme\) with several processes run on one node with strategy.offload_optimizer=nvme "
                  r"for now, and trainer.devices=2 x trainer.num_nodes=1 start 2 with offload_optimizer=cpu: add "
                  "strategy.offload_params=cpu")
    refused(tmp_path, "strategy=megatrain_nvme", "trainer.num_nodes=2", key="strategy", match="start 2")
    cfg = cfg_for(tmp_path, "trainer.devices=auto", "trainer.num_nodes=2")  # what Lightning takes passes the checks
    check_values(OmegaConf.to_container(cfg, resolve=True))
    check_values(OmegaConf.to_container(cfg_for(tmp_path, "trainer.devices=[0,1]"), resolve=True))
    for nvme in (["strategy=megatrain_nvme"], ["strategy=megatrain_nvme", "strategy.offload_params=cpu"]):
        check_values(OmegaConf.to_container(cfg_for(tmp_path, *nvme, "trainer.devices=2"), resolve=True))


# ---------------------------------------------------------------------------------------------- optim config group
def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(cfg)


def _groups(opt):
    return [({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]]) for g in opt.param_groups]


def test_default_optim_is_the_adamw_the_recipe_always_built(tmp_path):
    """optim=adamw (the default): the same class, hyper-parameters and param groups as the recipe's AdamW before the
    optim group existed, and bitwise the same steps."""
    cfg = cfg_for(tmp_path)
    assert OmegaConf.to_container(cfg.optim) == {"_target_": "torch.optim.AdamW", "lr": 1.0e-4, "weight_decay": 0.0,
                                                 "betas": [0.9, 0.95], "warmup_steps": 5}
    model, twin = _tiny_llama(), _tiny_llama()
    out = step.build_module(cfg, model, None).configure_optimizers()
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    before = torch.optim.AdamW([{"params": [p for p in twin.parameters() if p.ndim >= 2], "weight_decay": 0.0},
                                {"params": [p for p in twin.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                               lr=1e-4, betas=(0.9, 0.95))
    torch.optim.lr_scheduler.LambdaLR(before, sched.lr_lambdas[0])  # the recipe's warm-up: lr x 1/5 at step 0
    assert type(opt) is torch.optim.AdamW and opt.defaults == before.defaults
    ids = {id(q): id(p) for p, q in zip(model.parameters(), twin.parameters())}
    assert _groups(opt) == [(h, [ids[i] for i in ps]) for h, ps in _groups(before)]
    for _ in range(2):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step(), before.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_dpo_default_optim_is_its_adamw(tmp_path):
    from megatrain_lightning.recipes_lib.preference import build_module

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="dpo", overrides=[], return_hydra_config=False)
        sgd = compose(config_name="dpo", overrides=["optim=sgd"], return_hydra_config=False)
    assert OmegaConf.to_container(cfg.optim) == {"_target_": "torch.optim.AdamW", "lr": 5.0e-5, "weight_decay": 0.0,
                                                 "betas": [0.9, 0.999]}
    assert sgd.optim._target_ == "torch.optim.SGD" and "betas" not in sgd.optim  # the DPO values are AdamW's only
    with open_dict(cfg):
        cfg.dpo.cache_dir = str(tmp_path)
    model = _tiny_llama()
    opt = build_module(cfg, model, None).configure_optimizers()
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    assert {k: opt.param_groups[0][k] for k in ("lr", "betas", "weight_decay")} == \
        {"lr": 5e-5, "betas": (0.9, 0.999), "weight_decay": 0.0}
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "adafactor", "adam", "lion", "adamw8bit"])
def test_optim_group_builds_that_class_with_its_hyper_parameters(tmp_path, name):
    declared = yaml.safe_load((ROOT / "conf" / "optim" / f"{name}.yaml").read_text())
    from megatrain_lightning.optim.build import locate

    cls = locate(declared["_target_"])  # lion-pytorch and torchao are in the test extra
    cfg = cfg_for(tmp_path, f"optim={name}")
    check_values(OmegaConf.to_container(cfg, resolve=True))
    opt = step.build_module(cfg, _tiny_llama(), None).configure_optimizers()["optimizer"]
    assert type(opt) is cls
    decay, flat = opt.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in flat["params"])
    assert decay["weight_decay"] == declared["weight_decay"] and flat["weight_decay"] == 0.0
    for k, v in declared.items():
        if k not in ("_target_", "weight_decay"):
            key = "initial_lr" if k == "lr" else k  # the warm-up scales lr; the scheduler keeps the configured one
            assert decay[key] == (tuple(v) if isinstance(v, list) else v), k


def test_optim_muon_is_muon_for_the_layers_2d_weights_and_adamw_for_the_rest(tmp_path):
    from megatrain_lightning.optim.muon import MuonWithAdamW

    cfg = cfg_for(tmp_path, "optim=muon")
    model = _tiny_llama()
    opt = step.build_module(cfg, model, None).configure_optimizers()["optimizer"]
    assert type(opt) is MuonWithAdamW
    muon, rest, flat = opt.param_groups
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    assert muon["use_muon"] is True and {id(p) for p in rest["params"]} == embeddings
    assert all(p.ndim == 2 and id(p) not in embeddings for p in muon["params"])
    assert rest["use_muon"] is flat["use_muon"] is False and all(p.ndim == 1 for p in flat["params"])
    assert (muon["initial_lr"], rest["initial_lr"], muon["adjust_lr_fn"]) == (1e-4, 1e-4, "match_rms_adamw")
    assert len(muon["params"]) + len(rest["params"]) + len(flat["params"]) == len(list(model.parameters()))


def test_any_optimizer_target_and_the_refusals(tmp_path, no_build):
    cfg = cfg_for(tmp_path, "optim._target_=torch.optim.RMSprop", "+optim.alpha=0.9")
    from megatrain_lightning.recipes_lib.checks import check_keys

    check_keys(OmegaConf.to_container(cfg, resolve=True))
    check_values(OmegaConf.to_container(cfg, resolve=True))
    opt = step.build_module(cfg, _tiny_llama(), None).configure_optimizers()["optimizer"]
    assert type(opt) is torch.optim.RMSprop and opt.defaults["alpha"] == 0.9
    msg = refused(tmp_path, "optim=sgd", "+optim.momentun=0.5", key="optim.momentun")
    assert "did you mean optim.momentum" in msg
    assert "optim=muon" in refused(tmp_path, "optim._target_=torch.optim.Muon", key="optim._target_")
    assert "cannot be imported" in refused(tmp_path, "optim._target_=torch.optim.NoSuch", key="optim._target_")


@pytest.mark.parametrize("name", ["sgd", "muon"])
def test_a_two_step_run_with_another_optimizer(tmp_path, gpt2_dir, name):
    """The class's own step on the host through the strategy (HostTorchOptimizer), from the recipe."""
    cfg = cfg_for(tmp_path, f"optim={name}", "eval.before=false", *tiny(gpt2_dir))
    out = finetune(cfg)
    assert out["run"]["steps"] == 2 and all(math.isfinite(p["loss"]) for p in out["loss"])
