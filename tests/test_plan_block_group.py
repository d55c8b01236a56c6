"""Planner and preflight with ``block_group``: the weights in flight on the
device, the NVMe tier's RAM window, the bytes per transfer, the report line, bad values, and the
suggestion for small decoder layers. Meta-device models and arithmetic only (seconds)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from megatrain_lightning.blocks import discover_blocks
from megatrain_lightning.engine.block_groups import form_groups
from megatrain_lightning.plan import compose, load_hardware, load_model, main, plan, plan_from_config, replan
from megatrain_lightning.planning import format_plan
from megatrain_lightning.planning.advice import TRANSFER_TARGET_BYTES, block_group_advice, device_advice
from megatrain_lightning.planning.config import CONF_DIR
from megatrain_lightning.planning.preflight import plan_for_run
from megatrain_lightning.engine.window import window_sizes
from megatrain_lightning.planning.terms import window_bytes
from megatrain_lightning.store.nvme import NVMeConfig
from megatrain_lightning.store.regions import Region
from megatrain_lightning.testing import make_model

MIB = 2**20


def _meta(name: str):
    cfg = transformers.AutoConfig.for_model(**load_model(name)["config"])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _layer_and_largest(model) -> tuple[int, int]:
    """Independently of the planner: parameters of one decoder layer and of the largest streamed block
    (embedding; final norm + LM head, with the tied embedding when tied)."""
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    emb = model.model.embed_tokens.weight.numel()
    head = model.lm_head.weight.numel() + model.model.norm.weight.numel()
    return layer, max(emb, head)


def _layer_wire_bf16(model) -> int:
    """One decoder layer's bytes on the link under bf16-mixed: nn.Linear weights in bf16, the rest
    (norms) in fp32 (engine/wire.py's rule for Llama-style layers)."""
    lin = sum(p.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False))
    rest = sum(p.numel() for p in model.model.layers[0].parameters()) - lin
    return 2 * lin + 4 * rest


def test_device_weights_grow_by_the_group_of_layers_in_flight():
    """llama8b on h200 (bf16-mixed: fp32 compute copies): block_group=3 holds lookahead + 1 = 2 fetches of
    3 decoder layers instead of 2 blocks (the largest, the embedding); nothing else on the device changes."""
    layer, big = _layer_and_largest(_meta("llama8b"))
    assert 3 * layer > big > layer  # llama8b: 218 M per layer, 525 M in the embedding
    mc, hw = load_model("llama8b"), load_hardware("h200")
    for la in (1, 2):
        p1 = plan(mc, hw, lookahead=la, block_group=1)
        p3 = plan(mc, hw, lookahead=la, block_group=3)
        assert p1.device[f"block weights x{la + 1} (compute dtype)"] == (la + 1) * big * 4
        assert p3.device[f"block weights x{la + 1} fetches x3 layers (compute dtype)"] == (la + 1) * 3 * layer * 4
        assert p3.device_bytes - p1.device_bytes == (la + 1) * (3 * layer - big) * 4
        assert {k: v for k, v in p3.device.items() if not k.startswith("block weights")} == \
            {k: v for k, v in p1.device.items() if not k.startswith("block weights")}
    # a group smaller than the largest block adds nothing: each fetch is still at most the embedding
    small = _meta("smollm2_135m")
    s_layer, s_big = _layer_and_largest(small)
    assert 3 * s_layer < s_big
    q1 = plan(load_model("smollm2_135m"), hw, block_group=1)
    assert plan(load_model("smollm2_135m"), hw, block_group=3).device_bytes == q1.device_bytes
    assert plan(load_model("smollm2_135m"), hw, block_group=10).device_bytes - q1.device_bytes == \
        2 * (10 * s_layer - s_big) * 4


def test_nvme_window_rows_are_the_engines_minimum_window():
    """On the NVMe tier the plan's window rows (``terms.window_bytes``: the regions' windows, the H2D staging ring,
    the D2H staging) are the minimum the engine itself requires of ``host_memory_limit`` (``engine/window.py``
    ``window_sizes`` on the real blocks), whatever the lookahead and block_group: the window holds one slab's
    update, not a window of blocks. On a CPU device the compute buffers share the engine's budget as its bound;
    the plan counts them in its own device-buffer row, so there the regions and the ring are compared."""
    model = _meta("llama8b")
    blocks = discover_blocks(model)
    sets = {"gop": dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme"),
            "go": dict(offload_optimizer="nvme", offload_grads="nvme"), "p": dict(offload_params="nvme")}
    for la, g in ((0, 1), (1, 1), (1, 3), (2, 7)):
        engine_ahead = (la + 1) * max(map(len, form_groups(blocks, g))) - 1
        for name, offload in sets.items():
            kinds = {Region.master} if "p" in name else set()
            kinds |= {Region.exp_avg, Region.exp_avg_sq, Region.grad_accum} if "o" in name else set()
            nvme = NVMeConfig(path="", kinds=frozenset(kinds), host_memory_limit=0)
            for hw_name, dev in (("h200", "cuda"), ("this_machine", "cpu")):
                p = plan(model, load_hardware(hw_name), lookahead=la, block_group=g, precision="bf16-mixed",
                         seq_len=512, **offload)
                engine_min, outside, _ = window_sizes(blocks, nvme, dev, engine_ahead)
                planned = window_bytes(p.host)
                if dev == "cpu":
                    if "p" not in name:
                        continue  # no ring: the engine counts a wire image of its compute buffers instead
                    engine_min -= outside
                    planned -= p.host["device buffers (CPU device): weights, gradients"]
                assert planned == pytest.approx(engine_min, rel=1e-3), (la, g, name, hw_name)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "two", None])
def test_bad_block_group_is_refused_naming_the_key(bad):
    mc, hw = load_model("llama8b"), load_hardware("h200")
    with pytest.raises(ValueError, match=r"block_group must be an int >= 1.*got .*strategy\.block_group"):
        plan(mc, hw, block_group=bad)
    with pytest.raises(ValueError, match="block_group"):  # the recipe's preflight reads cfg.strategy
        plan_for_run(mc, hw, {"block_group": bad}, batch_size=1, seq_len=512, precision="bf16-mixed")
    assert plan(mc, hw, block_group="3").settings["block_group"] == 3  # a command line's digits


def test_cli_and_recipe_preflight_read_block_group():
    """conf/plan.yaml's ``block_group`` key and a recipe's ``strategy.block_group`` (conf/strategy/megatrain.yaml,
    default 1 there and in MegaTrainStrategy) reach the plan."""
    cfg = compose(["model=llama8b", "block_group=3"])
    assert plan_from_config(cfg).settings["block_group"] == 3
    assert compose(["model=llama8b"]).block_group == 1
    mc, hw = load_model("llama8b"), load_hardware("h200")
    strategy = OmegaConf.load(CONF_DIR / "strategy" / "megatrain.yaml")
    assert strategy.block_group == 1
    strategy.block_group = 3
    p = plan_for_run(mc, hw, strategy, batch_size=1, seq_len=2048, precision="bf16-mixed")
    assert p.settings["block_group"] == 3
    assert p.device_bytes == plan_for_run(mc, hw, {**OmegaConf.to_container(strategy), "block_group": 3}, batch_size=1,
                                          seq_len=2048, precision="bf16-mixed").device_bytes
    assert plan_for_run(mc, hw, {}, batch_size=1, seq_len=2048, precision="bf16-mixed").settings["block_group"] == 1

def test_cli_refuses_a_bad_block_group(capsys):
    assert main(["model=llama8b", "hardware=h200", "block_group=0"]) == 2
    assert "block_group" in capsys.readouterr().err


def test_report_shows_block_group_and_bytes_per_transfer():
    """The settings line prints block_group next to lookahead; the transfers line one fetch's bytes:
    the layer's wire bytes (bf16 Linear weights, fp32 norms) x block_group."""
    mc, hw = load_model("llama8b"), load_hardware("h200")
    wire = _layer_wire_bf16(_meta("llama8b"))
    p = plan(mc, hw, block_group=3)
    assert p.transfer_bytes == 3 * wire
    assert p.to_dict()["transfer_bytes"] == 3 * wire
    text = format_plan(p)
    assert "lookahead=1 block_group=3 " in text
    assert (f"transfers: block_group=3: {3 * wire / MIB:,.1f} MiB per decoder-layer fetch "
            f"(3 x {wire / MIB:,.1f} MiB in the wire dtype); weights of up to 6 decoder layers in flight") in text
    # 32-true: 4 bytes for every parameter; a group larger than the model is capped at its layers
    layer, _ = _layer_and_largest(_meta("llama8b"))
    assert plan(mc, hw, precision="32-true", block_group=100).transfer_bytes == 32 * layer * 4
    assert "lookahead=1 block_group=1 " in format_plan(plan(mc, hw))


def test_block_group_suggested_for_small_layers_only():
    """smollm2_135m's decoder layer is ~7 MiB on the bf16 link: the advice names the smallest block_group
    whose transfer reaches the planner's 64 MiB; llama8b's 416 MiB layers get no such advice."""
    assert TRANSFER_TARGET_BYTES == 64 * MIB
    hw = load_hardware("h200")
    p = plan(load_model("smollm2_135m"), hw)
    wire = _layer_wire_bf16(_meta("smollm2_135m"))
    want = math.ceil(64 * MIB / wire)
    assert (want - 1) * wire < 64 * MIB <= want * wire and want == 10
    tip = block_group_advice(p)
    q = replan(p, block_group=want)
    assert tip is not None and tip.startswith(f"tip: block_group={want}: {want} decoder layers per transfer, "
                                              f"{want * wire / MIB:,.1f} MiB each")
    assert f"device then needs {q.device_bytes / 2**30:.2f} GiB" in tip
    assert tip in format_plan(p)
    assert f"strategy.block_group={want}" in block_group_advice(p, keys={})  # the recipe's key
    # already grouped enough: nothing to suggest; a large-block model: nothing either
    assert block_group_advice(replan(p, block_group=want)) is None
    big = plan(load_model("llama8b"), hw)
    assert block_group_advice(big) is None and "block_group=" not in format_plan(big).split("fits:")[-1]
    # the device holds too little for 10 layers in flight: the largest group that fits is named
    h200 = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "hardware" / "h200.yaml"))
    need1, need10 = p.device_bytes, q.device_bytes
    cap = (need1 + (need10 - need1) // 2) / 2**30  # between block_group=1 and 10
    small_dev = plan(load_model("smollm2_135m"), {**h200, "hbm_gib": cap})
    tip = block_group_advice(small_dev)
    assert tip is not None and "the largest that fits" in tip
    g = int(tip.split("block_group=")[1].split(":")[0])
    assert 1 < g < want and replan(small_dev, block_group=g).fits and not replan(small_dev, block_group=g + 1).fits
    # no GPU: no suggestion (the threshold is about the H2D link)
    assert block_group_advice(plan(load_model("smollm2_135m"), load_hardware("this_machine"))) is None


def test_device_advice_names_block_group_when_grouped():
    p = plan(load_model("llama8b"), load_hardware("h200"), block_group=4)
    advice = device_advice(p, p.capacity["device"], p.capacity["host"], keys={})
    assert any(a.startswith("change: strategy.block_group=1 (the weights of 2 blocks in flight") for a in advice)
    assert not any("block_group" in a for a in device_advice(replan(p, block_group=1), p.capacity["device"]))
