"""What a block's forward saw of its modules: their ``training`` flags, and the values of its buffers
(BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``), replayed when the block is recomputed.

A recomputed block runs its forward twice per step (the forward, then its recompute in backward). Two kinds of
module state can differ between the two runs:

* ``training`` flags: a ``training_step`` that switches modes between a block's forward and its backward
  (a forward under ``model.eval()`` followed by ``model.train()``, BatchNorm layers set to eval inside a block,
  ``eval()`` before ``backward()``) would otherwise recompute with the backward-time flags: other dropout masks
  (dropout acts only in training mode), other BatchNorm statistics (batch vs running), so other gradients than
  plain PyTorch's, which differentiates the forward it ran. The flags of every submodule are recorded at the
  forward and set for the recompute (then put back).
* buffers: a buffer the forward updates in training mode would be updated twice where plain PyTorch updates it
  once, and the recompute would see the updated value where the forward saw the old one (also when another
  forward updated it after this one: an eval-mode forward, then a train-mode one, then one backward). A copy of
  the buffer values the forward started from is kept; the recompute runs on a fresh copy of them and the current
  values are put back afterwards, so the module keeps exactly the forwards' updates.

Decoder layers of Hugging Face models hold no buffers (rotary tables live on the model): for them a snapshot is
one walk over the block's submodules (about ten for a decoder layer) and one flag per submodule, nothing cloned.
A block with buffers (BatchNorm) has them cloned at every training-mode block call (2 x channels values each).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class BlockState:
    """The module state one block call's forward started from.

    Args:
        modules: every submodule of the block (the block itself included), in ``modules()`` order.
    """

    def __init__(self, modules: list[nn.Module]):
        self._modes = [(m, m.training) for m in modules]
        entries = [(m, n, b) for m in modules for n, b in m.named_buffers(recurse=False) if b is not None]
        self._buffers = [(m, n, b.clone()) for m, n, b in entries]

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Within the context every submodule has the ``training`` flag the forward saw and the buffers hold
        (copies of) the values the forward started from; on exit the flags are the current ones again and each
        buffer is the tensor it was on entry, so what the recompute wrote into them is dropped."""
        flags = [(m, m.training) for m, _ in self._modes]
        for m, was in self._modes:
            if m.training != was:
                m.training = was  # this module only: its children have their own entries
        current = [getattr(m, n) for m, n, _ in self._buffers]
        for m, n, before in self._buffers:
            setattr(m, n, before.clone())
        try:
            yield
        finally:
            for (m, n, _), cur in zip(self._buffers, current):
                setattr(m, n, cur)
            for m, now in flags:
                m.training = now


def snapshot(module: nn.Module) -> BlockState:
    """The ``training`` flags of ``module`` and its submodules, and a copy of their buffers, before a block
    call's forward. The copies are kept until the call's backward even when its forward changed no buffer: a later
    forward before that backward may (an eval-mode forward reads BatchNorm's running statistics, a train-mode one
    then updates them in place), and the recompute must read what its forward read."""
    return BlockState(list(module.modules()))
