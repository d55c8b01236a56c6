"""Grad mode in a streamed block's forward without keeping what its backward reads.

A streamed block's forward runs in grad mode (``torch.enable_grad``) on leaves standing for its inputs and
parameters, so each output carries the ``requires_grad`` plain PyTorch would give it and ops that branch on
grad mode (SDPA's kernel choice, autocast's cast cache) behave as in plain PyTorch; the saved-tensors hooks here
keep none of the tensors the backward would read, because the block is recomputed in backward
(MegaTrain, arXiv 2604.05091, per-block recompute).
"""
from __future__ import annotations

from typing import Any, ContextManager, Sequence

import torch

from .calls import BlockCall


def differentiable(call: BlockCall, outs: Sequence[torch.Tensor]) -> list[bool]:
    """Which of a call's tensor outputs ``outs`` require grad, as in plain PyTorch: those its grad-mode run
    (``call.out_grad``) produced requiring grad; autograd marks the others non-differentiable. T5's decoder
    layer returns the cross-attention position bias it makes with ``torch.zeros``: made differentiable, the
    next layer's SDPA took its math kernel (a mask that requires grad) and the bf16-mixed loss moved
    (5.1301 vs 5.1295 plain). Integer outputs never require grad."""
    known = call.out_grad if call.out_grad is not None and len(call.out_grad) == len(outs) else [True] * len(outs)
    return [k and o.is_floating_point() for k, o in zip(known, outs)]


def _never_unpacked(_saved: Any) -> torch.Tensor:
    raise RuntimeError(
        "megatrain: a backward reached a tensor computed inside a streamed block's forward that is not one of the "
        "block's outputs (kept by a forward hook on a module inside the block, or stored on an attribute): a streamed "
        "block's forward keeps no autograd history (the block is recomputed in backward). Compute the loss term from "
        "the block's outputs (hook the block itself), or detach the kept tensor if it is only logged.")


def saving_nothing() -> ContextManager[None]:
    """Autograd records the graph but keeps none of the tensors its backward would read: the forward of a call
    recomputed in backward (a backward through a tensor kept from inside it raises, naming what to do)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: None, _never_unpacked)


def refuse_func_transforms(name: str) -> None:
    """Raise if streamed block ``name`` is called under a ``torch.func`` transform (grad, vmap, jacrev...):
    its autograd boundary (a ``torch.autograd.Function`` with host-side state) does not compose with them.

    Raises:
        RuntimeError: naming the alternatives."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"megatrain: streamed block {name} was called under a torch.func transform (grad, "
                           "vmap, jacrev...), which the strategy's block calls do not support; use "
                           "torch.autograd.grad, or strategy='auto'.")
