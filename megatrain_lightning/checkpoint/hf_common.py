"""Constants and small helpers shared by the Hugging Face reader and writer."""

from __future__ import annotations

import difflib
import re
from typing import Iterable

import torch


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKSUMS_FILE = "checksums.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HASH_CHUNK = 8 * 2**20

_ST_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "U16": "uint16", "U32": "uint32", "U64": "uint64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    }.items()
    if hasattr(torch, attr)
}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


class CheckpointFormatError(ValueError):
    """A safetensors file or index is truncated, corrupted or inconsistent."""


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``None``/a floating ``torch.dtype``/one of ``fp32 bf16 fp16 float32 bfloat16 float16`` -> dtype.

    Raises:
        ValueError: an unknown name or a non-floating dtype.
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating-point dtype; use one of fp32, bf16, fp16.")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of fp32, bf16, fp16 (or float32, bfloat16, float16).")
    return _DTYPE_NAMES[key]


def _close(word: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    cands = list(candidates)
    near = difflib.get_close_matches(word, cands, n=n, cutoff=0.5)
    return near or cands[:n]


def _tied_targets(model: torch.nn.Module) -> dict[str, str]:
    """``{tied parameter name: name it is tied to}`` as transformers declares it for ``model``."""
    ties = getattr(model, "all_tied_weights_keys", None)
    if ties is None and hasattr(model, "get_expanded_tied_weights_keys"):
        ties = model.get_expanded_tied_weights_keys(all_submodels=True)
    return dict(ties or {})


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
