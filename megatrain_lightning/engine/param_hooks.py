"""Hooks registered on a streamed parameter, run on its gradient before the gradient leaves the device.

An ordinary ``backward()`` does not give a streamed parameter's gradient to autograd's ``AccumulateGrad`` node
(the block's autograd function returns ``None`` for it; the gradient goes to the parameter's host accumulator
instead), so torch never calls the hooks a user put on the parameter. This module calls them where the gradient
is produced, with the same contract as :meth:`torch.Tensor.register_hook`: each hook is called with the gradient
(a dense tensor of the parameter's shape and dtype) and may return a tensor that replaces it.

One difference from plain PyTorch: a parameter used by several block calls in one backward (a tied embedding
and LM head, one layer applied at several depths) has its hooks called once per call, with that call's part of the gradient, where autograd calls them once with
the sum. A hook that is linear in the gradient (scaling, masking rows) gives the same result; one that is not
(per-tensor clipping) sees the parts. ``register_post_accumulate_grad_hook`` hooks are refused: the host
accumulator, not ``param.grad``, holds the gradient during the backward.
"""

from __future__ import annotations

from typing import Sequence

import torch


def run_grad_hooks(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``grads`` (``grads[i]``: the gradient of ``params[i]`` from one block call, ``None`` where it has none),
    each passed through the tensor hooks of its parameter in registration order.

    Args:
        params: the module's parameters (the ``nn.Parameter`` objects the user holds and registered hooks on).
        grads: device tensors of each parameter's shape (dense, or a sparse COO embedding gradient, made dense
            when its parameter has hooks), or ``None``.

    Returns:
        The gradients, unchanged where the parameter has no hook (the same objects), else the hooks' result cast
        to the parameter's dtype when it is not already.

    Raises:
        RuntimeError: a parameter with a gradient has a ``register_post_accumulate_grad_hook`` hook; or a hook
            returned something that is not a tensor of the parameter's shape.
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
    """A user's gradient hook, not called when torch passes ``None``: a streamed parameter is an input of its
    block's autograd function only so that ``torch.autograd.grad`` can reach it; after an ordinary backward the
    function returns ``None`` for it, and torch runs the parameter's hooks with that ``None`` (the gradient
    itself goes through :func:`run_grad_hooks`)."""

    __slots__ = ("hook",)

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, grad):
        return None if grad is None else self.hook(grad)


def skip_none_calls(params: Sequence[torch.Tensor]) -> None:
    """Wrap every tensor hook of ``params`` (in place, under the same handle keys: ``handle.remove()`` still
    removes it) so that torch's call with ``None`` after an ordinary backward does not reach it. Called by the
    backward of a block's autograd function, for the parameters it returns gradients for (``None`` or not),
    before torch runs their hooks."""
    for p in params:
        hooks = p._backward_hooks
        if hooks:
            for key, hook in hooks.items():
                if not isinstance(hook, _WithGradient):
                    hooks[key] = _WithGradient(hook)
