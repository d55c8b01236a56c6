"""Probe items from held-out documents: ``[{"id", "prompt", "response"}]``, ordered by a seeded hash of the id
(deterministic and spread over the documents, not the first N of one file)."""

from __future__ import annotations

import ast
import re

from .corpus import unit_hash

_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_SPACE = re.compile(r"\s+")


def _ordered(items: list[dict], max_items: int | None, seed: int) -> list[dict]:
    items = sorted(items, key=lambda it: unit_hash("probe:" + it["id"], seed))
    return items[:max_items] if max_items is not None else items


def legal_items(docs: list[dict], max_items: int | None = None, seed: int = 0, min_words: int = 24) -> list[dict]:
    """Clause continuation: every paragraph (blank-line separated) of at least ``min_words`` words of the text
    documents, cut before its middle word: ``prompt`` = first half, ``response`` = the rest (starting with the
    whitespace before the middle word)."""
    items = []
    for d in docs:
        for k, para in enumerate(p.strip() for p in _PARAGRAPH.split(d["text"])):
            spaces = [m.start() for m in _SPACE.finditer(para)]
            if len(spaces) + 1 < min_words:
                continue
            cut = spaces[len(spaces) // 2]
            items.append({"id": f"{d['id']}#p{k}", "prompt": para[:cut], "response": para[cut:]})
    return _ordered(items, max_items, seed)


def code_items(docs: list[dict], max_items: int | None = None, seed: int = 0, max_body_lines: int = 60) -> list[dict]:
    """Function-body completion: for every function or method with a docstring and at least one statement after it
    in the (Python) text documents, ``prompt`` = the ``def`` line(s) through the end of the docstring (decorators left
    out), ``response`` = the following lines up to the end of the function (at most ``max_body_lines``). Documents that
    do not parse as Python are skipped."""
    items = []
    for d in docs:
        try:
            tree = ast.parse(d["text"])
        except (SyntaxError, ValueError):
            continue
        lines = d["text"].splitlines()
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            first = fn.body[0]
            has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
            if not has_doc or len(fn.body) < 2 or fn.end_lineno is None or first.end_lineno is None:
                continue
            body = lines[first.end_lineno : fn.end_lineno]
            if not body or len(body) > max_body_lines:
                continue
            prompt = "\n".join(lines[fn.lineno - 1 : first.end_lineno]) + "\n"
            items.append({"id": f"{d['id']}::{fn.name}:{fn.lineno}", "prompt": prompt, "response": "\n".join(body) + "\n"})
    return _ordered(items, max_items, seed)


def instruction_items(docs: list[dict], max_items: int | None = None, seed: int = 0, kinds: list[str] | None = None) -> list[dict]:
    """Question/answer items: single-turn instruction documents (``prompt``/``response``, or ``messages`` with one user
    and one assistant turn), restricted to ``kinds`` for documents that carry a ``kind``."""
    items = []
    for d in docs:
        if kinds is not None and "kind" in d and d["kind"] not in kinds:
            continue
        if "prompt" in d:
            items.append({"id": d["id"], "prompt": d["prompt"], "response": d["response"]})
            continue
        roles = [m["role"] for m in d.get("messages", [])]
        if roles == ["user", "assistant"]:
            items.append({"id": d["id"], "prompt": d["messages"][0]["content"], "response": d["messages"][1]["content"]})
    return _ordered(items, max_items, seed)
