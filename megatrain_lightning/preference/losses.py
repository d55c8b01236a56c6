"""Preference losses over per-sequence log-probabilities: DPO, IPO and the reference-free SimPO.

Inputs are, per preference pair, the *summed* log-probabilities of the response tokens under the policy
(``pol_c``, ``pol_r``: chosen, rejected) and the reference (``ref_c``, ``ref_r``), and the response lengths in
tokens (``n_c``, ``n_r``); all ``[B]``, float32 (lengths any numeric dtype). Each loss returns the per-pair
losses ``[B]`` and the chosen and rejected rewards ``[B]``. The formulas follow the papers as TRL implements
them (``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``, TRL 1.16): DPO on summed log-ratios, IPO on
length-normalised log-ratios, rewards ``beta`` x summed log-ratio for both; SimPO (TRL's ``CPOTrainer`` with
``loss_type="simpo"``) on length-normalised policy log-probs, rewards ``beta`` x those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "simpo")
"""Loss types: ``"sigmoid"`` (DPO), ``"ipo"``, ``"simpo"`` (needs no reference model)."""

Losses = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def dpo_sigmoid(pol_c: torch.Tensor, pol_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
                beta: float) -> Losses:
    """DPO (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``.

    Returns: (losses, chosen rewards ``beta * (pi_c - ref_c)``, rejected rewards ``beta * (pi_r - ref_r)``)."""
    chosen, rejected = beta * (pol_c - ref_c), beta * (pol_r - ref_r)
    return -F.logsigmoid(chosen - rejected), chosen, rejected


def ipo(pol_c: torch.Tensor, pol_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, n_c: torch.Tensor,
        n_r: torch.Tensor, beta: float) -> Losses:
    """IPO (Azar et al. 2023, eq. 17): ``(h - 1 / (2 * beta))**2`` with ``h`` the difference of the chosen and rejected
    log-ratios, each divided by its response length (as TRL, confirmed there with the paper's authors; ``beta`` is
    the paper's tau).

    Returns: (losses, ``beta * (pi_c - ref_c)``, ``beta * (pi_r - ref_r)`` on summed log-probs, as TRL logs them)."""
    h = (pol_c - ref_c) / n_c.clamp(min=1) - (pol_r - ref_r) / n_r.clamp(min=1)
    return (h - 1.0 / (2.0 * beta)) ** 2, beta * (pol_c - ref_c), beta * (pol_r - ref_r)


def simpo(pol_c: torch.Tensor, pol_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor, beta: float,
          gamma: float) -> Losses:
    """SimPO (Meng et al. 2024, eq. 6): ``-log sigmoid(beta * pi_c / n_c - beta * pi_r / n_r - gamma)``, without a
    reference model. ``gamma`` is the target reward margin (TRL's ``simpo_gamma``, which TRL writes as
    ``beta * (... - gamma / beta)``: the same value).

    Returns: (losses, ``beta * pi_c / n_c``, ``beta * pi_r / n_r``)."""
    chosen, rejected = beta * pol_c / n_c.clamp(min=1), beta * pol_r / n_r.clamp(min=1)
    return -F.logsigmoid(chosen - rejected - gamma), chosen, rejected


def preference_loss(loss_type: str, pol_c: torch.Tensor, pol_r: torch.Tensor, ref_c: torch.Tensor | None,
                    ref_r: torch.Tensor | None, n_c: torch.Tensor, n_r: torch.Tensor, beta: float,
                    gamma: float = 0.5) -> Losses:
    """The losses of ``loss_type`` (one of :data:`LOSS_TYPES`) from summed log-probs and response lengths.

    Raises:
        ValueError: an unknown ``loss_type``, or a reference-based loss without reference log-probs."""
    if loss_type == "simpo":
        return simpo(pol_c, pol_r, n_c, n_r, beta, gamma)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"megatrain: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    if ref_c is None or ref_r is None:
        raise ValueError(f"megatrain: loss_type={loss_type!r} needs reference log-probs (reference=...).")
    if loss_type == "sigmoid":
        return dpo_sigmoid(pol_c, pol_r, ref_c, ref_r, beta)
    return ipo(pol_c, pol_r, ref_c, ref_r, n_c, n_r, beta)


def sft_nll(pol_c: torch.Tensor, n_c: torch.Tensor) -> torch.Tensor:
    """The chosen responses' negative log-likelihood per token over the whole batch, ``-sum(pi_c) / sum(n_c)``
    (a scalar), for ``DPOModule(sft_weight=...)``: the DPO + NLL loss of Pang et al. 2024 ("Iterative Reasoning
    Preference Optimization"), as TRL computes the term (``DPOTrainer``'s ``"sft"`` loss type via ``loss_weights``)."""
    return -pol_c.sum() / n_c.sum().clamp(min=1)


def needs_reference(loss_type: str) -> bool:
    """Whether ``loss_type`` compares against a reference model (every type but SimPO)."""
    return loss_type != "simpo"
