"""The process groups of a data-parallel megatrain run, created once ``torch.distributed`` is initialised, in the
same order on every rank (what each group carries: docs/internals/data-parallel.md, the table of files; why each
subgroup is one group of a partition of the world, every rank creating every group: "Groups on CUDA" there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ContextManager

import torch.distributed as dist

from .faults import Peers


@dataclass
class ProcessGroups:
    """Ranks and groups of one process.

    Attributes:
        global_rank / world_size: this process among all (``node_rank * local_world_size + local_rank``).
        local_rank / local_world_size: this process among its node's.
        node_rank / num_nodes: its node.
        backend: the default group's backend (``"nccl"`` or ``"gloo"``).
        grads, host, node, leaders, node_grads, cross_grads: the groups (module docstring; ``leaders``:
            ``None`` off local rank 0; ``cross_grads``: ``None`` with one node).
        peers: every rank's host and process (``parallel/faults.py``).
        timeout_s: seconds a collective of these groups waits for the other ranks (the strategy's ``timeout``).
    """

    global_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    backend: str
    grads: Any
    host: Any
    node: Any
    leaders: Any
    node_grads: Any = None
    cross_grads: Any = None
    peers: Peers | None = None
    timeout_s: float | None = None

    @classmethod
    def create(cls, local_rank: int, local_world_size: int, node_rank: int, num_nodes: int,
               timeout: timedelta | None = None) -> "ProcessGroups":
        """Create the groups (a collective: every rank calls it at the same point). ``timeout``: how long their
        collectives wait (``new_group`` would otherwise give them its 30-minute default, not the default group's).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised, or its world size is not
                ``local_world_size * num_nodes``.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("megatrain: torch.distributed is not initialised (the strategy's setup_environment "
                               "initialises it before setup).")
        world = dist.get_world_size()
        if world != local_world_size * num_nodes:
            raise RuntimeError(
                f"megatrain: torch.distributed has {world} processes but the Trainer asks for devices={local_world_size} "
                f"x num_nodes={num_nodes} = {local_world_size * num_nodes}. Launch as many processes as "
                "Trainer(devices=..., num_nodes=...) says (torchrun --nproc_per_node=devices --nnodes=num_nodes; "
                "SLURM --ntasks-per-node=devices --nodes=num_nodes).")
        backend = str(dist.get_backend())
        # torch 2.13's _new_process_group_helper (torch/distributed/distributed_c10d.py) splits the default NCCL
        # communicator on each member of an NCCL group and on every non-member of any group, not on a member of a
        # gloo group; the splits are matched by call order, so unequal counts hang every rank. Partitions keep
        # them equal: per gloo partition of P groups each rank splits P - 1 times, per NCCL group once.
        ranks_of_node = [[k * local_world_size + i for i in range(local_world_size)] for k in range(num_nodes)]
        ranks_of_local = [[k * local_world_size + r for k in range(num_nodes)] for r in range(local_world_size)]

        def partition(parts: list[list[int]], mine: int, group_backend: str) -> Any:
            """Create every group of ``parts`` (a partition of the ranks) in order; return the ``mine``-th."""
            made = [dist.new_group(ranks=ranks, backend=group_backend, timeout=timeout) for ranks in parts]
            return made[mine]

        grads = dist.new_group(backend=backend, timeout=timeout)
        host = dist.new_group(backend="gloo", timeout=timeout)
        node = partition(ranks_of_node, node_rank, "gloo")
        # local rank 0's group is ``leaders``; the other local ranks' groups balance the splits (unused)
        cross_host = partition(ranks_of_local, local_rank, "gloo")
        leaders = cross_host if local_rank == 0 else None
        node_grads = partition(ranks_of_node, node_rank, backend)
        cross_grads = partition(ranks_of_local, local_rank, backend) if num_nodes > 1 else None
        peers = Peers.gather(host)
        return cls(dist.get_rank(), world, local_rank, local_world_size, node_rank, num_nodes, backend, grads, host,
                   node, leaders, node_grads, cross_grads, peers, timeout.total_seconds() if timeout else None)

    def guard(self, what: str) -> ContextManager[None]:
        """``with groups.guard("the gradient reduce"):`` around collectives (:meth:`~.faults.Peers.guard`)."""
        return self.peers.guard(what, self.timeout_s) if self.peers is not None else contextlib.nullcontext()
