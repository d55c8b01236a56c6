"""Documents: the two shapes, their checks, the split by document and the content fingerprint.

A *document* is a ``dict``:

* text shape: ``{"id": str, "text": str}``
* instruction shape: ``{"id": str, "prompt": str, "response": str}`` or
  ``{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``

Optional keys: ``"group"`` (documents with the same group always land in the same split, e.g. all
questions about one drug, or all files of one package) and ``"kind"`` (a label a probe can filter
on, e.g. ``"mesh_category"``). Other keys are ignored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

SHAPES = ("text", "instruction")


def check_shape(shape: str) -> str:
    """Return ``shape`` if it is ``"text"`` or ``"instruction"``.

    Raises:
        ValueError: any other value.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}.")
    return shape


def check_document(doc: Any, shape: str, where: str = "") -> dict:
    """Validate one document of ``shape`` and return it.

    Raises:
        TypeError: ``doc`` is not a dict, or a field has the wrong type.
        ValueError: a required field is missing (the message names the field, the keys present and ``where``).
    """
    at = f" ({where})" if where else ""
    if not isinstance(doc, dict):
        raise TypeError(f"A document must be a dict, got {type(doc).__name__}{at}.")
    if not isinstance(doc.get("id"), str):
        raise ValueError(f"Document has no string 'id'{at}; keys present: {sorted(doc)}.")
    if shape == "text":
        if not isinstance(doc.get("text"), str):
            raise ValueError(
                f"Document {doc['id']!r}{at} has no string 'text' field (keys: {sorted(doc)}); the text shape needs "
                "{'id', 'text'}. For prompt/response data use shape='instruction'."
            )
    else:
        if "messages" in doc:
            msgs = doc["messages"]
            if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
            ):
                raise TypeError(f"Document {doc['id']!r}{at}: 'messages' must be a list of {{'role', 'content'}} string dicts.")
        elif not (isinstance(doc.get("prompt"), str) and isinstance(doc.get("response"), str)):
            raise ValueError(
                f"Document {doc['id']!r}{at} has neither string 'prompt' and 'response' fields nor 'messages' "
                f"(keys: {sorted(doc)}); the instruction shape needs one of them. For plain text use shape='text'."
            )
    return doc


def as_messages(doc: dict) -> list[dict]:
    """The conversation of an instruction document: its ``messages``, or ``[user: prompt, assistant: response]``."""
    if "messages" in doc:
        return doc["messages"]
    return [{"role": "user", "content": doc["prompt"]}, {"role": "assistant", "content": doc["response"]}]


def unit_hash(key: str, seed: int) -> float:
    """A number in ``[0, 1)`` from SHA-256 of ``f"{seed}:{key}"``: stable across runs, machines and Python versions."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_documents(docs: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, val)`` by document: a document is validation iff ``unit_hash(key, seed) < val_fraction``, ``key``
    its ``"group"`` when present, else its ``"id"``.

    The assignment of a document depends only on its id/group and ``seed``, never on the order or
    the other documents, so adding documents never moves existing ones across the split.

    Raises:
        ValueError: ``val_fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
    train, val = [], []
    for d in docs:
        (val if unit_hash(str(d.get("group", d["id"])), seed) < val_fraction else train).append(d)
    return train, val


def subsample(docs: list[dict], max_documents: int | None, seed: int) -> list[dict]:
    """Keep the ``max_documents`` documents with the smallest ``unit_hash(id, seed)`` (source order kept).

    A deterministic, order-independent sample spread over the whole source (the first N files of a
    sorted listing would all come from one corner of it). ``None`` keeps all.

    Raises:
        ValueError: ``max_documents`` < 1.
    """
    if max_documents is None or len(docs) <= max_documents:
        return docs
    if max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or None, got {max_documents}.")
    ranked = sorted(range(len(docs)), key=lambda i: unit_hash("sample:" + docs[i]["id"], seed))
    return [docs[i] for i in sorted(ranked[:max_documents])]


def dedupe_ids(docs: Iterable[dict]) -> list[dict]:
    """The documents as a list.

    Raises:
        ValueError: two documents share an id (the split and the cache key rely on unique ids).
    """
    out, seen = [], set()
    for d in docs:
        if d["id"] in seen:
            raise ValueError(f"Duplicate document id {d['id']!r}; ids must be unique (a user source: id_field=null, "
                             "in the recipe data.source_options.id_field=null, numbers the records by file and line).")
        seen.add(d["id"])
        out.append(d)
    return out


def fingerprint(docs: Iterable[dict], shape: str) -> str:
    """SHA-256 hex digest of the documents' ids, groups and contents in order (the part of the cache key
    that changes when the data does)."""
    h = hashlib.sha256(shape.encode())
    for d in docs:
        body = {"id": d["id"], "group": d.get("group")}
        if shape == "text":
            body["text"] = d["text"]
        else:
            body["messages"] = as_messages(d)
        h.update(json.dumps(body, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\0")
    return h.hexdigest()
