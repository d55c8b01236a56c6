"""User sources: local ``.jsonl`` / ``.txt`` / ``.parquet`` files, directories of them, or a Hugging Face dataset id.

Rules (all tested in ``tests/test_data.py``):

* ``.jsonl``: one JSON object per line (blank lines skipped). Fields are mapped with ``text_field``
  (text shape) or ``prompt_field``/``response_field`` or ``messages_field`` (instruction shape);
  ``id_field`` gives the id when present, otherwise ``"<file>:<line>"``. Optional ``group``/``kind``
  fields are kept.
* ``.txt``: text shape only. ``txt_mode="file"``: one document per file (id = path relative to the
  directory given, or the file name); ``txt_mode="line"``: one document per non-blank line
  (id ``"<file>:<line>"``).
* ``.parquet``: rows mapped like JSON objects; needs ``pyarrow`` (ImportError saying so otherwise).
* A directory: every file below it, in sorted path order. Files of the three types that can give the
  requested shape are read; everything else (other extensions, ``.txt`` for the instruction shape,
  hidden files and directories) is skipped and listed in one INFO log line.
* Invalid UTF-8 with ``errors="replace"`` (default): the file is decoded with U+FFFD replacement
  characters and one WARNING names every such file. ``errors="strict"``: ValueError naming the file
  and the byte offset.
* A path that does not exist: FileNotFoundError naming it, unless it looks like a Hugging Face
  dataset id (``name`` or ``owner/name``, no file extension), which is loaded with
  ``datasets.load_dataset(id, split=hf_split)``: ImportError when ``datasets`` is not installed,
  RuntimeError when loading fails (e.g. offline).
* Documents with empty text (or empty prompt/response) are dropped; no document at all: ValueError.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from .corpus import check_document, check_shape

log = logging.getLogger(__name__)

READABLE = (".jsonl", ".txt", ".parquet")
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class _Fields:
    def __init__(self, shape, text_field, prompt_field, response_field, messages_field, id_field):
        self.shape, self.text, self.prompt, self.response = shape, text_field, prompt_field, response_field
        self.messages, self.id = messages_field, id_field

    def document(self, rec: Any, default_id: str) -> dict | None:
        """A document from one record, ``None`` when its content is empty.

        Raises:
            ValueError: a required field is missing or not a string (names it, the record's location and keys).
        """
        if not isinstance(rec, dict):
            raise ValueError(f"{default_id}: expected a JSON object, got {type(rec).__name__}.")
        rid = rec.get(self.id)
        doc: dict = {"id": str(rid) if rid is not None else default_id}
        for extra in ("group", "kind"):
            if isinstance(rec.get(extra), str):
                doc[extra] = rec[extra]
        if self.shape == "text":
            doc["text"] = self._field(rec, self.text, default_id)
            empty = not doc["text"].strip()
        elif isinstance(rec.get(self.messages), list):
            doc["messages"] = rec[self.messages]
            empty = not doc["messages"]
        else:
            doc["prompt"] = self._field(rec, self.prompt, default_id)
            doc["response"] = self._field(rec, self.response, default_id)
            empty = not doc["prompt"].strip() or not doc["response"].strip()
        return None if empty else check_document(doc, self.shape, default_id)

    @staticmethod
    def _field(rec: dict, name: str, where: str) -> str:
        value = rec.get(name)
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: field {name!r} is {'missing' if value is None else type(value).__name__}; record keys are "
                f"{sorted(rec)}. Name the right field with text_field=/prompt_field=/response_field=."
            )
        return value


class _Decoder:
    """Bytes -> str under the ``errors`` policy, remembering files that needed replacement characters."""

    def __init__(self, errors: str):
        if errors not in ("replace", "strict"):
            raise ValueError(f"errors must be 'replace' or 'strict', got {errors!r}.")
        self.errors, self.replaced = errors, []

    def read(self, path: Path) -> str:
        raw = path.read_bytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if self.errors == "strict":
                raise ValueError(f"{path} is not valid UTF-8 (byte {e.start}: {e.reason}); convert it to UTF-8 or "
                                 "pass errors='replace' to decode with replacement characters.") from None
            self.replaced.append(path)
            return raw.decode("utf-8", errors="replace")


def _jsonl(path: Path, name: str, fields: _Fields, dec: _Decoder) -> Iterator[dict]:
    for i, line in enumerate(dec.read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}); a .jsonl file holds one JSON object per line.") from None
        doc = fields.document(rec, f"{name}:{i}")
        if doc is not None:
            yield doc


def _txt(path: Path, name: str, fields: _Fields, dec: _Decoder, txt_mode: str) -> Iterator[dict]:
    text = dec.read(path)
    if txt_mode == "file":
        if text.strip():
            yield {"id": name, "text": text}
        return
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield {"id": f"{name}:{i}", "text": line}


def _parquet(path: Path, name: str, fields: _Fields) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"Reading {path} needs pyarrow: `pip install pyarrow` (or convert it to .jsonl).") from None
    for i, rec in enumerate(pq.read_table(path).to_pylist()):
        doc = fields.document(rec, f"{name}:{i}")
        if doc is not None:
            yield doc


def _read_file(path: Path, name: str, fields: _Fields, dec: _Decoder, txt_mode: str) -> Iterator[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl(path, name, fields, dec)
    if suffix == ".parquet":
        return _parquet(path, name, fields)
    if suffix == ".txt":
        if fields.shape != "text":
            raise ValueError(f"{path}: a .txt file has no prompt/response fields; instruction data must be .jsonl or .parquet.")
        return _txt(path, name, fields, dec, txt_mode)
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {READABLE} (or a directory of them).")


def _directory_files(root: Path, shape: str) -> list[Path]:
    readable = {".jsonl", ".parquet"} | ({".txt"} if shape == "text" else set())
    keep, skipped = [], []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or p.suffix.lower() not in readable:
            skipped.append(rel.as_posix())
        else:
            keep.append(p)
    if skipped:
        log.info("%s: read %d file(s) of types %s; skipped %d other file(s): %s", root, len(keep), sorted(readable),
                 len(skipped), ", ".join(skipped[:20]) + (" ..." if len(skipped) > 20 else ""))
    return keep


def _hf_records(dataset_id: str, split: str) -> Iterable[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"No local file or directory named {dataset_id!r} exists, and loading it as a Hugging Face dataset needs "
            "the `datasets` package (`pip install datasets`) and a connection to the Hub. Offline, point the source "
            "at a local .jsonl/.txt/.parquet file or a directory of them."
        ) from None
    try:
        return datasets.load_dataset(dataset_id, split=split)
    except Exception as e:  # network, missing dataset, bad split: all need the same advice
        raise RuntimeError(f"Could not load Hugging Face dataset {dataset_id!r} (split {split!r}): {e}. Check the id "
                           "and your connection, or point the source at local files.") from e


def looks_like_hf_id(s: str) -> bool:
    """``True`` for ``name`` or ``owner/name`` without a known file extension and not starting with ``.``, ``/`` or ``~``."""
    return bool(_HF_ID.match(s)) and Path(s).suffix.lower() not in READABLE + (".json", ".csv")


def load_user_source(
    path_or_id: str | Path,
    shape: str = "text",
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    id_field: str = "id",
    txt_mode: str = "file",
    errors: str = "replace",
    hf_split: str = "train",
    limit: int | None = None,
) -> list[dict]:
    """Documents of ``shape`` from a local file, a directory, or a Hugging Face dataset id (rules in the module docstring).

    Args:
        path_or_id: a ``.jsonl``/``.txt``/``.parquet`` file, a directory, or a dataset id such as ``"owner/name"``.
        shape: ``"text"`` or ``"instruction"``.
        text_field, prompt_field, response_field, messages_field, id_field: record field names.
        txt_mode: ``"file"`` (one document per ``.txt`` file) or ``"line"`` (one per non-blank line).
        errors: invalid UTF-8 handling, ``"replace"`` (warn and decode with U+FFFD) or ``"strict"`` (ValueError).
        hf_split: split of a Hugging Face dataset.
        limit: stop after this many documents (in reading order); ``None`` reads everything.

    Returns:
        ``[{"id", "text"}]`` or ``[{"id", "prompt", "response"} | {"id", "messages"}]`` (plus ``group``/``kind`` if given).

    Raises:
        FileNotFoundError: the path does not exist (and is not a dataset id).
        ImportError: ``.parquet`` without pyarrow, or a dataset id without ``datasets``.
        RuntimeError: the Hugging Face dataset could not be loaded.
        ValueError: empty corpus, a missing field, bad JSON, invalid UTF-8 under ``errors="strict"``,
            a ``.txt`` for the instruction shape, an unsupported file type, bad ``txt_mode``/``errors``.
    """
    check_shape(shape)
    if txt_mode not in ("file", "line"):
        raise ValueError(f"txt_mode must be 'file' or 'line', got {txt_mode!r}.")
    fields = _Fields(shape, text_field, prompt_field, response_field, messages_field, id_field)
    dec = _Decoder(errors)
    raw = str(path_or_id)
    path = Path(raw).expanduser()
    if path.is_dir():
        files = _directory_files(path, shape)
        streams = (_read_file(f, f.relative_to(path).as_posix(), fields, dec, txt_mode) for f in files)
    elif path.is_file():
        streams = iter([_read_file(path, path.name, fields, dec, txt_mode)])
    elif looks_like_hf_id(raw):
        records = _hf_records(raw, hf_split)
        streams = iter([filter(None, (fields.document(r, f"{raw}:{hf_split}:{i}") for i, r in enumerate(records)))])
    else:
        raise FileNotFoundError(f"Data source {raw!r} does not exist (resolved to {path.resolve()}); give an existing "
                                ".jsonl/.txt/.parquet file, a directory of them, or a Hugging Face dataset id.")
    docs: list[dict] = []
    for stream in streams:
        for doc in stream:
            docs.append(doc)
            if limit is not None and len(docs) >= limit:
                break
        if limit is not None and len(docs) >= limit:
            break
    if dec.replaced:
        log.warning("%d file(s) were not valid UTF-8 and were decoded with U+FFFD replacement characters: %s",
                    len(dec.replaced), ", ".join(str(p) for p in dec.replaced[:20]))
    if not docs:
        raise ValueError(f"Data source {raw!r} has no non-empty {shape} documents; check the path, the file types "
                         f"({', '.join(READABLE)}) and the field names.")
    return docs
