"""The autograd boundary of a streamed block: what a training forward keeps, and its backward.

Under grad mode every block call goes through :class:`_BlockFunction`: its forward runs the block
in grad mode keeping no saved tensors past its return (:mod:`.forward_grad`) and keeps only what the backward needs to rebuild the block's inputs (the inputs of
every ``recompute_every``-th call, links to the previous call's outputs otherwise, optionally
offloaded to host memory), the RNG and autocast state and the module state (:mod:`.block_state`); its
backward fetches the block again, recomputes its forward under the replayed state and differentiates it locally. The last block of a training forward keeps its graph instead (no
recompute). Each training forward has its own record of calls, so several forwards, ``retain_graph=True``
and ``torch.autograd.grad`` behave as on a plain model (docs/architecture.md, "A training step"). Weights
reach the device and gradients the host through the block runner (``acquire`` + ``bind``) and gradient sink.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from ..blocks import Block
from ..store.host import HostStore
from .accounting import ByteAccounting
from .backward_state import keeps_graph, leaf_grad_use, local_grad
from .block_state import snapshot as snapshot_state
from .opaque_values import check_inputs, check_outputs, inplace_input_hint
from .param_hooks import skip_none_calls
from .block_graph import GraphHooks, own_outputs, release_leaves
from .bound_params import BoundParams
from .calls import SECOND_BACKWARD, STEPPED_SINCE, BlockCall, replayed, ForwardRecord, KeptGraph, autocast_state, trainable_refs
from .forward_grad import ForeignLeafCheck, differentiable, refuse_func_transforms, saving_for_the_call
from .grads import GradientSink
from .chunked_mlp import plain_chunks
from .offload import ActivationOffload, next_offloaded, next_saved_ops
from .recompute_policy import RecomputePolicy, hidden_shapes, is_lookup
from .recorded_outputs import hand_over, recorded_keys, recording
from .row_grads import dense, lookup_context


class _BlockFunction(torch.autograd.Function):
    """Autograd boundary of one block: forward keeping no saved tensors past its return, backward by recompute (the kept
    last block: backward through its kept graph).

    Inputs: the call record, the engine's marker leaf, the call's tensor arguments, then the block's
    trainable parameters (host ``nn.Parameter`` objects: only so that ``torch.autograd.grad`` or
    ``backward(inputs=[param])`` on them gets their gradient; an ordinary ``backward()`` sends
    parameter gradients to the host accumulators instead and returns ``None`` for them)."""

    @staticmethod
    def forward(ctx, call: BlockCall, dummy: torch.Tensor, *inputs: torch.Tensor):  # type: ignore[override]
        rc = call.rc
        dev = rc.device
        tensors = inputs[: len(call.tensor_pos)]
        call.input_grad = [t.requires_grad for t in tensors]
        call.rng_cpu = torch.get_rng_state()
        if dev.type == "cuda":
            call.rng_dev = torch.cuda.get_rng_state(dev)
        call.autocast = autocast_state(dev.type)
        if call.keep:
            out = rc._run_kept(call, tensors)
        else:
            lookup = is_lookup(call.block.module)
            call.saved_ops, measure, graph = rc.policy.start(call.block.index, call.fwd, lookup, hidden_shapes(tensors))
            if graph:  # "none" (or an embedding lookup): the call keeps its graph, without its weights
                out = rc._run_kept(call, tensors, GraphHooks(rc.offload if rc.offload_activations else None,
                                                                call.block.name))
            else:  # recomputed in backward: from the module state (flags, buffers) this forward starts from
                call.state = snapshot_state(call.block.module, call.block.name, rc.hook_warnings)
                out = rc._run_block(call, tensors, backward=False, measure=measure)
        out_flat, call.out_spec = tree_flatten(out)
        call.out_pos = [i for i, x in enumerate(out_flat) if isinstance(x, torch.Tensor)]
        call.out_flat = [None if isinstance(x, torch.Tensor) else x for x in out_flat]
        check_outputs(call.block.name, call.out_flat)
        outs = tuple(out_flat[i] for i in call.out_pos)
        call.out_meta = [(tuple(o.shape), o.dtype) for o in outs]
        ctx.call = call
        if call.graph is None:
            rc._save_inputs(call, tensors)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, differentiable(call, outs)) if not d])
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):  # type: ignore[override]
        call: BlockCall = ctx.call
        rc = call.rc
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"megatrain: backward(create_graph=True) (double backward, e.g. a gradient penalty) reached "
                f"streamed block {call.block.name}; streamed blocks are differentiated once. Compute the "
                "penalty with strategy='auto' or without create_graph."
            )
        if call.freed:
            raise RuntimeError(SECOND_BACKWARD + f" (megatrain: streamed block {call.block.name}).")
        n = len(call.tensor_pos)
        needs = ctx.needs_input_grad[2 : 2 + n]
        kind = "all" if leaf_grad_use(rc.dummy) == "accumulate" else "select"
        keep_graph = keeps_graph()
        call.fwd.backward_started = True
        with inplace_input_hint(call.block.name):
            grad_inputs, grad_params = rc._backward_call(call, needs, grad_outs, kind, keep_graph)
        skip_none_calls([r.param for r in call.refs])  # torch calls their hooks next, with None
        return (None, None, *grad_inputs, *grad_params)


class Recompute:
    """Saved inputs, recompute chains and backward of the grad-mode block calls.

    Args:
        device: the compute device.
        store: the host store (slab layout: views of a block's buffer per parameter).
        acct: live-byte accounting and statistics.
        grads: the gradient sink (parameter gradients of a backward go there).
        transport: the device transport (``offload``/``restore_async`` of saved activations: :class:`~.offload.ActivationOffload`).
        acquire: ``acquire(block, backward, training)`` -> slab index -> device buffer (the
            engine's prefetch schedule); released with ``acct.release``.
        bind: ``bind(block, bufs, leaves)``: context manager pointing the block's parameters at views
            of ``bufs`` (or at the given gradient leaves, keyed by ``id(param)``).
        enter_backward: called when a backward starts at a kept graph (before any fetch).
        recompute_every: K: only every K-th call keeps its inputs; the others recompute them.
        offload_activations: kept inputs that need gradients go to host memory.
        policy: what a call keeps besides its inputs (:class:`RecomputePolicy`; default ``"block"``).
        castable: ``castable(param_ref)``: autocast casts it at every use (``"none"`` binds its cast: :mod:`.block_graph`).
    """

    def __init__(self, *, device: torch.device, store: HostStore, acct: ByteAccounting, grads: GradientSink,
                 transport: Any, acquire: Callable[..., dict[int, torch.Tensor]],
                 bind: Callable[..., ContextManager[None]], enter_backward: Callable[[], None],
                 recompute_every: int = 1, offload_activations: bool = False, policy: RecomputePolicy | None = None,
                 castable: Callable[[Any], bool] | None = None):
        self.device, self.store, self.acct, self.grads, self.transport = device, store, acct, grads, transport
        self._acquire, self._bind, self._enter_backward = acquire, bind, enter_backward
        self._castable = castable
        self.recompute_every = recompute_every
        self.offload_activations = offload_activations
        self.offload = ActivationOffload(transport, acct)
        self.policy = policy or RecomputePolicy()
        self.policy.meter.on_change = acct.saw_activations
        self.fwd = ForwardRecord()  # grad-mode block calls of the current forward, in order
        self.kept_open: set[KeptGraph] = set()  # last-block graphs whose backward has not run
        self.dummy = torch.empty(0, device=device, requires_grad=True)  # marker leaf of every call
        self.hook_warnings: set[str] = set()  # blocks warned about forward hooks inside them (block_state)
        self.leaf_check = ForeignLeafCheck(store)

    def call(self, blk: Block, forward: Callable[..., Any], args: tuple, kwargs: dict, keep: bool) -> Any:
        """Run one grad-mode call of ``blk`` (``forward``: the block's own forward) through the
        autograd boundary; ``keep``: the last block of the forward (keeps its graph). Returns what
        ``forward`` returns, its tensors connected to autograd."""
        refuse_func_transforms(blk.name)
        flat, spec = tree_flatten((args, kwargs))
        pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        refs = trainable_refs(blk)
        fwd = self.forward_for(blk)
        keys = recorded_keys()  # e.g. router logits for the load-balancing loss: outputs of the call too
        forward = recording(forward, keys) if keys else forward
        rest = [None if i in pos else x for i, x in enumerate(flat)]
        check_inputs(blk.name, rest)  # a tensor hidden in an object would get no gradient
        call = BlockCall(self, blk, forward, rest, spec, pos, fwd=fwd, refs=refs, keep=keep and bool(fwd.calls))
        with inplace_input_hint(blk.name):
            outs = _BlockFunction.apply(call, self.dummy, *[flat[i] for i in pos], *[r.param for r in refs])
        # the next call may rebuild its inputs from this call's outputs, unless this call keeps its graph
        call.fwd.last_outs = None if call.graph is not None else (call.pos, [weakref.ref(o) for o in outs])
        out_flat = list(call.out_flat)
        for i, o in zip(call.out_pos, outs):
            out_flat[i] = o
        out = tree_unflatten(out_flat, call.out_spec)
        return hand_over(out) if keys else out

    def bound_params(self, blk: Block, refs: list, bufs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """A container's own trainable parameters (``refs``) as autograd-tracked device views of
        ``bufs`` for the span of its forward (:class:`~.bound_params.BoundParams`), keyed by ``id(param)``."""
        views = [self.store.slabs[r.slab].view(bufs[r.slab], r.index) for r in refs]
        outs = BoundParams.apply(self, refs, views, self.dummy, *[r.param for r in refs])
        self.forward_for(blk).direct.append(refs)
        return {id(r.param): o for r, o in zip(refs, outs)}

    def plan_refs(self) -> list[list]:
        """Trainable parameter references of each call of the current forward (containers' included):
        the gradient batches its backward sends."""
        return [c.refs for c in self.fwd.live()] + self.fwd.direct

    def forward_for(self, blk: Block) -> ForwardRecord:
        """The forward record a grad-mode call of ``blk`` belongs to: a new one when ``blk`` is the
        block the current forward started with (a new forward pass)."""
        fwd = self.fwd
        if (fwd.calls or fwd.direct) and blk.index == fwd.first_block:
            earlier_open = not fwd.backward_started and any(not c.freed for c in fwd.live())
            fwd = self.fwd = ForwardRecord(shares_step=earlier_open)
        if not (fwd.calls or fwd.direct):
            fwd.first_block = blk.index
        return fwd

    def _grad_leaves(self, refs: Sequence, bufs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One autograd leaf per parameter of ``refs`` (a view of its device buffer, with its own version counter as
        a separate parameter has: an in-place write to one does not invalidate what autograd saved of another),
        keyed by ``id(param)``."""
        return {id(r.param): self.store.slabs[r.slab].view(bufs[r.slab], r.index).data.requires_grad_(True)
                for r in refs}

    def _run_kept(self, call: BlockCall, tensors: Sequence[torch.Tensor], hooks: GraphHooks | None = None) -> Any:
        """Run a training call with autograd and keep its graph for its backward (no recompute).

        Without ``hooks``: the last block of a training forward, whose backward comes right after the loss:
        its weights stay on the device until then (no second fetch, no second B x T x V logits matmul).
        With ``hooks`` (``recompute="none"``, :mod:`.block_graph`): the graph keeps every saved tensor
        but the block's weights; the buffers are released now and fetched again for the backward. An
        embedding's gradient then goes to the host as the rows its tokens read (:mod:`.row_grads`)."""
        blk = call.block
        bufs = self._acquire(blk, backward=False, training=True)
        leaves = self._grad_leaves(call.refs, bufs)
        inputs = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in tensors]
        args, kwargs = call.arguments(inputs)
        binding, casts = leaves, []
        if hooks is not None and call.autocast is not None and call.autocast[0]:
            binding, casts = self._autocast_copies(blk, bufs, leaves, call.autocast[1])
        t0 = time.perf_counter()
        try:
            rows = lookup_context(blk.module, inputs, self.grads.wire_dtype, not hooks or self.grads.reducer is not None)
            with torch.enable_grad(), self._bind(blk, bufs, binding), rows, \
                    hooks.capture(bufs, casts) if hooks else contextlib.nullcontext(), \
                    plain_chunks() if hooks else contextlib.nullcontext():
                out = own_outputs(call.forward(*args, **kwargs), bufs)
            out_flat, spec = tree_flatten(out)
            outs = [x for x in out_flat if isinstance(x, torch.Tensor)]
            call.out_grad = [o.requires_grad for o in outs]
            self.leaf_check(blk, outs, [*inputs, *leaves.values()])
        except BaseException:  # a refusal leaves no buffer counted as live
            self.acct.release(bufs)
            raise
        finally:
            self.acct.add(compute_s=time.perf_counter() - t0)
        if hooks is not None:
            release_leaves(leaves)
            self.acct.release(bufs)  # the graph holds no weights
            call.graph = KeptGraph(self, {}, leaves, inputs, outs, hooks=hooks)
            fwd = call.fwd
            call.pos, call.offloaded = len(fwd.calls), hooks.offloaded
            fwd.calls.append(weakref.ref(call))
            call.kept_bytes = self.policy.meter.add(call, hooks.nbytes)
        else:
            kept = KeptGraph(self, bufs, leaves, inputs, outs)
            call.graph = kept
            self.kept_open.add(kept)
            weakref.finalize(call, kept.close)  # its graph dropped unused (training_step returned None)
            call.fwd.kept.append(weakref.ref(call))
        # the caller gets detached outputs: autograd connects them to this call's node
        return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in out_flat], spec)

    def _autocast_copies(self, blk: Block, bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor],
                         dtype: torch.dtype) -> tuple[dict[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """``recompute="none"`` under autocast: each weight autocast casts at every use, cast to ``dtype`` now
        (differentiable to its leaf, as autocast's own cast) so the graph saves a copy the hooks can name.
        Returns (what to bind: parameter id -> tensor, the (weight view, copy) pairs)."""
        binding, casts = dict(leaves), []
        done: set[int] = set()
        for ref in blk.params:
            if id(ref.param) in done or self._castable is None or not self._castable(ref):
                continue
            done.add(id(ref.param))
            src = leaves.get(id(ref.param))
            if src is None:
                src = self.store.slabs[ref.slab].view(bufs[ref.slab], ref.index)
            if src.is_floating_point() and src.dtype != dtype:
                with torch.enable_grad():
                    binding[id(ref.param)] = copy = src.to(dtype)
                casts.append((src, copy))
        return binding, casts

    def close_kept(self) -> None:
        """Release every kept last-block graph whose backward has not run (the step is over)."""
        for kept in list(self.kept_open):
            kept.close()

    def _run_block(self, call: BlockCall, tensors: Sequence[torch.Tensor], backward: bool, measure: Any = None):
        """Forward of a call without keeping its graph: in the training forward (``backward=False``) or to
        rebuild a later call's input in backward (a recompute chain, ``backward=True``).

        It runs in grad mode (:mod:`.forward_grad`) on leaves for its inputs (requiring grad as the caller's did)
        and trainable parameters, keeping what its backward reads only until it returns; a call that keeps op outputs
        (``call.saved_ops``) or that "auto" measures (``measure(bufs)``) runs under that context too. Sets ``out_grad``.

        Returns:
            the block's output, its tensors detached."""
        saved = call.saved_ops
        ops = None if backward else (lambda bufs: saved.forward()) if saved is not None else measure
        tensors = [t.detach().requires_grad_(g) if t.is_floating_point() else t for t, g in zip(tensors, call.input_grad)]
        args, kwargs = call.arguments(tensors)
        bufs = self._acquire(call.block, backward=backward, training=not backward)
        t0 = time.perf_counter()
        try:
            leaves = self._grad_leaves(call.refs, bufs)
            with self._bind(call.block, bufs, leaves), torch.enable_grad(), saving_for_the_call(), \
                    ops(bufs) if ops is not None else contextlib.nullcontext(), \
                    plain_chunks() if ops is not None else contextlib.nullcontext():
                out = own_outputs(call.forward(*args, **kwargs), bufs)
            release_leaves(leaves)  # a tensor kept from inside the call (a hook's) must not hold the weights
            if not backward:
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                call.out_grad = [t.requires_grad for t in outs]
                self.leaf_check(call.block, outs, [*tensors, *leaves.values()])
                if saved is not None:
                    saved.recompute_returned(outs)
            return tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        finally:
            self.acct.add(compute_s=time.perf_counter() - t0)
            self.acct.release(bufs)

    def _backward_call(self, call: BlockCall, needs: Sequence[bool], grad_outs: Sequence[torch.Tensor | None],
                       kind: str, keep_graph: bool) -> tuple[list, list]:
        """Backward of one block call: input gradients for autograd, parameter gradients to the host
        accumulators (``kind == "all"``: ``loss.backward()``; under ``backward(inputs=...)`` those of
        the listed parameters) or, under ``torch.autograd.grad``, to autograd for the listed ones.

        Returns:
            (gradients of the call's tensor inputs, gradients of ``call.refs``' parameters), ``None``
            where there is none.
        """
        refs = call.refs
        use = ["accumulate"] * len(refs) if kind == "all" else [leaf_grad_use(r.param) for r in refs]
        leaf_refs = [r for r, u in zip(refs, use) if u is not None]
        kept = call.graph
        if kept is not None:  # the graph kept from the forward: the last block, or recompute="none"
            bufs = None
            if call.keep:
                self._enter_backward()
                self.offload.prefetch(next_offloaded(call.fwd.calls, len(call.fwd.calls)))  # the first call's inputs
                self._prefetch_saved_ops(call.fwd.calls, len(call.fwd.calls))
            else:
                self.offload.prefetch(next_offloaded(call.fwd.calls, call.pos))
                self._prefetch_saved_ops(call.fwd.calls, call.pos)
                if kept.hooks.needs_weights:  # an embedding's backward reads no weight: no fetch
                    bufs = self._acquire(call.block, backward=True)
                    kept.hooks.bind(bufs)
            inputs, outs, leaves = kept.inputs, kept.outs, kept.leaves
            t0 = time.perf_counter()
        else:
            inputs = []
            for t, need in zip(self._load_inputs(call, final=True), needs):
                t = t.detach()
                if need:
                    t.requires_grad_(True)
                inputs.append(t)
            if call.saved_ops is not None:
                self.acct.add(h2d_bytes=call.saved_ops.restore(self.transport))
            self._prefetch_saved_ops(call.fwd.calls, call.pos)  # the next call's, one call ahead
            bufs = self._acquire(call.block, backward=True)
            t0 = time.perf_counter()
            leaves = self._grad_leaves(refs, bufs)
        pre = self.grads.grad_bytes(leaf_refs)
        self.acct.track(pre)  # the parameter gradients autograd is about to allocate
        try:
            if kept is None:
                args, kwargs = call.arguments(inputs)
                saved = call.saved_ops
                ctx = saved.recompute(keep_graph) if saved is not None else contextlib.nullcontext()
                plain = plain_chunks() if saved is not None else contextlib.nullcontext()  # SAC keeps/recomputes
                t1 = time.perf_counter()
                with call.recomputing(), replayed(call, self.device), torch.enable_grad(), \
                        self._bind(call.block, bufs, leaves), ctx, plain:
                    out = call.forward(*args, **kwargs)
                self.acct.add(recompute_s=time.perf_counter() - t1)
                outs = call.recomputed_outputs(out)
            pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
            in_targets = [t for t, need in zip(inputs, needs) if need]
            if any(id(r.param) not in leaves for r in leaf_refs):
                raise RuntimeError(STEPPED_SINCE + f" (megatrain: streamed block {call.block.name}).")
            targets = in_targets + [leaves[id(r.param)] for r in leaf_refs]
            if pairs and targets:
                grads = local_grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                   retain_graph=kept is not None and keep_graph)
            else:
                grads = (None,) * len(targets)
        finally:
            self.acct.add(compute_s=time.perf_counter() - t0)
            del leaves
            if bufs is not None:
                if kept is not None:
                    kept.hooks.unbind()
                self.acct.release(bufs)
        grads_of = dict(zip((id(r) for r in leaf_refs), grads[len(in_targets) :]))
        sent = [r for r, u in zip(refs, use) if u == "accumulate"]
        self.grads.send(sent, [grads_of[id(r)] for r in sent], reserved=pre)
        out_params = [dense(grads_of[id(r)]).to(r.param.device) if u == "capture" and grads_of[id(r)] is not None
                      else None for r, u in zip(refs, use)]
        self._done_backward(call, keep_graph)
        it = iter(grads[: len(in_targets)])
        return [next(it) if need else None for need in needs], out_params

    # ------------------------------------------------------------------ activations
    def _save_inputs(self, call: BlockCall, tensors: Sequence[torch.Tensor]) -> None:
        """Keep what backward needs to rebuild this call's inputs.

        A call that starts a segment (the first after a call that keeps its graph, such as the
        embedding, then every ``recompute_every``-th call) keeps all its tensor inputs (in host
        memory with ``offload_activations``). Other calls keep only a link to the
        output of the previous call they consumed (by identity) and recompute it in backward;
        inputs that are not such outputs (attention masks, rotary cos/sin shared by all blocks)
        are kept by reference, which costs no memory beyond what the model already holds.
        """
        fwd = call.fwd
        call.pos = len(fwd.calls)
        fwd.calls.append(weakref.ref(call))
        prev = fwd.last_outs if (fwd.last_outs and fwd.last_outs[0] == call.pos - 1) else None
        start = prev is None or call.pos - fwd.segment_start >= self.recompute_every
        if start:
            fwd.segment_start = call.pos
        call.saved = []
        kept = 0
        for i, t in enumerate(tensors):
            link = None
            if not start and prev is not None:
                link = next((j for j, o in enumerate(prev[1]) if o() is t), None)
            if link is not None:
                call.links[i] = link
                call.saved.append(None)
            elif self.offload_activations and t.is_floating_point() and t.requires_grad:
                call.offloaded[i] = self.offload.offload(t)
                call.saved.append(None)
            else:
                call.saved.append(t)
                call.versions[i] = t._version
                kept += t.numel() * t.element_size() if t.requires_grad else 0  # masks, cos/sin: shared
        if call.saved_ops is not None and self.offload_activations:
            self.acct.add(d2h_bytes=call.saved_ops.offload(self.transport))
        elif call.saved_ops is not None:
            kept += call.saved_ops.nbytes
        call.kept_bytes = self.policy.meter.add(call, kept)

    def _prefetch_saved_ops(self, calls: list, below: int) -> None:
        """Start restoring the offloaded op outputs of the next call backward restores (``"selective"`` with
        ``offload_activations``), so their H2D copy overlaps the backward before it."""
        saved = next_saved_ops(calls, below) if self.offload_activations else None
        if saved is not None:
            self.acct.add(h2d_bytes=saved.prefetch(self.transport))

    def _load_inputs(self, call: BlockCall, final: bool = False) -> list[torch.Tensor]:
        """The call's tensor inputs, recomputing linked ones from the segment start if needed.
        Offloaded inputs come from the restore prefetched one call ahead (``final``: the call's own
        backward, after which its device copy is dropped; else a recompute chain, which keeps it for
        that backward); then the next call's restore starts."""
        if call.links and (call.pos - 1) not in call.fwd.recomputed:
            self._recompute_chain(call.fwd, call.pos - 1)
        out: list[torch.Tensor] = []
        for i, t in enumerate(call.saved):
            if i in call.links:
                t = call.fwd.recomputed[call.pos - 1][call.links[i]]
            elif i in call.offloaded:
                t = self.offload.take(call.offloaded[i], keep=not final)
            elif t is not None and t._version != call.versions.get(i, t._version):
                raise RuntimeError(
                    f"megatrain: input {i} of block {call.block.name} was modified in place after the block's "
                    "forward; its recompute would be wrong. Make the operation after the block out of place."
                )
            out.append(t)  # type: ignore[arg-type]
        if call.offloaded:
            self.offload.prefetch(next_offloaded(call.fwd.calls, call.pos))
        return out

    def _recompute_chain(self, fwd: ForwardRecord, last: int) -> None:
        """Forward (no autograd) the calls of ``fwd`` from the nearest one with all inputs kept up to
        ``last``, caching each call's outputs for the backward of the call after it."""
        chain = [last]
        while fwd.call(chain[-1]).links and (chain[-1] - 1) not in fwd.recomputed:
            chain.append(chain[-1] - 1)
        for q in reversed(chain):
            c = fwd.call(q)
            if c.freed:
                raise RuntimeError(SECOND_BACKWARD + f" (megatrain: block {c.block.name} is recomputed from freed inputs).")
            inputs = [t.detach() for t in self._load_inputs(c)]
            t0 = time.perf_counter()
            with c.recomputing(), replayed(c, self.device):
                out = self._run_block(c, inputs, backward=True)
            self.acct.add(recompute_s=time.perf_counter() - t0)
            fwd.recomputed[q] = c.recomputed_outputs(out)

    def _done_backward(self, call: BlockCall, keep_graph: bool) -> None:
        """After a call's backward: drop the recomputed input it consumed; unless the graph is retained
        (``retain_graph=True``), free what it saved, as autograd frees saved tensors."""
        call.fwd.recomputed.pop(call.pos - 1, None)
        if keep_graph:
            return
        call.freed = True
        call.saved, call.offloaded, call.versions = [], {}, {}
        if call.saved_ops is not None:
            call.saved_ops.free()
        if call.kept_bytes is not None:
            call.kept_bytes()
        if call.graph is not None:
            call.graph.close()
            call.graph = None
