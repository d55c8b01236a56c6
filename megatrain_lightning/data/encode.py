"""Tokenize documents: text documents packed into fixed-length rows, instruction documents with a loss mask.

Both use the tokenizer's batched call (Rust for fast tokenizers) in chunks of ``CHUNK`` strings.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .corpus import as_messages
from .formatting import conversation_segments, eos_id, wants_bos

CHUNK = 512


def _batch_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each string, no special tokens added (empty string -> ``[]``)."""
    out: list[list[int]] = []
    for i in range(0, len(texts), CHUNK):
        part = texts[i : i + CHUNK]
        out += tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"] if part else []
    return out


def encode_texts(tokenizer, docs: list[dict]) -> list[list[int]]:
    """Token ids of each text document: ``[BOS] + tokens(text) + [EOS]`` (BOS only if the tokenizer adds one itself).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    eos = eos_id(tokenizer)
    head = [tokenizer.bos_token_id] if wants_bos(tokenizer) else []
    return [head + ids + [eos] for ids in _batch_ids(tokenizer, [d["text"] for d in docs])]


def pack(sequences: Iterable[list[int]], seq_len: int) -> tuple[torch.Tensor, int]:
    """Concatenate ``sequences`` and cut into rows of ``seq_len`` tokens.

    Returns:
        ``(rows, tail)``: ``rows`` int32 ``[N, seq_len]`` with ``N = total // seq_len``, ``tail = total % seq_len``
        tokens at the very end that fill no row and are dropped.
    """
    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len).clone(), int(flat.numel() - n * seq_len)


def encode_instructions(tokenizer, docs: list[dict], seq_len: int, use_chat_template: bool) -> tuple[list[list[int]], list[list[bool]], dict]:
    """Token ids and trained-token flags of each instruction document, truncated to ``seq_len`` tokens.

    Longer examples keep their first ``seq_len`` tokens (counted in ``stats["truncated"]``); an example
    with no trained token left (prompt alone fills ``seq_len``, or no assistant turn) is dropped and
    counted in ``stats["dropped"]``.

    Returns:
        ``(ids, trained, stats)``: per kept document a list of ids and a same-length list of bools;
        ``stats = {"truncated", "dropped", "kept_ids"}`` (``kept_ids`` lists the ids of the kept documents).

    Raises:
        ValueError: see :func:`~megatrain_lightning.data.formatting.conversation_segments`.
    """
    all_segs = [conversation_segments(tokenizer, as_messages(d), use_chat_template) for d in docs]
    texts = [s for segs in all_segs for s, _ in segs if isinstance(s, str)]
    tokenized = iter(_batch_ids(tokenizer, texts))
    ids_out, mask_out, kept = [], [], []
    truncated = dropped = 0
    for doc, segs in zip(docs, all_segs):
        ids: list[int] = []
        trained: list[bool] = []
        for s, t in segs:
            piece = next(tokenized) if isinstance(s, str) else s
            ids += piece
            trained += [t] * len(piece)
        if len(ids) > seq_len:
            truncated += 1
            ids, trained = ids[:seq_len], trained[:seq_len]
        if not any(trained):
            dropped += 1
            continue
        ids_out.append(ids)
        mask_out.append(trained)
        kept.append(doc["id"])
    return ids_out, mask_out, {"truncated": truncated, "dropped": dropped, "kept_ids": kept}
