"""Resuming a ResumableDataLoader mid-epoch with another batch size, gradient accumulation or world size: every
sample of the resumed epoch is trained exactly once across the two runs, the following epoch is whole, and
``global_step`` continues from the checkpoint.

The reference is independent of the loader: every dataset item carries its index, and the module records the
indices each ``training_step`` receives (with the epoch) and the indices of each optimizer step.
"""

from __future__ import annotations

import copy
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

import megatrain_lightning  # noqa: F401
from megatrain_lightning.data import ResumableDataLoader, ResumedEpochAlignment
from megatrain_lightning.data.global_batches import rank_share
from megatrain_lightning.testing import LM, SEQ, VOCAB, make_model

N = 24


class Recording(LM):
    """:class:`LM` on ``(ids, index)`` batches; ``seen``: ``(epoch, [indices])`` per training step, ``windows``: the
    indices of each optimizer step, ``last_flags``: Lightning's ``is_last_batch`` after each batch."""

    def __init__(self, model):
        super().__init__(model)
        self.seen: list[tuple[int, list[int]]] = []
        self.windows: list[list[int]] = []
        self._window: list[int] = []
        self.last_flags: list[bool] = []  # Lightning's is_last_batch after each batch

    def training_step(self, batch, batch_idx):
        ids, index = batch
        self.seen.append((self.trainer.current_epoch, index.tolist()))
        self._window += index.tolist()
        return self.model(input_ids=ids, labels=ids).loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.last_flags.append(self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def on_before_optimizer_step(self, optimizer):
        self.windows.append(self._window)
        self._window = []


def loader(batch_size: int) -> ResumableDataLoader:
    ids = torch.randint(0, VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(1))
    return ResumableDataLoader(TensorDataset(ids, torch.arange(N)), batch_size=batch_size, shuffle=True, seed=5)


def trainer(strategy: str, accumulate: int, **kw) -> pl.Trainer:
    base = dict(strategy=strategy, accelerator="cpu", enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                num_sanity_val_steps=0)
    base.update(kw)
    return pl.Trainer(**base)


def stream(*modules: Recording) -> list[list[int]]:
    """The batches trained, in order, across the runs (Lightning's ``current_epoch`` is not used: after a checkpoint
    written once ``fit`` stopped at ``max_steps`` it counts the interrupted epoch as finished)."""
    return [idx for m in modules for _, idx in m.seen]


def run_resume(tmp_path, strategy, before, after, first_steps, callbacks=()):
    """Train ``first_steps`` optimizer steps with ``(batch_size, accumulate)`` ``before``, save, resume with
    ``after`` for the rest of the sampler's epoch 0 and all of its epoch 1 (Lightning's epochs 1 and 2). Returns the two modules and the resumed Trainer."""
    model = make_model("llama")
    first = Recording(copy.deepcopy(model))
    t1 = trainer(strategy, before[1], max_steps=first_steps, callbacks=list(callbacks))
    t1.fit(first, loader(before[0]))
    t1.save_checkpoint(tmp_path / "ckpt")
    assert t1.global_step == first_steps
    second = Recording(copy.deepcopy(model))
    t2 = trainer(strategy, after[1], max_epochs=3, max_steps=1000, callbacks=list(callbacks))
    t2.fit(second, loader(after[0]), ckpt_path=tmp_path / "ckpt")
    return first, second, t2


def check_exact(first, second, t2, after, first_steps):
    batches = stream(first, second)
    flat = [i for b in batches for i in b]
    assert len(flat) == 2 * N, len(flat)
    everyone = Counter(range(N))
    epoch0, epoch1 = Counter(flat[:N]), Counter(flat[N:])
    assert epoch0 == everyone, f"resumed epoch: {epoch0 - everyone} twice, {everyone - epoch0} never"
    assert epoch1 == everyone, "the following epoch is not whole"
    batch, accumulate = after
    sizes, cut = [len(b) for b in batches], 0
    while sum(sizes[:cut]) < N:
        cut += 1
    assert sum(sizes[:cut]) == N  # no batch spans the two epochs
    # Lightning saw the epoch end at its last batch (not at an exhausted iterator: that skips the final step and
    # the epoch-end validation)
    ends = [i for i, flag in enumerate(second.last_flags) if flag]
    assert ends == [cut - len(first.seen) - 1, len(second.seen) - 1], (ends, cut)
    assert sizes[cut:] == [batch] * (N // batch) + ([N % batch] if N % batch else [])
    # every optimizer step after the resume accumulates whole windows (each epoch's last may be shorter)
    window = batch * accumulate
    per_step = [len(w) for w in second.windows]
    following = -(-N // window)
    resumed = per_step[:-following]
    assert all(n == window for n in resumed[:-1]) and 0 < resumed[-1] <= window, per_step
    assert per_step[-following:] == [window] * (N // window) + ([N % window] if N % window else []), per_step
    assert sum(per_step) == sum(len(i) for _, i in second.seen)  # no micro-batch left without a step
    assert t2.global_step == first_steps + len(second.windows)  # global_step continues from the checkpoint


# (batch_size, accumulate) before -> after; first_steps optimizer steps before the save (mid-epoch)
CASES = [
    ((2, 1), (4, 1), 3),  # batch doubled: Lightning's counter (3 batches of 2) ended the epoch 6 samples early
    ((4, 1), (2, 1), 3),  # batch halved: the counter (3 of 4) ended at an exhausted iterator, not its last batch
    ((2, 1), (2, 2), 3),  # accumulation 1 -> 2 at an odd batch counter: the first step had one micro-batch
    ((2, 2), (2, 1), 3),  # accumulation 2 -> 1 (the counter fits already: a guard)
    ((4, 2), (2, 1), 2),  # batch halved, accumulation 2 -> 1
    ((2, 2), (4, 1), 2),  # both: 8 samples consumed, the new batch counter is 2
    ((3, 1), (2, 3), 3),  # 9 consumed: 4.5 batches of 2 -> counter rounded to a window, epoch shortened
]


@pytest.mark.parametrize(("before", "after", "first_steps"), CASES)
def test_megatrain_resume_with_another_batch_or_accumulation_trains_every_sample_once(tmp_path, before, after,
                                                                                        first_steps):
    first, second, t2 = run_resume(tmp_path, "megatrain", before, after, first_steps, callbacks=[ResumedEpochAlignment()])
    check_exact(first, second, t2, after, first_steps)
    t2.strategy.close()


def test_plain_lightning_with_the_callback_is_exact(tmp_path):
    """The loader and the callback work with any strategy."""
    first, second, t2 = run_resume(tmp_path, "auto", (2, 1), (4, 1), 3, callbacks=[ResumedEpochAlignment()])
    check_exact(first, second, t2, (4, 1), 3)


def test_plain_lightning_without_the_callback_refuses_a_changed_batch_size(tmp_path):
    with pytest.raises(RuntimeError, match=r"batch_size per process 2 -> 4, world size 1 -> 1.*ResumedEpochAlignment"):
        run_resume(tmp_path, "auto", (2, 1), (4, 1), 3)


def test_unchanged_configuration_keeps_lightnings_counter(tmp_path):
    first, second, t2 = run_resume(tmp_path, "megatrain", (2, 2), (2, 2), 3, callbacks=[ResumedEpochAlignment()])
    check_exact(first, second, t2, (2, 2), 3)
    assert len(second.seen) == (N - 12) // 2 + N // 2
    t2.strategy.close()


@pytest.mark.parametrize(("world_from", "world_to"), [(1, 2), (2, 1), (2, 3)])
def test_world_size_change_sets_the_counter_to_the_new_global_steps(world_from, world_to):
    """Simulated ranks (explicit ``DistributedSampler``-free ``rank``/``num_replicas`` through
    ``torch.utils.data.DistributedSampler``): the loaded state's counter is in global steps of the saved world size;
    the loader reports the steps left at the new one, and refuses to iterate until the counter is set."""
    from torch.utils.data import DistributedSampler

    ds = TensorDataset(torch.arange(N))

    def rank_loader(world, rank):
        return ResumableDataLoader(ds, batch_size=2, seed=5, shuffle=True,
                                   sampler=DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True))

    writers = [rank_loader(world_from, r) for r in range(world_from)]
    its = [iter(w) for w in writers]
    for it in its:
        next(it), next(it)  # 2 global steps
    state = writers[0].state_dict()
    assert state["samples"] == 4 * world_from and state["batches"] == 2 and state["world_size"] == world_from
    readers = [rank_loader(world_to, r) for r in range(world_to)]
    for dl in readers:
        dl.load_state_dict(state)
    left = readers[0].resume_point()[1]
    assert left == -(-(N - 4 * world_from) // (2 * world_to))
    with pytest.raises(RuntimeError, match=f"world size {world_from} -> {world_to}"):
        next(iter(rank_loader_loaded(rank_loader(world_to, 0), state)))
    for dl in readers:
        dl.resume_at(len(dl) - left)
        assert dl.state_dict()["batches"] == len(dl) - left
    got = sorted(sum((b[0].tolist() for dl in readers for b in dl), []))
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5 * 100_003)).tolist()
    assert got == sorted(order[4 * world_from:])
    for dl in readers:
        assert dl.state_dict()["batches"] == len(dl) and dl.state_dict()["samples"] == N
    assert sorted(sum((rank_share(order, 0, 2, world_to, r, False) for r in range(world_to)), [])) == list(range(N))


def rank_loader_loaded(dl: ResumableDataLoader, state: dict) -> ResumableDataLoader:
    dl.load_state_dict(state)
    return dl
