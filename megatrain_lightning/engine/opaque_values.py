"""Tensors a block call would pass or return hidden inside objects that torch's pytree does not open.

A block call's autograd boundary sees the tensors of its arguments and of its result as
``torch.utils._pytree.tree_flatten`` finds them: inside tuples, lists, dicts, named tuples and registered
classes (Hugging Face ``ModelOutput`` among them). A tensor inside any other object (a plain ``@dataclass``,
a ``SimpleNamespace``, an instance of the user's own class) is not an input or output of the boundary: no
gradient would flow through it, and what it computes would be trained wrongly without an error. Such calls are
refused here with what to change. Only the object's own attributes are looked at (one level), which covers the
usual state containers. :func:`inplace_input_hint` explains torch's error for a block that modifies an input in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator

import torch


def _fields(obj: Any) -> Iterable[tuple[str, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        return d.items()
    slots = getattr(type(obj), "__slots__", ())
    return ((s, getattr(obj, s, None)) for s in ([slots] if isinstance(slots, str) else slots))


def _hidden(items: Iterable[Any], wanted) -> list[str]:
    found = []
    for x in items:
        if x is None or isinstance(x, (torch.Tensor, int, float, bool, str, bytes, type, torch.nn.Module)):
            continue
        found += [f"{type(x).__name__}.{name}" for name, v in _fields(x) if isinstance(v, torch.Tensor) and wanted(v)]
    return found


def _advice(block: str, where: str, found: list[str]) -> str:
    return (f"megatrain: streamed block {block} {where} tensors inside an object torch's pytree does not open "
            f"({', '.join(found[:4])}): the block's autograd boundary would not see them and their gradient "
            "would be lost silently. Pass/return the tensors themselves (or a tuple, list, dict or NamedTuple of "
            "them), or register the class with torch.utils._pytree.register_dataclass / register_pytree_node.")


def check_inputs(block: str, values: Iterable[Any]) -> None:
    """Refuse a block call whose non-tensor arguments (``values``: the leaves of its flattened ``(args, kwargs)``
    that are not tensors) hold a tensor that requires a gradient.

    Raises:
        RuntimeError: naming the block and the attributes.
    """
    found = _hidden(values, lambda t: t.requires_grad)
    if found:
        raise RuntimeError(_advice(block, "was called with", found))


def check_outputs(block: str, values: Iterable[Any]) -> None:
    """Refuse a block call whose result holds a floating-point tensor inside an object the pytree does not open
    (``values``: the non-tensor leaves of the flattened result); in a training forward its history is cut.

    Raises:
        RuntimeError: naming the block and the attributes.
    """
    found = _hidden(values, lambda t: t.is_floating_point())
    if found:
        raise RuntimeError(_advice(block, "returned", found))


@contextlib.contextmanager
def inplace_input_hint(block: str) -> Iterator[None]:
    """Re-raise torch's "a (view of a) leaf Variable that requires grad is being used in an in-place operation" from a
    block call (its forward, or its recompute in backward) with what it means here: the strategy passes each block's
    tensor inputs as views of autograd leaves (plain PyTorch passes the caller's activation), so an in-place
    operation on an input inside the block (``x += 1``) is refused by torch.

    Raises:
        RuntimeError: naming the block and the rewrite.
    """
    try:
        yield
    except RuntimeError as e:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(e):
            raise
        raise RuntimeError(
            f"megatrain: streamed block {block} modifies one of its tensor inputs in place (e.g. `x += 1` or "
            "`x.add_(...)` on an argument): the strategy passes a block's inputs as views of autograd leaves, which "
            "torch does not let be modified in place. Write it out of place inside the block (`x = x + 1`).") from e
