"""Writing Hugging Face safetensors directories shard by shard, with fsync and checksums."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file

from .hf_common import (CHECKSUMS_FILE, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, _HASH_CHUNK, _SHARD_RE,
                        resolve_dtype)
from .hf_config import saved_config
from .hf_names import saved_names, state_dict_entries, undeclared_sharing, warn_undeclared_sharing


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems/platforms refuse fsync on directories
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the file at ``path`` (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def add_checksums(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, str]:
    """Fsync the files ``names`` of ``directory`` and merge their sha256 into its ``checksums.json`` (written
    atomically, then the directory is fsynced). Returns the full mapping.

    Raises:
        FileNotFoundError: one of the files does not exist.
    """
    d = Path(directory)
    path = d / CHECKSUMS_FILE
    sums = json.loads(path.read_text()) if path.is_file() else {}
    for n in names:
        _fsync_path(d / n)
        sums[n] = file_sha256(d / n)
    _write_json(path, dict(sorted(sums.items())))
    _fsync_path(d)
    return sums


def _existing_weights(d: Path) -> list[str]:
    if not d.is_dir():
        return []
    return sorted(x.name for x in d.iterdir() if x.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(x.name))


def _prepare(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` on the CPU, contiguous, floating tensors cast to ``dtype`` (items were checked when grouped)."""
    cast = dtype is not None and t.is_floating_point()
    return t.detach().to(device="cpu", dtype=dtype if cast else t.dtype).contiguous()


def _unaliased(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``shard`` with every tensor whose bytes overlap an earlier one's replaced by a copy (safetensors refuses
    overlapping tensors in one file); disjoint views of one storage (a host slab) stay views."""
    spans: dict[int, list[tuple[int, int]]] = {}
    out = {}
    for n, t in shard.items():
        if t.numel():
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            mine = spans.setdefault(t.untyped_storage().data_ptr(), [])
            if any(s < end and start < e for s, e in mine):
                t = t.clone()
            else:
                mine.append((start, end))
        out[n] = t
    return out


def write_safetensors_shards(out_dir: str | os.PathLike, items: Iterable[tuple[str, torch.Tensor]], *,
                             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                             dtype: torch.dtype | str | None = None,
                             metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream ``(name, tensor)`` pairs into safetensors shards, transformers-style.

    Tensors are grouped in order until the next one would push the shard past ``max_shard_bytes`` (a larger
    tensor gets a shard of its own); each shard is converted (to CPU, ``dtype``, contiguous) only when written, so
    at most one shard of converted tensors exists at a time. Shard names, index and checksums: as
    :func:`finish_safetensors_parts`. Every file is fsynced, then the directory.

    Args:
        out_dir: created if missing; must not already hold weight files.
        items: ``(name, tensor)`` pairs, any dtype/device (meta excluded), names unique; views of one storage
            are fine (one overlapping an earlier tensor of its shard is written from a copy).
        max_shard_bytes: shard size limit in bytes (of the converted tensors).
        dtype: floating tensors are cast to it (:func:`~megatrain_lightning.checkpoint.hf_common.resolve_dtype`);
            integer/bool tensors keep theirs. ``None``: keep every dtype.
        metadata: string key/values stored in every shard header (``format: pt`` is always added).

    Returns:
        The index dict ``{"metadata": {"total_size": bytes, "total_parameters": n}, "weight_map": {name: file}}``
        (also for a single file, where it is not written).

    Raises:
        FileExistsError: ``out_dir`` already holds model.safetensors / shards / an index.
        ValueError: a duplicate name, a meta tensor, ``max_shard_bytes`` <= 0, an unknown dtype.
        TypeError: an item is not a tensor.
        OSError: the disk is full or not writable (temporary shards are removed).
    """
    d = Path(out_dir)
    if clash := _existing_weights(d):
        raise FileExistsError(f"{d} already holds weight files {clash[:5]}: write into a new or empty directory.")
    part = write_safetensors_part(d, items, prefix=f".tmp-{uuid.uuid4().hex[:8]}", max_shard_bytes=max_shard_bytes,
                                  dtype=dtype, metadata=metadata)
    return finish_safetensors_parts(d, [part])


def write_safetensors_part(out_dir: str | os.PathLike, items: Iterable[tuple[str, torch.Tensor]], *, prefix: str,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | str | None = None,
                           metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Write ``items`` as fsynced shards ``<prefix>-NNNNN.safetensors`` (grouped and converted as
    :func:`write_safetensors_shards` says), without index or checksums: one writer's part of a directory that
    :func:`finish_safetensors_parts` completes (several processes may write parts at once, each with its ``prefix``).

    Returns:
        Plain data that can travel to another process: ``{"files": [shard file names], "names": [[tensor names of
        each file]], "sums": {file: sha256}, "total_size": bytes, "total_parameters": n}``.

    Raises:
        ValueError, TypeError, OSError: as :func:`write_safetensors_shards` (this part's shards are removed).
    """
    d = Path(out_dir)
    dt = resolve_dtype(dtype)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}.")
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    written: list[Path] = []
    shard_names: list[list[str]] = []
    sums: dict[str, str] = {}
    seen: set[str] = set()
    total_size = total_params = 0

    def flush(pending: list[tuple[str, torch.Tensor]]) -> None:
        tmp = d / f"{prefix}-{len(written) + 1:05d}.safetensors"
        written.append(tmp)
        shard = _unaliased({n: _prepare(t, dt) for n, t in pending})
        save_file(shard, str(tmp), metadata=meta)
        del shard
        _fsync_path(tmp)
        sums[tmp.name] = file_sha256(tmp)
        shard_names.append([n for n, _ in pending])

    try:
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        for name, t in items:
            if name in seen:
                raise ValueError(f"Tensor name {name!r} appears twice; names must be unique.")
            seen.add(name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor.")
            if t.device.type == "meta":
                raise ValueError(f"{name!r} is on the meta device (never materialised): there is no data to write.")
            size = t.numel() * (dt.itemsize if dt is not None and t.is_floating_point() else t.element_size())
            if pending and pending_bytes + size > max_shard_bytes:
                flush(pending)
                pending, pending_bytes = [], 0
            pending.append((name, t))
            pending_bytes += size
            total_size += size
            total_params += t.numel()
        if pending:
            flush(pending)
        del pending
    except BaseException:
        for tmp in written:
            tmp.unlink(missing_ok=True)
        raise
    return {"files": [w.name for w in written], "names": shard_names, "sums": sums, "total_size": total_size,
            "total_parameters": total_params}


def finish_safetensors_parts(out_dir: str | os.PathLike, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Complete a directory of :func:`write_safetensors_part` parts (in order): rename the shards to
    ``model-00001-of-0000N.safetensors`` (``model.safetensors`` when there is one; an empty shard when there is
    none), write ``model.safetensors.index.json`` (N > 1), merge every file's sha256 into ``checksums.json`` and
    fsync the directory.

    Returns:
        The index dict ``{"metadata": {"total_size", "total_parameters"}, "weight_map": {name: file}}``.

    Raises:
        OSError: the disk is full or not writable (the parts' shards are removed).
    """
    d = Path(out_dir)
    files = [f for p in parts for f in p["files"]]
    names = [n for p in parts for n in p["names"]]
    sums = {k: v for p in parts for k, v in p["sums"].items()}
    try:
        if not files:  # nothing to write: one empty shard (``format: pt``), as a model without tensors is saved
            tmp = d / f".tmp-{uuid.uuid4().hex[:8]}-00001.safetensors"
            save_file({}, str(tmp), metadata={"format": "pt"})
            _fsync_path(tmp)
            sums[tmp.name] = file_sha256(tmp)
            files.append(tmp.name)
            names.append([])
        n = len(files)
        finals = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for tmp, final in zip(files, finals):
            os.replace(d / tmp, d / final)
        final_sums = {final: sums[tmp] for tmp, final in zip(files, finals)}
        files = []
    finally:
        for tmp in files:  # only on error: remove the partial shards
            (d / tmp).unlink(missing_ok=True)
    index = {
        "metadata": {"total_size": sum(p["total_size"] for p in parts),
                     "total_parameters": sum(p["total_parameters"] for p in parts)},
        "weight_map": {name: final for final, ns in zip(finals, names) for name in ns},
    }
    if n > 1:
        _write_json(d / INDEX_FILE, index)
        final_sums[INDEX_FILE] = file_sha256(d / INDEX_FILE)
    path = d / CHECKSUMS_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    _write_json(path, dict(sorted({**old, **final_sums}.items())))
    _fsync_path(d)
    return index


def _safetensors_expected_size(path: Path) -> tuple[int | None, str | None]:
    """(size the header implies, problem) for a safetensors file; problem is set when unreadable."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, f"truncated ({size} bytes, shorter than a safetensors header)"
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            return None, "corrupted (header length is implausible)"
        raw = f.read(n)
    if len(raw) < n:
        return None, f"truncated ({size} bytes; its header alone needs {8 + n})"
    try:
        header = json.loads(raw)
        end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
    except (ValueError, KeyError, TypeError, IndexError):
        return None, "corrupted (its header is not valid safetensors JSON)"
    return 8 + n + end, None


def verify_checksums(directory: str | os.PathLike) -> dict[str, str]:
    """Check every file listed in ``directory/checksums.json`` against its sha256.

    Returns:
        The verified ``{file name: sha256 hex}`` mapping.

    Raises:
        FileNotFoundError: ``directory`` or its ``checksums.json`` does not exist.
        ValueError: listed files are missing, truncated (shorter than their safetensors header implies) or
            corrupted (another size or hash); the message names each file.
    """
    d = Path(directory)
    path = d / CHECKSUMS_FILE
    if not d.is_dir():
        raise FileNotFoundError(f"Directory {d} does not exist.")
    if not path.is_file():
        raise FileNotFoundError(f"{d} has no {CHECKSUMS_FILE}: it was not written completely by megatrain "
                                "(or is not a megatrain checkpoint), so its files cannot be verified.")
    try:
        sums = json.loads(path.read_text())
        assert isinstance(sums, dict)
    except (ValueError, AssertionError) as err:
        raise ValueError(f"{path} is corrupted (not a JSON object of file -> sha256).") from err
    problems = []
    for name, digest in sums.items():
        f = d / name
        if Path(name).name != name:
            problems.append(f"{name}: not a plain file name")
        elif not f.is_file():
            problems.append(f"{name}: missing")
        else:
            expected, problem = (_safetensors_expected_size(f) if name.endswith(".safetensors") else (None, None))
            actual = f.stat().st_size
            if problem is None and expected is not None and actual != expected:
                problem = (f"truncated ({actual} bytes, header says {expected})" if actual < expected
                           else f"corrupted ({actual} bytes, header says {expected})")
            if problem is None and file_sha256(f) != digest:
                problem = "corrupted (sha256 differs)"
            if problem:
                problems.append(f"{name}: {problem}")
    if problems:
        raise ValueError(f"Checksum verification failed in {d}: " + "; ".join(problems))
    return sums


def save_hf_model_dir(out_dir: str | os.PathLike, model: torch.nn.Module, *, dtype: torch.dtype | str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: Any = None,
                      named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Write a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    The weights go through :func:`write_safetensors_shards` under ``model.state_dict()`` names, one tensor at a
    time (no state_dict is built); which names of shared tensors are written: :mod:`.hf_names`. Then the other
    files (:func:`write_hf_config_files`). Names are the model's own: for models whose checkpoints transformers
    converts on load (e.g. Mixtral's experts fused into ``experts.gate_up_proj``) the fused names are written;
    transformers >= 5 loads them as they are.

    Args:
        model: a transformers ``PreTrainedModel`` with materialised (non-meta) weights, unless
            ``named_tensors`` is given.
        tokenizer: anything with ``save_pretrained(dir)``.
        named_tensors: ``(state_dict name, tensor)`` pairs written instead of the model's own tensors (the
            caller then skips tied duplicates itself).

    Other arguments, return value and errors: as :func:`write_safetensors_shards`; also ``ValueError`` when the
    model holds packed quantized tensors (nothing is written then).
    """
    d = Path(out_dir)
    dt = resolve_dtype(dtype)
    if clash := _existing_weights(d):
        raise FileExistsError(f"{d} already holds weight files {clash[:5]}: write into a new or empty directory.")
    config = saved_config(model, dt)
    d.mkdir(parents=True, exist_ok=True)
    if named_tensors is None:
        entries = list(state_dict_entries(model))
        warn_undeclared_sharing(undeclared_sharing(model, entries), type(model).__name__)
        saved = saved_names(model, entries)
        named_tensors = ((n, t) for n, t in entries if saved[n] == n)
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    if ignore:  # exact names, as save_pretrained treats them
        named_tensors = ((n, t) for n, t in named_tensors if n not in ignore)
    index = write_safetensors_shards(d, named_tensors, max_shard_bytes=max_shard_bytes, dtype=dt)
    write_hf_config_files(d, model, dtype=dt, tokenizer=tokenizer, config=config)
    return index


def write_hf_config_files(out_dir: str | os.PathLike, model: torch.nn.Module, *, dtype: torch.dtype | str | None = None,
                          tokenizer: Any = None, config: Any = None) -> None:
    """The non-weight files of a Hugging Face model directory: ``config.json`` (``config``, default
    :func:`~.hf_config.saved_config` of ``model`` for ``dtype``, which describes the dense weights written; the
    model's own config is not modified), ``generation_config.json`` when the model can generate, remote code, the
    tokenizer; each new file (not weights) is added to ``checksums.json``."""
    d = Path(out_dir)
    before = {x.name for x in d.iterdir()}
    config = config if config is not None else saved_config(model, resolve_dtype(dtype))
    config.save_pretrained(str(d))
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if gen is not None and can_generate():
        gen.save_pretrained(str(d))
    if getattr(model, "is_remote_code", lambda: False)():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, str(d), config=config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(d))
    skip = {INDEX_FILE, CHECKSUMS_FILE}
    new = sorted(x.name for x in d.iterdir() if x.is_file() and x.name not in before and x.name not in skip
                 and not x.name.endswith(".safetensors"))
    add_checksums(d, new)

