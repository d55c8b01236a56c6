"""Block groups (``block_group``): consecutive decoder layers fetched as one transfer unit give the same
numbers as single blocks, with fewer H2D worker tasks and no block copied in vain."""

from __future__ import annotations

import copy
import re

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.blocks import discover_blocks
from megatrain_lightning.engine.block_groups import GroupSchedule, form_groups
from megatrain_lightning.testing import LM, assert_parity, freeze_key_biases, make_data, make_model, reference_train

STEPS, ACC, CLIP = 3, 2, 0.5
DROPOUT = dict(resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)


def _model(arch: str, layers: int = 5):
    extra: dict = {"num_hidden_layers": layers}
    if arch == "gemma2":  # its config lists each layer's attention kind
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if arch == "gpt2_dropout":  # dropout's RNG is replayed by the recompute: the same masks in every grouping
        arch, extra = "gpt2", {"n_layer": layers, **DROPOUT}
    model = make_model(arch, **extra)
    freeze_key_biases(model)
    return model


def _fit(model, steps=STEPS, **strategy_kw):
    lm = LM(model)
    torch.manual_seed(0)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(**strategy_kw), accelerator="cpu", devices=1, max_steps=steps,
                         accumulate_grad_batches=ACC, gradient_clip_val=CLIP, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, make_data(n=steps * ACC * 2))
    return lm, trainer.strategy.engine


def _totals(engine, key: str) -> float:
    return sum(h[f"megatrain/{key}"] for h in engine.history)


def _assert_same(a, b):
    assert a.losses == b.losses
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("mode", ["block", "none"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2_dropout", "mixtral"])
def test_groups_give_the_numbers_of_single_blocks(arch, mode):
    """5 decoder layers in groups of 2 (2 + 2 + 1), accumulation 2 + norm clipping: bitwise the run with
    single blocks and within the parity tolerance of plain PyTorch; one H2D task serves two layers."""
    model = _model(arch)
    ref = copy.deepcopy(model)
    single, e1 = _fit(copy.deepcopy(model), recompute=mode)
    grouped, e2 = _fit(model, recompute=mode, block_group=2)
    _assert_same(single, grouped)
    torch.manual_seed(0)
    ref_losses = reference_train(ref, make_data(n=STEPS * ACC * 2), STEPS, accumulate=ACC, clip=CLIP)
    assert_parity(grouped.model, ref, grouped.losses, ref_losses)
    assert _totals(e2, "blocks_fetched") == _totals(e1, "blocks_fetched")  # no block copied in vain
    assert _totals(e2, "weight_transfers") < _totals(e1, "weight_transfers")
    assert _totals(e1, "weight_transfers") == _totals(e1, "blocks_fetched")


@pytest.mark.parametrize("kw", [dict(recompute_every=2), dict(offload_activations=True, recompute="selective"),
                                dict(lookahead=2, cpu_zero_copy=False), dict(lookahead=0)])
def test_groups_with_segments_offload_and_lookahead(kw):
    """Recompute chains (a segment's recompute fetches a layer twice), offloaded inputs, deeper and no
    prefetch: groups of 3 change nothing in the numbers, and no fetch copies a layer it does not serve."""
    model = _model("llama", layers=7)
    single, e1 = _fit(copy.deepcopy(model), **kw)
    grouped, e2 = _fit(model, block_group=3, **kw)
    _assert_same(single, grouped)
    assert _totals(e2, "blocks_fetched") == _totals(e1, "blocks_fetched")
    assert _totals(e2, "weight_transfers") < _totals(e1, "weight_transfers")


def test_groups_on_the_nvme_tier_at_its_smallest_window(tmp_path):
    """Masters and AdamW states on disk, ``host_memory_limit`` at the minimum preflight asks for with groups
    of 2 (the window holds a group's fetch ahead): bitwise the RAM tier with single blocks."""
    model = _model("llama")
    ram, _ = _fit(copy.deepcopy(model))
    nvme = dict(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), block_group=2)
    with pytest.raises(ValueError, match="lower lookahead or block_group") as err:
        _fit(copy.deepcopy(model), host_memory_limit=100_000, **nvme)
    need = int(re.search(r"Raise host_memory_limit to at least (\d+) bytes", str(err.value)).group(1))
    disk, _ = _fit(model, host_memory_limit=need, **nvme)
    _assert_same(ram, disk)


def test_only_consecutive_decoder_layers_are_grouped():
    """The tied embedding / LM head, gpt2's position embedding and the final norm stay alone."""
    for arch, attr in (("llama_tied", "num_hidden_layers"), ("gpt2", "n_layer")):
        model = make_model(arch, **{attr: 5})
        blocks = discover_blocks(model)
        groups = form_groups(blocks, 2)
        assert sorted(bi for g in groups for bi in g) == [b.index for b in blocks]
        for g in groups:
            if len(g) > 1:
                assert len({type(blocks[bi].module) for bi in g}) == 1
                assert all(blocks[bi].slabs == [bi] for bi in g)
        layers = [g for g in groups if "layers" in blocks[g[0]].name or ".h." in blocks[g[0]].name]
        assert [len(g) for g in layers] == [2, 2, 1], (arch, groups)
        assert all(len(g) == 1 for g in groups if g not in layers)
        assert form_groups(blocks, 1) == [(b.index,) for b in blocks]


def test_schedule_serves_consecutive_members_and_refetches_a_repeated_one():
    s = GroupSchedule([(0,), (1, 2), (3,)])
    seq = [0, 1, 2, 3, 2, 1, 1, 2, 0]
    assert s.run_at(seq, 1) == (1, 2)
    assert s.run_at(seq, 4) == (2, 1)
    assert s.run_at(seq, 6) == (1, 2)  # 1 again: a new fetch
    assert list(s.iter_upcoming(seq, 0, set())) == [(1, 2), (3,), (2, 1), (1, 2), (0,)]
    assert list(s.iter_upcoming(seq, 1, {2})) == [(3,), (2, 1), (1, 2), (0,)]  # 2: served by the open fetch
    assert list(s.iter_upcoming([1, 2, 1, 2], 0, {2})) == [(1, 2)]  # a member used once is not served twice


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_block_group_is_refused_when_the_strategy_is_built(bad):
    with pytest.raises(ValueError, match="block_group must be an int >= 1"):
        MegaTrainStrategy(block_group=bad)
