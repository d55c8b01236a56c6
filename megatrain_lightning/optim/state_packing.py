"""Where a parameter's optimizer state lives on the NVMe tier: packed into that parameter's two ranges of the store's
optimizer regions.

Each parameter of ``numel`` elements has two ranges of ``numel`` fp32 values (``exp_avg`` and ``exp_avg_sq``, 8 bytes
per element in all). :func:`pack` places its state in them byte for byte: every tensor with at least one dimension
of any dtype up to 4 bytes per element, and the inner tensors of a ``__tensor_flatten__`` subclass (torchao's
``OptimState8bit``, about 2.03 bytes per element), rebuilt around views at every update (:func:`rebuild`) so the
class's in-place writes land in the ranges. 0-d tensors (``step``) and other values stay in host RAM (the
caller's). Too large: three fp32 tensors per element (``amsgrad=True``), or fp64.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: bytes per element of a parameter's range in one optimizer region (the regions hold fp32)
RANGE_ITEMSIZE = 4


@dataclass(frozen=True)
class Placement:
    """One packed tensor: ``key`` (the state key, or ``"<key>.<inner name>"`` for a tensor inside a subclass),
    ``region`` 0 (``exp_avg``) or 1 (``exp_avg_sq``), ``offset`` in bytes from the parameter's start in that
    region (a multiple of the dtype's size), ``shape``, ``dtype``."""

    key: str
    region: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def view(self, regions: tuple[torch.Tensor, torch.Tensor], base: int) -> torch.Tensor:
        """The tensor's view in the slab's held flat fp32 regions, the parameter starting at element ``base``."""
        start = base * RANGE_ITEMSIZE + self.offset
        flat = regions[self.region].view(torch.uint8)[start:start + math.prod(self.shape) * self.dtype.itemsize]
        return flat.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Wrapper:
    """A tensor subclass of the state, rebuilt from its inner tensors: ``cls.__tensor_unflatten__({name: inner},
    ctx, size, stride)`` (the protocol of ``torch.utils._python_dispatch.is_traceable_wrapper_subclass``)."""

    cls: type
    names: tuple[str, ...]
    ctx: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """A parameter's packed state: the :class:`Placement` of each packed tensor, the :class:`Wrapper` of each
    subclass (by key), and ``order``, the class's own key order of the whole state (packed or not)."""

    placements: tuple[Placement, ...]
    wrappers: dict[str, Wrapper]
    order: tuple[str, ...]

    @property
    def regions(self) -> set[int]:
        """The regions the layout uses (an empty set for a state without packed tensors)."""
        return {pl.region for pl in self.placements}


def packed_kind(v: Any) -> bool:
    """Whether a state value is packed (a tensor with at least one dimension)."""
    return torch.is_tensor(v) and v.dim() > 0


def leaves(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Wrapper]]:
    """The tensors of ``state`` to pack, by key (a subclass's inner tensors as ``"<key>.<name>"``, recursively),
    and the :class:`Wrapper` of each subclass."""
    out: dict[str, torch.Tensor] = {}
    wrappers: dict[str, Wrapper] = {}

    def walk(key: str, v: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(v):
            names, ctx = v.__tensor_flatten__()
            wrappers[key] = Wrapper(type(v), tuple(names), ctx, tuple(v.shape), tuple(v.stride()))
            for n in names:
                walk(f"{key}.{n}", getattr(v, n))
        else:
            out[key] = v

    for k, v in state.items():
        if packed_kind(v):
            walk(k, v)
    return out, wrappers


def pack(state: dict[str, Any], numel: int) -> Layout | None:
    """Place a parameter's state tensors (:func:`leaves`) in its two ranges of ``numel`` fp32 values, first fit in
    decreasing size, each at an offset aligned to its dtype's size (AdamW's moments land one per region at 0).

    Returns:
        The :class:`Layout`, or ``None`` if the tensors do not fit or one is wider than 4 bytes per element
        (:func:`unpackable` says which).
    """
    tensors, wrappers = leaves(state)
    if any(v.dtype.itemsize > RANGE_ITEMSIZE for v in tensors.values()):
        return None
    free = [0, 0]
    where: dict[str, tuple[int, int]] = {}
    for k in sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].dtype.itemsize):
        v = tensors[k]
        for r in (0, 1):
            at = -(-free[r] // v.dtype.itemsize) * v.dtype.itemsize  # aligned to the dtype's size
            if at + v.numel() * v.dtype.itemsize <= numel * RANGE_ITEMSIZE:
                where[k], free[r] = (r, at), at + v.numel() * v.dtype.itemsize
                break
        else:
            return None
    return Layout(tuple(Placement(k, *where[k], tuple(v.shape), v.dtype) for k, v in tensors.items()),
                  wrappers, tuple(state))


def unpackable(state: dict[str, Any], numel: int) -> str | None:
    """Why a parameter's state (``numel`` elements) cannot be packed (:func:`pack`), as a phrase ("keeps ..."), or
    ``None`` if it can."""
    tensors, _ = leaves(state)
    wide = [f"{k} ({v.dtype})" for k, v in tensors.items() if v.dtype.itemsize > RANGE_ITEMSIZE]
    if wide:
        return f"keeps tensors wider than 4 bytes per element: {', '.join(wide)}"
    if pack(state, numel) is None:
        total = sum(v.numel() * v.dtype.itemsize for v in tensors.values())
        return (f"keeps {total / numel:g} bytes of tensors per element ({', '.join(tensors)}), more than the two "
                "fp32 values (8 bytes) per element that fit")
    return None


def copy_tensor(v: torch.Tensor) -> torch.Tensor:
    """A detached copy of a state tensor; a subclass (``__tensor_flatten__``) rebuilt around copies of its inner
    tensors (torchao's 8-bit state implements no ``clone``)."""
    if is_traceable_wrapper_subclass(v):
        names, ctx = v.__tensor_flatten__()
        return type(v).__tensor_unflatten__({n: copy_tensor(getattr(v, n)) for n in names}, ctx, tuple(v.shape),
                                            tuple(v.stride()))
    return v.detach().clone()


#: suffix of the entry that describes a tensor subclass in a flat name -> tensor mapping (:func:`flatten_named`)
SUBCLASS_SUFFIX = ".__subclass__"


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    raise TypeError(f"a value of type {type(v).__name__}")


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        return getattr(torch, v["dtype"])
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def flatten_named(key: str, v: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs that store ``v`` under ``key`` as plain tensors (for safetensors files): ``v`` itself,
    or for a subclass its inner tensors as ``"<key>.<inner name>"`` (recursively) and ``"<key>.__subclass__"``, a
    uint8 tensor of UTF-8 JSON naming the class and its flatten context (:func:`unflatten_named` reverses it).

    Raises:
        TypeError: the context holds something other than None, bool, int, float, str, a torch dtype or lists.
    """
    if not is_traceable_wrapper_subclass(v):
        yield key, v
        return
    names, ctx = v.__tensor_flatten__()
    cls = type(v)
    try:
        desc = {"class": f"{cls.__module__}.{cls.__qualname__}", "names": list(names), "ctx": _encode(ctx),
                "size": list(v.shape), "stride": list(v.stride())}
    except TypeError as err:
        raise TypeError(f"megatrain cannot store the optimizer state {key!r} ({cls.__qualname__}): its flatten "
                        f"context holds {err}; keep the optimizer state in RAM without checkpoints or use an "
                        "optimizer with plain tensor state.") from None
    for n in names:
        yield from flatten_named(f"{key}.{n}", getattr(v, n))
    yield key + SUBCLASS_SUFFIX, torch.frombuffer(bytearray(json.dumps(desc).encode()), dtype=torch.uint8)


def unflatten_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (keys as :func:`flatten_named` writes them) with each subclass rebuilt from its inner tensors.

    Raises:
        ValueError: a described class cannot be imported or is not a tensor subclass with ``__tensor_unflatten__``.
    """
    pool = dict(state)

    def build(key: str) -> torch.Tensor:
        raw = pool.pop(key + SUBCLASS_SUFFIX, None)
        if raw is None:
            return pool.pop(key)
        desc = json.loads(bytes(raw.to(torch.uint8).tolist()).decode())
        module, _, qual = desc["class"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), qual)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"the saved optimizer state {key!r} is a {desc['class']}, which cannot be imported "
                             f"({err}); install the package that defines it.") from None
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor) and hasattr(cls, "__tensor_unflatten__")):
            raise ValueError(f"the saved optimizer state {key!r} names {desc['class']}, not a tensor subclass.")
        inner = {n: build(f"{key}.{n}") for n in desc["names"]}
        return cls.__tensor_unflatten__(inner, _decode(desc["ctx"]), tuple(desc["size"]), tuple(desc["stride"]))

    tops = [k[: -len(SUBCLASS_SUFFIX)] for k in state if k.endswith(SUBCLASS_SUFFIX)]
    outer = [t for t in tops if not any(t.startswith(u + ".") for u in tops if u != t)]
    built = {t: build(t) for t in outer}
    out: dict[str, torch.Tensor] = {}
    for k in state:  # the saved order, each subclass where its first inner tensor was
        t = next((t for t in outer if k.startswith(t + ".")), None)
        if t is None:
            out[k] = state[k]
        elif t not in out:
            out[t] = built[t]
    return out


def rebuild(layout: Layout, tensor: Callable[[Placement], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed state tensors by state key: ``tensor(placement)`` for each packed tensor (a view into the held
    regions, or a copy), subclasses reassembled around their inner tensors."""
    flat = {pl.key: tensor(pl) for pl in layout.placements}

    def build(key: str) -> torch.Tensor:
        w = layout.wrappers.get(key)
        if w is None:
            return flat[key]
        return w.cls.__tensor_unflatten__({n: build(f"{key}.{n}") for n in w.names}, w.ctx, w.size, w.stride)

    return {k: build(k) for k in layout.order if k in flat or k in layout.wrappers}
