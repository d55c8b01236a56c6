"""Module buffers a block's forward changes (BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``),
changed once per forward although the block runs again in backward.

A recomputed block runs its forward twice per step (the forward, then its recompute in backward), so a buffer its
forward updates in training mode would be updated twice where plain PyTorch updates it once, and the recompute
would see the updated value where the forward saw the old one. :func:`snapshot` keeps, for a block call whose
forward changed a buffer, a copy of the buffer values the forward started from; :meth:`BufferSnapshot.replayed`
runs the recompute on a fresh copy of those values and puts the forward's results back afterwards, so the
recompute sees what the forward saw (same output, same gradients) and the module keeps exactly one update.

Decoder layers of Hugging Face models hold no buffers (rotary tables live on the model), so for them
:func:`snapshot` returns ``None`` and costs one walk over the block's submodules.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class BufferSnapshot:
    """The buffers of one block call as its forward found them.

    Args:
        entries: ``(submodule, buffer name, buffer tensor)`` of every buffer of the block.
    """

    def __init__(self, entries: list[tuple[nn.Module, str, torch.Tensor]]):
        self._entries = [(m, n, b, b._version, b.clone()) for m, n, b in entries]

    def changed(self) -> bool:
        """Whether the forward changed a buffer: updated it in place or assigned a new tensor to it."""
        return any(getattr(m, n) is not b or b._version != v for m, n, b, v, _ in self._entries)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Within the context the buffers hold (copies of) the values the forward started from; on exit each
        buffer is the tensor it was on entry again, so what the recompute wrote into them is dropped."""
        current = [getattr(m, n) for m, n, *_ in self._entries]
        for m, n, _, _, before in self._entries:
            setattr(m, n, before.clone())
        try:
            yield
        finally:
            for (m, n, *_), cur in zip(self._entries, current):
                setattr(m, n, cur)


def snapshot(module: nn.Module) -> BufferSnapshot | None:
    """A copy of ``module``'s buffers (those of its submodules too) before a block call's forward, or ``None``
    when it has none. Keep it only if :meth:`BufferSnapshot.changed` says the forward changed one."""
    entries = [(m, n, b) for m in module.modules() for n, b in m.named_buffers(recurse=False) if b is not None]
    return BufferSnapshot(entries) if entries else None
