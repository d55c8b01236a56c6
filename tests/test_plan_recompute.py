"""The planner and the recompute policy: the kept-activation formulas of
``planning/activations.py`` against the engine's measured ``megatrain/saved_activation_bytes`` on tiny
Llama models, the recompute FLOPs per mode, ``"auto"``'s budget and mix, and the preflight refusal of a
``recompute="none"`` run whose kept activations do not fit the device."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.plan import GIB, PreflightError, load_hardware, load_model, plan, preflight, replan
from megatrain_lightning.planning import format_plan
from megatrain_lightning.planning.activations import kept_bytes
from megatrain_lightning.planning.estimate import gib
from megatrain_lightning.planning.preflight import plan_for_run
from megatrain_lightning.testing import LM, learnable_data, make_model

TOL = 0.10  # planner vs engine, relative (see planning/activations.py for where "none" differs)
BATCH = 2


def _measured(mode: str, seq: int, precision: str, **kw) -> int:
    """The engine's ``saved_activation_bytes`` of the last of 2 steps of a tiny Llama (SDPA, as the
    planner's formulas assume: no T x T score matrix) at ``BATCH x seq`` tokens."""
    model = make_model("llama", attn="sdpa")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(recompute=mode, **kw), accelerator="cpu", devices=1, max_steps=2,
                         precision=precision, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(LM(model), learnable_data(n=2 * BATCH, seq=seq, batch_size=BATCH))
    return trainer.strategy.engine.history[-1]["megatrain/saved_activation_bytes"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["block", "selective", "none"])
def test_kept_activation_formula_matches_the_engine(mode, precision):
    """Planner's kept bytes within TOL of the engine's measurement at two sequence lengths; the per-token
    slope too (so a fixed term cannot hide a wrong per-token formula)."""
    tiny = make_model("llama", attn="sdpa")
    got = {}
    for seq in (32, 64):
        p = plan(tiny, load_hardware("this_machine"), batch_size=BATCH, seq_len=seq, precision=precision,
                 recompute=mode, loss_chunk_size=None, mlp_chunk_size=None)
        want, have = _measured(mode, seq, precision), kept_bytes(p.counts, p.settings)
        assert abs(have - want) <= TOL * want, (seq, have, want)
        got[seq] = (have, want)
    slope_plan = (got[64][0] - got[32][0]) / (BATCH * 32)
    slope_eng = (got[64][1] - got[32][1]) / (BATCH * 32)
    assert abs(slope_plan - slope_eng) <= TOL * slope_eng, (slope_plan, slope_eng)
    if mode != "none":  # "block" and "selective": the same bytes exactly
        assert got[32][0] == got[32][1] and got[64][0] == got[64][1]


def test_recompute_flops_and_device_bytes_by_mode():
    hw = load_hardware("h200")
    p = {m: plan(load_model("llama8b"), hw, seq_len=4096, recompute=m) for m in ("block", "selective", "none")}
    c, tokens = p["block"].counts, 4096
    layer_fwd = (2 * c.layer_total + 2 * c.num_layers * 4096 * c.num_heads * c.head_dim) * tokens
    # "block" recomputes every layer's forward; "selective" and "none" no matmul
    assert p["block"].flops - p["selective"].flops == pytest.approx(layer_fwd)
    assert p["selective"].flops == p["none"].flops
    f_attn = 2 * c.num_layers * 4096 * c.num_heads * c.head_dim  # Kaplan's 2 n_layer n_ctx d_attn per token
    assert p["none"].flops == pytest.approx((6 * c.matmul_params + 3 * f_attn) * tokens)  # forward + backward
    # kept bytes and device memory grow block < selective < none; the plan shows the mode and its bytes
    kept = {m: kept_bytes(q.counts, q.settings) for m, q in p.items()}
    assert kept["block"] < kept["selective"] < kept["none"]
    assert p["block"].device_bytes < p["selective"].device_bytes < p["none"].device_bytes
    text = format_plan(p["none"])
    assert f"recompute=none: keeps {gib(kept['none'])} GiB of activations" in text and "recompute=none grad" in text
    # the advice names "selective" when it fits on the device
    assert "tip: recompute=selective also fits" in format_plan(p["block"])
    # recompute_every=K chains: only layers that recompute rebuild (none: nothing to chain)
    k4 = {m: replan(q, recompute_every=4) for m, q in p.items()}
    assert k4["none"].flops == p["none"].flops and k4["block"].flops > p["block"].flops
    assert k4["none"].moved["h2d"] == p["none"].moved["h2d"] < k4["block"].moved["h2d"]


def test_auto_reports_its_budget_and_mix():
    hw = load_hardware("h200")
    none = plan(load_model("llama8b"), hw, seq_len=4096, recompute="none")
    block = plan(load_model("llama8b"), hw, seq_len=4096, recompute="block")
    limit = kept_bytes(none.counts, none.settings) // 4
    a = plan(load_model("llama8b"), hw, seq_len=4096, recompute="auto", activation_memory_limit=limit)
    mix = a.settings["recompute_mix"]
    assert a.settings["activation_budget"] == limit and sum(mix.values()) == a.counts.num_layers
    assert mix["block"] < a.counts.num_layers and kept_bytes(a.counts, a.settings) <= limit
    assert block.flops > a.flops >= none.flops
    text = format_plan(a)
    assert f"budget {gib(limit)} GiB (activation_memory_limit)" in text
    assert f"block/selective/none: {mix['block']}/{mix['selective']}/{mix['none']}" in text
    # default budget: half the device memory the plan leaves free with every layer in "block"
    d = plan(load_model("llama8b"), hw, seq_len=4096, recompute="auto")
    assert d.settings["activation_budget"] == (d.capacity["device"] - block.device_bytes) // 2
    with pytest.raises(ValueError, match="strategy.recompute"):
        plan(load_model("llama8b"), hw, recompute="some")


def test_preflight_refuses_recompute_none_that_does_not_fit_and_names_the_option():
    strategy = {"recompute": "none", "loss_chunk_size": None, "mlp_chunk_size": None}
    p = plan_for_run(load_model("llama8b"), load_hardware("h100"), strategy, batch_size=1, seq_len=8192,
                     precision="bf16-mixed")
    assert p.settings["recompute"] == "none" and not p.fits
    with pytest.raises(PreflightError) as ei:
        preflight(p, host_ram_bytes=2048 * GIB, disk_free_bytes=10_000 * GIB, device_bytes=p.capacity["device"])
    msg = str(ei.value)
    assert f"device memory short: need {gib(p.device_bytes)} GiB, have {gib(p.capacity['device'])} GiB" in msg
    assert "recompute=none):" in msg and "kept op outputs / graphs (recompute=none)" in msg
    fix = replan(p, recompute="selective")
    assert fix.fits and (f"set strategy.recompute=selective: data.batch_size=1 data.seq_len=8192 then fits (device then needs "
                         f"{gib(fix.device_bytes)} GiB") in msg
    # the same run with the strategy's default ("block") passes
    ok = plan_for_run(load_model("llama8b"), load_hardware("h100"), {}, batch_size=1, seq_len=8192,
                      precision="bf16-mixed")
    assert ok.settings["recompute"] == "block" and ok.fits


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
@pytest.mark.parametrize("mode", ["block", "selective", "none"])
def test_weight_bytes_moved_per_step_match_the_engine(mode, arch, zero_copy):
    """The planner's H2D and D2H bytes per step (``moved``) equal the engine's measured
    ``megatrain/h2d_bytes`` / ``d2h_bytes`` (fp32). When every block is copied (``cpu_zero_copy=False``): forward fetches
    every block, backward every block but the last (its graph is kept); with ``"none"`` the embedding's
    backward fetches nothing either (its graph keeps only the token indices). From step 2 on: the first
    step does not know yet which block is last (it recomputes it), and its backward's schedule must not
    make step 2 prefetch that block for a backward that no longer fetches it. With ``cpu_zero_copy=True`` (the
    CPU default) blocks bind the fp32 masters: no byte is copied, both say 0 (the counter once counted the
    bytes bound as if copied, ~1 GiB per step for SmolLM2-135M, while the planner said 0)."""
    model = make_model(arch, attn="sdpa")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(recompute=mode, cpu_zero_copy=zero_copy), accelerator="cpu",
                         devices=1, max_steps=3, precision="32-true", enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LM(model), learnable_data(n=3 * BATCH, seq=16, batch_size=BATCH))
    hist = trainer.strategy.engine.history
    moved = plan(model, load_hardware("this_machine"), batch_size=BATCH, seq_len=16, precision="32-true",
                 recompute=mode, cpu_zero_copy=zero_copy).moved
    assert [h["megatrain/h2d_bytes"] for h in hist][1:] == [moved["h2d"]] * 2
    assert (moved["h2d"] == 0) == zero_copy
    # D2H: every gradient once, the embedding's as the rows its tokens read (engine/row_grads.py)
    assert [h["megatrain/d2h_bytes"] for h in hist] == [moved["d2h"]] * 3


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_h2d_bytes_of_the_2_byte_wires_match_the_engine(precision, zero_copy):
    """Under the 2-byte wires the planner's H2D bytes equal the engine's copies too. With ``cpu_zero_copy`` a CPU
    device binds what already has the compute dtype: under ``bf16-true`` every cached bf16 image (0 bytes copied),
    under ``bf16-mixed`` the all-fp32 slabs (the untied embedding, the final norm), while the layers' mixed images
    are decoded into fp32 copies; without it every fetch is a copy."""
    model = make_model("llama", attn="sdpa")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(cpu_zero_copy=zero_copy), accelerator="cpu", devices=1,
                         max_steps=3, precision=precision, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LM(model), learnable_data(n=3 * BATCH, seq=16, batch_size=BATCH))
    hist = trainer.strategy.engine.history
    moved = plan(model, load_hardware("this_machine"), batch_size=BATCH, seq_len=16, precision=precision,
                 cpu_zero_copy=zero_copy).moved
    measured = [h["megatrain/h2d_bytes"] for h in hist][1:]
    # each run of a mixed image is padded to 16 bytes on the wire (engine/wire.py); the planner does not count it
    assert all(moved["h2d"] <= m <= moved["h2d"] + 16 * 8 * 2 * 3 for m in measured), (measured, moved["h2d"])
    if zero_copy and precision == "bf16-true":
        assert measured == [0, 0] and moved["h2d"] == 0
    if not zero_copy:
        assert moved["h2d"] > 0
