"""ResumableDataLoader under data parallel ("Data", "Exact resume across world sizes").

No processes are started: each rank's loader is built as Lightning's ``_update_dataloader`` re-instantiates
it with a ``DistributedSampler(num_replicas=W, rank=r)``, directly with that sampler, or with
``torch.distributed`` reporting ``(W, r)``. The reference is computed here from the documented epoch order
(``torch.randperm`` seeded by ``seed * 100_003 + epoch``, or ``range(n)``): global step ``k`` of an epoch
resumed at sample ``p`` is ``order[p + k*G : p + (k+1)*G]``, and "the same" means the ranks' batches of a
step, concatenated in rank order, equal that slice exactly (so as sets too).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from megatrain_lightning.data import ResumableDataLoader

SEED = 7


def order(n: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED * 100_003 + epoch)).tolist()


def reference(n: int, epoch: int, shuffle: bool, global_batch: int, world: int, start: int = 0,
              drop_last: bool = False) -> list[list[int]]:
    """Global steps of the epoch from sample ``start``: consecutive slices; a short tail is kept only without
    ``drop_last`` and when every rank gets a sample of it."""
    o = order(n, epoch, shuffle)
    steps = [o[p : p + global_batch] for p in range(start, n, global_batch)]
    if steps and len(steps[-1]) < global_batch and (drop_last or len(steps[-1]) < world):
        steps.pop()
    return steps


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def rank_loaders(n: int, batch: int, world: int, shuffle: bool, via: str = "lightning", **kw) -> list[ResumableDataLoader]:
    ds = dataset(n)
    if world == 1:
        return [ResumableDataLoader(ds, batch_size=batch, shuffle=shuffle, seed=SEED, **kw)]
    out = []
    for r in range(world):
        sampler = DistributedSampler(ds, num_replicas=world, rank=r, shuffle=shuffle, seed=123)  # its seed is unused
        if via == "lightning":  # a loader built once, then re-instantiated per rank as Lightning does
            base = ResumableDataLoader(ds, batch_size=batch, shuffle=shuffle, seed=SEED, **kw)
            out.append(_update_dataloader(base, sampler))
        else:
            out.append(ResumableDataLoader(ds, batch_size=batch, seed=SEED, sampler=sampler, **kw))
    return out


def global_steps(loaders: list[ResumableDataLoader], iters: list | None = None, limit: int | None = None) -> list[list[int]]:
    """Step k = the ranks' k-th batches concatenated in rank order; every rank must yield as many batches."""
    per_rank = []
    for i, loader in enumerate(loaders):
        it = iters[i] if iters is not None else iter(loader)
        batches = []
        for b in it:
            batches.append(b[0].tolist())
            if limit is not None and len(batches) == limit:
                break
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1, [len(b) for b in per_rank]
    return [sum((rank[k] for rank in per_rank), []) for k in range(len(per_rank[0]))]


# n = 24: whole global batches of 6; 23: a tail of 5 split 3 + 2; 19: a tail of 1 < 2 ranks, dropped with 2 ranks
@pytest.mark.parametrize("n", [24, 23, 19])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("via", ["lightning", "sampler"])
def test_ranks_share_every_global_batch_exactly_once(n, shuffle, via):
    loaders = rank_loaders(n, 3, 2, shuffle, via)
    assert all(isinstance(dl, ResumableDataLoader) and dl.shuffle == shuffle and dl.seed == SEED for dl in loaders)
    one = ResumableDataLoader(dataset(n), batch_size=6, shuffle=shuffle, seed=SEED)
    for epoch in range(2):  # the loader counts its epochs: the second pass is a new permutation
        steps = global_steps(loaders)
        assert steps == reference(n, epoch, shuffle, 6, 2)
        assert len(steps) == len(loaders[0]) == len(loaders[1])
        single = [b[0].tolist() for b in one]
        assert single == reference(n, epoch, shuffle, 6, 1)  # one process: batch 2b, tail kept
        assert steps == (single if n != 19 else single[:-1])  # same steps; 19: the 1-sample tail is dropped
    if shuffle:
        assert reference(n, 0, True, 6, 2) != reference(n, 1, True, 6, 2)
    else:
        assert steps[0] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("shuffle", [True, False])
def test_drop_last_drops_the_incomplete_global_batch_at_every_world_size(shuffle):
    two = global_steps(rank_loaders(23, 3, 2, shuffle, drop_last=True))
    one = [b[0].tolist() for b in ResumableDataLoader(dataset(23), batch_size=6, shuffle=shuffle, seed=SEED, drop_last=True)]
    assert two == one == reference(23, 0, shuffle, 6, 2, drop_last=True) and len(one) == 3


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("world_from", "world_to"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("taken", [1, 2, 4])  # mid-epoch, and (4 of 4 steps) at its end
def test_resume_across_world_sizes_is_exact(shuffle, world_from, world_to, taken):
    n, g = 23, 6
    writers = rank_loaders(n, g // world_from, world_from, shuffle)
    iters = [iter(dl) for dl in writers]
    assert global_steps(writers, iters, limit=taken) == reference(n, 0, shuffle, g, 2)[:taken]
    states = [dl.state_dict() for dl in writers]
    assert all(s == states[0] for s in states)  # global terms: every rank writes the same state
    assert states[0] == {"epoch": 0, "batches": taken, "samples": min(n, taken * g), "batch_size": g // world_from,
                         "world_size": world_from}

    readers = rank_loaders(n, g // world_to, world_to, shuffle)
    for dl in readers:
        dl.load_state_dict(states[0])
        assert dl.state_dict() == states[0]  # loaded, not yet iterated
    rest = global_steps(readers)
    # the uninterrupted run from that position, then the next epoch from its start
    if taken < 4:
        assert rest == reference(n, 0, shuffle, g, 2, start=taken * g) and rest
        assert readers[0].state_dict() == {"epoch": 0, "batches": 4, "samples": n, "batch_size": g // world_to,
                                           "world_size": world_to}
    else:
        assert rest == reference(n, 1, shuffle, g, 2)  # the written epoch was complete
    following = global_steps(readers)
    assert following == reference(n, 1 if taken < 4 else 2, shuffle, g, 2)


def test_resume_in_a_different_global_batch_continues_from_the_sample_position():
    writers = rank_loaders(23, 3, 2, True)
    global_steps(writers, [iter(dl) for dl in writers], limit=2)  # 12 samples consumed
    reader = ResumableDataLoader(dataset(23), batch_size=4, shuffle=True, seed=SEED)
    reader.load_state_dict(writers[0].state_dict())
    with pytest.raises(RuntimeError, match="batch_size per process 3 -> 4, world size 2 -> 1"):
        next(iter(reader))  # the restored batch counter (2 steps of 6) is not in steps of 4: set it first
    reader.load_state_dict(writers[0].state_dict())
    reader.resume_at(len(reader) - reader.resume_point()[1])
    assert [b[0].tolist() for b in reader] == reference(23, 0, True, 4, 1, start=12)


def test_state_written_by_one_process_before_sharding_still_loads():
    """``{"epoch", "batches"}`` (no "samples"): read as that many global steps of the reader's global batch."""
    one = ResumableDataLoader(dataset(23), batch_size=6, shuffle=True, seed=SEED)
    one.load_state_dict({"epoch": 1, "batches": 2})
    assert [b[0].tolist() for b in one] == reference(23, 1, True, 6, 1, start=12)
    two = rank_loaders(23, 3, 2, True)
    for dl in two:
        dl.load_state_dict({"epoch": 1, "batches": 2})
    assert global_steps(two) == reference(23, 1, True, 6, 2, start=12)


def test_rank_and_world_size_from_torch_distributed(monkeypatch):
    """Built before the process group exists (no sampler given): sharded by the default group when iterated."""
    loaders = [ResumableDataLoader(dataset(23), batch_size=3, shuffle=True, seed=SEED) for _ in range(2)]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    per_rank = []
    for r, dl in enumerate(loaders):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=r: r)
        assert (dl.sampler.num_replicas, dl.sampler.rank, len(dl)) == (2, r, 4)
        per_rank.append([b[0].tolist() for b in dl])
    assert [a + b for a, b in zip(*per_rank)] == reference(23, 0, True, 6, 2)


def test_lightning_keeps_the_loader_and_shards_a_plain_validation_loader(tmp_path):
    """Lightning's own decision (DDP, 2 devices; nothing launched): a ResumableDataLoader is left as it is (its
    sampler is a DistributedSampler), a plain DataLoader gets Lightning's DistributedSampler."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import RunningStage

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, default_root_dir=tmp_path)
    connector = trainer._data_connector
    train = ResumableDataLoader(dataset(23), batch_size=3, shuffle=True, seed=SEED)
    assert isinstance(train.sampler, DistributedSampler)
    assert connector._prepare_dataloader(train, shuffle=True, mode=RunningStage.TRAINING) is train
    val = connector._prepare_dataloader(DataLoader(dataset(23), batch_size=3), shuffle=False, mode=RunningStage.VALIDATING)
    assert isinstance(val.sampler, DistributedSampler) and val.sampler.num_replicas == 2 and not val.sampler.shuffle


def test_bad_samplers_are_refused():
    ds = dataset(8)
    with pytest.raises(ValueError, match="owns the sample order"):
        ResumableDataLoader(ds, batch_size=2, sampler=torch.utils.data.SequentialSampler(ds))
    with pytest.raises(ValueError, match="owns the sample order"):
        ResumableDataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(range(8), 2, False))
    with pytest.raises(ValueError, match="contradicts the DistributedSampler"):
        ResumableDataLoader(ds, batch_size=2, shuffle=True, sampler=DistributedSampler(ds, 2, 0, shuffle=False))


def test_data_module_training_loader_shards_like_one_process_with_the_global_batch(gpt2_tok, monkeypatch):
    """DomainDataModule(batch_size=2) on 2 ranks (torch.distributed reporting them) = batch_size=4 in one process."""
    from megatrain_lightning.data import DomainDataModule

    docs = [{"id": f"doc{i}", "text": f"Document number {i}. " + "clause " * (i % 7 + 1) + "end."} for i in range(60)]
    kw = dict(documents=docs, seq_len=8, val_fraction=0.2, num_workers=0)
    one = [b["input_ids"] for b in DomainDataModule(gpt2_tok, batch_size=4, **kw).train_dataloader()]
    dm = DomainDataModule(gpt2_tok, batch_size=2, **kw)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    per_rank = []
    for r in range(2):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=r: r)
        per_rank.append([b["input_ids"] for b in dm.train_dataloader()])
    assert one[-1].shape[0] == 3  # 67 rows: the tail of 3 is split 2 + 1
    assert len(per_rank[0]) == len(per_rank[1]) == len(one) > 2
    for step, (a, b) in zip(one, zip(*per_rank)):
        assert torch.equal(torch.cat([a, b]), step)
