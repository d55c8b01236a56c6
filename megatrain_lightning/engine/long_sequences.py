"""The long-sequence options, installed together (docs/internals/long-sequences.md): ``loss_chunk_size``
(:mod:`.head_loss`, :mod:`.chunked_loss`) and ``mlp_chunk_size`` (:mod:`.chunked_mlp`). ``offload_activations``
lives in :mod:`.offload`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..blocks import Block
from .chunked_mlp import ChunkedMLP
from .head_loss import HeadLoss


class LongSequences:
    """Chunked LM head + loss and chunked MLP for one engine.

    Args:
        root: the streamed module.
        loss_chunk_size: tokens per loss chunk, ``"auto"`` (256 MiB of fp32 logits per chunk) or ``None``
            (both sizes checked by :class:`~megatrain_lightning.config.MegaTrainConfig`).
        mlp_chunk_size: tokens per MLP chunk, or ``None``.
        call_block: the engine's grad-mode block call (``call_block(block, forward, args, kwargs)``).
        param_dtype: the dtype of the weights while a block computes.
    """

    def __init__(self, root: nn.Module, loss_chunk_size: int | str | None,
                 mlp_chunk_size: int | None, call_block: Callable[..., Any], param_dtype: Callable[[], torch.dtype]):
        self.head_loss = HeadLoss(root, loss_chunk_size, call_block, param_dtype)
        self.mlp = ChunkedMLP(mlp_chunk_size)

    def install(self, blocks: list[Block]) -> None:
        """Wrap the causal LMs' forwards and the MLPs of ``blocks`` (after the block proxies are installed)."""
        self.head_loss.install(blocks)
        self.mlp.install(blocks)

    def uninstall(self) -> None:
        """Restore what :meth:`install` wrapped."""
        self.mlp.uninstall()
        self.head_loss.uninstall()
