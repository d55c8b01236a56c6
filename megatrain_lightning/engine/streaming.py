"""``StreamingEngine``: streams a model's blocks through one device and owns their host state.

The engine's frame: the parts (each owning its state: docs/architecture.md, "Engine layout"; a step through them:
"A training step"), the per-block proxies, the phase machine of a step that gives the prefetch schedule.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..config import MegaTrainConfig
from ..optim.host_adamw import HostAdamW
from ..optim.host_generic import make_host_optimizer
from ..store import heap
from ..store.budget import HostBudget
from ..store.host import HostStore, build_store
from ..store.regions import Region
from ..store.shared import NodeShare, SlabOwnership
from ..store.nvme import NVMeConfig
from ..blocks import Block, HFRunSettings, check_floating, discover_blocks, output_embedding_blocks
from .accounting import ByteAccounting, StepStats
from .block_groups import form_groups
from .chunked_mlp import ChunkedMLP
from .fetch import WeightFetcher
from .forward_patch import ForwardPatches
from .grads import GradientSink
from .head_loss import HeadLoss
from .kv_cache import any_requires_grad, layer_index, training_call
from .prefetch import Prefetcher
from .boundary.boundary import Boundary
from .boundary.records import trainable_refs
from .boundary.runner import BlockRunner
from .recompute_policy import RecomputePolicy
from .reduce import GradReducer
from .staging import StagingRing
from .window import nvme_window
from .shared_grads import SharedGradSums
from .params import ParamAccess
from .threads import resolve_host_threads, start_worker
from .stopped_step import StoppedStep
from .transport import make_transport

log = logging.getLogger(__name__)

class StreamingEngine:
    """Streams a model's blocks through the compute device and owns their host state.

    Args:
        root: the module to stream (the ``LightningModule``).
        device: compute device (``cpu`` or ``cuda:N``).
        config: the options (:class:`~megatrain_lightning.config.MegaTrainConfig`); ``None``: one built from
            ``options``.
        nvme: the NVMe tier's settings (:class:`~megatrain_lightning.store.nvme.NVMeConfig`); ``None``: the
            config's (``None`` there: all in host RAM). Its preflight runs before any weight is read.
        sources: ``id(param) -> loader`` for parameters on the ``meta`` device (``checkpoint.hf_io.weight_sources``);
            each loader is called once while the host store is built.
        reducer / node: data parallel (``None``: one process): the gradient averaging
            (:class:`~.reduce.GradReducer`); the node-shared store and slab owners.
        reserve_frozen: gradient and AdamW state for frozen parameters too, to unfreeze in fit (``slab_layout``).
        options: ``MegaTrainConfig`` fields, when ``config`` is not given (e.g. ``lookahead=2``).

    Raises:
        BlockDiscoveryError: no blocks found (see ``discover_blocks``).
        ValueError: ``lookahead < 0``, ``block_group < 1``, ``host_threads < 1``, a chunk size that is not a
            positive int, or an unsupported device type; a ``meta`` parameter without a source or of another shape.
        HostPinningError: ``pin_memory=True`` and the NVMe window could not be page-locked.
    """

    def __init__(
        self,
        root: nn.Module,
        device: torch.device,
        config: MegaTrainConfig | None = None,
        *,
        nvme: NVMeConfig | None = None,
        sources: dict[int, Callable[[], torch.Tensor]] | None = None,
        reducer: GradReducer | None = None,
        node: NodeShare | None = None,
        reserve_frozen: bool = False,
        **options: Any,
    ):
        if config is not None and options:
            raise TypeError(f"StreamingEngine: pass either config or options ({', '.join(options)}), not both.")
        config = config if config is not None else MegaTrainConfig(**options)
        nvme = nvme if nvme is not None else config.nvme
        cpu_zero_copy, pin_memory = config.cpu_zero_copy, config.pin_memory
        self.head_loss = HeadLoss(root, config.loss_chunk_size, self.call_block, lambda: self.fetcher.param_dtype)
        self.mlp = ChunkedMLP(config.mlp_chunk_size)
        self.root, self.device = root, torch.device(device)
        host_threads = resolve_host_threads(config.host_threads, self.device)
        self.blocks: list[Block] = discover_blocks(root, config.block_classes, config.block_names)
        check_floating(self.blocks)
        groups = form_groups(self.blocks, config.block_group)
        ahead = (config.lookahead + 1) * max(map(len, groups)) - 1  # blocks fetched ahead of the one computing
        pin: bool | None = pin_memory if self.device.type == "cuda" else False  # None: try (CUDA default), fall back with a warning
        self.budget: HostBudget | None = None
        min_window, factory = 0, None  # factory: Callable[[layout], NVMeStore] for the NVMe tier
        if nvme is not None and nvme.kinds:
            self.budget, min_window, factory = nvme_window(self.blocks, nvme, self.device, ahead, pin, reserve_frozen)
            if Region.master in nvme.kinds:
                cpu_zero_copy = False  # compute buffers are copies, counted in the budget
        self.store: HostStore = build_store(self.blocks, pin_memory=pin if not (nvme and Region.master in nvme.kinds) else False,
                                            sources=sources, nvme_factory=factory, nvme_kinds=nvme.kinds if nvme else (),
                                            shared=node.regions if node is not None else None, reserve_frozen=reserve_frozen)
        self.ownership: SlabOwnership | None = node.setup(self.store) if node is not None else None
        heap.trim()  # the module's own parameter storage, freed into the heap now that the store holds the weights
        self.trainable = [reserve_frozen or p.requires_grad for p in root.parameters()]  # state in the store
        staging = self.store.max_slab_numel(trainable=True) + (max(len(s.entries) for s in self.store.slabs) if reducer
                                                              else 0)  # data parallel: + presence flags (reduce.py)
        self.transport = make_transport(self.device, staging, cpu_zero_copy, pin=pin,
                                        reuse_cpu_buffers=self.budget is None)
        # on CPU the compute buffers are host memory: they count in host_memory_limit
        budget_device = self.budget is not None and self.device.type == "cpu"
        self.acct = ByteAccounting(reserve=self.store.nvme.reserve if budget_device else None,
                                   unreserve=self.budget.release if budget_device else None,
                                   on_release=self.transport.released)
        self.params = ParamAccess(self.store)
        # gradients of a parameter read by several blocks are summed per backward, as autograd does
        shared = SharedGradSums(self.blocks, enabled=Region.grad_accum not in self.store.nvme_kinds)
        self.grads = GradientSink(self.store, self.acct, self.transport, shared, host_threads=host_threads,
                                  reducer=reducer, ownership=self.ownership)
        self.stopped = StoppedStep(self.grads)  # a step stopped after part of its in-backward updates
        nv = self.store.nvme  # masters on disk: the H2D staging ring of their wire images
        ring = StagingRing(lambda n: nv.alloc_staging(n, "the H2D staging ring"), nv.free_staging,
                           self.transport.when_done) if self.store.masters_on_disk else None
        self.fetcher = WeightFetcher(self.blocks, self.store, self.transport, self.acct, self.device, pin_memory=pin,
                                     ring=ring, shared_images=node and node.wire_images, ownership=self.ownership)
        nvme_on = self.store.nvme is not None
        self.prefetcher = Prefetcher(self.blocks, self.store, self.transport, self.acct, lambda blk: self.fetcher.fetch(blk),
                                     config.lookahead, read_ahead_bytes=self.budget.limit - min_window if nvme_on else None,
                                     read_ahead_depth=nvme.read_ahead if nvme_on else 0, host_threads=host_threads,
                                     groups=groups)
        self.optimizer: HostAdamW | None = None
        # RAM tier: the host optimizer's own worker threads, sharing host_threads (docs/architecture.md, "Threads,
        # streams and locks")
        self._update_pool = start_worker("megatrain-update", max(1, host_threads // config.update_threads),
                                         self.device, workers=config.update_threads) if self.store.nvme is None \
            else None
        self.order: list[int] = []  # block indices in forward call order (learned on the first forward)
        self._heads = output_embedding_blocks(root, self.blocks)  # the last block before the order is known
        self._seq: list[int] = []  # the fetch sequence the prefetcher follows now
        self._cursor, self._phase = 0, "idle"
        self._bwd_seq: list[int] = []  # backward fetch sequence of the last training step
        self.runner = BlockRunner(self.store.slabs, self.acct, self.acquire)
        self.boundary = Boundary(device=self.device, store=self.store, acct=self.acct, grads=self.grads,
                                 transport=self.transport, runner=self.runner, enter_backward=self._enter_backward,
                                 recompute_every=config.recompute_every, offload_activations=config.offload_activations,
                                 policy=RecomputePolicy(config.recompute, self.device, config.activation_memory_limit),
                                 castable=lambda r: self.fetcher.autocast_castable[r.slab][r.index])
        self._proxies = ForwardPatches()  # each block's forward -> its streaming proxy
        self.update_in_backward = False  # per micro-batch (set_update_in_backward; optimizer_in_backward, grads.py)
        self._plan_due = False
        self._warned_cache = False
        self._io_last: dict[str, float] = {}  # the NVMe meter at the last step's end (end_step logs the difference)
        self.installed = False

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        """Replace each block's ``forward`` by its streaming proxy and move buffers to the device (HF gradient
        checkpointing off, with a warning, until :meth:`uninstall`)."""
        if self.installed:
            return
        self.params.dematerialize()
        self.hf_settings = HFRunSettings(self.root)
        for name in self.hf_settings.names:
            log.warning("megatrain: %s has gradient checkpointing enabled; it is off during the run (the strategy's "
                        "recompute option decides what each block keeps: 'block', the default, recomputes each "
                        "block as HF checkpointing does) and back on after it.", name)
        for blk in self.blocks:
            orig = blk.module.forward
            proxy = self._make_direct_proxy(blk, orig) if blk.direct else self._make_proxy(blk, orig)
            proxy.__wrapped__ = orig  # type: ignore[attr-defined]
            self._proxies.patch(blk.module, proxy)
        self.head_loss.install(self.blocks)
        self.mlp.install(self.blocks)
        self.buffers_to(self.device)
        self.installed = True

    def uninstall(self) -> None:
        """Restore the original ``forward`` of every block and move buffers back to the CPU."""
        if not self.installed:
            return
        self.flush()
        self.mlp.uninstall()
        self.head_loss.uninstall()
        self._proxies.restore()
        self.hf_settings.restore()
        self._drop_prefetched()
        self.buffers_to(torch.device("cpu"))
        self.installed = False

    def buffers_to(self, device: torch.device) -> None:
        """Move module buffers (rotary ``inv_freq``, masks; never parameters) to ``device``."""
        for m in self.root.modules():
            m._buffers.update({k: b.to(device) for k, b in m._buffers.items() if b is not None and b.device != device})

    def set_update_in_backward(self, on: bool) -> None:
        """Whether the next backward applies each slab's update as its gradients complete (per micro-batch)."""
        self.update_in_backward = on

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, overlap: bool = True) -> HostAdamW:
        """Take over ``optimizer`` on the host (:func:`~..optim.host_generic.make_host_optimizer`).

        Raises:
            UnsupportedOptimizerError: an optimizer or tier the host cannot step.
        """
        if self.optimizer is not None and self.optimizer.optimizer is optimizer:
            self.optimizer.set_overlap(overlap)
            return self.optimizer
        self.flush()
        self.optimizer = make_host_optimizer(self.store, optimizer, overlap=overlap, transport=self.transport,
                                             ownership=self.ownership, worker=self._update_pool)
        for part in (self.params, self.grads, self.fetcher, self.prefetcher):
            part.optimizer = self.optimizer
        return self.optimizer

    # ------------------------------------------------------------------ direct parameter access
    def read_param(self, p: torch.Tensor) -> torch.Tensor:
        """The current fp32 value of ``p`` (:meth:`ParamAccess.read`; ``KeyError`` if not streamed)."""
        return self.params.read(p)

    def write_param(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``p``'s fp32 master (see :meth:`ParamAccess.write`)."""
        self.params.write(p, value)

    @property
    def host_memory_limit(self) -> int | None:
        """Bytes the NVMe tier's host window may use (``None`` without the NVMe tier)."""
        return self.budget.limit if self.budget is not None else None

    @property
    def stats(self) -> StepStats:
        return self.acct.stats  # the current optimizer step's statistics

    @property
    def history(self) -> list[dict[str, float]]:
        """Every finished step's statistics (what :meth:`end_step` returned), oldest first."""
        return self.acct.history

    def close(self) -> None:
        """Uninstall, stop the worker threads and close the NVMe store (its files are removed unless kept)."""
        self.uninstall()
        self.prefetcher.close()
        self.grads.close()
        if self._update_pool is not None:
            self._update_pool.shutdown(wait=True)
        self.store.close()
        self.closed = True

    closed = False
    # ------------------------------------------------------------------ proxy
    def _make_proxy(self, blk: Block, orig: Callable[..., Any]) -> Callable[..., Any]:
        # a block with nothing to differentiate (a frozen embedding) runs like evaluation: no autograd boundary,
        # no backward fetch (decided at each call: unfreezing in fit)
        layer = layer_index(blk.module)

        def proxy(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and (any(r.param.requires_grad for r in blk.params) or any_requires_grad(args, kwargs)):
                args, kwargs, forward, stripped = training_call(args, kwargs, orig, blk.index, layer)
                if stripped and not self._warned_cache:
                    self._warned_cache = True
                    log.info("megatrain: KV cache disabled for training forwards (recompute would corrupt gradients).")
                return self.call_block(blk, forward, args, kwargs)
            with self.runner.weights(blk, training=torch.is_grad_enabled()) as bufs:
                with self.runner.bind(blk, bufs, None):
                    return orig(*args, **kwargs)

        return proxy

    def call_block(self, blk: Block, forward: Callable[..., Any], args: tuple, kwargs: dict,
                   keep: bool | None = None) -> Any:
        """Run ``forward(*args, **kwargs)`` as a grad-mode call of ``blk`` (:meth:`Boundary.call`); ``keep``: keep
        its graph (default: the last block of the forward order, or in the first forward the output embedding)."""
        if keep is None:
            keep = blk.index == self.order[-1] if blk.index in self.order else blk.index in self._heads
        return self.boundary.call(blk, forward, args, kwargs, keep=keep)

    def _make_direct_proxy(self, blk: Block, orig: Callable[..., Any]) -> Callable[..., Any]:
        """Proxy of a container with a direct block: its own parameters are bound for its whole call, under grad
        mode as autograd-tracked views (``Boundary.bound_params``). Their bytes leave the accounting when its forward
        returns although the graph may keep the views until backward (small; the NVMe minimum window counts them)."""

        def proxy(*args: Any, **kwargs: Any) -> Any:
            grad = torch.is_grad_enabled()
            refs = trainable_refs(blk) if grad else []
            with self.runner.weights(blk, training=grad, timed=False) as bufs:
                leaves = self.boundary.bound_params(blk, refs, bufs) if refs else None
                with self.runner.bind(blk, bufs, leaves):
                    return orig(*args, **kwargs)

        return proxy

    # ------------------------------------------------------------------ weights
    def _locate(self, blk: Block, backward: bool, training: bool) -> int | None:
        """Advance the prefetch cursor to this fetch; returns its position in ``self._seq``."""
        if not backward and blk.index not in self.order:
            self.order.append(blk.index)
        if backward:
            self._enter_backward()
        elif self._phase != "forward" or (self.order and blk.index == self.order[0]):
            self._phase = "forward"
            self._seq = self.order + self._bwd_seq if training else list(self.order)
            self._cursor = 0
            self._plan_due = True  # a new forward: plan its backward's updates
            if self.optimizer is not None:  # the pending updates run on the update worker, in fetch order
                self.optimizer.start_updates(si for bi in self.order for si in self.blocks[bi].slabs)
        seq = self._seq
        for start in (self._cursor, 0):
            for p in range(start, len(seq)):
                if seq[p] == blk.index:
                    self._cursor = p + 1
                    return p
        return None

    def _enter_backward(self) -> None:
        """First fetch (or kept graph) of a backward: plan its updates and its prefetch sequence."""
        if self._phase == "backward":
            return
        self._phase = "backward"
        self.grads.new_backward()
        if self._plan_due:
            # with update_in_backward: GradientSink.plan; not when this forward shares its step with an earlier one
            # whose backward has not run (its gradients would arrive after the update): the deferred schedule runs
            self._plan_due = False
            eager = self.update_in_backward and self.optimizer is not None and not self.boundary.fwd.shares_step
            self.grads.plan(self.boundary.plan_refs() if eager else [])
        self._seq, self._cursor = self.boundary.end_forward(), 0
        seq = self._seq  # the next forward's guess: from the 2nd forward on the last block keeps its graph
        self._bwd_seq = seq[1:] if seq[:1] == self.order[-1:] else seq

    def acquire(self, blk: Block, backward: bool, training: bool = False) -> dict[int, torch.Tensor]:
        """The block's slabs on the device (:meth:`Prefetcher.get`: slab index -> compute-dtype ``[slab numel]``).
        ``backward``: a fetch while autograd runs backward (recompute included); ``training``: a forward that a
        backward will follow (the schedule continues into it)."""
        pos = self._locate(blk, backward, training)
        return self.prefetcher.get(blk, self._seq, pos, backward=self._phase == "backward",
                                   updates_in_backward=bool(self.grads.sends_left),
                                   held=self.boundary.held_numel())  # kept last block

    def configure_precision(self, wire: torch.dtype, param: torch.dtype, grad_wire: torch.dtype) -> None:
        """Set the dtypes of the H2D weight copies and bound parameters (:meth:`WeightFetcher.configure`) and of
        gradients on the D2H link."""
        f = self.fetcher
        if (wire, param, grad_wire) != (f.wire_dtype, f.param_dtype, self.grads.wire_dtype):
            self._drop_prefetched()
        f.configure(wire, param)
        self.grads.configure(grad_wire, param)

    @property
    def wire_layouts(self) -> list:
        """Per slab, how its weights travel host -> device (:class:`~megatrain_lightning.engine.wire.WireLayout`)."""
        return self.fetcher.wire_layouts

    @property
    def autocast_castable(self) -> list[list[bool]]:
        """Per slab entry: autocast casts the parameter at every use (it travels 16-bit in mixed modes)."""
        return self.fetcher.autocast_castable

    def _drop_prefetched(self) -> None:
        """Wait for and discard prefetched copies (they predate an optimizer update)."""
        self.prefetcher.drop()
        self._phase = "idle"

    # ------------------------------------------------------------------ gradients
    def attach_grads(self) -> None:
        """:meth:`GradientSink.attach`; with a node-shared store, once every local rank's adds are in."""
        if self.ownership is not None:
            self.grads.wait()
            self.ownership.sync()
        self.grads.attach()

    # ------------------------------------------------------------------ optimizer
    def step(self) -> None:
        """Schedule the host AdamW update for the gradients accumulated so far.

        Raises:
            RuntimeError: no optimizer attached (``attach_optimizer`` was not called).
        """
        if self.optimizer is None:
            raise RuntimeError("megatrain: optimizer step requested but no optimizer is attached.")
        self.grads.wait()
        self._drop_prefetched()  # prefetched copies predate this update
        self.optimizer.step()
        self.grads.detach()

    def skip_step(self) -> None:
        """Drop the accumulated gradients without any update (a skipped fp16 step)."""
        self.grads.wait()
        self.grads.detach()
        if self.optimizer is not None:
            self.optimizer.discard_grads()

    def flush(self) -> None:
        """Apply all pending optimizer updates (call before reading parameters directly)."""
        self.grads.wait()
        if self.optimizer is not None and self.optimizer.has_pending():
            self._drop_prefetched()
            self.optimizer.flush()

    def weights_written(self) -> None:
        """Parameters were written through ``param.data`` (no version counter shows it, so the wire images are
        re-encoded), or replaced by ``param.data = tensor`` (taken into the store after the pending updates)."""
        self.flush()
        self._drop_prefetched()
        self.fetcher.forget_images()
        self.params.adopt(self.params.replaced())

    def adopt_replaced(self) -> list[str]:
        """:meth:`weights_written` if a parameter's ``.data`` was replaced; returns their names (cheap when none:
        one pointer comparison per parameter)."""
        found = self.params.replaced()
        if found:
            self.weights_written()
        return [self.store.slabs[si].entries[i].ref.fqn for si, i in found]

    def start_steps(self) -> None:
        """Open the first step's accounting window at the start of training: what setup, a sanity check or an
        evaluation before ``fit`` did is not counted in the first step's ``megatrain/*`` metrics."""
        self.acct.new_step()
        if self.store.nvme is not None:
            self._io_last = self.store.nvme.meter.snapshot()

    def end_step(self) -> dict[str, float]:
        """Close the accounting window of one optimizer step; returns the logged metrics."""
        self.boundary.close_kept()  # the step's backward is over (or was skipped)
        if self.optimizer is not None:
            self.acct.set(optimizer_s=self.optimizer.take_seconds())
        peak = self.transport.peak_bytes()
        if peak is not None:
            self.acct.set(peak_device_bytes=peak)
            self.transport.reset_peak()
        out = self.stats.as_dict()
        if self.store.nvme is not None:
            io = self.store.nvme.meter.snapshot()
            out.update({"megatrain/" + k: v - self._io_last.get(k, 0) for k, v in io.items()})
            out["megatrain/host_budget_peak_bytes"] = self.budget.peak  # type: ignore[union-attr]
            self._io_last = io
        self.history.append(out)
        self.acct.new_step()
        if self.device.type == "cpu":
            # glibc keeps freed activations resident, fragmented: returned now, each step starts from the same
            # resident set (docs/guide/planner.md, "How close the plan is")
            heap.trim()
        return out
