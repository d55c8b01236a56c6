"""Tensors a block hands to later blocks outside its return values: refused, not silently cut off.

Only a streamed call's return values (and recorded_outputs.py's tensors) connect to autograd, so a tensor stored
into a mutable argument (a dict or list) for a later block reaches it as a constant, its gradient silently lost:
Gemma 3n / Gemma 4 with ``num_kv_shared_layers > 0`` (``shared_kv_states``; 12% relative weight error after 4
steps on a tiny Gemma 3n, unguarded). :func:`guard` makes such tensors raise when a later block reads them, in
the first training forward (docs/internals/block-calls.md, "Tensors passed between blocks through a mutable
argument").
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..blocks import BlockDiscoveryError


def _tensor_ids(container: Any) -> set[int]:
    """Ids of the tensors a mapping's values or a list's items hold, nested ones included."""
    items = list(container.values()) if isinstance(container, MutableMapping) else list(container)
    return {id(x) for x in tree_flatten(items)[0] if isinstance(x, torch.Tensor)}


class _Unreadable(torch.Tensor):
    """A tensor a block stored for later blocks: any use of it raises :class:`BlockDiscoveryError`
    (``_megatrain_message`` says which block and argument)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        seen = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, _Unreadable)]
        raise BlockDiscoveryError(seen[0].__dict__.get("_megatrain_message", "megatrain: tensor passed between blocks"))


def guard(forward: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
    """Wrap a block's training ``forward`` so that tensors it stores into a mutable argument raise when read.

    A stored tensor that no later block reads costs nothing (Gemma 4 stores them even without sharing).

    Args:
        forward: the block's forward (a bound method of the block module, or a wrapper with ``__wrapped__``).
        args, kwargs: the call's arguments; the dicts and lists among them are watched.

    Returns:
        ``forward`` when nothing is watched, else a wrapper that replaces each tensor the call added to a
        watched container by an unreadable view.

    Raises (from the reading block, not here):
        BlockDiscoveryError: naming the writing block's class, the argument and the key, and what to do.
    """
    named = [(f"positional argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    watched = [(n, v) for n, v in named if isinstance(v, (MutableMapping, list))]
    if not watched:
        return forward

    def run(*a: Any, **kw: Any) -> Any:
        before = [_tensor_ids(c) for _, c in watched]
        out = forward(*a, **kw)
        for (name, container), ids in zip(watched, before):
            if _tensor_ids(container) - ids:
                _make_unreadable(container, ids, _owner(forward), name)
        return out

    run.__wrapped__ = forward  # type: ignore[attr-defined]
    return run


def _owner(forward: Callable[..., Any]) -> str:
    fn = forward
    while not hasattr(fn, "__self__") and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return type(getattr(fn, "__self__", None)).__name__


def _make_unreadable(container: Any, ids: set[int], owner: str, name: str) -> None:
    """Replace, in place, every tensor of ``container`` whose id is not in ``ids`` by an unreadable view."""
    hint = (" This model shares keys and values across layers (Gemma 3n / Gemma 4 `num_kv_shared_layers` > 0);"
            " a config with `num_kv_shared_layers=0` trains." if name == "shared_kv_states" else "")
    keys = list(container.keys()) if isinstance(container, MutableMapping) else range(len(container))
    for k in keys:
        flat, spec = tree_flatten(container[k])
        if not any(isinstance(x, torch.Tensor) and id(x) not in ids for x in flat):
            continue
        msg = (f"megatrain: a later block read a tensor that a {owner} block stored into its argument `{name}` "
               f"(key {k!r}). A streamed block connects only its return values to autograd (it runs without a "
               "graph and is recomputed in backward), so the gradient through that tensor would be silently lost; "
               f"megatrain cannot train such a model.{hint} Train it with another strategy, or pass the tensor "
               "between layers as a return value.")
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor) and id(x) not in ids:
                flat[i] = x.detach().as_subclass(_Unreadable)
                flat[i]._megatrain_message = msg
        container[k] = tree_unflatten(flat, spec)
