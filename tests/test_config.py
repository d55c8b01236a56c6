"""``MegaTrainConfig`` holds every strategy option's one default: the Hydra recipes (``conf/strategy/*.yaml``), the
planner's settings (``conf/plan.yaml``) and the strategy's keywords may not drift from it, and the planner decides
``optimizer_in_backward``'s automatic default by the config's rule."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.config import MegaTrainConfig, optimizer_in_backward_on
from megatrain_lightning.planning.terms import update_in_backward
from megatrain_lightning.store.budget import parse_bytes

ROOT = Path(__file__).resolve().parent.parent
CONF_DIRS = [d for d in (ROOT / "conf", ROOT / "megatrain_lightning" / "conf") if d.is_dir()]
DEFAULTS = MegaTrainConfig.defaults()
SIZES = {"nvme_io_block_size", "host_memory_limit", "activation_memory_limit"}
#: values a recipe sets on purpose (the NVMe tier's recipe puts everything on NVMe, its path from the environment)
RECIPE_CHOICES = {"megatrain_nvme.yaml": {"offload_params": "nvme", "offload_optimizer": "nvme",
                                         "nvme_path": "${oc.env:MEGATRAIN_NVME_PATH,null}"}}
#: conf/plan.yaml keys that are strategy options ("default" there means the strategy's default)
PLANNER_OPTIONS = ("offload_params", "offload_optimizer", "offload_activations", "loss_chunk_size", "mlp_chunk_size",
                   "lookahead", "block_group", "recompute_every", "recompute", "activation_memory_limit",
                   "optimizer_in_backward", "cpu_zero_copy")


def _same(name: str, value, default) -> bool:
    if name in SIZES and value is not None and default is not None:
        return parse_bytes(value) == parse_bytes(default)
    return value == default and type(value) is type(default)


@pytest.mark.parametrize("path", [p for d in CONF_DIRS for p in sorted((d / "strategy").glob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_strategy_keys_and_defaults_match_the_config(path):
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert raw.pop("_target_") == "megatrain_lightning.MegaTrainStrategy"
    unknown = sorted(set(raw) - set(DEFAULTS))
    assert not unknown, f"{path.name}: keys that are not MegaTrainConfig fields: {unknown}"
    chosen = RECIPE_CHOICES.get(path.name, {})
    drift = {k: (v, DEFAULTS[k]) for k, v in raw.items() if k not in chosen and not _same(k, v, DEFAULTS[k])}
    assert not drift, f"{path.name}: value != MegaTrainConfig default (value, default): {drift}"
    assert {k: raw.get(k) for k in chosen} == chosen


@pytest.mark.parametrize("conf", CONF_DIRS, ids=lambda d: str(d.relative_to(ROOT)))
def test_planner_strategy_settings_match_the_config(conf):
    plan = OmegaConf.to_container(OmegaConf.load(conf / "plan.yaml"), resolve=False)
    drift = {k: (plan[k], DEFAULTS[k]) for k in PLANNER_OPTIONS
             if not (plan[k] == "default" or _same(k, plan[k], DEFAULTS[k]))}
    assert not drift, f"plan.yaml: value != MegaTrainConfig default (value, default): {drift}"


def test_the_strategy_takes_every_option_with_the_config_default():
    built = MegaTrainStrategy().config
    assert built == MegaTrainConfig()
    assert MegaTrainStrategy(lookahead=2, recompute="none").config == MegaTrainConfig(lookahead=2, recompute="none")
    cfg = MegaTrainConfig(lookahead=3)
    strategy = MegaTrainStrategy(config=cfg)
    assert strategy.config is cfg and strategy.lookahead == 3
    with pytest.raises(TypeError, match="either config or options"):
        MegaTrainStrategy(config=cfg, lookahead=2)
    every = {f.name for f in dataclasses.fields(MegaTrainConfig) if f.init}
    assert every == set(DEFAULTS)


@pytest.mark.parametrize("option", [None, True, False])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_planner_decides_optimizer_in_backward_by_the_config_rule(option, tier):
    for key in ("offload_params", "offload_optimizer", "offload_grads"):
        settings = {"optimizer_in_backward": option, key: tier}
        assert update_in_backward(settings) == optimizer_in_backward_on(option, tier == "nvme")


@pytest.mark.parametrize("mode", ["selective", "auto"])
def test_selective_recompute_is_refused_at_construction_on_a_torch_without_the_sac_marker(monkeypatch, mode):
    """torch releases whose selective activation checkpointing has no recompute marker (2.11) cannot drop a kept
    op output from its cache: ``"selective"`` and ``"auto"`` (which may choose it) are refused when the strategy
    is built, naming the torch version and the modes that work; ``"block"`` and ``"none"`` still build."""
    import torch.utils.checkpoint

    monkeypatch.delattr(torch.utils.checkpoint, "_RECOMPUTE")
    with pytest.raises(RuntimeError, match=rf"recompute='{mode}' needs torch.utils.checkpoint._RECOMPUTE.*"
                                           r"recompute='block' or 'none'"):
        MegaTrainStrategy(recompute=mode)
    for ok in ("block", "none"):
        assert MegaTrainStrategy(recompute=ok).config.recompute == ok


def test_host_memory_limit_above_physical_ram_warns(tmp_path):
    """A ``host_memory_limit`` above this machine's physical RAM bounds nothing (the machine swaps or kills the run
    first): the options warn when the strategy is built, as the planner does; a limit below the RAM does not."""
    import warnings

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nvme = dict(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.warns(UserWarning, match=rf"host_memory_limit={2 * ram} bytes .* is more than the .* GiB of physical "
                                         "RAM of this machine"):
        MegaTrainStrategy(host_memory_limit=2 * ram, **nvme)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MegaTrainStrategy(host_memory_limit=ram // 4, **nvme)


@pytest.mark.parametrize("options, category", [
    (dict(checkpoint_every=2), DeprecationWarning),
    (dict(recompute="block", activation_memory_limit="1GiB"), UserWarning),
    (dict(nvme_path="/tmp"), UserWarning),
    (dict(offload_params="nvme", nvme_path="/tmp", update_threads=2), UserWarning),
])
def test_option_warnings_point_at_the_users_line(options, category):
    """Each warning about the options names the user's own line, whether the options go to ``MegaTrainConfig``,
    ``MegaTrainStrategy`` or a ``Trainer`` through the registered name (Python prints that line with it)."""
    import lightning.pytorch as pl

    from megatrain_lightning.config import MegaTrainConfig

    for build in (lambda: MegaTrainConfig(**options), lambda: MegaTrainStrategy(**options),
                  lambda: pl.Trainer(strategy=MegaTrainStrategy(**options), accelerator="cpu", logger=False)):
        with pytest.warns(category, match="megatrain: ") as record:
            build()
        ours = [w for w in record if str(w.message).startswith("megatrain: ")]
        assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]
