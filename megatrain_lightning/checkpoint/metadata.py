"""``megatrain.json``: what a directory checkpoint holds, and the digests that tie its parts together.

Format 2 (the one written)::

    {"format": 2,
     "has_optimizer": true,
     "params":  {"<LightningModule parameter name>": {"shape": [..], "requires_grad": true}, ...},
     "tensors": {"<LightningModule state_dict key>": ["<part>", "<key in that part>"], ...},
     "parts":   {"model": "<sha256 of model/checksums.json>", "optimizer": "...", "trainer.pt": "<sha256>"},
     "digest":  "<sha256 of the other fields (:func:`info_digest`)>"}

A part is a folder with its own ``checksums.json`` (sha256 of each of its files) or the file ``trainer.pt``;
recording the sha256 of each ``checksums.json`` refuses, by name, a folder copied in from another checkpoint
(complete and self-consistent, but not the one recorded); ``digest`` refuses an edited or damaged
``megatrain.json`` that is still valid JSON (a file without it is read unchecked). Format 1 (no
``tensors``/``parts``) is still read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .hf_common import CHECKSUMS_FILE
from .hf_write import file_sha256, verify_checksums

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
INFO_FILE = "megatrain.json"
TRAINER_FILE = "trainer.pt"


def part_digest(root: Path, part: str) -> str:
    """sha256 of ``<part>/checksums.json`` for a folder, of the file itself otherwise."""
    p = root / part
    return file_sha256(p / CHECKSUMS_FILE if p.is_dir() else p)


def info_digest(info: dict[str, Any]) -> str:
    """sha256 (hex) of ``info`` without its ``digest`` field, as JSON with sorted keys."""
    body = json.dumps({k: v for k, v in info.items() if k != "digest"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def write_info(root: Path, *, has_optimizer: bool, params: dict[str, Any], tensors: dict[str, tuple[str, str]],
               parts: list[str]) -> dict[str, Any]:
    """Write ``root/megatrain.json`` (format 2, fsynced) after every part is complete. Returns it."""
    info = {
        "format": FORMAT_VERSION,
        "has_optimizer": has_optimizer,
        "params": params,
        "tensors": {k: list(v) for k, v in tensors.items()},
        "parts": {part: part_digest(root, part) for part in parts},
    }
    info["digest"] = info_digest(info)
    with open(root / INFO_FILE, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    return info


def _schema_problem(info: Any) -> str | None:
    """What is wrong with a parsed megatrain.json, or ``None``."""
    if not isinstance(info, dict):
        return f"it holds a {type(info).__name__}, not a JSON object"
    if type(info.get("format")) is not int or info["format"] not in READABLE_FORMATS:
        if "format" not in info:
            return "the field 'format' is missing"
        return (f"checkpoint format {info['format']!r} is not one this version reads {READABLE_FORMATS} "
                "(written by a newer megatrain-lightning? upgrade it)")
    required = {"has_optimizer": bool, "params": dict}
    if info["format"] >= 2:
        required.update(tensors=dict, parts=dict)
    for field, kind in required.items():
        if field not in info:
            return f"the field {field!r} is missing"
        if not isinstance(info[field], kind):
            return f"the field {field!r} is a {type(info[field]).__name__}, not a {kind.__name__}"
    for name, p in info["params"].items():
        if not (isinstance(p, dict) and isinstance(p.get("shape"), list) and isinstance(p.get("requires_grad"), bool)):
            return f"params[{name!r}] is not {{'shape': [...], 'requires_grad': bool}}"
    if info["format"] >= 2:
        bad = [k for k, v in info["tensors"].items()
               if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v))]
        if bad:
            return f"tensors[{bad[0]!r}] is not a [part, key] pair"
        unmapped = [n for n in info["params"] if n not in info["tensors"]]
        if unmapped:
            return f"the parameter(s) {unmapped[:3]} have no entry in 'tensors'"
        for part, digest in info["parts"].items():
            if not isinstance(digest, str) or Path(part).is_absolute() or ".." in Path(part).parts:
                return f"parts[{part!r}] is not a relative part name with a sha256"
    return None


def read_info(path: Path) -> dict[str, Any]:
    """The validated ``megatrain.json`` of the checkpoint directory ``path``.

    Raises:
        CheckpointError: ``path`` is a file or missing, or its megatrain.json is missing, not JSON, lacks a
            field, has a field of the wrong type or an unknown format (the message names the file and field).
    """
    if path.is_file():
        raise CheckpointError(
            f"{path} is a single file, not a checkpoint directory written by strategy='megatrain'. "
            "Checkpoints of this strategy are directories (model/, optimizer/, trainer.pt); "
            "trainer.fit(ckpt_path=...) also resumes from a plain Lightning .ckpt file."
        )
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint directory {path} does not exist.")
    f = path / INFO_FILE
    if not f.is_file():
        raise CheckpointError(f"{path} has no {INFO_FILE}: not a complete checkpoint of strategy='megatrain'.")
    advice = (f"It lists the checkpoint's parameters and ties its parts together, so {path} cannot be resumed or "
              "converted without it: restore it from a copy of this checkpoint, or resume from another checkpoint.")
    try:
        info = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{f} is damaged: not valid JSON ({err}). {advice}") from err
    problem = _schema_problem(info)
    if problem:
        raise CheckpointError(f"{f} is damaged: {problem}. {advice}")
    if "digest" in info and info["digest"] != info_digest(info):
        raise CheckpointError(f"{f} is damaged: its content does not match the sha256 recorded in it (an edit or a "
                              f"damaged byte). {advice}")
    return info


def verify_parts(path: Path, info: dict[str, Any]) -> None:
    """Check every part recorded in ``info`` (format 2): its files against its ``checksums.json``, and that
    (or ``trainer.pt``) against the digest recorded at save time.

    Raises:
        CheckpointError: a part is missing or damaged (names the file), or does not belong to this
            checkpoint (names the folder: it was copied from another checkpoint or changed after saving).
    """
    for part, digest in info["parts"].items():
        p = path / part
        if p.is_dir():
            try:
                verify_checksums(p)
            except (ValueError, FileNotFoundError) as err:
                raise CheckpointError(f"Checkpoint {path} is damaged: {err}") from err
        elif not p.is_file():
            raise CheckpointError(f"Checkpoint {path} is damaged: {part} is missing.")
        if part_digest(path, part) != digest:
            what = f"{part}/" if p.is_dir() else part
            state = ("it is complete and matches its checksums.json, but it is not the one saved with it" if p.is_dir()
                     else "its sha256 is not the one recorded in megatrain.json")
            raise CheckpointError(
                f"Checkpoint {path}: {what} does not belong to this checkpoint: {state}, so it was copied from "
                f"another checkpoint (another step?) or changed after saving. Put back the {what} saved with this "
                f"checkpoint, or resume from the checkpoint that {what} comes from.")
