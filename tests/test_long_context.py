"""Long sequences: chunked LM head + loss, chunked MLP, offloaded block
inputs restored one call ahead.

Parity: the same tiny model trained three ways from the same weights, 10 steps with gradient
accumulation 2 and norm clipping that clips: ``strategy="megatrain"`` with the chunking on (chunks
smaller than a micro-batch, so several chunks run), with it off, and plain PyTorch
(``testing.reference_train``); losses and weights within 1e-5 relative. The chunked runs check that
chunking really ran (the training forward's logits are :class:`LazyLogits`).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine.chunked_loss import auto_loss_chunk, causal_lm_loss, chunked_linear_cross_entropy
from megatrain_lightning.engine.chunked_mlp import chunked_call
from megatrain_lightning.engine.head_loss import LazyLogits
from megatrain_lightning.testing import (LM, assert_parity, freeze_key_biases, make_data, make_model, padded_data,
                                        reference_train)

STEPS, ACC, CLIP = 10, 2, 0.05


class _LM(LM):
    """:class:`LM` that records whether each training forward's logits were lazy (chunked)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lazy: list[bool] = []

    def training_step(self, batch, batch_idx):
        from megatrain_lightning.testing import batch_inputs

        extra = self.extra_inputs(batch) if self.extra_inputs is not None else {}
        out = self.model(**batch_inputs(batch), **extra)
        self.lazy.append(isinstance(out.logits, LazyLogits))
        self.losses.append(out.loss.item())
        return out.loss


def _fit(model, data, **strategy):
    lm = _LM(model, extra_inputs=strategy.pop("extra_inputs", None))
    trainer = pl.Trainer(strategy=MegaTrainStrategy(**strategy), accelerator="cpu", devices=1, max_steps=STEPS,
                         accumulate_grad_batches=ACC, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, data())
    return lm, trainer


def _unit_offset_norms(model):
    """A copy of a Gemma model with every RMSNorm weight w replaced by 1 + w, the factor its forward
    multiplies by. Relative errors of w itself (zero at initialisation, ~1e-2 after 10 steps) turn the
    1e-7 reordering differences of the gradients, amplified by Adam's normalisation of near-zero
    gradient components, into >1e-5 (measured: gradients of one step agree to 3e-7 relative)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return model


def _num_items(batch):
    # a count that is not this micro-batch's own (as transformers' Trainer passes the window's count)
    return {"num_items_in_batch": torch.tensor(int((batch[-1][:, 1:] != -100).sum()) + 7)}


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}),
                                            ("gemma2", {}), ("mixtral", {})])
@pytest.mark.parametrize("data_kind", ["plain", "padded"])
def test_chunked_matches_unchunked_and_plain_pytorch(arch, overrides, data_kind):
    data = (lambda: make_data(n=STEPS * ACC * 2)) if data_kind == "plain" else (lambda: padded_data(n=STEPS * ACC * 2))
    extra = _num_items if (data_kind == "padded" and arch in ("llama", "gemma2")) else None
    base = make_model(arch, **overrides)
    freeze_key_biases(base)  # exact gradient 0: trained on rounding noise (testing.freeze_key_biases)
    chunked, _ = _fit(copy.deepcopy(base), data, loss_chunk_size=5, mlp_chunk_size=4, extra_inputs=extra)
    assert all(chunked.lazy) and len(chunked.lazy) == STEPS * ACC  # 32 tokens > 5: the chunked path ran
    full, _ = _fit(copy.deepcopy(base), data, loss_chunk_size=None, extra_inputs=extra)
    assert not any(full.lazy)
    ref = copy.deepcopy(base)
    ref_losses = reference_train(ref, data(), STEPS, accumulate=ACC, clip=CLIP, extra_inputs=extra)
    if arch == "gemma2":  # Gemma's RMSNorm scales by 1 + w, w initialised at 0: compare the scale the model uses
        chunked.model, full.model, ref = (_unit_offset_norms(m) for m in (chunked.model, full.model, ref))
    assert_parity(chunked.model, full.model, chunked.losses, full.losses)
    assert_parity(chunked.model, ref, chunked.losses, ref_losses)
    assert chunked.losses != full.losses or data_kind == "padded"  # another summation order, not the same code


def test_chunked_function_equals_full_cross_entropy_and_gradients():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[::5] = -100
    cap = 3.0
    transform = (lambda x: x / cap, torch.tanh, lambda x: x * cap)
    got = chunked_linear_cross_entropy(h, w, b, t, chunk=8, transform=transform)
    gh, gw, gb = torch.autograd.grad(got * 0.3, (h, w, b))
    want = F.cross_entropy(torch.tanh(F.linear(h, w, b) / cap) * cap, t, reduction="sum")
    wh, ww, wb = torch.autograd.grad(want * 0.3, (h, w, b))
    for x, y in ((got, want), (gh, wh), (gw, ww), (gb, wb)):  # sums over tokens (and matmul blocking): another order
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_causal_lm_loss_shift_mean_and_num_items_match_transformers():
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(1)
    h = torch.randn(2, 9, 8)
    w = torch.randn(20, 8)
    labels = torch.randint(0, 20, (2, 9))
    labels[1, 6:] = -100
    logits = F.linear(h, w)
    for n in (None, torch.tensor(11)):
        got = causal_lm_loss(h, w, None, labels, chunk=4, num_items_in_batch=n)
        want = ForCausalLMLoss(logits, labels, vocab_size=20, num_items_in_batch=n)
        assert torch.allclose(got, want, rtol=1e-6), (n, got, want)


def test_bf16_autocast_gradients_within_bf16_rounding_of_full():
    torch.manual_seed(2)
    h = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(100, 32, requires_grad=True)
    t = torch.randint(0, 100, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_linear_cross_entropy(h, w, None, t, chunk=16)
        want = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    gh, gw = torch.autograd.grad(got, (h, w))
    wh, ww = torch.autograd.grad(want, (h, w))
    assert torch.allclose(got, want, rtol=1e-5)
    assert torch.allclose(gh, wh, rtol=1e-2, atol=1e-3)  # per-token rows: the same bf16 steps, matmul blocking aside
    assert (gw - ww).norm() / ww.norm() < 1e-2  # sums over tokens: one bf16 rounding of a reordered fp32 sum


def test_chunked_mlp_call_matches_whole_and_refuses_non_token_outputs():
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8))
    x = torch.randn(2, 13, 8, requires_grad=True)
    got = chunked_call(mlp, x, 4)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    want = mlp(x)
    (wx,) = torch.autograd.grad(want.square().sum(), x)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(gx, wx, atol=1e-6)
    with pytest.raises(RuntimeError, match="mlp_chunk_size"):
        chunked_call(lambda c: c.sum(1), x, 4)


def test_logits_are_real_without_labels_under_no_grad_and_when_short():
    model = make_model("gemma2")
    ref = copy.deepcopy(model)
    lm = _LM(model)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(loss_chunk_size=5), accelerator="cpu", devices=1, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, make_data(n=4))
    ref_losses = reference_train(ref, make_data(n=4), 1)
    assert lm.lazy == [True] and abs(lm.losses[0] - ref_losses[0]) <= 1e-5 * ref_losses[0]
    (ids,) = next(iter(make_data(n=2)))
    engine = trainer.strategy.engine
    engine.install()
    try:
        with torch.no_grad():  # validation / predict: real logits, the ones plain PyTorch gives
            out = lm.model(input_ids=ids, labels=ids)
            want = ref(input_ids=ids, labels=ids)
        assert not isinstance(out.logits, LazyLogits)
        assert torch.allclose(out.logits, want.logits, atol=1e-5) and torch.allclose(out.loss, want.loss, rtol=1e-5)
        out = lm.model(input_ids=ids)  # grad mode, no labels
        assert not isinstance(out.logits, LazyLogits) and out.logits.shape == (2, 16, 96)
        out = lm.model(input_ids=ids[:, :2], labels=ids[:, :2])  # 4 tokens <= 5: not chunked
        assert not isinstance(out.logits, LazyLogits)
        out = lm.model(input_ids=ids, labels=ids)
        assert isinstance(out.logits, LazyLogits)
        with pytest.raises(RuntimeError, match="loss_chunk_size=None"):
            out.logits.argmax(-1)
        out.loss.backward()
    finally:
        engine.uninstall()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "big"])
def test_bad_chunk_sizes_are_refused_at_construction(bad):
    with pytest.raises(ValueError, match="loss_chunk_size must be a positive int"):
        MegaTrainStrategy(loss_chunk_size=bad)
    with pytest.raises(ValueError, match="mlp_chunk_size must be a positive int"):
        MegaTrainStrategy(mlp_chunk_size=bad)
    with pytest.raises(ValueError, match="mlp_chunk_size"):
        MegaTrainStrategy(mlp_chunk_size="auto")


def test_auto_chunk_keeps_logits_under_256_mib():
    assert auto_loss_chunk(128256) == 523 and 523 * 128256 * 4 <= 256 * 2**20
    assert auto_loss_chunk(32000) == 2097 and auto_loss_chunk(10**9) == 1


def test_custom_loss_function_is_left_alone_with_a_log_line(caplog):
    model = make_model("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()
    lm = _LM(model)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(loss_chunk_size=5), accelerator="cpu", devices=1, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level("INFO", logger="megatrain_lightning.engine.head_loss"):
        trainer.fit(lm, make_data(n=2))
    assert lm.lazy == [False]
    assert "computes its full logits and loss" in caplog.text and "ForCausalLMLoss" in caplog.text


@pytest.mark.parametrize("recompute_every", [1, 2])
def test_offloaded_inputs_are_restored_one_call_ahead(recompute_every):
    model = make_model("llama", num_hidden_layers=6)
    ref = copy.deepcopy(model)
    lm = _LM(model)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(offload_activations=True, recompute_every=recompute_every),
                         accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, make_data(n=6))
    ref_losses = reference_train(ref, make_data(n=6), 3)
    assert_parity(lm.model, ref, lm.losses, ref_losses)
    hist = trainer.strategy.engine.history
    one_input = 2 * 16 * 32 * 4  # batch x seq x hidden x fp32: the hidden states a layer call keeps
    for step in hist[1:]:  # from the second step the last block's graph is kept and starts the chain
        assert step["megatrain/activation_restore_misses"] == 0
    for step in hist:
        # at most the call in backward and the next one; never all 6 layers'
        assert step["megatrain/activation_restored_peak_bytes"] <= 2 * one_input
    assert hist[0]["megatrain/activation_restore_misses"] <= 1


def test_chunked_mlp_backward_recomputes_with_the_weights_bound_at_its_forward():
    # the engine binds a block's parameters to device views / gradient leaves only for the block's call;
    # the checkpointed chunks are recomputed later, inside autograd.grad, and must use those same tensors
    torch.manual_seed(4)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU(), torch.nn.Linear(8, 4))
    leaf = (mlp[0].weight.detach() * 2).requires_grad_(True)
    x = torch.randn(1, 6, 4)
    host = mlp[0]._parameters["weight"]
    mlp[0]._parameters["weight"] = leaf
    y = chunked_call(mlp, x, 2, mlp)
    want = mlp(x)
    mlp[0]._parameters["weight"] = host  # the block call is over
    (g,) = torch.autograd.grad(y.square().sum(), leaf)
    (wg,) = torch.autograd.grad(want.square().sum(), leaf)
    assert torch.allclose(y, want, atol=1e-6) and torch.allclose(g, wg, atol=1e-5)


@pytest.mark.parametrize("arch,overrides,random", [("gpt2", dict(resid_pdrop=0.1), True), ("gpt2", {}, False),
                                                   ("llama", {}, False)])
def test_mlp_chunks_warn_when_the_mlp_draws_random_numbers(caplog, arch, overrides, random):
    """Over chunks, an MLP's dropout (GPT-2's ``resid_pdrop``) or router jitter (PhiMoE) draws its random numbers
    per chunk, in another order than plain PyTorch: training is not the same numbers then (GPT-2 with dropout 0.1:
    weights 47% apart after 4 steps). A warning names the module and the option;
    MLPs without random ops (exact parity, tested above) get none."""
    import logging

    lm = LM(make_model(arch, **overrides))
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning"):
        pl.Trainer(strategy=MegaTrainStrategy(mlp_chunk_size=4), accelerator="cpu", devices=1, max_steps=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False).fit(lm, make_data(n=2))
    warned = [r.getMessage() for r in caplog.records if "draws random numbers" in r.getMessage()]
    assert len(warned) == (1 if random else 0)
    if random:
        assert "Dropout(p=0.1)" in warned[0] and "mlp_chunk_size=None" in warned[0]


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_models_keep_their_own_loss(name):
    """T5 and BART compute their own ``CrossEntropyLoss`` on the full logits (``lm_logits.view(...)``, BART adds
    ``final_logits_bias``) although transformers maps them to ``ForCausalLMLoss``: with labels longer than the loss
    chunk they crashed at the first large batch ("'view' needs the values of logits that were not materialised").
    Now left unchunked at install: they train, with plain Lightning's numbers."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                          num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
                                                          pad_token_id=0, dropout_rate=0.0))
    else:
        model = tf.BartForConditionalGeneration(tf.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                              encoder_attention_heads=4, decoder_attention_heads=4,
                                                              encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(2, 64, (8, 12), generator=g),
                                                                      torch.randint(2, 64, (8, 20), generator=g)), batch_size=2)

    class Seq2Seq(pl.LightningModule):
        def __init__(self, m):
            super().__init__()
            self.model, self.losses = m, []

        def training_step(self, batch, i):
            loss = self.model(input_ids=batch[0], labels=batch[1]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    runs = []
    for strategy in ("auto", MegaTrainStrategy(loss_chunk_size=8)):  # 2 x 20 labels > 8: chunking would have run
        lm = Seq2Seq(copy.deepcopy(model))
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(lm, data)
        runs.append(lm)
    assert_parity(runs[1].model, runs[0].model, runs[1].losses, runs[0].losses)


def test_causal_lm_loss_off_the_cpu_reads_no_label_on_the_host(monkeypatch):
    """The path a non-CPU device takes (``drop_ignored=False``: ignored tokens through the head, the count of the
    mean a tensor) reads no value on the host (``nonzero``, ``item``, ``tolist`` or a tensor's truth value would
    make the host wait for the device) and gives transformers' loss and gradients, ignored tokens' exactly zero."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(1)
    h = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (2, 9))
    labels[1, 3:] = -100
    labels[0, 0] = -100
    want = ForCausalLMLoss(torch.nn.functional.linear(h, w), labels, vocab_size=20)
    wh, ww = torch.autograd.grad(want, (h, w))
    ignored = (F.pad(labels, (0, 1), value=-100)[..., 1:] == -100).reshape(-1)

    def host_read(*args, **kwargs):
        raise AssertionError("a value read on the host")

    for drop in (True, False):
        with monkeypatch.context() as m:
            if not drop:
                for name in ("nonzero", "item", "tolist", "__bool__"):
                    m.setattr(torch.Tensor, name, host_read)
                m.setattr(torch, "nonzero", host_read)
            got = causal_lm_loss(h, w, None, labels, chunk=4, drop_ignored=drop)
            gh, gw = torch.autograd.grad(got, (h, w))
        assert torch.allclose(got, want, rtol=1e-6), drop
        assert torch.allclose(gh, wh, rtol=1e-5, atol=1e-7) and torch.allclose(gw, ww, rtol=1e-5, atol=1e-7), drop
        assert torch.equal(gh.reshape(-1, 8)[ignored], torch.zeros(int(ignored.sum()), 8)), drop
