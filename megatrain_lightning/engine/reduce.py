"""Gradient averaging across data-parallel ranks, one gradient batch (one block's gradients of one slab) at a time,
delivered to the slab's owner only.

Semantics of ``torch.nn.parallel.DistributedDataParallel``: the slab's owner receives the mean over all W ranks,
so W processes with micro-batch b step like one with W*b. A parameter without gradient on a rank (an MoE expert)
counts as zeros, as with DDP's ``find_unused_parameters``; it stays ``None`` (no AdamW update) only if no rank had
one, which one presence flag per parameter decides. Overview: docs/internals/data-parallel.md, "Gradients".

Per batch, with N local ranks per node (the slab's owner is local rank r on every node):

1. the presence flags (``[n_params]``) are summed over all ranks, so every rank keeps the owner's bookkeeping;
2. the gradients are summed onto the node's owner (``reduce`` to rank ``node * N + r``); a non-owner receives
   nothing (on CUDA it copies only the flags to the host);
3. with several nodes the owners all-reduce the node sums, so every node's owner holds the same sum, bitwise;
4. the owner divides by W.

Sums are fp32 whatever the wire dtype (where and how: the overview): W ranks' bf16 gradients summed in bf16 lose up
to ``log2(W)`` more bits than the one rounding of the mean. Every rank sends the same batches in the same order (a
batch lists every trainable parameter of the call), so the collectives match without negotiation. The groups
(``parallel/groups.py``) serve gradients only: these never interleave with the main thread's collectives.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist


class GradReducer:
    """Averages gradient batches over all ranks onto each slab's owner.

    Args:
        everyone: process group of all ranks (the presence flags).
        node: process group of this node's ranks (sums onto the owner).
        cross: process group of the ranks with this local rank on every node, or ``None`` with one node.
        node_rank / local_world_size: this process's node and the ranks per node (the owner's global rank is
            ``node_rank * local_world_size + owner``).
        device_side: reduce on the device before the D2H copy (NCCL) instead of on the host after it.
        guard: ``guard(what)``, a context manager around each batch's collectives that turns a transport error (a
            dead rank, a timeout) into one naming that rank (``ProcessGroups.guard``); default: errors unchanged.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised (at construction).
        PeerFailure: (from ``guard``) in :meth:`reduce_host` / :meth:`reduce_device`: another rank died or hangs.
    """

    def __init__(self, everyone: Any, node: Any, cross: Any, node_rank: int, local_world_size: int,
                 device_side: bool = False, guard: Callable[[str], ContextManager[None]] | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("megatrain: gradient reduction needs torch.distributed initialised "
                               "(the strategy's setup_environment does it).")
        self.everyone, self.node, self.cross = everyone, node, cross
        self.world_size = dist.get_world_size(everyone)
        self.node_rank, self.local_world_size = node_rank, local_world_size
        self.device_side = device_side
        self.guard = guard if guard is not None else (lambda what: contextlib.nullcontext())

    def pack(self, grads: Sequence[torch.Tensor | None], shapes: Sequence[torch.Size], device: torch.device,
             dtype: torch.dtype) -> list[torch.Tensor]:
        """The tensors of one batch as every rank sends them: each gradient (zeros of ``shapes[i]`` where
        ``None``), then the presence flags ``[len(grads)]`` (1 where this rank has a gradient), all ``dtype``."""
        out = [g if g is not None else torch.zeros(s, dtype=dtype, device=device) for g, s in zip(grads, shapes)]
        flags = torch.ones(len(grads), dtype=dtype, device=device)  # made on the device: no host copy, no sync
        for i, g in enumerate(grads):
            if g is None:
                flags[i] = 0.0
        return [*out, flags]

    def _reduce(self, grads: torch.Tensor, flags: torch.Tensor, owner: int, mine: bool) -> None:
        """Steps 1-4 of the module docstring on flat ``grads`` and ``flags`` (same device), in place."""
        with self.guard("the gradient reduce"):
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.everyone)
            dist.reduce(grads, dst=self.node_rank * self.local_world_size + owner, op=dist.ReduceOp.SUM,
                        group=self.node)
            if mine and self.cross is not None:
                dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=self.cross)
        if mine:
            grads.div_(self.world_size)

    def reduce_device(self, flat: torch.Tensor, n_flags: int, owner: int,
                      mine: bool) -> tuple[torch.Tensor, int | None]:
        """NCCL: average the packed batch ``flat`` (``[n]``, the wire dtype: gradients, then ``n_flags`` presence
        flags) onto the owner, with the D2H stream current (any device: gloo runs it on CPU tensors).

        Returns:
            ``(out, keep)``: ``out`` is ``[n]`` fp32 (``flat`` itself when it is fp32, else a fp32 copy made on
            the current stream) holding, on the owner, the mean gradients and everywhere the summed flags;
            ``keep`` is how many trailing elements of ``out`` the copy to the host needs: ``None`` (all) on the
            owner, ``n_flags`` elsewhere."""
        out = flat if flat.dtype == torch.float32 else flat.float()
        self._reduce(out[: out.numel() - n_flags], out[out.numel() - n_flags :], owner, mine)
        return out, None if mine else n_flags

    def reduce_host(self, tensors: Sequence[torch.Tensor], owner: int, mine: bool) -> list[torch.Tensor]:
        """gloo: average the host tensors of a batch (:meth:`pack`) onto the owner. Returns new fp32 tensors of
        the same shapes (views of one flat copy); on a non-owner only the last (the summed flags) is meaningful."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        n_flags = tensors[-1].numel()
        self._reduce(flat[: flat.numel() - n_flags], flat[flat.numel() - n_flags :], owner, mine)
        return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    @staticmethod
    def present(tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per gradient of a reduced batch: whether any rank had one (its summed presence flag > 0)."""
        return [f > 0 for f in tensors[-1].tolist()]
