"""What the running backward does with a leaf (accumulate, capture, nothing) and whether it retains the graph, read
from torch's autograd engine so a block's backward behaves like ordinary autograd; :class:`BoundParams`
(docs/internals/block-calls.md, "Block discovery")."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ..param_hooks import skip_none_calls


def leaf_grad_use(leaf: torch.Tensor) -> str | None:
    """What the running backward does with ``leaf``'s gradient: ``"accumulate"`` (``backward()``, or listed in
    ``backward(inputs=...)``), ``"capture"`` (listed in ``torch.autograd.grad``) or ``None`` (not computed). The
    engine's marker leaf (never listed by users) thus tells a plain ``backward()`` apart."""
    try:
        return "accumulate" if torch._C._will_engine_execute_node(get_gradient_edge(leaf).node) else None
    except RuntimeError:  # torch answers this for a leaf that autograd.grad() captures: it is listed
        return "capture"


def keeps_graph() -> bool:
    """``retain_graph`` of the running backward (what torch's own AOT autograd reads)."""
    fn = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(fn()) if fn is not None else False


def local_grad(outputs: list, targets: list, grad_outputs: list, retain_graph: bool) -> tuple:
    """A block's local backward: ``torch.autograd.grad(..., allow_unused=True)``.

    Raises:
        RuntimeError: the block calls ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, which
            ``autograd.grad`` cannot differentiate (names what to use instead).
    """
    try:
        return torch.autograd.grad(outputs, targets, grad_outputs, allow_unused=True, retain_graph=retain_graph)
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise RuntimeError(
            "megatrain: a streamed block calls torch.utils.checkpoint.checkpoint(..., use_reentrant=True) in its "
            "forward; the engine differentiates each block with torch.autograd.grad after recomputing it, which "
            "reentrant checkpointing does not support. Pass use_reentrant=False there, or drop the checkpoint: "
            "megatrain already recomputes every block (its `recompute` option).") from err


class BoundParams(torch.autograd.Function):
    """A container's own parameters (a direct block) on the device for the span of its ``forward``, tracked by
    ordinary autograd (nothing to recompute).

    Inputs: the gradient sink, the parameters' references, their device views, the marker leaf, then the host
    parameters. Outputs: the views, tracked. Backward (``RuntimeError`` under ``create_graph=True``): gradients to
    the host accumulators, or returned for the parameters ``torch.autograd.grad`` captures."""

    @staticmethod
    def forward(ctx, grads: Any, refs: list, views: list, dummy: torch.Tensor,
                *params: torch.Tensor):  # type: ignore[override]
        ctx.grads, ctx.refs, ctx.dummy = grads, refs, dummy
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        sink, refs = ctx.grads, ctx.refs
        if torch.is_grad_enabled():
            raise RuntimeError(
                "megatrain: backward(create_graph=True) (double backward) reached a container's own parameters; "
                "streamed models are differentiated once."
            )
        none = (None, None, None, None)
        skip_none_calls([r.param for r in refs])  # torch calls their hooks after this backward, with None or not
        if leaf_grad_use(ctx.dummy) == "accumulate":
            sink.send(refs, list(grads))
            return none + (None,) * len(refs)
        use = [leaf_grad_use(r.param) for r in refs]
        sink.send([r for r, u in zip(refs, use) if u == "accumulate"],
                  [g for g, u in zip(grads, use) if u == "accumulate"])
        return none + tuple(g.to(r.param.device) if g is not None and u == "capture" else None
                            for r, g, u in zip(refs, grads, use))
