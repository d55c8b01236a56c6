"""Per-backward sums of the gradients of a parameter read by several blocks (tied embeddings).

Why (docs/architecture.md, "Fidelity"): autograd sums a parameter's contributions of one backward before adding
them into ``.grad``, so after two micro-batches a tied embedding holds ``(a1 + b1) + (a2 + b2)``; adding each
contribution as it arrives would give ``((a1 + b1) + a2) + b2``, a last-bit difference. Such parameters' sums of
one backward are kept apart and added when the backward is over (the next one starts, or the gradients are waited
for). In the first backward of an accumulation window the accumulator itself holds the sum; later ones need a
separate fp32 buffer of the parameter's size.

All methods run on the D2H worker (or after waiting for it) with the slab's lock available; not safe to call
concurrently with each other.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..store.host import Slab
from .row_grads import RowGrad


def _copy(dst: torch.Tensor, g: "torch.Tensor | RowGrad") -> None:
    g.copy_to(dst) if isinstance(g, RowGrad) else dst.copy_(g)


def _add(dst: torch.Tensor, g: "torch.Tensor | RowGrad") -> None:
    g.add_to(dst) if isinstance(g, RowGrad) else dst.add_(g)


class SharedGradSums:
    """Sums the gradients of shared parameters per backward before adding them into the accumulators.

    Args:
        blocks: the model's blocks; a parameter their references list in two or more blocks is shared.
        enabled: ``False`` when the accumulators live on disk (``offload_optimizer="nvme"``): every
            gradient is added as it arrives.
    """

    def __init__(self, blocks: Iterable, enabled: bool = True):
        users: dict[int, set[int]] = {}
        where: dict[int, tuple[int, int]] = {}
        for blk in blocks:
            for ref in blk.params:
                users.setdefault(id(ref.param), set()).add(blk.index)
                where[id(ref.param)] = (ref.slab, ref.index)
        # (slab, entry) of every shared parameter
        self.shared = frozenset([where[p] for p, b in users.items() if len(b) > 1]) if enabled else frozenset()
        # (slab, entry) -> the running sum of this backward: None while the accumulator itself holds it
        # (the window's first gradient of the parameter), else a separate fp32 tensor
        self.open: dict[tuple[int, int], torch.Tensor | None] = {}

    def add(self, slab: Slab, i: int, acc: torch.Tensor, g: "torch.Tensor | RowGrad") -> None:
        """Add gradient ``g`` of entry ``i`` into its accumulator view ``acc`` (or into this backward's sum).

        Sets ``slab.has_grad[i]`` as a plain add does. ``g``: a host tensor of the entry's shape or a
        :class:`~.row_grads.RowGrad`."""
        k = (slab.index, i)
        if k in self.open:
            part = self.open[k]
            _add(acc if part is None else part, g)
        elif not slab.has_grad[i]:
            _copy(acc, g)  # the window's first gradient: copied
            slab.got_grad(i)
            if k in self.shared:
                self.open[k] = None
        elif k in self.shared:
            self.open[k] = torch.empty(g.shape, dtype=torch.float32)
            _copy(self.open[k], g)
        else:
            _add(acc, g)

    def close_slab(self, slab: Slab) -> None:
        """The backward is over for ``slab``: add each separate sum into its accumulator."""
        keys = [k for k in self.open if k[0] == slab.index]
        if not keys:
            return
        with slab.lock:
            for k in keys:
                part = self.open.pop(k)
                if part is not None:
                    slab.view(slab.grad_accum, k[1]).add_(part)

    def close_all(self, slabs: list[Slab]) -> None:
        """The backward is over: add every open sum into its accumulator."""
        for si in sorted({k[0] for k in self.open}):
            self.close_slab(slabs[si])
