"""A DataLoader whose position is part of Lightning's checkpoint, for exact mid-epoch resume,
sharded over data-parallel ranks (docs/internals/checkpoints.md, "Mid-epoch data position").

Lightning saves and restores ``state_dict()`` of every training loader that has ``state_dict`` and
``load_state_dict`` (``lightning.fabric.utilities.types._Stateful``); a plain ``DataLoader`` restarts the
epoch instead (Lightning only warns). Lightning's data fetcher reads one batch ahead only for loaders without
``len()``; this loader has one, so every batch yielded has been consumed when a checkpoint is written.

The sampler is a ``DistributedSampler`` subclass, so Lightning (``use_distributed_sampler=True``) leaves the
loader as it is and ``shuffle``/``seed`` stay its own. Rank and world size come from a ``DistributedSampler``
passed as ``sampler`` (what Lightning's ``_update_dataloader`` does), else from ``torch.distributed``'s default
group, read at each use (a loader built before the process group exists shards correctly), else one process.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from .global_batches import consumed, rank_share, share_size, steps_left


class _PositionSampler(DistributedSampler):
    """This rank's indices of one epoch from global position ``start`` on
    (:mod:`~megatrain_lightning.data.global_batches`).

    ``DistributedSampler.__init__`` is not called: it needs the rank and world size before ``torch.distributed``
    may be initialised; they are read when used (module docstring). ``set_epoch`` is ignored on purpose:
    Lightning's ``current_epoch`` is off by one after some resumes; the loader sets ``epoch`` itself.
    """

    def __init__(self, n: int, shuffle: bool, seed: int, batch_size: int, drop_last: bool,
                 num_replicas: int | None = None, rank: int | None = None):
        self.n, self.shuffle, self.seed, self.batch_size, self.drop_last = n, shuffle, seed, batch_size, drop_last
        self.epoch, self.start = 0, 0
        self._explicit = None if num_replicas is None else (int(num_replicas), int(rank or 0))

    def world(self) -> tuple[int, int]:
        """``(world_size, rank)`` this sampler shards for."""
        if self._explicit is not None:
            return self._explicit
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self.world()[0]

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.world()[1]

    def set_epoch(self, epoch: int) -> None:
        """Ignored (class docstring); the loader sets ``epoch`` at the start of each iteration."""

    def order(self) -> list[int]:
        """The epoch's sample indices, ``[n]``: ``torch.randperm`` seeded by ``seed * 100_003 + epoch``, or in order."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            return torch.randperm(self.n, generator=g).tolist()
        return list(range(self.n))

    def __iter__(self) -> Iterator[int]:
        world, rank = self.world()
        return iter(rank_share(self.order(), self.start, self.batch_size, world, rank, self.drop_last))

    def __len__(self) -> int:
        world, rank = self.world()
        return share_size(self.n, self.start, self.batch_size, world, rank, self.drop_last)


class ResumableDataLoader(DataLoader):
    """``DataLoader`` that resumes mid-epoch with the next global batch after a checkpoint, at any world size.

    Every rank builds the same epoch order and yields the same number of batches; how global steps and the
    tail are split over ranks: :mod:`~megatrain_lightning.data.global_batches`. One process is a plain
    in-order/shuffled loader. Used for validation it shards the same way (each sample once, no padding).

    Args:
        dataset: a map-style dataset (``len()`` and integer indexing).
        batch_size: samples per batch of each rank (``None``: one sample per step, no collation).
        shuffle: reshuffle every epoch with a generator seeded by ``(seed, epoch)``, so the order after a resume
            is the uninterrupted run's. The loader counts its own epochs (one per iteration started).
        seed: shuffling seed (the same on every rank).
        **kwargs: any other ``DataLoader`` argument (``drop_last`` drops an incomplete global batch), and
            ``sampler``: only a ``torch.utils.data.DistributedSampler``, whose ``num_replicas``/``rank`` give
            the world size and rank and whose ``shuffle`` replaces ``shuffle=`` (its seed and order are not
            used). ``batch_sampler`` only as ``None``.

    Raises:
        ValueError: a ``sampler`` that is not a ``DistributedSampler``, a ``batch_sampler``, ``shuffle=True``
            with a ``DistributedSampler(shuffle=False)``, or a sampler's ``rank`` outside ``[0, num_replicas)``.
    """

    def __init__(self, dataset: Dataset, batch_size: int | None = 1, shuffle: bool = False, seed: int = 0,
                 **kwargs: Any):
        sampler, batch_sampler = kwargs.pop("sampler", None), kwargs.pop("batch_sampler", None)
        if batch_sampler is not None or (sampler is not None and not isinstance(sampler, DistributedSampler)):
            raise ValueError("ResumableDataLoader owns the sample order; pass shuffle=/seed= instead of a sampler or "
                             "batch_sampler (only a torch DistributedSampler is accepted, for its rank/world size).")
        replicas = rank = None
        if sampler is not None:
            if shuffle and not sampler.shuffle:
                raise ValueError("shuffle=True contradicts the DistributedSampler given (shuffle=False); the "
                                 "sampler's shuffle decides: make them agree.")
            shuffle, replicas, rank = bool(sampler.shuffle), int(sampler.num_replicas), int(sampler.rank)
            if not 0 <= rank < replicas:
                raise ValueError(f"The DistributedSampler's rank {rank} is outside [0, num_replicas={replicas}).")
        self._position = _PositionSampler(len(dataset), shuffle, seed, batch_size or 1,  # type: ignore[arg-type]
                                          bool(kwargs.get("drop_last", False)), replicas, rank)
        super().__init__(dataset, batch_size=batch_size, sampler=self._position, **kwargs)
        self.shuffle, self.seed = shuffle, seed  # public: Lightning's re-instantiation copies them
        self._epoch = 0  # epoch being iterated
        self._next_epoch = 0
        self._start = 0  # global position (samples) the current iteration started at
        self._start_batches = 0  # global steps of the epoch taken before it (from a loaded state)
        self._yielded = 0
        self._resume: tuple[int, int, int] | None = None  # (epoch, samples, batches) from a checkpoint
        self._saved: dict[str, int] = {}  # the loaded state, for the settings it was written with
        self._aligned = False  # the fit loop's batch counter was set from the loaded state (ResumedEpochAlignment)
        self.accumulate_grad_batches: int | None = None  # the Trainer's, recorded in the state when known

    def _steps(self, start: int) -> int:
        world, _ = self._position.world()
        return steps_left(self._position.n, start, self._position.batch_size, world, self._position.drop_last)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # the body runs at the first next(): an iterator created and dropped unused (Lightning
        # makes one in setup_data) does not count as an epoch
        if self._resume is not None:
            epoch, start, batches = self._resume
            self._resume = None
            if not self._aligned:
                self._check_counter(start, batches)
            self._aligned = False
            if start > 0 and self._steps(start) == 0:  # that epoch was complete
                epoch, start, batches = epoch + 1, 0, 0
        else:
            epoch, start, batches = self._next_epoch, 0, 0
        self._epoch, self._next_epoch = epoch, epoch + 1
        self._start, self._start_batches, self._yielded = start, batches, 0
        self._position.epoch, self._position.start = epoch, start
        try:
            for batch in super().__iter__():
                self._yielded += 1
                yield batch
        finally:
            self._position.start = 0

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (= global steps per epoch)."""
        return self._steps(0)

    def resume_point(self) -> tuple[int, int] | None:
        """For a loaded state not yet iterated: ``(samples consumed, global steps left)`` of that epoch in this
        loader's configuration (``0`` steps: the next iteration starts the following epoch). ``None`` otherwise."""
        if self._resume is None:
            return None
        _, samples, _ = self._resume
        return samples, self._steps(samples)

    def resume_at(self, batches: int, next_epoch: bool = False) -> None:
        """Count ``batches`` global steps of the resumed epoch as taken (``next_epoch``: the loaded epoch is
        complete). Called by :class:`~megatrain_lightning.data.ResumedEpochAlignment` once it set the fit loop's
        counter to match; disables the first iteration's counter check.

        Raises:
            RuntimeError: no loaded state is pending."""
        if self._resume is None:
            raise RuntimeError("resume_at needs a state loaded by load_state_dict and not yet iterated.")
        epoch, samples, _ = self._resume
        self._resume = (epoch + 1, 0, 0) if next_epoch else (epoch, samples, int(batches))
        self._aligned = True

    def _check_counter(self, start: int, batches: int) -> None:
        """Raise RuntimeError if the restored batch counter (``batches``, saved configuration) plus the steps left
        from sample ``start`` is not one epoch now: the epoch would end early (samples never trained) or late."""
        left = self._steps(start)
        if start == 0 or left == 0 or batches + left == len(self):
            return
        world, _ = self._position.world()
        was = (self._saved.get("batch_size"), self._saved.get("world_size"))
        changed = (f"batch_size per process {was[0]} -> {self._position.batch_size}, world size {was[1]} -> {world}"
                   if None not in was else f"the global batch (now batch_size {self._position.batch_size} x world "
                   f"size {world})")
        raise RuntimeError(
            f"ResumableDataLoader: resumed after {start} of {self._position.n} samples with {changed}: Lightning's "
            f"restored batch counter ({batches} batches of the old size) plus the {left} batches left is not the "
            f"{len(self)} batches of an epoch now, so the epoch would end with samples untrained or run past them. "
            "Add megatrain_lightning.data.ResumedEpochAlignment() to Trainer(callbacks=...) (the recipes add it), "
            "or resume with the saved batch size and world size.")

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "samples", "batches", "batch_size", "world_size"}`` (plus ``"accumulate_grad_batches"`` once
        :class:`~megatrain_lightning.data.ResumedEpochAlignment` recorded it), the same on every rank: ``samples``
        (consumed by all ranks together) decides the resume position, ``batches`` is Lightning's batch counter of
        the epoch. A state loaded but not yet iterated is returned as loaded."""
        world, _ = self._position.world()
        if self._resume is not None and not self._aligned:  # as loaded: its counter is in the saved configuration
            epoch, samples, batches = self._resume
            return {"epoch": epoch, "batches": batches, "samples": samples,
                    **{k: v for k, v in self._saved.items() if k not in ("epoch", "batches", "samples")}}
        if self._resume is not None:
            epoch, samples, batches = self._resume
        else:
            epoch, batches = self._epoch, self._start_batches + self._yielded
            samples = consumed(self._position.n, self._start, self._yielded, self._position.batch_size, world)
        out = {"epoch": epoch, "batches": batches, "samples": samples, "batch_size": self._position.batch_size,
               "world_size": world}
        if self.accumulate_grad_batches is not None:
            out["accumulate_grad_batches"] = self.accumulate_grad_batches
        return out

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues epoch ``state["epoch"]`` after its first ``state["samples"]`` samples (or
        starts the following epoch if no global step is left), at this loader's batch size and world size. A
        state without ``samples`` (``{"epoch", "batches"}``) is read as ``batches`` global steps of this loader's
        global batch.

        With another batch size or world size than the state's, Lightning's restored batch counter no longer
        matches: :class:`~megatrain_lightning.data.ResumedEpochAlignment` resets it; without it the first
        iteration raises RuntimeError naming the change."""
        epoch, batches = int(state["epoch"]), int(state.get("batches", 0))
        if "samples" in state:
            samples = int(state["samples"])
        else:
            samples = batches * self._position.batch_size * self._position.world()[0]
        self._resume = (epoch, min(max(samples, 0), self._position.n), batches)
        self._saved = {k: int(v) for k, v in state.items()}
        self._aligned = False
