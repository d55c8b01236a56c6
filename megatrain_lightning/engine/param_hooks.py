"""Hooks registered on a streamed parameter, run on its gradient before the gradient leaves the device.

The block's autograd function returns ``None`` for a streamed parameter (its gradient goes to the host
accumulator), so torch never calls its hooks with the gradient; :func:`run_grad_hooks` calls them where the
gradient is produced, with :meth:`torch.Tensor.register_hook`'s contract.

One difference from plain PyTorch: a parameter used by several block calls in one backward (tied embedding and
LM head) has its hooks called once per call with that call's part, where autograd calls them once with the sum;
a hook linear in the gradient gives the same result. ``register_post_accumulate_grad_hook`` hooks are refused:
the host accumulator, not ``param.grad``, holds the gradient during the backward.
"""

from __future__ import annotations

from typing import Sequence

import torch


def run_grad_hooks(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``grads`` (from one block call) each passed through its parameter's tensor hooks, in registration order.

    Args:
        params: the module's parameters (the ``nn.Parameter`` objects the user holds and registered hooks on).
        grads: per parameter, a device tensor of its shape (a sparse COO one is made dense for hooks), or ``None``.

    Returns:
        The gradients: the same objects where the parameter has no hook, else the hooks' result in the
        parameter's dtype.

    Raises:
        RuntimeError: a parameter with a gradient has a ``register_post_accumulate_grad_hook`` hook, or a hook
            returned something other than ``None`` or a tensor of the gradient's shape.
    """
    out = list(grads)
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise RuntimeError(
                f"megatrain: a parameter of shape {tuple(p.shape)} has a register_post_accumulate_grad_hook hook; "
                "the strategy keeps streamed parameters' gradients in host accumulators during the backward, so "
                "param.grad is not set when such a hook would run. Use param.register_hook (called with each "
                "gradient) or the LightningModule's on_before_optimizer_step (param.grad is set there), or "
                "strategy='auto'.")
        hooks = p._backward_hooks
        if not hooks:
            continue
        if g.is_sparse:
            g = g.to_dense()
        if g.dtype != p.dtype:
            g = g.to(p.dtype)
        for hook in list(hooks.values()):
            r = hook(g)
            if r is not None:
                if not isinstance(r, torch.Tensor) or r.shape != g.shape:
                    raise RuntimeError(
                        f"megatrain: a gradient hook of a parameter of shape {tuple(p.shape)} returned "
                        f"{type(r).__name__}{'' if not isinstance(r, torch.Tensor) else ' of shape ' + str(tuple(r.shape))}; "
                        "a hook returns None or a tensor of the gradient's shape.")
                g = r
        out[i] = g
    return out


class _WithGradient:
    """A user's gradient hook, skipped when torch passes ``None`` (after an ordinary backward, for a streamed
    parameter, an input of the block's function only so ``torch.autograd.grad`` can reach it)."""

    __slots__ = ("hook",)

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, grad):
        return None if grad is None else self.hook(grad)


def skip_none_calls(params: Sequence[torch.Tensor]) -> None:
    """Wrap every tensor hook of ``params`` in :class:`_WithGradient`, in place under the same handle keys
    (``handle.remove()`` still works). Called by a block function's backward before torch runs the hooks."""
    for p in params:
        hooks = p._backward_hooks
        if hooks:
            for key, hook in hooks.items():
                if not isinstance(hook, _WithGradient):
                    hooks[key] = _WithGradient(hook)
