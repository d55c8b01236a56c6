"""What a block's forward saw of its modules: their ``training`` flags, and the buffers the forward changed
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
  once, and the recompute would see the updated value where the forward saw the old one. For a call whose
  forward changed a buffer, a copy of the values the forward started from is kept; the recompute runs on a fresh
  copy of them and the forward's results are put back afterwards, so the module keeps exactly one update.

Decoder layers of Hugging Face models hold no buffers (rotary tables live on the model): for them a snapshot is
one walk over the block's submodules (about ten for a decoder layer) and one flag per submodule, nothing cloned.
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
        self._buffers = [(m, n, b, b._version, b.clone()) for m, n, b in entries]

    def forward_done(self) -> "BlockState":
        """Call after the forward: drops the buffer copies if the forward changed no buffer (neither updated
        one in place nor assigned a new tensor to one); returns ``self``."""
        if not any(getattr(m, n) is not b or b._version != v for m, n, b, v, _ in self._buffers):
            self._buffers = []
        return self

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Within the context every submodule has the ``training`` flag the forward saw and the buffers hold
        (copies of) the values the forward started from; on exit the flags are the current ones again and each
        buffer is the tensor it was on entry, so what the recompute wrote into them is dropped."""
        flags = [(m, m.training) for m, _ in self._modes]
        for m, was in self._modes:
            if m.training != was:
                m.training = was  # this module only: its children have their own entries
        current = [getattr(m, n) for m, n, *_ in self._buffers]
        for m, n, _, _, before in self._buffers:
            setattr(m, n, before.clone())
        try:
            yield
        finally:
            for (m, n, *_), cur in zip(self._buffers, current):
                setattr(m, n, cur)
            for m, now in flags:
                m.training = now


def snapshot(module: nn.Module) -> BlockState:
    """The ``training`` flags of ``module`` and its submodules, and a copy of their buffers, before a block
    call's forward; call :meth:`BlockState.forward_done` after it."""
    return BlockState(list(module.modules()))
