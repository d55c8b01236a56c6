"""``param.grad`` for Lightning's hooks when a node's processes share one gradient accumulator (data parallel).

Each process shows its hooks a copy-on-write mapping of the node's file
(:meth:`~..store.shared.SharedRegions.private_mapping`), and :meth:`HookGradViews.commit` brings the edits into the
shared accumulators once; as under DDP, every rank must make the same edit (docs/internals/data-parallel.md, "Hooks
that edit ``param.grad``").
"""

from __future__ import annotations

import mmap

import torch

from ..store.host import HostStore
from ..store.regions import Region
from ..store.shared import SlabOwnership


class HookGradViews:
    """Per optimizer step (or per backward, for ``on_after_backward``): the private views of the node's shared
    gradient accumulators (``store.shared``) that ``param.grad`` shows, and the commit of the hooks' edits.

    Raises:
        ValueError: ``store.shared`` is ``None`` (not a node-shared store).
    """

    def __init__(self, store: HostStore, ownership: SlabOwnership):
        if store.shared is None:
            raise ValueError("HookGradViews needs a node-shared store (data parallel).")
        self.store = store
        self.shared = store.shared
        self.ownership = ownership
        self._mapping: mmap.mmap | None = None
        self._flat: dict[int, torch.Tensor] = {}

    def open(self) -> dict[int, torch.Tensor]:
        """A fresh copy-on-write mapping; returns per slab index its flat fp32 ``[trainable numel]`` accumulator
        view in it (slabs without trainable parameters left out). Call once every owner's adds are in."""
        self.close()
        self._mapping = self.shared.private_mapping()
        self._flat = {s.index: self.shared.region(s.index, Region.grad_accum, self._mapping)
                      for s in self.store.slabs if s.trainable_numel}
        return self._flat

    def commit(self) -> None:
        """Bring the hooks' edits of the views into the shared accumulators, once: owners find their written
        slabs (``/proc/self/pagemap``); one all-reduce (max) of that flag, also the barrier after every rank's hooks;
        if any, owners copy, a barrier, every rank drops its private pages (``madvise(MADV_DONTNEED)``).
        A collective: every rank of the node calls it at the same points (nothing while no views are open)."""
        if self._mapping is None:
            return
        own = self.ownership
        written = [si for si, flat in self._flat.items() if own.owns(si) and self.shared.written_privately(flat)]
        flag = torch.tensor([1.0 if written else 0.0])
        own.all_reduce(flag, "max")
        if flag.item() == 0.0:
            return
        for si in written:
            slab = self.store.slabs[si]
            with slab.lock:
                assert slab.grad_accum is not None
                slab.grad_accum.copy_(self._flat[si])
        own.sync()
        self._mapping.madvise(mmap.MADV_DONTNEED)

    def storage_ptr(self, i: int) -> int | None:
        """Address of slab ``i``'s view storage while views are open (``None`` otherwise)."""
        flat = self._flat.get(i)
        return flat.untyped_storage().data_ptr() if flat is not None else None

    def close(self) -> None:
        """Forget the views (the mapping goes when the last tensor over it is freed, with its private pages)."""
        self._mapping, self._flat = None, {}
