"""``MegaTrainFabricStrategy``: ``Fabric(strategy="megatrain")``, the streaming engine under a hand-written loop.

The engine, options (:class:`~megatrain_lightning.config.MegaTrainConfig`), tiers, precision and checkpoint format
are the Trainer strategy's (:mod:`megatrain_lightning.strategy_base` holds what both share). A full loop, and what
each Fabric call does, are in docs/guide/fabric.md.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _sync_ddp_if_available

from .checkpoint.hf_meta import params_on_meta
from .config import MegaTrainConfig
from .optim.host_adamw import UnsupportedOptimizerError
from .precision import MegaTrainFabricPrecision, to_megatrain_fabric_precision
from .setup_guards import refuse_checkpoint_plugin
from .strategy_base import MegaTrainBase


class MegaTrainFabricStrategy(MegaTrainBase, ParallelStrategy):
    """``Fabric(strategy="megatrain")``: stream a model's blocks through one device per process; fp32 masters, gradient
    accumulators and AdamW state in host RAM (or NVMe), as :class:`~megatrain_lightning.strategy.MegaTrainStrategy`.

    Args:
        config, options: every option at once or one by one (:class:`~megatrain_lightning.config.MegaTrainConfig`).
        accelerator, checkpoint_io, precision, parallel_devices, cluster_environment: as for Fabric's strategies
            (Fabric's connector fills them in from ``Fabric(...)``).

    Raises:
        ValueError, TypeError: an option fails its check (when built).
        UnsupportedPrecisionError: ``Fabric(precision=...)`` other than 32-true, bf16-mixed, 16-mixed, bf16-true.
        UnsupportedOptimizerError: at setup, several optimizers, an optimizer set up before the module or for another
            module, or one the host cannot step (``optim/host_generic.py``).
        RuntimeError: at ``fabric.setup(model, optimizer)``, an optimizer holding the meta-device parameters of
            ``init_module(empty_init=True)``.
        NotImplementedError: at setup, several modules (the engine streams one), ``fabric.setup_module`` a second
            time with another module, or ``clip_gradients`` with ``norm_type`` other than a number.
        BlockDiscoveryError, ConfigMismatchError, SharedMemoryTooSmall, RendezvousError, PeerFailure: as the
            Trainer strategy's.
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        *,
        config: MegaTrainConfig | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        **options: Any,
    ) -> None:
        self._init_megatrain(config, options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        self.lightning_module: torch.nn.Module | None = None  # the module set up (any nn.Module)
        self._state_dict_hook: Any = None  # the module's state_dict pre-hook that applies pending updates
        self._backward_sync_control = _EveryBackwardReduces()

    # ------------------------------------------------------------------ precision and placement
    @property  # type: ignore[override]
    def precision(self) -> MegaTrainFabricPrecision:
        return self._precision if self._precision is not None else MegaTrainFabricPrecision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = to_megatrain_fabric_precision(precision)

    @property
    def precision_plugin(self) -> MegaTrainFabricPrecision:
        """:attr:`precision` under the Trainer strategy's name (read by the code both strategies share)."""
        return self.precision

    _set_world_ranks = MegaTrainBase.set_world_ranks  # Fabric's connector calls this name

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: the module is created on the CPU in fp32; with ``empty_init=True`` its parameters
        on the ``meta`` device (docs/guide/fabric.md, "What each Fabric call does")."""
        return params_on_meta() if empty_init else contextlib.nullcontext()

    def module_to_device(self, module: torch.nn.Module) -> None:
        """Only buffers move to the device (once the engine exists); parameters stay in the host store."""
        if self.engine is not None:
            self.engine.buffers_to(self.root_device)

    # ------------------------------------------------------------------ setup
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Any],
                                    scheduler: Any = None) -> tuple[torch.nn.Module, list[Any], Any]:
        """``fabric.setup(model, optimizer)``: :meth:`setup_module`, then :meth:`setup_optimizer`.

        Raises:
            UnsupportedOptimizerError: not exactly one optimizer.
            RuntimeError: the optimizer holds the meta-device parameters of ``init_module(empty_init=True)``.
        """
        if len(optimizers) != 1:
            raise UnsupportedOptimizerError(
                f"megatrain steps exactly one optimizer on the host; fabric.setup got {len(optimizers)}. Pass a "
                "single optimizer, e.g. torch.optim.AdamW (use param groups for different learning rates or weight "
                "decay).")
        if any(p.is_meta for g in optimizers[0].param_groups for p in g["params"]):
            raise RuntimeError(
                "megatrain: the optimizer holds meta-device parameters (the model was created under "
                "fabric.init_module(empty_init=True)); setup replaces them by parameters in the host store. Set up "
                "the model first (model = fabric.setup_module(model)), then create the optimizer from "
                "model.parameters() and call optimizer = fabric.setup_optimizers(optimizer).")
        return self.setup_module(module), [self.setup_optimizer(optimizers[0])], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Build the host store and block proxies over ``module``; the module object is returned.

        Raises:
            NotImplementedError: another module was set up with this strategy (the engine streams one model).
            CheckpointError: a checkpoint plugin (``Fabric(plugins=[...])``) that would never be used.
        """
        if self.lightning_module is not None and self.lightning_module is not module and self.engine is not None \
                and not self.engine.closed:
            raise NotImplementedError(
                f"megatrain: Fabric(strategy='megatrain') streams one model; {type(self.lightning_module).__name__} is "
                f"already set up and {type(module).__name__} was passed too. Put both in one nn.Module (one forward), "
                "or train the second with another Fabric.")
        refuse_checkpoint_plugin(self.checkpoint_io)
        self.lightning_module = module
        if self._state_dict_hook is None:  # model.state_dict() in the loop sees the last step's weights
            self._state_dict_hook = module.register_state_dict_pre_hook(lambda *_: self.flush())
        self._build_engine(module, bool(self.config.unfreeze_during_fit), zeros_for_meta=True)
        self.engine.buffers_to(self.root_device)
        plugin = self.precision
        plugin.attach_engine(self.engine, self.root_device.type)
        plugin.clip_in_place = self.engine.ownership is None  # a loop's code after the clip sees param.grad
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        """``fabric.setup_optimizers(optimizer)`` (or the second half of ``fabric.setup``): the host AdamW steps
        ``optimizer`` (:mod:`~megatrain_lightning.optim.takeover`); the optimizer object is returned.

        Raises:
            UnsupportedOptimizerError: no module set up yet, a second optimizer, or an optimizer the host cannot
                step (``optim/host_generic.py``).
        """
        if self.engine is None or self.engine.closed:
            raise UnsupportedOptimizerError(
                "megatrain: set up the module first (fabric.setup(model, optimizer), or fabric.setup_module(model) "
                "before fabric.setup_optimizers(optimizer)): the host optimizer is built over the module's store.")
        current = self.engine.optimizer
        if current is not None and current.optimizer is not optimizer and self.takeover.active:
            raise UnsupportedOptimizerError(
                "megatrain steps exactly one optimizer on the host, and one is already set up; pass a single "
                "optimizer, e.g. torch.optim.AdamW (param groups for different learning rates or weight decay).")
        if not self.takeover.active:
            self._attach_host_optimizer(optimizer, self.precision)
        return optimizer

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: the host AdamW step through the precision plugin, then the step's accounting
        (``strategy.engine.history``)."""
        try:
            out = self.precision.optimizer_step(optimizer, **kwargs)
        except BaseException:
            if self.engine is not None:
                self.engine.stopped.stopped(f"{len(self.engine.history) + 1} (stopped by an exception)")
            raise
        if self.engine is not None:
            self.engine.stopped.completed()
            self.engine.end_step()
        return out

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)``: the global norm of the host gradients (returned,
        0-dim fp32, before clipping), as ``torch.nn.utils.clip_grad_norm_``.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and an inf/NaN norm.
        """
        plugin = self.precision
        plugin.unscale_gradients(optimizer)
        return plugin.clip_norm(max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Any, clip_val: float | int) -> None:
        """``fabric.clip_gradients(model, optimizer, clip_val=...)``: every gradient clamped to ``[-clip_val,
        clip_val]``."""
        plugin = self.precision
        plugin.unscale_gradients(optimizer)
        plugin.clip_grad_by_value(optimizer, clip_val)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``fabric.all_reduce``: the mean (or ``reduce_op``) over the ranks; identity in one process."""
        if isinstance(tensor, torch.Tensor):
            with self._guard("fabric.all_reduce"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    def get_module_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """The module's state dict with the pending updates applied (views of the host store: no copy)."""
        self.flush()
        return module.state_dict()

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save(path, state)``: a directory checkpoint in the Trainer strategy's layout
        (:meth:`~megatrain_lightning.checkpoint.strategy_io.StrategyCheckpoints.save_fabric`).

        Raises:
            TypeError: ``storage_options`` given. ValueError: ``filter`` given, or another module or optimizer in
                ``state``. CheckpointError, OSError: the write failed (the previous checkpoint is untouched).
        """
        if storage_options is not None:
            raise TypeError("strategy='megatrain' writes directory checkpoints and takes no storage_options.")
        self.checkpoints.save_fabric(path, state, self.precision.state_dict(), filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load(path, state)``: restore ``state`` in place
        (:meth:`~megatrain_lightning.checkpoint.strategy_io.StrategyCheckpoints.load_fabric`). Returns the entries
        ``state`` did not ask for."""
        return self.checkpoints.load_fabric(path, state, self.precision, strict, weights_only)

    def teardown(self) -> None:
        """Restore the module's own ``forward`` methods and the optimizer's ``zero_grad``; the store stays open (see
        :meth:`close`)."""
        self._release_engine()
        self.takeover.restore(())
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
            self._state_dict_hook = None
        super().teardown()


class _EveryBackwardReduces(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: a no-op. With several ranks each block's gradients are averaged as
    its backward produces them (``engine/reduce.py``) into one host accumulator per node: no per-rank gradient to
    keep back (results equal DDP's to rounding)."""

    @contextlib.contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Generator[None, None, None]:
        yield
