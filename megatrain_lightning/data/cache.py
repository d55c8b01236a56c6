"""Tokenized-data cache: one safetensors file per key (no pickle), written atomically.

The key is a SHA-256 over everything the tensors depend on: the source fingerprint (document ids and
contents), the tokenizer (class, name, vocabulary size, a hash of its full serialized definition and
chat template), ``seq_len``, the shape, the split settings and a format version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 1
log = logging.getLogger(__name__)


def _sha(s: str | bytes) -> str:
    return hashlib.sha256(s.encode() if isinstance(s, str) else s).hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer's output: ``{"class", "name", "vocab_size", "definition", "chat_template", "eos",
    "bos"}``. ``definition`` hashes the Rust tokenizer's JSON (fast tokenizers) or the sorted vocabulary, so two
    tokenizers with the same name but different files get different keys.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "class": type(tokenizer).__name__,
        "name": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "definition": _sha(definition),
        "chat_template": _sha(str(getattr(tokenizer, "chat_template", None))),
        "eos": getattr(tokenizer, "eos_token_id", None),
        "bos": getattr(tokenizer, "bos_token_id", None),
    }


def cache_path(cache_dir: str | Path, parts: dict) -> Path:
    """``<cache_dir>/<shape>-T<seq_len>-<sha256 of parts, 24 hex>.safetensors``."""
    key = _sha(json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str))[:24]
    return Path(cache_dir).expanduser() / f"{parts.get('shape', 'data')}-T{parts.get('seq_len', 0)}-{key}.safetensors"


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write ``tensors`` and JSON ``meta`` to ``path`` via a temporary file and ``os.replace`` (no partial file is
    ever visible under ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"meta": json.dumps(meta)})
    os.replace(tmp, path)


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """``(tensors, meta)`` from ``path``, or ``None`` when it is missing or unreadable (then it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception as e:  # truncated/corrupt file: rebuild rather than fail
        log.warning("Ignoring unreadable cache file %s (%s); the data is tokenized again.", path, e)
        return None
