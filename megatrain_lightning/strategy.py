"""``MegaTrainStrategy``: Lightning glue around the streaming engine.

``Trainer(strategy="megatrain")`` (after ``import megatrain_lightning``) or
``Trainer(strategy=MegaTrainStrategy(...))``. The model stays an ordinary
``LightningModule``: build it on the CPU as usual; at ``setup`` the strategy
packs its parameters into fp32 host slabs (the ``nn.Parameter`` objects stay,
their ``.data`` become views of the slabs), replaces each block's ``forward``
by a streaming proxy, and takes over the AdamW/Adam returned by
``configure_optimizers``. After ``fit`` the module's parameters are the trained
fp32 weights.

What a callback sees: during ``on_before_optimizer_step`` each parameter's
``.grad`` is a view of its fp32 host accumulator (``None`` if it got no
gradient), so ``lightning.pytorch.utilities.grad_norm`` and clipping work.
Between an optimizer step and the next forward (``on_train_batch_end``,
``on_train_batch_start``, ``training_step`` before it calls the model) updates
are still pending when ``overlap_optimizer=True``: code that reads raw
parameters there sees the weights *before* the last step; call
``trainer.strategy.flush()`` first (or pass ``overlap_optimizer=False``). Validation, test, predict, checkpoints,
``lightning_module_state_dict()``, the end of every training epoch (before any
``on_train_epoch_end``: ``StochasticWeightAveraging`` averages the current weights) and
the end of ``fit`` flush automatically.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Generator, Mapping

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .callbacks import add_flush_callbacks
from .checkpoint.hf_io import weight_sources
from .checkpoint.strategy_io import StrategyCheckpoints
from .config import MegaTrainConfig, optimizer_in_backward_on
from .engine.reduce import GradReducer
from .engine.streaming import StreamingEngine
from .optim.host_adamw import UnsupportedOptimizerError, validate_optimizer
from .optim.takeover import OptimizerTakeover
from .parallel.checkpoint_writers import CheckpointWriters
from .parallel.faults import guarded
from .parallel.groups import ProcessGroups
from .parallel.launcher import MegaTrainLauncher
from .store.allocator import bound_retention
from .parallel.node_share import NodeStore, nvme_for_rank, weights_written
from .parallel.preflight import (check_rendezvous, check_same_batches, check_same_config, optimizer_fingerprint,
                                 run_fingerprint)
from .parallel.summon import summon_full_params
from .placeholder_guard import format_gib, guard as guard_placeholders, guard_state_dict, holder_of
from .placeholder_guard import unguard as unguard_placeholders
from .precision import MegaTrainPrecision, to_megatrain_precision
from .setup_guards import (check_new_store, check_setup, refuse_placeholder_writes, refuse_unfrozen,
                           user_code_after_clip, user_code_sees_step_gradients)
from .store.nvme import NVME_PATH_FROM_ENV
from .store.regions import Region

log = logging.getLogger(__name__)


def _option(name: str) -> property:
    """``strategy.<name>``: the option as :attr:`MegaTrainStrategy.config` holds it (read-only)."""
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only).")


class MegaTrainStrategy(ParallelStrategy):
    """Train a model larger than accelerator memory by streaming it block by block.

    fp32 master weights, fp32 gradient accumulators and AdamW ``exp_avg``/``exp_avg_sq`` live
    in host RAM; the device holds the block computing, ``lookahead`` prefetched blocks and the
    saved block inputs (MegaTrain, arXiv 2604.05091).

    Args:
        config: every option at once (:class:`~megatrain_lightning.config.MegaTrainConfig`).
        options: the options one by one, as keywords (``lookahead=2``, ``offload_params="nvme"``...): each
            field of :class:`~megatrain_lightning.config.MegaTrainConfig`, which documents its default, unit and
            effect, and checks it when the strategy is built.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning strategy.

    Several processes (``Trainer(devices=N, num_nodes=M)``): launched as ``DDPStrategy`` launches them
    (Lightning's subprocess script launcher for ``python train.py``; torchrun and SLURM through their
    cluster environments); each rank streams its micro-batches through its own device and every gradient
    batch is averaged over the ranks as soon as its block's backward ends (``engine/reduce.py``), so the
    ranks' updates, and weights, stay identical (docs/architecture.md, "Several GPUs and nodes").

    Raises:
        ValueError, TypeError: an option fails its check (when the strategy is built; see
            :class:`~megatrain_lightning.config.MegaTrainConfig`).
        NotImplementedError: several processes with ``offload_params``/``offload_optimizer="nvme"`` (at setup).
        ValueError: a ``meta``-device parameter that no weights source provides, or whose checkpoint tensor has
            another shape, e.g. ``resize_token_embeddings`` on a ``meta_model_from_pretrained`` model (at setup;
            the message says to resize a materialised model before ``fit``).
        UnsupportedOptimizerError: ``configure_optimizers`` returned anything but one AdamW/Adam.
        BlockDiscoveryError: the model has no discoverable blocks.
        RendezvousError: the launch's ``WORLD_SIZE`` / ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` contradict
            ``devices`` and ``num_nodes`` (in ``Trainer(...)``, ``parallel/preflight.py``).
        ConfigMismatchError: the ranks were started with different models or options (at setup, every rank).
        SharedMemoryTooSmall: ``/dev/shm`` of some node cannot hold the node's state (at setup, every rank).
        PeerFailure: another rank died or stopped answering (during the run).
    """

    strategy_name = "megatrain"
    config_class = MegaTrainConfig  # what ``**options`` are (Hydra recipes check their keys against it)

    lookahead = _option("lookahead")
    block_group = _option("block_group")
    recompute_every = _option("recompute_every")
    recompute = _option("recompute")
    activation_memory_limit = _option("activation_memory_limit")
    offload_activations = _option("offload_activations")
    loss_chunk_size = _option("loss_chunk_size")
    mlp_chunk_size = _option("mlp_chunk_size")
    host_threads = _option("host_threads")
    optimizer_in_backward = _option("optimizer_in_backward")
    unfreeze_during_fit = _option("unfreeze_during_fit")
    nvme = _option("nvme")

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
        if config is not None and options:
            raise TypeError(f"MegaTrainStrategy: pass either config or options ({', '.join(options)}), not both.")
        self.config = config if config is not None else MegaTrainConfig(**options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = self.config.process_group_backend
        self.groups: ProcessGroups | None = None
        self.engine: StreamingEngine | None = None
        self.takeover = OptimizerTakeover()
        self.checkpoints = StrategyCheckpoints(self, self._checkpoint_writers, self._share_written)
        self._interrupt_pending = False  # Ctrl-C arrived during in-backward updates: raised once the step is complete
        self._warned_log = False

    # ------------------------------------------------------------------ devices and processes
    @property
    def root_device(self) -> torch.device:
        """This process's device: ``parallel_devices[local_rank]`` (CPU before the Trainer sets them)."""
        if self.parallel_devices:
            return torch.device(self.parallel_devices[self.local_rank])
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node (``Trainer(devices=N)``)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 1

    @property
    def is_distributed(self) -> bool:
        """More than one process in the run (Lightning's accelerator connector reads it for custom strategies:
        it decides the ``DistributedSampler`` injection)."""
        return self.num_processes * self.num_nodes > 1

    distributed = is_distributed

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """What Lightning's ``DistributedSampler`` injection needs (``None`` in a single process)."""
        if not self.distributed:
            return None
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        """Lightning's subprocess script launcher, as ``DDPStrategy(start_method="popen")``, watching the ranks it
        starts (``parallel/launcher.py``); none for one process (so a single-device run works in a notebook).
        First the launch's environment is checked against devices/num_nodes (``parallel/preflight.py``)."""
        assert self.cluster_environment is not None
        check_rendezvous(os.environ, self.cluster_environment, self.num_processes, self.num_nodes)
        self._launcher = (MegaTrainLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
                          if self.distributed else None)

    def setup_environment(self) -> None:
        """Lightning's, after bounding what glibc's ``malloc`` keeps of the host memory a step frees
        (``store/allocator.py``: ``M_MMAP_THRESHOLD`` 8 MiB, ``M_ARENA_MAX`` 2; ``MEGATRAIN_MALLOC_TUNING=0`` turns it
        off), then the process group when distributed."""
        bound_retention()
        super().setup_environment()
        if self.distributed:
            self.setup_distributed()

    def setup_distributed(self) -> None:
        """Initialise ``torch.distributed`` as ``DDPStrategy`` does (seed, ranks, default group with ``timeout``),
        then create the engine's own groups (``parallel/groups.py``)."""
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self.config.timeout,
                              device_id=self.root_device if self.root_device.type != "cpu" else None)
        self.groups = ProcessGroups.create(self.local_rank, self.num_processes, self.node_rank, self.num_nodes,
                                           timeout=self.config.timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _guard(self, what: str) -> Any:
        """Main-thread collectives: a rank that died is named (``parallel/faults.py``)."""
        return guarded(self.groups.peers if self.groups else None, what, self.config.timeout.total_seconds() if self.config.timeout else None)

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        with self._guard(f"the barrier {name!r}" if name else "a barrier"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with self._guard("a broadcast"):
            dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: the mean (or ``reduce_op``) over the ranks; identity in one process."""
        if isinstance(tensor, torch.Tensor):
            with self._guard("a reduce of logged values (sync_dist)"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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
        if self.engine is not None and (self.engine.closed or self.engine.root is not module
                                        or self.engine.trainable != [reserve_frozen or p.requires_grad
                                                                     for p in module.parameters()]
                                        or not _same_parameters(self.engine.store, module)):
            self.engine.close()
            self.engine = None
        if self.engine is None:
            prev = holder_of(module)
            if prev is not None and prev is not self:
                prev.hand_over_weights()  # another strategy's store holds them (a new Trainer for the same module)
            check_new_store(module)
            nvme = nvme_for_rank(cfg.nvme, self.groups) if self.groups is not None and cfg.nvme is not None \
                else cfg.nvme  # data parallel: the optimizer's regions on each owner's disk
            if self.groups is not None:  # every rank the same model and options, before the store is built
                check_same_config(self.groups.host, run_fingerprint(module, self, trainer), guard=self.groups.guard)
            node = NodeStore(self.groups, cfg.timeout.total_seconds() if cfg.timeout else 1800.0,
                             pin=cfg.pin_memory if self.root_device.type == "cuda" else False) if self.groups else None
            self.engine = StreamingEngine(module, self.root_device, cfg, nvme=nvme, sources=weight_sources(module),
                                          reducer=self._grad_reducer(), node=node, reserve_frozen=reserve_frozen)
            if self.is_global_zero:  # once per engine: what is in force, to confirm from the log
                self._log_tier()
        unguard_placeholders(self.lightning_module)  # a forward with the store's weights bound is fine again
        if self.engine.store.masters_on_disk:
            guard_state_dict(self.lightning_module, (
                "megatrain: state_dict() (or save_pretrained) of a module whose parameters are NVMe placeholders "
                "(offload_params='nvme': the weights are in the NVMe store, the parameters hold NaN) would save NaN. "
                "Save with trainer.save_checkpoint(dir) (dir/model loads with from_pretrained), or, from a hook, "
                "inside `with trainer.strategy.summon_full_params(module, writeback=False):`; after fit the "
                "weights come back into the module when host_memory_limit holds 4 bytes per parameter (otherwise save before "
                "trainer.strategy.close(), which deletes the store and the weights only it holds)."))
        self.engine.install()  # weights materialized after an earlier fit are written back
        adopted = self.engine.adopt_replaced()  # e.g. another Trainer trained the module since this one ran
        if adopted:
            log.info("megatrain: %d parameter(s) (e.g. %s) were given new data since this Trainer last ran (another "
                     "Trainer trained the module, or param.data = ... was assigned): their current values are used.",
                     len(adopted), adopted[0])
        self._share_written()
        module._device = self.root_device  # the module is never moved as a whole
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup_optimizers(trainer)
            self._take_over_optimizer()
            add_flush_callbacks(trainer)
        plugin = self.precision_plugin
        assert isinstance(plugin, MegaTrainPrecision)
        plugin.attach_engine(self.engine, self.root_device.type)
        # user code may run between the clip and the step (and read or edit param.grad): clip at once there
        plugin.clip_in_place = user_code_after_clip(module) and self.engine.ownership is None
        if (trainer.state.fn == TrainerFn.FITTING and self.is_global_zero
                and optimizer_in_backward_on(cfg.optimizer_in_backward, self.engine.store.nvme is not None)):
            log.info("megatrain: optimizer_in_backward: each block's update runs during its backward. Ctrl-C then "
                     "stops the run once the step is complete; any other exception raised inside a backward leaves "
                     "the model half updated, and training and saving are refused until a checkpoint is loaded. "
                     "optimizer_in_backward=False keeps every step consistent (on the NVMe tier: 8 bytes more I/O "
                     "per trainable parameter and step).")
        self.setup_precision_plugin()
        self.takeover.wrap_lightning_optimizers(self._lightning_optimizers)

    def _log_tier(self) -> None:
        """Log once per engine what is in force (the tier, where each state lives, the options)."""
        cfg, disk = self.config, self.engine.store.nvme_kinds
        where = lambda *ks: "NVMe" if any(k in disk for k in ks) else "host RAM"  # noqa: E731
        log.info("megatrain: strategy=MegaTrainStrategy, tier %s: fp32 masters in %s, AdamW state in %s, "
                 "gradient accumulators in %s%s; device %s, precision=%s, lookahead=%s, block_group=%s, "
                 "recompute=%s, recompute_every=%s, loss_chunk_size=%s, mlp_chunk_size=%s, "
                 "offload_activations=%s, cpu_zero_copy=%s, optimizer_in_backward=%s, processes=%d",
                 "NVMe" if disk else "RAM", where(Region.master), where(Region.exp_avg, Region.exp_avg_sq),
                 where(Region.grad_accum),
                 f" (host_memory_limit {cfg.nvme.host_memory_limit / 2**30:.1f} GiB, {cfg.nvme.path})"
                 if disk and cfg.nvme is not None else "", self.root_device,
                 getattr(self.precision_plugin, "precision", "?"), cfg.lookahead, cfg.block_group,
                 cfg.recompute, cfg.recompute_every, cfg.loss_chunk_size, cfg.mlp_chunk_size,
                 cfg.offload_activations, cfg.cpu_zero_copy, cfg.optimizer_in_backward, self.world_size)

    def _share_written(self) -> None:
        """Data parallel: the node's other ranks see the shared weights just written (no-op in one process)."""
        if self.groups is not None and self.engine is not None:
            weights_written(self.groups, self.engine.store)

    def _checkpoint_writers(self) -> CheckpointWriters | None:
        """Data parallel: each rank writes its own slabs of a directory checkpoint (``None`` in one process)."""
        if self.groups is None:
            return None
        assert self.engine is not None and self.engine.ownership is not None
        return CheckpointWriters(self.groups, self.engine.store, self.engine.ownership)

    def _grad_reducer(self) -> GradReducer | None:
        g = self.groups
        if g is None:
            return None
        return GradReducer(g.grads, g.node_grads, g.cross_grads, g.node_rank, g.local_world_size, g.device_side_reduce,
                           guard=g.guard)

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's (``configure_optimizers`` again); during fit, where a callback calls
        ``trainer.strategy.setup_optimizers(trainer)`` to change optimizers mid-training (Lightning's way), the host
        optimizer then steps the new one: the old one's pending updates are applied first, and the new one starts
        with empty AdamW state as a new ``torch.optim.AdamW`` does.

        Raises:
            UnsupportedOptimizerError: the new optimizers are not exactly one AdamW/Adam.
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
                f"{len(self.optimizers)}. Return a single torch.optim.AdamW (use param groups for different "
                "learning rates or weight decay)."
            )
        opt = self.optimizers[0]
        validate_optimizer(opt)
        if self.groups is not None:  # every rank's owners must apply the same update
            check_same_config(self.groups.host, optimizer_fingerprint(opt, self.lr_scheduler_configs),
                              guard=self.groups.guard)
        assert self.engine is not None
        self.engine.attach_optimizer(opt, overlap=self.config.overlap_optimizer)
        plugin = self.precision_plugin
        self.takeover.take_over(opt, self.engine, plugin.grads_zeroed if isinstance(plugin, MegaTrainPrecision) else None)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step (the closure runs the forward and backward), then the step's accounting logged
        through Lightning.

        A step that an exception stops after its backward applied part of the updates (``optimizer_in_backward``)
        is reported to the engine (`engine/stopped_step.py`), which then refuses training and saving;
        Ctrl-C waits for the step instead (:meth:`_ctrl_c_after_step`)."""
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
        """During the optimizer step, Ctrl-C (``SIGINT``) that arrives while the backward applies the updates as it
        goes (``optimizer_in_backward``) is held until the step is complete, and raised as ``KeyboardInterrupt`` at
        the next point where Lightning can stop cleanly (the next batch's start, validation, or the end of fit:
        :meth:`_raise_pending_interrupt`), so that the model is the complete step, as consistent as plain Lightning's
        stop mid-backward (which keeps the step before). A second Ctrl-C stops at once (the step is then left half
        applied and `engine/stopped_step.py` refuses going on). At other moments Ctrl-C acts as
        always. Only from the main thread, and only where ``SIGINT`` has Python's default handler (a handler of the
        user's own is left alone)."""
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
        """Raise the ``KeyboardInterrupt`` :meth:`_ctrl_c_after_step` held, now that the step is complete."""
        if self._interrupt_pending:
            self._interrupt_pending = False
            raise KeyboardInterrupt

    def _log_stats(self, metrics: Mapping[str, float]) -> None:
        """Log one optimizer step's accounting (``megatrain/*``: bytes, seconds, counts) with the
        module's ``log_dict(on_step=True, on_epoch=False)``, as a ``self.log`` in the hook that ran the
        step (``optimizer_step``; ``training_step`` under manual optimization) would. So every logger
        of ``Trainer(logger=[...])`` receives them, at the step and ``log_every_n_steps`` cadence of
        the user's own ``self.log(..., on_step=True)`` metrics, and ``trainer.callback_metrics`` holds
        them (``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` can use them). Lightning logs step
        metrics once per batch, so a manual-optimization ``training_step`` that steps twice logs the
        second step's values (as it would a user's ``self.log``); ``engine.history`` has both.

        Values are float64 CPU tensors: byte counts stay exact (float32 would round them) and
        logging adds no device synchronisation. Nothing is logged with ``Trainer(barebones=True)``
        (Lightning disables logging there) or outside a Trainer's loop; a hook in which Lightning
        refuses step-level logging (a manual ``opt.step()`` in ``on_train_epoch_end``) gets a warning
        once, and the values stay in ``trainer.strategy.engine.history``.
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
        """Lightning's training step; first decides whether this micro-batch's backward applies the
        AdamW updates (``optimizer_in_backward``)."""
        if self.engine is not None:
            self.engine.stopped.check("training")
            self._adopt_replaced_weights()
            self.engine.set_update_in_backward(self._update_in_backward_now())
        return super().training_step(*args, **kwargs)

    def _adopt_replaced_weights(self) -> None:
        """Before a training or evaluation step: parameters whose ``.data`` user code replaced
        (``param.data = tensor`` in a hook) are taken into the store, as plain PyTorch would compute with them.

        Raises:
            RuntimeError: with several processes (each rank's masters are the node's shared copy, which one
                rank's assignment must not change alone): write in place instead, on every rank.
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

    def _update_in_backward_now(self) -> bool:
        engine, module = self.engine, self.lightning_module
        if engine is None or engine.optimizer is None or module is None \
                or not optimizer_in_backward_on(self.config.optimizer_in_backward, engine.store.nvme is not None):
            return False
        trainer = module.trainer
        plugin = self.precision_plugin
        if (not module.automatic_optimization or trainer.gradient_clip_val or getattr(plugin, "scaling", False)
                or user_code_sees_step_gradients(module, trainer)):
            return False
        try:
            return not trainer.fit_loop.epoch_loop._should_accumulate()
        except AttributeError:  # another Lightning version: stay with the deferred schedule
            return False

    def flush(self) -> None:
        """Apply pending optimizer updates so parameters read directly are current."""
        if self.engine is not None:
            self.engine.flush()

    def weights_written(self) -> None:
        """Call after writing parameters through ``param.data`` (or another tensor with a version counter of its
        own): the engine then drops prefetched copies and re-encodes the cached 16-bit wire images of the mixed
        precisions at their next fetch. Writes with ``param.copy_`` / ``param.mul_`` under ``torch.no_grad()`` are
        seen without it (their version counter moves). A write between an optimizer step and the next forward needs
        :meth:`flush` *before* it (the step's update may still be pending; a write under it is refused at its
        next fetch with a RuntimeError)."""
        if self.engine is not None:
            opt = self.engine.optimizer
            if opt is not None and opt.has_pending():
                raise RuntimeError(
                    "megatrain: weights_written() was called while optimizer updates were still deferred "
                    "(overlap_optimizer=True applies each block's update when the next forward fetches it): the "
                    "write just made hit the weights from before that update, and the update would land on top of "
                    "it. Call trainer.strategy.flush() before writing the weights, then weights_written() after.")
            self.engine.weights_written()

    def summon_full_params(self, module: torch.nn.Module | None = None, writeback: bool = True
                           ) -> contextlib.AbstractContextManager[None]:
        """The parameters of ``module`` (default: the whole LightningModule) hold their current fp32 weights inside
        this context, as FSDP's ``summon_full_params``
        (:func:`~megatrain_lightning.parallel.summon.summon_full_params`: ``writeback``, errors, an example)."""
        return summon_full_params(self.engine, module if module is not None else self.lightning_module, writeback,
                                  self.groups, self.barrier)

    def on_exception(self, exception: BaseException) -> None:
        """With the weights on NVMe, an in-place write into a placeholder parameter that torch itself refuses
        (``copy_``, ``mul_``, ``nn.init.normal_``, ``load_state_dict`` on a stride-0 tensor: "more than one element of
        the written-to tensor refers to a single memory location") gets a note saying why and what to do (Python >=
        3.11 ``add_note``; the exception is not changed otherwise)."""
        super().on_exception(exception)
        if self.engine is None or not self.engine.store.masters_on_disk or not hasattr(exception, "add_note"):
            return
        if "refers to a single memory location" in str(exception):
            exception.add_note(
                "megatrain: with offload_params='nvme' the module's parameters are placeholders outside a block's "
                "compute (their weights are on NVMe), so they cannot be written in place. Make the edit inside "
                "`with trainer.strategy.summon_full_params(module):`, or assign param.data = new_tensor.")

    def on_validation_start(self) -> None:
        self._raise_pending_interrupt()
        self._before_evaluation("validation")

    def on_test_start(self) -> None:
        self._before_evaluation("testing")

    def on_predict_start(self) -> None:
        self._before_evaluation("prediction")

    def _before_evaluation(self, what: str) -> None:
        """Before a validation, test or prediction loop: the weights are consistent, the pending updates applied,
        and parameters whose ``.data`` user code replaced taken into the store."""
        if self.engine is not None:
            self.engine.stopped.check(what)
        self.flush()
        if self.engine is not None:
            self._adopt_replaced_weights()

    def on_train_start(self) -> None:
        """Data parallel: every rank must have as many training batches per epoch as the others (checked once,
        before the first step; :func:`~.parallel.preflight.check_same_batches`)."""
        if self.groups is not None:
            trainer = self.lightning_module.trainer
            batches = trainer.num_training_batches
            if trainer.max_steps > 0:  # a run that ends within every rank's first epoch needs no equal epochs
                batches = min(batches, trainer.max_steps * trainer.accumulate_grad_batches)
            check_same_batches(self.groups.host, batches, guard=self.groups.guard)

    def on_train_end(self) -> None:
        """Lightning calls it after the callbacks' and the module's ``on_train_end``: a write into a placeholder in
        the last step's hooks or there is refused too (else it was lost, and blamed on the next run)."""
        refuse_placeholder_writes(self.engine)
        self.flush()
        self._raise_pending_interrupt()

    def on_validation_end(self) -> None:
        refuse_placeholder_writes(self.engine)

    def on_test_end(self) -> None:
        refuse_placeholder_writes(self.engine)

    def on_predict_end(self) -> None:
        refuse_placeholder_writes(self.engine)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Refuse a parameter unfrozen since setup (Lightning calls this after the callbacks' and the
        module's ``on_train_batch_start``, so an unfreeze in any of those hooks is caught before its forward).

        Raises:
            RuntimeError: :func:`~megatrain_lightning.setup_guards.refuse_unfrozen`.
        """
        super().on_train_batch_start(batch, batch_idx)
        self._raise_pending_interrupt()  # Ctrl-C during the last step's in-backward updates
        if self.engine is not None:
            refuse_unfrozen(self.lightning_module, self.engine.trainable, self.config.unfreeze_during_fit is False)

    # ------------------------------------------------------------------ state
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict: host-store views of the current weights, no copy.

        With masters on NVMe it is empty: directory checkpoints read the weights from the store
        one slab at a time instead (a full state dict would not fit the host budget)."""
        self.flush()
        if self._masters_on_disk():
            return {}
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """``torch.optim.AdamW``-format state of the host optimizer, as views (no copy); with the
        optimizer on NVMe only the param groups (directory checkpoints stream the state)."""
        self.flush()
        if self.engine is None or self.engine.optimizer is None:
            return super().optimizer_state(optimizer)
        if "exp_avg" in self.engine.store.nvme_kinds:
            return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        return self.engine.optimizer.state_dict(copy=False)

    def _masters_on_disk(self) -> bool:
        return self.engine is not None and not self.engine.closed and self.engine.store.masters_on_disk

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a directory checkpoint, or defer it to the end of the step when asked for mid-backward
        (:meth:`~.checkpoint.strategy_io.StrategyCheckpoints.save`)."""
        self.checkpoints.save(checkpoint, filepath, storage_options)

    def save_deferred(self, trainer: Any) -> None:
        """Write the checkpoints asked for in the middle of an in-backward update, now that the step is complete."""
        self.checkpoints.save_deferred(trainer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a directory checkpoint into the host store, or read a plain Lightning ``.ckpt``
        (:meth:`~.checkpoint.strategy_io.StrategyCheckpoints.load`)."""
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
        if self.engine is not None:
            self.engine.uninstall()
            if self._masters_on_disk():
                self._release_nvme()
        self.takeover.restore(self._lightning_optimizers)
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # the store was never built (e.g. preflight refused the run): the module cannot move to
            # the CPU, and trying would hide the real error behind "Cannot copy out of meta tensor"
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    def _release_nvme(self) -> None:
        """End of a run with masters on disk. The store stays open (it is the authoritative copy:
        ``trainer.save_checkpoint`` after ``fit`` reads it); if the fp32 weights fit in
        ``host_memory_limit`` the module's parameters get real tensors again (copies, written back at
        the next setup) so the module works on its own; otherwise they stay placeholders and a
        warning says how to get the weights."""
        assert self.engine is not None and self.engine.host_memory_limit is not None
        nbytes = 4 * self.engine.store.numel
        if nbytes <= self.engine.host_memory_limit:
            self.engine.params.materialize()
        else:
            assert self.lightning_module is not None
            guard_placeholders(self.lightning_module, self.engine.store.is_placeholder, nbytes / 2**30,
                               str(self.engine.store.nvme.dir), holder=self)
            log.warning(
                "megatrain: the fp32 weights (%s) exceed host_memory_limit, so after the run they stay in the "
                "NVMe store %s and the module's parameters are placeholders; save them with "
                "trainer.save_checkpoint(dir) or read one with trainer.strategy.engine.read_param(p). "
                "trainer.strategy.close() (or the end of the process) removes the files.",
                format_gib(nbytes / 2**30), self.engine.store.nvme.dir)

    def hand_over_weights(self) -> None:
        """Bring the trained fp32 weights, which only this strategy's NVMe store holds (larger than its
        ``host_memory_limit``), into the module's parameters, then :meth:`close`: called by another strategy's
        setup for the same module (a new Trainer), so the weights are neither trained on as placeholders nor
        deleted with this strategy when it is garbage-collected. Needs 4 bytes/param of host RAM.

        Raises:
            MemoryError: the weights do not fit in the host RAM available now (``MemAvailable``); nothing is
                changed (the store stays open and the error names how to save them).
        """
        from .store.budget import mem_available_bytes

        if self.engine is None or self.engine.closed:
            return
        nbytes = 4 * self.engine.store.numel
        avail = mem_available_bytes()
        if avail is not None and nbytes > 0.9 * avail:
            raise MemoryError(
                f"megatrain: the module's trained fp32 weights ({format_gib(nbytes / 2**30)}) are only in the NVMe store "
                f"{self.engine.store.nvme.dir} of the strategy of a previous Trainer, and they do not fit in the host "
                f"RAM available ({avail / 2**30:.2f} GiB) to hand them to this one. Save them with that Trainer "
                "(trainer.save_checkpoint(dir)) before making a new Trainer, and fit the new one with ckpt_path=dir; "
                "the previous strategy stays open while the module lives: megatrain_lightning.placeholder_guard."
                "holder_of(module).")
        self.engine.params.materialize()
        self.close()

    def close(self) -> None:
        """Close the engine: stop its threads and remove the NVMe store's files (unless kept).

        If the weights were only in the store (larger than ``host_memory_limit``), they are gone
        afterwards: save them first (``trainer.save_checkpoint``). The module then refuses to be
        set up again (its parameters are placeholders)."""
        if self.engine is not None:
            eng = self.engine
            if eng.store.masters_on_disk and not eng.params.materialized and not (self.config.nvme and self.config.nvme.keep_files):
                log.warning("megatrain: closing the NVMe store deletes the trained weights, which were only in it; "
                            "the module's parameters stay placeholders.")
            self.engine.close()
            self.engine = None
        self.takeover.close()  # the torch optimizer's own state_dict methods again

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "megatrain",
            cls,
            description="Stream blocks through one device; fp32 weights and AdamW state in host RAM",
        )
        strategy_registry.register(
            "megatrain_nvme",
            cls,
            description="megatrain with fp32 weights, AdamW state and gradients on NVMe ($MEGATRAIN_NVME_PATH)",
            offload_params="nvme",
            offload_optimizer="nvme",
            nvme_path=NVME_PATH_FROM_ENV,
        )


def _same_parameters(store: Any, module: torch.nn.Module) -> bool:
    """Whether every parameter of ``module`` is one the store was built from, with the shape it had (a
    ``resize_token_embeddings`` or a replaced submodule between two ``fit`` calls makes new parameters: the store
    is then rebuilt from the module as it is now)."""
    for p in module.parameters():
        where = store.index.get(id(p))
        if where is None or tuple(store.slabs[where[0]].entries[where[1]].shape) != tuple(p.shape):
            return False
    return True
