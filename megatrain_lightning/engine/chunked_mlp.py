"""The MLP of each block over chunks of the sequence (``mlp_chunk_size``).

A decoder layer's MLP keeps the block's largest activations for backward (gate, up, activation, product:
Llama's intermediate is 3.5 x hidden). It is per token, so chunks of the sequence give the same values.
Under grad mode each chunk is a non-reentrant ``torch.utils.checkpoint``, so backward holds one chunk's
intermediates; cost: one more MLP forward per block in backward (docs/internals/long-sequences.md, "MLP").
The MLP child (:data:`MLP_NAMES`) gets an instance ``forward``, removed at uninstall; inputs ``[B, T, H]``
with ``T > mlp_chunk_size`` are chunked along ``T``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..blocks import Block
from .block_state import has_user_hooks
from .forward_patch import ForwardPatches
from .recorded_outputs import over_chunks

log = logging.getLogger(__name__)

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
"""Child names of a block's MLP, first match wins."""


def _random_parts(mlp: nn.Module) -> list[str]:
    """What in ``mlp`` draws random numbers in training: dropout with ``p > 0``, router jitter noise (PhiMoE)."""
    found = []
    for name, m in mlp.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            found.append(f"{name or 'mlp'}: {type(m).__name__}(p={m.p})")
        jitter = getattr(m, "router_jitter_noise", None) or getattr(m, "jitter_noise", None)
        if isinstance(jitter, (int, float)) and jitter > 0:
            found.append(f"{name or 'mlp'}: router jitter noise {jitter}")
    return found


@contextlib.contextmanager
def _bound(slots: list[tuple[nn.Module, str]], tensors: tuple) -> Iterator[None]:
    """Point each ``module._parameters[name]`` of ``slots`` at the matching tensor for the block."""
    saved = [m._parameters[k] for m, k in slots]
    try:
        for (m, k), t in zip(slots, tensors):
            m._parameters[k] = t
        yield
    finally:
        for (m, k), t in zip(slots, saved):
            m._parameters[k] = t


_state = threading.local()


@contextlib.contextmanager
def plain_chunks() -> Iterator[None]:
    """Inside: :func:`chunked_call` does not checkpoint its chunks (this thread). For calls that selective
    activation checkpointing manages: its policy already keeps or recomputes each op's output, and a checkpoint
    would drop what it kept and run the MLP forward once more."""
    prev = getattr(_state, "plain", False)
    _state.plain = True
    try:
        yield
    finally:
        _state.plain = prev


def chunked_call(forward: Callable[[torch.Tensor], Any], x: torch.Tensor, chunk: int,
                 module: nn.Module | None = None) -> torch.Tensor:
    """``forward(x)`` for ``x`` ``[B, T, ...]`` computed over ``x[:, s:s + chunk]`` and concatenated along
    dim 1; each chunk checkpointed when grad mode is on (not inside :func:`plain_chunks`).

    ``module``: the module ``forward`` belongs to. Its parameters as bound *now* (only during the block's
    call) are passed to the checkpoint and bound again for the chunk's recompute, after that binding ended.

    Raises:
        RuntimeError: ``forward`` returns anything but a tensor ``[B, chunk, ...]`` (an MLP that is not
            per token); the message names ``mlp_chunk_size``."""
    grad = torch.is_grad_enabled() and not getattr(_state, "plain", False)
    slots = [(m, k) for m in (module.modules() if module is not None else ()) for k, v in m._parameters.items()
             if v is not None]
    params = tuple(m._parameters[k] for m, k in slots)

    def run(xc: torch.Tensor, *ps: torch.Tensor) -> Any:
        with _bound(slots, ps):
            return forward(xc)

    starts = range(0, x.shape[1], chunk)

    def one(i: int) -> Any:
        xc = x[:, starts[i] : starts[i] + chunk].contiguous()  # a view across the batch stride otherwise (MoE .view)
        return xc, checkpoint(run, xc, *params, use_reentrant=False) if grad else forward(xc)

    pieces = []
    # what hooks inside record (MoE router logits) is put back in the unchunked layout
    for xc, y in over_chunks(one, len(starts), x.shape[0], [min(chunk, x.shape[1] - s) for s in starts]):
        if not torch.is_tensor(y) or tuple(y.shape[:2]) != tuple(xc.shape[:2]):
            raise RuntimeError(
                f"megatrain: mlp_chunk_size: the MLP returned {type(y).__name__} "
                f"{tuple(y.shape) if torch.is_tensor(y) else ''} for input {tuple(xc.shape)}; only MLPs that map "
                "[B, T, H] to [B, T, ...] per token can run in chunks. Set mlp_chunk_size=None (strategy option / "
                "Hydra key strategy.mlp_chunk_size).")
        pieces.append(y)
    return torch.cat(pieces, 1)


class ChunkedMLP:
    """Wraps the MLP of every (non-direct) block to run over ``chunk`` tokens at a time.

    Args:
        chunk: ``mlp_chunk_size`` (tokens), or ``None`` (nothing installed).
    """

    def __init__(self, chunk: int | None):
        self.chunk = chunk
        self.installed = ForwardPatches()
        self.hooks_warned: list[bool] = []  # one warning per run about hooks inside chunked MLPs

    def install(self, blocks: list[Block]) -> None:
        """Wrap the MLP of every block of ``blocks`` that has one."""
        if self.chunk is None or self.installed:
            return
        streamed = {id(b.module) for b in blocks}
        warned = False
        for blk in blocks:
            children = () if blk.direct else (getattr(blk.module, name, None) for name in MLP_NAMES)
            mlp = next((m for m in children if isinstance(m, nn.Module)), None)
            if mlp is None or id(mlp) in streamed:  # an MLP streamed as its own block keeps its proxy
                continue
            self.installed.patch(mlp, self._wrap(mlp, mlp.forward, self.chunk, self.hooks_warned))
            random = _random_parts(mlp)
            if random and not warned:
                warned = True
                log.warning("megatrain: mlp_chunk_size=%d: the MLP of %s draws random numbers in training (%s); over "
                            "chunks they are drawn per chunk, so training differs from plain PyTorch's (the same "
                            "distribution, not the same numbers). Set mlp_chunk_size=None for exact parity.",
                            self.chunk, blk.name, ", ".join(random))

        if not self.installed:
            types = sorted({type(b.module).__name__ for b in blocks if not b.direct})
            log.warning("megatrain: mlp_chunk_size=%d has no effect: no streamed block (%s) has an MLP child named %s "
                        "(the per-token MLP it runs in chunks). Set mlp_chunk_size=None, or use a model whose layers "
                        "name their MLP so.", self.chunk, ", ".join(types[:4]) or "none", " / ".join(MLP_NAMES))

    def uninstall(self) -> None:
        self.installed.restore()

    @staticmethod
    def _wrap(mlp: nn.Module, orig: Callable[..., Any], chunk: int, warned: list[bool]) -> Callable[..., Any]:
        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or not torch.is_tensor(x) or x.dim() < 3 or x.shape[1] <= chunk:
                return orig(x, *args, **kwargs)
            if not warned:
                hooked = [n for n, m in mlp.named_modules() if n and has_user_hooks(m, backward=True)]
                if hooked:  # they see chunk-sized slices: a hook that is not per-token gives other numbers
                    warned.append(True)
                    log.warning("megatrain: mlp_chunk_size=%d: hooks on %s inside a chunked MLP run once per chunk "
                                "of %d tokens, on slices; a hook that is not per-token (a norm over the sequence) "
                                "gives other numbers than plain PyTorch. Hook the MLP itself, or set "
                                "mlp_chunk_size=None.", chunk, ", ".join(hooked[:3]), chunk)
            return chunked_call(orig, x, chunk, mlp)

        forward.__wrapped__ = orig  # type: ignore[attr-defined]
        return forward
