"""User sources: local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.txt`` files, directories of them, or a Hugging Face
dataset id. Records become documents through :class:`~megatrain_lightning.data.records.RecordMapper` (plain text,
prompt/response, Alpaca, OpenAI ``messages``, ShareGPT ``conversations``).

Rules (all tested in ``tests/test_data.py``):

* ``.jsonl``: one JSON object per line (blank lines skipped). ``id_field`` gives the id when present, otherwise
  ``"<file>:<line>"``. Optional ``group``/``kind`` fields are kept.
* ``.json``: a list of records, or an object with exactly one list of records as a value (``{"data": [...]}``);
  ids default to ``"<file>:<index>"`` (from 1).
* ``.parquet``: rows mapped like JSON objects (ids ``"<file>:<row>"`` from 0); needs ``pyarrow``
  (``pip install megatrain-lightning[data]``; ImportError saying so otherwise).
* ``.txt``: text shape only. ``txt_mode="file"``: one document per file (id = path relative to the directory
  given, or the file name); ``txt_mode="line"``: one document per non-blank line (id ``"<file>:<line>"``).
* A directory: every file below it, in sorted path order. Files of the types that can give the requested shape are
  read; everything else (other extensions, ``.txt`` for the instruction shape, hidden files and directories) is
  skipped and listed in one INFO log line.
* Invalid UTF-8 with ``errors="replace"`` (default): the file is decoded with U+FFFD replacement characters and one
  WARNING names every such file. ``errors="strict"``: ValueError naming the file and the byte offset.
* A path that does not exist: FileNotFoundError naming it, unless it looks like a Hugging Face dataset id (``name``
  or ``owner/name``, no file extension), which is loaded with ``datasets.load_dataset(id, split=hf_split)``:
  ImportError when ``datasets`` is not installed, RuntimeError when loading fails (e.g. offline).
* Documents with empty text (or empty prompt/response) are dropped; no document at all: ValueError.
* :func:`peek_user_source` maps only the first records (the first MiB of a text file, the first row group of a
  parquet file, the first file of a directory), so a wrong field name is found in milliseconds.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from .corpus import check_document, check_shape
from .records import FieldError, RecordMapper

log = logging.getLogger(__name__)

READABLE = (".jsonl", ".json", ".parquet", ".txt")
PEEK_BYTES = 2**20
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class _Decoder:
    """Bytes -> str under the ``errors`` policy, remembering files that needed replacement characters."""

    def __init__(self, errors: str):
        if errors not in ("replace", "strict"):
            raise FieldError(f"errors must be 'replace' or 'strict', got {errors!r}.", "errors")
        self.errors, self.replaced = errors, []

    def read(self, path: Path, head: int | None = None) -> str:
        """The file's text; with ``head``, only its first ``head`` bytes cut back to the last full line."""
        if head is None:
            raw = path.read_bytes()
        else:
            with path.open("rb") as f:
                raw = f.read(head + 1)
            if len(raw) > head:
                raw = raw[: raw.rfind(b"\n", 0, head) + 1]
        try:
            return raw.decode("utf-8-sig")  # a byte-order mark (some Windows editors write one) is not text
        except UnicodeDecodeError as e:
            if self.errors == "strict":
                raise ValueError(f"{path} is not valid UTF-8 (byte {e.start}: {e.reason}); convert it to UTF-8 or "
                                 "pass errors='replace' to decode with replacement characters.") from None
            self.replaced.append(path)
            return raw.decode("utf-8-sig", errors="replace")


def _jsonl(path: Path, name: str, fields: RecordMapper, dec: _Decoder, head: int | None) -> Iterator[dict | None]:
    for i, line in enumerate(dec.read(path, head).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            hint = " (is it a .json file: one list of records?)" if i == 1 and line.lstrip().startswith("[") else ""
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}); a .jsonl file holds one JSON object per "
                             f"line{hint}.") from None
        if isinstance(rec, list):  # json.dump(records, f) on one line: valid JSON, but a list, not a record
            raise ValueError(f"{path}:{i}: a JSON list, not one JSON object per line (is it a .json file: one list "
                             "of records? rename it to .json).")
        yield fields.document(rec, f"{name}:{i}")


def _json(path: Path, name: str, fields: RecordMapper, dec: _Decoder) -> Iterator[dict | None]:
    try:
        data = json.loads(dec.read(path))
    except json.JSONDecodeError as e:
        hint = " (one object per line is a .jsonl file: rename it)" if e.msg == "Extra data" else ""
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}){hint}.") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json source must hold a list of records (or an object with one list of "
                         f"records, e.g. {{\"data\": [...]}}), got {type(data).__name__} with keys "
                         f"{sorted(data) if isinstance(data, dict) else '-'}.")
    for i, rec in enumerate(data, start=1):
        yield fields.document(rec, f"{name}:{i}")


def _txt(path: Path, name: str, dec: _Decoder, txt_mode: str, head: int | None) -> Iterator[dict]:
    text = dec.read(path, head)
    if txt_mode == "file":
        if text.strip():
            yield {"id": name, "text": text}
        return
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield {"id": f"{name}:{i}", "text": line}


def _parquet(path: Path, name: str, fields: RecordMapper, head: int | None) -> Iterator[dict | None]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"Reading {path} needs pyarrow: `pip install megatrain-lightning[data]` (or `pip install "
                          "pyarrow`), or convert it to .jsonl.") from None
    f = pq.ParquetFile(path)
    i = 0
    for batch in f.iter_batches(batch_size=head or 4096):
        for rec in batch.to_pylist():
            yield fields.document(rec, f"{name}:{i}")
            i += 1
        if head:
            return


def _read_file(path: Path, name: str, fields: RecordMapper, dec: _Decoder, txt_mode: str,
               head: int | None = None) -> Iterator[dict | None]:
    """The file's documents, ``None`` for a record with empty content."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl(path, name, fields, dec, head)
    if suffix == ".json":
        return _json(path, name, fields, dec)
    if suffix == ".parquet":
        return _parquet(path, name, fields, head and 64)
    if suffix == ".txt":
        if fields.shape != "text":
            raise FieldError(f"{path}: a .txt file has no prompt/response fields; instruction data must be .jsonl, "
                             ".json or .parquet (or use shape='text').", "shape", "text")
        return _txt(path, name, dec, txt_mode, head)
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {READABLE} (or a directory of them).")


def source_files(path: str | Path, shape: str) -> list[Path]:
    """The files a local source is read from: the file itself, or those of a directory that
    :func:`load_user_source` reads for ``shape`` (nothing logged).

    Raises:
        FileNotFoundError: ``path`` does not exist."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"Data source {p} does not exist.")
    return [p] if p.is_file() else _directory_files(p, shape, quiet=True)


def _directory_files(root: Path, shape: str, quiet: bool = False) -> list[Path]:
    readable = {".jsonl", ".json", ".parquet"} | ({".txt"} if shape == "text" else set())
    keep, skipped = [], []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or p.suffix.lower() not in readable:
            skipped.append(rel.as_posix())
        else:
            keep.append(p)
    if skipped and not quiet:
        _log_skipped(root, len(keep), tuple(sorted(readable)), tuple(skipped))
    return keep


@functools.lru_cache(maxsize=None)
def _log_skipped(root: Path, kept: int, readable: tuple[str, ...], skipped: tuple[str, ...]) -> None:
    """Log the files a directory source leaves out, once per process (preflight and the data module both list it)."""
    log.info("%s: read %d file(s) of types %s; skipped %d other file(s): %s", root, kept, list(readable),
             len(skipped), ", ".join(skipped[:20]) + (" ..." if len(skipped) > 20 else ""))


def _hf_module(dataset_id: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"No local file or directory named {dataset_id!r} exists, and loading it as a Hugging Face dataset needs "
            "the `datasets` package (`pip install datasets`) and a connection to the Hub. Offline, point the source "
            "at a local .jsonl/.txt/.parquet file or a directory of them."
        ) from None
    return datasets


def looks_like_hf_id(s: str) -> bool:
    """``True`` for ``name`` or ``owner/name`` without a known file extension, not starting with ``.``/``/``/``~``."""
    return bool(_HF_ID.match(s)) and Path(s).suffix.lower() not in READABLE + (".csv",)


USER_OPTIONS = ("text_field", "prompt_field", "response_field", "input_field", "messages_field", "conversations_field",
                "id_field", "txt_mode", "errors", "hf_split", "limit")


def _streams(raw: str, shape: str, fields: RecordMapper, dec: _Decoder, txt_mode: str, hf_split: str,
             head: int | None) -> Iterator[tuple[str, Iterable[dict]]]:
    """``(name, documents)`` of each file of the source (name: relative to a directory given), or of the dataset."""
    path = Path(raw).expanduser()
    if path.is_dir():
        for f in _directory_files(path, shape):
            name = f.relative_to(path).as_posix()
            yield name, filter(None, _read_file(f, name, fields, dec, txt_mode, head))
    elif path.is_file():
        yield path.name, filter(None, _read_file(path, path.name, fields, dec, txt_mode, head))
    elif looks_like_hf_id(raw):
        datasets = _hf_module(raw)
        try:
            records = datasets.load_dataset(raw, split=hf_split)
        except Exception as e:  # network, missing dataset, bad split: all need the same advice
            raise RuntimeError(f"Could not load Hugging Face dataset {raw!r} (split {hf_split!r}): {e}. Check the id "
                               "and your connection, or point the source at local files.") from e
        yield raw, filter(None, (fields.document(r, f"{raw}:{hf_split}:{i}") for i, r in enumerate(records)))
    else:
        raise FileNotFoundError(f"Data source {raw!r} does not exist (resolved to {path.resolve()}); give an existing "
                                f"{'/'.join(READABLE)} file, a directory of them, or a Hugging Face dataset id.")


def _mapper(shape: str, txt_mode: str, **field_names: Any) -> RecordMapper:
    check_shape(shape)
    if txt_mode not in ("file", "line"):
        raise FieldError(f"txt_mode must be 'file' or 'line', got {txt_mode!r}.", "txt_mode")
    return RecordMapper(shape, **field_names)


def load_user_source(
    path_or_id: str | Path,
    shape: str = "text",
    text_field: str = "text",
    prompt_field: str | None = None,
    response_field: str | None = None,
    input_field: str | None = "input",
    messages_field: str = "messages",
    conversations_field: str = "conversations",
    id_field: str = "id",
    txt_mode: str = "file",
    errors: str = "replace",
    hf_split: str = "train",
    limit: int | None = None,
) -> list[dict]:
    """Documents of ``shape`` from a local file, a directory, or a Hugging Face dataset id (module docstring).

    Args:
        path_or_id: a ``.jsonl``/``.json``/``.parquet``/``.txt`` file, a directory, or a dataset id (``"owner/name"``).
        shape: ``"text"`` or ``"instruction"``.
        text_field, prompt_field, response_field, input_field, messages_field, conversations_field, id_field: record
            field names (:class:`~megatrain_lightning.data.records.RecordMapper`).
        txt_mode: ``"file"`` (one document per ``.txt`` file) or ``"line"`` (one per non-blank line).
        errors: invalid UTF-8 handling, ``"replace"`` (warn and decode with U+FFFD) or ``"strict"`` (ValueError).
        hf_split: split of a Hugging Face dataset.
        limit: stop after this many documents (in reading order); ``None`` reads everything.

    Returns:
        ``[{"id", "text"}]`` or ``[{"id", "prompt", "response"} | {"id", "messages"}]`` (plus ``group``/``kind``).

    Raises:
        FileNotFoundError: the path does not exist (and is not a dataset id).
        ImportError: ``.parquet`` without pyarrow, or a dataset id without ``datasets``.
        RuntimeError: the Hugging Face dataset could not be loaded.
        FieldError: (a ValueError naming the option and a suggested value) a record lacks the named field, a bad
            ``txt_mode``/``errors``, or two records with one id (``option="id_field"``, suggestion ``null``).
        ValueError: empty corpus, bad JSON, invalid UTF-8 under ``errors="strict"``, an unsupported file type.
    """
    fields = _mapper(shape, txt_mode, text_field=text_field, prompt_field=prompt_field, response_field=response_field,
                     input_field=input_field, messages_field=messages_field, conversations_field=conversations_field,
                     id_field=id_field)
    dec = _Decoder(errors)
    raw = str(path_or_id)
    docs: list[dict] = []
    seen: dict[str, str] = {}  # id -> the file that gave it first
    streams = _streams(raw, shape, fields, dec, txt_mode, hf_split, None)
    for name, doc in ((name, doc) for name, stream in streams for doc in stream):
        if doc["id"] in seen:
            where = name if seen[doc["id"]] == name else f"{seen[doc['id']]} and {name}"
            raise FieldError(f"{raw}: two records have the id {doc['id']!r} (field {id_field!r}, in {where}); ids "
                             f"must be unique. Set id_field=null to number the records by file and line instead, "
                             "or make the ids unique.", "id_field", "null")
        seen[doc["id"]] = name
        docs.append(doc)
        if limit is not None and len(docs) >= limit:
            break
    if dec.replaced:
        log.warning("%d file(s) were not valid UTF-8 and were decoded with U+FFFD replacement characters: %s",
                    len(dec.replaced), ", ".join(str(p) for p in dec.replaced[:20]))
    if not docs:
        types = [t for t in READABLE if shape == "text" or t != ".txt"]  # .txt is skipped for instruction data
        raise ValueError(f"Data source {raw!r} has no non-empty {shape} documents; check the path, the file types "
                         f"({', '.join(types)}) and the field names.")
    return docs


def peek_user_source(path_or_id: str | Path, shape: str = "text", n: int = 8, **options: Any) -> list[dict]:
    """The first ``n`` documents of a local source, reading only its beginning (module docstring), to check field
    names before a run. A dataset id is not opened (``[]``; ``datasets`` must be importable). ``options``: those of
    :func:`load_user_source` (``limit`` and ``hf_split`` are ignored).

    Raises:
        the errors of :func:`load_user_source` that the first records show, plus ValueError for an unknown option.
    """
    unknown = sorted(set(options) - set(USER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown source option(s) {unknown}; allowed: {list(USER_OPTIONS)}.")
    txt_mode, errors = options.pop("txt_mode", "file"), options.pop("errors", "replace")
    hf_split = options.pop("hf_split", "train")
    options.pop("limit", None)
    fields = _mapper(shape, txt_mode, **options)
    raw = str(path_or_id)
    if not Path(raw).expanduser().exists() and looks_like_hf_id(raw):
        _hf_module(raw)
        return []
    docs: list[dict] = []
    for _, stream in _streams(raw, shape, fields, _Decoder(errors), txt_mode, hf_split, PEEK_BYTES):
        for doc in stream:
            docs.append(check_document(doc, shape, doc["id"]))
            if len(docs) >= n:
                return docs
    return docs
