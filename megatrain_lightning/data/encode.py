"""Tokenize documents: text documents packed into fixed-length rows, instruction documents with a loss mask.

Both use the tokenizer's batched call (Rust for fast tokenizers) in chunks of ``CHUNK`` strings.
"""

from __future__ import annotations

import torch

from .corpus import as_messages
from .formatting import conversation_segments, eos_id, wants_bos

CHUNK = 512


def _chunks(items: list):
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def _batch_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each string, no special tokens added (empty string -> ``[]``).

    Raises:
        ValueError: a non-blank string gave no token (a tokenizer without its vocabulary loaded does that).
    """
    out: list[list[int]] = []
    for part in _chunks(texts):
        out += tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]
    for text, ids in zip(texts, out):
        if not ids and text.strip():
            raise ValueError(f"The tokenizer turned {text[:40]!r}... into no tokens (vocabulary size {len(tokenizer)}); "
                             "load it with from_pretrained(...) so its vocabulary is there.")
    return out


def encode_texts(tokenizer, docs: list[dict]) -> list[list[int]]:
    """Token ids of each text document: ``[BOS] + tokens(text) + [EOS]`` (BOS only if the tokenizer adds one itself).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    eos = eos_id(tokenizer)
    head = [tokenizer.bos_token_id] if wants_bos(tokenizer) else []
    return [head + ids + [eos] for ids in _batch_ids(tokenizer, [d["text"] for d in docs])]


def pack_texts(tokenizer, docs: list[dict], seq_len: int) -> tuple[torch.Tensor, int, int]:
    """Encode the text documents (:func:`encode_texts`), concatenate them in order and cut into rows of ``seq_len``.

    Works chunk by chunk, so memory is about 4 bytes per token (int32), not a Python list of the corpus.

    Returns:
        ``(rows, tokens, tail)``: ``rows`` int32 ``[N, seq_len]`` with ``N = tokens // seq_len``; ``tokens`` encoded in
        total; ``tail = tokens % seq_len`` tokens at the very end that fill no row and are dropped.

    Raises:
        ValueError: no EOS token, or the tokenizer gives no tokens for non-blank text.
    """
    parts = [torch.tensor([t for s in encode_texts(tokenizer, c) for t in s], dtype=torch.int32) for c in _chunks(docs)]
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len).clone(), int(flat.numel()), int(flat.numel() - n * seq_len)


def encode_instructions(tokenizer, docs: list[dict], seq_len: int, use_chat_template: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Token ids and trained-token flags of the instruction documents, each truncated to ``seq_len`` tokens.

    Longer examples keep their first ``seq_len`` tokens (counted in ``stats["truncated"]``); an example with no
    trained token left (the prompt alone fills ``seq_len``, or no assistant turn) is dropped and counted in
    ``stats["dropped"]`` only. Encoded chunk by chunk (int32/uint8 tensors, not Python lists of the corpus).

    Returns:
        ``(tensors, stats)``: ``tensors = {"ids": int32 [total], "trained": uint8 [total], "lengths": int64 [N]}``
        (kept examples back to back); ``stats = {"truncated", "dropped"}``.

    Raises:
        ValueError: see :func:`~megatrain_lightning.data.formatting.conversation_segments` and :func:`_batch_ids`.
    """
    ids_parts, trained_parts, lengths = [], [], []
    truncated = dropped = 0
    bos = wants_bos(tokenizer)
    for chunk in _chunks(docs):
        flat_ids: list[int] = []
        flat_trained: list[bool] = []
        all_segs = [conversation_segments(tokenizer, as_messages(d), use_chat_template, bos) for d in chunk]
        tokenized = iter(_batch_ids(tokenizer, [s for segs in all_segs for s, _ in segs if isinstance(s, str)]))
        for segs in all_segs:
            ids: list[int] = []
            trained: list[bool] = []
            for s, t in segs:
                piece = next(tokenized) if isinstance(s, str) else s
                ids += piece
                trained += [t] * len(piece)
            cut = len(ids) > seq_len
            if cut:
                ids, trained = ids[:seq_len], trained[:seq_len]
            if not any(trained):
                dropped += 1
                continue
            truncated += cut
            flat_ids += ids
            flat_trained += trained
            lengths.append(len(ids))
        ids_parts.append(torch.tensor(flat_ids, dtype=torch.int32))
        trained_parts.append(torch.tensor(flat_trained, dtype=torch.uint8))
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    tensors = {"ids": cat(ids_parts, torch.int32), "trained": cat(trained_parts, torch.uint8),
               "lengths": torch.tensor(lengths, dtype=torch.int64)}
    return tensors, {"truncated": truncated, "dropped": dropped}
