"""The autograd boundary of a streamed block: what a training forward keeps, and its backward.

Under grad mode every block call goes through :class:`_BlockFunction`: its forward keeps what the backward needs to
rebuild the block's inputs (:meth:`Boundary._save_inputs`) and the state to replay (:meth:`.records.BlockCall.record`);
its backward fetches the block again, recomputes it and differentiates it locally. The last block of a training
forward (and ``recompute="none"``) keeps its graph instead (:mod:`.kept`). Each training forward has its own
record of calls, so several forwards, ``retain_graph=True`` and ``torch.autograd.grad`` behave as on a plain model
(docs/architecture.md, "A training step"; docs/internals/block-calls.md).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from ...blocks import Block
from ...store.host import HostStore
from ..accounting import ByteAccounting
from ..block_state import snapshot as snapshot_state
from ..chunked_mlp import plain_chunks
from ..grads import GradientSink
from ..offload import ActivationOffload
from ..param_hooks import skip_none_calls
from ..recompute_policy import RecomputePolicy, hidden_shapes, is_lookup
from ..recorded_outputs import hand_over, recorded_keys, recording
from ..row_grads import dense, lookup_context
from .backward import BoundParams, keeps_graph, leaf_grad_use, local_grad
from .forward import saving_for_the_call
from .guards import CallGuards
from .kept import GraphHooks, KeptGraph, own_outputs, release_leaves
from .records import BlockCall, ForwardRecord, trainable_refs
from .runner import BlockRunner


class _BlockFunction(torch.autograd.Function):
    """Autograd boundary of one block call (module docstring).

    Inputs: the call record, the engine's marker leaf, the call's tensor arguments, then the block's trainable host
    parameters (only so that ``torch.autograd.grad`` / ``backward(inputs=[param])`` gets their gradient; a plain
    ``backward()`` sends them to the host accumulators and returns ``None`` for them)."""

    @staticmethod
    def forward(ctx, call: BlockCall, dummy: torch.Tensor, *inputs: torch.Tensor):  # type: ignore[override]
        outs = call.owner.forward(call, inputs[: len(call.tensor_pos)])
        ctx.call = call
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, call.differentiable(outs)) if not d])
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):  # type: ignore[override]
        call: BlockCall = ctx.call
        needs = ctx.needs_input_grad[2 : 2 + len(call.tensor_pos)]
        grad_inputs, grad_params = call.owner.backward(call, needs, grad_outs)
        skip_none_calls([r.param for r in call.refs])  # torch calls their hooks next, with None
        return (None, None, *grad_inputs, *grad_params)


class Boundary:
    """Block calls, saved inputs, recompute chains and backward of the grad-mode block calls.

    Args:
        device: the compute device.
        store: the host store (names a parameter in the guards' refusals).
        acct: live-byte accounting and statistics.
        grads: the gradient sink (parameter gradients of a backward go there).
        transport: the device transport (saved activations' offload: :class:`~..offload.ActivationOffload`).
        runner: the block runner (:class:`~.runner.BlockRunner`).
        enter_backward: called when a backward starts at a kept graph (before any fetch).
        recompute_every: K: only every K-th call keeps its inputs; the others recompute them.
        offload_activations: kept inputs that need gradients go to host memory.
        policy: what a call keeps besides its inputs (:class:`RecomputePolicy`; default ``"block"``).
        castable: ``castable(param_ref)``: autocast casts it at every use (``"none"`` binds its cast: :mod:`.kept`).
    """

    def __init__(self, *, device: torch.device, store: HostStore, acct: ByteAccounting, grads: GradientSink,
                 transport: Any, runner: BlockRunner, enter_backward: Callable[[], None],
                 recompute_every: int = 1, offload_activations: bool = False, policy: RecomputePolicy | None = None,
                 castable: Callable[[Any], bool] | None = None):
        self.device, self.acct, self.grads, self.transport = device, acct, grads, transport
        self.runner, self._enter_backward, self._castable = runner, enter_backward, castable
        self.recompute_every = recompute_every
        self.offload_activations = offload_activations
        self.offload = ActivationOffload(transport, acct)
        self.policy = policy or RecomputePolicy()
        self.policy.report_to(lambda nbytes: acct.peak(saved_activation_bytes=nbytes))  # the most seen
        self.fwd = ForwardRecord()  # grad-mode block calls of the current forward, in order
        self.kept_open: set[KeptGraph] = set()  # last-block graphs whose backward has not run
        self.dummy = torch.empty(0, device=device, requires_grad=True)  # marker leaf of every call
        self.guards = CallGuards(store)

    # ------------------------------------------------------------------ calls
    def call(self, blk: Block, forward: Callable[..., Any], args: tuple, kwargs: dict, keep: bool) -> Any:
        """Run one grad-mode call of ``blk`` (``forward``: its own forward) through the autograd boundary; ``keep``:
        keep its graph. Returns what ``forward`` returns, its tensors connected to autograd."""
        flat, spec = tree_flatten((args, kwargs))
        pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        rest = [None if i in pos else x for i, x in enumerate(flat)]
        with self.guards.call(blk.name, rest):
            fwd = self.forward_for(blk)
            keys = recorded_keys()  # e.g. router logits for the load-balancing loss: outputs of the call too
            call = BlockCall(self, blk, recording(forward, keys) if keys else forward, rest, spec, pos, fwd=fwd,
                             refs=trainable_refs(blk), keep=keep and bool(fwd.calls))
            outs = _BlockFunction.apply(call, self.dummy, *[flat[i] for i in pos], *[r.param for r in call.refs])
        fwd.returned(call, outs)
        out = call.outputs(outs)
        return hand_over(out) if keys else out

    def bound_params(self, blk: Block, refs: list, bufs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """A container's own trainable parameters ``refs`` as autograd-tracked views of ``bufs``
        (:class:`~.backward.BoundParams`), keyed by ``id(param)``."""
        views = [self.runner.view(r, bufs) for r in refs]
        outs = BoundParams.apply(self.grads, refs, views, self.dummy, *[r.param for r in refs])
        self.forward_for(blk).add_direct(refs)
        return {id(r.param): o for r, o in zip(refs, outs)}

    def plan_refs(self) -> list[list]:
        """Trainable parameter references of each call of the current forward, containers' included (the gradient
        batches its backward sends)."""
        return [c.refs for c in self.fwd.live()] + self.fwd.direct

    def forward_for(self, blk: Block) -> ForwardRecord:
        """The forward record a grad-mode call of ``blk`` belongs to: a new one when ``blk`` started the current one."""
        fwd = self.fwd
        if fwd.started and blk.index == fwd.first_block:
            earlier_open = not fwd.backward_started and any(not c.freed for c in fwd.live())
            fwd = self.fwd = ForwardRecord(shares_step=earlier_open)
        fwd.enter(blk.index)
        return fwd

    def end_forward(self) -> list[int]:
        """A backward starts: the current forward is over. Returns its backward's block fetch order."""
        self.fwd.end()
        return self.fwd.backward_sequence()

    def held_numel(self) -> int:
        """Elements of the device buffers that kept last-block graphs hold."""
        return sum(b.numel() for k in list(self.kept_open) for b in k.bufs.values())

    def close_kept(self) -> None:
        """Release every kept last-block graph whose backward has not run (the step is over)."""
        for kept in list(self.kept_open):
            kept.close()

    def _closed(self, kept: KeptGraph) -> None:
        self.kept_open.discard(kept)
        self.acct.release(kept.bufs)

    # ------------------------------------------------------------------ forward
    def forward(self, call: BlockCall, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Forward of ``call`` inside the autograd function: run keeping its graph (the last block; ``"none"`` and
        embedding lookups without the weights) or what its recompute needs. Returns its tensor outputs, detached."""
        call.record(tensors, self.device)
        if call.keep:
            out = self._run_kept(call, tensors)
        else:
            saved_ops, measure, graph = self.policy.start(call.block.index, call.fwd, is_lookup(call.block.module),
                                                          hidden_shapes(tensors))
            if graph:  # "none" (or an embedding lookup): the call keeps its graph, without its weights
                out = self._run_kept(call, tensors, GraphHooks(self.offload if self.offload_activations else None,
                                                                call.block.name))
            else:  # recomputed in backward: from the module state (flags, buffers) this forward starts from
                call.recomputed_with(saved_ops, snapshot_state(call.block.module, call.block.name,
                                                               self.guards.hook_warnings))
                out = self._run_block(call, tensors, backward=False, measure=measure)
        outs = call.record_outputs(out)
        if call.graph is None:
            self._save_inputs(call, tensors)
        return outs

    def _run_kept(self, call: BlockCall, tensors: Sequence[torch.Tensor], hooks: GraphHooks | None = None) -> Any:
        """Run a training call with autograd and keep its graph for its backward.

        Without ``hooks``: the last block, whose backward comes right after the loss: its weights stay on the device
        (no second fetch, no second B x T x V logits matmul). With ``hooks`` (``recompute="none"``, :mod:`.kept`):
        the buffers are released now and fetched again for the backward; an embedding's gradient goes to the host
        as rows (:mod:`..row_grads`)."""
        blk = call.block
        inputs = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in tensors]
        args, kwargs = call.arguments(inputs)
        with self.runner.weights(blk, training=True, hold=hooks is None) as bufs:
            leaves = self.runner.leaves(call.refs, bufs)
            binding, casts = leaves, []
            if hooks is not None and call.autocast is not None and call.autocast[0]:
                binding, casts = self._autocast_copies(blk, bufs, leaves, call.autocast[1])
            rows = lookup_context(blk.module, inputs, self.grads.wire_dtype, not hooks or self.grads.reducer is not None)
            with torch.enable_grad(), self.runner.bind(blk, bufs, binding), rows, \
                    hooks.capture(bufs, casts) if hooks else contextlib.nullcontext(), \
                    plain_chunks() if hooks else contextlib.nullcontext():
                out = own_outputs(call.forward(*args, **kwargs), bufs)
            out_flat, spec = tree_flatten(out)
            outs = [x for x in out_flat if isinstance(x, torch.Tensor)]
            call.ran(outs)
            self.guards.forward(blk, out_flat, outs, [*inputs, *leaves.values()])
            if hooks is not None:
                release_leaves(leaves)  # the graph holds no weights: the buffers are released now
                kept = KeptGraph({}, leaves, inputs, outs, hooks=hooks)
            else:
                kept = KeptGraph(bufs, leaves, inputs, outs, on_close=self._closed)  # type: ignore[arg-type]
                self.kept_open.add(kept)
        call.keep_graph(kept)
        if hooks is not None:
            call.metered(self.policy.meter.add(call, hooks.nbytes))
        # the caller gets detached outputs: autograd connects them to this call's node
        return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in out_flat], spec)

    def _autocast_copies(self, blk: Block, bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor],
                         dtype: torch.dtype) -> tuple[dict[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """``recompute="none"`` under autocast: each castable weight cast to ``dtype`` now (differentiably, as
        autocast's cast) so the hooks can name the saved copy. Returns (parameter id -> what to bind, the (weight
        view, copy) pairs)."""
        binding, casts = dict(leaves), []
        done: set[int] = set()
        for ref in blk.params:
            if id(ref.param) in done or self._castable is None or not self._castable(ref):
                continue
            done.add(id(ref.param))
            src = leaves.get(id(ref.param))
            if src is None:
                src = self.runner.view(ref, bufs)
            if src.is_floating_point() and src.dtype != dtype:
                with torch.enable_grad():
                    binding[id(ref.param)] = copy = src.to(dtype)
                casts.append((src, copy))
        return binding, casts

    def _run_block(self, call: BlockCall, tensors: Sequence[torch.Tensor], backward: bool, measure: Any = None):
        """Forward of a call without keeping its graph (:mod:`.forward`): in the training forward
        (``backward=False``; under ``call.saved_ops`` or "auto"'s ``measure(bufs)``, sets ``out_grad``) or to rebuild
        a later call's input in backward (a recompute chain). Returns the block's output, its tensors detached."""
        saved = call.saved_ops
        ops = None if backward else (lambda bufs: saved.forward()) if saved is not None else measure
        tensors = [t.detach().requires_grad_(g) if t.is_floating_point() else t for t, g in zip(tensors, call.input_grad)]
        args, kwargs = call.arguments(tensors)
        with self.runner.weights(call.block, backward=backward, training=not backward) as bufs:
            leaves = self.runner.leaves(call.refs, bufs)
            with self.runner.bind(call.block, bufs, leaves), torch.enable_grad(), saving_for_the_call(), \
                    ops(bufs) if ops is not None else contextlib.nullcontext(), \
                    plain_chunks() if ops is not None else contextlib.nullcontext():
                out = own_outputs(call.forward(*args, **kwargs), bufs)
            release_leaves(leaves)  # a tensor kept from inside the call (a hook's) must not hold the weights
            if not backward:
                flat = tree_flatten(out)[0]
                outs = [t for t in flat if isinstance(t, torch.Tensor)]
                call.ran(outs)
                self.guards.forward(call.block, flat, outs, [*tensors, *leaves.values()])
                if saved is not None:
                    saved.recompute_returned(outs)
            return tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    def _save_inputs(self, call: BlockCall, tensors: Sequence[torch.Tensor]) -> None:
        """Keep what backward needs to rebuild this call's inputs (:meth:`BlockCall.save_inputs`) and the op outputs a
        ``"selective"`` call keeps; the bytes kept go to the activation meter."""
        prev, start = call.fwd.segment(len(call.fwd.calls), self.recompute_every)
        kept = call.save_inputs(tensors, prev, start, self.offload if self.offload_activations else None)
        if call.saved_ops is not None and self.offload_activations:
            self.acct.add(d2h_bytes=call.saved_ops.offload(self.transport))
        elif call.saved_ops is not None:
            kept += call.saved_ops.nbytes
        call.metered(self.policy.meter.add(call, kept))

    # ------------------------------------------------------------------ backward
    def backward(self, call: BlockCall, needs: Sequence[bool], grad_outs: Sequence[torch.Tensor | None]
                 ) -> tuple[list, list]:
        """Backward of one block call (``needs``: which tensor inputs need a gradient): parameter gradients go to the
        host accumulators or, where captured (:func:`~.backward.leaf_grad_use`), to autograd.

        Returns:
            (gradients of the call's tensor inputs, gradients of ``call.refs``' parameters), ``None``
            where there is none.
        """
        refs = call.refs
        accumulate = leaf_grad_use(self.dummy) == "accumulate"
        use = ["accumulate"] * len(refs) if accumulate else [leaf_grad_use(r.param) for r in refs]
        leaf_refs = [r for r, u in zip(refs, use) if u is not None]
        with self.guards.backward(call, leaf_refs):
            keep_graph = keeps_graph()
            call.fwd.start_backward()
            grads, n_in, pre = self._local_grads(call, needs, grad_outs, leaf_refs, keep_graph)
            grads_of = dict(zip((id(r) for r in leaf_refs), grads[n_in:]))
            sent = [r for r, u in zip(refs, use) if u == "accumulate"]
            self.grads.send(sent, [grads_of[id(r)] for r in sent], reserved=pre)
            out_params = [dense(grads_of[id(r)]).to(r.param.device) if u == "capture" and grads_of[id(r)] is not None
                          else None for r, u in zip(refs, use)]
            call.fwd.consumed(call.pos)  # the recomputed input it read
            if not keep_graph:
                call.free()
        it = iter(grads[:n_in])
        return [next(it) if need else None for need in needs], out_params

    def _local_grads(self, call: BlockCall, needs: Sequence[bool], grad_outs: Sequence[torch.Tensor | None],
                     leaf_refs: list, keep_graph: bool) -> tuple[tuple, int, int]:
        """The call's local backward, through its kept graph or its recompute.

        Returns:
            (gradients of the inputs that need one, then of ``leaf_refs``' parameters; how many inputs need one;
            the gradient bytes reserved in the accounting)."""
        kept, fwd = call.graph, call.fwd
        if kept is None:
            inputs = [t.detach().requires_grad_(need) for t, need in zip(self._inputs(call, final=True), needs)]
            if call.saved_ops is not None:
                self.acct.add(h2d_bytes=call.saved_ops.restore(self.transport))
            self._prefetch_saved_ops(fwd, call.pos)  # the next call's, one call ahead
        else:  # the graph kept from the forward: the last block, or recompute="none"
            if call.keep:
                self._enter_backward()
            below = len(fwd.calls) if call.keep else call.pos  # the last block: the first call's inputs
            self.offload.prefetch(fwd.next_offloaded(below))
            self._prefetch_saved_ops(fwd, below)
            inputs = kept.inputs
        fetch = kept is None or (not call.keep and kept.hooks.needs_weights)  # an embedding's backward reads no weight
        with self.runner.weights(call.block, backward=True, fetch=fetch) as bufs:
            if kept is not None and bufs is not None:
                kept.hooks.bind(bufs)
            leaves = kept.leaves if kept is not None else self.runner.leaves(call.refs, bufs)
            pre = self.grads.grad_bytes(leaf_refs)
            self.acct.track(pre)  # the parameter gradients autograd is about to allocate
            try:
                outs = kept.outs if kept is not None else self._recompute(call, inputs, bufs, leaves, keep_graph)
                pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
                in_targets = [t for t, need in zip(inputs, needs) if need]
                targets = in_targets + [leaves[id(r.param)] for r in leaf_refs]
                if pairs and targets:
                    grads = local_grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                       retain_graph=kept is not None and keep_graph)
                else:
                    grads = (None,) * len(targets)
            finally:
                del leaves
                if kept is not None and bufs is not None:
                    kept.hooks.unbind()
        return grads, len(in_targets), pre

    def _recompute(self, call: BlockCall, inputs: list, bufs: Any, leaves: dict, keep_graph: bool) -> list:
        """The call's forward run again with autograd for its own backward. Returns its tensor outputs."""
        args, kwargs = call.arguments(inputs)
        saved = call.saved_ops
        ctx = saved.recompute(keep_graph) if saved is not None else contextlib.nullcontext()
        plain = plain_chunks() if saved is not None else contextlib.nullcontext()  # SAC keeps/recomputes
        t1 = time.perf_counter()
        with self.guards.recompute(call), call.replayed(self.device), torch.enable_grad(), \
                self.runner.bind(call.block, bufs, leaves), ctx, plain:
            out = call.forward(*args, **kwargs)
        self.acct.add(recompute_s=time.perf_counter() - t1)
        return self.guards.recomputed(call, out)

    # ------------------------------------------------------------------ activations
    def _prefetch_saved_ops(self, fwd: ForwardRecord, below: int) -> None:
        """Start restoring the next call's offloaded op outputs, so their H2D copy overlaps this backward."""
        saved = fwd.next_saved_ops(below) if self.offload_activations else None
        if saved is not None:
            self.acct.add(h2d_bytes=saved.prefetch(self.transport))

    def _inputs(self, call: BlockCall, final: bool = False) -> list[torch.Tensor]:
        """The call's tensor inputs (:meth:`BlockCall.load_inputs`), recomputing linked ones if needed."""
        if call.links and (call.pos - 1) not in call.fwd.recomputed:
            self._recompute_chain(call.fwd, call.pos - 1)
        return call.load_inputs(self.offload, final)

    def _recompute_chain(self, fwd: ForwardRecord, last: int) -> None:
        """Forward the calls of ``fwd`` from the nearest one with all inputs kept up to ``last``, caching each call's
        outputs for the backward of the call after it."""
        chain = [last]
        while fwd.call(chain[-1]).links and (chain[-1] - 1) not in fwd.recomputed:
            chain.append(chain[-1] - 1)
        for q in reversed(chain):
            c = fwd.call(q)
            inputs = [t.detach() for t in self._inputs(c)]
            t0 = time.perf_counter()
            with self.guards.recompute(c), c.replayed(self.device):
                out = self._run_block(c, inputs, backward=True)
            self.acct.add(recompute_s=time.perf_counter() - t0)
            fwd.keep_recomputed(q, self.guards.recomputed(c, out))
