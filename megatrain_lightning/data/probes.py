"""Domain probes, run by the recipes before and after fine-tuning on held-out items.

Every probe has the signature ``probe(model, tokenizer, items, device, max_items, **options) -> dict[str, float]``:

* ``model``: any Hugging Face causal LM module (``model(input_ids=, attention_mask=).logits``; the exact-match
  probe also needs ``model.generate``), e.g. the model the megatrain strategy streams. It is put in eval mode
  for the probe and back in its previous mode afterwards; everything runs under ``torch.no_grad``.
* ``items``: ``[{"id", "prompt", "response"}]`` from :mod:`megatrain_lightning.data.probe_items`; the first
  ``max_items`` are used (``None``: all).
* ``device``: where the inputs go (``None``: the device of the model's first parameter).

=================  ==================================================================  ===============================
probe              measures                                                            keys
=================  ==================================================================  ===============================
``legal_probe``    mean loss (nats/token) of the second half of held-out paragraphs    clause_loss, clause_ppl, items,
                   given the first half                                                tokens
``code_probe``     mean loss of held-out function bodies given def line + docstring    body_loss, body_ppl, items,
                                                                                       tokens
``biomedical_...`` exact-match accuracy (0..1) of greedy answers to held-out questions exact_match, items
=================  ==================================================================  ===============================

Losses are token-weighted means over all items (sum of per-token cross-entropy / number of scored tokens).
Exact match compares after collapsing whitespace, case-folding and dropping a final period.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .datasets import PadCollate
from .formatting import end_of_turn, eos_id, generation_prompt, resolve_chat_template
from .probe_items import code_items, instruction_items, legal_items


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _device(model: torch.nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _batches(n: int, batch_size: int, desc: str) -> "tqdm":
    """Batch start offsets with a progress bar on a terminal (tqdm hides it when stderr is not a TTY)."""
    return tqdm(range(0, n, batch_size), desc=desc, unit="batch", leave=False, disable=None)


def _take(items: list[dict], max_items: int | None) -> list[dict]:
    items = items[:max_items] if max_items is not None else items
    if not items:
        raise ValueError("No probe items: the held-out documents gave none (too few or too short documents); "
                         "raise val_fraction or lower the probe's minimum length.")
    return items


def _pair_ids(tokenizer, prompt: str, response: str, max_tokens: int) -> tuple[list[int], list[bool]]:
    """Ids of ``prompt + response`` and which of them belong to the response, at most ``max_tokens`` tokens (the prompt
    keeps its last ``max_tokens // 2`` tokens, the response its first ones)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(prompt + response, return_offsets_mapping=True, verbose=False)
        ids = enc["input_ids"]
        scored = [start >= len(prompt) and end > start for start, end in enc["offset_mapping"]]
    else:
        p = tokenizer(prompt, verbose=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False, verbose=False)["input_ids"]
        ids, scored = p + r, [False] * len(p) + [True] * len(r)
    n_prompt = scored.index(True) if True in scored else len(ids)
    keep_prompt = min(n_prompt, max_tokens // 2)
    lo = n_prompt - keep_prompt
    hi = min(len(ids), lo + max_tokens)
    return ids[lo:hi], scored[lo:hi]


def continuation_loss(model, tokenizer, items: list[dict], device=None, max_items: int | None = None,
                      batch_size: int = 4, max_tokens: int = 512) -> dict[str, float]:
    """Token-weighted mean cross-entropy of each item's ``response`` given its ``prompt``.

    Returns:
        ``{"loss", "ppl", "items", "tokens"}`` (nats/token, ``exp(loss)``, items scored, response tokens scored).

    Raises:
        ValueError: no items, or no response token survived truncation.
    """
    items = _take(items, max_items)
    dev = _device(model, device)
    collate = PadCollate(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id(tokenizer))
    pairs = [_pair_ids(tokenizer, it["prompt"], it["response"], max_tokens) for it in items]
    pairs = [(ids, s) for ids, s in pairs if any(s[1:])]
    if not pairs:
        raise ValueError("No probe item has a response token to score; raise max_tokens.")
    total, count = 0.0, 0
    with _eval_mode(model):
        for i in _batches(len(pairs), batch_size, "probe"):
            b = collate([{"input_ids": torch.tensor(x), "attention_mask": torch.ones(len(x), dtype=torch.long),
                          "labels": torch.tensor([t if k else -100 for t, k in zip(x, s)])}
                         for x, s in pairs[i : i + batch_size]])
            logits = model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev)).logits
            target = b["labels"][:, 1:].to(logits.device)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                   ignore_index=-100, reduction="sum")
            total += float(loss)
            count += int((target != -100).sum())
    mean = total / count
    return {"loss": mean, "ppl": math.exp(min(mean, 700.0)), "items": float(len(pairs)), "tokens": float(count)}


def legal_probe(model, tokenizer, items, device=None, max_items: int | None = 64, **options) -> dict[str, float]:
    """Held-out clause continuation: ``{"clause_loss", "clause_ppl", "items", "tokens"}`` (see :func:`continuation_loss`)."""
    r = continuation_loss(model, tokenizer, items, device, max_items, **options)
    return {"clause_loss": r["loss"], "clause_ppl": r["ppl"], "items": r["items"], "tokens": r["tokens"]}


def code_probe(model, tokenizer, items, device=None, max_items: int | None = 64, **options) -> dict[str, float]:
    """Held-out function-body completion: ``{"body_loss", "body_ppl", "items", "tokens"}`` (see :func:`continuation_loss`)."""
    r = continuation_loss(model, tokenizer, items, device, max_items, **options)
    return {"body_loss": r["loss"], "body_ppl": r["ppl"], "items": r["items"], "tokens": r["tokens"]}


def normalize_answer(s: str) -> str:
    """Whitespace collapsed, case-folded, one final period dropped: what exact match compares."""
    s = " ".join(s.split()).casefold()
    return s[:-1] if s.endswith(".") else s


def biomedical_probe(model, tokenizer, items, device=None, max_items: int | None = 64, batch_size: int = 8,
                     max_new_tokens: int = 32, use_chat_template: bool | None = None) -> dict[str, float]:
    """Exact-match accuracy of greedy answers (``model.generate``, no sampling, KV cache) to the items' prompts, formatted
    as in training (chat template or plain format, see :mod:`~megatrain_lightning.data.formatting`). The answer is the
    generated text up to the end-of-turn marker or EOS.

    Returns:
        ``{"exact_match": fraction in [0, 1], "items": n}``.

    Raises:
        TypeError: the model has no ``generate`` method.
        ValueError: no items.
    """
    if not hasattr(model, "generate"):
        raise TypeError(f"{type(model).__name__} has no generate(); the exact-match probe needs a Hugging Face causal LM.")
    from transformers import GenerationConfig

    items = _take(items, max_items)
    dev = _device(model, device)
    chat = resolve_chat_template(tokenizer, use_chat_template)
    stop_text = end_of_turn(tokenizer, chat)
    stops = {eos_id(tokenizer)}
    stop_ids = tokenizer(stop_text, add_special_tokens=False)["input_ids"] if stop_text else []
    if len(stop_ids) == 1:
        stops.add(stop_ids[0])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id(tokenizer)
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                              eos_token_id=sorted(stops), pad_token_id=pad)
    hits = 0
    with _eval_mode(model):
        for i in _batches(len(items), batch_size, "probe (generation)"):
            chunk = items[i : i + batch_size]
            prompts = [generation_prompt(tokenizer, it["prompt"], chat) for it in chunk]
            encoded = [tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"] for text, special in prompts]
            t = max(len(x) for x in encoded)
            ids = torch.full((len(chunk), t), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), t), dtype=torch.long)
            for r, x in enumerate(encoded):  # left padding: every row's answer starts at column t
                ids[r, t - len(x):] = torch.tensor(x)
                mask[r, t - len(x):] = 1
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=config)
            for r, it in enumerate(chunk):
                text = tokenizer.decode(out[r, t:].tolist(), skip_special_tokens=False)
                for marker in (stop_text, tokenizer.eos_token):
                    if marker:
                        text = text.split(marker, 1)[0]
                if tokenizer.pad_token and tokenizer.pad_token != tokenizer.eos_token:
                    text = text.replace(tokenizer.pad_token, "")
                hits += normalize_answer(text) == normalize_answer(it["response"])
    return {"exact_match": hits / len(items), "items": float(len(items))}


PROBES = {
    "legal": (legal_items, legal_probe),
    "code": (code_items, code_probe),
    "biomedical": (instruction_items, biomedical_probe),
}
"""``domain -> (item builder over held-out documents, probe function)``."""
