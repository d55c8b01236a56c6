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
from collections import defaultdict
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable, Generator, Mapping, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import BaseFinetuning, Callback
from lightning.pytorch.callbacks import StochasticWeightAveraging as _StochasticWeightAveraging
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

try:  # Lightning >= 2.5: WeightAveraging / EMAWeightAveraging read the weights after every optimizer step
    from lightning.pytorch.callbacks.weight_averaging import WeightAveraging as _WeightAveraging
except ImportError:  # pragma: no cover - older Lightning
    _WeightAveraging = None

from .checkpoint.atomic import check_name_length
from .checkpoint.atomic import remove as remove_entry
from .checkpoint.hf_io import weight_sources
from .checkpoint.peft_io import unsavable_adapters
from .checkpoint.directory import load_checkpoint_dir, load_optimizer_dir, save_checkpoint_dir
from .checkpoint.errors import CheckpointError
from .checkpoint.location import is_local, local_path
from .checkpoint.lightning_resume import load_lightning_optimizer, load_lightning_weights
from .engine.chunked_loss import check_chunk_size
from .engine.block_groups import check_block_group
from .engine.recompute_policy import RecomputePolicy, check_recompute, deprecated_recompute_every
from .engine.prefetch import check_lookahead
from .engine import recorded_outputs
from .module_checks import check_module
from .optim.state_view import HostStateView
from .engine.kv_cache import prefix_tuning_adapters
from .engine.reduce import GradReducer
from .engine.streaming import StreamingEngine
from .engine.threads import check_host_threads
from .strategy_options import check_switches, check_timeout, warn_unused_activation_limit
from .optim.host_adamw import UnsupportedOptimizerError, validate_optimizer
from .parallel.checkpoint_writers import CheckpointWriters
from .parallel.faults import guarded
from .parallel.groups import ProcessGroups
from .parallel.launcher import MegaTrainLauncher
from .parallel.node_share import NodeStore, nvme_for_rank, weights_written
from .parallel.preflight import (check_rendezvous, check_same_batches, check_same_config, optimizer_fingerprint,
                                 run_fingerprint)
from .placeholder_guard import (format_gib, guard as guard_placeholders, guard_state_dict, holder_of, keys_only,
                                unguard as unguard_placeholders)
from .precision import MegaTrainPrecision, to_megatrain_precision
from .store.host import is_nvme_placeholder
from .store.nvme import IO_BLOCK_SIZE, NVME_PATH_FROM_ENV, NVMeConfig
from .store.regions import Region

log = logging.getLogger(__name__)


class MegaTrainStrategy(ParallelStrategy):
    """Train a model larger than accelerator memory by streaming it block by block.

    fp32 master weights, fp32 gradient accumulators and AdamW ``exp_avg``/``exp_avg_sq`` live
    in host RAM; the device holds the block computing, ``lookahead`` prefetched blocks and the
    saved block inputs (MegaTrain, arXiv 2604.05091).

    Args:
        lookahead: fetches copied ahead of the one computing (1 = double buffering).
        block_group: consecutive decoder layers fetched as one transfer unit (one H2D worker task and
            one wait for the group instead of one per layer: for small blocks, whose fixed cost per
            fetch is not hidden behind their compute; docs/internals/streaming.md, "Block groups"). The device
            then holds up to ``(lookahead + 1) x block_group`` decoder layers' weights. Default 1.
        recompute_every: keep the input of every K-th block call only and recompute the others
            in backward (saved activations / K, at most one extra forward of K-1 blocks per segment).
            Default 1: every block input is kept (measured: docs/benchmarks.md, "Recompute segments").
        checkpoint_every: the former name of ``recompute_every`` (it collided with Lightning's model
            checkpoints); still accepted for one release, with a ``DeprecationWarning``.
        offload_activations: keep saved block inputs in host memory (device footprint flat in depth);
            in backward each block call's inputs are copied back one call ahead (prefetched).
        loss_chunk_size: tokens per chunk of the chunked LM head + cross-entropy in training calls
            ``model(input_ids=..., labels=...)`` of a Hugging Face causal LM: the full logits are never
            materialised, each chunk's are recomputed in backward; the loss equals the full computation's up
            to the order of the sum over tokens. ``"auto"`` (default): 256 MiB of fp32 logits per chunk
            (523 tokens of a 128,256-token vocabulary); calls with at most that many tokens, without labels or
            under ``no_grad`` (validation, predict, generation) compute real logits as usual. ``None``: off.
            See docs/guide/long-sequences.md.
        mlp_chunk_size: tokens per chunk of each block's MLP (forward and recompute; each chunk
            checkpointed, so backward holds one chunk's MLP intermediates). ``None`` (default): off.
        recompute: what each block's backward recomputes (docs/architecture.md, "Recompute policy"):
            ``"block"`` (default: keep the block's inputs, recompute the whole block), ``"selective"``
            (also keep the outputs of matmuls and attention; recompute norms, activations, elementwise
            ops and dropout), ``"none"`` (keep every op output: nothing costly is recomputed) or
            ``"auto"`` (per block, within ``activation_memory_limit``; the choice is logged once).
        activation_memory_limit: bytes (or ``"4GiB"``) of device memory that ``recompute="auto"`` lets the
            kept activations take (block inputs included; the last block's graph, e.g. the LM head's logits,
            kept from its forward to the backward that follows at once, is not counted: leave room for it);
            default: half the free device memory.
        overlap_optimizer: apply each block's AdamW update just before its next prefetch (default)
            instead of all at once in ``optimizer.step()``. Both give identical results.
        block_classes: class names/classes of the repeated blocks; default: every Hugging Face
            model's ``_no_split_modules``.
        block_names: ``fnmatch`` patterns of module paths that are blocks, e.g. ``["net.layers.*"]``.
        pin_memory: page-lock host memory on CUDA (the masters and wire images of the RAM tier, the NVMe
            window, exactly what ``host_memory_limit`` counts). ``None`` (default): pin, and where pinning the
            window or a wire image fails use pageable memory with a warning; ``True``: a failure is an error
            (``HostPinningError``, naming host memory and this option); ``False``: never pin (H2D copies then
            run at pageable speed). ``ulimit -l`` does not limit CUDA's pinned memory and is not checked.
        cpu_zero_copy: on CPU, compute on the fp32 master slabs instead of a copy of them (default
            ``True``: on a CPU device the copy would only move host memory to host memory; the
            prefetch schedule, deferred updates and accounting run the same either way, and
            ``False`` makes the CPU path copy exactly as the CUDA path does). Mixed precision always
            streams converted copies.
        log_stats: log per-step accounting (``megatrain/h2d_bytes`` ...) like ``self.log(..., on_step=True)``:
            to every logger of the Trainer at its ``log_every_n_steps``, and into ``trainer.callback_metrics``.
        offload_params: where fp32 master weights live: ``"cpu"`` (host RAM, default) or ``"nvme"``
            (per-block files under ``nvme_path``, read through a host window).
        offload_optimizer: where ``exp_avg``, ``exp_avg_sq`` and the gradient accumulators live:
            ``"cpu"`` or ``"nvme"``.
        nvme_path: directory on a fast local disk for the NVMe tier (the store is
            ``<nvme_path>/megatrain_store``). ``strategy="megatrain_nvme"`` reads it from the
            environment variable ``MEGATRAIN_NVME_PATH``.
        host_memory_limit: bytes (or ``"16GiB"``-style strings) the NVMe tier's host window may use,
            on CPU including the compute buffers (strict: never exceeded). Default: half of the
            machine's physical RAM. Ignored when nothing is on NVMe.
        nvme_io_threads: threads issuing NVMe read/write requests, one each at a time: the queue
            depth (default 4, measured in bench/nvme.py).
        nvme_io_block_size: bytes per NVMe request, a multiple of 4096 (or ``"16MiB"``-style);
            each region is split into requests of this size that run concurrently (default 16 MiB,
            measured in bench/nvme_requests.py).
        nvme_read_ahead: buffers read ahead at most at once (default 4).
        direct_io: ``"auto"`` (``O_DIRECT`` where the filesystem allows it), ``True`` or ``False``.
        keep_nvme_files: keep the store's files when the engine closes (default: removed).
        optimizer_in_backward: apply each block's AdamW update during backward, as soon as its
            gradients of the step are complete, instead of deferring it to the next forward. Same
            arithmetic, bitwise the same results; it moves the update's reads and writes (AdamW
            states, master) into the backward, where the disk is otherwise idle, and the gradient
            accumulator never goes to disk. ``None`` (default): on with the NVMe tier. Used only on
            the last micro-batch of an accumulation window, in automatic optimization, without
            gradient clipping or fp16 loss scaling (both need every gradient first) and when no user code
            sees the step's gradients before the step: the LightningModule does not override
            ``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping`` or
            ``optimizer_step`` and no callback overrides ``on_after_backward`` or
            ``on_before_optimizer_step``; otherwise the deferred schedule runs.
        unfreeze_during_fit: keep gradient and AdamW state in the store for the parameters frozen at setup as
            well, so that they can be unfrozen (``requires_grad_(True)``, ``optimizer.add_param_group``) while fit
            runs. Costs what training them costs (12 bytes per frozen element more once allocated: the
            accumulator at the first backward, the moments at the first step), from the start. ``None`` (default):
            on when a Lightning ``BaseFinetuning`` callback (``BackboneFinetuning`` or a subclass) is in the
            Trainer. ``False``: unfreezing during fit raises (the store has no room for the gradient).
        host_threads: intra-op CPU threads of the engine's two host workers (the host AdamW, gradient
            adds into the fp32 accumulators, casts to the wire dtype). ``None`` (default): on CUDA
            ``torch.get_num_threads() - 1``, which leaves a core for the thread launching GPU kernels
            (derived, not measured: docs/architecture.md, "Threads, streams and locks"); on CPU 1 (the compute
            kernels use every core; measured: engine/threads.py).
        process_group_backend: ``torch.distributed`` backend of a run with several processes (default: NCCL
            on CUDA, gloo on CPU, as ``DDPStrategy``).
        timeout: how long a collective waits for the other ranks before it fails (default 30 minutes, as
            ``DDPStrategy``; a ``timedelta`` or seconds; also the rendezvous's wait for every rank to start):
            a rank that hangs makes the others stop after at most about twice this long instead of hanging;
            one that died stops them at once, with a ``PeerFailure`` naming it (``parallel/faults.py``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning strategy.

    Several processes (``Trainer(devices=N, num_nodes=M)``): launched as ``DDPStrategy`` launches them
    (Lightning's subprocess script launcher for ``python train.py``; torchrun and SLURM through their
    cluster environments); each rank streams its micro-batches through its own device and every gradient
    batch is averaged over the ranks as soon as its block's backward ends (``engine/reduce.py``), so the
    ranks' updates, and weights, stay identical (docs/architecture.md, "Several GPUs and nodes").

    Raises:
        ValueError: ``host_threads`` is not ``None`` or an integer >= 1, or ``block_group`` not an integer >= 1
            (when the strategy is built).
        NotImplementedError: several processes with ``offload_params``/``offload_optimizer="nvme"`` (at setup).
        ValueError: ``loss_chunk_size`` / ``mlp_chunk_size`` not a positive int (or ``"auto"`` / ``None``).
        ValueError: a ``meta``-device parameter that no weights source provides, or whose checkpoint tensor has
            another shape, e.g. ``resize_token_embeddings`` on a ``meta_model_from_pretrained`` model (at setup;
            the message says to resize a materialised model before ``fit``).
        UnsupportedOptimizerError: ``configure_optimizers`` returned anything but one AdamW/Adam.
        BlockDiscoveryError: the model has no discoverable blocks.
        ValueError: ``recompute`` is not one of "block", "selective", "none", "auto", or
            ``activation_memory_limit`` is not a positive size (at construction).
        RendezvousError: the launch's ``WORLD_SIZE`` / ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` contradict
            ``devices`` and ``num_nodes`` (in ``Trainer(...)``, ``parallel/preflight.py``).
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
        lookahead: int = 1,
        block_group: int = 1,
        recompute_every: int = 1,
        checkpoint_every: int | None = None,
        offload_activations: bool = False,
        recompute: str = "block",
        activation_memory_limit: int | str | None = None,
        overlap_optimizer: bool = True,
        block_classes: Sequence[str | type] | None = None,
        block_names: Sequence[str] | None = None,
        pin_memory: bool | None = None,
        cpu_zero_copy: bool = True,
        log_stats: bool = True,
        offload_params: str = "cpu",
        offload_optimizer: str = "cpu",
        nvme_path: str | None = None,
        host_memory_limit: int | str | None = None,
        nvme_io_threads: int = 4,
        nvme_io_block_size: int | str = IO_BLOCK_SIZE,
        nvme_read_ahead: int = 4,
        direct_io: bool | str = "auto",
        keep_nvme_files: bool = False,
        optimizer_in_backward: bool | None = None,
        unfreeze_during_fit: bool | None = None,
        host_threads: int | None = None,
        loss_chunk_size: int | str | None = "auto",
        mlp_chunk_size: int | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = timedelta(minutes=30),
    ) -> None:
        check_host_threads(host_threads)
        check_switches(("pin_memory", "optimizer_in_backward", "unfreeze_during_fit"), offload_activations=offload_activations,
                       overlap_optimizer=overlap_optimizer, pin_memory=pin_memory, cpu_zero_copy=cpu_zero_copy,
                       log_stats=log_stats, keep_nvme_files=keep_nvme_files, optimizer_in_backward=optimizer_in_backward,
                       unfreeze_during_fit=unfreeze_during_fit)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = check_timeout(timeout)
        self.groups: ProcessGroups | None = None
        self.lookahead = check_lookahead(lookahead)
        self.block_group = check_block_group(block_group)
        self.recompute_every = deprecated_recompute_every(recompute_every, checkpoint_every)
        self.offload_activations = offload_activations
        self.recompute, self.activation_memory_limit = check_recompute(recompute, activation_memory_limit)
        warn_unused_activation_limit(self.recompute, activation_memory_limit)
        self.overlap_optimizer = overlap_optimizer
        self.block_classes = block_classes
        self.block_names = block_names
        self.pin_memory = pin_memory
        self.cpu_zero_copy = cpu_zero_copy
        self.log_stats = log_stats
        self.nvme = NVMeConfig.from_options(
            offload_params=offload_params, offload_optimizer=offload_optimizer, nvme_path=nvme_path,
            host_memory_limit=host_memory_limit, io_threads=nvme_io_threads, io_block_size=nvme_io_block_size,
            read_ahead=nvme_read_ahead, direct_io=direct_io, keep_files=keep_nvme_files)
        self.optimizer_in_backward = optimizer_in_backward
        self.unfreeze_during_fit = unfreeze_during_fit
        self.host_threads = host_threads
        self.loss_chunk_size = check_chunk_size("loss_chunk_size", loss_chunk_size, allow_auto=True)
        self.mlp_chunk_size = check_chunk_size("mlp_chunk_size", mlp_chunk_size, allow_auto=False)
        self.engine: StreamingEngine | None = None
        self._orig_zero_grad: tuple[Any, Any] | None = None
        self._state_dict_patched: Any = None  # the optimizer whose state_dict() reads the host AdamW state
        self._deferred_saves: list[tuple[Any, bool]] = []  # (filepath, weights_only) asked for mid-backward, in order
        self._interrupt_pending = False  # Ctrl-C arrived during in-backward updates: raised once the step is complete

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
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout,
                              device_id=self.root_device if self.root_device.type != "cpu" else None)
        self.groups = ProcessGroups.create(self.local_rank, self.num_processes, self.node_rank, self.num_nodes,
                                           timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _guard(self, what: str) -> Any:
        """Main-thread collectives: a rank that died is named (``parallel/faults.py``)."""
        return guarded(self.groups.peers if self.groups else None, what, self._timeout.total_seconds() if self._timeout else None)

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
        if type(self.checkpoint_io) is not TorchCheckpointIO:  # before any work: it would never be called
            raise CheckpointError(
                f"megatrain: the checkpoint plugin {type(self.checkpoint_io).__name__} (Trainer(plugins=[...])) would "
                "not be used: strategy='megatrain' writes its directory checkpoints itself (safetensors shards, "
                "atomic rename). Remove the plugin; to upload or post-process checkpoints, do it from a callback's "
                "on_save_checkpoint or after the run.")
        if trainer.state.fn == TrainerFn.FITTING:
            _refuse_callbacks_reading_masters_on_disk(trainer.callbacks, self.nvme is not None and Region.master in self.nvme.kinds)
            _warn_save_hooks_see_no_weights(module, trainer.callbacks, self.nvme is not None and Region.master in self.nvme.kinds)
            _refuse_pruning(trainer.callbacks)
        reserve_frozen = _reserve_frozen(self.unfreeze_during_fit, trainer.callbacks)
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
            _refuse_placeholders(module)
            check_module(module)  # compiled submodules, fp64 or aliased parameters refused; 16-bit ones warned
            nvme = nvme_for_rank(self.nvme, self.groups) if self.groups is not None and self.nvme is not None \
                else self.nvme  # data parallel: the optimizer's regions on each owner's disk
            if self.groups is not None:  # every rank the same model and options, before the store is built
                check_same_config(self.groups.host, run_fingerprint(module, self, trainer), guard=self.groups.guard)
            self.engine = StreamingEngine(
                module,
                self.root_device,
                lookahead=self.lookahead,
                block_group=self.block_group,
                reserve_frozen=reserve_frozen,
                recompute_every=self.recompute_every,
                offload_activations=self.offload_activations,
                loss_chunk_size=self.loss_chunk_size,
                mlp_chunk_size=self.mlp_chunk_size,
                recompute_policy=RecomputePolicy(self.recompute, self.root_device, self.activation_memory_limit),
                block_classes=self.block_classes,
                block_names=self.block_names,
                pin_memory=self.pin_memory,
                cpu_zero_copy=self.cpu_zero_copy,
                nvme=nvme,
                sources=weight_sources(module),
                host_threads=self.host_threads,
                reducer=self._grad_reducer(),
                node=NodeStore(self.groups, self._timeout.total_seconds() if self._timeout else 1800.0,
                               pin=self.pin_memory if self.root_device.type == "cuda" else False)
                if self.groups else None,
            )
            if self.is_global_zero:  # once per engine: what is in force, to confirm from the log
                disk = self.engine.store.nvme_kinds
                where = lambda *ks: "NVMe" if any(k in disk for k in ks) else "host RAM"  # noqa: E731
                log.info("megatrain: strategy=MegaTrainStrategy, tier %s: fp32 masters in %s, AdamW state in %s, "
                         "gradient accumulators in %s%s; device %s, precision=%s, lookahead=%s, block_group=%s, "
                         "recompute=%s, recompute_every=%s, loss_chunk_size=%s, mlp_chunk_size=%s, "
                         "offload_activations=%s, cpu_zero_copy=%s, optimizer_in_backward=%s, processes=%d",
                         "NVMe" if disk else "RAM", where(Region.master), where(Region.exp_avg, Region.exp_avg_sq),
                         where(Region.grad_accum),
                         f" (host_memory_limit {self.nvme.host_memory_limit / 2**30:.1f} GiB, {self.nvme.path})"
                         if disk and self.nvme is not None else "", self.root_device,
                         getattr(self.precision_plugin, "precision", "?"), self.lookahead, self.block_group,
                         self.recompute, self.recompute_every, self.loss_chunk_size, self.mlp_chunk_size,
                         self.offload_activations, self.cpu_zero_copy, self.optimizer_in_backward, self.world_size)
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
        if self.groups is not None:
            weights_written(self.groups, self.engine.store)
        module._device = self.root_device  # the module is never moved as a whole
        if trainer.state.fn == TrainerFn.FITTING:
            prefix = prefix_tuning_adapters(module)
            if prefix:  # before any work: its first training forward would be refused (engine/kv_cache.py)
                raise RuntimeError(f"megatrain: peft prefix tuning ({', '.join(prefix)}) cannot be trained with "
                                   "strategy='megatrain': its virtual tokens enter every attention layer as a KV "
                                   "cache, whose gradients the streamed blocks cannot carry. Use prompt tuning or "
                                   "P-tuning (peft PromptTuningConfig / PromptEncoderConfig: virtual tokens as input "
                                   "embeddings), or LoRA.")
            unsavable = unsavable_adapters(module)
            if unsavable:  # before the training that a final save_checkpoint would then refuse
                log.warning("megatrain: peft adapter(s) %s train, but directory checkpoints cannot save them "
                            "(trainer.save_checkpoint and ModelCheckpoint will raise CheckpointError); save the adapter "
                            "with model.save_pretrained(...) after fit, or use LoRA, DoRA, IA3, LoHa, LoKr or VeRA.",
                            ", ".join(unsavable))
            if not recorded_outputs.supported():
                _refuse_router_aux_loss(module)
            super().setup_optimizers(trainer)
            self._take_over_optimizer()
            if _WeightAveraging is not None and trainer.checkpoint_callbacks \
                    and any(isinstance(cb, _WeightAveraging) for cb in trainer.callbacks):
                raise CheckpointError(
                    "megatrain: a WeightAveraging / EMAWeightAveraging callback and checkpointing (ModelCheckpoint; "
                    "Trainer(enable_checkpointing=True) is the default) are both in this Trainer: its checkpoints' "
                    "state_dict would be the average, which the directory checkpoint cannot hold. Pass "
                    "enable_checkpointing=False (the average is in the module after fit: save it with "
                    "save_pretrained), or drop the averaging callback.")
            for cb in trainer.checkpoint_callbacks:  # before training, not at the first save
                if getattr(cb, "dirpath", None) is not None:
                    local_path(cb.dirpath)
            if not any(isinstance(cb, _FlushForCallbacks) for cb in trainer.callbacks):
                trainer.callbacks.insert(0, _FlushForCallbacks())
                trainer.callbacks.append(_AfterWeightAveraging())
        plugin = self.precision_plugin
        assert isinstance(plugin, MegaTrainPrecision)
        plugin.attach_engine(self.engine, self.root_device.type)
        # user code may run between the clip and the step (and read or edit param.grad): clip at once there
        user_code_after_clip = (not module.automatic_optimization
                                or is_overridden("configure_gradient_clipping", module))
        plugin.clip_in_place = user_code_after_clip and self.engine.ownership is None
        if user_code_after_clip and self.engine.ownership is not None:
            rank_zero_warn("megatrain: with several processes gradient clipping is applied in the optimizer step: "
                           "param.grad read or edited after clip_gradients (manual optimization, a "
                           "configure_gradient_clipping override) shows the gradients before the clip, and edits "
                           "made after it are clipped too (one process applies the clip at once, as plain Lightning).")
        if self.optimizer_in_backward is True and trainer.state.fn == TrainerFn.FITTING:
            why = [w for w, on in (("gradient_clip_val (the clip needs the global norm first)", trainer.gradient_clip_val),
                                   ("manual optimization", not module.automatic_optimization),
                                   ("fp16 loss scaling", getattr(plugin, "scaling", False)),
                                   ("code that sees the step's gradients", self._user_code_sees_step_gradients(module, trainer)))
                   if on]
            if why:  # asked for explicitly: say why the deferred schedule runs instead
                rank_zero_warn(f"megatrain: optimizer_in_backward=True is not used with {', '.join(why)}: the update "
                               "runs in the optimizer step (same numbers; host memory holds the step's gradients).")
        if (trainer.state.fn == TrainerFn.FITTING and self.is_global_zero and self.optimizer_in_backward is not False
                and (self.optimizer_in_backward or self.engine.store.nvme is not None)):
            log.info("megatrain: optimizer_in_backward: each block's update runs during its backward. Ctrl-C then "
                     "stops the run once the step is complete; any other exception raised inside a backward leaves "
                     "the model half updated, and training and saving are refused until a checkpoint is loaded. "
                     "optimizer_in_backward=False keeps every step consistent (on the NVMe tier: 8 bytes more I/O "
                     "per trainable parameter and step).")
        if Region.grad_accum in self.engine.store.nvme_kinds and trainer.state.fn == TrainerFn.FITTING:
            hooks = self._gradient_hooks(module, trainer)
            if hooks:  # they would see param.grad None and their edits would be no-ops, silently
                rank_zero_warn(f"megatrain: the gradient accumulators are on NVMe (offload_optimizer='nvme'), where "
                               f"they are never all in memory, so param.grad is None in {', '.join(hooks)}: that code "
                               "cannot read or change the gradients. Clip with Trainer(gradient_clip_val=...) (applied "
                               "slab by slab), or keep the optimizer state in RAM (offload_optimizer='cpu') to see "
                               "param.grad there.")
        self.setup_precision_plugin()
        self._wrap_lightning_optimizers()

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
        if self._orig_zero_grad is not None and self.engine is not None and not self.engine.closed \
                and trainer.state.fn == TrainerFn.FITTING:
            self._restore_zero_grad()
            old = self._state_dict_patched
            if old is not None:
                old.__dict__.pop("state_dict", None)
                old.__dict__.pop("load_state_dict", None)
            self._take_over_optimizer()
            self._wrap_lightning_optimizers()

    def _take_over_optimizer(self) -> None:
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
        self.engine.attach_optimizer(opt, overlap=self.overlap_optimizer)
        engine = self.engine
        had = "zero_grad" in opt.__dict__
        orig = opt.zero_grad

        plugin = self.precision_plugin

        def zero_grad(set_to_none: bool = True) -> None:
            if not set_to_none:
                warn_zero_grad_kept()
            orig(set_to_none=set_to_none)
            engine.zero_grad()
            if isinstance(plugin, MegaTrainPrecision):
                plugin.grads_zeroed()

        self._orig_zero_grad = (opt, orig if had else None)
        opt.zero_grad = zero_grad  # type: ignore[method-assign]
        self._patch_state_dict(opt, engine)

        def forget(param: torch.Tensor | None) -> None:
            host = engine.optimizer
            if host is None or engine.closed:
                return
            host.flush()
            for p in ([param] if param is not None else [p for g in opt.param_groups for p in g["params"]]):
                host.forget_param_state(p)

        opt.state = HostStateView(forget)  # type: ignore[assignment]

    def _patch_state_dict(self, opt: Any, engine: StreamingEngine) -> None:
        """``opt.state_dict()`` / ``opt.load_state_dict(sd)`` on the user's optimizer read and write the host
        optimizer's AdamW state in ``torch.optim.AdamW`` format (``HostAdamW.state_dict(copy=True)``: 8 bytes/param
        of host RAM while the dict lives; ``HostAdamW.load_state_dict``): the torch optimizer itself holds no state,
        so user code saving it (``torch.save(opt.state_dict(), ...)``) got an empty state without a word. Kept
        after fit (the store stays open for ``trainer.save_checkpoint``); :meth:`close` removes them."""
        def state_dict() -> dict[str, Any]:
            if engine.closed or engine.optimizer is None:
                raise RuntimeError("megatrain: this optimizer's AdamW state lived in the strategy's host store, which "
                                   "trainer.strategy.close() removed; save it (or a checkpoint) before closing.")
            return engine.optimizer.state_dict(copy=True)

        def load_state_dict(state: dict[str, Any]) -> None:
            if engine.closed or engine.optimizer is None:
                raise RuntimeError("megatrain: the strategy's host store was closed (trainer.strategy.close()); "
                                   "load the optimizer state in a new run (fit(ckpt_path=...)).")
            engine.optimizer.load_state_dict(state)

        opt.state_dict = state_dict  # type: ignore[method-assign]
        opt.load_state_dict = load_state_dict  # type: ignore[method-assign]
        self._state_dict_patched = opt

    def _wrap_lightning_optimizers(self) -> None:
        """``self.optimizers()`` under manual optimization: Lightning's wrapper subclasses the optimizer's class, so
        its ``zero_grad`` is the class's, not the one set on the optimizer (the engine would keep its gradients).
        Called once the wrappers are final (``setup_precision_plugin`` makes new ones)."""
        if self._orig_zero_grad is not None:
            opt = self._orig_zero_grad[0]
            for wrapper in self._lightning_optimizers:
                if wrapper.optimizer is opt:
                    wrapper.zero_grad = opt.zero_grad  # type: ignore[method-assign]
                    wrapper.state_dict = opt.state_dict  # type: ignore[method-assign]
                    wrapper.load_state_dict = opt.load_state_dict  # type: ignore[method-assign]

    def _restore_zero_grad(self) -> None:
        if self._orig_zero_grad is not None:
            opt, orig = self._orig_zero_grad
            if orig is None:
                opt.__dict__.pop("zero_grad", None)
            else:
                opt.zero_grad = orig
            self._orig_zero_grad = None
            if isinstance(opt.state, HostStateView):
                opt.state = defaultdict(dict)  # torch's own, empty: the state is read through state_dict()
        for wrapper in self._lightning_optimizers:
            wrapper.__dict__.pop("zero_grad", None)

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
            self._deferred_saves = []  # asked for in the stopped backward: never written
            self._interrupt_pending = False
            raise
        if self.engine is not None:
            self.engine.stopped.completed()
            metrics = self.engine.end_step()
            if self.log_stats:
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
            if not getattr(self, "_warned_log", False):
                self._warned_log = True
                log.warning("megatrain: per-step statistics not logged (%s); they stay in "
                            "trainer.strategy.engine.history.", err)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step; first decides whether this micro-batch's backward applies the
        AdamW updates (``optimizer_in_backward``)."""
        if self.engine is not None:
            self.engine.stopped.check("training")
            self._adopt_replaced_weights()
            self.engine.update_in_backward = self._update_in_backward_now()
        return super().training_step(*args, **kwargs)

    def _adopt_replaced_weights(self) -> None:
        """Before a training or evaluation step: parameters whose ``.data`` user code replaced
        (``param.data = tensor`` in a hook) are taken into the store, as plain PyTorch would compute with them.

        Raises:
            RuntimeError: with several processes (each rank's masters are the node's shared copy, which one
                rank's assignment must not change alone): write in place instead, on every rank.
        """
        self._refuse_placeholder_writes()
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
        if self.optimizer_in_backward is False or engine is None or engine.optimizer is None or module is None:
            return False
        if self.optimizer_in_backward is None and engine.store.nvme is None:
            return False
        trainer = module.trainer
        plugin = self.precision_plugin
        if (not module.automatic_optimization or trainer.gradient_clip_val or getattr(plugin, "scaling", False)
                or self._user_code_sees_step_gradients(module, trainer)):
            return False
        try:
            return not trainer.fit_loop.epoch_loop._should_accumulate()
        except AttributeError:  # another Lightning version: stay with the deferred schedule
            return False

    @staticmethod
    def _gradient_hooks(module: Any, trainer: Any) -> list[str]:
        """The user hooks that read or edit the step's gradients before the optimizer step, as ``"Class.hook"``:
        the module's ``on_after_backward`` / ``on_before_optimizer_step`` overrides and the callbacks' (e.g. a
        gradient-norm logger or clipper)."""
        hooks = ("on_after_backward", "on_before_optimizer_step")
        found = [f"{type(module).__name__}.{h}" for h in hooks if is_overridden(h, module)]
        return found + [f"{type(cb).__name__}.{h}" for cb in trainer.callbacks for h in hooks
                        if is_overridden(h, cb, Callback)]

    @classmethod
    def _user_code_sees_step_gradients(cls, module: Any, trainer: Any) -> bool:
        """Whether user code sees the step's complete gradients before the optimizer step (:meth:`_gradient_hooks`,
        or a ``configure_gradient_clipping`` / ``optimizer_step`` override). An update applied in the backward
        would run before that code, so its edits would be lost and its reads would see no gradients: the deferred
        schedule runs instead."""
        return (any(is_overridden(h, module) for h in ("configure_gradient_clipping", "optimizer_step"))
                or bool(cls._gradient_hooks(module, trainer)))

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

    @contextlib.contextmanager
    def summon_full_params(self, module: torch.nn.Module | None = None, writeback: bool = True
                           ) -> Generator[None, None, None]:
        """Inside this context the parameters of ``module`` (default: the whole LightningModule) hold their current
        fp32 weights, to read or edit from a hook or callback, as ``FullyShardedDataParallel.summon_full_params``
        does for FSDP. In the RAM tier they always do (they are views of the host masters); with the weights on NVMe
        (``offload_params="nvme"``) they are placeholders (NaN) outside it, so a weight norm read there is NaN and a
        write there (``nn.init``, ``fill_``) is refused at the next step or at the end of the run.

        Pending optimizer updates are applied first. On exit with ``writeback=True`` (the default) the values the
        parameters hold then (in-place edits, or ``param.data = tensor`` of the same shape) are written into the
        store and the prefetched copies dropped; pass ``writeback=False`` to only read (with NVMe: no disk writes).
        Do not edit weights under ``writeback=False``: as with FSDP, what happens to such an edit is not defined (the
        NVMe tier drops it, the RAM tier keeps it: its parameters are the weights). Contexts nest: an inner one
        leaves the parameters of an enclosing one as they are, and each writes back its own on exit. If the block
        raises, nothing is written back. Use it from hooks outside the model's forward and backward
        (``on_fit_start``, ``on_train_batch_start``/``_end``, ``on_before_optimizer_step``, validation hooks), not
        inside a block's forward (there the block's parameters are bound to the device copies it computes with).
        A write into a one-element placeholder by arithmetic (``mul_``, ``add_``) leaves its NaN a NaN and is not
        detected: edit such parameters inside this context too.
        With several processes and ``writeback=True`` every rank must enter it (it meets the others on entry and
        exit) and compute the same edit: each rank edits a copy of its own, as each rank of DDP edits its own replica, and the node's shared
        weights get the result once (an in-place ``mul_`` on every rank straight into the shared weights would be
        applied once per rank).

        Example (a weight-norm callback on the NVMe tier)::

            with trainer.strategy.summon_full_params(pl_module.model.lm_head, writeback=False):
                norm = pl_module.model.lm_head.weight.norm()

        Raises:
            ValueError: with the weights on NVMe, the requested parameters' fp32 bytes exceed ``host_memory_limit``
                (checked before anything is read): pass a submodule.
        """
        if self.engine is None:
            yield
            return
        module = module if module is not None else self.lightning_module
        params = list(module.parameters())
        engine = self.engine
        if engine.store.masters_on_disk and engine.host_memory_limit is not None:
            need = sum(p.numel() * 4 for p in params if id(p) in engine.store.index)
            if need > engine.host_memory_limit:
                raise ValueError(
                    f"megatrain: summon_full_params would read {format_gib(need / 2**30)} of fp32 weights from NVMe into "
                    f"host RAM, more than host_memory_limit ({format_gib(engine.host_memory_limit / 2**30)}). Pass the "
                    "submodule you need (e.g. pl_module.model.lm_head), or raise host_memory_limit.")
        engine.flush()
        # several processes, writing back: each rank edits its own copy; the result is written once per value
        private = self.groups is not None and writeback
        summoned = engine.params.summon(params, private)
        if private:
            self.barrier("summon_full_params: every rank has read the weights")
        failed = True
        try:
            yield
            failed = False
        finally:
            try:
                if private and not failed:
                    self.barrier("summon_full_params: every rank is done with its copy")
                engine.params.unsummon(summoned, writeback and not failed)  # a half-made edit is not written
                if private and not failed:
                    if engine.store.masters_on_disk:  # owners' writes reach their files; window copies dropped
                        weights_written(self.groups, engine.store)
                    else:
                        self.barrier("summon_full_params: the weights are written")
            finally:
                if writeback:
                    engine.weights_written()

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

    def _refuse_placeholder_writes(self) -> None:
        """Raise if user code wrote into NVMe placeholder parameters since the last check (before every training
        step and evaluation loop, and at the end of each; :meth:`HostStore.placeholder_writes`).

        Raises:
            RuntimeError: naming the parameter and :meth:`summon_full_params`."""
        if self.engine is None or self.engine.closed:
            return
        written = self.engine.params.placeholder_writes()
        if written:
            more = f" and {len(written) - 1} more" if len(written) > 1 else ""
            raise RuntimeError(
                f"megatrain: parameter {written[0]}{more} was written in place during this run (nn.init, fill_ or zero_ in "
                "a hook), but its weights are on NVMe (offload_params='nvme') and outside a block's compute the module's "
                "parameters are placeholders: the write did not reach the weights. Make the edit inside "
                "`with trainer.strategy.summon_full_params(module):` (reads and writes there see the real weights), "
                "or assign param.data = new_tensor.")

    def on_train_end(self) -> None:
        """Lightning calls it after the callbacks' and the module's ``on_train_end``: a write into a placeholder in
        the last step's hooks or there is refused too (else it was lost, and blamed on the next run)."""
        self._refuse_placeholder_writes()
        self.flush()
        self._raise_pending_interrupt()

    def on_validation_end(self) -> None:
        self._refuse_placeholder_writes()

    def on_test_end(self) -> None:
        self._refuse_placeholder_writes()

    def on_predict_end(self) -> None:
        self._refuse_placeholder_writes()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Refuse a parameter unfrozen since setup (Lightning calls this after the callbacks' and the
        module's ``on_train_batch_start``, so an unfreeze in any of those hooks is caught before its forward).

        Raises:
            RuntimeError: :func:`_refuse_unfrozen`.
        """
        super().on_train_batch_start(batch, batch_idx)
        self._raise_pending_interrupt()  # Ctrl-C during the last step's in-backward updates
        if self.engine is not None:
            _refuse_unfrozen(self.lightning_module, self.engine.trainable, self.unfreeze_during_fit is False)

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
        """Write a directory checkpoint (see :mod:`megatrain_lightning.checkpoint.directory`).

        ``storage_options`` is not supported (there is no CheckpointIO for directories).

        Raises:
            CheckpointError: a tensor of the module would not be written (e.g. a peft prompt-learning
                adapter), found before anything is written; or the checkpoint holds Lightning's
                ``WeightAveraging`` average in place of the module's weights.
            OSError: ``ENAMETOOLONG``: a name in ``filepath`` is longer than its filesystem accepts (255 bytes on
                Linux; e.g. a long ``ModelCheckpoint(filename=...)``), before anything is written.
        """
        if storage_options is not None:
            raise TypeError("strategy='megatrain' writes directory checkpoints and takes no storage_options.")
        if self.engine is None or self.lightning_module is None:
            raise RuntimeError("save_checkpoint called before the megatrain strategy was set up, or after "
                               "trainer.strategy.close().")
        filepath = local_path(filepath)
        self.engine.stopped.check("saving a checkpoint", CheckpointError)
        check_name_length(Path(filepath))
        if self.engine.grads.step_partly_applied() and self._defer_save(checkpoint, filepath):
            return
        if "current_model_state" in checkpoint:  # Lightning's WeightAveraging put its average in state_dict
            raise CheckpointError(
                "megatrain: the checkpoint's state_dict holds averaged weights (Lightning's WeightAveraging / "
                "EMAWeightAveraging moved the module's own weights to 'current_model_state'); the directory "
                "checkpoint writes the weights from the host store and would save the module's weights, not the "
                "average, and could not be resumed. Drop the averaging callback or the checkpointing (ModelCheckpoint, "
                "Tuner) for this run; the average is in the module after fit (WeightAveraging copies it in at "
                "on_train_end): save it then with save_pretrained or torch.save(module.state_dict(), path).")
        self.flush()
        self.engine.params.write_back_materialized()  # weights edited after fit (NVMe tier) are what gets saved
        coop = None
        if self.groups is not None:  # each rank writes its own slabs; Trainer.save_checkpoint's barrier follows
            assert self.engine.ownership is not None
            coop = CheckpointWriters(self.groups, self.engine.store, self.engine.ownership)
        tokenizer = getattr(self.lightning_module, "tokenizer", None)
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            rank_zero_warn(f"megatrain: the module's `tokenizer` attribute ({type(tokenizer).__name__}) has no "
                           "save_pretrained: it is not written into the checkpoint's model/ folder (a Hugging Face "
                           "tokenizer there would be).")
            tokenizer = None
        with keys_only():  # the writer reads values from the store; peft lists some keys through state_dict()
            save_checkpoint_dir(filepath, checkpoint, self.lightning_module, self.engine, tokenizer=tokenizer,
                                coop=coop)

    def _defer_save(self, checkpoint: dict[str, Any], filepath: Any) -> bool:
        """A save requested while a backward applies the AdamW updates as it goes (``optimizer_in_backward``) and
        has updated only part of the model (a module backward hook, or a signal handler such as Lightning's SLURM
        auto-requeue running in the middle of the backward): the weights are half at the next step, so a checkpoint
        now would be resumed with that step applied twice to part of the model (weights 40% off). During
        fit the save is deferred to the end of this optimizer step (the first callback's ``on_train_batch_end``,
        where ``ModelCheckpoint`` saves too: one step later, consistent) and ``True`` returned. Several saves in one
        backward are all written, in the order asked (a second save to the same path replaces the first's request).

        Raises:
            CheckpointError: not during fit (the step was interrupted mid-backward, e.g. an emergency save after
                an error): the model is partly updated and no consistent checkpoint can be made from it.
        """
        trainer = self.lightning_module.trainer
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING or not trainer.training:
            raise CheckpointError(
                "megatrain: the last optimizer step stopped in the middle of its backward after optimizer_in_backward "
                "had updated part of the model, so the weights mix two steps and no consistent checkpoint can be "
                "written. Resume from the last checkpoint (set optimizer_in_backward=False to keep every update until "
                "the backward ends).")
        self._deferred_saves = [s for s in self._deferred_saves if s[0] != filepath]
        self._deferred_saves.append((filepath, "optimizer_states" not in checkpoint))
        rank_zero_warn(f"megatrain: save_checkpoint({str(filepath)!r}) was called in the middle of a backward that "
                       "applies the optimizer updates as it goes (optimizer_in_backward): part of the model is already "
                       "at the next step. It is written at the end of this optimizer step instead (one step later); "
                       "if the step does not finish, nothing is written.")
        return True

    def save_deferred(self, trainer: Any) -> None:
        """Write the checkpoints :meth:`_defer_save` put off, in the order asked, now that the optimizer step is
        complete."""
        saves, self._deferred_saves = self._deferred_saves, []
        for filepath, weights_only in saves:
            trainer.save_checkpoint(filepath, weights_only=weights_only)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify a directory checkpoint, load its weights into the host store and return the metadata; or read a
        plain Lightning ``.ckpt`` file (another strategy's) with Lightning's own loader, whose weights and AdamW state
        :meth:`load_model_state_dict` and :meth:`load_optimizer_state_dict` then copy into the store
        (``checkpoint/lightning_resume.py``).

        A directory checkpoint's tensors (parameters and persistent buffers) are loaded here, honouring
        ``LightningModule.strict_loading``, so the dict returned (and the one ``on_load_checkpoint`` sees) has
        ``state_dict == {}``: the weights are in the checkpoint's ``model/`` (and ``extra/``) and already in the
        module; to fix up keys, convert the checkpoint or edit the weights in ``on_fit_start``.

        Raises:
            CheckpointError: a directory that is not a megatrain checkpoint, written for another model config,
                damaged (checksums, a damaged megatrain.json), or with a part copied from another checkpoint; a
                ``.ckpt`` whose keys or shapes do not fit the module (raised when its weights are loaded).
        """
        if self.engine is None or self.lightning_module is None:
            raise RuntimeError("load_checkpoint called before the megatrain strategy was set up.")
        self.flush()
        if self.engine.optimizer is not None:
            self.engine.optimizer.pending.clear()
        if not is_local(checkpoint_path) and get_filesystem(checkpoint_path).isfile(checkpoint_path):
            self._loaded_path, self._loaded_meta = None, None  # a remote .ckpt file: Lightning's loader (fsspec)
            self._loaded_file = str(checkpoint_path)
            return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint_path = local_path(checkpoint_path)
        if Path(checkpoint_path).is_file():  # another strategy's .ckpt: Lightning's own loader (lightning_resume.py)
            self._loaded_path, self._loaded_meta = None, None
            self._loaded_file = str(checkpoint_path)
            return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaded_file = None
        meta = load_checkpoint_dir(checkpoint_path, self.lightning_module, self.engine,
                                   strict=getattr(self.lightning_module, "strict_loading", True))
        if self.groups is not None:
            weights_written(self.groups, self.engine.store)
        self.engine.stopped.restored()
        self._loaded_path = checkpoint_path
        self._loaded_meta = meta
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A directory checkpoint's weights were already copied into the store by :meth:`load_checkpoint`; a plain
        Lightning ``.ckpt``'s ``state_dict`` is copied now, one tensor at a time (``load_lightning_weights``)."""
        if getattr(self, "_loaded_file", None) is not None and self.engine is not None:
            self.flush()
            load_lightning_weights(checkpoint, self.lightning_module, self.engine, strict=strict,
                                   source=self._loaded_file)
            self.engine.stopped.restored()
            if self.groups is not None:
                weights_written(self.groups, self.engine.store)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the AdamW state and param groups of the checkpoint :meth:`load_checkpoint` read.

        A ``BaseFinetuning`` callback restores the param groups it added (``on_fit_start`` after its
        ``load_state_dict``); with ``restore_checkpoint_after_setup`` Lightning restores callbacks after
        ``on_fit_start``, so its hook runs again here, before the groups are matched (a no-op when not resuming)."""
        loaded_file = getattr(self, "_loaded_file", None)
        if self.engine is None or self.engine.optimizer is None or (getattr(self, "_loaded_path", None) is None
                                                                  and loaded_file is None):
            return
        trainer = self.lightning_module.trainer
        for cb in trainer.callbacks:
            if isinstance(cb, BaseFinetuning):
                cb.on_fit_start(trainer, self.lightning_module)
        if loaded_file is not None:
            load_lightning_optimizer(checkpoint, self.engine.optimizer, source=loaded_file)
            return
        load_optimizer_dir(self._loaded_path, self.lightning_module, self.engine, self._loaded_meta)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint directory, file or symlink (not the symlink's target: ``save_last="link"``), as
        ``ModelCheckpoint(save_top_k=...)`` prunes."""
        if self.is_global_zero:
            remove_entry(Path(filepath))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def teardown(self) -> None:
        """Flush updates, restore the module's own ``forward`` methods and the optimizer."""
        if self.engine is not None:
            self.engine.uninstall()
            if self._masters_on_disk():
                self._release_nvme()
        self._restore_zero_grad()
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
            if eng.store.masters_on_disk and not eng.params.materialized and not (self.nvme and self.nvme.keep_files):
                log.warning("megatrain: closing the NVMe store deletes the trained weights, which were only in it; "
                            "the module's parameters stay placeholders.")
            self.engine.close()
            self.engine = None
        opt = getattr(self, "_state_dict_patched", None)
        if opt is not None:  # the torch optimizer's own methods again
            opt.__dict__.pop("state_dict", None)
            opt.__dict__.pop("load_state_dict", None)
            self._state_dict_patched = None

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


def _refuse_pruning(callbacks: Sequence[Callback]) -> None:
    """Raise if Lightning's ``ModelPruning`` callback is in the Trainer: it prunes during fit with
    ``torch.nn.utils.prune``, which re-registers each pruned ``weight`` as ``weight_orig`` (plus a mask buffer and a
    forward pre-hook), a change of the module's parameters the store (laid out at setup) cannot follow; without this
    check the first block call after the first pruning fails (``ParamRef.registered``), an epoch of training later.

    Raises:
        RuntimeError: naming the callback and what to do instead.
    """
    from lightning.pytorch.callbacks import ModelPruning

    for cb in callbacks:
        if isinstance(cb, ModelPruning):
            raise RuntimeError(
                "megatrain: the ModelPruning callback prunes during fit (torch.nn.utils.prune re-registers each pruned "
                "'weight' as 'weight_orig' with a mask), which strategy='megatrain' cannot follow: its host store is "
                "laid out from the module at setup. Prune before trainer.fit instead (torch.nn.utils.prune on the "
                "model, then prune.remove to make it permanent), or between two fit calls, and remove ModelPruning.")


def _warn_save_hooks_see_no_weights(module: Any, callbacks: Sequence[Callback], masters_on_disk: bool) -> None:
    """Warn (once, at setup) when the LightningModule or a callback overrides ``on_save_checkpoint`` while the weights
    are on NVMe: the hook's ``checkpoint["state_dict"]`` is then empty (the strategy writes the weights into the
    checkpoint directory's ``model/`` one slab at a time; a dict of them would need the whole model in host RAM).
    Without the warning a hook counting the keys sees 0 instead of 30, without a word."""
    if not masters_on_disk:
        return
    who = [type(module).__name__] if is_overridden("on_save_checkpoint", module) else []
    who += [type(cb).__name__ for cb in callbacks if is_overridden("on_save_checkpoint", cb, Callback)
            and not type(cb).__module__.startswith("megatrain_lightning.")]  # the recipes' run record adds metadata only
    if who:
        rank_zero_warn(
            f"megatrain: {', '.join(who)} override(s) on_save_checkpoint; with offload_params='nvme' the hook's "
            "checkpoint['state_dict'] is empty: the weights are written to the checkpoint directory's model/ "
            "(safetensors) one slab at a time. Read weights there after the save, or in a hook inside "
            "`with trainer.strategy.summon_full_params(submodule, writeback=False):`.")


def _refuse_callbacks_reading_masters_on_disk(callbacks: Sequence[Callback], masters_on_disk: bool) -> None:
    """Raise if a callback would read (or write) parameter values through ``param.data`` while the masters are on
    NVMe (``offload_params="nvme"``: those tensors are placeholders, the weights are in the store's files).

    ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) average ``pl_module.parameters()``
    and copy the average back into them: the average would be of placeholders, and the first swap fails with a
    PyTorch error after the training steps it ran. ``BaseFinetuning`` decides which unfrozen parameters are
    already in the optimizer by comparing values (``filter_on_optimizer``: ``torch.equal``), and placeholders of
    one shape are all equal: it would add no param group, and the unfrozen parameters would silently not train
    (measured). Refused at setup, before any work.

    Raises:
        RuntimeError: naming the callback and what to change.
    """
    if not masters_on_disk:
        return
    kinds = tuple(k for k in (_WeightAveraging, _StochasticWeightAveraging) if k is not None)
    for cb in callbacks:
        if kinds and isinstance(cb, kinds):
            raise RuntimeError(
                f"megatrain: the {type(cb).__name__} callback averages the parameters by reading and writing them "
                "directly, but with offload_params='nvme' the weights live in the NVMe store's files and the "
                "parameters are placeholders. Keep the weights in host RAM (offload_params='cpu'; "
                "offload_optimizer='nvme' still moves the AdamW state to disk), or remove the callback.")
        if isinstance(cb, BaseFinetuning):
            raise RuntimeError(
                f"megatrain: the {type(cb).__name__} callback finds the parameters it unfreezes in the optimizer by "
                "comparing their values, but with offload_params='nvme' the weights live in the NVMe store's files "
                "and the parameters are placeholders (all equal), so it would add no param group and the unfrozen "
                "parameters would not train. Keep the weights in host RAM (offload_params='cpu'; "
                "offload_optimizer='nvme' still moves the AdamW state to disk), or unfreeze in a callback of your own "
                "(requires_grad_(True) and optimizer.add_param_group) with MegaTrainStrategy(unfreeze_during_fit=True).")


def _refuse_placeholders(module: torch.nn.Module) -> None:
    """Raise if the module's parameters are NVMe placeholders (stride-0 views of one 4-byte NaN) that
    a new engine would take for weights: building a store from them would train or evaluate NaN.

    Raises:
        RuntimeError: with what happened and what to do.
    """
    for name, p in module.named_parameters():
        if is_nvme_placeholder(p):
            raise RuntimeError(
                f"megatrain: parameter {name} holds no weights (an NVMe placeholder: its weights are in the NVMe store "
                "of another strategy, or were, if that store was closed). Use the Trainer whose strategy holds them, "
                "or load them again: from a checkpoint saved before the close (fit(module, ckpt_path=...)) or "
                "from_pretrained on its model/ folder."
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


def _refuse_router_aux_loss(module: torch.nn.Module) -> None:
    """Raise if a mixture-of-experts model returns router logits (``config.output_router_logits=True``: Mixtral,
    Qwen-MoE, OLMoE...), whose router auxiliary (load-balancing) loss the model adds to the loss.

    Called only when this transformers version does not record per-layer outputs the way
    ``engine/recorded_outputs.py`` handles (which makes the router logits outputs of the block calls):
    otherwise the logits are kept by hooks inside a streamed block, whose forward keeps none of the tensors past its return
    a backward reads (the block is recomputed in backward), so the backward through the auxiliary loss
    would fail mid-step. Refused even with ``router_aux_loss_coef=0``: the model still multiplies the
    auxiliary loss by the coefficient, and the backward still reaches the logits.

    Raises:
        RuntimeError: naming the submodule and what to set.
    """
    for name, m in module.named_modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "output_router_logits", False):
            raise RuntimeError(
                f"megatrain: {name or '(the LightningModule)'} ({type(m).__name__}) has config.output_router_logits="
                "True, which strategy='megatrain' does not support with this transformers version: the router logits "
                "are gathered by hooks inside the streamed decoder layers, whose forward keeps nothing for a backward, so the "
                "backward through the router auxiliary loss (even with router_aux_loss_coef=0) would fail. Set config.output_router_logits=False (the loss is "
                "then the language-modelling loss alone) before fit.")


def _reserve_frozen(option: bool | None, callbacks: Sequence[Callback]) -> bool:
    """``unfreeze_during_fit`` resolved: the option, or with ``None`` whether a ``BaseFinetuning`` callback (which
    unfreezes parameters and adds them to the optimizer during fit) is among ``callbacks``."""
    return option if option is not None else any(isinstance(cb, BaseFinetuning) for cb in callbacks)


def _refuse_unfrozen(module: torch.nn.Module, trainable: Sequence[bool], option_off: bool = False) -> None:
    """Raise if a parameter frozen when the engine was built (``trainable[i]`` False, in
    ``module.parameters()`` order) has ``requires_grad`` True now.

    The host store holds gradient accumulators and AdamW state only for the parameters trainable at
    setup; such a parameter's gradient has nowhere to go (the backward failed with a reshape error of
    an empty accumulator). Freezing during fit works (its gradient is dropped, as in plain PyTorch).

    Raises:
        RuntimeError: naming the first such parameter and the two ways to get the same training.
    """
    for (name, p), was in zip(module.named_parameters(), trainable):
        if p.requires_grad and not was:
            raise RuntimeError(
                f"megatrain: parameter {name} was frozen (requires_grad=False) when fit started and is trainable now "
                "(requires_grad_(True) during fit); strategy='megatrain' "
                "allocates gradient and AdamW state at setup, for the parameters trainable then"
                + (" (unfreeze_during_fit=False was passed). " if option_off else ". ")
                + "Pass MegaTrainStrategy(unfreeze_during_fit=True) (Hydra: strategy.unfreeze_during_fit=true; the "
                "default None turns it on with a BaseFinetuning callback) to keep state for the frozen parameters too, "
                "or train in two fits (fit with it frozen, then unfreeze, raise max_epochs/max_steps and call "
                "trainer.fit again).")


def warn_zero_grad_kept() -> None:
    """Warn (once per process) that ``optimizer.zero_grad(set_to_none=False)`` acts as ``set_to_none=True``.

    Gradients live in host accumulators, not in ``param.grad``, so there is no zero gradient to keep: a parameter
    that gets no gradient in a step is not updated, where ``torch.optim.AdamW`` with a kept zero gradient would
    still apply weight decay and decay its moments (momentum moves it). Every parameter that gets a gradient in
    every step (the usual case) is updated exactly as in PyTorch."""
    global _ZERO_GRAD_WARNED
    if _ZERO_GRAD_WARNED:
        return
    _ZERO_GRAD_WARNED = True
    rank_zero_warn("megatrain: optimizer.zero_grad(set_to_none=False) acts as set_to_none=True here (gradients live "
                   "in host accumulators): a parameter that gets no gradient in a step is not updated, where "
                   "torch's AdamW would still apply weight decay and momentum with a zero gradient. Parameters "
                   "that get a gradient every step are unaffected; for the others use strategy='auto' or give them "
                   "a gradient every step (e.g. add 0 * their output to the loss).", category=UserWarning)


_ZERO_GRAD_WARNED = False
