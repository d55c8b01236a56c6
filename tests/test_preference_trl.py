"""The preference losses against TRL's own code on the same log-probabilities.

TRL computes its DPO-family losses inside ``DPOTrainer._compute_loss`` (after a model call) and SimPO inside
``CPOTrainer.cpo_loss``; neither is a free function. The tests run those methods on a stand-in trainer whose model
returns given per-token log-probs, so TRL's arithmetic (length normalisation, rewards, reward metrics) is the
reference. TRL is in the ``test`` extra.
"""

from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from megatrain_lightning.preference.losses import preference_loss, sft_nll

trl = pytest.importorskip("trl", reason="TRL is in the test extra (pip install -e .[test])")

B, T = 4, 12


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(completion mask ``[2B, T]``, per-token policy log-probs ``[2B, T-1]`` zero outside the shifted mask,
    reference summed log-probs ``[2B]``, response lengths ``[2B]``); rows ``[:B]`` chosen, ``[B:]`` rejected."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 6, (2 * B,), generator=g)
    length = torch.randint(1, T - 6, (2 * B,), generator=g)
    pos = torch.arange(T)
    mask = ((pos >= prompt[:, None]) & (pos < (prompt + length)[:, None])).long()
    per_token = -torch.rand(2 * B, T - 1, generator=g) * 3 * mask[:, 1:]
    ref = per_token.sum(1) + torch.randn(2 * B, generator=g)
    return mask, per_token, ref, mask.sum(1)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_and_ipo_equal_trl_dpo_trainer(loss_type: str, beta: float):
    mask, per_token, ref, n = _batch(seed=int(beta * 10) + len(loss_type))
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    metrics: dict = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    theirs = trl.DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, return_outputs=False)

    pol = per_token.sum(1)
    losses, chosen, rejected = preference_loss(loss_type, pol[:B], pol[B:], ref[:B], ref[B:], n[:B], n[B:], beta)
    torch.testing.assert_close(losses.mean(), theirs, rtol=1e-6, atol=0)
    m = metrics["train"]
    assert chosen.mean().item() == pytest.approx(m["rewards/chosen"][0], rel=1e-6)
    assert rejected.mean().item() == pytest.approx(m["rewards/rejected"][0], rel=1e-6)
    assert (chosen - rejected).mean().item() == pytest.approx(m["rewards/margins"][0], rel=1e-6)
    assert (chosen > rejected).float().mean().item() == m["rewards/accuracies"][0]


@pytest.mark.parametrize("weight", [0.5, 1.0])
def test_the_sft_term_equals_trl_dpo_trainer_sigmoid_plus_sft(weight: float):
    """``sft_weight``: TRL's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, weight]``."""
    beta = 0.1
    mask, per_token, ref, n = _batch(seed=int(weight * 10))
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    metrics: dict = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid", "sft"],
        loss_weights=[1.0, weight], beta=beta, use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    theirs = trl.DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, return_outputs=False)

    pol = per_token.sum(1)
    losses, _, _ = preference_loss("sigmoid", pol[:B], pol[B:], ref[:B], ref[B:], n[:B], n[B:], beta)
    torch.testing.assert_close(losses.mean() + weight * sft_nll(pol[:B], n[:B]), theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (2.5, 1.4)])
def test_simpo_equals_trl_cpo_trainer(beta: float, gamma: float):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOTrainer

    _, per_token, _, n = _batch(seed=7)
    pol = per_token.sum(1)
    trainer = SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=gamma, label_smoothing=0.0, loss_type="simpo",
                              accelerator=_Accelerator())
    # CPOTrainer averages the log-probs over the response for SimPO (average_log_prob) before cpo_loss
    theirs, their_chosen, their_rejected = CPOTrainer.cpo_loss(trainer, pol[:B] / n[:B], pol[B:] / n[B:])

    losses, chosen, rejected = preference_loss("simpo", pol[:B], pol[B:], None, None, n[:B], n[B:], beta, gamma)
    torch.testing.assert_close(losses, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chosen, their_chosen, rtol=1e-6, atol=0)
    torch.testing.assert_close(rejected, their_rejected, rtol=1e-6, atol=0)
