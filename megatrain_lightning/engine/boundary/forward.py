"""Grad mode in a streamed block's forward without keeping what its backward reads.

The forward runs in grad mode on leaves for its inputs and parameters, so outputs get plain PyTorch's
``requires_grad`` and ops that branch on grad mode (SDPA's kernel, autocast's cast cache) behave as there
(docs/internals/block-calls.md, "Forward"); the hooks here keep what the backward would read only while the call
runs, since the block is recomputed in backward (MegaTrain, arXiv 2604.05091, per-block recompute).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def saving_for_the_call() -> Iterator[None]:
    """Keep saved tensors only while the call runs (a ``torch.autograd.grad`` inside the block works as in plain
    PyTorch) and drop them when it returns (:class:`SavedBoxes`); a later backward through a tensor kept from
    inside the call raises, naming what to do. The call holds its activations until it returns, as its recompute
    does (``mlp_chunk_size`` chunks keep only their inputs either way: each is checkpointed)."""
    boxes = SavedBoxes()
    try:
        with torch.autograd.graph.saved_tensors_hooks(boxes.pack, SavedBoxes.unpack):
            yield
    finally:
        boxes.clear()


class SavedBoxes:
    """Saved tensors of a block call's forward, each in a one-element list (a box) that :meth:`clear` empties when
    the call returns, so a graph node outliving the call holds no tensor. ``pack``/``unpack`` are
    ``saved_tensors_hooks``; unpacking an emptied box raises."""

    def __init__(self):
        self._boxes: list[list] = []

    def pack(self, t: torch.Tensor) -> list:
        box = [t]
        self._boxes.append(box)
        return box

    @staticmethod
    def unpack(box: list) -> torch.Tensor:
        if box[0] is None:
            raise RuntimeError(
                "megatrain: a backward reached a tensor computed inside a streamed block's forward that is not one of "
                "the block's outputs (kept by a forward hook on a module inside the block, or stored on an attribute): "
                "a streamed block's forward keeps nothing for a backward once it returns (the block is recomputed in "
                "backward). Compute the loss term from the block's outputs (hook the block itself), or detach the kept "
                "tensor if it is only logged.")
        return box[0]

    def clear(self) -> None:
        for box in self._boxes:
            box[0] = None
        self._boxes.clear()
