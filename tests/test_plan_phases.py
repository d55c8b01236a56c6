"""The planner's step time by phase (planning/phases.py): forward + backward, each as long as its longest
chain of work, for the deferred AdamW schedule and for ``optimizer_in_backward``; the seconds exposed beyond
compute; what the report prints."""

import dataclasses
import math

import pytest

from megatrain_lightning.planning import format_comparison, format_plan, load_hardware, load_model, plan, replan
from megatrain_lightning.planning.phases import chains
from megatrain_lightning.planning.terms import _estimate, block_calls, term_label

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


def test_host_adamw_moves_from_the_forward_to_both_phases_with_the_schedule():
    """SmolLM2-135M on one H200 (bf16-mixed, 1 x 2048 tokens): compute is 2 ms, so every phase is bound by a
    worker. RAM tier, so the update worker runs the host AdamW. Deferred: all of it in the forward, beside the H2D
    worker's copies; optimizer_in_backward: split between the phases in proportion to their lengths without it, so
    here it is hidden. On the NVMe tier the H2D worker (deferred) or the D2H worker (in backward) runs it in series
    with its other work."""
    p = plan(load_model("smollm2_135m"), load_hardware("h200"))
    assert p.settings["optimizer_in_backward"] is None               # the RAM tier's default: deferred
    h = _hand(p)
    assert math.isclose(h["adds"], p.times["grad_add"], rel_tol=1e-9)
    fwd, bwd = max(h["h2d_f"], h["adamw"]), h["d2h"] + h["adds"]
    assert h["adamw"] > h["h2d_f"] > h["comp_f"] and bwd > max(h["comp_b"], h["h2d_b"])
    assert p.phases["forward"] == (pytest.approx(fwd, rel=1e-9), "host_adamw")
    assert p.phases["backward"] == (pytest.approx(bwd, rel=1e-9), "d2h+grad_add")
    assert math.isclose(p.step_time_s, fwd + bwd, rel_tol=1e-9)
    assert p.dominating == ("host_adamw" if fwd > bwd else "d2h+grad_add")
    assert math.isclose(p.exposed["host_adamw"], fwd - h["comp_f"], rel_tol=1e-9)
    assert math.isclose(p.exposed["d2h+grad_add"], bwd - h["comp_b"], rel_tol=1e-9)

    q = replan(p, optimizer_in_backward=True)
    fwd_q = max(h["h2d_f"], h["comp_f"])
    share = fwd_q / (fwd_q + bwd)
    assert h["adamw"] * share < fwd_q and h["adamw"] * (1 - share) < bwd   # hidden behind both phases
    assert q.phases["forward"] == (pytest.approx(fwd_q, rel=1e-9), "h2d")
    assert q.phases["backward"] == (pytest.approx(bwd, rel=1e-9), "d2h+grad_add")
    assert "host_adamw" not in q.exposed and math.isclose(q.step_time_s, fwd_q + bwd, rel_tol=1e-9)
    # each plan carries the other schedule's step time
    assert p.other_schedule["optimizer_in_backward"] is True and math.isclose(p.other_schedule["step_time_s"], q.step_time_s)
    assert q.other_schedule["optimizer_in_backward"] is False and math.isclose(q.other_schedule["step_time_s"], p.step_time_s)

    nv = replan(p, offload_optimizer="nvme", optimizer_in_backward=False)  # the H2D worker runs it
    assert "h2d+host_adamw" in dict(chains(_estimate(nv.counts, nv.hardware, nv.settings))["forward"])
    nv = replan(nv, optimizer_in_backward=True)                          # the D2H worker runs it
    assert "d2h+grad_add+host_adamw" in dict(chains(_estimate(nv.counts, nv.hardware, nv.settings))["backward"])


def test_an_update_longer_than_both_phases_is_exposed_in_proportion():
    """llama70b fp32 on one H200 whose host updates 1.5 G params/s (the rate the fp32 AdamW of a 70B model reaches on
    a loaded host), optimizer_in_backward on the RAM tier: the host AdamW (47 s) is longer than forward + backward
    without it, so the step is the update's time, split between the phases in proportion to their lengths without
    it."""
    hw = dataclasses.replace(load_hardware("h200"), host_adam_gparams_per_s=1.5)
    p = plan(load_model("llama70b"), hw, precision="32-true", optimizer_in_backward=True)
    e = _estimate(p.counts, p.hardware, p.settings)
    lengths = {ph: max(t for k, t in row if k != "host_adamw") for ph, row in chains(
        {**e, "times": {**e["times"], "host_adamw": 0.0}}).items()}
    assert p.times["host_adamw"] > sum(lengths.values())
    assert p.step_time_s == pytest.approx(p.times["host_adamw"], rel=1e-9)
    assert {k for _, k in p.phases.values()} == {"host_adamw"}
    assert p.phases["forward"][0] / p.step_time_s == pytest.approx(lengths["forward"] / sum(lengths.values()))
    assert p.exposed == {"host_adamw": pytest.approx(p.step_time_s - p.times["compute"], rel=1e-9)}
    deferred = replan(p, optimizer_in_backward=False)  # hidden behind the forward only
    assert deferred.step_time_s == pytest.approx(p.times["host_adamw"] + lengths["backward"], rel=1e-9)


def test_backward_compute_hides_the_d2h_worker_at_a_large_batch():
    """llama8b, bf16-mixed, batch 16 on an H200: the backward is compute-bound (nothing exposed there); the forward
    is bound by the update worker's deferred AdamW, which optimizer_in_backward spreads over both phases, so that
    schedule is faster (compute-bound)."""
    p = plan(load_model("llama8b"), load_hardware("h200"), batch_size=16)
    h = _hand(p)
    assert h["comp_b"] > max(h["h2d_b"], h["d2h"] + h["adds"])
    assert p.phases["backward"] == (pytest.approx(h["comp_b"], rel=1e-9), "compute")
    assert p.phases["forward"] == (pytest.approx(max(h["h2d_f"], h["adamw"]), rel=1e-9), "host_adamw")
    assert list(p.exposed) == ["host_adamw"]
    q = replan(p, optimizer_in_backward=True)
    assert q.step_time_s < p.step_time_s and p.other_schedule["step_time_s"] == pytest.approx(q.step_time_s)
    assert q.step_time_s == pytest.approx(h["comp_f"] + h["comp_b"], rel=1e-9) and q.exposed == {}


def test_nvme_io_lands_in_the_phase_of_the_update():
    """Every state on NVMe (llama8b, 8 drives): deferred, the forward reads master + moments + accumulator (16 B/param)
    and writes master + moments (12), the backward re-reads the masters for its fetch and writes the accumulators (4);
    in backward the update's reads and writes move to the backward and the accumulator never reaches the disk."""
    nv = dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    p = plan(load_model("llama8b"), load_hardware("h200"), optimizer_in_backward=False, **nv)
    p = replan(p, host_memory_limit=p.nvme_window["min_window"])  # a window that keeps nothing beyond its minimum
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


def test_cpu_device_plan_puts_the_host_work_in_series_with_compute():
    """SmolLM2-135M on this 2-core machine: the workers run on the cores that compute (one intra-op thread each),
    so each phase is compute + the engine's fixed time + the copies, gradient adds and host update of that phase;
    the step is the sum of those terms, whichever the schedule, and the report names what they add to compute."""
    hw = load_hardware("this_machine")
    p = plan(load_model("smollm2_135m"), hw)
    on_cores = ("compute", "engine", "h2d", "d2h", "grad_add", "host_adamw")
    assert set(p.times) >= set(on_cores) and p.times["engine"] > 0
    assert p.step_time_s == pytest.approx(sum(p.times[k] for k in on_cores), rel=1e-12)
    assert p.step_time_s == pytest.approx(p.other_schedule["step_time_s"], rel=1e-12)
    fwd, bwd = block_calls(p.counts, p.settings)
    assert (fwd, bwd) == (p.counts.num_layers + 2, 2 * p.counts.num_layers + 2)  # recompute=block
    # + the activations the engine gave back at the last step's end, faulted in again (StreamingEngine.end_step)
    refill = p.host["activations (CPU device)"] / (hw.page_fill_gbps * 1e9)
    assert refill > 0.1
    assert p.times["engine"] == pytest.approx(((fwd + bwd) * hw.block_call_ms + hw.step_overhead_ms) / 1e3 + refill)
    assert p.dominating.startswith("compute+engine")
    assert sum(p.exposed.values()) == pytest.approx(p.step_time_s - p.times["compute"], rel=1e-9)
    step = next(ln for ln in format_plan(p).splitlines() if ln.startswith("  exposed beyond compute"))
    assert "engine CPU time + H2D copies + host AdamW" in step and "compute + " not in step
    # a GPU preset leaves the engine's fixed time out (it overlaps the device's kernels) and the workers overlap
    g = plan(load_model("smollm2_135m"), load_hardware("h200"))
    assert "engine" not in g.times and g.step_time_s < sum(g.times.values())


def test_report_prints_the_phases_the_exposed_seconds_and_the_other_schedule():
    p = plan(load_model("smollm2_135m"), load_hardware("h200"))
    q = replan(p, optimizer_in_backward=True)
    lines = format_plan(p).splitlines()
    step = next(ln for ln in lines if ln.startswith("step time: "))
    assert step.startswith(f"step time: {p.step_time_s:,.3f} s/step (")
    assert "bound by host AdamW" in step or "bound by D2H copies + host gradient adds" in step
    assert (f"forward {p.phases['forward'][0]:,.3f} s (host AdamW), "
            f"backward {p.phases['backward'][0]:,.3f} s (D2H copies + host gradient adds)") in step
    i = lines.index(step)
    assert lines[i + 1].startswith(f"  exposed beyond compute ({p.times['compute']:,.3f} s): ")
    assert f"host AdamW {p.exposed['host_adamw']:,.3f} s" in lines[i + 1]
    assert lines[i + 2].startswith("  schedule: optimizer_in_backward=False")
    assert f"with optimizer_in_backward=True: {q.step_time_s:,.3f} s/step" in lines[i + 2]
    assert lines[i + 3].startswith(f"fastest estimate (every term overlapping): {p.step_time_fastest_s:,.3f} s/step, "
                                   "the H2D copies term")
    assert lines[i + 4].startswith("pessimistic (backward H2D at half bandwidth while D2H runs): ")
    assert "exposed beyond compute (" in format_plan(plan(load_model("smollm2_135m"), load_hardware("this_machine")))
    assert "none (compute-bound)" in format_plan(plan(load_model("smollm2_135m"), load_hardware("h200"), batch_size=16))


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

