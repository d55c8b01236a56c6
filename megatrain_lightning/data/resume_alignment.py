"""Lightning's batch counter of a resumed epoch, made consistent with a :class:`ResumableDataLoader` that resumed
with another batch size, world size or gradient accumulation than the run that wrote the checkpoint.

Lightning restores the epoch's batch counter (``epoch_loop.batch_progress.current``, in batches of the *saved*
size) and ends the epoch when it reaches ``trainer.num_training_batches`` (the loader's ``len()``, *new* size) or
the data fetcher's ``fetched`` (started at the restored counter) reaches the loader's length. The loader resumes at
the saved *sample* position, so with another global batch the epoch would end early (samples never trained) or late.

:class:`ResumedEpochAlignment` (``on_train_start``: after the loader's state is loaded, before the first batch)
sets the counter to ``len(loader) - steps_left``, rounded down to a multiple of ``accumulate_grad_batches`` (whole
accumulation windows); when it rounds, ``trainer.num_training_batches`` is shortened for the resumed epoch only.
``global_step`` is not touched, so ``max_steps`` and step-based LR schedules continue from the checkpoint.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from .resumable import ResumableDataLoader

_FIELDS = ("ready", "started", "processed", "completed")


class ResumedEpochAlignment(Callback):
    """Sets Lightning's batch counter of a resumed epoch from the :class:`ResumableDataLoader`'s sample position
    (module docstring).

    The recipes add one; elsewhere pass it in ``Trainer(callbacks=[...])`` (without it, see
    :meth:`ResumableDataLoader.load_state_dict`). Also records ``accumulate_grad_batches`` in the loader's state.
    A no-op for fresh runs, other loaders, and resumes with an unchanged configuration.

    Raises (at ``on_train_start``):
        RuntimeError: several training loaders of which one resumed with a changed configuration, or a
            mid-epoch checkpoint whose samples left are fewer than one global step of the new configuration.
    """

    def __init__(self) -> None:
        self._full_epoch: int | float | None = None  # num_training_batches to restore after the resumed epoch

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        fit_loop = trainer.fit_loop
        combined = fit_loop._combined_loader
        if combined is None:
            return
        loaders = list(combined.flattened)
        ours = [dl for dl in loaders if isinstance(dl, ResumableDataLoader)]
        for dl in ours:
            dl.accumulate_grad_batches = int(trainer.accumulate_grad_batches)
        pending = [dl for dl in ours if dl.resume_point() is not None]
        if not pending or not fit_loop.restarting:
            return
        epoch_loop = fit_loop.epoch_loop
        progress = epoch_loop.batch_progress
        # the counter as Lightning's epoch_loop.reset() will leave it (it first counts a batch saved at its end)
        taken = progress.current.completed + int(epoch_loop.restarted_on_train_batch_end)
        if len(loaders) > 1:
            if any(_changed(dl, taken) for dl in pending):
                raise RuntimeError(
                    "ResumedEpochAlignment: the training data has several loaders and a ResumableDataLoader among them "
                    "resumed with another batch size or world size than its checkpoint; Lightning's one batch counter "
                    "cannot match them all. Resume with the saved batch size and world size, or with one loader.")
            return
        dl = pending[0]
        samples, left = dl.resume_point()  # type: ignore[misc]
        full = len(dl)
        saved = dl.state_dict()  # as loaded: the configuration that wrote it, where recorded
        now = {"batch_size": dl._position.batch_size, "world_size": dl._position.world()[0],
               "accumulate_grad_batches": int(trainer.accumulate_grad_batches)}
        if not _changed(dl, taken) and all(saved.get(k, v) == v for k, v in now.items()):
            return  # the same configuration: Lightning's counter already fits
        if progress.is_last_batch or (left == 0 and samples > 0):
            if not progress.is_last_batch and samples < dl._position.n:
                raise RuntimeError(
                    f"ResumedEpochAlignment: the checkpoint was written after {samples} of the epoch's "
                    f"{dl._position.n} samples; the {dl._position.n - samples} left are fewer than one global step at "
                    f"batch_size {dl._position.batch_size} x world size {dl._position.world()[0]} (was "
                    f"{saved.get('batch_size')} x {saved.get('world_size')}) and would be dropped as the epoch's tail. "
                    "Resume with the saved batch size and world size until the epoch ends, or from a checkpoint "
                    "written at the end of an epoch.")
            target, next_epoch = full, True  # the epoch is complete: as an end-of-epoch checkpoint of this size
        else:
            target, next_epoch = full - left, False
            aligned = target - target % int(trainer.accumulate_grad_batches)
            if aligned != target:  # start at a window boundary; the epoch ends after the `left` batches
                target = aligned
                self._full_epoch = fit_loop.max_batches
                fit_loop.max_batches = aligned + left
                if fit_loop._data_fetcher is not None and fit_loop._data_fetcher.length is not None:
                    fit_loop._data_fetcher.length = aligned + left
        delta = target - taken
        for tracker in (progress.current, progress.total):
            for name in _FIELDS:
                setattr(tracker, name, getattr(tracker, name) + delta)
        dl.resume_at(target, next_epoch=next_epoch)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore(trainer)

    def _restore(self, trainer: Any) -> None:
        if self._full_epoch is not None:
            trainer.fit_loop.max_batches = self._full_epoch
            self._full_epoch = None


def _changed(dl: ResumableDataLoader, taken: int) -> bool:
    """Whether ``taken`` restored batches plus the loader's steps left is not one epoch of its configuration."""
    samples, left = dl.resume_point()  # type: ignore[misc]
    return samples > 0 and left > 0 and taken + left != len(dl)
