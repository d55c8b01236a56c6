"""Records of grad-mode block calls: what one call keeps for its backward (:class:`BlockCall`) and the calls of
one forward (:class:`ForwardRecord`) (docs/architecture.md, "A training step"). Each changes only through its own
methods; :class:`~.boundary.Boundary` drives them."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...blocks import Block

if TYPE_CHECKING:
    from ..offload import ActivationOffload, Offloaded
    from .boundary import Boundary
    from .kept import KeptGraph


def trainable_refs(blk: Block) -> list:
    """The block's trainable parameter references, one per parameter object, in block order."""
    seen: set[int] = set()
    refs = []
    for ref in blk.params:
        if ref.param.requires_grad and id(ref.param) not in seen:
            seen.add(id(ref.param))
            refs.append(ref)
    return refs


@dataclass
class BlockCall:
    """Everything one block call needs for its backward. ``keep``: the last block of a training forward (its graph
    kept in ``graph``, no recompute). ``freed``: released by a backward that did not retain the graph (a further
    backward raises, as in PyTorch)."""

    owner: "Boundary"
    block: Block
    forward: Callable[..., Any]
    flat: list[Any]
    spec: Any
    tensor_pos: list[int]
    fwd: "ForwardRecord"
    refs: list = field(default_factory=list)
    keep: bool = False
    rng_cpu: torch.Tensor | None = None
    rng_dev: torch.Tensor | None = None
    autocast: tuple | None = None  # (enabled, dtype, cache enabled) of the device's autocast in the forward
    out_spec: Any = None
    out_flat: list[Any] = field(default_factory=list)
    out_pos: list[int] = field(default_factory=list)
    pos: int = -1
    saved: list[torch.Tensor | None] = field(default_factory=list)
    links: dict[int, int] = field(default_factory=dict)
    offloaded: dict[int, Any] = field(default_factory=dict)  # input index -> offload.Offloaded (host copy)
    versions: dict[int, int] = field(default_factory=dict)
    graph: "KeptGraph | None" = None
    freed: bool = False
    saved_ops: Any = None  # recompute_policy.SavedOps: op outputs kept ("selective"/"none")
    kept_bytes: Any = None  # releases this call's bytes in the activation meter
    state: Any = None  # block_state.BlockState: modules' training flags and changed buffers, as the forward found them
    input_grad: list[bool] = field(default_factory=list)  # which tensor inputs required grad in the forward
    out_grad: list[bool] | None = None  # which tensor outputs required grad in the forward's grad-mode run
    out_meta: list[tuple] = field(default_factory=list)  # (shape, dtype) of each tensor output of the forward

    def record(self, tensors: Sequence[torch.Tensor], dev: torch.device) -> None:
        """Record what the forward starts from: which ``tensors`` (inputs) require grad, the CPU RNG state (and
        ``dev``'s on a GPU) and ``dev``'s autocast state."""
        self.input_grad = [t.requires_grad for t in tensors]
        self.rng_cpu = torch.get_rng_state()
        if dev.type == "cuda":
            self.rng_dev = torch.cuda.get_rng_state(dev)
        self.autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type),
                         torch.is_autocast_cache_enabled())

    def recomputed_with(self, saved_ops: Any, state: Any) -> None:
        """The call is recomputed in backward, keeping ``saved_ops`` and replaying the module ``state``."""
        self.saved_ops, self.state = saved_ops, state

    def ran(self, outs: Sequence[torch.Tensor]) -> None:
        """The forward's grad-mode run returned the tensors ``outs``: which of them require grad."""
        self.out_grad = [t.requires_grad for t in outs]

    def record_outputs(self, out: Any) -> tuple[torch.Tensor, ...]:
        """Record the layout of ``out`` (what the block returned); returns its tensors, in order."""
        out_flat, self.out_spec = tree_flatten(out)
        self.out_pos = [i for i, x in enumerate(out_flat) if isinstance(x, torch.Tensor)]
        self.out_flat = [None if isinstance(x, torch.Tensor) else x for x in out_flat]
        outs = tuple(out_flat[i] for i in self.out_pos)
        self.out_meta = [(tuple(o.shape), o.dtype) for o in outs]
        return outs

    def outputs(self, outs: Sequence[torch.Tensor]) -> Any:
        """What the block returned, with ``outs`` (connected to autograd) in place of its tensors."""
        out_flat = list(self.out_flat)
        for i, o in zip(self.out_pos, outs):
            out_flat[i] = o
        return tree_unflatten(out_flat, self.out_spec)

    def differentiable(self, outs: Sequence[torch.Tensor]) -> list[bool]:
        """Which tensor outputs ``outs`` are differentiable: floating-point ones the grad-mode run produced requiring
        grad (``out_grad``), as in plain PyTorch. T5's decoder layer returns a position bias made with
        ``torch.zeros``: made differentiable, the next SDPA took its math kernel and the bf16-mixed loss moved (5.1301
        vs 5.1295 plain)."""
        known = self.out_grad if self.out_grad is not None and len(self.out_grad) == len(outs) else [True] * len(outs)
        return [k and o.is_floating_point() for k, o in zip(known, outs)]

    def arguments(self, tensors: "list[torch.Tensor]") -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with ``tensors`` (detached inputs, in ``tensor_pos`` order) in place of the
        caller's. A leaf that requires grad is passed as a view of itself, so it is no leaf inside the block: autocast
        caches its cast of such a leaf, and the input gradients of its uses (q/k/v) would be summed in bf16/fp16
        instead of fp32 (measured: T5 encoder gradients 6e-3 relative off under bf16-mixed)."""
        flat = list(self.flat)
        with torch.enable_grad():  # the view is part of the graph the call's gradients are taken through
            for i, t in zip(self.tensor_pos, tensors):
                flat[i] = t.view_as(t) if t.requires_grad and t.is_leaf else t
        return tree_unflatten(flat, self.spec)

    def save_inputs(self, tensors: Sequence[torch.Tensor], prev: list | None, start: bool,
                    offload: "ActivationOffload | None") -> int:
        """Keep what backward needs to rebuild the call's inputs ``tensors``; the call becomes one of its forward's.

        A segment start (``start``) keeps all its inputs (with ``offload``, those needing gradients in host memory);
        other calls keep a link to the previous call's output they consumed (by identity among ``prev``, weak
        references), recomputed in backward. Other inputs (masks, rotary cos/sin) are kept by reference.

        Returns:
            the device bytes kept (inputs that require grad)."""
        self.pos = self.fwd.add(self)
        kept = 0
        for i, t in enumerate(tensors):
            link = None
            if not start and prev is not None:
                link = next((j for j, o in enumerate(prev) if o() is t), None)
            if link is not None:
                self.links[i] = link
                self.saved.append(None)
            elif offload is not None and t.is_floating_point() and t.requires_grad:
                self.offloaded[i] = offload.offload(t)
                self.saved.append(None)
            else:
                self.saved.append(t)
                self.versions[i] = t._version
                kept += t.numel() * t.element_size() if t.requires_grad else 0  # masks, cos/sin: shared
        return kept

    def metered(self, release: Callable[[], Any]) -> None:
        """``release()`` returns the call's kept bytes to the activation meter (when the call is freed)."""
        self.kept_bytes = release

    def keep_graph(self, graph: "KeptGraph") -> None:
        """Keep ``graph`` for the backward instead of saved inputs: a ``recompute="none"`` call's is one of its
        forward's calls; the last block's is closed when the call is garbage-collected."""
        self.graph = graph
        if graph.hooks is not None:
            self.pos, self.offloaded = self.fwd.add(self), graph.hooks.offloaded
        else:
            weakref.finalize(self, graph.close)  # its graph dropped unused (training_step returned None)
            self.fwd.add_kept(self)

    def load_inputs(self, offload: "ActivationOffload", final: bool) -> list[torch.Tensor]:
        """The call's tensor inputs: linked ones from the previous call's recomputed outputs, offloaded ones restored
        (``final``: the call's own backward, which drops the device copy; else a recompute chain, which keeps it);
        then the next call's restore starts."""
        out: list[torch.Tensor] = []
        for i, t in enumerate(self.saved):
            if i in self.links:
                t = self.fwd.recomputed[self.pos - 1][self.links[i]]
            elif i in self.offloaded:
                t = offload.take(self.offloaded[i], keep=not final)
            out.append(t)  # type: ignore[arg-type]
        if self.offloaded:
            offload.prefetch(self.fwd.next_offloaded(self.pos))
        return out

    @contextlib.contextmanager
    def replayed(self, dev: torch.device) -> Iterator[None]:
        """Run under the RNG, autocast state and module state (``training`` flags, buffers, hooks) the call's forward
        saw; buffer updates (BatchNorm's) are not made twice. ``dev``: the compute device."""
        enabled, dtype, cache = self.autocast  # type: ignore[misc]
        state = self.state.replayed() if self.state is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type="cuda"), state:
            torch.set_rng_state(self.rng_cpu)  # type: ignore[arg-type]
            if self.rng_dev is not None:
                torch.cuda.set_rng_state(self.rng_dev, dev)
            with torch.autocast(dev.type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                yield

    def free(self) -> None:
        """Drop what the call saved for its backward (a backward that does not retain the graph)."""
        self.freed = True
        self.saved, self.offloaded, self.versions = [], {}, {}
        if self.saved_ops is not None:
            self.saved_ops.free()
        if self.kept_bytes is not None:
            self.kept_bytes()
        if self.graph is not None:
            self.graph.close()
            self.graph = None


@dataclass(eq=False)
class ForwardRecord:
    """The grad-mode block calls of one training forward, shared by their backward. Calls are held weakly (their
    autograd nodes keep them alive), so a graph dropped without a backward frees its saved inputs at once. Several
    forwards may be alive together."""

    calls: list["weakref.ref[BlockCall]"] = field(default_factory=list)
    kept: list["weakref.ref[BlockCall]"] = field(default_factory=list)
    recomputed: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # call pos -> outputs recomputed in backward
    last_outs: tuple[int, list] | None = None  # (pos, weak refs to the outputs) of the latest call
    segment_start: int = 0  # pos of the call that started the current recompute segment
    backward_started: bool = False
    shares_step: bool = False  # started while an earlier forward's backward had not run
    first_block: int = -1  # block index of the first call (or container)
    direct: list[list] = field(default_factory=list)  # trainable refs of each container call (backward.BoundParams)

    @property
    def started(self) -> bool:
        return bool(self.calls or self.direct)

    def enter(self, block: int) -> None:
        """A grad-mode call of block ``block`` (or a container) starts in this forward."""
        if not self.started:
            self.first_block = block

    def add(self, call: BlockCall) -> int:
        self.calls.append(weakref.ref(call))
        return len(self.calls) - 1

    def add_kept(self, call: BlockCall) -> None:
        """``call`` keeps the last block's graph (it is not one of the recomputed calls)."""
        self.kept.append(weakref.ref(call))

    def add_direct(self, refs: list) -> None:
        """A container's own trainable parameters ``refs`` are tracked in this forward."""
        self.direct.append(refs)

    def segment(self, pos: int, every: int) -> tuple[list | None, bool]:
        """For call ``pos``: (weak references to call ``pos - 1``'s outputs when it was the latest call and kept no
        graph, else ``None``; whether ``pos`` starts a recompute segment: after no such outputs, or every
        ``every``-th call)."""
        prev = self.last_outs[1] if (self.last_outs and self.last_outs[0] == pos - 1) else None
        start = prev is None or pos - self.segment_start >= every
        if start:
            self.segment_start = pos
        return prev, start

    def returned(self, call: BlockCall, outs: Sequence[torch.Tensor]) -> None:
        """``call`` returned ``outs``: the next call may link to them, unless ``call`` keeps its graph."""
        self.last_outs = None if call.graph is not None else (call.pos, [weakref.ref(o) for o in outs])

    def end(self) -> None:
        """The forward is over (its backward starts): no later call links to its outputs."""
        self.last_outs = None

    def start_backward(self) -> None:
        self.backward_started = True

    def keep_recomputed(self, pos: int, outs: list[torch.Tensor]) -> None:
        """Call ``pos``'s outputs, recomputed for the backward of the call after it."""
        self.recomputed[pos] = outs

    def consumed(self, pos: int) -> None:
        """Call ``pos``'s backward ran: the recomputed outputs of the call before it are no longer needed."""
        self.recomputed.pop(pos - 1, None)

    def live_calls(self) -> list[BlockCall]:
        """The calls in order, while their graph is alive (all of them at the start of a backward)."""
        return [c for c in (r() for r in self.calls) if c is not None]

    def call(self, pos: int) -> BlockCall:
        c = self.calls[pos]()
        if c is None:
            raise RuntimeError("megatrain: the graph of this forward was freed before its backward.")
        return c

    def backward_sequence(self) -> list[int]:
        """Block fetch order of this forward's coming backward, for prefetching: from the last call back, each call's
        block after the recompute chain that rebuilds its linked inputs; a kept graph needing no weights fetches
        nothing."""
        seq: list[int] = []
        cached: set[int] = set()
        calls = self.live_calls()
        for p in range(len(calls) - 1, -1, -1):
            g = calls[p].graph
            if g is not None and g.hooks is not None and not g.hooks.needs_weights:
                continue  # its backward fetches nothing
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

    def live(self) -> list[BlockCall]:
        return [c for c in (r() for r in self.calls + self.kept) if c is not None]

    def next_offloaded(self, below: int) -> "list[Offloaded]":
        """The offloaded inputs of the last call before ``below`` that has any (backward's next), or ``[]``."""
        for p in range(min(below, len(self.calls)) - 1, -1, -1):
            c = self.calls[p]()
            if c is not None and c.offloaded and not c.freed:
                return list(c.offloaded.values())
        return []

    def next_saved_ops(self, below: int) -> Any:
        """The ``SavedOps`` with offloaded outputs of the last call before ``below`` that has them, or ``None``."""
        for p in range(min(below, len(self.calls)) - 1, -1, -1):
            c = self.calls[p]()
            if c is not None and not c.freed and c.saved_ops is not None and c.saved_ops.offloaded:
                return c.saved_ops
        return None
