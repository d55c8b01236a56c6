"""Row gradients of an embedding lookup: the rows its tokens read, not the whole ``[V, H]`` table.

An embedding's weight gradient is zero outside the rows its tokens looked up. Dense, it is a
``[V, H]`` tensor on the device (4.2 GB fp32 for a 128k x 8192 table, per micro-batch), copied whole
to the host and added whole into the accumulator. Here the engine runs the lookup with torch's sparse
embedding backward (``F.embedding(..., sparse=True)``), whose gradient holds the looked-up row ids
``[N]`` (int64, one per token that is not ``padding_idx``, in token order) and one gradient row per
token ``[N, H]``; only those cross the D2H link (``N * (H * wire bytes + 8)`` bytes), and the host adds
them into the rows they belong to (:class:`RowGrad`).

Same numbers as the dense gradient: torch's dense CPU backward sums each row's token contributions
in token order starting from zero, then that sum is added into ``.grad`` (or into the other
contribution of a tied weight); :class:`RowGrad` sums the rows of one micro-batch per row id in token
order from zero first (``index_add_``, sequential over the ids) and then adds each sum once, so the
fp32 accumulator is bitwise what the dense path gives (tests/test_row_grads.py).

Used only where it is smaller than the dense gradient (:func:`use_row_grads`) and gradients are not
averaged over ranks (data parallel packs dense gradients for its collectives: the dense path).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _index_elements(wire: torch.dtype) -> int:
    """Elements of ``wire`` that carry one int64 row id on the link (its 8 bytes, reinterpreted)."""
    return 8 // wire.itemsize


def use_row_grads(module: torch.nn.Embedding, tokens: int, wire: torch.dtype) -> bool:
    """Send ``module``'s weight gradient as rows: its weight trains, and ``tokens`` gradient rows plus their
    ids (``tokens * (H + 8 / wire bytes)`` elements of ``wire``) are fewer than the dense ``V * H``.

    Args:
        module: the embedding (a lookup: ``engine.recompute_policy.is_lookup``).
        tokens: number of token ids of the call's input (``input.numel()``).
        wire: dtype of gradients on the D2H link."""
    w = module.weight
    if not w.requires_grad or w.dim() != 2:
        return False
    rows, width = w.shape
    return tokens * (width + _index_elements(wire)) < rows * width


@contextlib.contextmanager
def sparse_lookup(module: torch.nn.Embedding) -> Iterator[None]:
    """Run ``module`` with torch's sparse embedding backward (``module.sparse = True``) inside the block; the
    forward computes the same output (only the gradient's layout changes)."""
    before = module.sparse
    module.sparse = True
    try:
        yield
    finally:
        module.sparse = before


def lookup_context(module: torch.nn.Module, tensors: list[torch.Tensor], wire: torch.dtype,
                   dense_only: bool) -> contextlib.AbstractContextManager:
    """The context a call of ``module`` runs in: :func:`sparse_lookup` for an embedding whose gradient goes to
    the host as rows (:func:`use_row_grads`), else none.

    Args:
        tensors: the call's tensor arguments (the first one: the token ids).
        dense_only: the gradient must stay dense (it is averaged over ranks; or the call is not a lookup whose
            graph the engine keeps)."""
    if (dense_only or not isinstance(module, torch.nn.Embedding) or module.max_norm is not None or not tensors
            or not use_row_grads(module, tensors[0].numel(), wire)):
        return contextlib.nullcontext()
    return sparse_lookup(module)


def dense(g: torch.Tensor | None) -> torch.Tensor | None:
    """``g`` as autograd returns it to the user (``torch.autograd.grad`` on an embedding weight): dense."""
    return g.to_dense() if g is not None and g.is_sparse else g


def to_wire(g: torch.Tensor, wire: torch.dtype) -> list[torch.Tensor]:
    """A sparse COO weight gradient ``[V, H]`` from torch's sparse embedding backward (uncoalesced: one entry
    per token) as the two device tensors the D2H link carries: the rows ``[N, H]`` (autograd's dtype;
    converted to ``wire`` by the copy) and the row ids ``[N]`` int64 reinterpreted as ``[N * 8 / wire
    bytes]`` elements of ``wire`` (the copy moves their bytes unchanged: same dtype, no conversion)."""
    ids = g._indices()[0].contiguous()
    return [g._values(), ids.view(wire)]


class RowGrad:
    """A gradient of shape ``shape`` (``[V, H]``) that is zero outside the rows ``ids`` (``[N]`` int64, in token
    order, repeats allowed) whose contributions are ``values`` (``[N, H]``, any float dtype): on the host,
    after the D2H copy.

    Args:
        host: the two host tensors :func:`to_wire` sent, as they arrived (``values`` then the ids' bytes).
        shape: the dense gradient's shape (the parameter's).
    """

    def __init__(self, host: list[torch.Tensor], shape: torch.Size | tuple[int, ...]):
        values, ids = host
        self.values = values.reshape(-1, *shape[1:])
        self.ids = ids.view(torch.int64)
        self.shape = torch.Size(shape)

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unique ids [U] int64, fp32 row sums [U, H])``: each row id's contributions summed in token order
        from zero, as torch's dense CPU embedding backward sums them."""
        uniq, inverse = torch.unique(self.ids, sorted=True, return_inverse=True)
        sums = torch.zeros((uniq.numel(), *self.shape[1:]), dtype=torch.float32)
        sums.index_add_(0, inverse, self.values.to(torch.float32))
        return uniq, sums

    def copy_to(self, acc: torch.Tensor) -> None:
        """``acc.copy_(dense)``: zeros, then the row sums in their rows."""
        uniq, sums = self.sums()
        acc.zero_()
        acc.index_copy_(0, uniq, sums)

    def add_to(self, acc: torch.Tensor) -> None:
        """``acc.add_(dense)``: each row sum added into its row (the other rows add zero)."""
        uniq, sums = self.sums()
        acc.index_add_(0, uniq, sums)
