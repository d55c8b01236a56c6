"""What the recipe prints while it runs: one line per log message, third-party notices that do not concern the
user filtered out, a progress bar with a right total, and a line per optimizer step where no bar is visible.

* :func:`tidy_console` (called by the recipes once Hydra has set up logging, and by the planner's CLI):
  ``lightning`` adds its own console handler to the ``lightning`` logger (and ``lightning.pytorch``,
  ``lightning.fabric`` and ``megatrain_lightning`` to theirs, not propagating, when imported before Hydra sets up
  logging), so under Hydra's root handler each message would print twice or bypass Hydra's format and log file;
  they are removed, and the loggers propagate, when the root logger has handlers. Filtered, and only these:
  torch's ``FutureWarning`` that ``isinstance(treespec, LeafSpec)`` is deprecated (raised from Lightning's own ``_pytree.py``), Lightning's "Tip"
  advertising litlogger (every ``Trainer`` construction), and what importing torchao logs (transformers imports it
  at every model build; ``optim=adamw8bit`` uses it): "Failed to load ...so" for each CUDA kernel library that does
  not load under this torch (the 8-bit optimizers' CPU code does not need them) and torch's warning that torchao
  registers Enum classes with ``register_constant``.
* :class:`RecipeProgressBar` and :class:`StepLog` (a line per step where no bar is visible, so that a long phase is
  never silent).
"""

from __future__ import annotations

import logging
import re
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

log = logging.getLogger(__name__)

#: (message regex, category) of the third-party warnings the recipe filters (``warnings.filterwarnings``)
FILTERED_WARNINGS = ((r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),)
#: (logger, message regex) of the third-party log records the recipe filters (module docstring)
FILTERED_LOGS = (
    ("lightning.pytorch.utilities.rank_zero", r"💡 Tip:"),
    ("torchao", r"Failed to load \S+\.so: "),
    ("torch.utils._pytree", r".* is an Enum subclass and is now natively supported by torch\.compile"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(str(record.getMessage()))


def tidy_console() -> None:
    """One line per log message, and :data:`FILTERED_WARNINGS` / :data:`FILTERED_LOGS` filtered (module
    docstring). Idempotent; keeps Lightning's handler when the root logger has none."""
    for message, category in FILTERED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in FILTERED_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
    if logging.getLogger().hasHandlers():
        # imported before Hydra set up logging, these packages gave their loggers console handlers of their own
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "megatrain_lightning"):
            own = logging.getLogger(name)
            for h in list(own.handlers):
                if type(h) is logging.StreamHandler:  # the package's console handler, not a file handler
                    own.removeHandler(h)
                    own.propagate = True  # to the root's handlers, as a logger without its own


def bar_visible(trainer: pl.Trainer) -> bool:
    """Whether a progress bar shows live progress: the trainer has one and stdout is a terminal."""
    return trainer.progress_bar_callback is not None and sys.stdout.isatty()


class RecipeProgressBar(RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar):  # rich comes with lightning's extras
    """Lightning's Rich (without ``rich``: TQDM) progress bar with the batches left to ``max_steps`` as the training
    total, the epoch total only when ``max_epochs`` bounds the run (no ``Epoch 0/-2``), and no ``v_num``."""

    _left: int | None = None  # training batches left before ``max_steps`` (``None``: not bounded by steps)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        bounded = trainer.max_steps is not None and trainer.max_steps >= 0
        self._left = max(0, (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches) \
            if bounded else None
        super().on_train_epoch_start(trainer, *args)

    @property
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches
        return total if self._left is None else min(total, self._left)

    def _get_train_description(self, current_epoch: int) -> str:  # RichProgressBar's; TQDM's bar has none
        epochs = self.trainer.max_epochs
        d = f"Epoch {current_epoch}" + (f"/{epochs - 1}" if epochs is not None and epochs > 0 else "")
        return f"{d:{len(self.validation_description)}}" if len(self.validation_description) > len(d) else d

    def get_metrics(self, trainer: pl.Trainer, pl_module: Any) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class StepLog(pl.Callback):
    """Where no progress bar is visible (:func:`bar_visible`: disabled, or stdout not a terminal: a log file,
    ``| tee``): one INFO line per optimizer step, ``step 3/20: loss
    2.3456, 61.2 s/step`` (the logged ``metric``, as :class:`~.results.LossHistory` reads it), and per validation
    batch, ``validation batch 2/8 (14.0 s)``.

    The step time runs from the start of the step's first micro-batch to the end of the batch that completes it, so
    checkpoint saves and validation between steps are not counted in it."""

    def __init__(self, metric: str = "train_loss") -> None:
        self.metric = metric
        self._last_step = 0
        self._t: float | None = None
        self._val_t = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._last_step, self._t = int(trainer.global_step), None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._t is None:
            self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step <= self._last_step or self._t is None:
            return
        per = (time.perf_counter() - self._t) / (trainer.global_step - self._last_step)
        self._last_step, self._t = int(trainer.global_step), None
        if bar_visible(trainer) or not trainer.is_global_zero:
            return
        loss = trainer.callback_metrics.get(self.metric)
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        log.info("step %d%s: loss %s, %.1f s/step", trainer.global_step, total,
                 "-" if loss is None else f"{float(loss):.4f}", per)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._val_t = time.perf_counter()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or bar_visible(trainer) or not trainer.is_global_zero:
            return
        totals = trainer.num_val_batches
        total = totals[dataloader_idx] if isinstance(totals, list) and len(totals) > dataloader_idx else "?"
        total = int(total) if isinstance(total, (int, float)) and total != float("inf") else total
        log.info("validation batch %d/%s (%.1f s)", batch_idx + 1, total, time.perf_counter() - self._val_t)
