"""The planner's ``optim`` setting: each optimizer's state bytes in host RAM, computed here independently from the
model's real parameter shapes (meta device) and each class's source; the NVMe tier keeps the store's two fp32 regions
whatever the optimizer and moves those its state packs into; the CLI and the recipes' config group use the same
names; ``MuonWithAdamW`` and ``build_optimizer`` (the recipes' optimizer). Meta device and tiny CPU tensors only."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from megatrain_lightning.plan import GIB, load_hardware, load_model, plan
from megatrain_lightning.planning.optimizers import OPTIMIZERS, measured_rule, resolve, state_bytes
from megatrain_lightning.planning.terms import NVME_CACHE

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["adamw", "adam", "sgd", "adafactor", "lion", "muon", "adamw8bit"]


@pytest.fixture(scope="module")
def llama100b():
    return load_model("llama100b")


@pytest.fixture(scope="module")
def shapes(llama100b):
    """``(kind, shape)`` of every parameter of the real model on the meta device, grouped here as the engine streams
    it: decoder layers' parameters are ``layer``, the input embedding ``embedding``, the final norm and the LM head
    ``head``."""
    cfg = transformers.AutoConfig.for_model(**llama100b["config"])
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    out = []
    for name, p in m.named_parameters():
        kind = "layer" if ".layers." in name else "embedding" if "embed_tokens" in name else "head"
        out.append((kind, tuple(p.shape)))
    return out


def expected_state(name: str, shapes) -> int:
    """Each optimizer's state bytes, written out from its class's source (not the planner's table)."""
    total = 0
    for kind, shape in shapes:
        n = math.prod(shape)
        if name in ("adamw", "adam"):
            total += 8 * n                                    # exp_avg + exp_avg_sq in the store's regions
        elif name == "sgd":
            total += 4 * n                                    # momentum_buffer (conf/optim/sgd.yaml: momentum 0.9)
        elif name == "adafactor":
            total += 4 + (4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * n)  # step + row/col or variance
        elif name == "lion":
            total += 4 * n                                    # exp_avg
        elif name == "muon":
            total += 4 * n if (len(shape) == 2 and kind == "layer") else 8 * n + 4  # momentum; AdamW + step
        elif name == "adamw8bit":
            total += 4 + (2 * (n + n // 256 * 4 + 1024) if n >= 4096 and n % 256 == 0 else 8 * n)
    return total


@pytest.mark.parametrize("name", NAMES)
def test_llama100b_host_ram_is_params_times_8_plus_the_optimizer_state(llama100b, shapes, name):
    """Host RAM on the RAM tier = N x (4 master + 4 gradient) + the optimizer's state, everything else unchanged."""
    hw = load_hardware("h200")
    n = sum(math.prod(s) for _, s in shapes)
    base = plan(llama100b, hw)
    p = plan(llama100b, hw, optim=name)
    state = expected_state(name, shapes)
    assert p.host["fp32 master weights"] + p.host["fp32 grad accumulators"] == 8 * n
    assert p.host[OPTIMIZERS[name].label] == state
    others = {k: v for k, v in p.host.items() if k != OPTIMIZERS[name].label}
    assert others == {k: v for k, v in base.host.items() if k != "AdamW exp_avg + exp_avg_sq"}
    assert p.host_bytes == base.host_bytes - 8 * n + state
    assert p.checkpoint_bytes == base.checkpoint_bytes - 8 * n + state  # fp32 weights + the class's state


def test_the_state_per_parameter_of_each_optimizer_on_llama100b(shapes):
    n = sum(math.prod(s) for _, s in shapes)
    per = {name: state_bytes(name, shapes) / n for name in NAMES}
    assert per["adamw"] == per["adam"] == 8.0 and per["sgd"] == per["lion"] == 4.0
    assert per["adafactor"] < 0.001                         # factored: rows + cols per matrix
    assert 4.0 < per["muon"] < 4.2                          # embeddings + head (2.6 B of 100 B params) on AdamW
    assert 2.03 < per["adamw8bit"] < 2.04                   # 8-bit codes + a fp32 scale per 256
    assert state_bytes({"_target_": "torch.optim.SGD", "momentum": 0.0}, shapes) == 0


def test_adafactor_fits_llama100b_in_1_5_tib_of_ram_where_adamw_does_not(llama100b):
    hw = load_hardware("h200")
    small = {**hw.to_dict(), "host_ram_gib": 1536}
    adamw, adafactor = plan(llama100b, small, optim="adamw"), plan(llama100b, small, optim="adafactor")
    assert adamw.host_bytes > 1536 * GIB > adafactor.host_bytes
    assert not adamw.fits and any(r.startswith("host RAM short") for r in adamw.reasons)
    assert adafactor.fits
    assert adamw.host_bytes - adafactor.host_bytes > 740 * GIB   # 8 B/param of AdamW moments, ~0 of Adafactor


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor", "adamw8bit"])
def test_the_nvme_tier_keeps_two_regions_and_moves_those_the_state_packs_into(llama100b, name):
    """On disk the store's two fp32 regions whatever the optimizer; per step the update reads and writes, per block,
    the regions its parameters' state packs into: both for AdamW, the first for SGD-momentum, Adafactor and 8-bit
    AdamW (at this size even the norms have 8-bit moments; a block with a tensor under 4,096 elements holds both)."""
    hw = load_hardware("h200")
    tier = dict(offload_optimizer="nvme", offload_grads="nvme")
    p, ref = plan(llama100b, hw, optim=name, **tier), plan(llama100b, hw, **tier)
    n = p.counts.total
    assert p.nvme_bytes == ref.nvme_bytes == 12 * n                 # 8 B/param state + 4 B/param accumulators
    # the same windows; the window caches what a step rewrites, fewer regions here
    assert p.host_bytes - p.host[NVME_CACHE] == ref.host_bytes - ref.host[NVME_CACHE] and p.disk_bytes == ref.disk_bytes
    assert p.host[NVME_CACHE] <= ref.host[NVME_CACHE]
    fewer = {"adamw": 0, "sgd": 4 * n, "adafactor": 4 * n, "adamw8bit": 4 * n}[name]
    assert p.moved["nvme_read_uncached"] == ref.moved["nvme_read_uncached"] - fewer  # before the window's cache
    assert p.moved["nvme_write"] == ref.moved["nvme_write"] - fewer
    assert not any(k.startswith(OPTIMIZERS[name].label) for k in p.host) or name == "adamw"


def test_a_block_holds_a_region_when_any_of_its_parameters_state_uses_it():
    from megatrain_lightning.planning.optimizers import nvme_region_bytes

    shapes = [("layer", (64, 128)), ("layer", (64,)), ("embedding", (96, 64))]
    # 8-bit AdamW: the 64-element norm keeps fp32 moments (both regions), so the layer moves both; the embedding's
    # 6,144 elements are 8-bit (the first region only)
    assert nvme_region_bytes("adamw8bit", shapes) == 8 * (64 * 128 + 64) + 4 * 96 * 64
    assert nvme_region_bytes("adamw", shapes) == 8 * (64 * 128 + 64 + 96 * 64)
    assert nvme_region_bytes({"_target_": "torch.optim.SGD", "momentum": 0.0}, shapes) == 0
    assert nvme_region_bytes("lion", shapes) == 4 * (64 * 128 + 64 + 96 * 64)


def test_a_name_reads_the_recipes_config_file_and_a_mapping_its_hyper_parameters():
    for name in NAMES:
        target = yaml.safe_load((ROOT / "conf" / "optim" / f"{name}.yaml").read_text())["_target_"]
        assert resolve({"_target_": target})[0].name == name == OPTIMIZERS[name].name
    assert resolve("sgd")[1]["momentum"] == 0.9
    with pytest.raises(ValueError, match="optim must be one of adamw, adam, sgd"):
        resolve("adamm")
    with pytest.raises(ValueError, match="_target_"):
        resolve({"lr": 1e-3})


def test_another_class_is_measured_on_cpu_tensors():
    rule = measured_rule("torch.optim.RMSprop")
    assert rule((1000, 30), "layer", {}) == 4 * 30_000 + 4       # square_avg (4 B/param) + a 0-d fp32 step
    assert rule((7,), "head", {}) == 4 * 7 + 4
    with pytest.raises(ValueError, match="cannot be imported"):
        measured_rule("torch.optim.NoSuchThing")


def test_adamw8bit_rule_matches_torchao_on_cpu():
    import torchao.optim as ao

    from megatrain_lightning.planning.optimizers import _tensor_bytes

    for shape in [(64, 128), (4096,), (100,), (33, 7)]:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.ones(shape)
        opt = ao.AdamW8bit([p], lr=1e-3)
        opt.step()
        measured = sum(_tensor_bytes(v) for v in opt.state[p].values())
        assert measured == state_bytes("adamw8bit", [("layer", shape)]), shape


@pytest.mark.parametrize("name", ["sgd", "adafactor", "lion", "muon", "adamw8bit"])
def test_each_rule_matches_the_class_stepped_on_cpu(name):
    """The table against the classes themselves: a tiny Llama's parameters on CPU, one step, the state's bytes."""
    from megatrain_lightning.optim.build import build_optimizer, locate
    from megatrain_lightning.planning.counts import count_module
    from megatrain_lightning.planning.optimizers import _conf_options, _tensor_bytes

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg)
    opts = dict(_conf_options(name))
    target = yaml.safe_load((ROOT / "conf" / "optim" / f"{name}.yaml").read_text())["_target_"]
    locate(target)  # lion-pytorch and torchao are in the test extra
    lr = opts.pop("lr")
    opt = build_optimizer(model, target, lr=lr, weight_decay=opts.pop("weight_decay", 0.0),
                          betas=opts.pop("betas", None), options=opts)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    measured = sum(_tensor_bytes(v) for st in opt.state.values() for v in st.values())
    assert measured == state_bytes(name, count_module(model).shapes)


def test_cli_optim_setting_and_its_labels():
    out = subprocess.run([sys.executable, "-m", "megatrain_lightning.plan", "model=llama100b", "hardware=h200",
                          "optim=adafactor", "hardware.host_ram_gib=1536"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Adafactor row/col variance + step" in out.stdout and "host Adafactor " in out.stdout
    assert "(AdamW rate)" not in out.stdout  # a measured cost: its own rate, its name in the step time's bound
    assert re.search(r"host Adafactor\s+100\.27 G params\s+6\.32 G params/s", out.stdout), out.stdout
    assert re.search(r"total\s+945\.\d\s+have 1,536\.0\s+fits", out.stdout), out.stdout
    assert "fp32 weights + Adafactor state, 4.00 B/param" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "megatrain_lightning.plan", "optim=adamm"], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and "adamw" in bad.stderr


def test_host_update_time_scales_the_adamw_rate_by_each_optimizers_measured_cost(llama100b):
    """The host update term is N / the preset's AdamW rate x the optimizer's time per parameter relative to AdamW
    (the bench's measured ratios), Muon's 2-D layer weights at SGD's momentum cost plus the Newton-Schulz FLOPs
    counted by torch's FlopCounterMode on torch's own iteration, at ``hardware.host_bf16_tflops``."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    from torch.utils.flop_counter import FlopCounterMode

    from megatrain_lightning.planning.optimizers import UPDATE_COST, newton_schulz_flops

    hw = load_hardware("h200")
    adamw = plan(llama100b, hw, optim="adamw")
    n = adamw.counts.total
    assert adamw.times["host_adamw"] == pytest.approx(n / (hw.host_adam_gparams_per_s * 1e9))
    for name in ("sgd", "adafactor", "lion"):
        p = plan(llama100b, hw, optim=name)
        assert p.times["host_adamw"] == pytest.approx(UPDATE_COST[name] * adamw.times["host_adamw"]), name
    for m, k in ((96, 160), (160, 96)):
        with FlopCounterMode(display=False) as fc:
            _zeropower_via_newtonschulz(torch.randn(m, k), (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert newton_schulz_flops((m, k), 5) == fc.get_total_flops()
    layer2d = [s for s in adamw.counts.shapes if s[0] == "layer" and len(s[1]) == 2]
    rest = n - sum(math.prod(s) for _, s in layer2d)
    ns = sum(newton_schulz_flops(s, 5) for _, s in layer2d)
    base = (rest + UPDATE_COST["sgd"] * (n - rest)) / (hw.host_adam_gparams_per_s * 1e9)
    muon = plan(llama100b, hw, optim="muon")
    assert hw.host_bf16_tflops is None and muon.times["host_adamw"] == pytest.approx(base)
    muon_fast = plan(llama100b, {**hw.to_dict(), "host_bf16_tflops": 100.0}, optim="muon")
    assert muon_fast.times["host_adamw"] == pytest.approx(base + ns / 100e12)
    # 8-bit AdamW: its 8-bit tensors (from 4,096 elements, multiples of 256) at their cost, fp32 ones at AdamW's
    eight = sum(math.prod(s) for _, s in adamw.counts.shapes if math.prod(s) >= 4096 and math.prod(s) % 256 == 0)
    assert 0 < eight <= n  # at this size every tensor, the norms too
    p8 = plan(llama100b, hw, optim="adamw8bit")
    want = (UPDATE_COST["adamw8bit"] * eight + n - eight) / (hw.host_adam_gparams_per_s * 1e9)
    assert p8.times["host_adamw"] == pytest.approx(want)


def test_recipe_preflight_plans_the_recipes_optimizer():
    from omegaconf import OmegaConf

    from megatrain_lightning.planning.preflight import plan_for_run

    hw = load_hardware("h200")
    for name in ("adamw", "adafactor"):
        optim = OmegaConf.create({**yaml.safe_load((ROOT / "conf" / "optim" / f"{name}.yaml").read_text()),
                                  "warmup_steps": 5})
        p = plan_for_run(load_model("smollm2_135m"), hw, {}, batch_size=1, seq_len=64, precision="bf16-mixed",
                         optim=optim)
        assert p.settings["optim"]["_target_"] == optim._target_ and "warmup_steps" not in p.settings["optim"]
        assert OPTIMIZERS[name].label in p.host


# ---------------------------------------------------------------------------------------------- the recipes' optimizer
def test_muon_with_adamw_is_torchs_muon_and_adamw():
    from megatrain_lightning.optim.muon import MuonWithAdamW

    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))
    w2, b2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
    opt = MuonWithAdamW([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}], lr=0.02,
                        adamw_lr=1e-3, adamw_betas=(0.9, 0.95))
    muon = torch.optim.Muon([w2], lr=0.02)
    adamw = torch.optim.AdamW([b2], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(3):
        g, gb = torch.randn(8, 4), torch.randn(4)
        w.grad, w2.grad, b.grad, b2.grad = g, g.clone(), gb, gb.clone()
        opt.step(), muon.step(), adamw.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
    assert set(opt.state[w]) == {"momentum_buffer"} and set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.param_groups[1]["lr"] == 1e-3  # a use_muon=False group's lr: adamw_lr (what a scheduler scales)
    with pytest.raises(ValueError, match="2-D weights only"):
        MuonWithAdamW([{"params": [b], "use_muon": True}])


def test_build_optimizer_refuses_torchs_muon_alone():
    from megatrain_lightning.optim.build import build_optimizer

    with pytest.raises(ValueError, match="MuonWithAdamW"):
        build_optimizer(torch.nn.Linear(2, 2), "torch.optim.Muon", lr=1e-3)

