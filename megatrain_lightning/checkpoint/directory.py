"""Directory checkpoints: weights and AdamW state as safetensors, trainer metadata without pickle.

A checkpoint directory holds ``model/`` (or ``base_model/`` + ``adapter/`` for a peft model: peft_io.py),
``extra/`` and ``optimizer/`` (keys ``"<parameter name>/<state>"``: AdamW's ``exp_avg``, ``exp_avg_sq``,
``step``, or another optimizer's state tensors such as ``momentum_buffer``), each with its ``checksums.json``, plus
``trainer.pt`` (plain.py) and ``megatrain.json`` (metadata.py); what each holds: docs/internals/checkpoints.md,
"Directory layout". What goes where is planned before anything is written (layout.py); the directory is written
into a hidden temporary sibling, fsynced, and put in place atomically (atomic.py). Tensors are written one shard
at a time from views of the host store, so saving never needs a second copy of the model.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..optim.state_packing import unflatten_named
from .atomic import check_name_length, clean_stale, fsync_path, put_in_place, temporary_path
from .errors import CheckpointError
from .hf_io import SafetensorsSource, save_hf_model_dir, source_key, verify_checksums, write_safetensors_shards
from .hf_write import finish_safetensors_parts, write_hf_config_files, write_safetensors_part
from .layout import Layout, hf_model_of, open_part, plan_layout, verify_written
from .metadata import INFO_FILE, TRAINER_FILE, read_info, verify_parts, write_info
from .peft_io import write_adapters
from .plain import to_plain

__all__ = ["CheckpointError", "check_compatible", "load_checkpoint_dir", "load_optimizer_dir", "save_checkpoint_dir",
           "saved_state_keys", "verified_info"]


def _write_parts(tmp: Path, layout: Layout, read: Callable, tokenizer: Any, max_shard_bytes: int) -> list[str]:
    """Write every part of ``layout`` into ``tmp``; returns the part names."""
    written: list[str] = []
    adapters = {}
    for part in layout.parts:
        items = ((k, read(t)) for k, t in part.entries)
        if part.kind == "hf":
            save_hf_model_dir(tmp / part.name, part.hf_model, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                              named_tensors=items)
        elif part.kind == "plain":
            write_safetensors_shards(tmp / part.name, items, max_shard_bytes=max_shard_bytes)
        else:
            adapters[part.name] = part.entries
            continue
        written.append(part.name)
    if adapters:
        written += write_adapters(tmp, layout.peft_model, adapters, read)
    return written


class Cooperation(Protocol):
    """Several processes writing one directory checkpoint (data parallel; ``parallel/checkpoint_writers.py``).

    Attributes:
        rank: this process's global rank (rank 0 completes the checkpoint).
        writer: this process's writer number (its files' prefix), or ``None`` if it writes no tensors (every
            node holds the same state, so one node writes).
    """

    rank: int
    writer: int | None

    def writes(self, t: torch.Tensor) -> bool:
        """This writer writes module tensor ``t`` (a parameter of a slab it owns; rank 0: every other tensor)."""

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a collective: every rank calls it at the same points)."""


def save_checkpoint_dir(path: str | os.PathLike, checkpoint: dict[str, Any], module: nn.Module, engine: Any,
                        tokenizer: Any = None, max_shard_bytes: int = 2 * 2**30, coop: Cooperation | None = None) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a directory checkpoint at ``path``.

    Args:
        path: the final directory (Lightning's ``filepath``, e.g. ``epoch=0-step=10.ckpt``).
        checkpoint: Lightning's checkpoint dict; its ``state_dict`` and ``optimizer_states`` entries
            are ignored (tensors are read from the host store instead).
        module: the LightningModule (its parameters are views of the store, flushed).
        engine: the streaming engine, whose store the weights and AdamW state are read from.
        tokenizer: written into the Hugging Face model folder when given.
        max_shard_bytes: shard size of the safetensors files (bytes).
        coop: data parallel: every rank calls this and writes the slabs it owns (:func:`_save_together`).

    Raises:
        CheckpointError: a tensor of the module would not be written, or ``path`` is a non-empty directory that
            is not a checkpoint (e.g. ``trainer.default_root_dir``, which saving would delete), both before anything
            is written; the written files lack a planned tensor, or the metadata cannot be made loadable without
            pickle.
        ValueError: the Hugging Face model holds packed quantized tensors (nothing written).
        OSError: ``ENOSPC`` (:func:`disk_full_error`) or not writable, the previous checkpoint untouched;
            ``ENAMETOOLONG`` (:func:`~megatrain_lightning.checkpoint.atomic.check_name_length`), before anything
            is written.
    """
    final = Path(path)
    check_name_length(final)
    layout = plan_layout(module)
    if final.is_dir() and not final.is_symlink() and any(final.iterdir()) and not (final / INFO_FILE).is_file():
        raise CheckpointError(
            f"megatrain: {final} is a directory with files in it that is not a checkpoint (no {INFO_FILE}); a "
            "checkpoint of strategy='megatrain' is itself a directory that replaces whatever is at its path, so "
            f"saving there would delete those files. Save to a new path instead, e.g. {final / 'last.ckpt'}.")
    if coop is not None:
        _save_together(final, checkpoint, module, engine, layout, tokenizer, max_shard_bytes, coop)
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = temporary_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if engine.host_memory_limit is not None:  # tensors are copies read through the window
            max_shard_bytes = max(2**26, min(max_shard_bytes, engine.host_memory_limit // 8))
        parts = _write_parts(tmp, layout, engine.params.reader(), tokenizer, max_shard_bytes)
        has_opt = "optimizer_states" in checkpoint and engine.optimizer is not None
        if has_opt:
            write_safetensors_shards(tmp / "optimizer", engine.params.named_optimizer_state(module),
                                     max_shard_bytes=max_shard_bytes)
        _finish(final, tmp, checkpoint, module, engine, layout, parts, has_opt)
    except BaseException as err:
        full = disk_full_error(err, final, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from err
        raise


def disk_full_error(err: BaseException, final: Path, tmp: Path) -> OSError | None:
    """``OSError(errno.ENOSPC, message naming the checkpoint, the MiB written and free, and what to do)`` when
    writing ``final`` (into ``tmp``) failed because its filesystem is full, else ``None``. Each library reports a
    full disk its own way (``OSError`` ENOSPC/EDQUOT, safetensors' "os error 28", ``torch.save``'s
    ``RuntimeError`` "unexpected pos", which names no cause: a full disk when under 16 MiB are free, read before
    ``tmp`` is removed)."""
    text = f"{type(err).__name__}: {err}"
    try:
        free = shutil.disk_usage(final.parent).free
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.exists() else 0
    except OSError:
        return None
    zip_writer = isinstance(err, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter" in text)
    nospace = ((isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left" in text or "os error 28" in text or (zip_writer and free < 2**24))
    if not nospace or isinstance(err, (KeyboardInterrupt, SystemExit)):
        return None
    mib = 2**20
    return OSError(errno.ENOSPC, (
        f"megatrain: the checkpoint {final} could not be written: its filesystem is full ({written / mib:,.1f} MiB "
        f"written before the failure, {free / mib:,.1f} MiB free now). What was written has been removed; the "
        f"previous checkpoint of that name, if any, is untouched. Free space on {final.parent}, or save elsewhere "
        f"(ModelCheckpoint(dirpath=...), trainer.save_checkpoint(path)). ({text})"))


def _finish(final: Path, tmp: Path, checkpoint: dict[str, Any], module: nn.Module, engine: Any, layout: Layout,
            parts: list[str], has_opt: bool) -> None:
    """Check what was written, add ``trainer.pt`` and ``megatrain.json``, move ``tmp`` to ``final`` atomically."""
    verify_written(tmp, layout.tensors)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if has_opt:
        parts.append("optimizer")
        meta["megatrain_param_groups"] = engine.optimizer.param_groups_meta(module)
    elif "optimizer_states" in checkpoint:  # saved with no optimizer (after trainer.validate): as plain Lightning,
        meta["optimizer_states"] = []  # an empty list, so fit from it starts a fresh optimizer (not "weights only")
    meta = to_plain(meta, where="checkpoint")
    torch.save(meta, tmp / TRAINER_FILE)
    fsync_path(tmp / TRAINER_FILE)
    torch.load(tmp / TRAINER_FILE, weights_only=True)  # refuse to write what cannot be loaded safely
    params = {n: {"shape": list(p.shape), "requires_grad": p.requires_grad} for n, p in module.named_parameters()}
    write_info(tmp, has_optimizer=has_opt, params=params, tensors=layout.tensors, parts=parts + [TRAINER_FILE])
    fsync_path(tmp)
    put_in_place(tmp, final)


def _save_together(final: Path, checkpoint: dict[str, Any], module: nn.Module, engine: Any, layout: Layout,
                   tokenizer: Any, max_shard_bytes: int, coop: Cooperation) -> None:
    """:func:`save_checkpoint_dir` by several processes: rank 0 makes the temporary directory; every writer writes
    its tensors (``write_safetensors_part``, prefix ``.part-<writer>``) into each part at once; the outcomes are
    exchanged (a failed writer fails every rank, naming it); rank 0 completes each part (shard names, indexes,
    config, tokenizer, peft adapters) and finishes as one process does. The files are those one process writes,
    with the shards split differently."""
    token = coop.exchange(f"{os.getpid()}-{os.urandom(4).hex()}" if coop.rank == 0 else None)[0]
    tmp = temporary_path(final, token)
    if coop.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(final)
        tmp.mkdir()
    coop.exchange(None)  # the directory exists before anyone writes into it
    has_opt = "optimizer_states" in checkpoint and engine.optimizer is not None
    mine: dict[str, Any] = {}
    try:
        if coop.writer is not None:
            prefix = f".part-{coop.writer:04d}"
            read = engine.params.reader()
            for part in layout.parts:
                if part.kind not in ("hf", "plain"):
                    continue
                items = ((k, read(t)) for k, t in part.entries if coop.writes(t))
                mine[part.name] = write_safetensors_part(tmp / part.name, items, prefix=prefix,
                                                         max_shard_bytes=max_shard_bytes)
            if has_opt:
                items = engine.params.named_optimizer_state(module, keep=coop.writes)
                mine["optimizer"] = write_safetensors_part(tmp / "optimizer", items, prefix=prefix,
                                                           max_shard_bytes=max_shard_bytes)
    except Exception as err:  # every rank learns of it below
        full = disk_full_error(err, final, tmp)
        mine = {"error": str(full) if full is not None else f"{type(err).__name__}: {err}"}
    outcomes = coop.exchange(mine)
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if "error" in o]
    if failed:
        if coop.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        r, err = failed[0]
        raise CheckpointError(f"rank {r} could not write its part of the checkpoint {final} ({err}); nothing was "
                              "written under that name (the previous checkpoint, if any, is untouched).")
    if coop.rank != 0:
        return
    try:
        parts: list[str] = []
        adapters = {}
        for part in layout.parts:
            if part.kind == "adapter":
                adapters[part.name] = part.entries
                continue
            finish_safetensors_parts(tmp / part.name, [o[part.name] for o in outcomes if part.name in o])
            if part.kind == "hf":
                write_hf_config_files(tmp / part.name, part.hf_model, tokenizer=tokenizer)
            parts.append(part.name)
        if adapters:
            parts += write_adapters(tmp, layout.peft_model, adapters, engine.params.reader())
        if has_opt:
            finish_safetensors_parts(tmp / "optimizer", [o["optimizer"] for o in outcomes if "optimizer" in o])
        _finish(final, tmp, checkpoint, module, engine, layout, parts, has_opt)
    except BaseException as err:
        full = disk_full_error(err, final, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from err
        raise


def saved_name(saved: Any, current: list[str]) -> Callable[[str], str]:
    """Map a name of the module being loaded to its name in a checkpoint whose parameter names are ``saved``: the
    same, or with one leading module path added or removed when that makes every current name a saved one (a
    ``LightningModule`` holding ``self.model = hf_model`` against the bare Hugging Face model, either way)."""
    names = set(saved)
    if not current or all(n in names for n in current):
        return lambda n: n
    first = current[0]
    for s in names:  # the checkpoint's names have a prefix more: "model." + name
        if s.endswith("." + first):
            pre = s[: len(s) - len(first)]
            if all(pre + n in names for n in current):
                return lambda n: pre + n
    for s in names:  # the module's names have a prefix more
        if first.endswith("." + s):
            pre = first[: len(first) - len(s)]
            if all(n.startswith(pre) and n[len(pre):] in names for n in current):
                return lambda n: n[len(pre):] if n.startswith(pre) else n
    return lambda n: n


def check_compatible(path: Path, info: dict[str, Any], module: nn.Module, strict: bool = True) -> None:
    """Raise ``CheckpointError`` naming the differences if the checkpoint was written for another model: with
    ``strict`` (``LightningModule.strict_loading``), parameters missing on either side or of another shape; without,
    only a parameter both hold with another shape (as ``nn.Module.load_state_dict(strict=False)``)."""
    saved = info["params"]
    rename = saved_name(saved, [n for n, _ in module.named_parameters()])
    current = {rename(n): list(p.shape) for n, p in module.named_parameters()}
    missing = sorted(set(current) - set(saved)) if strict else []
    extra = sorted(set(saved) - set(current)) if strict else []
    shapes = sorted(n for n in set(current) & set(saved) if saved[n]["shape"] != current[n])
    if missing or extra or shapes:
        detail = "; ".join(
            s for s in (
                f"missing in checkpoint: {missing[:5]}" if missing else "",
                f"not in the model: {extra[:5]}" if extra else "",
                f"shape differs: {[(n, saved[n]['shape'], current[n]) for n in shapes[:5]]}" if shapes else "",
            ) if s
        )
        hint = (" Set `self.strict_loading = False` in the LightningModule to load the tensors both hold."
                if strict and not shapes else "")
        raise CheckpointError(f"Checkpoint {path} was written for another model config ({detail}).{hint}")


def verified_info(path: str | os.PathLike) -> dict[str, Any]:
    """The ``megatrain.json`` of a checkpoint directory after checking every part
    (:func:`~megatrain_lightning.checkpoint.metadata.verify_parts`; format 1: the checksums only).

    Raises:
        CheckpointError: not a checkpoint directory, a damaged megatrain.json, a missing or damaged
            file, or a part copied from another checkpoint (the message names the file or folder).
    """
    p = Path(path)
    info = read_info(p)
    _verify(p, info)
    return info


def _verify(p: Path, info: dict[str, Any]) -> None:
    if info["format"] >= 2:
        verify_parts(p, info)
        return
    for sub in ("model", "optimizer") if info["has_optimizer"] else ("model",):
        try:
            verify_checksums(p / sub)
        except (ValueError, FileNotFoundError) as err:
            raise CheckpointError(f"Checkpoint {p} is damaged: {err}") from err


def _format1_keys(module: nn.Module) -> dict[str, tuple[str, str]]:
    """Format-1 checkpoints: parameter name -> ("model", key), HF naming when the model is HF."""
    found = hf_model_of(module)
    names = [n for n, _ in module.named_parameters()]
    if found is None:
        return {n: ("model", n) for n in names}
    prefix, hf = found
    cut = len(prefix) + 1 if prefix else 0
    return {n: ("model", source_key(hf, n[cut:])) for n in names}


def load_checkpoint_dir(path: str | os.PathLike, module: nn.Module, engine: Any, strict: bool = True) -> dict[str, Any]:
    """Verify a checkpoint directory, copy its tensors into the module one at a time (parameters into the
    engine's store, persistent buffers in place), and return Lightning's metadata dict, whose ``state_dict`` is
    ``{}`` (docs/guide/checkpoints.md, "``on_load_checkpoint`` and ``on_save_checkpoint``").

    Args:
        strict: ``LightningModule.strict_loading``; ``False``: tensors the checkpoint lacks keep their values and
            tensors the module lacks are ignored (a shape that differs is still refused).

    Raises:
        CheckpointError: not a directory checkpoint, another model config, a damaged megatrain.json,
            missing/corrupted files, or a part that belongs to another checkpoint.
    """
    p = Path(path)
    info = read_info(p)
    check_compatible(p, info, module, strict=strict)
    _verify(p, info)
    try:
        meta = torch.load(p / TRAINER_FILE, weights_only=True)
    except Exception as err:  # truncated or corrupted metadata
        raise CheckpointError(f"Checkpoint {p}: {TRAINER_FILE} cannot be read ({err}).") from err
    keys = ({n: tuple(v) for n, v in info["tensors"].items()} if info["format"] >= 2 else _format1_keys(module))
    params = {id(t) for t in module.parameters()}
    sources: dict[str, SafetensorsSource] = {}
    done: set[int] = set()
    rename = saved_name(info["params"], [n for n, _ in module.named_parameters()])
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            name = rename(name)
            if name not in keys or t is None or id(t) in done:  # not saved (strict=False, declared unsaved): kept
                continue
            done.add(id(t))
            part, key = keys[name]
            if part not in sources:
                sources[part] = open_part(p, part)
            value = sources[part].get(key)
            if id(t) not in params:  # a persistent buffer: in place, wherever it lives
                if tuple(value.shape) != tuple(t.shape):
                    raise CheckpointError(f"Checkpoint {p}: buffer {name} has shape {tuple(value.shape)}, the "
                                          f"module's {tuple(t.shape)}.")
                t.copy_(value)
            else:
                engine.write_param(t, value)  # either tier, one tensor at a time
    meta["state_dict"] = {}
    if info["has_optimizer"]:  # absent otherwise, so Lightning's resume refuses a weights-only checkpoint by name
        meta["optimizer_states"] = [{}]
    return meta


def load_optimizer_dir(path: str | os.PathLike, module: nn.Module, engine: Any, meta: dict[str, Any]) -> None:
    """Load the per-parameter optimizer state and the param-group hyper-parameters. A parameter the checkpoint
    holds no state for has none afterwards (its next update is a first one), whatever steps ran since.

    Raises:
        CheckpointError: a parameter's saved state does not fit the optimizer (another optimizer's state keys, a
            shape that differs).
    """
    p = Path(path)
    opt = engine.optimizer
    if opt is None or not (p / "optimizer").exists():
        return
    source = SafetensorsSource(p / "optimizer")
    rename = saved_name(read_info(p)["params"], [n for n, _ in module.named_parameters()])
    opt.load_param_groups_meta(meta.get("megatrain_param_groups"), module, rename)
    saved = saved_state_keys(source)
    for name, param in module.named_parameters():
        keys = saved.get(rename(name))
        if keys:
            try:
                # tensor subclasses (torchao's 8-bit moments) rebuilt from their inner tensors; ValueError where
                # their package is not installed
                opt.set_param_state(param, unflatten_named({k: source.get(key) for k, key in keys.items()}))
            except ValueError as err:
                raise CheckpointError(f"Checkpoint {p}: optimizer state of {name}: {err}") from None
        else:  # no state saved (no step before the save): none now, as torch.optim.AdamW.load_state_dict leaves it
            opt.forget_param_state(param)


def saved_state_keys(source: SafetensorsSource) -> dict[str, dict[str, str]]:
    """``parameter name -> {state key: safetensors key}`` of an ``optimizer/`` part (keys ``"<name>/<state key>"``)."""
    out: dict[str, dict[str, str]] = {}
    for key in source.keys():
        name, _, k = key.rpartition("/")
        out.setdefault(name, {})[k] = key
    return out
