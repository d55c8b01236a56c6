"""Graphs a block call keeps from its forward to its backward (:class:`KeptGraph`): the last block's, with the
device buffers it computed with, and a ``recompute="none"`` call's, without the block's weights.

For ``"none"`` (docs/internals/recompute.md, ``"none"``) the forward runs under saved-tensor hooks
(:class:`GraphHooks`): a saved tensor that lies in one of the block's device buffers (a weight or a view such as
``weight.t()``) is kept as its place there (:class:`InBuffer`), one in an autocast copy of a weight as
:class:`CastOf`, any other as autograd would keep it (or offloaded to host memory). In backward the unpack hook
rebuilds each weight from the fetched buffer (and casts it again, once per weight and backward), so autograd
differentiates the forward's own graph: nothing runs twice, and the bytes kept are plain PyTorch's for that block,
weights excluded (``saved_activation_bytes``). Autograd does not check the version of tensors saved through hooks,
so the hooks do (:class:`Kept`): one modified in place before the backward raises autograd's own error. The graph's
parameter leaves are then pointed at placeholders (:func:`release_leaves`), so the device buffer is released as in
every other mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_map_only

from ..offload import ActivationOffload, Offloaded


@dataclass(frozen=True)
class InBuffer:
    """Where a saved tensor lies in a block's device buffer: ``slab`` index; ``offset``, ``size``, ``stride`` in
    elements."""

    slab: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class CastOf:
    """A saved tensor in the ``dtype`` copy of the weight at ``source``; ``offset``, ``size``, ``stride`` in
    elements of that copy."""

    source: InBuffer
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Kept:
    """A saved tensor kept by reference and its version counter when saved, compared when the backward reads it."""

    tensor: torch.Tensor
    version: int


class ParamLocator:
    """Finds the tensors that lie in a block's device buffers (``bufs``: slab index -> flat buffer): first element
    inside the buffer, same dtype and device (the buffers are disjoint allocations: activations never match)."""

    def __init__(self, bufs: dict[int, torch.Tensor]):
        self.spans = [(si, b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), b.dtype, b.device)
                      for si, b in bufs.items() if b.numel()]

    def find(self, t: torch.Tensor) -> InBuffer | None:
        """``t``'s place in one of the buffers, or ``None``."""
        if not self.spans or t.numel() == 0:
            return None
        p = t.data_ptr()
        for si, lo, hi, dtype, device in self.spans:
            if lo <= p < hi and t.dtype == dtype and t.device == device:
                return InBuffer(si, (p - lo) // t.element_size(), tuple(t.size()), tuple(t.stride()))
        return None


def own_outputs(out: Any, bufs: dict[int, torch.Tensor]) -> Any:
    """``out`` (a block call's output pytree) with each tensor sharing storage with a weight buffer in ``bufs`` (a
    soft prompt's ``return self.p``) cloned under grad mode, so releasing the leaves and buffers leaves its values
    intact (uncloned, they would read zeros)."""
    ptrs = {b.untyped_storage().data_ptr() for b in bufs.values()}

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in ptrs:
            return t
        with torch.enable_grad():
            return t.clone()
    return tree_map_only(torch.Tensor, own, out) if ptrs else out


def release_leaves(leaves: dict[int, torch.Tensor]) -> None:
    """Point each gradient leaf at a one-element, zero-stride placeholder of its shape, so the graph's
    ``AccumulateGrad`` nodes no longer hold the device buffer (autograd needs only the leaf's shape, dtype and
    device)."""
    for leaf in leaves.values():
        leaf.data = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)


class GraphHooks:
    """The saved-tensor hooks of one ``recompute="none"`` block call (module docstring). Compute thread only.

    Args:
        offload: with ``offload_activations``, moves saved activations to host memory (``None``: kept on the
            device).
        name: the block's name, for the in-place modification error.

    After ``capture(bufs)``: ``nbytes`` the device bytes kept (unique storages), ``offloaded`` the host copies,
    ``needs_weights`` whether the backward reads any weight (an embedding's saves only indices: it fetches nothing).
    ``bind(bufs)`` / ``unbind()`` bracket the backward with the buffers fetched for it.
    """

    def __init__(self, offload: ActivationOffload | None = None, name: str = ""):
        self.offload = offload
        self.name = name
        self.nbytes = 0
        self.needs_weights = False
        self.offloaded: dict[int, Offloaded] = {}
        self._bufs: dict[int, torch.Tensor] | None = None
        self._casts: dict[tuple, torch.Tensor] = {}  # (weight, dtype) -> its cast, during one backward

    @contextlib.contextmanager
    def capture(self, bufs: dict[int, torch.Tensor],
                casts: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Iterator[None]:
        """Context of the call's forward with the block's buffers ``bufs`` and the autocast copies of its weights
        (``casts``: ``(weight view in bufs, its copy)``)."""
        locator = ParamLocator(bufs)
        device = next(iter(bufs.values())).device if bufs else None  # saved tensors elsewhere stay there
        copies = []
        for src, copy in casts or []:
            where = locator.find(src)
            if where is not None and copy.numel():
                lo = copy.data_ptr()
                copies.append((lo, lo + copy.numel() * copy.element_size(), copy.dtype, where))
        seen: dict[tuple, Any] = {}  # one record per saved tensor (several ops save the same input)
        alive: list[torch.Tensor] = []  # no address is reused while the forward runs (keys stay unique)
        storages: set[int] = set()

        def pack(t: torch.Tensor) -> Any:
            where = locator.find(t)
            if where is not None:
                self.needs_weights = True
                return where
            p = t.data_ptr()
            for lo, hi, dtype, src in copies:
                if lo <= p < hi and t.dtype == dtype and t.numel():
                    self.needs_weights = True
                    return CastOf(src, dtype, (p - lo) // t.element_size(), tuple(t.size()), tuple(t.stride()))
            if self.offload is not None and t.numel() and (device is None or t.device == device):
                key = (t.data_ptr(), tuple(t.size()), tuple(t.stride()), t.dtype)
                if key not in seen:
                    alive.append(t)
                    seen[key] = self.offload.offload(t)
                    self.offloaded[len(self.offloaded)] = seen[key]
                return seen[key]
            if t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in storages:
                    storages.add(ptr)
                    self.nbytes += t.untyped_storage().nbytes()
            return Kept(t, t._version)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _weight(self, x: InBuffer) -> torch.Tensor:
        if self._bufs is None:
            raise RuntimeError(
                "megatrain: a streamed block's weights were read outside its backward: a tensor computed inside the "
                "block reached the loss by another path than the block call's outputs (a forward hook on a module "
                "inside the block that keeps its output, a tensor stored on self or in a list during the forward), "
                "and its graph reads weights the block released after its forward. Return such tensors from the "
                "block, or register the hook on the block itself (its outputs are tracked).")
        buf = self._bufs[x.slab]
        return buf.as_strided(x.size, x.stride, buf.storage_offset() + x.offset)

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, InBuffer):
            return self._weight(x)
        if isinstance(x, CastOf):
            key = (x.source, x.dtype)
            copy = self._casts.get(key)
            if copy is None:
                copy = self._casts[key] = self._weight(x.source).to(x.dtype)
            return copy.as_strided(x.size, x.stride, copy.storage_offset() + x.offset)
        if isinstance(x, Offloaded):
            assert self.offload is not None
            return self.offload.take(x, keep=True)
        if isinstance(x, Kept):
            t = x.tensor
            if t._version != x.version:
                raise RuntimeError(  # autograd's own message for this error, so users find the usual advice
                    "one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {x.version} instead."
                    f" (megatrain: a tensor saved by block {self.name} for its backward, which keeps its graph: an "
                    "input of the block such as token ids or an attention mask, or a tensor computed in it, was "
                    "modified in place after the block's forward. Make that operation out of place, or clone the "
                    "tensor before modifying it.)")
            return t
        return x

    def bind(self, bufs: dict[int, torch.Tensor]) -> None:
        """Backward: the saved weights are views of ``bufs`` (the buffers fetched for it)."""
        self._bufs = dict(bufs)

    def unbind(self) -> None:
        """After the backward: drop the buffers, the weights' casts and the restored activations' device copies."""
        self._bufs = None
        self._casts = {}
        for e in self.offloaded.values():
            e.device, e.h2d = None, None

    def free(self) -> None:
        """The graph was freed: drop the host copies too."""
        self.unbind()
        self.offloaded = {}


class KeptGraph:
    """A block call's autograd graph kept to its backward: the last block's (with its device buffers ``bufs``) or a
    ``recompute="none"`` call's (``hooks``); the gradient ``leaves`` (by parameter id), detached ``inputs`` and
    ``outs``. ``close`` (idempotent) drops them and calls ``on_close(self)`` (the owner returns the buffers' bytes):
    after a backward that does not retain the graph, when the call is garbage-collected, or at the step's end."""

    def __init__(self, bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor], inputs: list,
                 outs: list[torch.Tensor], hooks: GraphHooks | None = None,
                 on_close: Callable[["KeptGraph"], None] | None = None):
        self.bufs, self.leaves, self.inputs, self.outs = bufs, leaves, inputs, outs
        self.hooks, self.on_close = hooks, on_close
        self.open = True

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        self.leaves, self.inputs, self.outs = {}, [], []
        if self.hooks is not None:
            self.hooks.free()
        if self.on_close is not None:
            self.on_close(self)
