"""What the running backward does: whether a leaf's gradient is accumulated, captured or not computed,
and whether the graph is retained. Read from torch's autograd engine, so a block's backward (an
``autograd.Function``) behaves like ordinary autograd under ``backward()``, ``backward(inputs=...)``,
``torch.autograd.grad`` and ``retain_graph=True``."""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge


def leaf_grad_use(leaf: torch.Tensor) -> str | None:
    """What the running backward does with ``leaf``'s gradient: ``"accumulate"`` into ``.grad``
    (``loss.backward()`` for every leaf, ``backward(inputs=...)`` for the listed ones), ``"capture"``
    (``torch.autograd.grad(..., inputs)`` for the listed ones: returned, nothing accumulates) or
    ``None`` (not computed). The engine's marker leaf (an input of every block call, never listed by
    users) therefore tells a plain ``backward()`` apart from the other two."""
    try:
        return "accumulate" if torch._C._will_engine_execute_node(get_gradient_edge(leaf).node) else None
    except RuntimeError:  # torch answers this for a leaf that autograd.grad() captures: it is listed
        return "capture"


def keeps_graph() -> bool:
    """``retain_graph`` of the running backward (what torch's own AOT autograd reads)."""
    fn = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(fn()) if fn is not None else False


def local_grad(outputs: list, targets: list, grad_outputs: list, retain_graph: bool) -> tuple:
    """``torch.autograd.grad(outputs, targets, grad_outputs, allow_unused=True, retain_graph=...)``: a block's
    local backward after its recompute.

    Raises:
        RuntimeError: the block itself calls ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, which
            torch cannot differentiate under ``autograd.grad``: says so and what to use instead.
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
