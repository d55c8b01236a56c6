"""The node-shared host store of a data-parallel run (the engine's ``NodeShare``, ``store/shared.py``).

Every local rank maps one file under ``/dev/shm`` that holds the node's fp32 masters, gradient accumulators
and AdamW moments; local rank 0 creates it and writes the initial weights, the file is unlinked once every
local rank has mapped it, and the first node's weights are broadcast to the other nodes' copies (as
``DistributedDataParallel`` broadcasts rank 0's module state).
"""

from __future__ import annotations

import os
import uuid
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from ..store.host import HostStore
from ..store.shared import (SharedMemoryTooSmall, SharedRegions, SharedWireImages, SlabOwnership, balance, check_shm,
                            shared_state_bytes)
from .groups import ProcessGroups

SHM_DIR = "/dev/shm"
T = TypeVar("T")


class NodeStore:
    """Builds the shared regions and the slab owners for one process (a collective object: every rank of the
    run constructs it and calls its methods at the same points).

    Args:
        groups: the run's process groups.
        timeout_s: seconds a rank waits for a slab's owner before it gives up (the strategy's ``timeout``).
        pin: page-lock the shared mapping: the strategy's ``pin_memory`` on CUDA (``None``: try, pageable with a
            warning if that fails), ``False`` on CPU.
        directory: the tmpfs holding the file (default ``/dev/shm``).
    """

    def __init__(self, groups: ProcessGroups, timeout_s: float, pin: bool | None = False, directory: str = SHM_DIR):
        self.groups = groups
        self.timeout_s = timeout_s
        self.pin = pin
        box = [uuid.uuid4().hex[:12] if groups.global_rank == 0 else None]
        with groups.guard("the setup of the node-shared store"):
            dist.broadcast_object_list(box, src=0, group=groups.host)  # one name per run, on every node
        self.path = os.path.join(directory, f"megatrain-{box[0]}-node{groups.node_rank}")
        self.directory = directory
        self._images = 0  # wire-image files made (one per precision configuration)

    def _barrier(self) -> None:
        with self.groups.guard("a barrier of the node's ranks"):
            dist.barrier(group=self.groups.node)

    def check_shm(self, nbytes: int) -> None:
        """Preflight on every rank of every node (a collective over all ranks): each checks its node's
        ``/dev/shm`` for ``nbytes``; if any is too small, every rank raises, quoting each one that is (so no
        rank goes on to wait for a node that stopped).

        Raises:
            SharedMemoryTooSmall: with the numbers, the ranks and nodes, and what to change."""
        try:
            check_shm(nbytes, self.directory)
            mine = None
        except SharedMemoryTooSmall as err:
            mine = str(err)
        box: list = [None] * self.groups.world_size
        with self.groups.guard("the shared-memory check"):
            dist.all_gather_object(box, (self.groups.node_rank, mine), group=self.groups.host)
        bad = [(r, node, msg) for r, (node, msg) in enumerate(box) if msg is not None]
        if bad:
            where = ", ".join(sorted({f"node {node}" for _, node, _ in bad}))
            raise SharedMemoryTooSmall(
                f"megatrain: shared memory too small on {where} (ranks {', '.join(str(r) for r, _, _ in bad)}); "
                f"nothing was allocated. {bad[0][2].removeprefix('megatrain: ')}")

    def regions(self, layout: list[tuple[int, int]]) -> SharedRegions:
        """Create (local rank 0) and map the node's file for ``layout``.

        Raises:
            SharedMemoryTooSmall: ``/dev/shm`` cannot hold it (checked on every local rank before anything
                is allocated)."""
        self.check_shm(shared_state_bytes(layout))
        return self._create_and_map(self.path, lambda create: SharedRegions.map(self.path, layout, create, self.pin))

    def wire_images(self, nbytes: list[int]) -> SharedWireImages:
        """Create (local rank 0) and map a new wire-image file (``nbytes`` per slab), as :meth:`regions`.

        Raises:
            SharedMemoryTooSmall: ``/dev/shm`` cannot hold it."""
        self.check_shm(sum(nbytes) + 64 * len(nbytes))
        self._images += 1
        path = f"{self.path}-wire{self._images}"
        return self._create_and_map(path, lambda create: SharedWireImages(path, nbytes, create, self.pin,
                                                                          self.timeout_s))

    def _create_and_map(self, path: str, make: Callable[[bool], T]) -> T:
        """``make(create=True)`` on local rank 0, then ``make(create=False)`` on the others once the file exists;
        the file is unlinked once every local rank has mapped it (the mappings keep the memory: nothing is left
        behind after the run, whatever way it ends)."""
        first = self.groups.local_rank == 0
        obj = make(True) if first else None
        self._barrier()
        if not first:
            obj = make(False)
        self._barrier()
        if first:
            os.unlink(path)
        assert obj is not None
        return obj

    def setup(self, store: HostStore) -> SlabOwnership:
        """After the store is built: the writer's weights reach every rank (and node), then the owners."""
        g = self.groups
        self._barrier()
        if g.num_nodes > 1 and g.local_rank == 0:
            with g.guard("the broadcast of the initial weights to the other nodes"):
                for slab in store.slabs:
                    dist.broadcast(slab.master, src=0, group=g.leaders)
        self._barrier()
        owner = balance([s.trainable_numel or s.numel for s in store.slabs], g.local_world_size)
        assert store.shared is not None

        def all_reduce(t: torch.Tensor, op: str) -> None:
            with g.guard("the all-reduce of the owners' norms and inf checks"):
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=g.node)

        return SlabOwnership(owner, g.local_rank, store.shared.counts, self.timeout_s,
                             global_rank_of=lambda r: g.node_rank * g.local_world_size + r,
                             all_reduce=all_reduce, sync=self._barrier, exited=lambda r: r in g.peers.dead())
