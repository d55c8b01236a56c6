"""Gradient averaging across data-parallel ranks, one gradient batch (one block's gradients of one slab) at a time.

Semantics are those of ``torch.nn.parallel.DistributedDataParallel``: after the reduce every rank holds
the mean over ranks of the batch's gradients, so a run of W processes with micro-batch b steps like one
process with micro-batch W*b (the loss being a mean over the micro-batch). A parameter that got no
gradient on a rank (``None``: an MoE expert no token of that rank was routed to) counts as zeros in the
mean, as DDP's ``find_unused_parameters`` does; it stays ``None`` (no AdamW update, as in plain PyTorch)
only if no rank produced a gradient for it. To decide that, every batch carries one presence flag per
parameter, reduced with the gradients.

Every rank sends the same batches in the same order (the backward visits the blocks in the same order
on every rank, and a batch lists every trainable parameter of the block call whether or not it got a
gradient), so the collectives match without any negotiation.

Where the reduce runs:

* ``device_side`` (NCCL, CUDA): on the packed device tensor, on the D2H stream before its copy to the
  host (:meth:`CUDATransport.stage_grads` calls :meth:`GradReducer.all_reduce_`); the compute stream is
  not blocked, so the next block's backward overlaps the collective;
* otherwise (gloo; CPU, or CUDA with ``process_group_backend="gloo"``): on the host tensors, by the D2H
  worker thread before it adds them into the accumulators (:meth:`GradReducer.reduce_host`), which also
  overlaps the next block's backward on the compute thread.

The collectives run on a process group of their own (``group``), so that the D2H worker's reduces
never interleave with collectives the main thread issues on Lightning's default group (``barrier``,
``self.log(..., sync_dist=True)``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist


class GradReducer:
    """Averages gradient batches over the ranks of ``group`` (sum, then divide by the group's size).

    Args:
        group: the ``torch.distributed`` process group the gradients are reduced over (all data-parallel
            ranks); created by the strategy, used only for gradients.
        device_side: reduce on the device before the D2H copy (NCCL) instead of on the host after it.
        guard: ``guard(what)``, a context manager around each collective that turns a transport error (a rank
            died: "Connection closed by peer", or a timeout) into one naming that rank
            (``ProcessGroups.guard``, ``parallel/faults.py``); default: errors pass unchanged.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised (at construction).
        PeerFailure: (from ``guard``) in :meth:`all_reduce_` when another rank died or stopped answering.
    """

    def __init__(self, group: Any, device_side: bool = False,
                 guard: Callable[[str], ContextManager[None]] | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("megatrain: gradient reduction needs torch.distributed initialised "
                               "(the strategy's setup_environment does it).")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.device_side = device_side
        self.guard = guard if guard is not None else (lambda what: contextlib.nullcontext())
        self.seconds = 0.0  # time spent inside the collectives (host side), for the step's stats

    def pack(self, grads: Sequence[torch.Tensor | None], shapes: Sequence[torch.Size], device: torch.device,
             dtype: torch.dtype) -> list[torch.Tensor]:
        """The tensors of one batch as every rank sends them: each gradient (zeros of ``shapes[i]`` and
        ``dtype`` on ``device`` where it is ``None``), then one presence flag per gradient (shape
        ``[len(grads)]``, ``dtype``: 1 where this rank has a gradient)."""
        out = [g if g is not None else torch.zeros(s, dtype=dtype, device=device) for g, s in zip(grads, shapes)]
        out.append(torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=dtype, device=device))
        return out

    def all_reduce_(self, flat: torch.Tensor) -> None:
        """Average ``flat`` (any shape and floating dtype, on the group's device) over the ranks, in place."""
        t0 = time.perf_counter()
        with self.guard("the gradient all-reduce"):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat.div_(self.world_size)
        self.seconds += time.perf_counter() - t0

    def reduce_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Average the host tensors of a batch (as made by :meth:`pack`) over the ranks: one collective on a
        flat fp32 copy (gloo reduces one tensor per call). Returns new tensors of the same shapes."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self.all_reduce_(flat)
        out, off = [], 0
        for t in tensors:
            out.append(flat[off : off + t.numel()].view(t.shape))
            off += t.numel()
        return out

    @staticmethod
    def unpack(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Split a reduced batch into its gradients, ``None`` where no rank had one (presence flag 0)."""
        *grads, present = tensors
        flags = present.tolist()
        return [g if f > 0 else None for g, f in zip(grads, flags)]
