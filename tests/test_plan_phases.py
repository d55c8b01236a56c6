"""The planner's step time by phase (planning/phases.py): forward + backward, each as long as its longest
chain of work, for the deferred AdamW schedule and for ``optimizer_in_backward``; the seconds exposed beyond
compute; what the report prints."""

import math

import pytest

from megatrain_lightning.planning import format_comparison, format_plan, load_hardware, load_model, plan, replan
from megatrain_lightning.planning.phases import chains
from megatrain_lightning.planning.terms import _estimate, term_label

GB = 1e9


def _hand(p):
    """The terms of a one-process GPU plan split by phase, computed here from the counts and the preset."""
    c, m, hw, s = p.counts, p.moved, p.hardware, p.settings
    tokens = s["batch_size"] * s["seq_len"]
    f_attn = 2 * c.num_layers * s["seq_len"] * c.num_heads * c.head_dim
    fwd_flops = (2 * c.matmul_params + f_attn) * tokens          # Kaplan: forward 2N + attention; backward 2x that
    comp = p.flops / (hw.bf16_tflops * 1e12)
    comp_f = fwd_flops / (hw.bf16_tflops * 1e12)
    table = c.vocab_size * c.hidden_size if c.embedding >= c.vocab_size * c.hidden_size else 0
    rows = 4 * table <= tokens * (4 * c.hidden_size + 8)
    elems = c.reads_per_pass - table + (table if rows else tokens * c.hidden_size)
    return dict(comp_f=comp_f, comp_b=comp - comp_f, h2d_f=m["h2d_forward"] / (hw.h2d_gbps * GB),
                h2d_b=m["h2d_backward"] / (hw.h2d_gbps * GB), d2h=m["d2h"] / (hw.d2h_gbps * GB),
                adamw=c.total / (hw.host_adam_gparams_per_s * GB), adds=12 * elems / (hw.host_mem_gbps * GB))


def test_host_adamw_moves_from_the_forward_to_the_backward_with_the_schedule():
    """SmolLM2-135M on one H200 (bf16-mixed, 1 x 2048 tokens): compute is 2 ms, so every phase is bound by a
    worker. Deferred: the forward's H2D worker runs the copies and the whole host AdamW; optimizer_in_backward: the
    backward's D2H worker runs the gradient copies, the adds and the AdamW."""
    p = plan(load_model("smollm2_135m"), load_hardware("h200"))
    assert p.settings["optimizer_in_backward"] is None               # the RAM tier's default: deferred
    h = _hand(p)
    assert math.isclose(h["adds"], p.times["grad_add"], rel_tol=1e-9)
    fwd, bwd = h["h2d_f"] + h["adamw"], h["d2h"] + h["adds"]
    assert fwd > h["comp_f"] and bwd > max(h["comp_b"], h["h2d_b"])
    assert p.phases["forward"][1] == "h2d+host_adamw" and math.isclose(p.phases["forward"][0], fwd, rel_tol=1e-9)
    assert p.phases["backward"][1] == "d2h+grad_add" and math.isclose(p.phases["backward"][0], bwd, rel_tol=1e-9)
    assert math.isclose(p.step_time_s, fwd + bwd, rel_tol=1e-9)
    assert p.dominating == ("h2d+host_adamw" if fwd > bwd else "d2h+grad_add")
    assert math.isclose(p.exposed["h2d+host_adamw"], fwd - h["comp_f"], rel_tol=1e-9)
    assert math.isclose(p.exposed["d2h+grad_add"], bwd - h["comp_b"], rel_tol=1e-9)

    q = replan(p, optimizer_in_backward=True)
    fwd, bwd = max(h["h2d_f"], h["comp_f"]), h["d2h"] + h["adds"] + h["adamw"]
    assert q.phases["forward"] == (pytest.approx(fwd, rel=1e-9), "h2d")
    assert q.phases["backward"] == (pytest.approx(bwd, rel=1e-9), "d2h+grad_add+host_adamw")
    assert q.dominating == "d2h+grad_add+host_adamw" and math.isclose(q.step_time_s, fwd + bwd, rel_tol=1e-9)
    # each plan carries the other schedule's step time
    assert p.other_schedule["optimizer_in_backward"] is True and math.isclose(p.other_schedule["step_time_s"], q.step_time_s)
    assert q.other_schedule["optimizer_in_backward"] is False and math.isclose(q.other_schedule["step_time_s"], p.step_time_s)


def test_backward_compute_hides_the_d2h_worker_at_a_large_batch():
    """llama8b, bf16-mixed, batch 16 on an H200: the backward is compute-bound (nothing exposed there); the forward
    is bound by the H2D worker (deferred), which optimizer_in_backward frees, so that schedule is faster."""
    p = plan(load_model("llama8b"), load_hardware("h200"), batch_size=16)
    h = _hand(p)
    assert h["comp_b"] > max(h["h2d_b"], h["d2h"] + h["adds"])
    assert p.phases["backward"] == (pytest.approx(h["comp_b"], rel=1e-9), "compute")
    assert p.phases["forward"] == (pytest.approx(h["h2d_f"] + h["adamw"], rel=1e-9), "h2d+host_adamw")
    assert list(p.exposed) == ["h2d+host_adamw"]
    q = replan(p, optimizer_in_backward=True)
    assert q.step_time_s < p.step_time_s and p.other_schedule["step_time_s"] == pytest.approx(q.step_time_s)
    assert q.phases["backward"][0] == pytest.approx(max(h["comp_b"], h["d2h"] + h["adds"] + h["adamw"]), rel=1e-9)


def test_nvme_io_lands_in_the_phase_of_the_update():
    """Every state on NVMe (llama8b, 8 drives): deferred, the forward reads master + moments + accumulator (16 B/param)
    and writes master + moments (12), the backward re-reads the masters for its fetch and writes the accumulators (4);
    in backward the update's reads and writes move to the backward and the accumulator never reaches the disk."""
    nv = dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    p = plan(load_model("llama8b"), load_hardware("h200"), optimizer_in_backward=False, **nv)
    hw, n, m = p.hardware, p.counts.total, p.moved
    rd, wr = hw.nvme_drives * hw.nvme_read_gbps * GB, hw.nvme_drives * hw.nvme_write_gbps * GB
    refetch = m["nvme_read"] - 16 * n                                # the backward fetch's master reads
    assert m["nvme_read_forward"] == 16 * n and m["nvme_write_forward"] == 12 * n and m["nvme_write"] == 16 * n
    e = _estimate(p.counts, hw, p.settings)
    row = dict(chains(e)["forward"])
    assert row["nvme_read+nvme_write"] == pytest.approx(16 * n / rd + 12 * n / wr, rel=1e-9)
    assert dict(chains(e)["backward"])["nvme_read+nvme_write"] == pytest.approx(refetch / rd + 4 * n / wr, rel=1e-9)
    q = replan(p, optimizer_in_backward=None)                        # the NVMe default: in backward
    assert q.moved["nvme_read_forward"] == 4 * n and q.moved["nvme_write_forward"] == 0
    assert q.moved["nvme_read"] == 12 * n + refetch and q.moved["nvme_write"] == 12 * n
    assert q.step_time_s < p.step_time_s                            # the docs' reason for the NVMe default


@pytest.mark.parametrize("model,hw,kw", [
    ("llama70b", "h200", {}), ("llama70b", "h200", {"precision": "32-true"}), ("llama100b", "h100", {}),
    ("llama8b", "h200", {"batch_size": 8, "optimizer_in_backward": True}), ("mixtral_8x7b", "a100", {}),
    ("llama8b", "h100", {"offload_optimizer": "nvme", "offload_grads": "nvme"}),
    ("llama8b", "h200", {"offload_params": "nvme", "offload_optimizer": "nvme", "offload_grads": "nvme"}),
    ("llama70b", "h200", {"devices": 8, "num_nodes": 2}), ("llama70b", "h200", {"devices": 4, "batch_size": 6}),
    ("smollm2_135m", "this_machine", {}), ("smollm2_135m", "this_machine", {"devices": 2}),
    ("smollm2_135m", "rtx4090", {"offload_activations": True, "grad_dtype": "bf16"}),
])
def test_step_is_between_the_largest_term_and_the_sum_of_the_terms(model, hw, kw):
    p = plan(load_model(model), load_hardware(hw), **kw)
    assert p.step_time_fastest_s == max(p.times.values()) <= p.step_time_s * (1 + 1e-12)
    assert p.step_time_s <= sum(p.times.values()) * (1 + 1e-12)
    assert p.step_time_s == pytest.approx(sum(t for t, _ in p.phases.values()), rel=1e-12)
    assert sum(p.exposed.values()) == pytest.approx(p.step_time_s - p.times["compute"], rel=1e-9, abs=1e-12)
    assert p.dominating == max(p.phases.values())[1]
    assert p.step_time_pessimistic_s >= p.step_time_s
    assert set(p.exposed) <= {k for _, k in p.phases.values()} and "compute" not in p.exposed


def test_cpu_device_plan_is_compute_bound():
    """SmolLM2-135M on this 2-core machine: compute (13.5 s at 0.198 TFLOP/s) hides every worker; the phase model
    gives the compute time, whichever the schedule."""
    p = plan(load_model("smollm2_135m"), load_hardware("this_machine"))
    assert p.exposed == {} and p.dominating == "compute"
    assert p.step_time_s == pytest.approx(p.times["compute"], rel=1e-12) == p.other_schedule["step_time_s"]


def test_report_prints_the_phases_the_exposed_seconds_and_the_other_schedule():
    p = plan(load_model("smollm2_135m"), load_hardware("h200"))
    q = replan(p, optimizer_in_backward=True)
    lines = format_plan(p).splitlines()
    step = next(ln for ln in lines if ln.startswith("step time: "))
    assert step.startswith(f"step time: {p.step_time_s:,.3f} s/step (")
    assert "bound by H2D copies + host AdamW" in step or "bound by D2H copies + host gradient adds" in step
    assert (f"forward {p.phases['forward'][0]:,.3f} s (H2D copies + host AdamW), "
            f"backward {p.phases['backward'][0]:,.3f} s (D2H copies + host gradient adds)") in step
    i = lines.index(step)
    assert lines[i + 1].startswith(f"  exposed beyond compute ({p.times['compute']:,.3f} s): ")
    assert f"H2D copies + host AdamW {p.exposed['h2d+host_adamw']:,.3f} s" in lines[i + 1]
    assert lines[i + 2].startswith("  schedule: optimizer_in_backward=False")
    assert f"with optimizer_in_backward=True: {q.step_time_s:,.3f} s/step" in lines[i + 2]
    assert lines[i + 3].startswith(f"fastest estimate (every term overlapping): {p.step_time_fastest_s:,.3f} s/step, "
                                   "the H2D copies term")
    assert lines[i + 4].startswith("pessimistic (backward H2D at half bandwidth while D2H runs): ")
    assert "exposed beyond compute (" in format_plan(plan(load_model("smollm2_135m"), load_hardware("this_machine")))
    assert "none (compute-bound)" in format_plan(plan(load_model("smollm2_135m"), load_hardware("this_machine")))


def test_cli_and_bad_value(capsys):
    from megatrain_lightning.plan import main

    assert main(["model=smollm2_135m", "hardware=h200", "optimizer_in_backward=true"]) == 0
    out = capsys.readouterr().out
    assert "schedule: optimizer_in_backward=True" in out and "with optimizer_in_backward=False: " in out
    with pytest.raises(ValueError, match="optimizer_in_backward must be true, false or null"):
        plan(load_model("smollm2_135m"), load_hardware("h200"), optimizer_in_backward="sometimes")


def test_the_report_calls_the_largest_term_an_estimate_and_names_its_resource():
    """The largest term (every term overlapping) is printed as the fastest estimate with the resource and rate it
    rests on, never as a lower bound: measured steps beat it where the real rate is higher than the preset's."""
    for p in (plan(load_model("llama70b"), load_hardware("h200")),
              plan(load_model("llama8b"), load_hardware("h200"), offload_params="nvme", offload_optimizer="nvme",
                   offload_grads="nvme"),
              plan(load_model("smollm2_135m"), load_hardware("h200"))):
        text = format_plan(p)
        assert "lower bound:" not in text and "lower s" not in format_comparison([p])
        k = p.dominating_fastest
        line = next(ln for ln in text.splitlines() if ln.startswith("fastest estimate (every term overlapping): "))
        assert f"{p.step_time_fastest_s:,.3f} s/step, the {term_label(k)} term at " in line
        assert "not a lower bound" in line
        rate = {"host_adamw": f"{p.hardware.host_adam_gparams_per_s:g} G params/s",
                "h2d": f"{p.hardware.h2d_gbps:g} GB/s", "d2h": f"{p.hardware.d2h_gbps:g} GB/s",
                "nvme_read": f"{p.hardware.nvme_drives} x {p.hardware.nvme_read_gbps:g} GB/s",
                "nvme_write": f"{p.hardware.nvme_drives} x {p.hardware.nvme_write_gbps:g} GB/s"}.get(k)
        assert rate is None or f"term at {rate}" in line, (k, line)
        assert "fastest s" in format_comparison([p])

