"""The KV-cache guard of training forwards.

Under grad mode a block call never uses a KV cache: a cache object passed to it is replaced by
``None`` and ``use_cache`` by ``False``, because the recompute in backward would attend over the
keys/values the first pass appended and the gradients would silently be wrong
(docs/architecture.md, "Departures": KV cache).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_cache(x: Any) -> bool:
    """Whether ``x`` is a transformers ``Cache`` object (``DynamicCache``, ``StaticCache`` ...)."""
    try:
        from transformers.cache_utils import Cache
    except Exception:  # pragma: no cover - transformers always installed with this package
        return False
    return isinstance(x, Cache)


def any_requires_grad(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor among a call's arguments (nested containers included) requires grad."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten((args, kwargs))[0])


def strip_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """Remove KV-cache objects from a block call made under grad mode; returns (args, kwargs, stripped)."""
    stripped = False
    new_args = []
    for a in args:
        if is_cache(a):
            a, stripped = None, True
        new_args.append(a)
    kwargs = dict(kwargs)
    for k in _CACHE_KWARGS:
        if kwargs.get(k) is not None:
            kwargs[k] = None
            stripped = True
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        stripped = True
    return tuple(new_args), kwargs, stripped
