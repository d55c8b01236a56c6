"""The process groups of a data-parallel megatrain run, created once ``torch.distributed`` is initialised.

Lightning's launcher (``_SubprocessScriptLauncher``, or torchrun / SLURM through their cluster environments)
starts the processes and ``MegaTrainStrategy.setup_distributed`` initialises the default group, as
``DDPStrategy`` does. On top of it the strategy creates, in the same order on every rank:

* ``grads``, ``node_grads``, ``cross_grads``: all ranks / this node's ranks / every node's rank with this
  local rank, the device's backend (NCCL on CUDA, gloo on CPU): gradient batches only, reduced by the
  engine's D2H worker or D2H stream (``engine/reduce.py``), never interleaved with the main thread's
  collectives on the default group;
* ``host``: all ranks, gloo: collectives on host tensors whatever the device (configuration check);
* ``node``: the ranks of this node, gloo: the node-shared store's barriers and the owners' partial clipping
  norms and inf checks (``store/shared.py``);
* ``leaders``: local rank 0 of every node, gloo: the first node's initial weights to the other nodes' copies.
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
        grads: the gradient group (see module docstring).
        host: the gloo group for host tensors.
        node: gloo group of this node's ranks.
        leaders: gloo group of every node's local rank 0 (``None`` on the other ranks).
        node_grads: this node's ranks, the device's backend: gradient batches reduced to their owner.
        cross_grads: the ranks of every node with this local rank, the device's backend: owners' all-reduce
            across nodes (``None`` with one node).
        peers: every rank's host and process (``parallel/faults.py``: a failed collective names the dead rank).
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
        """Create the groups (a collective call: every rank calls it at the same point). ``timeout``: how long
        their collectives wait for the other ranks (``torch.distributed.new_group`` would otherwise give them
        its 30-minute default, not the default group's).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised, or its world size is not
                ``local_world_size * num_nodes`` (the launch and the Trainer disagree: the message says
                which values each gave).
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
        grads = dist.new_group(backend=backend, timeout=timeout)
        host = dist.new_group(backend="gloo", timeout=timeout)
        node = leaders = None
        for k in range(num_nodes):  # every rank creates every group, in the same order
            g = dist.new_group(ranks=[k * local_world_size + i for i in range(local_world_size)], backend="gloo",
                               timeout=timeout)
            if k == node_rank:
                node = g
        g = dist.new_group(ranks=[k * local_world_size for k in range(num_nodes)], backend="gloo", timeout=timeout)
        if local_rank == 0:
            leaders = g
        node_grads = cross_grads = None
        for k in range(num_nodes):
            g = dist.new_group(ranks=[k * local_world_size + i for i in range(local_world_size)], backend=backend,
                               timeout=timeout)
            if k == node_rank:
                node_grads = g
        if num_nodes > 1:
            for r in range(local_world_size):
                g = dist.new_group(ranks=[k * local_world_size + r for k in range(num_nodes)], backend=backend,
                                   timeout=timeout)
                if r == local_rank:
                    cross_grads = g
        peers = Peers.gather(host)
        return cls(dist.get_rank(), world, local_rank, local_world_size, node_rank, num_nodes, backend, grads, host,
                   node, leaders, node_grads, cross_grads, peers, timeout.total_seconds() if timeout else None)

    def guard(self, what: str) -> ContextManager[None]:
        """``with groups.guard("the gradient reduce"):`` around collectives: a transport error becomes a
        :class:`~.faults.PeerFailure` naming the rank that died (``parallel/faults.py``)."""
        return self.peers.guard(what, self.timeout_s) if self.peers is not None else contextlib.nullcontext()

    @property
    def device_side_reduce(self) -> bool:
        """Gradients are reduced on the device before their D2H copy (NCCL), else on the host (gloo)."""
        return self.backend == "nccl"
