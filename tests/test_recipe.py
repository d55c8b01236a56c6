"""The Hydra recipe: configs compose, overrides apply, preflight refuses what cannot fit, and a
short real run (SmolLM2-135M on the legal corpus) goes end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

import megatrain_lightning  # noqa: F401
from megatrain_lightning.planning import PreflightError
from megatrain_lightning.recipes_lib.run import finetune

CONF = str(Path(__file__).resolve().parents[1] / "conf")
MODELS = sorted(p.stem for p in Path(CONF, "model").glob("*.yaml"))
DATA = sorted(p.stem for p in Path(CONF, "data").glob("*.yaml"))


def cfg_for(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=list(overrides), return_hydra_config=False)
    with open_dict(cfg):
        cfg.output_dir = str(tmp_path)
        cfg.data.cache_dir = str(tmp_path / "cache")
    return cfg


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATA)
def test_every_group_composes(tmp_path, model, data):
    cfg = cfg_for(tmp_path, f"model={model}", f"data={data}")
    assert cfg.model.name == model and cfg.data.domain == data
    assert cfg.strategy._target_.endswith("MegaTrainStrategy")


def test_overrides_apply(tmp_path):
    cfg = cfg_for(tmp_path, "trainer.max_steps=7", "optim.lr=3e-5", "data.seq_len=128", "strategy.lookahead=2")
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.data.seq_len, cfg.strategy.lookahead) == (7, 3e-5, 128, 2)


def test_preflight_refuses_llama100b_here_before_allocating(tmp_path):
    cfg = cfg_for(tmp_path, "model=llama100b", "data=legal")
    with pytest.raises(PreflightError, match="host RAM short"):
        finetune(cfg)
    assert not any(tmp_path.iterdir())  # nothing written


def test_short_real_run_end_to_end(tmp_path, capsys):
    cfg = cfg_for(tmp_path, "data=legal", "trainer.max_steps=2", "trainer.limit_val_batches=2", "data.seq_len=64",
                  "data.batch_size=2", "data.probe.max_items=2", "sample.max_new_tokens=4",
                  "trainer.enable_progress_bar=false", "optim.lr=3e-4")
    out = finetune(cfg)
    assert out["run"]["steps"] == 2
    assert out["after"]["val_loss"] < out["before"]["val_loss"]
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(out["checkpoint"]) / "model")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    printed = capsys.readouterr().out
    assert "val_ppl" in printed and "sample" in printed


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


def test_preflight_refuses_llama100b_on_nvme_for_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    cfg = cfg_for(tmp_path, "model=llama100b", "strategy=megatrain_nvme")
    with pytest.raises(PreflightError, match="disk"):
        finetune(cfg)
    assert not any(tmp_path.iterdir())


def test_short_real_run_on_the_nvme_tier(tmp_path, monkeypatch):
    store = tmp_path / "nvme"
    store.mkdir()
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(store))
    cfg = cfg_for(tmp_path, "data=legal", "strategy=megatrain_nvme", "strategy.host_memory_limit=2GiB",
                  "trainer.max_steps=2", "trainer.limit_val_batches=2", "data.seq_len=64", "data.batch_size=2",
                  "data.probe.max_items=2", "sample.max_new_tokens=4", "trainer.enable_progress_bar=false",
                  "optim.lr=3e-4")
    out = finetune(cfg)
    assert out["after"]["val_loss"] < out["before"]["val_loss"]
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(out["checkpoint"]) / "model")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
