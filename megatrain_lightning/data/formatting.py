"""How a conversation becomes text, and which parts of it the loss sees.

With a chat template (``tokenizer.chat_template``, used by default when present) the conversation is
rendered by ``tokenizer.apply_chat_template``; each assistant reply is found as the difference between
the rendering of the conversation up to the reply with ``add_generation_prompt=True`` and the rendering
including it. The reply's text and the template's end-of-turn marker (e.g. ``"Paris<|im_end|>"``) are
trained; everything else (system prompt, user turns, role headers, whitespace after the end-of-turn
marker) is masked out of the loss.

Without a chat template (or ``use_chat_template=False``) the plain format is::

    ### Question:
    {prompt}

    ### Answer:
    {response}<eos>

where ``{response}`` and the EOS token are trained. A system message becomes a first untrained
paragraph; further turns follow after a blank line. The tokenizer's BOS token is put first when the
tokenizer adds one to plain text by itself (Llama-style), as for text documents.
"""

from __future__ import annotations

from typing import Union

PLAIN_QUESTION = "### Question:\n"
PLAIN_ANSWER = "\n\n### Answer:\n"

Segment = tuple[Union[str, list[int]], bool]  # (text or token ids, trained)


def wants_bos(tokenizer) -> bool:
    """``True`` when the tokenizer puts its BOS token in front of plain text by itself (``add_special_tokens=True``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == bos and len(ids) > 1


def eos_id(tokenizer) -> int:
    """The tokenizer's EOS token id.

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"Tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no eos_token; set "
                         "tokenizer.eos_token (documents are separated and answers terminated with it).")
    return int(eos)


def resolve_chat_template(tokenizer, use_chat_template: bool | None) -> bool:
    """Whether to use the chat template: ``None`` -> iff the tokenizer has one.

    Raises:
        ValueError: ``use_chat_template=True`` but the tokenizer has no chat template.
    """
    has = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template is None:
        return has
    if use_chat_template and not has:
        raise ValueError(f"use_chat_template=True but tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                         "chat_template; set one or use the plain '### Question/### Answer' format (False/None).")
    return bool(use_chat_template)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _template_segments(tokenizer, messages: list[dict]) -> list[Segment]:
    segs: list[Segment] = []
    prev = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        after = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(prev) or not after.startswith(before):
            raise ValueError(
                "The tokenizer's chat template does not render a conversation as a prefix of its continuation, so "
                "the assistant replies cannot be located for loss masking; pass use_chat_template=False (plain "
                "'### Question/### Answer' format)."
            )
        reply = after[len(before):]
        body = reply.rstrip()
        segs += [(before[len(prev):], False), (body, True), (reply[len(body):], False)]
        prev = after
    return segs


def _plain_segments(tokenizer, messages: list[dict], bos: bool) -> list[Segment]:
    segs: list[Segment] = [([tokenizer.bos_token_id], False)] if bos else []
    eos = eos_id(tokenizer)
    sep = ""
    for m in messages:
        if m["role"] == "assistant":
            segs += [(PLAIN_ANSWER, False), (m["content"], True), ([eos], True)]
            sep = "\n\n"
        elif m["role"] == "system":
            segs.append((sep + m["content"] + "\n\n", False))
            sep = ""
        else:
            segs.append((sep + PLAIN_QUESTION + m["content"], False))
            sep = ""
    return segs


def conversation_segments(tokenizer, messages: list[dict], use_chat_template: bool, bos: bool | None = None) -> list[Segment]:
    """The conversation as ``(text or token ids, trained)`` pieces in order; their concatenation is the model input.

    ``bos`` (plain format only): put the BOS token first; ``None`` asks :func:`wants_bos` (pass it when encoding many).

    Raises:
        ValueError: the chat template is not prefix-stable (see :func:`_template_segments`), or no EOS token.
    """
    if use_chat_template:
        return _template_segments(tokenizer, messages)
    return _plain_segments(tokenizer, messages, wants_bos(tokenizer) if bos is None else bos)


_SENTINEL = "ANSWER_SENTINEL_7F3A"


def end_of_turn(tokenizer, use_chat_template: bool) -> str:
    """Text that ends an answer: what the chat template writes right after a reply (``"<|im_end|>"`` for SmolLM2,
    trailing whitespace dropped), or the EOS token text in the plain format or when the template writes nothing."""
    if use_chat_template:
        msgs = [{"role": "user", "content": "q"}]
        before = _render(tokenizer, msgs, add_generation_prompt=True)
        after = _render(tokenizer, msgs + [{"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False)
        tail = after[len(before):].split(_SENTINEL, 1)[-1].strip()
        if tail:
            return tail
    return tokenizer.eos_token or ""


def generation_prompt(tokenizer, prompt: str, use_chat_template: bool) -> tuple[str, bool]:
    """``(text, add_special_tokens)`` to tokenize for asking ``prompt`` and letting the model answer: the chat template
    with ``add_generation_prompt=True``, or ``"### Question:\\n{prompt}\\n\\n### Answer:\\n"`` (with the tokenizer's own
    special tokens, i.e. its BOS if it adds one)."""
    if use_chat_template:
        return _render(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True), False
    return PLAIN_QUESTION + prompt + PLAIN_ANSWER, True
