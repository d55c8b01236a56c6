"""The planner's NVMe bytes written per optimizer step against the engine's measured ``megatrain/nvme_write_bytes``:
a tiny Llama with every state on NVMe, for the schedule the strategy runs (updates in backward: master and both
moments written, 12 B/param; deferred, by ``optimizer_in_backward=False`` or because gradient clipping needs every
gradient first: the accumulators too, 16 B/param), planned the way the recipe's preflight plans it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.plan import load_hardware
from megatrain_lightning.planning import format_plan
from megatrain_lightning.planning.preflight import plan_for_run
from megatrain_lightning.store.nvme import ALIGN
from megatrain_lightning.testing import LM, learnable_data, make_model

BATCH, SEQ, STEPS = 2, 16, 6


@pytest.mark.parametrize("in_backward,clip", [(None, None), (False, None), (None, 1.0)])
def test_nvme_write_bytes_per_step_match_the_engine(tmp_path, in_backward, clip):
    """Mean bytes written per step over steps 2..6 (the first step has no deferred update to write; a write-behind
    may finish in the next step, so single steps jitter by a region) against the plan. The engine pads each region
    to 4 KiB on disk, which the plan does not count: allowed, per block and region written, plus one region of
    jitter. Before the recipe's plan knew that clipping makes the strategy defer the update, it planned 12 B/param
    for the clipped run, which writes 16."""
    model = make_model("llama", attn="sdpa")
    options = dict(offload_params="nvme", offload_optimizer="nvme", optimizer_in_backward=in_backward)
    extra = {"gradient_clip_val": clip} if clip else {}
    trainer = pl.Trainer(strategy=MegaTrainStrategy(nvme_path=str(tmp_path), host_memory_limit=600_000, **options),
                         accelerator="cpu", devices=1, max_steps=STEPS, precision="32-true", enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, **extra)
    trainer.fit(LM(model), learnable_data(n=STEPS * BATCH, seq=SEQ, batch_size=BATCH))
    engine = trainer.strategy.engine
    written = [h["megatrain/nvme_write_bytes"] for h in engine.history][1:]
    measured = sum(written) / len(written)
    deferred = engine.optimizer.updates_in_backward == 0
    assert deferred == (in_backward is False or clip is not None)
    layout = engine.store.nvme.layout  # per block (numel, trainable numel)
    trainer.strategy.close()

    p = plan_for_run({"config": model.config.to_dict()}, load_hardware("this_machine"), options, batch_size=BATCH,
                     seq_len=SEQ, precision="32-true", gradient_clip_val=clip)
    planned = p.moved["nvme_write"]
    regions = 3 + deferred  # master, exp_avg, exp_avg_sq (+ the accumulator when deferred)
    assert planned == sum(4 * n + 4 * (regions - 1) * t for n, t in layout)
    pad = regions * ALIGN * len(layout)
    assert planned <= measured <= planned + pad + 4 * max(t for _, t in layout) + ALIGN, (measured, planned, written)


class SGDMomentumLM(LM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_nvme_write_bytes_of_sgd_momentum_are_one_optimizer_region(tmp_path):
    """SGD with momentum keeps one buffer per element: after each block's first update its updates hold the
    ``exp_avg`` region only, so a step writes master + momentum, 8 B/param, and the plan says the same (where AdamW
    writes 12)."""
    model = make_model("llama", attn="sdpa")
    options = dict(offload_params="nvme", offload_optimizer="nvme")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(nvme_path=str(tmp_path), host_memory_limit=600_000, **options),
                         accelerator="cpu", devices=1, max_steps=STEPS, precision="32-true", enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(SGDMomentumLM(model), learnable_data(n=STEPS * BATCH, seq=SEQ, batch_size=BATCH))
    engine = trainer.strategy.engine
    written = [h["megatrain/nvme_write_bytes"] for h in engine.history][2:]  # from the step after the first update
    measured = sum(written) / len(written)
    assert engine.optimizer.updates_in_backward > 0
    layout = engine.store.nvme.layout
    trainer.strategy.close()

    p = plan_for_run({"config": model.config.to_dict()}, load_hardware("this_machine"), options, batch_size=BATCH,
                     seq_len=SEQ, precision="32-true", optim={"_target_": "torch.optim.SGD", "momentum": 0.9})
    planned = p.moved["nvme_write"]
    assert planned == sum(4 * n + 4 * t for n, t in layout)
    pad = 2 * ALIGN * len(layout)
    assert planned <= measured <= planned + pad + 4 * max(t for _, t in layout) + ALIGN, (measured, planned, written)


def _reads_per_step(tmp_path, model, limit: int) -> list[int]:
    tmp_path.mkdir()
    options = dict(offload_params="nvme", offload_optimizer="nvme")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(nvme_path=str(tmp_path), host_memory_limit=limit, **options),
                         accelerator="cpu", devices=1, max_steps=STEPS, precision="32-true", enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LM(model), learnable_data(n=STEPS * BATCH, seq=SEQ, batch_size=BATCH))
    reads = [h["megatrain/nvme_read_bytes"] for h in trainer.strategy.engine.history][1:]
    trainer.strategy.close()
    return reads


def test_nvme_reads_per_step_are_what_the_window_cannot_keep(tmp_path):
    """The host window is a cache of the regions a step rewrites: with ``host_memory_limit`` at the engine's minimum
    window the engine reads (about) every region the schedule needs, with room for all of them beyond the minimum it
    reads nothing, and the plan says each. Before the plan counted the window's cache it planned the full reads at
    every limit (the default limit, half of RAM, keeps a small model's regions: the engine read 0 bytes per step
    where the plan said 303 MB)."""
    model = make_model("llama", attn="sdpa", num_hidden_layers=12)  # the minimum window: 3 of 14 blocks
    options = dict(offload_params="nvme", offload_optimizer="nvme")

    def planned(limit: int):
        return plan_for_run({"config": model.config.to_dict()}, load_hardware("this_machine"),
                            {**options, "host_memory_limit": limit}, batch_size=BATCH, seq_len=SEQ,
                            precision="32-true")

    base = planned(600_000)
    mw, rewritten = base.nvme_window["min_window"], base.moved["nvme_write"]
    tight, roomy = planned(mw), planned(mw + 2 * rewritten)
    assert tight.moved["nvme_read"] == tight.moved["nvme_read_uncached"] > 0
    assert tight.moved["nvme_read_back_regions"] == rewritten  # no reference copy: the regions a step writes
    assert roomy.moved["nvme_read"] == 0 < roomy.moved["nvme_read_uncached"] == tight.moved["nvme_read_uncached"]
    assert roomy.times["nvme_read"] == 0 < tight.times["nvme_read"]
    half = planned(mw + rewritten // 2)
    assert half.moved["nvme_read"] == pytest.approx(tight.moved["nvme_read"] / 2, abs=2)
    saved = int(100 * (1 - half.moved["nvme_read"] / half.moved["nvme_read_uncached"]))
    assert saved in (49, 50) and f"saves {saved}% of them" in format_plan(half) and "without the window's cache" not in format_plan(tight)

    assert _reads_per_step(tmp_path / "roomy", model, mw + 2 * rewritten) == [0] * (STEPS - 1)
    tight_reads = _reads_per_step(tmp_path / "tight", model, mw)
    # at the minimum the engine also reads again regions evicted between the backward fetch and the update
    # (bench/nvme_window.py: 1.13-1.21 x the schedule's count on larger models)
    for r in tight_reads:
        assert tight.moved["nvme_read"] * 0.9 <= r <= tight.moved["nvme_read"] * 1.5, (tight_reads, tight.moved)


def test_the_window_caches_a_reference_copy_on_nvme_too():
    """``reference=copy`` with the masters on NVMe reads the frozen copy every step and never writes it: the window
    needs room for it as well before the reads stop (the plan's kept share is spare / (written + the copy))."""
    from megatrain_lightning.planning import load_model, plan, replan

    nv = dict(offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
    p = plan(load_model("llama8b"), load_hardware("h200"), host_memory_limit="100GiB", **nv)
    r = replan(p, reference="copy")
    n, mw = p.counts.total, p.nvme_window["min_window"]
    spare = 100 * 2**30 - mw
    assert p.moved["nvme_read"] == pytest.approx(p.moved["nvme_read_uncached"] * (1 - spare / (12 * n)), abs=2)
    assert r.moved["nvme_read"] == pytest.approx(r.moved["nvme_read_uncached"] * (1 - spare / (16 * n)), abs=2)
    # the tip's limit that reads nothing holds the copy too
    from megatrain_lightning.planning.advice import window_advice

    assert r.moved["nvme_read_back_regions"] == p.moved["nvme_read_back_regions"] + 4 * n
    tip = window_advice(r)
    assert f"host_memory_limit={-(-(mw + 16 * n) // 2**30)}GiB" in tip and "no NVMe reads" in tip, tip
