"""How selective activation checkpointing (``engine/recompute_policy.py``) classifies aten ops: cheap to recompute
or expensive (the forward ops ``torch.utils.flop_counter`` counts, attention without dropout), their FLOPs, their
output bytes, and which arguments an op writes."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

_aten = torch.ops.aten
# forward ops whose FLOPs torch counts (matmuls, convolutions, attention), plus CPU flash attention
_EXPENSIVE = {k: v for k, v in flop_registry.items() if "backward" not in str(k)}
_EXPENSIVE[_aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[_aten._scaled_dot_product_flash_attention]
_CASTS = {_aten._to_copy, _aten.to, _aten.clone, _aten.copy_, _aten.lift_fresh}


@functools.lru_cache(maxsize=None)
def cheap_op(func: Any) -> bool:
    """Ops never kept: views (free to redo), casts and copies (a cast weight would keep a copy of the
    weights) and in-place ops (their output is their input)."""
    return func.is_view or func.overloadpacket in _CASTS or func._schema.is_mutable


@functools.lru_cache(maxsize=None)
def _dropout_index(func: Any) -> int | None:
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == "dropout_p"), None)


@functools.lru_cache(maxsize=None)
def written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments ``func`` writes to (in-place and ``out=`` ops); ``()`` for others."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def dropout_p(func: Any, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` argument of an op that has one (attention), else 0."""
    i = _dropout_index(func)
    if i is None:
        return 0.0
    return float(kwargs.get("dropout_p", args[i] if i < len(args) else 0.0) or 0.0)


def cheap(func: Any, args: tuple, kwargs: dict) -> bool:
    """Ops never kept: :func:`cheap_op`, and random ops (recomputed under the replayed RNG state). Attention
    counts as random only with ``dropout_p > 0``, so attention without dropout, the costliest recompute, is kept."""
    if cheap_op(func):
        return True
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    return _dropout_index(func) is None or dropout_p(func, args, kwargs) > 0.0


def expensive(func: Any, args: tuple, kwargs: dict) -> bool:
    return func.overloadpacket in _EXPENSIVE and dropout_p(func, args, kwargs) == 0.0


def flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Forward FLOPs of one op: torch's formula for matmuls/attention (``torch.utils.flop_counter``),
    otherwise one per output element (elementwise estimate)."""
    f = _EXPENSIVE.get(func.overloadpacket)
    if f is not None:
        try:
            return int(f(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - an estimate; a formula that does not fit counts elements
            pass
    return sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def storage_bytes(out: Any, seen: set) -> int:
    """Bytes of the tensors in ``out`` whose storage was not counted yet (``seen``: data pointers)."""
    n = 0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                n += t.numel() * t.element_size()
    return n
