"""Preference pairs as tensors: records ``{prompt, chosen, rejected}`` -> token ids -> padded batches.

A record is a dict with ``prompt``, ``chosen`` and ``rejected``: strings (the standard form) or, in TRL's
conversational form, lists of ``{"role", "content"}`` messages (``prompt`` the conversation so far, ``chosen``
and ``rejected`` each the assistant's answer as a one-message list). A string prompt is tokenized with the
tokenizer's special tokens, and each response, without special tokens, ends with the end-of-sequence token.
A conversational prompt is rendered by the tokenizer's chat template with the generation prompt, or without one
in the recipes' plain ``### Question/### Answer`` format (its last message), as the recipes ask a question
(``data/formatting.py``); each response then ends with the template's end-of-turn text (or the EOS token).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from ..data.formatting import end_of_turn, generation_prompt

FIELDS = ("prompt", "chosen", "rejected")


class PreferenceDataError(ValueError):
    """A preference record that cannot be trained on (missing field, empty response, prompt too long)."""


def _text(value: Any, field: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return "".join(str(m["content"]) for m in value)
    raise PreferenceDataError(f"megatrain: {where}: {field!r} must be a string or a list of "
                              f"{{'role', 'content'}} messages, got {type(value).__name__}.")


def encode_pair(record: Any, tokenizer: Any, max_length: int, where: str = "record") -> dict[str, list[int]]:
    """Token ids of one record: ``{"prompt", "chosen", "rejected"}`` -> lists of ints; responses are cut so that
    prompt + response fits ``max_length`` tokens (the prompt is kept whole, as in TRL).

    Raises:
        PreferenceDataError: a field is missing or not text, a response is empty, or the prompt alone takes
            ``max_length`` tokens or more (no response token would remain), each naming ``where``."""
    if not isinstance(record, dict) or any(f not in record for f in FIELDS):
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise PreferenceDataError(f"megatrain: {where} needs the fields {list(FIELDS)} (TRL's preference format), "
                                  f"got {have}.")
    prompt = record["prompt"]
    if isinstance(prompt, list):  # as the recipes ask a question (data/formatting.py): the chat template, or plain
        template = bool(getattr(tokenizer, "chat_template", None))
        if template:
            text, special = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True), False
        else:
            text, special = generation_prompt(tokenizer, _text(prompt[-1:], "prompt", where), False)
        prompt_ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        end = tokenizer(end_of_turn(tokenizer, template), add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(_text(prompt, "prompt", where), add_special_tokens=True)["input_ids"]
        end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if len(prompt_ids) >= max_length:
        raise PreferenceDataError(f"megatrain: {where}: the prompt has {len(prompt_ids)} tokens, max_length is "
                                  f"{max_length}: no response token fits. Raise max_length or shorten the prompt.")
    out = {"prompt": list(prompt_ids)}
    for field in ("chosen", "rejected"):
        text = _text(record[field], field, where)
        if not text.strip():
            raise PreferenceDataError(f"megatrain: {where}: the {field!r} response is empty.")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + end
        out[field] = ids[: max_length - len(prompt_ids)]
    return out


class PreferenceDataset(Dataset):
    """Encoded preference pairs; item ``i`` is ``{"index": i, "prompt": [...], "chosen": [...], "rejected": [...]}``.

    Args:
        records: the pairs (module docstring), all encoded and checked here, before any model is built.
        tokenizer: a Hugging Face tokenizer.
        max_length: tokens of prompt + response at most.

    Raises:
        PreferenceDataError: the first bad record, naming its index."""

    def __init__(self, records: Sequence[Any], tokenizer: Any, max_length: int) -> None:
        if not records:
            raise PreferenceDataError("megatrain: no preference records.")
        self.items = [encode_pair(r, tokenizer, max_length, where=f"record {i}") for i, r in enumerate(records)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, **self.items[i]}


def collate_pairs(items: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Batch encoded pairs (items of :class:`PreferenceDataset`, or any dicts of ``prompt``/``chosen``/``rejected``
    id lists with an ``index``).

    Returns a dict of int64 tensors: ``index`` ``[B]``; for ``chosen`` and ``rejected`` each
    ``<side>_input_ids`` ``[B, T]`` (prompt + response, right-padded with ``pad_id``), ``<side>_attention_mask``
    ``[B, T]`` (1 on tokens) and ``<side>_labels`` ``[B, T]`` (the response's ids, -100 on the prompt and padding);
    ``T`` is the longest prompt + response of the batch over both sides."""
    width = max(len(it["prompt"]) + len(it[side]) for it in items for side in ("chosen", "rejected"))
    out: dict[str, torch.Tensor] = {"index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long)}
    for side in ("chosen", "rejected"):
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        labels = torch.full((len(items), width), -100, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, it in enumerate(items):
            p, r = it["prompt"], it[side]
            ids[row, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
            labels[row, len(p): len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
            mask[row, : len(p) + len(r)] = 1
        out[f"{side}_input_ids"], out[f"{side}_attention_mask"], out[f"{side}_labels"] = ids, mask, labels
    return out
