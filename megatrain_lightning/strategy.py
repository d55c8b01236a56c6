"""``MegaTrainStrategy``: Lightning glue around the streaming engine, ``Trainer(strategy="megatrain")`` (after
``import megatrain_lightning``) or ``Trainer(strategy=MegaTrainStrategy(...))``. The model stays an ordinary
``LightningModule`` built on the CPU; what ``setup`` does to it and to the optimizer of ``configure_optimizers``:
docs/architecture.md, "1. Setup". After ``fit`` the module's parameters are the trained fp32 weights.

What hooks and callbacks see (``param.grad``, pending updates, when to call ``trainer.strategy.flush()``):
docs/guide/models-and-hooks.md, "Reading and writing weights in hooks" and "Gradients in hooks".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from typing import Any, Callable, Generator, Mapping

import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .callbacks import add_flush_callbacks
from .config import MegaTrainConfig, optimizer_in_backward_on
from .optim.host_adamw import UnsupportedOptimizerError
from .parallel.preflight import check_same_batches
from .precision import MegaTrainPrecision, to_megatrain_precision
from .setup_guards import (check_setup, refuse_placeholder_writes, refuse_unfrozen, user_code_after_clip,
                           user_code_sees_step_gradients)
from .strategy_base import MegaTrainBase

log = logging.getLogger(__name__)


class MegaTrainStrategy(MegaTrainBase, ParallelStrategy):
    """Train a model larger than accelerator memory by streaming it block by block.

    fp32 master weights, fp32 gradient accumulators and AdamW ``exp_avg``/``exp_avg_sq`` live
    in host RAM; the device holds the block computing, ``lookahead`` prefetched blocks and the
    saved block inputs (MegaTrain, arXiv 2604.05091).

    Args:
        config: every option at once (:class:`~megatrain_lightning.config.MegaTrainConfig`).
        options: the options one by one, as keywords (``lookahead=2``, ``offload_params="nvme"``...): the
            fields of :class:`~megatrain_lightning.config.MegaTrainConfig`.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning strategy.

    Several processes (``Trainer(devices=N, num_nodes=M)``) are launched as ``DDPStrategy`` launches them; every
    gradient batch is averaged over the ranks as soon as its block's backward ends, so the ranks' weights stay
    identical (docs/architecture.md, "Several GPUs and nodes").

    Raises:
        ValueError, TypeError: an option fails its check (when the strategy is built).
        NotImplementedError: several processes with ``offload_params``/``offload_optimizer="nvme"`` (at setup).
        ValueError: a ``meta``-device parameter that no weights source provides, or whose checkpoint tensor has
            another shape (at setup).
        UnsupportedOptimizerError: ``configure_optimizers`` returned several optimizers, or one the host cannot
            step (``optim/host_generic.py``).
        BlockDiscoveryError: the model has no discoverable blocks.
        RendezvousError: the launch's environment contradicts ``devices`` and ``num_nodes`` (in ``Trainer(...)``).
        ConfigMismatchError: the ranks were started with different models or options (at setup, every rank).
        SharedMemoryTooSmall: ``/dev/shm`` of some node cannot hold the node's state (at setup, every rank).
        PeerFailure: another rank died or stopped answering (during the run).
    """

    strategy_name = "megatrain"
    def __init__(
        self,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        *,
        config: MegaTrainConfig | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        **options: Any,
    ) -> None:
        self._init_megatrain(config, options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._interrupt_pending = False  # Ctrl-C arrived during in-backward updates: raised once the step is complete
        self._warned_log = False

    # ------------------------------------------------------------------ precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else MegaTrainPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = to_megatrain_precision(plugin)

    # ------------------------------------------------------------------ placement
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Create the model on the CPU (never on the accelerator): the host store is built from it."""
        yield

    def model_to_device(self) -> None:
        """Only buffers move to the device; parameters stay in the host store."""
        if self.engine is not None:
            self.engine.buffers_to(self.root_device)

    def setup(self, trainer: Any) -> None:
        """Build the host store and streaming proxies, take over the optimizer (when fitting)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_setup(self, trainer)  # refusals and warnings about user code, before any work
        cfg = self.config
        reserve_frozen = cfg.unfreeze_during_fit if cfg.unfreeze_during_fit is not None \
            else any(isinstance(cb, BaseFinetuning) for cb in trainer.callbacks)  # BaseFinetuning unfreezes in fit
        self.precision_plugin.convert_module(module)  # bf16-true: the buffers in bf16, as Lightning's
        self._build_engine(module, reserve_frozen, trainer)
        module._device = self.root_device  # the module is never moved as a whole
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup_optimizers(trainer)
            self._take_over_optimizer()
            add_flush_callbacks(trainer)
        plugin = self.precision_plugin
        plugin.attach_engine(self.engine, self.root_device.type)
        # user code may run between the clip and the step (and read or edit param.grad): clip at once there
        plugin.clip_in_place = user_code_after_clip(module) and self.engine.ownership is None
        if trainer.state.fn == TrainerFn.FITTING and self.is_global_zero and self._updates_in_backward():
            log.info("megatrain: optimizer_in_backward: each block's update starts as soon as its gradients of the "
                     "step are complete (RAM tier: on a host thread of its own, until the next forward needs the "
                     "block; call trainer.strategy.flush() before reading weights directly between steps). Ctrl-C then "
                     "stops the run once the step is complete; any other exception raised inside a backward leaves "
                     "the model half updated, and training and saving are refused until a checkpoint is loaded. "
                     "optimizer_in_backward=False keeps every step consistent (on the NVMe tier: 8 bytes more I/O "
                     "per trainable parameter and step).")
        self.setup_precision_plugin()
        self.takeover.wrap_lightning_optimizers(self._lightning_optimizers)

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's (``configure_optimizers`` again). During fit (a callback changing optimizers mid-training) the
        host optimizer then steps the new one, after applying the old one's pending updates; the new one starts with
        empty state, as a new torch optimizer does.

        Raises:
            UnsupportedOptimizerError: not exactly one optimizer, or one the host cannot step
                (``optim/host_generic.py``).
        """
        super().setup_optimizers(trainer)
        if self.takeover.active and self.engine is not None and not self.engine.closed \
                and trainer.state.fn == TrainerFn.FITTING:
            self.takeover.restore(self._lightning_optimizers)
            self.takeover.close()
            self._take_over_optimizer()
            self.takeover.wrap_lightning_optimizers(self._lightning_optimizers)

    def _take_over_optimizer(self) -> None:
        """The host AdamW steps the one optimizer of ``configure_optimizers`` (:mod:`~.optim.takeover`)."""
        if len(self.optimizers) != 1:
            raise UnsupportedOptimizerError(
                f"megatrain steps exactly one optimizer on the host; configure_optimizers returned "
                f"{len(self.optimizers)}. Return a single optimizer, e.g. torch.optim.AdamW (use param groups for "
                "different learning rates or weight decay)."
            )
        self._attach_host_optimizer(self.optimizers[0], self.precision_plugin, self.lr_scheduler_configs)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step (the closure runs the forward and backward), then the step's accounting.

        A step that an exception stops after its backward applied part of the updates (``optimizer_in_backward``)
        is reported to the engine (``engine/stopped_step.py``), which then refuses training and saving; Ctrl-C waits
        for the step instead (:meth:`_ctrl_c_after_step`)."""
        try:
            with self._ctrl_c_after_step():
                out = super().optimizer_step(optimizer, closure, model, **kwargs)
        except BaseException as err:
            if self.engine is not None:
                step = self.lightning_module.trainer.global_step + 1
                self.engine.stopped.stopped(f"{step} (global_step {step - 1} -> {step}, stopped by {type(err).__name__})")
            self.checkpoints.drop_deferred()  # asked for in the stopped backward: never written
            self._interrupt_pending = False
            raise
        if self.engine is not None:
            self.engine.stopped.completed()
            metrics = self.engine.end_step()
            if self.config.log_stats:
                self._log_stats(metrics)
        return out

    @contextlib.contextmanager
    def _ctrl_c_after_step(self) -> Generator[None, None, None]:
        """A Ctrl-C (``SIGINT``) that arrives while the backward applies the updates (``optimizer_in_backward``) is
        held until the step is complete and raised as ``KeyboardInterrupt`` at the next point where Lightning can stop
        cleanly (:meth:`_raise_pending_interrupt`), so the model is never half updated. A second Ctrl-C stops at once
        (then ``engine/stopped_step.py`` refuses going on). Only from the main thread, and only where ``SIGINT`` has
        Python's default handler."""
        if (self.engine is None or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        grads = self.engine.grads

        def on_sigint(signum: int, frame: Any) -> None:
            if self._interrupt_pending or not grads.sends_left:
                raise KeyboardInterrupt
            self._interrupt_pending = True
            log.warning("megatrain: Ctrl-C received while the backward applies the optimizer updates "
                        "(optimizer_in_backward); stopping once this optimizer step is complete, so that the model is "
                        "not left half updated. Press Ctrl-C again to stop now (training and saving are then refused "
                        "until a checkpoint is loaded).")

        signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _raise_pending_interrupt(self) -> None:
        if self._interrupt_pending:
            self._interrupt_pending = False
            raise KeyboardInterrupt

    def _log_stats(self, metrics: Mapping[str, float]) -> None:
        """Log one optimizer step's accounting (``megatrain/*``: bytes, seconds, counts) with the module's
        ``log_dict(on_step=True, on_epoch=False)``, as a ``self.log`` in the hook that ran the step would: to every
        logger and into ``trainer.callback_metrics``. Lightning logs step metrics once per batch, so a
        manual-optimization ``training_step`` that steps twice logs the second step's values; ``engine.history`` has
        both.

        Values are float64 CPU tensors: byte counts stay exact and logging adds no device synchronisation.
        """
        module = self.lightning_module
        try:
            trainer = module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return
        if trainer is None or trainer.barebones or not trainer.training:
            return
        values = {k: torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}
        try:
            # logger left at its default (True): no "no logger configured" warning with logger=False
            module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
        except MisconfigurationException as err:
            if not self._warned_log:
                self._warned_log = True
                log.warning("megatrain: per-step statistics not logged (%s); they stay in "
                            "trainer.strategy.engine.history.", err)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step, after deciding whether this micro-batch's backward applies the AdamW updates."""
        if self.engine is not None:
            self.engine.stopped.check("training")
            self._adopt_replaced_weights()
            self.engine.set_update_in_backward(self._update_in_backward_now())
        return super().training_step(*args, **kwargs)

    def _adopt_replaced_weights(self) -> None:
        """Before a training or evaluation step: parameters whose ``.data`` user code replaced (``param.data =
        tensor``) are taken into the store, as plain PyTorch would compute with them.

        Raises:
            RuntimeError: with several processes (the masters are the node's shared copy, which one rank must not
                change alone).
        """
        refuse_placeholder_writes(self.engine)
        if self.groups is not None:
            found = self.engine.params.replaced()
            if found:
                name = self.engine.store.slabs[found[0][0]].entries[found[0][1]].ref.fqn
                raise RuntimeError(f"megatrain: {len(found)} parameter(s) (e.g. {name}) were given new tensors "
                                   "(param.data = ...) during fit; with several processes write the values in place "
                                   "instead, on every rank (with torch.no_grad(): param.copy_(value)).")
            return
        self.engine.adopt_replaced()

    def _updates_in_backward(self) -> bool:
        """Whether this fit updates slabs in backward at all: ``optimizer_in_backward`` on, automatic optimization,
        no clipping, no loss scaling and no user code that reads the step's gradients (else the deferred schedule)."""
        engine, module = self.engine, self.lightning_module
        if engine is None or engine.optimizer is None or module is None \
                or not optimizer_in_backward_on(self.config.optimizer_in_backward, engine.store.nvme is not None):
            return False
        trainer = module.trainer
        return not (not module.automatic_optimization or trainer.gradient_clip_val
                    or getattr(self.precision_plugin, "scaling", False) or user_code_sees_step_gradients(module, trainer))

    def _update_in_backward_now(self) -> bool:
        if not self._updates_in_backward():
            return False
        try:
            return not self.lightning_module.trainer.fit_loop.epoch_loop._should_accumulate()
        except AttributeError:  # another Lightning version: stay with the deferred schedule
            return False

    def on_exception(self, exception: BaseException) -> None:
        """With the weights on NVMe, torch's own refusal of an in-place write into a stride-0 placeholder ("refers to
        a single memory location") gets a note saying why and what to do (``add_note``, Python >= 3.11)."""
        super().on_exception(exception)
        if self.engine is None or not self.engine.store.masters_on_disk or not hasattr(exception, "add_note"):
            return
        if "refers to a single memory location" in str(exception):
            exception.add_note(
                "megatrain: with offload_params='nvme' the module's parameters are placeholders outside a block's "
                "compute (their weights are on NVMe), so they cannot be written in place. Make the edit inside "
                "`with trainer.strategy.summon_full_params(module):`, or assign param.data = new_tensor.")

    def _before_evaluation(self, what: str) -> None:
        """Before a validation, test or prediction loop: check the weights are consistent, apply the pending updates
        and :meth:`_adopt_replaced_weights`."""
        if self.engine is not None:
            self.engine.stopped.check(what)
            self.flush()
            self._adopt_replaced_weights()

    on_test_start = functools.partialmethod(_before_evaluation, "testing")
    on_predict_start = functools.partialmethod(_before_evaluation, "prediction")

    def on_validation_start(self) -> None:
        self._raise_pending_interrupt()
        self._before_evaluation("validation")

    def on_train_start(self) -> None:
        """The first step's accounting window opens here (:meth:`StreamingEngine.start_steps`); data parallel:
        :func:`~.parallel.preflight.check_same_batches`, once, before the first step."""
        self.engine.start_steps()
        if self.groups is not None:
            trainer = self.lightning_module.trainer
            batches = trainer.num_training_batches
            if trainer.max_steps > 0:  # a run that ends within every rank's first epoch needs no equal epochs
                batches = min(batches, trainer.max_steps * trainer.accumulate_grad_batches)
            check_same_batches(self.groups, batches)

    def on_train_end(self) -> None:
        """Runs after the callbacks' and the module's ``on_train_end``, so a placeholder write in them is refused here
        rather than lost."""
        refuse_placeholder_writes(self.engine)
        self.flush()
        self._raise_pending_interrupt()

    def on_validation_end(self) -> None:
        refuse_placeholder_writes(self.engine)

    on_test_end = on_predict_end = on_validation_end

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Refuse a parameter unfrozen since setup (this runs after the callbacks' and the module's
        ``on_train_batch_start``, so an unfreeze there is caught before its forward).

        Raises:
            RuntimeError: :func:`~megatrain_lightning.setup_guards.refuse_unfrozen`.
        """
        super().on_train_batch_start(batch, batch_idx)
        self._raise_pending_interrupt()  # Ctrl-C during the last step's in-backward updates
        if self.engine is not None:
            refuse_unfrozen(self.lightning_module, self.engine.trainable, self.config.unfreeze_during_fit is False)

    # ------------------------------------------------------------------ state
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict: host-store views of the current weights, no copy. Empty with masters on NVMe
        (directory checkpoints read the store one slab at a time; a full state dict would not fit the host budget)."""
        self.flush()
        if self._masters_on_disk():
            return {}
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The host optimizer's state in its class's ``state_dict()`` format, as views (no copy); only the param
        groups where one process cannot hold it all (``HostAdamW.streams_state``): directory checkpoints stream it."""
        self.flush()
        if self.engine is None or self.engine.optimizer is None:
            return super().optimizer_state(optimizer)
        if self.engine.optimizer.streams_state():
            return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        return self.engine.optimizer.state_dict(copy=False)

    # ------------------------------------------------------------------ checkpoints
    # directory checkpoints, deferred to the end of the step when asked for mid-backward, and plain ``.ckpt`` files
    # (:class:`~.checkpoint.strategy_io.StrategyCheckpoints`)
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.checkpoints.save(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoints.load(checkpoint_path, weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.checkpoints.load_model_state_dict(checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.checkpoints.load_optimizer_state_dict(checkpoint)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def teardown(self) -> None:
        """Flush updates, restore the module's own ``forward`` methods and the optimizer."""
        self._release_engine()
        self.takeover.restore(self._lightning_optimizers)
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # the store was never built (preflight refused the run): moving the module would hide the real
            # error behind "Cannot copy out of meta tensor"
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()
