"""Who writes what of a directory checkpoint in a data-parallel run (``checkpoint/directory.py``'s ``Cooperation``).

The first node's ranks write, each the weights and AdamW state of the slabs it owns, from the node-shared store
(other nodes hold the same bytes); buffers are local rank 0's. Outcomes and the temporary directory's name travel
by ``all_gather_object`` over the gloo group of all ranks: no tensor is ever gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..store.host import HostStore
from ..store.shared import SlabOwnership
from .groups import ProcessGroups


class CheckpointWriters:
    """The :class:`~megatrain_lightning.checkpoint.directory.Cooperation` of one process."""

    def __init__(self, groups: ProcessGroups, store: HostStore, ownership: SlabOwnership):
        self.groups, self.store, self.ownership = groups, store, ownership
        self.rank = groups.global_rank
        self.writer = groups.local_rank if groups.node_rank == 0 else None

    def writes(self, t: torch.Tensor) -> bool:
        if self.writer is None:
            return False
        try:
            si, _ = self.store.locate(t)
        except KeyError:  # not a parameter of the store (a buffer): local rank 0
            return self.writer == 0
        return self.ownership.owner[si] == self.writer

    def exchange(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.groups.world_size
        # every rank writes its own slabs, so a save that only rank 0 runs stops here: say so in the error
        with self.groups.guard("the checkpoint writers' exchange (trainer.save_checkpoint writes from every rank: "
                               "call it on all ranks, not only under `if trainer.is_global_zero`)"):
            dist.all_gather_object(out, obj, group=self.groups.host)
        return out
