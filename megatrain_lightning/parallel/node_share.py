"""The node-shared host store of a data-parallel run (the engine's ``NodeShare``, ``store/shared.py``): one file
under ``/dev/shm`` per node with the node's fp32 masters, gradient accumulators and AdamW moments (with the NVMe
tier, what stays in RAM: :func:`nvme_for_rank`); docs/internals/data-parallel.md, "One copy of the state per node".
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from ..store.host import HostStore
from ..store.nvme import NVMeConfig
from ..store.regions import Region
from ..store.shared import (SharedMemoryTooSmall, SharedRegions, SharedWireImages, SlabOwnership, check_shm, owners,
                            shared_state_bytes)
from .faults import PeerFailure
from .groups import ProcessGroups

SHM_DIR = "/dev/shm"
T = TypeVar("T")


class NodeStore:
    """Builds the shared regions and the slab owners for one process (a collective object: every rank constructs
    it and calls its methods at the same points).

    Args:
        groups: the run's process groups.
        pin: page-lock the shared mapping: the strategy's ``pin_memory`` on CUDA, ``False`` on CPU.

    A rank waits for a slab's owner up to the strategy's ``timeout`` (30 minutes without one) before it gives up.
    """

    def __init__(self, groups: ProcessGroups, pin: bool | None = False):
        self.groups = groups
        self.timeout_s = groups.timeout_s if groups.timeout_s is not None else 1800.0
        self.pin = pin
        box = [uuid.uuid4().hex[:12] if groups.global_rank == 0 else None]
        with groups.guard("the setup of the node-shared store"):
            dist.broadcast_object_list(box, src=0, group=groups.host)  # one name per run, on every node
        self.path = os.path.join(SHM_DIR, f"megatrain-{box[0]}-node{groups.node_rank}")
        self._images = 0  # wire-image files made (one per precision configuration)

    def _barrier(self) -> None:
        with self.groups.guard("a barrier of the node's ranks"):
            dist.barrier(group=self.groups.node)

    def check_shm(self, nbytes: int) -> None:
        """Check every node's ``/dev/shm`` for ``nbytes`` (a collective over all ranks); if any is too small, every
        rank raises, so no rank waits for a node that stopped.

        Raises:
            SharedMemoryTooSmall: naming the nodes and ranks."""
        try:
            check_shm(nbytes, SHM_DIR)
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
            SharedMemoryTooSmall: ``/dev/shm`` cannot hold it (checked before anything is allocated)."""
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
                                                                          self.timeout_s, PeerFailure))

    def _create_and_map(self, path: str, make: Callable[[bool], T]) -> T:
        """``make(create=True)`` on local rank 0, then ``make(create=False)`` on the others; the file is unlinked
        once every local rank has mapped it, so nothing is left behind however the run ends."""
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
        """After the store is built: the writer's weights reach every rank (and node), then the owners. Masters
        on disk: each owner's are written before the others open its files."""
        g = self.groups
        if store.nvme is not None:
            store.nvme.wait_io()
        self._barrier()
        if store.nvme is not None:
            store.nvme.open_remote()
        if g.num_nodes > 1 and g.local_rank == 0:
            with g.guard("the broadcast of the initial weights to the other nodes"):
                for slab in store.slabs:
                    dist.broadcast(slab.master, src=0, group=g.leaders)
        self._barrier()
        owner = owners([(s.numel, s.trainable_numel) for s in store.slabs], g.local_world_size)
        assert store.shared is not None

        def all_reduce(t: torch.Tensor, op: str) -> None:
            with g.guard("the all-reduce of the owners' norms and inf checks"):
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=g.node)

        return SlabOwnership(owner, g.local_rank, store.shared.counts, self.timeout_s,
                             global_rank_of=lambda r: g.node_rank * g.local_world_size + r,
                             all_reduce=all_reduce, sync=self._barrier, exited=lambda r: r in g.peers.dead(),
                             failure=PeerFailure)


def nvme_for_rank(nvme: NVMeConfig, groups: ProcessGroups) -> NVMeConfig:
    """This process's NVMe settings in a data-parallel run: its own store directory
    (``megatrain_store_rank<global rank>`` under ``nvme_path``) for the slabs it owns (other ranks' masters are read
    from ``peer_dirs``), and ``host_memory_limit // local_world_size`` bytes for its window. With
    ``offload_params="cpu"`` the masters stay in the node-shared RAM store.

    Raises:
        NotImplementedError: ``offload_params="nvme"`` on several nodes (the initial weights' broadcast is written
            for masters in RAM), or with ``offload_optimizer="cpu"``."""
    if Region.master in nvme.kinds and (groups.num_nodes > 1 or Region.grad_accum not in nvme.kinds):
        raise NotImplementedError(
            "megatrain: offload_params='nvme' (fp32 masters on disk) with several processes runs on one node with "
            f"offload_optimizer='nvme' for now; with devices={groups.local_world_size} x num_nodes={groups.num_nodes}"
            f" and offload_optimizer={'nvme' if Region.grad_accum in nvme.kinds else 'cpu'!r} use offload_params='cpu' "
            "with offload_optimizer='nvme' (masters once per node in shared memory, 4 bytes/param; gradient "
            "accumulators and AdamW states, 12 bytes/param, on each owner's disk), keep everything in host RAM "
            "(strategy='megatrain'), or train on one device (docs/architecture.md, 'Several GPUs and nodes').")
    first = groups.node_rank * groups.local_world_size
    return dataclasses.replace(nvme, store_dir=f"megatrain_store_rank{groups.global_rank}",
                               host_memory_limit=nvme.host_memory_limit // groups.local_world_size,
                               share=(groups.local_rank, groups.local_world_size),
                               peer_dirs=tuple(f"megatrain_store_rank{first + r}"
                                               for r in range(groups.local_world_size)),
                               run_dirs=tuple(f"megatrain_store_rank{r}" for r in range(groups.world_size)))


def weights_written(groups: ProcessGroups, store: HostStore) -> None:
    """After every rank wrote the same weights into the store (a checkpoint load, a new ``setup``), with the masters
    on disk: each owner's writes reach its files, the node's ranks meet, and window copies of other ranks' masters
    are dropped. Masters in RAM: nothing to do. A collective either way: call it on every rank."""
    if store.nvme is None or not store.masters_on_disk:
        return
    store.nvme.wait_io()
    with groups.guard("a barrier of the node's ranks after writing weights"):
        dist.barrier(group=groups.node)
    for i in range(len(store.slabs)):
        store.master_changed_elsewhere(i)
