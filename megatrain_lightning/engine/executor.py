"""The streaming engine: per-block proxies, double-buffered prefetch, recompute backward.

How a training step runs (DESIGN.md section 3):

1. The model's own ``forward`` runs. Each block's ``forward`` has been replaced by
   a proxy (an instance attribute, so module names, hooks and ``state_dict`` are
   unchanged). Under grad mode the proxy calls :class:`_BlockFunction`: it takes
   the block's weights from the prefetch queue, binds them into the block module
   (its ``_parameters`` point at views of the device buffer for the duration of
   the call), runs the original ``forward`` without autograd, saves only the
   block's tensor inputs and the RNG state, and frees the weights.
2. While block i computes, an H2D worker thread has already applied block i+1's
   pending optimizer update on the host and copied its slab to the device
   (``lookahead`` blocks ahead).
3. ``loss.backward()`` reaches each block's ``backward`` in reverse order: the
   block's weights come back (prefetched in reverse order), its forward is
   recomputed with the saved inputs and replayed RNG/autocast state, a local
   ``torch.autograd.grad`` gives input and parameter gradients, and the parameter
   gradients go to a D2H worker thread that adds them into the fp32 host
   accumulators. The block's device memory is released.
4. ``optimizer.step()`` (via the strategy) waits for the gradients, runs
   Lightning's hooks and clipping on ``param.grad`` views of the accumulators,
   then records one pending AdamW update per slab (see
   :mod:`megatrain_lightning.optim.host_adamw`).

The training forward never writes a KV cache: each run of a block (forward and
recompute) gets a fresh copy of an empty dynamic cache passed to it under grad mode
(what plain PyTorch computes with it, see :mod:`.kv_cache`); any other cache object
is replaced by ``None`` and ``use_cache`` by ``False``, because the recompute would
attend over keys/values appended by the first pass and the gradients would silently
be wrong (DESIGN.md section 3, "Pitfall").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..optim.host_adamw import HostAdamW
from ..store import heap
from ..store.budget import HostBudget
from ..store.host import HostStore, build_store, placeholder, slab_layout
from ..store.nvme import NVMeConfig, NVMeStore, preflight_nvme
from .blocks import Block, check_floating, discover_blocks, find_hf_models
from .kv_cache import training_call
from .shared_grads import SharedGradSums
from .transport import make_transport
from .wire import WireLayout, castable_flags

log = logging.getLogger(__name__)

def _weight_sources(root: nn.Module) -> dict[int, Callable[[], torch.Tensor]]:
    """Loaders for meta-device parameters of Hugging Face models built by ``meta_model_from_pretrained``."""
    from ..checkpoint.hf_io import source_key

    out: dict[int, Callable[[], torch.Tensor]] = {}
    for m in find_hf_models(root):
        src = getattr(m, "_megatrain_source", None)
        if src is None:
            continue
        for name, p in m.named_parameters(remove_duplicate=False):
            if p.is_meta and id(p) not in out:
                key = source_key(m, name)
                out[id(p)] = lambda src=src, key=key: src.get(key)
    return out


def _any_requires_grad(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten((args, kwargs))[0])


@dataclass
class StepStats:
    """Per-optimizer-step accounting (reset after each step).

    Attributes:
        h2d_bytes: bytes copied host -> device (weights and restored activations).
        d2h_bytes: bytes copied device -> host (gradients and offloaded activations).
        wait_s: seconds the compute thread waited for weights or gradients (stall time).
        optimizer_s: seconds spent in AdamW updates (mostly on the H2D worker, overlapped).
        compute_s: seconds the compute thread spent inside block forward/backward calls, waits excluded.
        peak_device_bytes: CUDA: ``torch.cuda.max_memory_allocated`` since the previous step (the
            engine resets CUDA's peak statistics at every step: read them in ``on_before_optimizer_step``
            if you measure over several steps); CPU: peak bytes of block weight/gradient buffers
            the engine had alive at once.
        blocks_fetched: number of block fetches (forward + backward + evaluation).
        prefetch_misses: fetches that were not prefetched (the compute thread had to start the copy).
        cast_s: seconds the H2D worker spent casting fp32 masters to their wire images (mixed and
            ``bf16-true`` precision).
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    wait_s: float = 0.0
    optimizer_s: float = 0.0
    compute_s: float = 0.0
    peak_device_bytes: int = 0
    blocks_fetched: int = 0
    prefetch_misses: int = 0
    cast_s: float = 0.0

    def as_dict(self, prefix: str = "megatrain/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in self.__dict__.items()}


@dataclass
class _Call:
    """Everything one block call needs to be recomputed in backward.

    ``keep``: the last block of a training forward, run with autograd and its graph kept in
    ``graph`` (no recompute). ``freed``: its saved inputs were released by a backward that did not
    retain the graph; a further backward through it is an error, as in PyTorch."""

    engine: "StreamingEngine"
    block: Block
    forward: Callable[..., Any]
    flat: list[Any]
    spec: Any
    tensor_pos: list[int]
    fwd: "_Forward"
    refs: list = field(default_factory=list)
    keep: bool = False
    rng_cpu: torch.Tensor | None = None
    rng_dev: torch.Tensor | None = None
    autocast: tuple | None = None
    out_spec: Any = None
    out_flat: list[Any] = field(default_factory=list)
    out_pos: list[int] = field(default_factory=list)
    pos: int = -1
    saved: list[torch.Tensor | None] = field(default_factory=list)
    links: dict[int, int] = field(default_factory=dict)
    offloaded: dict[int, torch.Tensor] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    graph: "_KeptGraph | None" = None
    freed: bool = False


@dataclass(eq=False)
class _Forward:
    """The grad-mode block calls of one training forward, shared by their backward.

    Calls are held weakly (each call is kept alive by its autograd node), so a forward whose graph
    was dropped without a backward frees its saved inputs at once. Several forwards may be alive
    together (two forwards, then one backward of both losses)."""

    calls: list["weakref.ref[_Call]"] = field(default_factory=list)
    kept: list["weakref.ref[_Call]"] = field(default_factory=list)
    recomputed: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # call pos -> outputs recomputed in backward
    last_outs: tuple[int, list] | None = None  # (pos, weak refs to the outputs) of the latest call
    backward_started: bool = False
    shares_step: bool = False  # started while an earlier forward's backward had not run
    first_block: int = -1  # block index of the first call (or container)
    direct: list[list] = field(default_factory=list)  # trainable refs of each container call (_BoundParams)

    def live_calls(self) -> list[_Call]:
        """The calls in order, while their graph is alive (all of them at the start of a backward)."""
        return [c for c in (r() for r in self.calls) if c is not None]

    def call(self, pos: int) -> _Call:
        c = self.calls[pos]()
        if c is None:
            raise RuntimeError("megatrain: the graph of this forward was freed before its backward.")
        return c

    def live(self) -> list[_Call]:
        return [c for c in (r() for r in self.calls + self.kept) if c is not None]


class _KeptGraph:
    """The last block's autograd graph, kept from its forward to its backward: the device buffers
    and gradient leaves it computed with, its detached inputs and its outputs. ``close`` (idempotent)
    drops them and returns their bytes to the accounting: after a backward that does not retain the
    graph, when the call is garbage-collected (its graph dropped unused), or at the end of the step."""

    def __init__(self, engine: "StreamingEngine", bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor],
                 inputs: list, outs: list[torch.Tensor]):
        self.engine, self.bufs, self.leaves, self.inputs, self.outs = engine, bufs, leaves, inputs, outs
        self.open = True

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        eng = self.engine
        eng._kept_open.discard(self)
        self.leaves, self.inputs, self.outs = {}, [], []
        eng._release(self.bufs)


def _autocast_state(device_type: str) -> tuple:
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


def _leaf_gets_grad(leaf: torch.Tensor) -> bool:
    """Whether the running backward computes a gradient for ``leaf``: ``loss.backward()`` does for
    every leaf, ``backward(inputs=...)`` and ``torch.autograd.grad(..., inputs)`` only for the listed
    ones. The engine's marker leaf (an input of every block call, never listed by users) therefore
    tells an accumulating ``backward()`` apart from the other two."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(leaf).node)
    except RuntimeError:  # torch answers this for a leaf that autograd.grad() captures: it is listed
        return True


def _keeps_graph() -> bool:
    """``retain_graph`` of the running backward (what torch's own AOT autograd reads)."""
    fn = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(fn()) if fn is not None else False


class _BoundParams(torch.autograd.Function):
    """A container's own parameters on the device for the span of its ``forward`` (a direct block:
    they are used outside any block call, so there is nothing to recompute and ordinary autograd
    tracks them).

    Inputs: the engine, the parameters' references, their device views (the fetched buffer), the
    engine's marker leaf, then the host parameters. Outputs: the device views, as tensors autograd
    tracks. Backward: ``loss.backward()`` sends their gradients to the host accumulators;
    ``torch.autograd.grad`` / ``backward(inputs=...)`` returns them for the parameters listed."""

    @staticmethod
    def forward(ctx, engine: "StreamingEngine", refs: list, views: list, dummy: torch.Tensor,
                *params: torch.Tensor):  # type: ignore[override]
        ctx.engine, ctx.refs = engine, refs
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        eng, refs = ctx.engine, ctx.refs
        if torch.is_grad_enabled():
            raise RuntimeError(
                "megatrain: backward(create_graph=True) (double backward) reached a container's own parameters; "
                "streamed models are differentiated once."
            )
        none = (None, None, None, None)
        if _leaf_gets_grad(eng._dummy):
            eng._send_grads(refs, list(grads))
            return none + (None,) * len(refs)
        return none + tuple(g.to(r.param.device) if g is not None and _leaf_gets_grad(r.param) else None
                            for r, g in zip(refs, grads))


class _BlockFunction(torch.autograd.Function):
    """Autograd boundary of one block: forward without a graph, backward by recompute (the kept
    last block: backward through its kept graph).

    Inputs: the call record, the engine's marker leaf, the call's tensor arguments, then the block's
    trainable parameters (host ``nn.Parameter`` objects: only so that ``torch.autograd.grad`` or
    ``backward(inputs=[param])`` on them gets their gradient; an ordinary ``backward()`` sends
    parameter gradients to the host accumulators instead and returns ``None`` for them)."""

    @staticmethod
    def forward(ctx, call: _Call, dummy: torch.Tensor, *inputs: torch.Tensor):  # type: ignore[override]
        eng = call.engine
        dev = eng.device
        tensors = inputs[: len(call.tensor_pos)]
        call.rng_cpu = torch.get_rng_state()
        if dev.type == "cuda":
            call.rng_dev = torch.cuda.get_rng_state(dev)
        call.autocast = _autocast_state(dev.type)
        if call.keep:
            out = eng._run_kept(call, tensors)
        else:
            out = eng._run_block(call, tensors, leaves=None, backward=False)
        out_flat, call.out_spec = tree_flatten(out)
        call.out_pos = [i for i, x in enumerate(out_flat) if isinstance(x, torch.Tensor)]
        call.out_flat = [None if isinstance(x, torch.Tensor) else x for x in out_flat]
        outs = tuple(out_flat[i] for i in call.out_pos)
        ctx.call = call
        if not call.keep:
            eng._save_inputs(call, tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):  # type: ignore[override]
        call: _Call = ctx.call
        eng = call.engine
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"megatrain: backward(create_graph=True) (double backward, e.g. a gradient penalty) reached "
                f"streamed block {call.block.name}; streamed blocks are differentiated once. Compute the "
                "penalty with strategy='auto' or without create_graph."
            )
        if call.freed:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors after "
                "they have already been freed). Saved intermediate values of the graph are freed when you call "
                ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
                f"graph a second time (megatrain: streamed block {call.block.name})."
            )
        n = len(call.tensor_pos)
        needs = ctx.needs_input_grad[2 : 2 + n]
        kind = "accumulate" if _leaf_gets_grad(eng._dummy) else "select"
        keep_graph = _keeps_graph()
        call.fwd.backward_started = True
        grad_inputs, grad_params = eng._backward_call(call, needs, grad_outs, kind, keep_graph)
        return (None, None, *grad_inputs, *grad_params)


class StreamingEngine:
    """Streams a model's blocks through the compute device and owns their host state.

    Args:
        root: the module to stream (the ``LightningModule``).
        device: compute device (``cpu`` or ``cuda:N``).
        lookahead: blocks prefetched ahead of the one computing (1 = double buffering).
        checkpoint_every: K, blocks per recompute segment. Only the input of every K-th block
            call is kept; the inputs of the others are recomputed (without autograd) from it when
            backward reaches the segment, so saved activations shrink K-fold for up to one extra
            forward of K-1 blocks per segment.
        offload_activations: keep the saved block inputs in host memory instead of on the
            device (the device footprint is then flat in depth; costs one D2H and one H2D of
            the hidden states per block).
        block_classes / block_names: override block discovery, see
            :func:`~megatrain_lightning.engine.blocks.discover_blocks`.
        pin_memory: page-lock host masters (default: ``True`` on CUDA).
        cpu_zero_copy: on CPU, bind blocks to the fp32 master slabs instead of copying them (only when
            the compute dtype is fp32; see MegaTrainStrategy). Off when masters are on disk.
        nvme: the NVMe tier's settings (:class:`~megatrain_lightning.store.nvme.NVMeConfig`), or
            ``None`` for everything in host RAM. Preflight (disk space, writable path, budget,
            ``ulimit -l``) runs before anything is allocated.

    Raises:
        BlockDiscoveryError: no blocks found (see ``discover_blocks``).
        ValueError: ``lookahead < 0`` or an unsupported device type.
    """

    def __init__(
        self,
        root: nn.Module,
        device: torch.device,
        *,
        lookahead: int = 1,
        checkpoint_every: int = 1,
        offload_activations: bool = False,
        block_classes: Sequence[str | type] | None = None,
        block_names: Sequence[str] | None = None,
        pin_memory: bool | None = None,
        cpu_zero_copy: bool = True,
        nvme: NVMeConfig | None = None,
    ):
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 (blocks prefetched ahead), got {lookahead}.")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 (blocks per recompute segment), got {checkpoint_every}.")
        self.checkpoint_every = checkpoint_every
        self.root = root
        self.device = torch.device(device)
        self.lookahead = lookahead
        self.offload_activations = offload_activations
        self.blocks: list[Block] = discover_blocks(root, block_classes, block_names)
        check_floating(self.blocks)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        self.nvme_config = nvme
        self.budget: HostBudget | None = None
        factory: Callable[[list[tuple[int, int]]], NVMeStore] | None = None
        if nvme is not None and nvme.kinds:
            layout = [(n, t) for _, n, t in slab_layout(self.blocks)]
            self._min_window = nvme.min_window(layout, self.device.type, lookahead)
            if self.device.type == "cpu":
                # direct blocks (a container's own parameters) keep their compute buffer for the whole
                # forward and backward, next to the blocks in flight; their gradients come at the end
                self._min_window += sum(8 * n for (n, _), b in zip(layout, self.blocks) if b.direct)
            self.nvme_preflight = preflight_nvme(nvme.path, layout, nvme.host_memory_limit, self._min_window,
                                                 pinned_bytes=nvme.pinned_bytes(layout) if pin_memory else 0)
            self.budget = HostBudget(nvme.host_memory_limit)
            heap.bound_heap()  # freed buffers leave the process (the budget counts only live ones)

            factory = lambda layout: NVMeStore(  # noqa: E731 - called by build_store with the slab layout
                nvme.path, layout, self.budget, io_threads=nvme.io_threads, io_block_size=nvme.io_block_size, read_ahead=nvme.read_ahead,
                direct_io=nvme.direct_io, pin_memory=pin_memory, keep_files=nvme.keep_files)
            if "master" in nvme.kinds:
                cpu_zero_copy = False  # compute buffers are copies, counted in the budget
        self.store: HostStore = build_store(self.blocks, pin_memory=pin_memory and not (nvme and "master" in nvme.kinds),
                                            sources=_weight_sources(root), nvme_factory=factory,
                                            nvme_kinds=nvme.kinds if nvme is not None else ())
        if self.budget is not None:
            heap.trim()  # what building the store (random init, safetensors reads) left in the heap
        self.trainable = [p.requires_grad for p in root.parameters()]
        self.transport = make_transport(self.device, self.store.max_slab_numel(trainable=True), cpu_zero_copy)
        # on CPU the compute buffers are host memory: they count in host_memory_limit
        self._budget_device = self.budget is not None and self.device.type == "cpu"
        self.wire_dtype = torch.float32  # dtype of (castable, under mixed precision) weights on the H2D link
        self.param_dtype = torch.float32  # dtype the block's parameters have while it computes
        self.grad_wire_dtype = torch.float32  # dtype of gradients on the D2H link
        # per slab entry: autocast casts the parameter at every use (owner is a Linear/Conv/Conv1D)
        self.autocast_castable: list[list[bool]] = self._castable()
        self.wire_layouts: list[WireLayout] = [WireLayout.uniform(s.numel, torch.float32) for s in self.store.slabs]
        self.optimizer: HostAdamW | None = None
        # gradients of a parameter read by several blocks are summed per backward, as autograd does
        self._shared_grads = SharedGradSums.for_blocks(self.blocks, enabled="acc" not in self.store.nvme_kinds)
        self._h2d = ThreadPoolExecutor(1, thread_name_prefix="megatrain-h2d")
        self._d2h = ThreadPoolExecutor(1, thread_name_prefix="megatrain-d2h")
        # budgeted CPU runs: at most 2 gradient batches queued for the D2H worker. Without this bound
        # the queued gradients could take the whole budget while the worker itself waits for budget
        # to accumulate (or update) them: a deadlock.
        self._d2h_slots = threading.BoundedSemaphore(2) if self._budget_device else None
        self._prefetched: dict[int, Future] = {}
        self._d2h_futures: list[Future] = []
        self.order: list[int] = []  # block indices in forward call order (learned on the first forward)
        self._seq: list[int] = []  # the fetch sequence the prefetcher follows now
        self._cursor = 0
        self._phase = "idle"
        self._bwd_seq: list[int] = []  # backward fetch sequence of the last training step
        self._fwd = _Forward()  # grad-mode block calls of the current forward, in order
        self._kept_open: set[_KeptGraph] = set()  # last-block graphs whose backward has not run
        self._dummy = torch.empty(0, device=self.device, requires_grad=True)
        self._saved_forwards: dict[int, tuple[bool, Any]] = {}
        self._live = 0
        self._live_lock = threading.Lock()
        self.stats = StepStats()
        self.history: list[dict[str, float]] = []
        # optimizer step in backward (set per micro-batch by the strategy): each slab's AdamW update
        # runs on the D2H worker as soon as its last gradient of the step is accumulated
        self.update_in_backward = False
        self._sends_left: dict[int, int] = {}
        self._plan_due = False
        self._eager_hyper = None
        self._warned_cache = False
        self.installed = False

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        """Replace each block's ``forward`` by the streaming proxy and move buffers to the device.

        Hugging Face gradient checkpointing, if enabled, is disabled with a warning (the engine
        already recomputes every block).
        """
        if self.installed:
            return
        self._dematerialize()
        for m in find_hf_models(self.root):
            flag = "is_activation_checkpointing" if hasattr(type(m), "is_activation_checkpointing") else "is_gradient_checkpointing"
            if getattr(m, flag, False):
                log.warning(
                    "megatrain: %s had gradient checkpointing enabled; disabling it (the strategy already "
                    "recomputes each block in backward).",
                    type(m).__name__,
                )
                if hasattr(m, "activation_checkpointing_disable"):
                    m.activation_checkpointing_disable()
                else:
                    m.gradient_checkpointing_disable()
        for blk in self.blocks:
            mod = blk.module
            had = "forward" in mod.__dict__
            orig = mod.forward
            self._saved_forwards[blk.index] = (had, mod.__dict__.get("forward"))
            mod.forward = self._make_direct_proxy(blk, orig) if blk.direct else self._make_proxy(blk, orig)
        self.buffers_to(self.device)
        self.installed = True

    def uninstall(self) -> None:
        """Restore the original ``forward`` of every block and move buffers back to the CPU."""
        if not self.installed:
            return
        self.flush()
        for blk in self.blocks:
            had, fwd = self._saved_forwards.pop(blk.index)
            if had:
                blk.module.forward = fwd
            else:
                del blk.module.forward
        self._drop_prefetched()
        self.buffers_to(torch.device("cpu"))
        self.installed = False

    def buffers_to(self, device: torch.device) -> None:
        """Move module buffers (rotary ``inv_freq``, masks; never parameters) to ``device``."""
        for m in self.root.modules():
            for k, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[k] = b.to(device)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, overlap: bool = True) -> HostAdamW:
        """Take over ``optimizer`` (AdamW/Adam); see :class:`HostAdamW`."""
        if self.optimizer is not None and self.optimizer.optimizer is optimizer:
            self.optimizer.overlap = overlap
            return self.optimizer
        self.flush()
        self.optimizer = HostAdamW(self.store, optimizer, overlap=overlap)
        self.optimizer.transport = self.transport
        return self.optimizer

    # ------------------------------------------------------------------ direct parameter access
    def _param_where(self, p: torch.Tensor) -> tuple[int, int]:
        if not hasattr(self, "_where") or id(p) not in self._where:
            self._where = {id(e.ref.param): (s.index, i) for s in self.store.slabs for i, e in enumerate(s.entries)}
        return self._where[id(p)]

    def read_param(self, p: torch.Tensor) -> torch.Tensor:
        """The current fp32 value of parameter ``p`` (pending updates applied): a view of the RAM
        slab, or a copy read through the NVMe window when masters are on disk.

        Raises:
            KeyError: ``p`` is not a parameter of the streamed module.
        """
        si, ei = self._param_where(p)
        if self.optimizer is not None:
            self.optimizer.apply_pending(si)
        slab = self.store.slabs[si]
        with self.store.hold(si, ["master"]) as t:
            v = slab.view(t["master"], ei)
            return v.clone() if self.store.masters_on_disk else v

    def write_param(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Set parameter ``p``'s master weights to ``value`` (same shape, any float dtype), in either tier.

        Raises:
            ValueError: shapes differ.
        """
        si, ei = self._param_where(p)
        slab = self.store.slabs[si]
        if tuple(value.shape) != tuple(slab.entries[ei].shape):
            raise ValueError(f"{slab.entries[ei].ref.fqn}: value has shape {tuple(value.shape)}, parameter {tuple(slab.entries[ei].shape)}.")
        if self.optimizer is not None:
            self.optimizer.pending.pop(si, None)
        with slab.lock, self.store.hold(si, ["master"], write=True) as t, torch.no_grad():
            slab.view(t["master"], ei).copy_(value)
            slab.updates += 1  # invalidates the bf16/fp16 shadow

    materialized = False

    def materialize(self) -> None:
        """Give every parameter a real fp32 tensor again (a copy read from the store) so the module
        works on its own; used when masters are on disk and a run is over. The next :meth:`install`
        writes them back (the user may have changed them) and restores the placeholders."""
        if not self.store.masters_on_disk or self.materialized:
            return
        self.store.nvme.drop_clean()  # the copies (4 B/param) replace the window, not add to it
        for slab in self.store.slabs:
            for i, e in enumerate(slab.entries):
                e.ref.param.data = self.read_param(e.ref.param).clone()
            self.store.nvme.discard(slab.index, "master")  # read through the window, not kept in it
        self.materialized = True

    def write_back_materialized(self) -> None:
        """Copy the materialized parameters (the user may have changed them after the run) into the
        store, which checkpoints read; a no-op unless :meth:`materialize` ran."""
        if not self.materialized:
            return
        for slab in self.store.slabs:
            for e in slab.entries:
                self.write_param(e.ref.param, e.ref.param.data)

    def _dematerialize(self) -> None:
        if not self.materialized:
            return
        self.write_back_materialized()
        for slab in self.store.slabs:
            for e in slab.entries:
                e.ref.param.data = placeholder(e.shape)
        self.materialized = False

    def close(self) -> None:
        """Uninstall, stop the worker threads and close the NVMe store (its files are removed unless kept)."""
        self.uninstall()
        self._h2d.shutdown(wait=True)
        self._d2h.shutdown(wait=True)
        self.store.close()
        self.closed = True

    closed = False

    # ------------------------------------------------------------------ proxy
    def _make_proxy(self, blk: Block, orig: Callable[..., Any]) -> Callable[..., Any]:
        # a block with no trainable parameter whose inputs need no gradient (a frozen embedding)
        # runs like evaluation: no autograd boundary, nothing saved, no backward fetch
        trainable = any(r.param.requires_grad for r in blk.params)

        def proxy(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and (trainable or _any_requires_grad(args, kwargs)):
                args, kwargs, forward, stripped = training_call(args, kwargs, orig)
                if stripped and not self._warned_cache:
                    self._warned_cache = True
                    log.info("megatrain: KV cache disabled for training forwards (recompute would corrupt gradients).")
                flat, spec = tree_flatten((args, kwargs))
                pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
                refs = self._trainable_refs(blk)
                fwd = self._forward_for(blk)
                keep = bool(fwd.calls) and bool(self.order) and blk.index == self.order[-1]
                call = _Call(self, blk, forward, [None if i in pos else x for i, x in enumerate(flat)], spec, pos,
                             fwd=fwd, refs=refs, keep=keep)
                outs = _BlockFunction.apply(call, self._dummy, *[flat[i] for i in pos], *[r.param for r in refs])
                call.fwd.last_outs = (call.pos, [weakref.ref(o) for o in outs])
                out_flat = list(call.out_flat)
                for i, o in zip(call.out_pos, outs):
                    out_flat[i] = o
                return tree_unflatten(out_flat, call.out_spec)
            bufs = self.acquire(blk, backward=False, training=torch.is_grad_enabled())
            t0 = time.perf_counter()
            try:
                with self._bind(blk, bufs, None):
                    return orig(*args, **kwargs)
            finally:
                self.stats.compute_s += time.perf_counter() - t0
                self._release(bufs)

        proxy.__wrapped__ = orig  # type: ignore[attr-defined]
        return proxy

    def _forward_for(self, blk: Block) -> _Forward:
        """The forward record a grad-mode call of ``blk`` belongs to: a new one when ``blk`` is the
        block the current forward started with (a new forward pass)."""
        fwd = self._fwd
        if (fwd.calls or fwd.direct) and blk.index == fwd.first_block:
            earlier_open = not fwd.backward_started and any(not c.freed for c in fwd.live())
            fwd = self._fwd = _Forward(shares_step=earlier_open)
        if not (fwd.calls or fwd.direct):
            fwd.first_block = blk.index
        return fwd

    def _make_direct_proxy(self, blk: Block, orig: Callable[..., Any]) -> Callable[..., Any]:
        """Proxy of a container whose own parameters form a direct block: its ``forward`` uses them
        outside any block call, so they are bound for the whole call (its child blocks stream inside
        it as usual). Under grad mode the trainable ones come from :class:`_BoundParams`, so autograd
        tracks them without recompute. Their buffer's bytes leave the accounting when the container's
        forward returns, although the graph may keep the views until backward (small: a container's
        own parameters; the NVMe minimum window counts them)."""

        def proxy(*args: Any, **kwargs: Any) -> Any:
            grad = torch.is_grad_enabled()
            refs = self._trainable_refs(blk) if grad else []
            fwd = self._forward_for(blk) if refs else None
            bufs = self.acquire(blk, backward=False, training=grad)
            try:
                leaves = None
                if refs:
                    views = []
                    for r in refs:
                        e = self.store.slabs[r.slab].entries[r.index]
                        views.append(bufs[r.slab][e.offset : e.offset + e.numel].view(e.shape))
                    outs = _BoundParams.apply(self, refs, views, self._dummy, *[r.param for r in refs])
                    leaves = {id(r.param): o for r, o in zip(refs, outs)}
                    fwd.direct.append(refs)  # type: ignore[union-attr]
                with self._bind(blk, bufs, leaves):
                    return orig(*args, **kwargs)
            finally:
                self._release(bufs)

        proxy.__wrapped__ = orig  # type: ignore[attr-defined]
        return proxy

    @staticmethod
    def _trainable_refs(blk: Block) -> list:
        """The block's trainable parameter references, one per parameter object, in block order."""
        seen: set[int] = set()
        refs = []
        for ref in blk.params:
            if ref.param.requires_grad and id(ref.param) not in seen:
                seen.add(id(ref.param))
                refs.append(ref)
        return refs

    def _grad_leaves(self, refs: Sequence, bufs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One autograd leaf per parameter of ``refs`` (a view of its device buffer), keyed by ``id(param)``."""
        leaves: dict[int, torch.Tensor] = {}
        for ref in refs:
            e = self.store.slabs[ref.slab].entries[ref.index]
            view = bufs[ref.slab][e.offset : e.offset + e.numel].view(e.shape)
            leaves[id(ref.param)] = view.detach().requires_grad_(True)
        return leaves

    def _run_kept(self, call: _Call, tensors: Sequence[torch.Tensor]) -> Any:
        """Run the last block of a training forward with autograd and keep its graph for its backward.

        Its backward comes first, right after the loss, so recomputing it would redo its forward
        (for an LM head: the B x T x V logits matmul) and fetch its weights again. Instead its
        weights stay on the device until its backward (``_KeptGraph``)."""
        blk = call.block
        bufs = self.acquire(blk, backward=False, training=True)
        leaves = self._grad_leaves(call.refs, bufs)
        inputs = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in tensors]
        flat = list(call.flat)
        for i, t in zip(call.tensor_pos, inputs):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, call.spec)
        t0 = time.perf_counter()
        try:
            with torch.enable_grad(), self._bind(blk, bufs, leaves):
                out = call.forward(*args, **kwargs)
        except BaseException:
            self._release(bufs)
            raise
        finally:
            self.stats.compute_s += time.perf_counter() - t0
        out_flat, spec = tree_flatten(out)
        outs = [x for x in out_flat if isinstance(x, torch.Tensor)]
        kept = _KeptGraph(self, bufs, leaves, inputs, outs)
        call.graph = kept
        self._kept_open.add(kept)
        weakref.finalize(call, kept.close)  # its graph dropped unused (training_step returned None)
        call.fwd.kept.append(weakref.ref(call))
        # the caller gets detached outputs: autograd connects them to this call's node
        return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in out_flat], spec)

    def _close_kept(self) -> None:
        """Release every kept last-block graph whose backward has not run (the step is over)."""
        for kept in list(self._kept_open):
            kept.close()

    @contextlib.contextmanager
    def _bind(self, blk: Block, bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor] | None):
        """Point the block's parameters at views of the device buffers (or at gradient leaves)."""
        saved = []
        try:
            for ref in blk.params:
                if leaves is not None and id(ref.param) in leaves:
                    t = leaves[id(ref.param)]
                else:
                    e = self.store.slabs[ref.slab].entries[ref.index]
                    t = bufs[ref.slab][e.offset : e.offset + e.numel].view(e.shape)
                saved.append((ref.owner, ref.attr, ref.owner._parameters[ref.attr]))
                ref.owner._parameters[ref.attr] = t
            yield
        finally:
            for owner, attr, p in reversed(saved):
                owner._parameters[attr] = p

    def _run_block(self, call: _Call, tensors: Sequence[torch.Tensor], leaves: dict[int, torch.Tensor] | None,
                   backward: bool):
        flat = list(call.flat)
        for i, t in zip(call.tensor_pos, tensors):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, call.spec)
        bufs = self.acquire(call.block, backward=backward, training=not backward)
        t0 = time.perf_counter()
        try:
            with self._bind(call.block, bufs, leaves):
                return call.forward(*args, **kwargs)
        finally:
            self.stats.compute_s += time.perf_counter() - t0
            self._release(bufs)

    def _backward_call(self, call: _Call, needs: Sequence[bool], grad_outs: Sequence[torch.Tensor | None],
                       kind: str, keep_graph: bool) -> tuple[list, list]:
        """Backward of one block call: input gradients for autograd, parameter gradients to the host
        accumulators (``kind == "accumulate"``: ``loss.backward()``) or (``"select"``: under
        ``torch.autograd.grad`` / ``backward(inputs=...)``) to autograd, for the parameters it lists.

        Returns:
            (gradients of the call's tensor inputs, gradients of ``call.refs``' parameters), ``None``
            where there is none.
        """
        refs = call.refs
        want = [True] * len(refs) if kind == "accumulate" else [_leaf_gets_grad(r.param) for r in refs]
        leaf_refs = [r for r, w in zip(refs, want) if w]
        if call.keep:
            self._enter_backward()
            kept = call.graph
            assert kept is not None
            inputs, outs, leaves, bufs = kept.inputs, kept.outs, kept.leaves, None
            t0 = time.perf_counter()
        else:
            inputs = []
            for t, need in zip(self._load_inputs(call), needs):
                t = t.detach()
                if need:
                    t.requires_grad_(True)
                inputs.append(t)
            bufs = self.acquire(call.block, backward=True)
            t0 = time.perf_counter()
            leaves = self._grad_leaves(refs, bufs)
        pre = self._grad_bytes(leaf_refs)
        self._track(pre)  # the parameter gradients autograd is about to allocate
        try:
            if not call.keep:
                flat = list(call.flat)
                for i, t in zip(call.tensor_pos, inputs):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, call.spec)
                with self._replay(call), torch.enable_grad(), self._bind(call.block, bufs, leaves):
                    out = call.forward(*args, **kwargs)
                out_flat = tree_flatten(out)[0]
                outs = [out_flat[i] for i in call.out_pos]
            pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
            in_targets = [t for t, need in zip(inputs, needs) if need]
            targets = in_targets + [leaves[id(r.param)] for r in leaf_refs]
            if pairs and targets:
                grads = torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True,
                                            retain_graph=call.keep and keep_graph)
            else:
                grads = (None,) * len(targets)
        finally:
            self.stats.compute_s += time.perf_counter() - t0
            del leaves
            if bufs is not None:
                self._release(bufs)
        param_grads = list(grads[len(in_targets) :])
        if kind == "accumulate":
            self._send_grads(leaf_refs, param_grads, reserved=pre)
            out_params: list = [None] * len(refs)
        else:
            self._track(-pre)
            it = iter(param_grads)
            out_params = []
            for r, w in zip(refs, want):
                g = next(it) if w else None
                out_params.append(None if g is None else g.to(r.param.device))
        self._done_backward(call, keep_graph)
        it = iter(grads[: len(in_targets)])
        return [next(it) if need else None for need in needs], out_params

    # ------------------------------------------------------------------ activations
    @contextlib.contextmanager
    def _replay(self, call: _Call):
        """Run under the RNG and autocast state the block's forward saw (dropout, mixed precision)."""
        dev = self.device
        enabled, dtype, cache = call.autocast  # type: ignore[misc]
        devices = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(call.rng_cpu)  # type: ignore[arg-type]
            if call.rng_dev is not None:
                torch.cuda.set_rng_state(call.rng_dev, dev)
            with torch.autocast(dev.type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                yield

    def _save_inputs(self, call: _Call, tensors: Sequence[torch.Tensor]) -> None:
        """Keep what backward needs to rebuild this call's inputs.

        A call that starts a segment (every ``checkpoint_every``-th call) keeps all its tensor
        inputs (in host memory with ``offload_activations``). Other calls keep only a link to the
        output of the previous call they consumed (by identity) and recompute it in backward;
        inputs that are not such outputs (attention masks, rotary cos/sin shared by all blocks)
        are kept by reference, which costs no memory beyond what the model already holds.
        """
        fwd = call.fwd
        call.pos = len(fwd.calls)
        fwd.calls.append(weakref.ref(call))
        prev = fwd.last_outs if (fwd.last_outs and fwd.last_outs[0] == call.pos - 1) else None
        start = call.pos % self.checkpoint_every == 0
        call.saved = []
        for i, t in enumerate(tensors):
            link = None
            if not start and prev is not None:
                link = next((j for j, o in enumerate(prev[1]) if o() is t), None)
            if link is not None:
                call.links[i] = link
                call.saved.append(None)
            elif self.offload_activations and t.is_floating_point() and t.requires_grad:
                call.offloaded[i] = self._offload(t)
                call.saved.append(None)
            else:
                call.saved.append(t)
                call.versions[i] = t._version

    def _load_inputs(self, call: _Call) -> list[torch.Tensor]:
        """The call's tensor inputs, recomputing linked ones from the segment start if needed."""
        if call.links and (call.pos - 1) not in call.fwd.recomputed:
            self._recompute_chain(call.fwd, call.pos - 1)
        out: list[torch.Tensor] = []
        for i, t in enumerate(call.saved):
            if i in call.links:
                t = call.fwd.recomputed[call.pos - 1][call.links[i]]
            elif i in call.offloaded:
                t = self._restore(call.offloaded[i])
            elif t is not None and t._version != call.versions.get(i, t._version):
                raise RuntimeError(
                    f"megatrain: input {i} of block {call.block.name} was modified in place after the block's "
                    "forward; its recompute would be wrong. Make the operation after the block out of place."
                )
            out.append(t)  # type: ignore[arg-type]
        return out

    def _recompute_chain(self, fwd: _Forward, last: int) -> None:
        """Forward (no autograd) the calls of ``fwd`` from the nearest one with all inputs kept up to
        ``last``, caching each call's outputs for the backward of the call after it."""
        chain = [last]
        while fwd.call(chain[-1]).links and (chain[-1] - 1) not in fwd.recomputed:
            chain.append(chain[-1] - 1)
        for q in reversed(chain):
            c = fwd.call(q)
            if c.freed:
                raise RuntimeError(
                    "Trying to backward through the graph a second time (or directly access saved tensors after "
                    "they have already been freed). Specify retain_graph=True if you need to backward through the "
                    f"graph a second time (megatrain: block {c.block.name} is recomputed from freed inputs).")
            inputs = [t.detach() for t in self._load_inputs(c)]
            with torch.no_grad(), self._replay(c):
                out = self._run_block(c, inputs, leaves=None, backward=True)
            flat = tree_flatten(out)[0]
            fwd.recomputed[q] = [flat[i] for i in c.out_pos]

    def _done_backward(self, call: _Call, keep_graph: bool) -> None:
        """After a call's backward: drop the recomputed input it consumed; unless the graph is retained
        (``retain_graph=True``), free what it saved, as autograd frees saved tensors."""
        call.fwd.recomputed.pop(call.pos - 1, None)
        if keep_graph:
            return
        call.freed = True
        call.saved, call.offloaded, call.versions = [], {}, {}
        if call.graph is not None:
            call.graph.close()
            call.graph = None

    def _plan_updates_in_backward(self) -> None:
        """At the start of a backward with ``update_in_backward``: snapshot the hyper-parameters and
        count, per slab, the gradient batches this backward will send (one per block call holding
        trainable parameters of the slab). Not when this forward shares its step with an earlier
        forward whose backward has not run (two forwards, one backward): gradients of that forward
        would arrive after the update; the deferred schedule runs instead."""
        if not self._plan_due:
            return
        self._plan_due = False
        self._sends_left = {}
        if not (self.update_in_backward and self.optimizer is not None) or self._fwd.shares_step:
            return
        self._eager_hyper = self.optimizer.snapshot()
        for refs in [c.refs for c in self._fwd.live()] + self._fwd.direct:
            for si in {r.slab for r in refs}:
                self._sends_left[si] = self._sends_left.get(si, 0) + 1

    def _backward_sequence(self) -> list[int]:
        """Block fetch order of the coming backward (recompute chains included), for prefetching."""
        seq: list[int] = []
        cached: set[int] = set()
        calls = self._fwd.live_calls()
        for p in range(len(calls) - 1, -1, -1):
            if calls[p].links and (p - 1) not in cached:
                chain = [p - 1]
                while calls[chain[-1]].links and (chain[-1] - 1) not in cached:
                    chain.append(chain[-1] - 1)
                for q in reversed(chain):
                    seq.append(calls[q].block.index)
                    cached.add(q)
            seq.append(calls[p].block.index)
            cached.discard(p - 1)
        return seq

    def _offload(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        nbytes = t.numel() * t.element_size()
        self.stats.d2h_bytes += nbytes
        return self.transport.offload(t)

    def _restore(self, host: tuple[torch.Tensor, Any]) -> torch.Tensor:
        self.stats.h2d_bytes += host[0].numel() * host[0].element_size()
        return self.transport.restore(*host)

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
        if self._shared_grads.shared:  # the previous backward is over: its shared-parameter sums go in, in order
            self._d2h_futures.append(self._d2h.submit(self._shared_grads.close_all, self.store.slabs))
        self._plan_updates_in_backward()
        self._fwd.last_outs = None  # the forward is over
        self._bwd_seq = self._backward_sequence()
        self._seq, self._cursor = self._bwd_seq, 0

    def acquire(self, blk: Block, backward: bool, training: bool = False) -> dict[int, torch.Tensor]:
        """Return the block's slabs on the device (waiting for the prefetch if needed) and start
        prefetching the next ``lookahead`` fetches of the schedule.

        Args:
            blk: the block about to run.
            backward: ``True`` for fetches made while autograd runs backward (recompute included).
            training: a forward that a backward will follow (the schedule continues into it).
        Returns:
            slab index -> device buffer (fp32/compute dtype, shape ``[slab numel]``).
        """
        t0 = time.perf_counter()
        pos = self._locate(blk, backward, training)
        fut = self._prefetched.pop(blk.index, None)
        if fut is None:
            self.stats.prefetch_misses += 1
            fut = self._h2d.submit(self._fetch, blk)
        if self.lookahead > 0 and pos is not None:
            want: list[int] = []
            for bi in self._seq[pos + 1 :]:
                if len(want) == self.lookahead:
                    break
                if bi not in want:
                    want.append(bi)
            for stale in [k for k in self._prefetched if k not in want]:
                self._discard(self._prefetched.pop(stale))
            for bi in want:
                if bi not in self._prefetched:
                    self._prefetched[bi] = self._h2d.submit(self._fetch, self.blocks[bi])
        if self.store.nvme is not None and pos is not None:
            self._read_ahead(pos)
        got = fut.result()
        for buf, ev in got.values():
            self.transport.ready(buf, ev)
        self.stats.wait_s += time.perf_counter() - t0
        return {s: buf for s, (buf, _) in got.items()}

    def _read_ahead(self, pos: int) -> None:
        """Tell the NVMe store what the schedule reads next: the masters of the coming fetches, and
        the AdamW states and accumulator of slabs whose update runs before their fetch.

        The list stops where its buffers would no longer fit beside the blocks in flight
        (``host_memory_limit`` - the minimum window): buffers read further ahead would be evicted
        by the compute path's own reservations before their use and read a second time."""
        kinds = self.store.nvme_kinds
        nvme = self.store.nvme
        spare = self.budget.limit - self._min_window  # type: ignore[union-attr]
        wanted: list[tuple[int, str]] = []
        pending = self.optimizer.pending if self.optimizer is not None else {}
        for bi in self._seq[pos + 1 : pos + 2 + 2 * self.lookahead + self.nvme_config.read_ahead]:  # type: ignore[union-attr]
            for si in self.blocks[bi].slabs:
                slab = self.store.slabs[si]
                want = ["master"]
                if si in pending:
                    want = ["exp_avg", "exp_avg_sq", "acc", "master"]
                elif self._phase == "backward" and self._sends_left:
                    want = ["master", "exp_avg", "exp_avg_sq"]  # the update runs right after this backward
                elif self._phase == "backward" and not slab.acc_empty:
                    want = ["master", "acc"]  # gradient accumulation adds into the stored accumulator
                for k in want:
                    if k in kinds and (si, k) not in wanted:
                        spare -= nvme.region_bytes(si, k)  # type: ignore[union-attr]
                        if spare < 0:
                            return nvme.read_ahead(wanted)  # type: ignore[union-attr]
                        wanted.append((si, k))
        nvme.read_ahead(wanted)  # type: ignore[union-attr]

    def _discard(self, fut: Future) -> None:
        def drop(f: Future) -> None:
            if f.exception() is None:
                self._track(-sum(b.numel() * b.element_size() for b, _ in f.result().values()))

        fut.add_done_callback(drop)

    def _fetch(self, blk: Block) -> dict[int, tuple[torch.Tensor, Any]]:
        """H2D worker: apply pending optimizer updates of the block's slabs, then copy them.

        A slab travels as its wire layout says (:meth:`configure_precision`): the fp32 master itself
        when it is all fp32, else its wire image (RAM tier: the cached shadow; NVMe tier: cast from
        the window's master at this fetch). ``stats.h2d_bytes`` counts the bytes that travel."""
        out = {}
        for si in blk.slabs:
            slab = self.store.slabs[si]
            layout = self.wire_layouts[si]
            if self.optimizer is not None:
                self.optimizer.apply_pending(si)
            nbytes = slab.numel * self.param_dtype.itemsize
            self._track(nbytes)  # reserved before the buffer exists (CPU + NVMe: counted in the budget)
            if not self.store.masters_on_disk:
                if layout.dtype == torch.float32:
                    src = slab.master
                    buf, ev = self.transport.to_device(src, self.param_dtype)
                else:
                    src = self._shadow(slab)
                    buf, ev = self.transport.to_device(src, self.param_dtype, layout)
            else:
                with self.store.hold(si, ["master"]) as t:
                    src = t["master"]
                    if layout.dtype != torch.float32:
                        self._track(layout.nbytes)
                        try:
                            t0 = time.perf_counter()
                            src = layout.encode(src, layout.empty())  # no cached shadow: it would be resident
                            self.stats.cast_s += time.perf_counter() - t0
                            buf, ev = self.transport.to_device(src, self.param_dtype, layout)
                            self.transport.last_read_done(ev)
                        finally:
                            self._track(-layout.nbytes)
                    else:
                        buf, ev = self.transport.to_device(src, self.param_dtype)
                        self.transport.last_read_done(ev)  # the window buffer may be evicted after the hold
            slab.last_read = ev
            self.stats.h2d_bytes += src.numel() * src.element_size()
            out[si] = (buf, ev)
        self.stats.blocks_fetched += 1
        return out

    def _castable(self) -> list[list[bool]]:
        """Per slab, per entry: whether autocast casts the parameter at every use (all its owners are
        Linear/Conv/Conv1D modules: see :func:`~megatrain_lightning.engine.wire.autocast_casts`)."""
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for blk in self.blocks:
            for ref in blk.params:
                owners.setdefault(id(ref.param), []).append((ref.owner, ref.attr))
        return [castable_flags([owners[id(e.ref.param)] for e in s.entries]) for s in self.store.slabs]

    def _wire_layout(self, si: int) -> WireLayout:
        slab = self.store.slabs[si]
        if self.wire_dtype == self.param_dtype:  # 32-true, bf16-true: every weight in one dtype
            return WireLayout.uniform(slab.numel, self.wire_dtype)
        dtypes = [self.wire_dtype if c else torch.float32 for c in self.autocast_castable[si]]
        return WireLayout.build([e.numel for e in slab.entries], dtypes)

    def configure_precision(self, wire: torch.dtype, param: torch.dtype, grad_wire: torch.dtype) -> None:
        """Set the dtypes of the H2D weight copies, of the bound parameters and of D2H gradients.

        Args:
            wire: dtype weights travel in. With ``param == wire`` (``32-true``: fp32, ``bf16-true``:
                bf16) every weight travels and computes in it. With ``wire`` 16-bit and ``param``
                fp32 (the mixed modes, computed under autocast) only the weights autocast casts at
                every use travel in ``wire`` (``engine.autocast_castable``); the others (embeddings,
                norms, tied weights, custom modules) travel in fp32, so the block sees exactly the
                values Lightning's own mixed precision gives it.
            param: dtype of the device buffer the block's parameters are bound to (fp32 in mixed modes).
            grad_wire: dtype of parameter gradients on the D2H link (accumulated in fp32 on the host).
        """
        if (wire, param, grad_wire) != (self.wire_dtype, self.param_dtype, self.grad_wire_dtype):
            self._drop_prefetched()
        self.wire_dtype, self.param_dtype, self.grad_wire_dtype = wire, param, grad_wire
        layouts = [self._wire_layout(si) for si in range(len(self.store.slabs))]
        for slab, old, new in zip(self.store.slabs, self.wire_layouts, layouts):
            if old != new:
                with slab.lock:
                    self.transport.last_read_done(slab.last_read)  # an async H2D may still read the shadow
                    slab.shadow, slab.shadow_version = None, (-1, -1)
        self.wire_layouts = layouts

    def _shadow(self, slab) -> torch.Tensor:
        """Host wire image of the master slab (:class:`WireLayout`: bf16/fp16 for castable weights, fp32
        for the rest under mixed precision; all bf16 under ``bf16-true``), refreshed when the master
        changed (an optimizer update, or its version counter moved: state-dict load).

        One cast per slab per optimizer step, made by the H2D worker right after the slab's update,
        instead of one cast per fetch (each block is fetched twice per step)."""
        layout = self.wire_layouts[slab.index]
        with slab.lock:
            v = (slab.updates, slab.master._version)
            if slab.shadow is None:
                slab.shadow = layout.empty(pin_memory=self.device.type == "cuda")
                slab.shadow_version = (-1, -1)
            if slab.shadow_version != v:
                self.transport.last_read_done(slab.last_read)  # an async H2D may still read the shadow
                t0 = time.perf_counter()
                layout.encode(slab.master, slab.shadow)
                slab.shadow_version = v
                self.stats.cast_s += time.perf_counter() - t0
            return slab.shadow

    def _track(self, nbytes: int) -> None:
        if self._budget_device:
            if nbytes > 0:
                self.budget.reserve(nbytes, self.store.nvme._make_room, what="compute buffers")  # type: ignore[union-attr]
            elif nbytes < 0:
                self.budget.release(-nbytes)  # type: ignore[union-attr]
        with self._live_lock:
            self._live += nbytes
            self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self._live)

    def _release(self, bufs: dict[int, torch.Tensor]) -> None:
        self._track(-sum(b.numel() * b.element_size() for b in bufs.values()))
        bufs.clear()
        self.transport.released()

    def _drop_prefetched(self) -> None:
        """Wait for and discard prefetched copies (they predate an optimizer update)."""
        for fut in self._prefetched.values():
            try:
                got = fut.result()
                self._track(-sum(b.numel() * b.element_size() for b, _ in got.values()))
            except Exception:  # the error resurfaces on the next synchronous fetch
                pass
        self._prefetched.clear()
        self._phase = "idle"

    # ------------------------------------------------------------------ gradients
    def _grad_bytes(self, refs: Sequence) -> int:
        """Bytes of the gradients of ``refs`` as autograd makes them (the compute dtype)."""
        return sum(self.store.slabs[r.slab].entries[r.index].numel for r in refs) * self.param_dtype.itemsize

    def _send_grads(self, refs: Sequence, grads: Sequence[torch.Tensor | None], reserved: int = 0) -> None:
        """Queue gradients for the D2H worker. ``reserved``: bytes already reserved for them (before
        autograd allocated them), exchanged here for the bytes of their wire copies."""
        by_slab: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for ref, g in zip(refs, grads):
            if g is not None:
                by_slab.setdefault(ref.slab, []).append((ref.index, g))
        wire = self.grad_wire_dtype
        total = sum(g.numel() * wire.itemsize for items in by_slab.values() for _, g in items)
        if total < reserved:
            self._track(total - reserved)
        final: set[int] = set()
        if self._sends_left:
            for si in {r.slab for r in refs}:
                if si in self._sends_left:
                    self._sends_left[si] -= 1
                    if self._sends_left[si] == 0:
                        final.add(si)
        for si, items in by_slab.items():
            nbytes = sum(g.numel() * wire.itemsize for _, g in items)
            take = min(nbytes, reserved)
            reserved -= take
            if self._d2h_slots is not None:
                self._d2h_slots.acquire()
            self._track(nbytes - take)
            run = self.transport.stage_grads([g for _, g in items], wire)
            idx = [i for i, _ in items]
            self.stats.d2h_bytes += nbytes
            self._d2h_futures.append(self._d2h.submit(self._accumulate, si, idx, run, nbytes, si in final))
        for si in final - set(by_slab):  # its last batch had no gradient: the update still runs, in order
            if self._d2h_slots is not None:
                self._d2h_slots.acquire()
            self._d2h_futures.append(self._d2h.submit(self._update_now, si, True))

    def _update_now(self, si: int, slot: bool = False) -> None:
        """D2H worker: the slab's gradients of this step are complete: apply its AdamW update now."""
        try:
            assert self.optimizer is not None and self._eager_hyper is not None
            self._shared_grads.close_slab(self.store.slabs[si])
            self.optimizer.apply_now(si, self._eager_hyper)
        finally:
            if slot and self._d2h_slots is not None:
                self._d2h_slots.release()

    def _accumulate(self, si: int, idx: list[int], run: Callable, nbytes: int, final: bool = False) -> None:
        """D2H worker: add one batch of slab ``si``'s gradients into its fp32 accumulator, then
        (``final``: the slab's last batch of the step under ``optimizer_in_backward``) apply its update.

        The final batch is consumed by the update while the accumulator is still pinned, so that
        accumulator is never marked for write-back: with ``offload_optimizer="nvme"`` it never
        goes to disk (4 bytes/param/step less written)."""
        slab = self.store.slabs[si]
        done = [False]

        def release() -> None:  # the gradient batch's bytes and D2H slot, exactly once
            if not done[0]:
                done[0] = True
                self._track(-nbytes)
                if self._d2h_slots is not None:
                    self._d2h_slots.release()

        try:
            with slab.lock:
                if slab.acc_empty:
                    slab.has_grad = [False] * len(slab.entries)
                # an empty accumulator is overwritten, not read (NVMe: no disk read)
                fresh = ["acc"] if slab.acc_empty else []
                with self.store.hold(si, ["acc"], write=not final, fresh=fresh) as t:

                    def consume(host_grads: list[torch.Tensor]) -> None:
                        for i, g in zip(idx, host_grads):
                            self._shared_grads.add(slab, i, slab.view(t["acc"], i), g)

                    try:
                        run(consume)
                    finally:
                        release()
                    slab.acc_empty = False
                    if final:
                        self._update_now(si)
                if final:
                    self.store.discard_acc(si)  # consumed: free its window buffer now
        finally:
            release()

    def wait_grads(self) -> None:
        """Block until every gradient sent so far is in the host accumulators."""
        t0 = time.perf_counter()
        futs, self._d2h_futures = self._d2h_futures, []
        for f in futs:
            f.result()
        self._shared_grads.close_all(self.store.slabs)
        self.stats.wait_s += time.perf_counter() - t0

    def attach_grads(self) -> None:
        """Set ``param.grad`` to a view of its fp32 accumulator (``None`` where no gradient arrived).

        With accumulators on disk (``offload_optimizer="nvme"``) ``param.grad`` stays ``None``: the
        gradients are not all in memory at once (clipping still works, see HostAdamW.clip_grad_norm).

        Raises:
            RuntimeError: a parameter got a gradient from ordinary autograd, outside the engine: it was
                used outside the forward of the module that owns it (see :meth:`check_outside_grads`).
        """
        self.wait_grads()
        self.check_outside_grads()
        if "acc" in self.store.nvme_kinds:
            return
        for slab in self.store.slabs:
            for i, e in enumerate(slab.entries):
                has = slab.acc is not None and not slab.acc_empty and slab.has_grad[i]
                e.ref.param.grad = slab.acc_view(i) if has else None

    def check_outside_grads(self) -> None:
        """Raise if a parameter's ``.grad`` was set by ordinary autograd rather than by the engine.

        The engine computes every gradient inside block calls and keeps it in the host accumulators;
        ``param.grad`` is only ever ``None`` or a view of an accumulator. A parameter used *outside*
        the forward of its block (for example ``self.net.pos`` read in ``training_step`` while only
        ``net.forward`` binds it, or a weight reused with ``F.linear`` in another module) is seen by
        autograd as the plain host tensor: its gradient would land in ``.grad`` and be lost.

        Raises:
            RuntimeError: naming the parameters and what to do.
        """
        bad = []
        for slab in self.store.slabs:
            acc = slab.acc.untyped_storage().data_ptr() if slab.acc is not None else None
            for e in slab.entries:
                g = e.ref.param.grad
                if g is not None and (acc is None or g.untyped_storage().data_ptr() != acc):
                    bad.append(e.ref.fqn)
        if bad:
            raise RuntimeError(
                f"megatrain: parameters {bad} got a gradient outside the streamed blocks: they were used "
                "outside the forward of the module that owns them, where the engine does not bind them, so "
                "their gradient would be lost. Use each parameter only inside its own module's forward (call "
                "the module instead of reading its weight, e.g. self.net(x) rather than self.net.pos), or "
                "move the computation that uses it into that module's forward."
            )

    def detach_grads(self) -> None:
        for slab in self.store.slabs:
            for e in slab.entries:
                e.ref.param.grad = None

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()``: forget gradients no step consumed."""
        self.wait_grads()
        if self.optimizer is not None:
            self.optimizer.discard_grads()
        else:
            for slab in self.store.slabs:
                slab.acc_empty = True
                slab.has_grad = [False] * len(slab.entries)

    # ------------------------------------------------------------------ optimizer
    def step(self) -> None:
        """Schedule the host AdamW update for the gradients accumulated so far.

        Raises:
            RuntimeError: no optimizer attached (``attach_optimizer`` was not called).
        """
        if self.optimizer is None:
            raise RuntimeError("megatrain: optimizer step requested but no optimizer is attached.")
        self.wait_grads()
        self._drop_prefetched()  # prefetched copies predate this update
        self.optimizer.step()
        self.detach_grads()

    def skip_step(self) -> None:
        """Drop the accumulated gradients without any update (a skipped fp16 step)."""
        self.wait_grads()
        self.detach_grads()
        if self.optimizer is not None:
            self.optimizer.discard_grads()

    def flush(self) -> None:
        """Apply all pending optimizer updates (call before reading parameters directly)."""
        self.wait_grads()
        if self.optimizer is not None and self.optimizer.has_pending():
            self._drop_prefetched()
            self.optimizer.flush()

    def end_step(self) -> dict[str, float]:
        """Close the accounting window of one optimizer step; returns the logged metrics."""
        self._close_kept()  # the step's backward is over (or was skipped)
        if self.optimizer is not None:
            self.stats.optimizer_s = self.optimizer.optimizer_seconds
            self.optimizer.optimizer_seconds = 0.0
        peak = self.transport.peak_bytes()
        if peak is not None:
            self.stats.peak_device_bytes = peak
            self.transport.reset_peak()
        out = self.stats.as_dict()
        if self.store.nvme is not None:
            io = self.store.nvme.meter.snapshot()
            last = getattr(self, "_io_last", {k: 0 for k in io})
            out.update({"megatrain/" + k: v - last[k] for k, v in io.items()})
            out["megatrain/host_budget_peak_bytes"] = self.budget.peak  # type: ignore[union-attr]
            self._io_last = io
        self.history.append(out)
        with self._live_lock:
            self.stats = StepStats(peak_device_bytes=self._live)
        return out
