"""Grad mode in a streamed block's forward without keeping what its backward reads.

A streamed block's forward runs in grad mode (``torch.enable_grad``) on leaves standing for its inputs and
parameters, so each output carries the ``requires_grad`` plain PyTorch would give it and ops that branch on
grad mode (SDPA's kernel choice, autocast's cast cache) behave as in plain PyTorch; the saved-tensors hooks here
keep the tensors the backward would read only while the call runs, because the block is recomputed in backward
(MegaTrain, arXiv 2604.05091, per-block recompute).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from .calls import BlockCall


def differentiable(call: BlockCall, outs: Sequence[torch.Tensor]) -> list[bool]:
    """Which of a call's tensor outputs ``outs`` require grad, as in plain PyTorch: those its grad-mode run
    (``call.out_grad``) produced requiring grad; autograd marks the others non-differentiable. T5's decoder
    layer returns the cross-attention position bias it makes with ``torch.zeros``: made differentiable, the
    next layer's SDPA took its math kernel (a mask that requires grad) and the bf16-mixed loss moved
    (5.1301 vs 5.1295 plain). Integer outputs never require grad."""
    known = call.out_grad if call.out_grad is not None and len(call.out_grad) == len(outs) else [True] * len(outs)
    return [k and o.is_floating_point() for k, o in zip(known, outs)]


def _never_unpacked(_saved: Any) -> torch.Tensor:
    raise RuntimeError(
        "megatrain: a backward reached a tensor computed inside a streamed block's forward that is not one of the "
        "block's outputs (kept by a forward hook on a module inside the block, or stored on an attribute): a streamed "
        "block's forward keeps nothing for a backward once it returns (the block is recomputed in backward). Compute the loss term from "
        "the block's outputs (hook the block itself), or detach the kept tensor if it is only logged.")


@contextlib.contextmanager
def saving_for_the_call() -> Iterator[None]:
    """Autograd records the graph and keeps the tensors its backward reads only while the call runs (a
    ``torch.autograd.grad`` inside the block's forward, as gradient features or fast weights take, works as in
    plain PyTorch), and drops them when it returns: the forward of a call recomputed in backward. A
    backward through a tensor kept from inside the call then raises, naming what to do. The call holds its own
    activations until it returns, as its recompute in backward does (``mlp_chunk_size`` chunks keep only their
    inputs either way: each is checkpointed)."""
    boxes = SavedBoxes()
    try:
        with torch.autograd.graph.saved_tensors_hooks(boxes.pack, SavedBoxes.unpack):
            yield
    finally:
        boxes.clear()


class SavedBoxes:
    """Saved tensors of a block call's forward, each packed in a one-element list (a box) that :meth:`clear` empties
    when the call returns: a graph node of that forward that outlives it (one that something still references)
    then holds an empty box, not the tensor. Use ``pack``/``unpack`` as ``saved_tensors_hooks``; a backward that
    unpacks an emptied box raises naming what to do."""

    def __init__(self):
        self._boxes: list[list] = []

    def pack(self, t: torch.Tensor) -> list:
        box = [t]
        self._boxes.append(box)
        return box

    @staticmethod
    def unpack(box: list) -> torch.Tensor:
        if box[0] is None:
            _never_unpacked(None)
        return box[0]

    def clear(self) -> None:
        for box in self._boxes:
            box[0] = None
        self._boxes.clear()


def refuse_func_transforms(name: str) -> None:
    """Raise if streamed block ``name`` is called under a ``torch.func`` transform (grad, vmap, jacrev...):
    its autograd boundary (a ``torch.autograd.Function`` with host-side state) does not compose with them.

    Raises:
        RuntimeError: naming the alternatives."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"megatrain: streamed block {name} was called under a torch.func transform (grad, "
                           "vmap, jacrev...), which the strategy's block calls do not support; use "
                           "torch.autograd.grad, or strategy='auto'.")


class ForeignLeafCheck:
    """Refuses, at the first training call of each block, a forward whose outputs depend on a tensor that requires
    grad and is neither an argument of the call nor one of the block's parameters: a parameter of a module outside
    the block read by a forward hook inside it, or through an attribute or closure. The block's backward
    differentiates its arguments and parameters only, so that tensor's gradient would be lost silently (a
    steering vector read in a hook on an inner MLP would train 6.5e-2 off plain PyTorch). Checked at the first training
    call of each block (a walk of the call's autograd graph), and again at the next call of every block after any hook
    was registered anywhere (PyTorch numbers every hook handle it makes: ``torch.utils.hooks.RemovableHandle.next_id``),
    so a hook added mid-fit (by a callback) is seen at its first use.

    Args:
        store: the host store (``index``: ``id(param)`` -> (slab, entry); ``slabs[s].entries[e].ref.fqn``), to
            name the parameter.
    """

    def __init__(self, store: Any):
        self.store = store
        self.checked: set[int] = set()
        self.hooks_seen = RemovableHandle.next_id  # hook handles made so far (any module, tensor or global hook)

    def __call__(self, block: Any, outs: Sequence[torch.Tensor], own: Sequence[torch.Tensor]) -> None:
        """Check ``outs`` (the call's tensor outputs, still attached to the call's graph) of ``block`` (a
        :class:`~megatrain_lightning.blocks.Block`) against ``own`` (the call's input and parameter leaves).

        Raises:
            RuntimeError: naming the block and the tensor (its parameter name when the store holds it)."""
        if RemovableHandle.next_id != self.hooks_seen:  # a hook was registered since: check every block again
            self.hooks_seen = RemovableHandle.next_id
            self.checked.clear()
        if block.index in self.checked:
            return
        self.checked.add(block.index)
        own_ids = {id(t) for t in own}
        seen: set = set()
        stack = [o.grad_fn for o in outs if o.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
            if var is not None and id(var) not in own_ids:
                raise RuntimeError(
                    f"megatrain: the forward of streamed block {block.name} used {self._describe(var)}, which requires "
                    "grad and is neither an argument of the block nor one of its parameters (a parameter of a module "
                    "outside the block, read by a forward hook inside it or through an attribute); the block's "
                    "backward differentiates its arguments and parameters only, so its gradient would be lost. Pass "
                    "it to the block as an argument, make its module a submodule of the block, or register the hook "
                    "on the block itself (its outputs are differentiated as in plain PyTorch).")
            stack.extend(f for f, _ in fn.next_functions)

    def _describe(self, t: torch.Tensor) -> str:
        where = self.store.index.get(id(t))
        if where is not None:
            return f"parameter {self.store.slabs[where[0]].entries[where[1]].ref.fqn}"
        return f"a tensor of shape {list(t.shape)} ({t.dtype})"
