"""What the planner tells a user to change when a plan does not fit: every suggestion is a complete set of
overrides with its numbers (re-planned), the obvious fix for activations that are short is named with and without
``preflight=true``, and the batch size is named when the sequence alone is not the problem."""

from __future__ import annotations

import re

import pytest

from megatrain_lightning.plan import GIB, PreflightError, load_hardware, load_model, main, plan, preflight, replan
from megatrain_lightning.planning import format_plan
from megatrain_lightning.planning.advice import RUN_ABOVE_PLAN
from megatrain_lightning.planning.estimate import max_batch_size, max_seq_len
from megatrain_lightning.planning.preflight import plan_for_run

_SETTINGS = {"seq_len", "batch_size", "recompute", "loss_chunk_size", "mlp_chunk_size", "offload_activations",
             "recompute_every", "offload_params", "offload_optimizer", "offload_grads", "host_memory_limit",
             "lookahead", "block_group", "precision"}


def _overrides(line: str) -> dict[str, str]:
    """The ``key=value`` overrides of a ``set ...:`` suggestion (the text between ``set`` and the first colon)."""
    m = re.search(r"\bset ((?:[\w.]+=\S+ ?)+):", line)
    assert m, line
    return dict(kv.split("=", 1) for kv in m.group(1).split())


def _cli(capsys, *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_cli_without_preflight_names_the_recompute_mode_that_fits(capsys):
    """smollm2 at 4 x 8192 with recompute=none on the CPU preset: only the kept activations are short. The plain
    command line (no preflight) names recompute=selective and recompute=block, each re-planned, not only the
    NVMe tier and a larger machine; every suggestion is overrides the planner accepts, with plain numbers."""
    out = _cli(capsys, "model=smollm2_135m", "hardware=this_machine", "batch_size=4", "seq_len=8192", "recompute=none")
    change = [l.strip() for l in out.splitlines() if l.strip().startswith("change:")]
    base = plan(load_model("smollm2_135m"), load_hardware("this_machine"), batch_size=4, seq_len=8192,
                recompute="none")
    block = replan(base, recompute="block")
    assert not base.fits and block.fits
    line = next(l for l in change if "recompute=block" in l)
    assert _overrides(line) == {"recompute": "block"}
    assert f"batch_size=4 seq_len=8192 then fits (host then needs {block.host_bytes / GIB:.2f} GiB" in line
    for l in change:
        if " set " in f" {l}":
            ov = _overrides(l)
            assert set(ov) <= _SETTINGS and all("," not in v and "<" not in v for v in ov.values()), l
            q = replan(base, **{k: (int(v) if v.isdigit() else v) for k, v in ov.items()
                                if k not in ("host_memory_limit",)})
            assert q.host_bytes <= q.capacity["host"] or "host_memory_limit" in ov, l


def test_preflight_names_the_batch_size_not_the_users_own_seq_len():
    """At batch 4 a sequence the user already has fits only at batch 1: the advice names the longest seq_len at
    batch 4 and the largest data.batch_size at this seq_len; it never suggests data.seq_len=8192 again."""
    p = plan_for_run(load_model("smollm2_135m"), load_hardware("this_machine"), {"recompute": "none"}, batch_size=4,
                     seq_len=8192, precision="bf16-mixed")
    host = 20 * GIB
    assert max_seq_len(p, host, None) >= 8192 > max_seq_len(p, host, None, batch_size=4)
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=host, disk_free_bytes=1000 * GIB)
    msg = str(ei.value)
    room = int(host / (1 + RUN_ABOVE_PLAN))  # the suggestions leave room for a run above its plan
    b, n = max_batch_size(p, room, None), max_seq_len(p, room, None, batch_size=4)
    assert 1 <= b < 4
    assert f"set data.batch_size={b}: the largest data.batch_size that fits at data.seq_len=8192" in msg
    assert f"set data.seq_len={n}: the longest data.seq_len that fits at data.batch_size=4" in msg
    assert "data.seq_len=8192:" not in msg and "data.seq_len=8,192" not in msg
    assert "set strategy.recompute=selective: data.batch_size=4 data.seq_len=8192 then fits" in msg


def test_max_batch_size_is_the_largest_that_fits():
    p = plan(load_model("smollm2_135m"), load_hardware("this_machine"), batch_size=4, seq_len=8192, recompute="none")
    host = 20 * GIB
    b = max_batch_size(p, host, None)
    assert replan(p, batch_size=b).host_bytes <= host < replan(p, batch_size=b + 1).host_bytes


def test_host_memory_limit_refusal_gives_the_value_to_set(tmp_path):
    """A host_memory_limit below the engine's minimum window: the advice is the limit to set, in whole GiB, not a
    placeholder; with that limit the plan fits."""
    from megatrain_lightning.testing import make_model

    model = make_model("llama")
    nv = dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme", precision="32-true")
    p = plan(model, load_hardware("this_machine"), host_memory_limit=100_000, **nv)
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=16 * GIB, disk_free_bytes=1000 * GIB, path=tmp_path)
    msg = str(ei.value)
    assert "<" not in msg.split("host_memory_limit", 2)[-1].split("\n")[0]
    m = re.search(r"change: set strategy.host_memory_limit=(\d+)GiB", msg)
    assert m, msg
    assert plan(model, load_hardware("this_machine"), host_memory_limit=f"{m.group(1)}GiB", **nv).fits


def test_cpu_plan_separates_activations_from_the_engine_buffers():
    """On a CPU device the host tier lists the engine's weight and gradient buffers and the activations apart, and
    the report says what megatrain/peak_device_bytes counts there (the buffers, not the activations)."""
    p = plan(load_model("smollm2_135m"), load_hardware("this_machine"), seq_len=4096)
    acts = sum(v for k, v in p.device.items() if "activations" in k or "inputs" in k or k.startswith("kept"))
    assert p.host["activations (CPU device)"] == acts
    assert p.host["device buffers (CPU device): weights, gradients"] == p.device_bytes - acts
    assert "megatrain/peak_device_bytes on a CPU device" in format_plan(p)


def test_unchunked_head_keeps_its_logits_until_backward():
    """Without a chunked loss the engine keeps the head's output, the logits, until the head's backward: the head
    phase is 12 B + the logits' own bytes per vocabulary entry and token (16 in fp32, measured on a CPU); a chunked
    loss holds the same for one chunk only (its backward recomputes the chunk's logits)."""
    from megatrain_lightning.testing import make_model

    m = make_model("llama", attn="sdpa", vocab_size=4096, hidden_size=64, intermediate_size=128)
    key = "computing block activations (LM head: logits + grad)"
    full = plan(m, load_hardware("this_machine"), precision="32-true", seq_len=2048, loss_chunk_size=None)
    assert full.device[key] >= 2048 * 4096 * 16
    chunked = plan(m, load_hardware("this_machine"), precision="32-true", seq_len=2048, loss_chunk_size=512)
    head = chunked.device.get(key, 0)
    assert 512 * 4096 * 16 <= head < 520 * 4096 * 17


def test_mlp_chunks_cost_one_more_mlp_forward():
    """mlp_chunk_size shorter than the sequence: each chunk's checkpoint runs the MLP forward once more in the
    block's backward (engine/chunked_mlp.py), 2 x 3 x H x I FLOP per token and layer, in the step time too."""
    hw = load_hardware("this_machine")
    m = load_model("smollm2_135m")
    off = plan(m, hw, seq_len=8192, mlp_chunk_size=None)
    on = plan(m, hw, seq_len=8192, mlp_chunk_size=1024)
    c = off.counts
    extra = 2 * 3 * c.hidden_size * c.intermediate_size * c.num_layers * 8192
    assert on.flops - off.flops == pytest.approx(extra, rel=1e-9)
    assert on.step_time_s > off.step_time_s
    assert plan(m, hw, seq_len=1024, mlp_chunk_size=1024).flops == plan(m, hw, seq_len=1024, mlp_chunk_size=None).flops


def test_mlp_chunks_claim_no_saving_on_a_cpu_device():
    """On a CPU device chunked MLPs were measured to add host RSS: the plan counts the MLP uncapped there and does
    not suggest mlp_chunk_size; on a GPU preset the cap stays."""
    m = load_model("smollm2_135m")
    cpu = load_hardware("this_machine")
    off = plan(m, cpu, seq_len=8192, mlp_chunk_size=None, loss_chunk_size=1024)
    on = plan(m, cpu, seq_len=8192, mlp_chunk_size=1024, loss_chunk_size=1024)
    assert on.host_bytes == off.host_bytes
    big = replan(off, seq_len=200_000)
    with pytest.raises(PreflightError) as ei:
        preflight(big, host_ram_bytes=20 * GIB, disk_free_bytes=1000 * GIB)
    assert "mlp_chunk_size" not in str(ei.value)
    gpu = load_hardware("h200")
    assert plan(m, gpu, seq_len=65536, mlp_chunk_size=1024).device_bytes < \
        plan(m, gpu, seq_len=65536, mlp_chunk_size=None).device_bytes


def test_the_bigger_machine_and_disk_lines_are_overrides_that_fit(capsys):
    """Llama-70B fp32 on the rtx4090 preset: host RAM and, on the NVMe tier, the disk are short. The "bigger
    machine" line gives ``hardware.host_ram_gib=`` and the NVMe line ``hardware.nvme_drives=``; each, re-planned
    with the overrides the line gives, fits that resource."""
    out = _cli(capsys, "model=llama70b", "hardware=rtx4090", "precision=32-true")
    change = [l.strip() for l in out.splitlines() if l.strip().startswith("change:")]
    machine = next(l for l in change if "a machine with >=" in l)
    ram = float(re.search(r"hardware\.host_ram_gib=([\d.]+)", machine).group(1))
    hw = load_hardware("rtx4090")
    model = load_model("llama70b")
    bigger = plan(model, type(hw).from_mapping({**hw.to_dict(), "host_ram_gib": ram}), precision="32-true")
    assert bigger.host_bytes <= bigger.capacity["host"]
    nvme = next(l for l in change if "use the NVMe tier" in l)
    assert "SHORT" in nvme
    drives = int(re.search(r"hardware\.nvme_drives=(\d+)", nvme).group(1))
    tiers = dict(kv.split("=", 1) for kv in re.search(r"use the NVMe tier: ((?:\w+=\S+ ?)+):", nvme).group(1).split())
    more = plan(model, type(hw).from_mapping({**hw.to_dict(), "nvme_drives": drives}), precision="32-true", **tiers)
    assert more.disk_bytes <= more.capacity["disk"]
    fewer = plan(model, type(hw).from_mapping({**hw.to_dict(), "nvme_drives": drives - 1}), precision="32-true",
                 **tiers)
    assert fewer.disk_bytes > fewer.capacity["disk"]  # the smallest number of drives that fits
