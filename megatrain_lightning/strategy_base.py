"""What the Trainer strategy (``strategy.py``) and the Fabric strategy (``fabric.py``) share: the options, devices
and processes, building the streaming engine over a module, the take-over of the user's AdamW, flush and close.

:class:`MegaTrainBase` is a mixin placed before Lightning's ``ParallelStrategy`` (``lightning.pytorch`` or
``lightning.fabric``): both hierarchies read ``root_device``, ``cluster_environment``, ``parallel_devices`` and the
ranks the same way, so one implementation serves both. The subclass sets ``self.lightning_module`` (the module
being trained: a ``LightningModule`` under the Trainer, any ``nn.Module`` under Fabric) and calls
:meth:`MegaTrainBase._init_megatrain` first in its ``__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed

from .checkpoint.hf_io import weight_sources
from .checkpoint.strategy_io import StrategyCheckpoints
from .config import MegaTrainConfig
from .engine.reduce import GradReducer
from .engine.streaming import StreamingEngine
from .optim.host_generic import validate_optimizer
from .optim.takeover import OptimizerTakeover
from .parallel.checkpoint_writers import CheckpointWriters
from .parallel.groups import ProcessGroups
from .parallel.launcher import MegaTrainLauncher
from .parallel.node_share import NodeStore, nvme_for_rank, weights_written
from .parallel.preflight import check_rendezvous, check_same_config, optimizer_fingerprint, run_fingerprint
from .parallel.summon import summon_full_params
from .placeholder_guard import format_gib, guard as guard_placeholders, guard_state_dict, holder_of
from .placeholder_guard import unguard as unguard_placeholders
from .setup_guards import check_new_store
from .store.allocator import bound_retention
from .store.budget import mem_available_bytes
from .store.nvme import NVME_PATH_FROM_ENV
from .store.regions import Region

log = logging.getLogger(__name__)


def _option(name: str) -> property:
    """``strategy.<name>``: the option as :attr:`MegaTrainBase.config` holds it (read-only)."""
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only).")


class MegaTrainBase:
    """The engine-side state and behaviour of both megatrain strategies (see the module docstring).

    Attributes:
        config: every option (:class:`~megatrain_lightning.config.MegaTrainConfig`).
        groups: the engine's process groups with several processes, else ``None``.
        engine: the :class:`~megatrain_lightning.engine.streaming.StreamingEngine` once set up, else ``None``.
        takeover: the user's optimizer while the host AdamW steps it.
        checkpoints: directory checkpoint save/load (:class:`~.checkpoint.strategy_io.StrategyCheckpoints`).
    """

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

    def _init_megatrain(self, config: MegaTrainConfig | None, options: dict[str, Any]) -> None:
        """The options (``config`` or ``**options``, not both) and the empty engine-side state.

        Raises:
            TypeError: both ``config`` and options given. ValueError, TypeError: an option fails its check.
        """
        if config is not None and options:
            raise TypeError(f"{type(self).__name__}: pass either config or options ({', '.join(options)}), not both.")
        self.config = config if config is not None else MegaTrainConfig(**options)
        self._num_nodes = 1
        self._process_group_backend = self.config.process_group_backend
        self.groups: ProcessGroups | None = None
        self.engine: StreamingEngine | None = None
        self.takeover = OptimizerTakeover()
        self.checkpoints = StrategyCheckpoints(self, self._checkpoint_writers, self._share_written)

    # ------------------------------------------------------------------ devices and processes
    @property
    def root_device(self) -> torch.device:
        """This process's device: ``parallel_devices[local_rank]`` (CPU before the Trainer sets them)."""
        return torch.device(self.parallel_devices[self.local_rank] if self.parallel_devices else "cpu")

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
        """More than one process in the run (Lightning's connector decides ``DistributedSampler`` injection by it)."""
        return self.num_processes * self.num_nodes > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """What Lightning's ``DistributedSampler`` injection needs (``None`` in a single process)."""
        if not self.is_distributed:
            return None
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        """After :func:`~.parallel.preflight.check_rendezvous`, the :class:`~.parallel.launcher.MegaTrainLauncher`;
        none for one process (so a single-device run works in a notebook)."""
        assert self.cluster_environment is not None
        check_rendezvous(os.environ, self.cluster_environment, self.num_processes, self.num_nodes)
        self._launcher = (MegaTrainLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
                          if self.is_distributed else None)

    def setup_environment(self) -> None:
        """Lightning's, after bounding what glibc's ``malloc`` keeps of the host memory a step frees
        (``store/allocator.py``), then the process group when distributed."""
        bound_retention()
        super().setup_environment()
        if self.is_distributed:
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
        return self.groups.guard(what) if self.groups is not None else contextlib.nullcontext()

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

    # ------------------------------------------------------------------ engine
    def _build_engine(self, module: torch.nn.Module, reserve_frozen: bool, trainer: Any = None,
                      zeros_for_meta: bool = False) -> None:
        """Build (or keep) the engine over ``module``: its host store, block proxies and NVMe guards, with the weights
        current (written back after an earlier run, replaced ``.data`` taken in, shared with the node's ranks).

        Args:
            module: the module trained (every parameter is put in the host store).
            reserve_frozen: keep gradient and AdamW room for frozen parameters too.
            trainer: the Trainer, whose settings every rank must share (``None`` under Fabric).
            zeros_for_meta: ``meta``-device parameters that no weights source provides start as zeros in the store
                (``fabric.init_module(empty_init=True)``); otherwise they are refused.

        Raises:
            RuntimeError, TypeError, ValueError: :func:`~.setup_guards.check_new_store` refusals;
                ConfigMismatchError: ranks differ.
        """
        cfg = self.config
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
            g = self.groups
            nvme, node, reducer = cfg.nvme, None, None  # one process: no node-shared store, no gradient reducer
            if g is not None:
                if nvme is not None:  # the optimizer's regions on each owner's disk
                    nvme = nvme_for_rank(nvme, g)
                check_same_config(g, run_fingerprint(module, self, trainer))  # every rank the same model and options
                node = NodeStore(g, pin=cfg.pin_memory if self.root_device.type == "cuda" else False)
                reducer = GradReducer(g.grads, g.node_grads, g.cross_grads, g.node_rank, g.local_world_size,
                                      g.backend == "nccl", guard=g.guard)  # NCCL: reduced on the device before D2H
            sources = weight_sources(module)
            if zeros_for_meta:
                missing = [p for p in module.parameters() if p.is_meta and id(p) not in sources]
                sources.update({id(p): (lambda shape=p.shape: torch.zeros(shape)) for p in missing})
                if missing and self.is_global_zero:
                    log.warning("megatrain: %d parameter(s) were created without weights (init_module(empty_init="
                                "True)) and start as zeros in the host store; load a checkpoint before training "
                                "(fabric.load(path, state)).", len(missing))
            self.engine = StreamingEngine(module, self.root_device, cfg, nvme=nvme, sources=sources,
                                          reducer=reducer, node=node, reserve_frozen=reserve_frozen)
            if self.is_global_zero:  # once per engine: what is in force, to confirm from the log
                self._log_tier()
        unguard_placeholders(module)  # a forward with the store's weights bound is fine again
        if self.engine.store.masters_on_disk:
            guard_state_dict(module, (
                "megatrain: state_dict() (or save_pretrained) of a module whose parameters are NVMe placeholders "
                "(offload_params='nvme': the weights are in the NVMe store, the parameters hold NaN) would save NaN. "
                "Save with trainer.save_checkpoint(dir) / fabric.save(dir, state) (dir/model loads with "
                "from_pretrained), or, from a hook, inside `with strategy.summon_full_params(module, writeback=False):`; "
                "after the run the weights come back into the module when host_memory_limit holds 4 bytes per "
                "parameter (otherwise save before strategy.close(), which deletes the store and the weights only it "
                "holds)."))
        self.engine.install()  # weights materialized after an earlier fit are written back
        adopted = self.engine.adopt_replaced()  # e.g. another Trainer trained the module since this one ran
        if adopted:
            log.info("megatrain: %d parameter(s) (e.g. %s) were given new data since this strategy last ran (another "
                     "strategy trained the module, or param.data = ... was assigned): their current values are used.",
                     len(adopted), adopted[0])
        self._share_written()

    def _attach_host_optimizer(self, opt: Any, plugin: Any, schedulers: Any = ()) -> None:
        """The host optimizer steps ``opt`` from now on (:mod:`~.optim.takeover`); ``plugin`` (a
        ``MegaTrainPrecision``) is told when gradients are zeroed. ``schedulers``: Lightning's ``LRSchedulerConfig``
        list (every rank must have the same).

        Raises:
            UnsupportedOptimizerError: ``opt`` cannot be stepped on the host (``optim/host_generic.py``).
            ConfigMismatchError: another rank's optimizer or schedulers differ.
        """
        validate_optimizer(opt)
        if self.groups is not None:  # every rank's owners must apply the same update
            check_same_config(self.groups, optimizer_fingerprint(opt, schedulers))
        assert self.engine is not None
        self.engine.attach_optimizer(opt, overlap=self.config.overlap_optimizer)
        self.takeover.take_over(opt, self.engine, plugin.grads_zeroed)

    def _release_engine(self) -> None:
        """End of a run: the module's own ``forward`` methods again. With masters on disk the store stays open
        (``trainer.save_checkpoint`` after ``fit`` reads it); if the fp32 weights fit in ``host_memory_limit`` the
        module's parameters get real copies again (written back at the next setup), otherwise they stay guarded
        placeholders."""
        if self.engine is None:
            return
        self.engine.uninstall()
        if not self._masters_on_disk():
            return
        assert self.engine.host_memory_limit is not None
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

    def _log_tier(self) -> None:
        """Log what is in force: the tier, where each state lives, the options."""
        cfg, disk = self.config, self.engine.store.nvme_kinds
        where = lambda *ks: "NVMe" if any(k in disk for k in ks) else "host RAM"  # noqa: E731
        log.info("megatrain: strategy=%s, tier %s: fp32 masters in %s, optimizer state in %s, "
                 "gradient accumulators in %s%s; device %s, precision=%s, lookahead=%s, block_group=%s, "
                 "recompute=%s, recompute_every=%s, loss_chunk_size=%s, mlp_chunk_size=%s, "
                 "offload_activations=%s, cpu_zero_copy=%s, optimizer_in_backward=%s, processes=%d",
                 type(self).__name__, "NVMe" if disk else "RAM", where(Region.master), where(Region.exp_avg, Region.exp_avg_sq),
                 where(Region.grad_accum),
                 f" (host_memory_limit {format_gib(cfg.nvme.host_memory_limit / 2**30)}, {cfg.nvme.path})"
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

    def _masters_on_disk(self) -> bool:
        return self.engine is not None and not self.engine.closed and self.engine.store.masters_on_disk

    def hand_over_weights(self) -> None:
        """Bring the trained fp32 weights, which only this strategy's NVMe store holds, into the module's parameters,
        then :meth:`close`: called by another strategy's setup for the same module, so the weights are neither
        trained on as placeholders nor deleted with this strategy. Needs 4 bytes/param of host RAM.

        Raises:
            MemoryError: the weights do not fit in the host RAM available now (``MemAvailable``); nothing is
                changed.
        """
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
            if eng.store.masters_on_disk and not eng.params.materialized \
                    and not (self.config.nvme and self.config.nvme.keep_files):
                log.warning("megatrain: closing the NVMe store deletes the trained weights, which were only in it; "
                            "the module's parameters stay placeholders.")
            eng.close()
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
    """Whether every parameter of ``module`` is one the store was built from, with the shape it had (else, e.g.
    after ``resize_token_embeddings`` between two ``fit`` calls, the store is rebuilt)."""
    return all((where := store.index.get(id(p))) is not None
               and tuple(store.slabs[where[0]].entries[where[1]].shape) == tuple(p.shape) for p in module.parameters())
