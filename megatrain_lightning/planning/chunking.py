"""Device bytes of the LM head + loss and of one block's MLP in a training step, with and without the
long-sequence options (``loss_chunk_size``, ``mlp_chunk_size``: docs/architecture.md, "Long
sequences"), for the planner's per-token activation figures and its longest-sequence answer.

Each function returns ``(per_token, constant)`` bytes: the step's peak for ``tokens`` tokens is
``per_token * tokens + constant`` (``tokens`` = batch x sequence length). Sources: the tensors
autograd keeps in ``torch.nn.functional.cross_entropy`` (its ``log_softmax`` output) and
transformers' Llama MLP (gate, up, activation, product), and what ``engine/chunked_loss.py`` /
``engine/chunked_mlp.py`` allocate; compared with ``bench/long_context.py`` (README, "Long
sequences": measured bytes per token).
"""

from __future__ import annotations

from ..engine.chunked_loss import DEFAULT_LOSS_CHUNK_BYTES, auto_loss_chunk

LOSS_LIVE_TENSORS = 4
"""Tensors of ``tokens x vocab`` fp32 alive together at the head's backward: the logits (kept with the
last block's graph), the log-softmax ``cross_entropy`` saves, its gradient and the logits' gradient.
The chunked loss holds the same four for one chunk."""

MLP_SAVED = 4
"""``tokens x intermediate`` tensors a gated MLP keeps for backward (gate and up projections, the
activation, their product: Llama, Mistral, Qwen, Gemma)."""


def loss_chunk_tokens(loss_chunk_size: int | str | None, vocab: int) -> int | None:
    """Tokens per loss chunk for the strategy option (``"auto"``: 256 MiB of fp32 logits), or ``None``."""
    if loss_chunk_size is None:
        return None
    return auto_loss_chunk(vocab, DEFAULT_LOSS_CHUNK_BYTES) if loss_chunk_size == "auto" else int(loss_chunk_size)


def head_loss_bytes(vocab: int, hidden: int, act_bytes: int, loss_chunk_size: int | str | None) -> tuple[int, int]:
    """``(per_token, constant)`` device bytes of the LM head + cross-entropy at its backward.

    Full computation: :data:`LOSS_LIVE_TENSORS` fp32 ``vocab`` rows per token (plus the 16-bit logits
    under autocast, ``act_bytes < 4``). Chunked: the same rows for one chunk only (``constant``), and per
    token the head's input, its copy without ignored labels and their gradients (4 x hidden x
    ``act_bytes``); the fp32 weight gradient accumulator (vocab x hidden x 4) is in ``constant``.
    """
    row = LOSS_LIVE_TENSORS * 4 * vocab + (2 * vocab if act_bytes < 4 else 0)
    chunk = loss_chunk_tokens(loss_chunk_size, vocab)
    if chunk is None:
        return row, 0
    return 4 * hidden * act_bytes, chunk * row + vocab * hidden * 4


def mlp_bytes(intermediate: int, hidden: int, act_bytes: int, mlp_chunk_size: int | None) -> tuple[int, int]:
    """``(per_token, constant)`` device bytes one block's MLP keeps for its backward (the block's
    recompute runs it with autograd). Chunked: each chunk is checkpointed, so only its input and output
    rows stay per token (2 x hidden) and the intermediates of one chunk are ``constant``."""
    inter = MLP_SAVED * intermediate * act_bytes
    if mlp_chunk_size is None:
        return inter, 0
    return 2 * hidden * act_bytes, mlp_chunk_size * inter
