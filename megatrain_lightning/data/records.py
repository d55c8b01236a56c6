"""One record (a JSON object, a parquet row, a dataset row) -> one document, in the formats people have.

Text shape: the ``text_field`` (default ``"text"``).

Instruction shape, the first that applies to the record:

=================  ====================================================  ==========================================
format             record                                                document
=================  ====================================================  ==========================================
chat (OpenAI)      ``{"messages": [{"role", "content"}, ...]}``          ``messages`` as they are
ShareGPT           ``{"conversations": [{"from", "value"}, ...]}``       ``from`` human/user -> user, gpt/assistant/
                   (also under ``messages``)                             model -> assistant, system -> system
Alpaca             ``{"instruction", "input" (optional), "output"}``     prompt = instruction + ``"\\n\\n"`` + input
                                                                         (input never dropped), response = output
prompt/response    ``{"prompt", "response"}``                            as they are
=================  ====================================================  ==========================================

``prompt_field``/``response_field`` left at ``None`` look for ``prompt`` then ``instruction``, and ``response``
then ``output`` then ``completion``; set them to use other names. ``input_field`` (default ``"input"``) is joined
into the prompt whenever the record has it non-empty.

A field that is missing raises :class:`FieldError`, which names the option to set and, when a record key looks
right (``question`` for the prompt, ``answer`` for the response...), the value to set it to.
"""

from __future__ import annotations

from typing import Any

PROMPT_AUTO = ("prompt", "instruction")
RESPONSE_AUTO = ("response", "output", "completion")
# names seen in public data sets, used only to suggest an option value in errors
PROMPT_GUESSES = PROMPT_AUTO + ("question", "query", "input", "problem", "source", "context", "user")
RESPONSE_GUESSES = RESPONSE_AUTO + ("answer", "target", "chosen", "reply", "solution", "assistant", "label")
TEXT_GUESSES = ("text", "content", "body", "document", "code", "article", "passage", "sentence")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


class FieldError(ValueError):
    """A record lacks the field a data option names.

    Attributes:
        option: the ``load_user_source`` option to change (``"prompt_field"``, ``"text_field"``, ``"shape"``...).
        suggestion: a value that would work for this record, or ``None`` when no key looks right.
        also: further options this record needs, option -> suggested value (both prompt and response fields
            missing: one error names both, so the user does not meet the second after fixing the first).
    """

    def __init__(self, message: str, option: str, suggestion: str | None = None,
                 also: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.option, self.suggestion, self.also = option, suggestion, dict(also or {})


def _guess(rec: dict, names: tuple[str, ...], taken: tuple[str, ...] = ()) -> str | None:
    lower = {k.lower(): k for k in rec if isinstance(rec[k], str) and k not in taken}
    for n in names:
        if n in lower:
            return lower[n]
    return None


def _missing(rec: dict, where: str, option: str, wanted: str, guesses: tuple[str, ...], taken=()) -> FieldError:
    got = _guess(rec, guesses, taken)
    fix = f"set {option}={got!r}" if got else f"set {option}= to the field that holds it"
    return FieldError(f"{where}: no {wanted}; record keys are {sorted(rec)}; {fix}.", option, got)


def _conversation(turns: list, where: str) -> list[dict]:
    out = []
    for t in turns:
        if isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str):
            out.append({"role": t["role"], "content": t["content"]})
        elif isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str):
            role = SHAREGPT_ROLES.get(t["from"].lower())
            if role is None:
                raise ValueError(f"{where}: unknown ShareGPT speaker {t['from']!r}; known: {sorted(SHAREGPT_ROLES)}.")
            out.append({"role": role, "content": t["value"]})
        else:
            raise ValueError(f"{where}: a conversation turn must be {{'role', 'content'}} (OpenAI) or "
                             f"{{'from', 'value'}} (ShareGPT) strings, got {t!r:.120}.")
    return out


class RecordMapper:
    """Maps records to documents of one shape (see the module docstring for the formats).

    Args:
        shape: ``"text"`` or ``"instruction"``.
        text_field: text shape's field.
        prompt_field, response_field: instruction fields; ``None`` finds them (module docstring).
        input_field: joined into the prompt after a blank line when present and non-empty (Alpaca's ``input``).
        messages_field: OpenAI-style (or ShareGPT-style) list of turns.
        conversations_field: ShareGPT-style list of ``{"from", "value"}`` turns.
        id_field: the record's id (default ``"<file>:<line>"``).
    """

    def __init__(self, shape: str, text_field: str = "text", prompt_field: str | None = None,
                 response_field: str | None = None, input_field: str | None = "input", messages_field: str = "messages",
                 conversations_field: str = "conversations", id_field: str = "id") -> None:
        self.shape, self.text, self.prompt, self.response = shape, text_field, prompt_field, response_field
        self.input, self.messages, self.conversations, self.id = input_field, messages_field, conversations_field, id_field

    def document(self, rec: Any, default_id: str) -> dict | None:
        """A document from one record, ``None`` when its content is empty.

        Raises:
            FieldError: a required field is missing or not a string (names the option and a suggested value).
            ValueError: the record is not an object, or a conversation turn is malformed.
        """
        if not isinstance(rec, dict):
            raise ValueError(f"{default_id}: expected a JSON object (a record), got {type(rec).__name__}.")
        rid = rec.get(self.id)
        doc: dict = {"id": str(rid) if rid is not None else default_id}
        for extra in ("group", "kind"):
            if isinstance(rec.get(extra), str):
                doc[extra] = rec[extra]
        if self.shape == "text":
            return self._text(rec, doc, default_id)
        for name in (self.messages, self.conversations):
            if isinstance(rec.get(name), list):
                doc["messages"] = _conversation(rec[name], default_id)
                return doc if doc["messages"] else None
        prompt, response = self._pair(rec, default_id)
        extra_input = rec.get(self.input) if self.input and self.input != self.prompt else None
        if isinstance(extra_input, str) and extra_input.strip():
            prompt = f"{prompt}\n\n{extra_input}"
        doc["prompt"], doc["response"] = prompt, response
        return None if not prompt.strip() or not response.strip() else doc

    def _text(self, rec: dict, doc: dict, where: str) -> dict | None:
        value = rec.get(self.text)
        if isinstance(value, str):
            doc["text"] = value
            return doc if value.strip() else None
        if _guess(rec, PROMPT_GUESSES) and _guess(rec, RESPONSE_GUESSES) or isinstance(rec.get(self.messages), list):
            raise FieldError(f"{where}: no {self.text!r} field, and the record looks like instruction data (keys "
                             f"{sorted(rec)}); set shape='instruction' (or text_field= to its text field).",
                             "shape", "instruction")
        raise _missing(rec, where, "text_field", f"{self.text!r} field (text)", TEXT_GUESSES)

    def _pair(self, rec: dict, where: str) -> tuple[str, str]:
        p = self.prompt or next((n for n in PROMPT_AUTO if isinstance(rec.get(n), str)), None)
        r = self.response or next((n for n in RESPONSE_AUTO if isinstance(rec.get(n), str)), None)
        if p is None or not isinstance(rec.get(p), str):
            _refuse_non_text(rec, where, [self.prompt] if self.prompt else PROMPT_AUTO)
            wanted = f"{p!r} field" if p else "prompt field (looked for 'prompt', 'instruction', 'messages', 'conversations')"
            err = _missing(rec, where, "prompt_field", wanted, PROMPT_GUESSES)
            r_guess = _guess(rec, RESPONSE_GUESSES, taken=(err.suggestion,)) if r is None else None
            if err.suggestion and r_guess:  # the response field is missing too: say both at once
                raise FieldError(f"{err} The response field is missing too: set response_field={r_guess!r}.",
                                 "prompt_field", err.suggestion, also={"response_field": r_guess})
            raise err
        if r is None or not isinstance(rec.get(r), str):
            _refuse_non_text(rec, where, [self.response] if self.response else RESPONSE_AUTO)
            wanted = f"{r!r} field" if r else "response field (looked for 'response', 'output', 'completion')"
            raise _missing(rec, where, "response_field", wanted, RESPONSE_GUESSES, taken=(p,))
        return rec[p], rec[r]


def _refuse_non_text(rec: dict, where: str, names) -> None:
    """Raise ValueError when one of ``names`` holds a non-text value (``null``, a number): "no such field" would
    send the user to the wrong fix."""
    for n in names:
        if n in rec and not isinstance(rec[n], str):
            what = "null" if rec[n] is None else f"of type {type(rec[n]).__name__}"
            raise ValueError(f"{where}: field {n!r} is {what}, not text; give it a string value or remove the record.")
