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
    """Applies the pending updates first among the callbacks' hooks (Lightning calls callbacks before the
    strategy's own hooks, and has no strategy hook at a batch's or an epoch's end):

    * at every training epoch's end, where ``StochasticWeightAveraging`` averages the weights;
    * at every training batch's end when a ``WeightAveraging`` callback (``EMAWeightAveraging``) is in the Trainer,
      which averages there (unflushed, it averaged weights one step old: final weights 2% off plain Lightning's);
    * at ``on_train_end``, before SWA or ``WeightAveraging`` copy their average into the parameters;
    * at ``on_validation_start`` (also mid-epoch), whose other hooks run before the strategy's and may swap
      weights in;
    * at a training batch's start (end) when a ``BaseFinetuning`` subclass overrides ``on_train_batch_start``
      (``on_train_batch_end``) and may unfreeze there: its ``filter_on_optimizer`` tells parameters by their
      values, and a trained parameter with a pending update looks frozen (``BaseFinetuning`` itself unfreezes in
      ``on_train_epoch_start``, after the epoch-end flush).

    Other callbacks that read weights in ``on_train_batch_end`` call ``trainer.strategy.flush()`` themselves
    (docs/guide/models-and-hooks.md, "Reading and writing weights in hooks"): flushing for every callback that
    overrides the hook (progress bars, loggers) would give up the optimizer overlap on every step."""

    _flushed_step = -1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if any(_finetuning_overrides(cb, "on_train_batch_start") for cb in trainer.callbacks):
            trainer.strategy.flush()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.strategy.checkpoints.save_deferred(trainer)  # a save asked for mid-backward (optimizer_in_backward)
        if trainer.global_step == self._flushed_step:  # no optimizer step since (a micro-batch of accumulation)
            return
        if any((_WeightAveraging is not None and isinstance(cb, _WeightAveraging))
               or _finetuning_overrides(cb, "on_train_batch_end") for cb in trainer.callbacks):
            self._flushed_step = trainer.global_step
            trainer.strategy.flush()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.flush()

    # at validation start: before the other callbacks' and the module's hooks, which may read or write weights
    on_validation_start = on_train_end = on_train_epoch_end


def _finetuning_overrides(cb: Callback, hook: str) -> bool:
    """``cb`` is a ``BaseFinetuning`` whose class overrides the Lightning hook ``hook`` (it may unfreeze there)."""
    return isinstance(cb, BaseFinetuning) and getattr(type(cb), hook) is not getattr(BaseFinetuning, hook)


class _AfterWeightAveraging(Callback):
    """Runs after every other callback at the hooks where Lightning's ``WeightAveraging`` writes the parameters
    through ``param.data`` (swap in and out around validation, copy in at ``on_train_end``). Those writes move no
    version counter, so the engine is told (:meth:`MegaTrainStrategy.weights_written`); otherwise the cached
    bf16/fp16 wire images keep the old weights (validation losses and final weights 0.4% off plain Lightning's)."""

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if _WeightAveraging is not None and any(isinstance(cb, _WeightAveraging) for cb in trainer.callbacks):
            trainer.strategy.weights_written()

    on_validation_epoch_end = on_train_end = on_validation_epoch_start
