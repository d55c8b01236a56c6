"""One run of a block on the compute device: acquire its weights, bind its parameters to them, run, release.

Every block run (evaluation, a container's forward, a training call's forward, recompute and backward) goes through
:class:`BlockRunner` (docs/internals/block-calls.md, "Forward").
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from ..accounting import ByteAccounting


class BlockRunner:
    """Acquire -> bind -> run -> release of a block's weights on the compute device.

    Args:
        slabs: the host store's slabs.
        acct: live-byte accounting.
        acquire: ``acquire(block, backward, training)`` -> slab index -> device buffer (``StreamingEngine.acquire``).
    """

    def __init__(self, slabs: Any, acct: ByteAccounting, acquire: Callable[..., dict[int, torch.Tensor]]):
        self.slabs, self.acct, self._acquire = slabs, acct, acquire

    @contextlib.contextmanager
    def weights(self, blk: Any, backward: bool = False, training: bool = False, timed: bool = True,
                fetch: bool = True, hold: bool = False) -> Iterator[dict[int, torch.Tensor] | None]:
        """The block's device buffers (slab index -> flat buffer; ``None`` when not ``fetch``) for the ``with`` body,
        released after it (``hold``: unless it returns normally; the kept graph releases them). ``timed``: the
        body's seconds count as ``compute_s`` (not for a container, whose forward runs its child blocks)."""
        bufs = self._acquire(blk, backward=backward, training=training) if fetch else None
        t0 = time.perf_counter()
        done = False
        try:
            yield bufs
            done = True
        finally:
            if timed:
                self.acct.add(compute_s=time.perf_counter() - t0)
            if bufs is not None and not (hold and done):
                self.acct.release(bufs)

    @contextlib.contextmanager
    def bind(self, blk: Any, bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor] | None
             ) -> Iterator[None]:
        """For the ``with`` body, point the block's parameters at views of ``bufs`` (slab index -> buffer) or at
        gradient ``leaves`` (by parameter id); in no-grad mode a trainable one's view still requires grad, as in plain
        PyTorch (``F.linear`` picks its kernel by it).

        Raises:
            RuntimeError: a parameter is no longer registered as it was at setup (``ParamRef.registered``: pruning,
                a replaced ``nn.Parameter``).
        """
        saved = []
        try:
            for ref in blk.params:
                if leaves is not None and id(ref.param) in leaves:
                    t = leaves[id(ref.param)]
                else:
                    t = self.view(ref, bufs)
                    t = t if torch.is_grad_enabled() or not ref.param.requires_grad else t.detach().requires_grad_()
                saved.append((ref.owner, ref.attr, ref.registered()))
                ref.owner._parameters[ref.attr] = t
            yield
        finally:
            for owner, attr, p in reversed(saved):
                owner._parameters[attr] = p

    def view(self, ref: Any, bufs: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.slabs[ref.slab].view(bufs[ref.slab], ref.index)

    def leaves(self, refs: Sequence, bufs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One autograd leaf per parameter of ``refs``, keyed by ``id(param)``: a view of its buffer with its own
        version counter (an in-place write to one does not invalidate what autograd saved of another)."""
        return {id(r.param): self.view(r, bufs).data.requires_grad_(True) for r in refs}
