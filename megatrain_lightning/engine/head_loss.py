"""Chunked LM head + loss through the call users already make: ``model(input_ids=..., labels=...)``.

Applies to each Hugging Face causal LM whose output embedding is a plain ``nn.Linear`` streamed as a
block and whose ``loss_function`` is transformers' ``ForCausalLMLoss`` (its ``forward`` gets an instance
attribute, removed at uninstall). A grad-mode call with ``labels`` of more than ``loss_chunk_size`` tokens
runs the model's forward with a head returning :class:`LazyLogits`, and answers its ``self.loss_function``
with :func:`~.chunked_loss.causal_lm_loss` as a grad-mode call of the head's block. Steps, and the calls
and models left unchanged: docs/internals/long-sequences.md, "LM head + loss".
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..blocks import Block
from .chunked_loss import auto_loss_chunk, causal_lm_loss
from .forward_patch import ForwardPatches

log = logging.getLogger(__name__)

# element-wise operations a model may apply to its logits before the loss (replayed per chunk)
_ELEMENTWISE = {"div", "mul", "add", "sub", "true_divide", "tanh", "float", "to", "__truediv__", "__mul__",
                "__rmul__", "__add__", "__radd__", "__sub__", "div_", "mul_", "tanh_"}
_DATA_GETTERS = {"T", "mT", "H", "mH", "data", "real", "imag"}


def _not_materialised(op: str, chunk: int) -> RuntimeError:
    return RuntimeError(
        f"megatrain: `{op}` needs the values of logits that were not materialised: this training call's LM head "
        f"and loss ran over chunks of {chunk} tokens (strategy option loss_chunk_size, Hydra key "
        "strategy.loss_chunk_size). Set loss_chunk_size=None to get full logits in training forwards with labels "
        "(or call the model without labels). Only element-wise scaling/tanh/casts of the logits before the loss "
        "are supported with a chunked loss.")


@dataclass
class _Pending:
    """One wrapped training call: the head's input, and whether the loss consumed the lazy logits."""

    chunk: int
    hidden: torch.Tensor | None = None
    used: bool = False
    transform: list = field(default_factory=list)


class LazyLogits(torch.Tensor):
    """Stand-in for the ``[..., V]`` logits of a chunked training call: right shape, dtype and device,
    one element of storage. Element-wise operations with scalar operands are recorded into the next lazy
    tensor; any other raises ``RuntimeError`` naming ``loss_chunk_size``."""

    pending: _Pending
    transform: tuple

    @staticmethod
    def make(shape: tuple, dtype: torch.dtype, device: torch.device, pending: _Pending, transform: tuple) -> "LazyLogits":
        t = torch.Tensor._make_subclass(LazyLogits, torch.zeros((), dtype=dtype, device=device).expand(shape))
        t.pending, t.transform = pending, transform
        return t

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, not materialised: loss_chunk_size)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__get__":
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            if attr in _DATA_GETTERS:
                raise _not_materialised(f".{attr}", args[0].pending.chunk)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in ("size", "dim", "numel", "is_floating_point", "element_size", "__len__", "__format__"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        me = args[0] if args and isinstance(args[0], LazyLogits) else None
        if me is not None and name in ("detach", "contiguous"):  # same values (OPT calls lm_head(...).contiguous())
            return me
        operands = list(args[1:]) + list(kwargs.values())
        scalar = all(isinstance(a, (int, float, torch.dtype)) or (torch.is_tensor(a) and a.dim() == 0
                                                                    and not isinstance(a, LazyLogits))
                     for a in operands)
        if me is None or name not in _ELEMENTWISE or not scalar:
            lazy = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, LazyLogits))
            raise _not_materialised(name, lazy.pending.chunk)
        rest = args[1:]
        op: Callable[[torch.Tensor], torch.Tensor] = lambda x: func(x, *rest, **kwargs)  # noqa: E731
        with torch._C.DisableTorchFunctionSubclass():
            dtype = op(torch.zeros(1, dtype=me.dtype, device=me.device)).dtype
        return LazyLogits.make(tuple(me.shape), dtype, me.device, me.pending, me.transform + (op,))


class HeadLoss:
    """Installs the chunked LM head + loss on the causal LMs of ``root`` (module docstring).

    Args:
        root: the module the engine streams.
        chunk: ``loss_chunk_size``: tokens per chunk, ``"auto"`` (:func:`~.chunked_loss.auto_loss_chunk`
            of the model's vocabulary) or ``None`` (nothing installed).
        call_block: the engine's ``call_block(block, forward, args, kwargs, keep=True)``: ``forward`` as a
            grad-mode call of ``block`` whose graph is kept until its backward.
        param_dtype: the dtype the head's weight has while it computes.
    """

    def __init__(self, root: nn.Module, chunk: int | str | None, call_block: Callable[..., Any],
                 param_dtype: Callable[[], torch.dtype]):
        self.root, self.chunk = root, chunk
        self.call_block, self.param_dtype = call_block, param_dtype
        self.installed = ForwardPatches()

    def install(self, blocks: list[Block]) -> None:
        """Wrap each eligible causal LM whose head is one of ``blocks``; log the others and why."""
        if self.chunk is None or self.installed:
            return
        by_module = {id(b.module): b for b in blocks if not b.direct}
        for m in self.root.modules():
            if not (hasattr(m, "get_output_embeddings") and hasattr(type(m), "loss_function")):
                continue
            head = m.get_output_embeddings()
            if head is None:
                continue
            why = self._unsupported(m, head, by_module)
            if why:
                log.info("megatrain: loss_chunk_size: %s computes its full logits and loss (%s).", type(m).__name__, why)
                continue
            chunk = self.chunk if isinstance(self.chunk, int) else auto_loss_chunk(head.out_features)
            self.installed.patch(m, self._wrap(m, m.forward, head, by_module[id(head)], chunk))

    def uninstall(self) -> None:
        self.installed.restore()

    @staticmethod
    def _unsupported(m: nn.Module, head: nn.Module, by_module: dict) -> str:
        from transformers.loss.loss_utils import ForCausalLMLoss

        if type(head).forward is not nn.Linear.forward:
            return f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
        if getattr(getattr(m, "config", None), "is_encoder_decoder", False):  # T5, BART: their own CrossEntropyLoss
            return "it is an encoder-decoder model, which computes its loss itself, not through loss_function"
        if id(head) not in by_module:
            return "its LM head is not a streamed block"
        try:
            if m.loss_function is not ForCausalLMLoss:
                return "its loss_function is not transformers' ForCausalLMLoss"
        except Exception as e:  # noqa: BLE001 - a model without a resolvable loss: leave it alone
            return f"no loss_function ({e})"
        if "labels" not in inspect.signature(m.forward).parameters:
            return "its forward takes no labels"
        return ""

    def _wrap(self, m: nn.Module, orig: Callable[..., Any], head: nn.Linear, blk: Block, chunk: int):
        sig = inspect.signature(orig)

        def forward(*args: Any, **kwargs: Any) -> Any:
            labels = sig.bind_partial(*args, **kwargs).arguments.get("labels")
            if labels is None or not torch.is_grad_enabled() or labels.numel() <= chunk:
                return orig(*args, **kwargs)
            if head._backward_hooks or head._backward_pre_hooks:  # they would never run: the head's backward is chunked
                raise RuntimeError(
                    f"megatrain: the LM head of {type(m).__name__} has backward hooks (register_full_backward_hook / "
                    f"register_full_backward_pre_hook), which do not run when the head and loss are computed over "
                    f"chunks of {chunk} tokens (strategy option loss_chunk_size, Hydra key strategy.loss_chunk_size): "
                    "set loss_chunk_size=None to compute full logits and keep the hooks.")
            pending = _Pending(chunk)
            lazy_head = ForwardPatches()
            lazy_head.patch(head, self._lazy_head(head, pending))
            had_loss, loss_fn = "_loss_function" in m.__dict__, m.__dict__.get("_loss_function")
            m.loss_function = self._loss_hook(head, blk, pending)
            try:
                out = orig(*args, **kwargs)
            finally:
                lazy_head.restore()
                if had_loss:
                    m.loss_function = loss_fn
                else:
                    del m._loss_function
            if pending.hidden is not None and not pending.used:
                raise RuntimeError(f"megatrain: {type(m).__name__} computed its LM head with labels but did not pass "
                                   "the logits to its loss_function; set loss_chunk_size=None for this model.")
            return out

        forward.__wrapped__ = orig  # type: ignore[attr-defined]
        return forward

    def _lazy_head(self, head: nn.Linear, pending: _Pending) -> Callable[[torch.Tensor], LazyLogits]:
        def lazy(hidden: torch.Tensor) -> LazyLogits:
            pending.hidden = hidden
            dev = hidden.device
            if torch.is_autocast_enabled(dev.type):
                dtype = torch.get_autocast_dtype(dev.type)
            else:
                dtype = torch.promote_types(hidden.dtype, self.param_dtype())
            return LazyLogits.make((*hidden.shape[:-1], head.out_features), dtype, dev, pending, ())

        return lazy

    def _loss_hook(self, head: nn.Linear, blk: Block, pending: _Pending) -> Callable[..., torch.Tensor]:
        def loss_function(logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
                          num_items_in_batch: Any = None, ignore_index: int = -100,
                          shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
            if not isinstance(logits, LazyLogits) or logits.pending is not pending or pending.hidden is None:
                raise _not_materialised("loss_function on other logits", pending.chunk)
            pending.used = True
            transform = logits.transform

            def run(h, labels, shift_labels, num_items):
                return causal_lm_loss(h, head.weight, head.bias, labels, pending.chunk, transform, ignore_index,
                                      num_items, shift_labels)

            # keep=True: the loss's backward comes first, so its graph (one chunk's logits at a time) is kept rather
            # than recomputed; never through the recompute policy, which would keep every chunk's logits
            return self.call_block(blk, run, (pending.hidden, labels, shift_labels, num_items_in_batch), {}, keep=True)

        return loss_function
