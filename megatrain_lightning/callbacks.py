"""The callbacks the strategy adds to the Trainer at setup (:func:`add_flush_callbacks`): they apply pending optimizer
updates before other callbacks read the weights, and tell the engine about weights Lightning's ``WeightAveraging``
writes through ``param.data``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BaseFinetuning, Callback

try:  # Lightning >= 2.5: WeightAveraging / EMAWeightAveraging read the weights after every optimizer step
    from lightning.pytorch.callbacks.weight_averaging import WeightAveraging as _WeightAveraging
except ImportError:  # pragma: no cover - older Lightning
    _WeightAveraging = None


def add_flush_callbacks(trainer: Any) -> None:
    """Put :class:`_FlushForCallbacks` first and :class:`_AfterWeightAveraging` last in ``trainer.callbacks``
    (once per Trainer)."""
    if not any(isinstance(cb, _FlushForCallbacks) for cb in trainer.callbacks):
        trainer.callbacks.insert(0, _FlushForCallbacks())
        trainer.callbacks.append(_AfterWeightAveraging())


class _FlushForCallbacks(Callback):
    """Applies the pending updates before the callbacks that read the weights, first among their hooks (the
    strategy puts it at the front of ``trainer.callbacks``; Lightning calls callbacks before the strategy's own
    hooks, and has no strategy hook at a batch's or an epoch's end):

    * at the end of every training epoch: ``StochasticWeightAveraging`` averages the weights there, and copies
      the average into the parameters at ``on_train_end`` (a pending update applied after that would overwrite
      it);
    * at the end of every training batch, when a ``WeightAveraging`` callback (Lightning's EMA,
      ``EMAWeightAveraging``) is in the Trainer: it averages the weights there after each optimizer step
      (without the flush it averaged weights one step old: final weights 2% off plain Lightning's);
    * at ``on_train_end``, before ``WeightAveraging`` copies its average into the parameters;
    * at ``on_validation_start`` (also mid-epoch, ``val_check_interval``): a callback's or the module's own
      ``on_validation_start`` runs before the strategy's and may swap weights in (an EMA of its own);
    * at the start (end) of every training batch, when a ``BaseFinetuning`` subclass overrides
      ``on_train_batch_start`` (``on_train_batch_end``), where it may unfreeze: its ``filter_on_optimizer`` tells
      parameters already in the optimizer by their values, and a trained parameter whose last update was still
      pending looked like a frozen one (a mid-epoch unfreeze left two unfrozen norms out of the new param group).
      ``BaseFinetuning`` itself unfreezes in ``on_train_epoch_start``, after the epoch-end flush.

    Other callbacks that read weights in ``on_train_batch_end`` (a hand-written EMA) call
    ``trainer.strategy.flush()`` first (docs/guide/models-and-hooks.md, "Reading and writing weights in hooks"); flushing for every callback that
    overrides the hook (progress bars, loggers) would give up the optimizer overlap on every step."""

    _flushed_step = -1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if any(_finetuning_overrides(cb, "on_train_batch_start") for cb in trainer.callbacks):
            trainer.strategy.flush()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.strategy.save_deferred(trainer)  # a save asked for mid-backward (optimizer_in_backward)
        if trainer.global_step == self._flushed_step:  # no optimizer step since (a micro-batch of accumulation)
            return
        if any((_WeightAveraging is not None and isinstance(cb, _WeightAveraging))
               or _finetuning_overrides(cb, "on_train_batch_end") for cb in trainer.callbacks):
            self._flushed_step = trainer.global_step
            trainer.strategy.flush()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.flush()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.flush()  # before the other callbacks' and the module's hooks, which may read or write weights

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.flush()


def _finetuning_overrides(cb: Callback, hook: str) -> bool:
    """``cb`` is a ``BaseFinetuning`` whose class overrides the Lightning hook ``hook`` (it may unfreeze there)."""
    return isinstance(cb, BaseFinetuning) and getattr(type(cb), hook) is not getattr(BaseFinetuning, hook)


class _AfterWeightAveraging(Callback):
    """Runs after every other callback (the strategy appends it to ``trainer.callbacks``) where Lightning's
    ``WeightAveraging`` (``EMAWeightAveraging``) writes the parameters through ``param.data``: swapping the
    average in at ``on_validation_epoch_start`` and back at ``on_validation_epoch_end``, copying it in at
    ``on_train_end``. Those writes move no version counter, so the engine is told
    (:meth:`MegaTrainStrategy.weights_written`): without it, under mixed precision the cached bf16/fp16 wire
    images kept the weights from before the swap (validation losses and final weights 0.4% off plain
    Lightning's)."""

    @staticmethod
    def _written(trainer: Any) -> None:
        if _WeightAveraging is not None and any(isinstance(cb, _WeightAveraging) for cb in trainer.callbacks):
            trainer.strategy.weights_written()

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._written(trainer)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._written(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._written(trainer)
