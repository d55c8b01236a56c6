"""Cross-entropy of a linear LM head over chunks of tokens, never materialising all logits.

The forward computes and frees each chunk's logits; the backward recomputes them and takes their gradient
by autograd on the chunk's loss (so every dtype step is the full computation's). Per-token values are the
full computation's; only the sums over tokens run in another order (docs/internals/long-sequences.md).
``transform``: the element-wise operations the model applies before its loss (Gemma 2's soft-capping),
recorded by :mod:`.head_loss` and replayed on each chunk.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..config import check_chunk_size

DEFAULT_LOSS_CHUNK_BYTES = 256 * 2**20
"""Bytes of fp32 logits per chunk when ``loss_chunk_size="auto"`` (256 MiB: 523 tokens of a
128,256-token vocabulary, 2,097 of a 32,000-token one). A chunk's backward holds about four such tensors."""

Transform = Sequence[Callable[[torch.Tensor], torch.Tensor]]


def auto_loss_chunk(vocab_size: int, chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES) -> int:
    """Tokens per loss chunk whose fp32 logits (``tokens x vocab_size x 4`` bytes) fit in ``chunk_bytes``, >= 1."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def _chunk_loss(logits: torch.Tensor, target: torch.Tensor, transform: Transform, ignore_index: int) -> torch.Tensor:
    for op in transform:
        logits = op(logits)
    # what transformers' ForCausalLMLoss does with the logits: .float(), cross_entropy (sum)
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")


class _ChunkedLinearCE(torch.autograd.Function):
    """:func:`chunked_linear_cross_entropy`'s autograd function; saves its inputs, no logits."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, chunk: int, transform: Transform, ignore_index: int):  # type: ignore[override]
        dev = h.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.chunk, ctx.transform, ctx.ignore_index = chunk, transform, ignore_index
        ctx.save_for_backward(h, weight, bias, target)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], weight, bias)
            total = total + _chunk_loss(logits, target[s : s + chunk], transform, ignore_index)
            del logits
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        h, weight, bias, target = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        dev = h.device.type
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        acc = torch.promote_types(torch.float32, weight.dtype)  # fp32 sums (fp64 for fp64 weights)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        mm_dtype = weight.dtype
        with torch.autocast(dev, dtype=dtype, enabled=enabled):
            for s in range(0, h.shape[0], ctx.chunk):
                hc = h[s : s + ctx.chunk]
                with torch.no_grad():
                    logits = F.linear(hc, weight, bias)  # the dtype the full head computes in
                x = logits.detach().requires_grad_(True)
                with torch.enable_grad():
                    loss = _chunk_loss(x, target[s : s + ctx.chunk], ctx.transform, ctx.ignore_index)
                    (dx,) = torch.autograd.grad(loss, x, grad_out)
                del logits, x, loss
                mm_dtype = dx.dtype
                with torch.autocast(dev, enabled=False):
                    if need_h:  # linear's input gradient in the matmul dtype, cast back as autocast's backward does
                        grad_h[s : s + ctx.chunk] = (dx @ weight.to(dx.dtype)).to(h.dtype)
                    if need_w:  # fp32 sums of the exact products
                        grad_w.addmm_(dx.t().to(acc), hc.to(dx.dtype).to(acc))
                    if need_b:
                        grad_b.add_(dx.to(acc).sum(0))
                del dx
        # the full computation rounds the summed weight/bias gradient to the matmul dtype once
        if grad_w is not None:
            grad_w = grad_w.to(mm_dtype).to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(mm_dtype).to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 target: torch.Tensor, chunk: int, transform: Transform = (),
                                 ignore_index: int = -100) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of ``transform(h @ weight.T + bias)``, chunked.

    Args:
        h: ``[N, H]`` hidden states (the head's input), any float dtype; may require grad.
        weight: ``[V, H]`` head weight; ``bias``: ``[V]`` or ``None``.
        target: ``[N]`` int64 class indices; ``ignore_index`` entries contribute 0.
        chunk: tokens whose logits (``chunk x V``) exist at once, forward and backward.
        transform: element-wise operations applied to the raw logits before ``.float()`` and the loss.
        ignore_index: label value that is not a target (transformers: -100).

    Returns:
        A 0-dim fp32 tensor, differentiable with respect to ``h``, ``weight`` and ``bias``: the ``reduction="sum"``
        cross-entropy up to the order of the sums over tokens.

    Raises:
        ValueError: ``chunk`` not a positive int, or ``h`` and ``target`` disagree in length.
    """
    check_chunk_size("loss_chunk_size", chunk, allow_auto=False)
    if chunk is None or h.dim() != 2 or target.shape != h.shape[:1]:
        raise ValueError(f"megatrain: chunked loss needs h [N, H] and target [N] and a chunk size; got h "
                         f"{tuple(h.shape)}, target {tuple(target.shape)}, chunk {chunk!r}.")
    return _ChunkedLinearCE.apply(h, weight, bias, target, chunk, tuple(transform), ignore_index)


def causal_lm_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor | None,
                   chunk: int, transform: Transform = (), ignore_index: int = -100,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   shift_labels: torch.Tensor | None = None, drop_ignored: bool | None = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``transform(linear(h))``, chunked over tokens.

    Labels are shifted as Hugging Face does unless ``shift_labels`` is given; ``ignore_index`` tokens
    contribute exactly zero loss and gradient; the mean is over the other tokens, or the sum divided by
    ``num_items_in_batch``. ``drop_ignored`` (default: on a CPU device) drops ignored tokens before the head;
    on an accelerator that would need their number on the host (a sync per micro-batch), so they go through.

    Args:
        h: ``[B, T, H]`` hidden states; ``labels`` / ``shift_labels``: ``[B, T]`` int64.
        Others: as :func:`chunked_linear_cross_entropy` and transformers' ``ForCausalLMLoss``.

    Returns:
        A 0-dim fp32 loss.

    Raises:
        ValueError: the labels' shape is not ``h``'s without its last dimension (``logits_to_keep``
            with labels), as the full computation would fail too.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if tuple(shift_labels.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"megatrain: labels of shape {tuple(shift_labels.shape)} do not match the hidden states "
                         f"{tuple(h.shape[:-1])} given to the LM head (logits_to_keep with labels?).")
    flat_t = shift_labels.reshape(-1).to(h.device)
    flat_h = h.reshape(-1, h.shape[-1])
    if drop_ignored if drop_ignored is not None else h.device.type == "cpu":  # no device to wait for
        keep = (flat_t != ignore_index).nonzero().squeeze(1)
        flat_h, flat_t = flat_h.index_select(0, keep), flat_t.index_select(0, keep)
        count: torch.Tensor | int = keep.numel()
    else:
        count = (flat_t != ignore_index).sum()
    total = chunked_linear_cross_entropy(flat_h, weight, bias, flat_t, chunk, transform, ignore_index)
    if num_items_in_batch is None:
        return total / count  # nll_loss "mean": sum / number of targets (0/0 = nan, as there)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
