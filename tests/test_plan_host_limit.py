"""``host_memory_limit`` in the planner and its preflight: parsed as the strategy parses it, checked against the
engine's minimum NVMe window for the planned model (the engine refuses a smaller limit when ``fit`` sets up, after
the model is built; the plan refuses it first, with the engine's message and numbers), and a limit above the RAM
warned about."""

from __future__ import annotations

import dataclasses
import json

import lightning.pytorch as pl
import pytest

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.plan import load_hardware, main, plan, preflight
from megatrain_lightning.planning.terms import NVME_CACHE
from megatrain_lightning.planning.window import physical_ram_bytes
from megatrain_lightning.testing import LM, learnable_data, make_model

NVME = dict(offload_params="nvme", offload_optimizer="nvme")
SMALL = 100_000  # bytes: below the window a block of the tiny Llama needs


def _engine_refusal(tmp_path, limit: int) -> str:
    """The engine's own refusal of ``limit`` for the tiny Llama on this CPU (raised when fit sets up the tier)."""
    model = make_model("llama", attn="sdpa")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(nvme_path=str(tmp_path), host_memory_limit=limit, **NVME),
                         accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="host_memory_limit") as err:
        trainer.fit(LM(model), learnable_data(n=2, seq=16, batch_size=2))
    return str(err.value)


def test_cli_refuses_a_limit_below_the_engines_window_with_the_engines_numbers(tmp_path, capsys):
    """``host_memory_limit`` on the planner's command line (before: "unknown setting"), for a local model directory:
    the plan does not fit and says what the engine says when it refuses that limit, the minimum included."""
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(make_model("llama").config.to_dict()))
    engine = _engine_refusal(tmp_path, SMALL)
    rc = main([f"model={d}", "hardware=this_machine", "precision=32-true", "offload_params=nvme",
               "offload_optimizer=nvme", "offload_grads=nvme", f"host_memory_limit={SMALL}"])
    out = capsys.readouterr().out
    assert rc == 0 and f"fits: NO: {engine}" in out, (engine, out[-2000:])
    assert "the NVMe tier needs" in engine and "Raise host_memory_limit to at least" in engine
    # the same syntax as the strategy option: a size with a unit; a limit at the minimum fits
    minimum = int(engine.split("Raise host_memory_limit to at least ")[1].split()[0])
    p = plan(make_model("llama"), load_hardware("this_machine"), precision="32-true", offload_grads="nvme",
             host_memory_limit="1GiB", **NVME)
    assert p.nvme_window == {"limit": 2**30, "min_window": minimum} and p.fits
    assert plan(make_model("llama"), load_hardware("this_machine"), precision="32-true", offload_grads="nvme",
                host_memory_limit=minimum, **NVME).fits
    assert main(["model=smollm2_135m", "host_memory_limit=lots"]) == 2
    assert "host_memory_limit" in capsys.readouterr().err


def test_a_limit_above_physical_ram_warns():
    """Against this machine's RAM in preflight (``SC_PHYS_PAGES``), against the preset's in the plan."""
    ram = physical_ram_bytes()
    hw = load_hardware("this_machine")
    p = plan(make_model("llama"), hw, offload_grads="nvme", host_memory_limit=2 * ram, **NVME)
    assert any("more than the" in w and "physical RAM of the preset" in w for w in p.warnings), p.warnings
    with pytest.warns(UserWarning, match=r"host_memory_limit=\d+ bytes .* is more than the .* physical RAM of this "
                                         r"machine"):
        preflight(p, disk_free_bytes=2**40)
    ok = plan(make_model("llama"), hw, offload_grads="nvme", host_memory_limit=ram // 4, **NVME)
    assert not any("physical RAM" in w for w in ok.warnings)


def test_nvme_advice_is_a_complete_recipe_override_with_the_limit_and_the_rss(tmp_path):
    """The host-RAM advice of the recipe's preflight: each NVMe suggestion is a whole Hydra override of the recipe
    (it composes, and sets the tiers and the limit it names), with the ``host_memory_limit`` to set (not the minimum
    window, which it once printed as what the host "then needs") and the RSS that gives: the plan's host total at
    that limit, the window caching what a step rewrites up to it."""
    import re

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatrain_lightning.plan import GIB, PreflightError, load_model, replan
    from megatrain_lightning.planning.config import CONF_DIR

    p = plan(load_model("llama70b"), load_hardware("a100"))
    have = 1024 * GIB
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=have, disk_free_bytes=10_000 * GIB, device_bytes=80 * GIB)
    found = re.findall(r"change: (?:use the NVMe tier: |set )((?:strategy[.=]\S+ ?)+).*?the host then uses about "
                       r"([\d,.]+) GiB", str(ei.value))
    assert len(found) == 2, str(ei.value)
    for override, rss in found:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="finetune", overrides=override.split())
        st = OmegaConf.to_container(cfg.strategy, resolve=False)
        limit = int(re.search(r"host_memory_limit=(\d+)GiB", override).group(1)) * GIB
        assert st["offload_optimizer"] == "nvme" and st["host_memory_limit"] == f"{limit // GIB}GiB"
        q = replan(p, offload_params=st["offload_params"], offload_optimizer="nvme", offload_grads="nvme",
                   host_memory_limit=limit)
        assert q.fits and limit >= q.nvme_window["min_window"]
        # the RSS printed is the plan's at that limit: the window caching up to it, within the RAM
        assert float(rss.replace(",", "")) * GIB == pytest.approx(q.host_bytes, abs=0.06 * GIB)
        assert q.host_bytes <= have and q.host[NVME_CACHE] > 0


def test_a_limit_that_keeps_the_nvme_window_full_is_suggested_with_its_step_time():
    """llama70b with every state on NVMe on the A100 preset (1 TiB of RAM): at host_memory_limit=300GiB the step reads
    back what the window cannot keep; the tip names the limit that keeps every region (the minimum window + the bytes
    a step writes, whole GiB), which re-planned reads nothing and is faster. With 600 GiB of RAM the tip is the most
    that RAM allows, still reading some; at the suggested limit there is no tip."""
    from megatrain_lightning.planning import format_plan, load_model, replan
    from megatrain_lightning.planning.advice import nvme_limit, window_advice

    nv = dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    p = plan(load_model("llama70b"), load_hardware("a100"), host_memory_limit="300GiB", **nv)
    assert p.fits and p.moved["nvme_read"] > 0
    tip = window_advice(p)
    every = -(-(p.nvme_window["min_window"] + p.moved["nvme_write"]) // 2**30)  # no reference copy: the writes
    assert tip.startswith(f"tip: host_memory_limit={every}GiB (now 300.0 GiB)") and "no NVMe reads" in tip, tip
    q = replan(p, host_memory_limit=every * 2**30)
    assert q.moved["nvme_read"] == 0 and q.step_time_s < p.step_time_s and f"{q.step_time_s:,.3f} s" in tip
    assert nvme_limit(q, q.capacity["host"])[1] <= q.capacity["host"]  # the host RSS at that limit fits the RAM
    assert tip in format_plan(p) and window_advice(q) is None
    assert window_advice(p, keys={}).startswith(f"tip: strategy.host_memory_limit={every}GiB")  # the recipe's key

    small = plan(load_model("llama70b"), dataclasses.replace(load_hardware("a100"), host_ram_gib=600),
                 host_memory_limit="300GiB", **nv)
    tip = window_advice(small)
    limit = nvme_limit(small, small.capacity["host"])[0]
    assert limit < every * 2**30 and tip.startswith(f"tip: host_memory_limit={limit // 2**30}GiB"), tip
    assert "the most this RAM allows" in tip
    assert 0 < replan(small, host_memory_limit=limit).moved["nvme_read"] < small.moved["nvme_read"]
    # no tip when the step would not be faster (a CPU device's NVMe overlaps its compute), nor when the RAM is
    # already short of more window; a limit above the RAM buys no more cache than the RAM
    cpu = plan(load_model("smollm2_135m"), load_hardware("this_machine"), host_memory_limit="2GiB", **nv)
    assert cpu.moved["nvme_read"] > 0 and window_advice(cpu) is None
    over = plan(load_model("llama70b"), dataclasses.replace(load_hardware("a100"), host_ram_gib=500),
                host_memory_limit="900GiB", **nv)
    at_ram = replan(over, host_memory_limit=500 * 2**30)
    assert over.moved["nvme_read"] == at_ram.moved["nvme_read"] > 0
