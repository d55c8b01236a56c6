"""Tensors Hugging Face records inside a decoder layer train through the streamed blocks
(engine/recorded_outputs.py): Mixtral's router logits (``output_router_logits=True``, the load-balancing
loss added to the loss) and the attention weights (``output_attentions=True``) in a user's loss, against
plain PyTorch on the same model, with accumulation and norm clipping, under every recompute mode.

Before, those tensors reached the loss without a gradient (the block runs its forward without a graph):
the router gates' gradients were 5-100% off and the loss diverged from step 2 (then the option was refused)."""

from __future__ import annotations

import copy
import types

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.engine import recorded_outputs
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model, padded_data, reference_train

STEPS, ACC, CLIP = 4, 2, 0.5


def _fit_against_plain(model, extra_inputs=None, data=make_data, **strategy_kw):
    ref = copy.deepcopy(model)
    lm = LM(model, extra_inputs=extra_inputs)
    torch.manual_seed(0)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(**strategy_kw), accelerator="cpu", devices=1, max_steps=STEPS,
                         accumulate_grad_batches=ACC, gradient_clip_val=CLIP, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, data(n=STEPS * ACC * 2))
    torch.manual_seed(0)
    ref_losses = reference_train(ref, data(n=STEPS * ACC * 2), STEPS, accumulate=ACC, clip=CLIP,
                                 extra_inputs=extra_inputs)
    assert_parity(lm.model, ref, lm.losses, ref_losses)
    return lm


@pytest.mark.parametrize("kw", [{}, dict(recompute="selective"), dict(recompute="none"), dict(recompute="auto"),
                                dict(recompute_every=2, offload_activations=True), dict(mlp_chunk_size=4),
                                dict(block_group=2)],
                         ids=["block", "selective", "none", "auto", "every2_offload", "mlp_chunks", "group2"])
def test_router_aux_loss_trains_like_plain_pytorch(kw):
    """``config.output_router_logits=True`` with a large coefficient (0.5, so the load-balancing loss moves the
    routers visibly): losses and every weight (router gates included) within 1e-5 of plain PyTorch."""
    _fit_against_plain(make_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5), **kw)


def test_router_aux_loss_with_an_attention_mask_over_mlp_chunks():
    """``mlp_chunk_size`` runs the MoE block (its router included) once per chunk of tokens; the load-balancing
    loss weighs each layer's ``[B*T, E]`` router logits by the ``[B*T]`` attention mask. The chunks' logits are
    put back in one tensor per layer: padded batches train like plain PyTorch (before: a shape error in
    ``load_balancing_loss_func``, as soon as the batch had an attention mask)."""
    _fit_against_plain(make_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5), data=padded_data,
                       mlp_chunk_size=4)


def test_router_logits_requested_per_call_train_too():
    """``model(..., output_router_logits=True)`` on a model whose config leaves it off: the same."""
    _fit_against_plain(make_model("mixtral", router_aux_loss_coef=0.5),
                       extra_inputs=lambda batch: {"output_router_logits": True})


class _AttentionPenalty(torch.nn.Module):
    """A causal LM whose loss adds a penalty on its attention weights (read from ``outputs.attentions``)."""

    def __init__(self, model):
        super().__init__()
        self.lm = model

    def forward(self, **kw):
        out = self.lm(**kw, output_attentions=True)
        penalty = torch.stack([a.pow(2).mean() for a in out.attentions]).sum()
        return types.SimpleNamespace(loss=out.loss + 0.5 * penalty, attentions=out.attentions)


def test_attention_weights_in_the_loss_train_like_plain_pytorch():
    """``output_attentions=True`` in training, the attention weights in the loss: same losses and weights."""
    _fit_against_plain(_AttentionPenalty(make_model("llama")))


def test_without_the_recorder_the_aux_loss_is_refused(monkeypatch):
    """If transformers stops providing its output collector (a future version), the load-balancing loss would
    silently train nothing again (or, with the block forward recorded in grad mode, fail mid-backward): refused at
    setup, naming the option, even with a zero coefficient (the model still multiplies the aux loss by it); with
    output_router_logits=False it trains."""
    monkeypatch.setattr(recorded_outputs, "_active_collector", None)

    def fit(logits: bool, coef: float) -> LM:
        lm = LM(make_model("mixtral", output_router_logits=logits, router_aux_loss_coef=coef))
        pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
                   ).fit(lm, make_data(n=4))
        return lm

    for coef in (0.02, 0.0):
        with pytest.raises(RuntimeError, match="output_router_logits"):
            fit(True, coef)
    assert len(fit(False, 0.02).losses) == 1
