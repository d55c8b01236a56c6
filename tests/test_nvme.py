"""NVMe tier: bitwise parity with the RAM tier, strict host budget, preflight, lock, faults.

The RAM tier is the reference here (it matches plain PyTorch to 1e-5, tests/test_parity.py):
the NVMe tier runs the same arithmetic on the same values, only stored in files, so losses and
weights must be *bitwise* equal, under a host budget small enough that every block is evicted
and read back from disk each step.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain_nvme")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.parallel.lifetime import dies_with_this_process
from megatrain_lightning.store import nvme as nvme_mod
from megatrain_lightning.store.budget import HostBudget, HostMemoryBudgetError, parse_bytes
from megatrain_lightning.store.nvme import STORE_DIR, NVMeIOError, NVMeStore, NVMeStoreLockedError, sweep_stale_stores
from megatrain_lightning.testing import LM, make_data, make_model
from test_checkpoint import loader

STEPS = 20
LIMIT = 600_000  # bytes: just above the window the largest block needs (min_window, ~0.5 MB)


DEEP = {"num_hidden_layers": 8}  # 8 decoder layers: the model's 16 B/param (1.1 MB) is ~2x LIMIT


def fit(strategy, steps=STEPS, accumulate=1, clip=None, arch="llama", model_kw=None, ckpt_path=None, data=None, **kw):
    lm = LM(make_model(arch, **(model_kw or {})), total_steps=STEPS, sched="cosine")  # same LR schedule for every length
    torch.manual_seed(0)
    extra = {"accumulate_grad_batches": accumulate} if accumulate > 1 else {}
    if clip is not None:
        extra["gradient_clip_val"] = clip
    extra.update(kw)
    tr = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                    enable_checkpointing=extra.pop("enable_checkpointing", bool(extra.get("callbacks"))),
                    enable_progress_bar=False,
                    enable_model_summary=False, **extra)
    tr.fit(lm, data if data is not None else make_data(n=steps * accumulate * 2), ckpt_path=ckpt_path)
    return lm, tr


def nvme_strategy(path, limit=LIMIT, **kw):
    return MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(path),
                             host_memory_limit=limit, **kw)


def assert_bitwise(a, b):
    assert a.losses == b.losses, [(x, y) for x, y in zip(a.losses, b.losses) if x != y][:3]
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n


@pytest.mark.parametrize("accumulate,clip", [(1, None), (3, 0.5)])
def test_nvme_tier_is_bitwise_equal_to_ram_tier(tmp_path, accumulate, clip):
    ram, _ = fit(MegaTrainStrategy(), accumulate=accumulate, clip=clip, model_kw=DEEP)
    # with accumulation, regions also move as many 8 KiB requests in flight at once
    io = {"nvme_io_block_size": 8192} if accumulate > 1 else {}
    disk, tr = fit(nvme_strategy(tmp_path, **io), accumulate=accumulate, clip=clip, model_kw=DEEP)
    assert_bitwise(ram, disk)
    hist = tr.strategy.engine.history
    n = sum(p.numel() for p in ram.parameters())
    # every step went through the disk: more bytes read than one copy of the weights
    assert all(h["megatrain/nvme_read_bytes"] > 4 * n for h in hist[1:])
    assert max(h["megatrain/host_budget_peak_bytes"] for h in hist) <= LIMIT
    if accumulate == 1:  # updates in backward consume the accumulator in the window: never written
        st = tr.strategy.engine.store.nvme
        once = sum(st._nbytes[i][k] for i, (_, t) in enumerate(st.layout) if t for k in ("master", "exp_avg", "exp_avg_sq"))
        per_step = sum(h["megatrain/nvme_write_bytes"] for h in hist[1:]) / (len(hist) - 1)
        assert abs(per_step / once - 1) < 0.05, (per_step, once)  # with accumulators written: +33%
    # without clipping the NVMe tier applies each update in backward; clipping needs every gradient first
    n_eager = tr.strategy.engine.optimizer.updates_in_backward
    assert (n_eager > 0) if clip is None else (n_eager == 0)
    # the store stays open after fit (trainer.save_checkpoint reads it) until the strategy closes
    assert list((tmp_path / STORE_DIR).glob("block_*.bin"))
    tr.strategy.close()
    assert not (tmp_path / STORE_DIR).exists()


@pytest.mark.parametrize("accumulate", [1, 3])
def test_optimizer_in_backward_is_bitwise_the_deferred_schedule(accumulate):
    deferred, _ = fit(MegaTrainStrategy(optimizer_in_backward=False), steps=8, accumulate=accumulate)
    eager, tr = fit(MegaTrainStrategy(optimizer_in_backward=True), steps=8, accumulate=accumulate)
    assert_bitwise(deferred, eager)
    # every slab with trainable parameters, every step (only the last micro-batch of a window)
    slabs = sum(1 for s in tr.strategy.engine.store.slabs if s.trainable_numel)
    assert tr.strategy.engine.optimizer.updates_in_backward == 8 * slabs


def test_optimizer_only_and_params_only_on_nvme_match(tmp_path):
    ram, _ = fit(MegaTrainStrategy(), steps=6, accumulate=2)
    for params, opt in (("nvme", "cpu"), ("cpu", "nvme")):
        d = tmp_path / f"{params}-{opt}"
        d.mkdir()
        disk, tr = fit(MegaTrainStrategy(offload_params=params, offload_optimizer=opt, nvme_path=str(d),
                                         host_memory_limit=LIMIT), steps=6, accumulate=2)
        assert_bitwise(ram, disk)
        tr.strategy.close()
        assert not (d / STORE_DIR).exists()


def test_registered_variant_reads_env(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRAIN_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match="MEGATRAIN_NVME_PATH"):
        pl.Trainer(strategy="megatrain_nvme", accelerator="cpu", devices=1)
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    lm, tr = fit("megatrain_nvme", steps=2)
    assert tr.strategy.nvme is not None and tr.strategy.nvme.path == str(tmp_path)
    assert tr.strategy.nvme.kinds == {"master", "exp_avg", "exp_avg_sq", "grad_accum"}


# ---------------------------------------------------------------- preflight
def test_preflight_errors_name_the_numbers(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        fit(nvme_strategy(tmp_path / "missing"), steps=1)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        fit(nvme_strategy(f), steps=1)
    with pytest.raises(ValueError, match="host_memory_limit=.* is below .* Raise host_memory_limit to at least"):
        fit(nvme_strategy(tmp_path, limit=100_000), steps=1)
    with pytest.raises(ValueError, match="Not a memory size"):
        nvme_strategy(tmp_path, limit="lots")
    with pytest.raises(ValueError, match="must be 'cpu' or 'nvme'"):
        MegaTrainStrategy(offload_params="disk")
    with pytest.raises(ValueError, match="needs nvme_path"):
        MegaTrainStrategy(offload_optimizer="nvme")

    real = nvme_mod.shutil.disk_usage
    monkeypatch.setattr(nvme_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=10 * 2**20))
    with pytest.raises(ValueError, match=r"has 10.00 MiB free; the NVMe store needs .* plus a margin"):
        fit(nvme_strategy(tmp_path), steps=1)
    monkeypatch.setattr(nvme_mod.shutil, "disk_usage", real)

    monkeypatch.setattr(nvme_mod.os, "access", lambda p, mode: False)
    with pytest.raises(ValueError, match="not writable"):
        fit(nvme_strategy(tmp_path), steps=1)
    monkeypatch.undo()
    # nothing was created by the refused runs
    assert not (tmp_path / STORE_DIR).exists()


def test_budget_and_sizes():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("-1", "12 parsecs", 0, True, float("inf"), float("nan"), "9" * 400 + "GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    b = HostBudget(100)
    assert b.try_reserve(60) and not b.try_reserve(50)
    with pytest.raises(HostMemoryBudgetError, match="needs 200 B"):
        b.reserve(200)
    with pytest.raises(HostMemoryBudgetError, match="waited"):
        b.reserve(50, timeout_s=0.2)
    b.release(60)
    b.reserve(100)
    assert b.peak == 100


@pytest.mark.parametrize("io_block_size", [2**20, 4096])  # one request per region; 3 concurrent requests each
def test_window_evicts_and_round_trips_exactly(tmp_path, io_block_size):
    layout = [(3000, 2000)] * 6  # each master region 12 KiB, each state 8 KiB
    budget = HostBudget(3 * 12288)
    st = NVMeStore(tmp_path, layout, budget, direct_io="auto", io_block_size=io_block_size)
    vals = []
    for i in range(6):
        with st.hold(i, ["master"], write=True, fresh=["master"]) as t:
            v = torch.randn(3000)
            t["master"].copy_(v)
            vals.append(v)
    st.wait_io()
    assert budget.peak <= budget.limit
    for i in reversed(range(6)):
        with st.hold(i, ["master"]) as t:
            assert torch.equal(t["master"], vals[i])
    with st.hold(0, ["exp_avg"]) as t:  # never written: zeros, like a fresh AdamW state
        assert t["exp_avg"].abs().sum() == 0
    assert st.meter.read_bytes >= 3 * 12288  # evicted blocks came back from disk
    st.close()
    assert not (tmp_path / STORE_DIR).exists()


def test_empty_regions_take_no_window_buffer(tmp_path):
    """A slab without parameters (a tied model's head block) or without trainable ones: its regions are empty
    tensors outside the window. Before, each was a 0-byte arena buffer at the offset the next buffer then took too,
    and freeing either lost the other's record (KeyError at the end of ``megatrain_nvme`` runs of tied models)."""
    layout = [(3000, 2000), (0, 0), (1024, 0), (3000, 2000)]
    budget = HostBudget(4 * 12288)
    st = NVMeStore(tmp_path, layout, budget, io_block_size=4096)
    vals = {}
    for _ in range(3):
        for i in (1, 0, 1, 2, 1, 3):
            with st.hold(i, ["master", "exp_avg"], write=True) as t:
                assert t["master"].numel() == layout[i][0] and t["exp_avg"].numel() == layout[i][1]
                if layout[i][0]:
                    vals[i] = torch.randn(layout[i][0])
                    t["master"].copy_(vals[i])
        st.drop_clean()  # frees every window buffer: each one's arena record must be its own
    assert st.arena.used == 0 and budget.used == 0
    for i, v in vals.items():
        with st.hold(i, ["master"]) as t:
            assert torch.equal(t["master"], v)
    st.close()


def test_stores_a_killed_run_left_are_removed_and_live_or_kept_ones_are_not(tmp_path, caplog):
    """A killed 2-process run leaves ``megatrain_store_rank1``; a later run with one process never opens it (its
    store is ``megatrain_store``), so the disk space leaked: the sweep removes it with a warning, and leaves a
    store a live process holds, a kept one and this run's own."""
    import fcntl
    from pathlib import Path

    def store(name: str, owner: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "LOCK").write_text(owner)
        (d / "block_00000.bin").write_bytes(b"x" * 4096)
        return d

    dead, kept, live, mine = (store("megatrain_store_rank1", "999999"), store("megatrain_store_rank2", "kept"),
                              store("megatrain_store_rank3", str(os.getpid())), store("megatrain_store", "999998"))
    fd = os.open(live / "LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run holds it
    try:
        with caplog.at_level("WARNING"):
            assert sweep_stale_stores(tmp_path, keep={"megatrain_store"}) == ["megatrain_store_rank1"]
    finally:
        os.close(fd)
    assert not dead.exists() and "left by a run that did not finish (pid 999999; 1 files)" in caplog.text
    assert all((d / "block_00000.bin").exists() for d in (kept, live, mine))


class SkipOddBatches(LM):
    """``training_step`` returns ``None`` on odd batches: Lightning skips their backward and step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


def test_skipped_backward_releases_the_head_buffers_in_the_budget(tmp_path):
    """The last block keeps its weights for a backward that never comes on skipped batches; the next
    forward must give their bytes back to the budget (else the window shrinks every skipped step)."""
    lm = SkipOddBatches(make_model("llama", **DEEP))
    tr = pl.Trainer(strategy=nvme_strategy(tmp_path), accelerator="cpu", devices=1, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tr.fit(lm, make_data(n=12))
    eng = tr.strategy.engine
    assert len(lm.losses) == 6  # 6 batches of 2, 3 of them without backward
    assert not eng.boundary.kept_open and eng.acct.live == 0
    assert eng.budget.used == eng.store.nvme.resident_bytes()  # only window buffers stay counted


def test_eviction_keeps_the_read_ahead_needed_soonest(tmp_path):
    layout = [(3000, 2000)] * 6  # master regions of 12 KiB
    st = NVMeStore(tmp_path, layout, HostBudget(4 * 12288), read_ahead=4)
    for i in range(6):
        with st.hold(i, ["master"], write=True, fresh=["master"]):
            pass
    st.drop_clean()
    st.read_ahead([(0, "master"), (1, "master"), (2, "master")])  # the schedule's next three, in order
    st.wait_io()
    with st.hold(3, ["master"]), st.hold(4, ["master"]):  # the window is full: one read-ahead must go
        assert sorted(st.entries) == [(0, "master"), (1, "master"), (3, "master"), (4, "master")]
    st.close()


def test_failed_request_of_a_split_region_names_its_offset(tmp_path, monkeypatch):
    st = NVMeStore(tmp_path, [(3000, 2000)], HostBudget(2**20), io_block_size=4096)
    with st.hold(0, ["master"], write=True, fresh=["master"]) as t:
        t["master"].fill_(1.0)
    st.wait_io()
    real, calls = nvme_mod._pread, []

    def faulty(fd, buf, off):
        calls.append(off)
        if off == 4096:  # the second of the region's three requests
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buf, off)

    st.drop_clean()
    monkeypatch.setattr(nvme_mod, "_pread", faulty)
    with pytest.raises(NVMeIOError, match="read of master of block 0 .*offset 4096, 4096 bytes"):
        with st.hold(0, ["master"]):
            pass
    assert sorted(calls) == [0, 4096, 8192]  # every request ran (none still writes into a freed buffer)
    monkeypatch.setattr(nvme_mod, "_pread", real)
    with st.hold(0, ["master"]) as t:  # the region is still readable once the disk recovers
        assert torch.equal(t["master"], torch.ones(3000))
    st.close()


@pytest.mark.parametrize("callback", ["ema", "swa", "finetuning"])
def test_callbacks_reading_weights_with_masters_on_disk_are_refused_before_any_step(tmp_path, callback):
    """``EMAWeightAveraging`` / ``StochasticWeightAveraging`` read and write ``param.data``, which the NVMe tier
    keeps as placeholders: refused at setup, naming the callback and the option (before, EMA failed with a
    PyTorch error at the first validation, after the steps before it ran). ``BaseFinetuning`` compares parameter
    values to find them in the optimizer: with placeholders it added no param group, and the unfrozen layers did
    not train. With only the AdamW state on NVMe, EMA trains bitwise as with the RAM tier."""
    from lightning.pytorch.callbacks import BaseFinetuning, EMAWeightAveraging, StochasticWeightAveraging

    class FreezeLayer0(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.model.model.layers[0])

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.model.model.layers[0], optimizer)

    make = {"ema": lambda: EMAWeightAveraging(decay=0.5), "swa": lambda: StochasticWeightAveraging(1e-2),
            "finetuning": FreezeLayer0}[callback]
    with pytest.raises(RuntimeError, match=rf"{type(make()).__name__} callback .* offload_params='nvme'.* host RAM"):
        fit(nvme_strategy(tmp_path / "a"), callbacks=[make()], default_root_dir=tmp_path,
            enable_checkpointing=callback != "ema")
    if callback == "ema":  # (checkpoints with an average in the Trainer are refused: tests/test_mid_fit_changes.py)
        (tmp_path / "b").mkdir()
        opt_only, _ = fit(MegaTrainStrategy(offload_optimizer="nvme", nvme_path=str(tmp_path / "b")),
                          callbacks=[make()], default_root_dir=tmp_path, enable_checkpointing=False)
        ram, _ = fit(MegaTrainStrategy(), callbacks=[make()], default_root_dir=tmp_path, enable_checkpointing=False)
        assert_bitwise(opt_only, ram)


def test_io_options_are_validated_with_their_names():
    with pytest.raises(ValueError, match="multiple of 4096"):
        MegaTrainStrategy(offload_params="nvme", nvme_path="/tmp", nvme_io_block_size=5000)
    with pytest.raises(ValueError, match="nvme_io_block_size: Not a memory size: 'abc'"):
        MegaTrainStrategy(offload_params="nvme", nvme_path="/tmp", nvme_io_block_size="abc")
    with pytest.raises(ValueError, match="host_memory_limit: Not a memory size"):
        MegaTrainStrategy(offload_params="nvme", nvme_path="/tmp", host_memory_limit="lots")
    for inf in (float("inf"), float("nan")):  # not "no limit": the default (unset) is half the RAM
        with pytest.raises(ValueError, match="megatrain: host_memory_limit: A memory size must be a finite number"):
            MegaTrainStrategy(offload_params="nvme", nvme_path="/tmp", host_memory_limit=inf)
    with pytest.raises(ValueError, match="nvme_io_threads must be an integer >= 1, got '4'"):
        MegaTrainStrategy(offload_params="nvme", nvme_path="/tmp", nvme_io_threads="4")


def test_closed_store_weights_are_refused_and_the_same_process_is_named(tmp_path, caplog):
    """Weights larger than the budget live only in the store: after close() the module's parameters
    are placeholders, and a new run must refuse them instead of training zeros. A second run on a
    store the same process still holds is told to close the first."""
    lm, tr = fit(nvme_strategy(tmp_path), steps=2, model_kw={"num_hidden_layers": 24})  # 4 B/param > LIMIT
    assert not tr.strategy.engine.params.materialized
    ids = make_data(n=2).dataset.tensors[0][:1]
    # a forward on the placeholders computed with zeros (generate gave plausible tokens): refused, saying what to do
    with pytest.raises(RuntimeError, match="exceed host_memory_limit.*placeholders.*save_checkpoint"):
        lm.model.generate(ids, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="placeholders"):
        lm.model(input_ids=ids)
    # a copy or pickle would turn the placeholders into real, unguarded zeros
    import copy

    with pytest.raises(RuntimeError, match="a copy or pickle of the module would hold placeholders.*save_checkpoint"):
        copy.deepcopy(lm.model)
    with pytest.raises(RuntimeError, match="a copy or pickle of the module would hold placeholders"):
        torch.save(lm.model, tmp_path / "model.pt")
    tr.validate(lm, make_data(n=2), verbose=False)  # the strategy binds the store's weights: allowed
    with pytest.raises(NVMeStoreLockedError, match="still open in this process.*trainer.strategy.close"):
        fit(nvme_strategy(tmp_path), steps=1)
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning.strategy_base"):
        tr.strategy.close()
    assert "deletes the trained weights" in caplog.text
    with pytest.raises(RuntimeError, match="holds no weights .*NVMe placeholder"):
        pl.Trainer(strategy=nvme_strategy(tmp_path), accelerator="cpu", devices=1, max_steps=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(lm, make_data(n=2))


def test_a_new_trainer_for_the_same_module_takes_the_weights_over(tmp_path):
    """fit, then a new Trainer assigned to the same variable fits the same module again (notebook style): the
    weights, larger than host_memory_limit, were only in the first strategy's store. The second fit continues from
    them, as plain Lightning's second Trainer does (fresh AdamW each), and the first store's files are gone.
    The garbage-collected first strategy must not delete the only copy of the trained weights."""
    import copy
    import gc

    from megatrain_lightning.placeholder_guard import holder_of

    init = LM(make_model("llama", num_hidden_layers=24), total_steps=STEPS, sched="cosine")

    def two_fits(strategy):
        lm = copy.deepcopy(init)
        for _ in range(2):
            torch.manual_seed(0)
            tr = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=1, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            tr.fit(lm, make_data(n=4))
            if isinstance(tr.strategy, MegaTrainStrategy):
                assert not tr.strategy.engine.params.materialized  # 4 B/param > LIMIT: placeholders after fit
            del tr
            gc.collect()  # the first Trainer is unreferenced now: its store must not take the weights with it
        return lm

    plain = two_fits(lambda: "auto")
    ours = two_fits(lambda: nvme_strategy(tmp_path))
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5) and len(ours.losses) == 4
    stores = [p for p in tmp_path.iterdir() if p.name.startswith(STORE_DIR)]
    assert len(stores) <= 1  # the second strategy's store (still held by the module); the first one's is removed
    holder = holder_of(ours)
    assert holder is not None and holder.engine is not None
    for n, p in ours.named_parameters():
        q = dict(plain.named_parameters())[n]
        assert torch.allclose(holder.engine.read_param(p), q.detach(), rtol=1e-5, atol=1e-7), n
    holder.close()
    assert not any(p.name.startswith(STORE_DIR) and any(p.iterdir()) for p in tmp_path.iterdir())


def test_weights_edited_after_fit_are_what_save_checkpoint_writes(tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "nvme").mkdir()
    lm, tr = fit(nvme_strategy(tmp_path / "nvme", limit=8 * 2**20), steps=2)  # small: materialized after fit
    assert tr.strategy.engine.params.materialized
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(0.5)
    tr.save_checkpoint(tmp_path / "ck")
    sd = load_file(tmp_path / "ck" / "model" / "model.safetensors")
    assert torch.equal(sd["lm_head.weight"], lm.model.lm_head.weight.detach())
    tr.strategy.close()


def test_kept_files_are_replaced_with_a_message_that_says_so(tmp_path, caplog):
    st = NVMeStore(tmp_path, [(1024, 1024)], HostBudget(2**20), keep_files=True)
    with st.hold(0, ["master"], write=True, fresh=["master"]):
        pass
    st.close()
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning.store.nvme"):
        NVMeStore(tmp_path, [(1024, 1024)], HostBudget(2**20)).close()
    assert "files an earlier run kept (keep_nvme_files=True)" in caplog.text and "did not finish" not in caplog.text


# ---------------------------------------------------------------- lock
HOLDER = textwrap.dedent("""
    import sys, time
    from megatrain_lightning.store.budget import HostBudget
    from megatrain_lightning.store.nvme import NVMeStore
    st = NVMeStore(sys.argv[1], [(1024, 1024)], HostBudget(2**20))
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_dropped_trainer_does_not_block_the_next_run_on_its_store(tmp_path):
    """Two NVMe runs one after the other in one process (a notebook), the first Trainer dropped: its strategy,
    engine and store hold reference cycles, so until the cyclic GC ran the second run was refused with "still open in
    this process ... Call trainer.strategy.close() on that run", a Trainer the user no longer has. Now the store
    collects such a run and goes on; the second run trains exactly like the RAM tier."""
    import gc

    gc.collect()
    gc.disable()  # the collector would otherwise run at a moment of its own choosing
    try:
        def dropped():
            lm, tr = fit(nvme_strategy(tmp_path), steps=2)
            return lm.losses

        first = dropped()
        second, tr = fit(nvme_strategy(tmp_path), steps=2)
    finally:
        gc.enable()
    ram, _ = fit(MegaTrainStrategy(), steps=2)
    assert first == ram.losses
    assert_bitwise(second, ram)
    tr.strategy.close()


def test_second_live_run_is_refused_and_killed_run_is_reset(tmp_path, caplog):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         preexec_fn=dies_with_this_process())
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(NVMeStoreLockedError, match=f"in use by another live run \\(pid {p.pid}\\)"):
            NVMeStore(tmp_path, [(1024, 1024)], HostBudget(2**20))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert list((tmp_path / STORE_DIR).glob("block_*.bin"))  # the killed run left its files
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning.store.nvme"):
        st = NVMeStore(tmp_path, [(1024, 1024)], HostBudget(2**20))
    assert f"left by a run that did not finish (pid {p.pid}); resetting it" in caplog.text
    st.close()


# ---------------------------------------------------------------- faults
@pytest.mark.parametrize("op,err", [("_pwrite", errno.ENOSPC), ("_pread", errno.EIO)])
def test_io_fault_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, op, err):
    store_dir, ckpt_dir = tmp_path / "nvme", tmp_path / "ckpt"
    store_dir.mkdir()
    real = getattr(nvme_mod, op)
    calls = {"n": 0, "armed": False}

    def faulty(fd, buf, off):
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(err, os.strerror(err))
        return real(fd, buf, off)

    class Arm(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 4:
                calls["armed"] = True  # the checkpoint of step 4 is complete

    monkeypatch.setattr(nvme_mod, op, faulty)
    cb = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(NVMeIOError) as info:
        fit(nvme_strategy(store_dir), steps=10, callbacks=[cb, Arm()])
    msg = str(info.value)
    assert ("write of" if op == "_pwrite" else "read of") in msg and "block_" in msg and os.strerror(err) in msg
    monkeypatch.setattr(nvme_mod, op, real)
    # the newest complete checkpoint loads and training resumes from it (RAM tier)
    last = max((p for p in ckpt_dir.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
    assert last.name == "epoch=0-step=4.ckpt"
    resumed, _ = fit(MegaTrainStrategy(), steps=6, ckpt_path=str(last))
    assert len(resumed.losses) == 2


# ---------------------------------------------------------------- checkpoints across tiers
@pytest.mark.parametrize("first,second", [("nvme", "ram"), ("ram", "nvme")])
def test_checkpoint_resumes_on_the_other_tier(tmp_path, first, second):
    def strat(kind, sub):
        if kind == "ram":
            return MegaTrainStrategy()
        (tmp_path / sub).mkdir(exist_ok=True)
        return nvme_strategy(tmp_path / sub)

    full, _ = fit(MegaTrainStrategy(), steps=8, accumulate=2, data=loader())
    a, ta = fit(strat(first, "a"), steps=3, accumulate=2, data=loader())  # mid-epoch (12 batches per epoch)
    ta.save_checkpoint(tmp_path / "ckpt")
    b, _ = fit(strat(second, "b"), steps=8, accumulate=2, ckpt_path=str(tmp_path / "ckpt"), data=loader())
    assert a.losses + b.losses == full.losses
    for (n, p), (_, q) in zip(b.named_parameters(), full.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n


def test_generation_streams_when_weights_are_only_on_disk(tmp_path):
    from megatrain_lightning.recipes_lib.run import inference_weights

    lm, tr = fit(nvme_strategy(tmp_path), steps=2)
    eng = tr.strategy.engine
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    with inference_weights(tr) as dev:  # 4 B/param fit the budget: the module holds the weights
        assert dev is None
        plain = lm.model.eval().generate(ids, **kw)
    eng.params.dematerialize()  # as for a model larger than host_memory_limit: placeholders only
    assert all(p.stride() == (0,) * p.dim() for p in lm.model.parameters())
    with inference_weights(tr) as dev:
        streamed = lm.model.generate(ids.to(dev), **kw)
    assert torch.equal(plain, streamed)
    tr.strategy.close()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_nvme_tier_mixed_precision_is_bitwise_equal_to_ram_tier(tmp_path, precision):
    """With masters on disk the wire image is cast from the window at every fetch (no resident shadow):
    same layout (bf16 for the weights autocast casts, fp32 for embeddings and norms under bf16-mixed),
    same bytes on the link, same results as the RAM tier's cached shadow, within the host budget."""
    # cpu_zero_copy=False: the NVMe tier copies every block (its engine turns zero-copy off); the RAM tier's CPU
    # default would bind the all-fp32 slabs instead and copy (and count in h2d_bytes) fewer bytes
    ram, t_ram = fit(MegaTrainStrategy(cpu_zero_copy=False), model_kw=DEEP, precision=precision)
    disk, tr = fit(nvme_strategy(tmp_path), model_kw=DEEP, precision=precision)
    assert_bitwise(ram, disk)
    engine = tr.strategy.engine
    assert engine.wire_layouts == t_ram.strategy.engine.wire_layouts
    assert not engine.fetcher.shadows  # the NVMe tier casts at each fetch: no resident wire image
    h2d = lambda t: [h["megatrain/h2d_bytes"] for h in t.strategy.engine.history]  # noqa: E731
    assert h2d(tr) == h2d(t_ram)
    assert max(h["megatrain/host_budget_peak_bytes"] for h in engine.history) <= LIMIT
    assert all(h["megatrain/cast_s"] > 0 for h in engine.history)


def test_a_read_only_nvme_path_is_named_as_such(tmp_path, monkeypatch):
    """A directory on a read-only mount is named as such, not as "not writable by this user. Fix its permissions"
    (which misleads root, whose permissions are not the cause)."""
    from megatrain_lightning.store.nvme import preflight_nvme

    real = os.statvfs

    class ReadOnly:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, k):
            return os.ST_RDONLY | self._st.f_flag if k == "f_flag" else getattr(self._st, k)

    monkeypatch.setattr(os, "access", lambda p, mode: False)
    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly(real(p)))
    with pytest.raises(ValueError, match="is on a read-only filesystem \\(mounted ro\\)"):
        preflight_nvme(tmp_path, [(16, 16)], 1 << 30, 1 << 20)


def test_the_finalizer_of_an_unreachable_store_does_not_join_its_threads(tmp_path):
    """A garbage collection can run ``NVMeStore.__del__`` inside threading's own bookkeeping (a thread starting,
    holding ``threading._shutdown_locks_lock``); joining the I/O threads there waited for that same lock forever
    (a whole test run hung in ``Thread.start``). Run in a child process with a time limit: the finalizer called
    with that lock held returns, and the store's files are gone."""
    script = textwrap.dedent(f"""
        import threading
        from megatrain_lightning.store.budget import HostBudget
        from megatrain_lightning.store.nvme import NVMeStore
        st = NVMeStore({str(tmp_path)!r}, [(3000, 2000), (1024, 0)], HostBudget(4 * 12288), io_block_size=4096)
        with st.hold(0, ["master"], write=True) as t:
            t["master"].fill_(1.0)
        st.wait_io()  # an unreachable store has no I/O queued (a queued request references it)
        with threading._shutdown_locks_lock:  # as during a thread's start
            st.__del__()
        print("closed", st.closed)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "closed True" in out.stdout, out.stderr[-2000:]
    assert not list(tmp_path.rglob("*.bin"))
