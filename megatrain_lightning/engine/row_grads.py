"""Row gradients of an embedding lookup: the rows its tokens read, not the whole ``[V, H]`` table, with torch's
sparse embedding backward (docs/internals/streaming.md, "Gradients to the host": why, when, the bytes moved).

Bitwise the dense path's numbers (tests/test_row_grads.py): like torch's dense CPU backward, :class:`RowGrad` sums
each row id's contributions of one micro-batch in token order from zero, then adds each sum once. Not under data
parallel (its collectives take dense gradients).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def use_row_grads(module: torch.nn.Embedding, tokens: int, wire: torch.dtype) -> bool:
    """Whether the weight of ``module`` (an embedding lookup: ``engine.recompute_policy.is_lookup``) trains and
    ``tokens`` (``input.numel()``) rows plus their ids (``tokens * (H + 8 / wire bytes)`` elements of ``wire``, the
    gradients' dtype on the D2H link) are fewer than the dense ``V * H``."""
    w = module.weight
    if not w.requires_grad or w.dim() != 2:
        return False
    rows, width = w.shape
    return tokens * (width + 8 // wire.itemsize) < rows * width  # a row id: 8 bytes reinterpreted as wire elements


@contextlib.contextmanager
def sparse_lookup(module: torch.nn.Embedding) -> Iterator[None]:
    """Run ``module`` with torch's sparse embedding backward; the forward output is unchanged."""
    before = module.sparse
    module.sparse = True
    try:
        yield
    finally:
        module.sparse = before


def lookup_context(module: torch.nn.Module, tensors: list[torch.Tensor], wire: torch.dtype,
                   dense_only: bool) -> contextlib.AbstractContextManager:
    """The context a call of ``module`` with tensor arguments ``tensors`` (the first: the token ids) runs in:
    :func:`sparse_lookup` for an embedding whose gradient goes to the host as rows (:func:`use_row_grads`), else
    none; none with ``dense_only`` too (the gradient is averaged over ranks, or the call is not a lookup whose graph
    the engine keeps)."""
    if (dense_only or not isinstance(module, torch.nn.Embedding) or module.max_norm is not None or not tensors
            or not use_row_grads(module, tensors[0].numel(), wire)):
        return contextlib.nullcontext()
    return sparse_lookup(module)


def dense(g: torch.Tensor | None) -> torch.Tensor | None:
    """``g`` as autograd returns it to the user (``torch.autograd.grad`` on an embedding weight): dense."""
    return g.to_dense() if g is not None and g.is_sparse else g


def to_wire(g: torch.Tensor, wire: torch.dtype) -> list[torch.Tensor]:
    """A sparse COO weight gradient ``[V, H]`` (uncoalesced: one entry per token) as the two device tensors the
    D2H link carries: the rows ``[N, H]`` (autograd's dtype; the copy converts them to ``wire``) and the row ids
    ``[N]`` int64 reinterpreted as ``[N * 8 / wire bytes]`` elements of ``wire`` (their bytes copied unchanged)."""
    ids = g._indices()[0].contiguous()
    return [g._values(), ids.view(wire)]


class RowGrad:
    """On the host, a ``[V, H]`` (``shape``, the parameter's) gradient that is zero outside the rows ``ids``
    (``[N]`` int64, token order, repeats allowed) whose contributions are ``values`` (``[N, H]``, any float dtype);
    ``host``: the two host tensors :func:`to_wire` sent, as they arrived (``values`` then the ids' bytes)."""

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
