"""What the recipe and the strategy show on the console: the recipe's command line run for a few steps prints each
log record once, a progress bar with no negative total, no third-party deprecation warning, a line per optimizer
step and the setup line naming the strategy, tier and options; a misspelt key without ``+`` is the project's one
``error:`` line; the summary names host copies as such on a CPU; the setup line on both tiers."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.recipes_lib import console
from megatrain_lightning.recipes_lib.console import StepLog
from megatrain_lightning.recipes_lib.results import summary_rows
from megatrain_lightning.testing import LM, make_data, make_model

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "finetune.py")
HYDRA_LINE = re.compile(r"^\[[0-9-]+ [0-9:,]+\]\[([\w.]+)\]\[(\w+)\] - (.*)$")


def _recipe(tmp_path: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, RECIPE, *overrides, f"hydra.run.dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


def _tiny(gpt2_dir: str, tmp_path: Path) -> list[str]:
    """A random 2-layer Llama with the GPT-2 tokenizer, 3 steps, the progress bar on (as a user's run)."""
    return ["model.name=tiny", "model.gguf=null", f"model.tokenizer={gpt2_dir}", "model.max_seq_len=256",
            "model.config.vocab_size=50257", "model.config.hidden_size=32", "model.config.intermediate_size=64",
            "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=1", "model.config.max_position_embeddings=256",
            "model.config.bos_token_id=50256", "model.config.eos_token_id=50256", "model.config.pad_token_id=50256",
            "trainer.max_steps=3", "trainer.limit_val_batches=1", "data.seq_len=32", "data.batch_size=2",
            "data.probe.max_items=2", "sample.max_new_tokens=2", "plot=false", f"data.cache_dir={tmp_path / 'cache'}"]


def test_recipe_console_one_line_per_message_bar_warnings_and_setup_line(tmp_path, gpt2_dir):
    r = _recipe(tmp_path, *_tiny(gpt2_dir, tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (r.stdout + "\n" + r.stderr).splitlines()
    records = [m.groups() for m in map(HYDRA_LINE.match, lines) if m]
    assert records, lines[:20]
    # each record once: no second handler printing it in another format ("INFO: ..." of lightning's own handler)
    hydra_lines = [ln for ln in lines if HYDRA_LINE.match(ln)]
    assert len(set(hydra_lines)) == len(hydra_lines)
    for _, level, message in records:
        copies = [ln for ln in lines if ln.rstrip().endswith(message.rstrip()) and not HYDRA_LINE.match(ln)]
        assert not copies, copies
    assert not any(ln.startswith(("INFO: ", "WARNING: ")) for ln in lines)
    # the progress bar: no negative epoch total (max_steps drives the run), the training total is the 3 steps
    assert not re.search(r"Epoch \d+/-\d", r.stdout), r.stdout
    assert re.search(r"Epoch 0 .* 3/3 ", r.stdout), r.stdout
    assert "v_num" not in r.stdout
    # no third-party deprecation warning or advertisement reaches the console
    for text in ("deprecated", "FutureWarning", "DeprecationWarning", "litlogger"):
        assert text not in r.stdout + r.stderr, text
    # stdout is not a terminal, so no bar is live: a line per optimizer step and per validation batch
    steps = [msg for name, _, msg in records if name.endswith("console") and msg.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1/3", "step 2/3", "step 3/3"], steps
    assert all(re.fullmatch(r"step \d/3: loss \d+\.\d{4}, \d+\.\d s/step", s) for s in steps), steps
    assert any(msg.startswith("validation batch 1/1") for _, _, msg in records)
    # the setup line: strategy, tier and options, once
    setup = [msg for name, _, msg in records if name == "megatrain_lightning.strategy_base" and "tier" in msg]
    assert len(setup) == 1, setup
    assert setup[0].startswith("megatrain: strategy=MegaTrainStrategy, tier RAM: fp32 masters in host RAM, "
                               "optimizer state in host RAM"), setup
    for option in ("precision=32-true", "lookahead=1", "block_group=1", "recompute=block", "cpu_zero_copy=True"):
        assert option in setup[0], option
    # the summary: wall time per phase, host copies named as such on a CPU
    phases = next(ln for ln in lines if ln.startswith("wall time per phase: "))
    for phase in ("preflight", "build_model", "build_data", "evaluate_before", "fit", "save", "evaluate_after"):
        assert f"{phase} " in phases, phase
    assert "weight copies per step (host, no GPU)" in r.stdout and "H2D per step" not in r.stdout


def test_misspelt_key_without_plus_is_the_projects_one_line_error(tmp_path):
    r = _recipe(tmp_path, "trainer.max_stpes=3", timeout=180)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: trainer.max_stpes: unknown option"), r.stderr
    assert "did you mean trainer.max_steps?" in err[0] and "+trainer" not in err[0]
    assert not (tmp_path / "out").exists()


def test_an_absent_key_some_group_takes_keeps_hydras_advice(tmp_path):
    """``trainer.max_epochs`` is a Trainer argument not in conf/trainer/default.yaml: Hydra's "+" is right."""
    r = _recipe(tmp_path, "trainer.max_epochs=3", timeout=180)
    assert r.returncode == 1 and "+trainer.max_epochs=3" in r.stderr, r.stderr


def test_summary_names_the_bytes_by_device():
    cpu = dict((k, v) for k, _, v in summary_rows({}, {}, {"device": "cpu", "h2d_bytes": 0, "d2h_bytes": 2**20}))
    assert cpu["gradient copies per step (host, no GPU)"] == "1.0 MiB" and "D2H per step" not in cpu
    gpu = dict((k, v) for k, _, v in summary_rows({}, {}, {"device": "cuda", "h2d_bytes": 2**21, "d2h_bytes": 0}))
    assert gpu["H2D per step"] == "2.0 MiB"


def test_summary_keeps_three_digits_of_a_slow_runs_tokens_per_second():
    for tps, shown in ((0.5149, "0.515"), (12.345, "12.3"), (1234.5, "1,234")):
        rows = dict((k, v) for k, _, v in summary_rows({}, {}, {"tokens_per_s": tps}))
        assert rows["train tokens/s"] == shown, tps


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_setup_logs_the_strategy_tier_and_options_once(tmp_path, caplog, tier):
    kw = dict(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
              host_memory_limit=2**30) if tier == "nvme" else {}
    strategy = MegaTrainStrategy(lookahead=2, **kw)
    tr = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        tr.fit(LM(make_model("llama")), make_data(n=4))
        tr.validate(tr.lightning_module, make_data(n=2), verbose=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatrain_lightning.strategy_base" and " tier " in r.getMessage()]
    assert len(lines) == 1, lines  # validate on the same module reuses the engine: no second line
    where = "NVMe" if tier == "nvme" else "host RAM"
    assert lines[0].startswith(f"megatrain: strategy=MegaTrainStrategy, tier {'NVMe' if tier == 'nvme' else 'RAM'}: "
                               f"fp32 masters in {where}, optimizer state in {where}"), lines[0]
    assert "lookahead=2" in lines[0] and "device cpu" in lines[0]
    if tier == "nvme":
        assert f"host_memory_limit 1.00 GiB, {tmp_path}" in lines[0]


class _SlowSave(pl.Callback):
    """Moves the console's clock 100 s on at the end of each batch, after :class:`StepLog` has run, as a checkpoint
    save or validation after a step does (and, with gradient accumulation, as slow work between micro-batches)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock[0] += 100.0


def test_step_log_time_leaves_out_work_between_steps(tmp_path, caplog, monkeypatch):
    """The per-step time spans the step's micro-batches only: time spent after the batch that completes a step is not
    added to the next step's time. The console's clock moves only in ``_SlowSave``, so the times are exact: 100 s per
    step (the work between its two micro-batches), where counting from the previous step's end gives 200 s."""
    clock = [0.0]
    monkeypatch.setattr(console, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    trainer = pl.Trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[StepLog(), _SlowSave(clock)],
                         enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=console.__name__):
        trainer.fit(LM(make_model("llama")), make_data(n=16))
    times = [float(m.group(1)) for r in caplog.records if (m := re.search(r"([\d.]+) s/step$", r.getMessage()))]
    assert times == [100.0, 100.0, 100.0], caplog.text
