"""Parity: strategy="megatrain" against plain PyTorch training of the unmodified model.

Every test trains the same tiny random model twice from the same initial weights: once
through Lightning with strategy="megatrain", once with a plain loop and
torch.optim.AdamW (default arguments), and requires for every step
|loss - loss_ref| / |loss_ref| <= 1e-5 and for every parameter
||w - w_ref|| / ||w_ref|| <= 1e-5.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import (ARCHS, LM, assert_parity, freeze_key_biases, make_data, make_model,
                                        reference_train)

STEPS = 20


def _trainer(strategy="megatrain", steps=STEPS, **kw):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def run_pair(arch="llama", accumulate=1, clip=None, sched=None, strategy="megatrain", model_overrides=None,
             freeze=None, opt_kwargs=None, seed=0, clip_value=None, attn="eager"):
    model = make_model(arch, attn=attn, **(model_overrides or {}))
    freeze_key_biases(model)
    if freeze:
        for name, p in model.named_parameters():
            if name in freeze:
                p.requires_grad_(False)
    ref = copy.deepcopy(model)
    lm = LM(model, sched=sched, total_steps=STEPS, opt_kwargs=opt_kwargs)
    kw = {}
    if accumulate > 1:
        kw["accumulate_grad_batches"] = accumulate
    if clip is not None:
        kw["gradient_clip_val"] = clip
    if clip_value is not None:
        kw["gradient_clip_val"] = clip_value
        kw["gradient_clip_algorithm"] = "value"
    torch.manual_seed(seed)
    trainer = _trainer(strategy, **kw)
    trainer.fit(lm, make_data(n=STEPS * accumulate * 2))
    torch.manual_seed(seed)
    ref_losses = reference_train(ref, make_data(n=STEPS * accumulate * 2), STEPS, accumulate=accumulate, clip=clip,
                                 sched=sched, opt_kwargs=opt_kwargs, clip_value=clip_value)
    return lm, ref, ref_losses, trainer


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architectures_match_plain_pytorch(arch):
    lm, ref, ref_losses, _ = run_pair(arch)
    assert len(lm.losses) == STEPS
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_gradient_accumulation():
    lm, ref, ref_losses, _ = run_pair("llama", accumulate=4)
    assert len(lm.losses) == 4 * STEPS
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_norm_clipping_that_really_clips():
    clip = 0.05
    # the threshold must be below the unclipped norm, or the test proves nothing
    probe = make_model("llama")
    (ids,) = next(iter(make_data()))
    probe(input_ids=ids, labels=ids).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(probe.parameters(), float("inf"))
    assert norm > 4 * clip
    lm, ref, ref_losses, _ = run_pair("llama", clip=clip)
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_value_clipping():
    probe = make_model("llama")
    (ids,) = next(iter(make_data()))
    probe(input_ids=ids, labels=ids).loss.backward()
    assert max(p.grad.abs().max().item() for p in probe.parameters()) > 4 * 1e-3  # really clips
    lm, ref, ref_losses, _ = run_pair("llama", clip_value=1e-3)
    assert_parity(lm.model, ref, lm.losses, ref_losses)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_users_attn_implementation_is_kept(attn):
    lm, ref, ref_losses, _ = run_pair("qwen3", attn=attn)
    assert lm.model.config._attn_implementation == attn
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_cosine_schedule():
    lm, ref, ref_losses, trainer = run_pair("llama", sched="cosine")
    assert trainer.optimizers[0].param_groups[0]["lr"] < 1e-4  # the schedule really ran
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_frozen_parameter_gets_no_grad_and_no_state():
    frozen = {"model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"}
    lm, ref, ref_losses, trainer = run_pair("llama", freeze=frozen)
    assert_parity(lm.model, ref, lm.losses, ref_losses)
    opt = trainer.strategy.engine.optimizer
    found = [(slab, i, e) for slab in trainer.strategy.engine.store.slabs for i, e in enumerate(slab.entries)
             if e.ref.fqn in {"model." + f for f in frozen}]  # the LightningModule holds the HF model as .model
    assert len(found) == len(frozen)
    for slab, i, e in found:
        assert not e.trainable and opt.state_for(slab.index, i) is None
    sd = opt.state_dict()
    n_trainable = sum(p.requires_grad for p in lm.parameters())
    assert len(sd["state"]) == n_trainable


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dropout_replays_rng(arch):
    over = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1} if arch == "gpt2" else {"attention_dropout": 0.1}
    lm, ref, ref_losses, _ = run_pair(arch, model_overrides=over)
    assert_parity(lm.model, ref, lm.losses, ref_losses)


@pytest.mark.parametrize("options", [
    dict(overlap_optimizer=False),
    dict(lookahead=0),
    dict(lookahead=3),
    dict(offload_activations=True),
    dict(cpu_zero_copy=False),
    dict(cpu_zero_copy=False, lookahead=2, recompute_every=2),
    dict(recompute_every=2),
    dict(recompute_every=3, lookahead=2),
    dict(recompute_every=4, offload_activations=True),
])
def test_engine_options_do_not_change_results(options):
    lm, ref, ref_losses, _ = run_pair("llama_tied", strategy=MegaTrainStrategy(**options))
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_weight_decay_param_groups():
    """Two param groups (no decay on norms and biases), as most fine-tuning recipes do."""
    model = make_model("qwen2")
    freeze_key_biases(model)
    ref = copy.deepcopy(model)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.requires_grad and p.ndim >= 2]
        no = [p for n, p in m.named_parameters() if p.requires_grad and p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no, "weight_decay": 0.0, "lr": 3e-3}]

    class GroupLM(LM):
        def configure_optimizers(self):
            return torch.optim.AdamW(groups(self.model), lr=1e-3)

    lm = GroupLM(model)
    _trainer().fit(lm, make_data(n=40))
    opt = torch.optim.AdamW(groups(ref), lr=1e-3)
    losses = []
    for (ids,) in make_data(n=40):
        opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
    assert_parity(lm.model, ref, lm.losses, losses)


def test_manual_optimization():
    model = make_model("llama")
    ref = copy.deepcopy(model)

    class ManualLM(LM):
        def __init__(self, m):
            super().__init__(m)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            opt = self.optimizers()
            opt.zero_grad()
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.item())
            self.manual_backward(loss)
            opt.step()

    lm = ManualLM(model)
    _trainer().fit(lm, make_data(n=40))
    ref_losses = reference_train(ref, make_data(n=40), STEPS)
    assert_parity(lm.model, ref, lm.losses, ref_losses)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_recompute_every_k_keeps_one_input_per_segment(k):
    """With recompute_every=K only every K-th block call keeps its hidden-state input."""
    from megatrain_lightning.engine.streaming import StreamingEngine

    model = make_model("llama")  # embed, 3 layers, norm, lm_head: 6 block calls
    eng = StreamingEngine(model, torch.device("cpu"), recompute_every=k)
    eng.install()
    (ids,) = next(iter(make_data()))
    loss = model(input_ids=ids, labels=ids).loss
    calls = eng.boundary.fwd.live_calls()
    # the LM head keeps its graph from the first forward on (the output embedding: no recompute, no saved input)
    assert len(calls) == 5 and len(eng.boundary.kept_open) == 1
    linked = [c.pos for c in calls if c.links]
    # the embedding (call 0) keeps its graph, so segments of K calls start at the first layer (call 1)
    assert linked == [p for p in range(1, 5) if (p - 1) % k != 0]
    loss.backward()
    assert not eng.boundary.fwd.recomputed  # every recomputed input was consumed
    eng.close()


def test_dropout_with_segments():
    over = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    lm, ref, ref_losses, _ = run_pair("gpt2", model_overrides=over, strategy=MegaTrainStrategy(recompute_every=3))
    assert_parity(lm.model, ref, lm.losses, ref_losses)


@pytest.mark.parametrize("k", [1, 2])
def test_prefetch_follows_the_schedule(k):
    """Once the schedule is learned (step 3 on: step 1 learns the order, step 2 the backward without
    the LM head, which keeps its graph), the only fetch not prefetched is the first block of each
    forward (prefetching it earlier would read weights before the optimizer step is recorded)."""
    lm, ref, ref_losses, trainer = run_pair("llama", strategy=MegaTrainStrategy(lookahead=1, recompute_every=k))
    hist = trainer.strategy.engine.history
    assert [h["megatrain/prefetch_misses"] for h in hist[2:]] == [1.0] * (len(hist) - 2)


def test_a_large_fetch_starts_while_small_blocks_compute():
    """A tied embedding 7x a decoder layer: its fetch for the LM head starts while the first layers
    compute (they leave room within 2 largest fetches, what lookahead=1 already needs), not one block
    before its use; the numbers, the bytes moved and the prefetch misses are those of plain lookahead."""
    model = make_model("llama_tied", vocab_size=2048, num_hidden_layers=6)
    ref = copy.deepcopy(model)
    lm = LM(model)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(lookahead=1, cpu_zero_copy=False), accelerator="cpu", devices=1,
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(lm, make_data(n=STEPS * 2))
    assert_parity(lm.model, ref, lm.losses, reference_train(ref, make_data(n=STEPS * 2), STEPS))
    eng = trainer.strategy.engine
    seq = list(range(len(eng.blocks)))  # the forward: embedding, 6 layers, final norm, LM head
    head = (seq[-1],)
    want = eng.prefetcher.wanted(seq, 1, set())
    assert want[0] == (2,) and head in want  # the next layer (lookahead=1), and the LM head at the first layer already
    hist = eng.history
    assert [h["megatrain/prefetch_misses"] for h in hist[2:]] == [1.0] * (len(hist) - 2)
    # per step from the second (the first does not know the last block yet): every block in forward, all
    # but the embedding and the LM head in backward (none in vain)
    assert {h["megatrain/blocks_fetched"] for h in hist[1:]} == {2 * len(seq) - 2}
    # within what the planner counts for lookahead=1: the weights of 2 largest blocks (the kept LM head counts
    # against the room) and the gradients of one (the LM head's, while its backward runs)
    largest = max(sum(eng.store.slabs[si].numel for si in b.slabs) for b in eng.blocks) * 4
    assert max(h["megatrain/peak_device_bytes"] for h in hist) <= 3 * largest


def test_checkpoint_every_still_works_with_a_deprecation_warning():
    """The former name of recompute_every (it collided with Lightning's model checkpoints)."""
    from megatrain_lightning import MegaTrainStrategy

    with pytest.warns(DeprecationWarning, match="recompute_every"):
        s = MegaTrainStrategy(checkpoint_every=3)
    assert s.recompute_every == 3
    with pytest.raises(TypeError, match="both given"):
        MegaTrainStrategy(recompute_every=2, checkpoint_every=3)
