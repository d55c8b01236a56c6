"""KV-cache objects passed to a block in a training forward.

A Hugging Face model with ``use_cache=True`` (most configs' default, also in training) creates an empty
``DynamicCache``; each attention layer appends its keys and attends over ``cache.update``'s fresh contiguous
copy. A streamed block runs twice per step, so its recompute must not see the keys its forward appended.
What happens to each kind of cache: docs/internals/block-calls.md, "KV cache". Why an empty ``DynamicCache``
is kept (a fresh copy per run) rather than dropped: the keys' memory layout. GPT-2's keys are a transposed
view of ``c_attn``'s output, the cache's copy is contiguous, and the CPU bmm in the attention backward sums
them in another order (measured: 2.6e-7 relative in ``h.0.attn.c_attn.weight`` after one step when dropped;
docs/internals/fidelity.md).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from .side_outputs import guard

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_cache(x: Any) -> bool:
    """Whether ``x`` is a transformers ``Cache``."""
    try:
        from transformers.cache_utils import Cache
    except Exception:  # pragma: no cover - transformers always installed with this package
        return False
    return isinstance(x, Cache)


def layer_index(module: torch.nn.Module) -> int | None:
    """The cache slot a block writes: the ``layer_idx`` of its first submodule that has one (transformers'
    attention modules), or ``None``."""
    return next((m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)


def _fresh_copyable(cache: Any) -> bool:
    """An empty ``DynamicCache`` of plain dynamic layers, or an ``EncoderDecoderCache`` of two: a shallow copy
    of its layers is an independent empty cache (their ``update`` rebinds attributes, never writes a shared tensor)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache

    if type(cache) is EncoderDecoderCache:
        return _fresh_copyable(cache.self_attention_cache) and _fresh_copyable(cache.cross_attention_cache)
    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return False
    layers = getattr(cache, "layers", None)
    return (isinstance(layers, list) and all(type(la) in (DynamicLayer, DynamicSlidingWindowLayer) for la in layers)
            and not any(getattr(la, "is_initialized", True) for la in layers))


def fresh_copy(cache: Any) -> Any:
    """An independent copy of an empty cache accepted by :func:`_fresh_copyable`."""
    from transformers.cache_utils import EncoderDecoderCache

    new = copy.copy(cache)
    if type(cache) is EncoderDecoderCache:
        new.self_attention_cache = fresh_copy(cache.self_attention_cache)
        new.cross_attention_cache = fresh_copy(cache.cross_attention_cache)
        new.is_updated = dict(cache.is_updated)
    else:
        new.layers = [copy.copy(la) for la in cache.layers]
    return new


def training_call(args: tuple, kwargs: dict, forward: Callable[..., Any], block: Any = None,
                  layer: int | None = None) -> tuple[tuple, dict, Callable[..., Any], bool]:
    """Prepare a block call made under grad mode: ``(args, kwargs, forward, stripped)``.

    Empty dynamic caches stay and each run of ``forward`` gets a fresh copy; other caches become ``None``
    (``stripped``; ``use_cache`` then ``False``). The returned ``forward`` is wrapped by :func:`.side_outputs.guard`.
    ``block``: the calling block, to refuse a cache reaching it in a second training forward (left empty by the
    first). ``layer``: the block's cache slot (:func:`layer_index`).

    Raises:
        RuntimeError: a cache already holds positions, or is passed again.
    """
    kept: list[Any] = []
    stripped = False

    def take(x: Any) -> Any:
        nonlocal stripped
        if not is_cache(x):
            return x
        # positions slot ``layer`` already holds (only this slot counts: earlier blocks that run like evaluation,
        # frozen, write theirs as in plain PyTorch)
        try:
            n = int(x.get_seq_length(layer)) if layer is not None else 0
        except Exception:  # noqa: BLE001 - a cache type without it (or not yet initialised) holds nothing we know of
            n = 0
        if n > 0:
            raise RuntimeError(
                f"megatrain: a training forward (grad enabled) was given a KV cache that already holds {n} positions "
                "(past_key_values: e.g. peft prefix tuning's virtual tokens, or a forward continuing an earlier one). "
                "strategy='megatrain' runs each block behind an autograd boundary (and again in backward) that carries "
                "tensors, not a cache's keys and values: their gradients would be lost. Feed the whole sequence in one "
                "forward; for prompt-based tuning use peft's prompt tuning or P-tuning (PromptTuningConfig, "
                "PromptEncoderConfig), which train as in plain Lightning. Caches work in evaluation and generation "
                "(no grad).")
        seen = x.__dict__.setdefault("_megatrain_blocks", set())
        if block is not None and block in seen:  # a later forward given the cache an earlier one returned
            raise RuntimeError(
                "megatrain: a training forward was given the KV cache (past_key_values) of an earlier training forward. "
                "In plain PyTorch that cache would hold the earlier forward's keys and values; here it is empty (each "
                "streamed block run works on a copy, and gradients could not flow through it anyway), so the second "
                "forward would silently attend over nothing. Feed the whole sequence in one forward.")
        seen.add(block)
        if _fresh_copyable(x):
            kept.append(x)
            return x
        stripped = True
        return None

    args = tuple(take(a) for a in args)
    kwargs = dict(kwargs)
    for k in CACHE_KWARGS:
        if kwargs.get(k) is not None:
            kwargs[k] = take(kwargs[k])
    if kwargs.get("use_cache") and not kept:
        kwargs["use_cache"] = False
        stripped = True
    if not kept:
        return args, kwargs, guard(forward, args, kwargs), stripped
    ids = {id(c) for c in kept}

    def run(*a: Any, **kw: Any) -> Any:
        a = tuple(fresh_copy(x) if id(x) in ids else x for x in a)
        kw = {k: fresh_copy(v) if id(v) in ids else v for k, v in kw.items()}
        return forward(*a, **kw)

    run.__wrapped__ = forward  # type: ignore[attr-defined]
    run._megatrain_caches = kept  # type: ignore[attr-defined]  # keeps the ids above valid
    return args, kwargs, guard(run, args, kwargs), stripped


def any_requires_grad(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor among a call's arguments (nested containers included) requires grad."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten((args, kwargs))[0])


def prefix_tuning_adapters(root: torch.nn.Module) -> list[str]:
    """Names of the peft prefix-tuning adapters in ``root`` (their virtual tokens reach every attention layer as a
    KV cache holding positions, which training forwards refuse: :func:`training_call`)."""
    out: list[str] = []
    for m in root.modules():
        cfgs = getattr(m, "peft_config", None)
        if isinstance(cfgs, dict):
            out += [n for n, c in cfgs.items() if str(getattr(c, "peft_type", "")).split(".")[-1] == "PREFIX_TUNING"]
    return list(dict.fromkeys(out))
