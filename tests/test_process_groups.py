"""The engine's process groups and its gradient reduce, checked on CPU.

Group creation: on CUDA the default group is bound to the rank's device, and torch then makes every new group by
splitting the default NCCL communicator, a collective over all ranks matched by call order. No GPU here, so each
rank's calls to ``torch.distributed.new_group`` are recorded and replayed through torch's rule for which of them
split (``_new_process_group_helper`` in torch/distributed/distributed_c10d.py): all ranks must issue the same
sequence of splits, each split's colored members agreeing on its ranks.

Reduce: the NCCL path's :meth:`GradReducer.reduce_device` runs on gloo with CPU tensors; two gloo processes check
that it and the host path (:meth:`GradReducer.reduce_host`) give the owner the fp32 mean of the ranks' wire-dtype
gradients, bitwise.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatrain_lightning.engine.reduce import GradReducer
from megatrain_lightning.parallel import groups as groups_mod
from megatrain_lightning.parallel.groups import ProcessGroups


class _Group:
    def __init__(self, ranks: list[int], backend: str):
        self.ranks, self.backend = ranks, backend


NON_MEMBER = object()


def _record(monkeypatch, rank: int, world: int, backend: str) -> tuple[list, list]:
    """Patch torch.distributed as seen by ``parallel/groups.py`` for ``rank`` of ``world`` with the default group on
    ``backend`` bound to a device. Returns (the calls of new_group, the default communicator's splits) as lists
    filled by the next ``ProcessGroups.create``: a split is ``None`` (no color: a non-member) or the sorted ranks
    of the NCCL group the rank joins."""
    calls: list = []
    splits: list = []

    def new_group(ranks=None, timeout=None, backend=None, **kwargs):
        members = sorted(ranks) if ranks is not None else list(range(world))
        kind = backend or default_backend
        calls.append((members, kind))
        # _new_process_group_helper with the default group bound (split_from set): a non-member of any group
        # calls perform_nocolor_split; a member of an NCCL group is created by a colored split; a member of a
        # gloo group does not split
        if rank not in members:
            splits.append(None)
            return NON_MEMBER
        if kind == "nccl":
            splits.append(tuple(members))
        return _Group(members, kind)

    default_backend = backend
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(groups_mod.Peers, "gather", staticmethod(lambda group: None))
    return calls, splits


def test_torch_still_splits_for_non_members_of_any_group():
    """The rule the recording replays is torch's: a non-member splits the default communicator without a color
    whatever the new group's backend, before the backend is chosen."""
    src = inspect.getsource(c10d._new_process_group_helper)
    nocolor = src.index("perform_nocolor_split")
    assert src.index("if global_rank not in global_ranks_in_group") < nocolor < src.index("Backend.GLOO")
    assert "split_from = _get_split_source(_get_default_group())" in src


@pytest.mark.parametrize("local_world,nodes", [(2, 1), (4, 1), (2, 2), (3, 2), (1, 3)])
def test_every_rank_splits_the_default_communicator_alike(monkeypatch, local_world, nodes):
    world = local_world * nodes
    per_rank = {}
    made = {}
    for rank in range(world):
        with monkeypatch.context() as m:
            calls, splits = _record(m, rank, world, "nccl")
            made[rank] = ProcessGroups.create(rank % local_world, local_world, rank // local_world, nodes)
            per_rank[rank] = (calls, splits)
    calls0 = per_rank[0][0]
    assert all(per_rank[r][0] == calls0 for r in range(world))  # the same new_group calls, in the same order
    seqs = [per_rank[r][1] for r in range(world)]
    assert len({len(s) for s in seqs}) == 1, seqs  # as many splits on every rank
    for i in range(len(seqs[0])):  # each split: the ranks naming a color are exactly that group
        colors = {s[i] for s in seqs if s[i] is not None}
        for c in colors:
            assert {r for r in range(world) if seqs[r][i] == c} == set(c), (i, seqs)
    for rank, g in made.items():  # and the groups are still the ones the engine uses
        node, local = rank // local_world, rank % local_world
        node_ranks = [node * local_world + i for i in range(local_world)]
        assert g.node.ranks == node_ranks and g.node.backend == "gloo"
        assert g.node_grads.ranks == node_ranks and g.node_grads.backend == "nccl"
        assert g.grads.ranks == list(range(world)) and g.host.backend == "gloo"
        if local == 0:
            assert g.leaders.ranks == [k * local_world for k in range(nodes)] and g.leaders.backend == "gloo"
        else:
            assert g.leaders is None
        if nodes > 1:
            assert g.cross_grads.ranks == [k * local_world + local for k in range(nodes)]
        else:
            assert g.cross_grads is None


# ---------------------------------------------------------------------------------------------- the reduce

N_GRAD, N_FLAGS = 1000, 3


def _grads(rank: int) -> torch.Tensor:
    """Rank ``rank``'s packed batch in bf16: gradients, then presence flags (one rank lacks the last gradient)."""
    g = torch.randn(N_GRAD, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    flags = torch.tensor([1.0, 1.0, 0.0 if rank else 1.0])
    return torch.cat([g, flags]).to(torch.bfloat16)


def _reduce_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        groups = ProcessGroups.create(rank, world, 0, 1, timeout=timedelta(seconds=60))
        red = GradReducer(groups.grads, groups.node_grads, groups.cross_grads, 0, world)
        flat = _grads(rank)
        dev, keep = red.reduce_device(flat.clone(), N_FLAGS, owner=0, mine=rank == 0)
        host = red.reduce_host([flat[:N_GRAD].clone(), flat[N_GRAD:].clone()], owner=0, mine=rank == 0)
        torch.save({"dev": dev, "keep": keep, "host": torch.cat(host), "leaders": groups.leaders is not None},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_device_and_host_reduce_give_the_fp32_mean_bitwise(tmp_path):
    world = 2
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_reduce_worker, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    # the reference: each rank's bf16 values in fp32, summed in fp32, divided by the world size
    want = (_grads(0).float() + _grads(1).float())
    want[:N_GRAD] /= world
    owner, other = res
    assert owner["dev"].dtype == torch.float32 and owner["keep"] is None and other["keep"] == N_FLAGS
    assert torch.equal(owner["dev"], want)
    assert torch.equal(owner["host"], want)
    assert torch.equal(other["dev"][N_GRAD:], want[N_GRAD:]) and torch.equal(other["host"][N_GRAD:], want[N_GRAD:])
    # a bf16 sum would have rounded: the fp32 mean is not representable in bf16 here
    assert not torch.equal(want[:N_GRAD], want[:N_GRAD].bfloat16().float())
    assert [r["leaders"] for r in res] == [True, False]
