"""A DataLoader whose position is part of Lightning's checkpoint, for exact mid-epoch resume.

Lightning saves ``state_dict()`` of every training loader that has ``state_dict`` and
``load_state_dict`` (``lightning.fabric.utilities.types._Stateful``) and restores it before
iterating on resume; a plain ``DataLoader`` restarts the epoch instead (Lightning only warns).

Position is counted in batches yielded to the training loop. Lightning's data fetcher reads
one batch ahead only for loaders without ``len()``; this loader always has a length, so
every batch yielded has been consumed when a checkpoint is written.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class _PositionSampler(Sampler[int]):
    """Indices of one epoch (a permutation seeded by ``(seed, epoch)`` when shuffling), from ``skip`` on.

    It has no ``set_epoch`` on purpose: Lightning would call it with its ``current_epoch``, which
    is off by one after some resumes; the loader sets ``epoch`` itself.
    """

    def __init__(self, n: int, shuffle: bool, seed: int):
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.epoch, self.skip = 0, 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        return iter(order[self.skip :])

    def __len__(self) -> int:
        return self.n - self.skip


class ResumableDataLoader(DataLoader):
    """``DataLoader`` that resumes mid-epoch with the next batch after a checkpoint.

    Args:
        dataset: a map-style dataset (``len()`` and integer indexing).
        batch_size: samples per batch.
        shuffle: reshuffle every epoch with a generator seeded by ``(seed, epoch)``, so the order
            after a resume is the order of the uninterrupted run. The loader counts its own epochs
            (one per iteration started); Lightning's ``current_epoch`` can differ by one after a
            resume from a checkpoint written once ``fit`` stopped at ``max_steps`` mid-epoch.
        seed: shuffling seed.
        **kwargs: any other ``DataLoader`` argument except ``sampler``/``batch_sampler``.

    Raises:
        ValueError: ``sampler`` or ``batch_sampler`` given (the loader owns the order).
    """

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False, seed: int = 0, **kwargs: Any):
        if "sampler" in kwargs or "batch_sampler" in kwargs:
            raise ValueError("ResumableDataLoader owns the sample order; pass shuffle=/seed= instead of a sampler.")
        self._position = _PositionSampler(len(dataset), shuffle, seed)  # type: ignore[arg-type]
        super().__init__(dataset, batch_size=batch_size, sampler=self._position, **kwargs)
        self._yielded = 0
        self._epoch = 0  # epoch being iterated
        self._next_epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # the body runs at the first next(): an iterator created and dropped unused (Lightning
        # makes one in setup_data) does not count as an epoch
        start = 0
        if self._resume is not None:
            self._epoch, start = self._resume
            self._resume = None
        else:
            self._epoch = self._next_epoch
        self._next_epoch = self._epoch + 1
        self._position.epoch = self._epoch
        self._position.skip = start * (self.batch_size or 1)
        self._yielded = start
        try:
            for batch in super().__iter__():
                self._yielded += 1
                yield batch
        finally:
            self._position.skip = 0

    def __len__(self) -> int:
        saved, self._position.skip = self._position.skip, 0
        try:
            return super().__len__()
        finally:
            self._position.skip = saved

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches"}``: the epoch being iterated and the batches of it already yielded."""
        return {"epoch": self._epoch, "batches": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration continues epoch ``state["epoch"]`` after its first ``batches``
        batches (or starts the following epoch if that one was complete)."""
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= len(self):
            epoch, batches = epoch + 1, 0
        self._resume = (epoch, batches)
