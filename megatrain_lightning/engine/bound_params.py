"""A container's own parameters on the device for the span of its ``forward`` (docs/internals/block-calls.md,
"Block discovery": a container that owns parameters used directly in its forward)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .backward_state import leaf_grad_use
from .param_hooks import skip_none_calls

if TYPE_CHECKING:
    from .recompute import Recompute


class BoundParams(torch.autograd.Function):
    """A container's own parameters on the device for the span of its ``forward`` (a direct block:
    they are used outside any block call, so there is nothing to recompute and ordinary autograd
    tracks them).

    Inputs: the :class:`Recompute`, the parameters' references, their device views (the fetched buffer), the
    engine's marker leaf, then the host parameters. Outputs: the device views, as tensors autograd
    tracks. Backward: ``loss.backward()`` sends their gradients to the host accumulators;
    ``torch.autograd.grad`` / ``backward(inputs=...)`` returns them for the parameters listed."""

    @staticmethod
    def forward(ctx, rc: "Recompute", refs: list, views: list, dummy: torch.Tensor,
                *params: torch.Tensor):  # type: ignore[override]
        ctx.rc, ctx.refs = rc, refs
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        rc, refs = ctx.rc, ctx.refs
        if torch.is_grad_enabled():
            raise RuntimeError(
                "megatrain: backward(create_graph=True) (double backward) reached a container's own parameters; "
                "streamed models are differentiated once."
            )
        none = (None, None, None, None)
        skip_none_calls([r.param for r in refs])  # torch calls their hooks after this backward, with None or not
        if leaf_grad_use(rc.dummy) == "accumulate":
            rc.grads.send(refs, list(grads))
            return none + (None,) * len(refs)
        use = [leaf_grad_use(r.param) for r in refs]
        rc.grads.send([r for r, u in zip(refs, use) if u == "accumulate"],
                        [g for g, u in zip(grads, use) if u == "accumulate"])
        return none + tuple(g.to(r.param.device) if g is not None and u == "capture" else None
                            for r, g, u in zip(refs, grads, use))


@contextlib.contextmanager
def bind_params(slabs: Any, blk: Any, bufs: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor] | None
                ) -> Iterator[None]:
    """For the ``with`` body, point the block's parameters (``owner._parameters[attr]``) at views of the device
    buffers ``bufs`` (per slab index, laid out as ``slabs[i]``) or at gradient ``leaves`` (by parameter id); in
    no-grad mode a trainable one's view requires grad as in plain PyTorch (``F.linear`` on a non-contiguous input
    picks its kernel by it). The registered parameters are put back afterwards.

    Raises:
        RuntimeError: a parameter is no longer registered as it was at setup (``ParamRef.registered``: pruning,
            a replaced ``nn.Parameter``).
    """
    saved = []
    try:
        for ref in blk.params:
            if leaves is not None and id(ref.param) in leaves:
                t = leaves[id(ref.param)]
            else:
                t = slabs[ref.slab].view(bufs[ref.slab], ref.index)
                t = t if torch.is_grad_enabled() or not ref.param.requires_grad else t.detach().requires_grad_()
            saved.append((ref.owner, ref.attr, ref.registered()))
            ref.owner._parameters[ref.attr] = t
        yield
    finally:
        for owner, attr, p in reversed(saved):
            owner._parameters[attr] = p
