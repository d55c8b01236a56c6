"""Tensors a block's submodules hand to Hugging Face's output recorder, as outputs of the block call.

Transformers gathers some per-layer tensors (MoE router logits, attention weights) with forward hooks inside a
decoder layer, into a collector the model's forward sets in a context variable
(``transformers.utils.output_capturing``). Appended inside a streamed call, they would reach the loss without a
gradient (the load-balancing loss would train nothing). :func:`recording` runs the call's forward (and its
recompute) under a collector of its own and returns what the hooks appended as extra outputs of the block's
``autograd.Function``; :func:`hand_over` appends them to the model's collector (docs/internals/block-calls.md,
"Outputs recorded inside a block"). ``hidden_states`` stays with the model's collector: its hook is on the
decoder layer itself, and its first-entry rule (the layer input first) must see the model's whole list.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

try:  # transformers >= 5: per-layer outputs recorded by forward hooks into a context variable
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - older transformers returned them from each layer
    _active_collector = None

_LEFT_TO_MODEL = {"hidden_states"}


def supported() -> bool:
    """Whether this transformers version records per-layer outputs through the collector handled here (the
    strategy refuses the router load-balancing loss otherwise)."""
    return _active_collector is not None


def recorded_keys() -> tuple[str, ...]:
    """The keys of the model's active output collector that hooks inside a block may append to
    (``()``: no model forward is recording, or it records nothing a block call must carry)."""
    if _active_collector is None:
        return ()
    collected = _active_collector.get()
    if not collected:
        return ()
    return tuple(k for k, v in collected.items()
                 if isinstance(v, list) and not k.startswith("_") and k not in _LEFT_TO_MODEL)


def recording(forward: Callable[..., Any], keys: tuple[str, ...]) -> Callable[..., tuple[Any, dict[str, list]]]:
    """``forward`` run under a collector of its own for ``keys``; returns ``(output, {key: [tensors the
    hooks appended during the call, in order]})``. Used for the call's forward and its recompute alike."""
    assert _active_collector is not None

    def run(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, list]]:
        own: dict[str, list] = {k: [] for k in keys}
        token = _active_collector.set(own)
        try:
            out = forward(*args, **kwargs)
        finally:
            _active_collector.reset(token)
        return out, own

    return run


def hand_over(out: tuple[Any, dict[str, list]]) -> Any:
    """Append what a :func:`recording` forward returned, now outputs of the block's autograd node, to the
    model's collector; return the block's own output."""
    out, recorded = out
    collected = _active_collector.get() if _active_collector is not None else None
    for k, tensors in recorded.items():
        if collected is not None and k in collected:
            collected[k].extend(tensors)
    return out


def over_chunks(run_chunk: Callable[[int], Any], n_chunks: int, batch: int, lengths: list[int]) -> list[Any]:
    """Run ``run_chunk(i)`` for each of ``n_chunks`` chunks of a ``[batch, sum(lengths), ...]`` input (chunk ``i``:
    ``lengths[i]`` tokens) and return their outputs. What the hooks inside record is recorded per chunk and put
    back in the unchunked layout (``[batch * len, ...]`` rows, batch-major, or ``[batch, len, ...]``), once per hook
    call: the load-balancing loss needs one ``[batch * T, E]`` router-logit tensor per layer, matching the
    ``[batch * T]`` attention mask.

    Raises:
        RuntimeError: a chunk recorded a tensor of another layout, or the chunks recorded different numbers.
    """
    keys = recorded_keys()
    if not keys:
        return [run_chunk(i) for i in range(n_chunks)]
    outs, per_chunk = [], []
    for i in range(n_chunks):
        out, own = recording(run_chunk, keys)(i)
        outs.append(out)
        per_chunk.append(own)
    collected = _active_collector.get()
    for k in keys:
        lists = [own[k] for own in per_chunk]
        if len({len(x) for x in lists}) != 1:
            raise RuntimeError(f"megatrain: mlp_chunk_size: the MLP's chunks recorded different numbers of "
                               f"'{k}' outputs ({[len(x) for x in lists]}); set mlp_chunk_size=None.")
        collected[k].extend(_merge(k, [x[j] for x in lists], batch, lengths) for j in range(len(lists[0])))
    return outs


def _merge(key: str, parts: list, batch: int, lengths: list[int]) -> Any:
    """One chunked recording (``parts``: one per chunk) in the layout of the unchunked call's."""
    if all(p is None for p in parts):
        return None
    if all(isinstance(p, torch.Tensor) and p.dim() >= 2 and tuple(p.shape[:2]) == (batch, n)
           for p, n in zip(parts, lengths)):
        return torch.cat(parts, 1)
    if all(isinstance(p, torch.Tensor) and p.dim() >= 1 and p.shape[0] == batch * n for p, n in zip(parts, lengths)):
        rest = tuple(parts[0].shape[1:])
        return torch.cat([p.reshape(batch, n, *rest) for p, n in zip(parts, lengths)], 1).reshape(-1, *rest)
    shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in parts]
    raise RuntimeError(f"megatrain: mlp_chunk_size: the MLP recorded '{key}' outputs of shapes {shapes} over chunks "
                       f"of {lengths} tokens (batch {batch}), which cannot be put back in the unchunked layout; set "
                       "mlp_chunk_size=None.")
