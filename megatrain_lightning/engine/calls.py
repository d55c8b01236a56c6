"""Records of grad-mode block calls: what one call keeps for its backward, the calls of one forward,
and the last block's kept graph (docs/architecture.md, "A training step")."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..blocks import Block

if TYPE_CHECKING:
    from .recompute import Recompute


def autocast_state(device_type: str) -> tuple[bool, torch.dtype, bool]:
    """The autocast state a block call's recompute replays: (enabled, dtype, cache enabled)."""
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


@dataclass
class BlockCall:
    """Everything one block call needs to be recomputed in backward.

    ``keep``: the last block of a training forward, run with autograd and its graph kept in
    ``graph`` (no recompute). ``freed``: its saved inputs were released by a backward that did not
    retain the graph; a further backward through it is an error, as in PyTorch."""

    rc: "Recompute"
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
    autocast: tuple | None = None
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

    def arguments(self, tensors: "list[torch.Tensor]") -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with ``tensors`` (the engine's detached inputs, in ``tensor_pos``
        order) in place of the caller's. An input that requires grad (an autograd leaf the engine takes its
        gradient from) is passed as a view of itself, so that inside the block it is not a leaf, as the
        caller's activation is not one in plain PyTorch: autocast caches its cast of a float32 leaf that
        requires grad (meant for weights) and reuses it at every use, so the input gradients of the uses
        (q/k/v projections of one hidden state) would be summed in bf16/fp16 where plain PyTorch sums
        them in float32 (measured: T5 encoder gradients 6e-3 relative off under bf16-mixed)."""
        flat = list(self.flat)
        with torch.enable_grad():  # the view is part of the graph the call's gradients are taken through
            for i, t in zip(self.tensor_pos, tensors):
                flat[i] = t.view_as(t) if t.requires_grad and t.is_leaf else t
        return tree_unflatten(flat, self.spec)

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Context of this call's forward run again for its backward: an exception raised in it (often in a
        user's hook that reads state set for another call) gets a note (Python >= 3.11) saying it came from the
        recompute and what makes a recompute differ from its forward."""
        try:
            yield
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(RECOMPUTE_NOTE.format(name=self.block.name))
            raise

    def recomputed_outputs(self, out: Any) -> list[torch.Tensor]:
        """The tensor outputs of this call's recompute (``out``: what the block returned), after checking that
        each has the shape and dtype the forward's had, as ``torch.utils.checkpoint`` checks its recompute.

        Raises:
            RuntimeError: a count, shape or dtype differs (the forward read state that changed since)."""
        flat = tree_flatten(out)[0]
        outs = [flat[i] if i < len(flat) else None for i in self.out_pos]
        got = [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in outs]
        if len(flat) != len(self.out_flat) or (self.out_meta and got != self.out_meta):
            raise RuntimeError(
                f"megatrain: block {self.block.name} recomputed for its backward returned outputs of other shapes or "
                f"dtypes than its forward did (forward: {self.out_meta}; recompute: {got}). "
                + RECOMPUTE_NOTE.format(name=self.block.name))
        return outs  # type: ignore[return-value]


@dataclass(eq=False)
class ForwardRecord:
    """The grad-mode block calls of one training forward, shared by their backward.

    Calls are held weakly (each call is kept alive by its autograd node), so a forward whose graph
    was dropped without a backward frees its saved inputs at once. Several forwards may be alive
    together (two forwards, then one backward of both losses)."""

    calls: list["weakref.ref[BlockCall]"] = field(default_factory=list)
    kept: list["weakref.ref[BlockCall]"] = field(default_factory=list)
    recomputed: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # call pos -> outputs recomputed in backward
    last_outs: tuple[int, list] | None = None  # (pos, weak refs to the outputs) of the latest call
    segment_start: int = 0  # pos of the call that started the current recompute segment
    backward_started: bool = False
    shares_step: bool = False  # started while an earlier forward's backward had not run
    first_block: int = -1  # block index of the first call (or container)
    direct: list[list] = field(default_factory=list)  # trainable refs of each container call (bound_params.BoundParams)

    def live_calls(self) -> list[BlockCall]:
        """The calls in order, while their graph is alive (all of them at the start of a backward)."""
        return [c for c in (r() for r in self.calls) if c is not None]

    def call(self, pos: int) -> BlockCall:
        c = self.calls[pos]()
        if c is None:
            raise RuntimeError("megatrain: the graph of this forward was freed before its backward.")
        return c

    def backward_sequence(self) -> list[int]:
        """Block fetch order of the coming backward of this forward (recompute chains included), for prefetching:
        from the last call back, each call's block after the chain that rebuilds its linked inputs; a kept graph whose
        backward needs no weights fetches nothing."""
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


class KeptGraph:
    """A block call's autograd graph, kept from its forward to its backward: the last block's (with the
    device buffers it computed with) or a ``recompute="none"`` call's (``hooks``: without its weights,
    :mod:`.block_graph`); the gradient leaves, its detached inputs and its outputs. ``close`` (idempotent)
    drops them and returns their bytes to the accounting: after a backward that does not retain the
    graph, when the call is garbage-collected (its graph dropped unused), or at the end of the step."""

    def __init__(self, rc: "Recompute", bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor],
                 inputs: list, outs: list[torch.Tensor], hooks: Any = None):
        self.rc, self.bufs, self.leaves, self.inputs, self.outs = rc, bufs, leaves, inputs, outs
        self.hooks = hooks  # block_graph.GraphHooks of a recompute="none" call (its weights are not kept)
        self.open = True

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        self.rc.kept_open.discard(self)
        self.leaves, self.inputs, self.outs = {}, [], []
        if self.hooks is not None:
            self.hooks.free()
        self.rc.acct.release(self.bufs)


RECOMPUTE_NOTE = (
    "megatrain: block {name}'s forward ran again for its backward (a recompute: recompute='block', 'selective' or "
    "'auto'), from its saved inputs, random state and module flags, but with the Python state its modules read now. "
    "If a hook or a module inside the block reads an attribute that training_step changes between two calls of the "
    "model before one backward (a mask or a steering vector set per call), the recompute sees the latest value, as "
    "under torch.utils.checkpoint. Pass such state as an argument of the model call, or use recompute='none' (the "
    "block keeps its graph: nothing runs twice).")

# PyTorch's own message for this error, so users find the usual advice
SECOND_BACKWARD = ("Trying to backward through the graph a second time (or directly access saved tensors after they "
                    "have already been freed). Saved intermediate values of the graph are freed when you call "
                    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
                    "graph a second time")
# a graph kept with retain_graph=True, used again after the weights it read were updated (plain PyTorch raises its
# in-place modification error there)
STEPPED_SINCE = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
                 "this graph, kept with retain_graph=True, is backpropagated again after the optimizer updated the "
                 "weights it read. Run every backward of a graph before optimizer.step()")


def trainable_refs(blk: Block) -> list:
    """The block's trainable parameter references, one per parameter object, in block order."""
    seen: set[int] = set()
    refs = []
    for ref in blk.params:
        if ref.param.requires_grad and id(ref.param) not in seen:
            seen.add(id(ref.param))
            refs.append(ref)
    return refs


@contextlib.contextmanager
def replayed(call: BlockCall, dev: torch.device) -> Iterator[None]:
    """Run under the RNG, autocast state, module ``training`` flags, buffer values and hooks the block call's
    forward saw (dropout, mixed precision, a mode switched before backward; its buffer updates, e.g. BatchNorm's
    statistics, are not made twice). ``dev``: the compute device (its RNG is replayed when it is a GPU)."""
    enabled, dtype, cache = call.autocast  # type: ignore[misc]
    state = call.state.replayed() if call.state is not None else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type="cuda"), state:
        torch.set_rng_state(call.rng_cpu)  # type: ignore[arg-type]
        if call.rng_dev is not None:
            torch.cuda.set_rng_state(call.rng_dev, dev)
        with torch.autocast(dev.type, dtype=dtype, enabled=enabled, cache_enabled=cache):
            yield
