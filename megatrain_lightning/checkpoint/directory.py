"""Directory checkpoints: weights and AdamW state as safetensors, trainer metadata without pickle.

Layout of a checkpoint directory (DESIGN.md section 6)::

    CKPT/
      model/            a Hugging Face model directory (config.json, sharded safetensors, index,
                        checksums.json) that AutoModelForCausalLM.from_pretrained loads; for a
                        LightningModule without exactly one HF model: its named parameters
      optimizer/        exp_avg / exp_avg_sq / step of every parameter with AdamW state,
                        safetensors keyed "<parameter name>/<state>", checksums.json
      trainer.pt        everything else Lightning saves (loops, callbacks, LR schedulers,
                        precision plugin state, hyper-parameters), converted to plain types and
                        tensors: loadable with torch.load(weights_only=True)
      megatrain.json    format version, parameter names/shapes/dtypes, param-group layout

Writes go to a hidden temporary directory next to the target, every file is fsynced, and
the directory is renamed into place (an existing checkpoint of the same name is moved aside
first and removed after): a crash at any moment leaves either the old or the new checkpoint
complete under the final name, never a half-written one. Tensors are written one shard at a
time from views of the host store, so saving never needs a second copy of the model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from .hf_io import SafetensorsSource, save_hf_model_dir, source_key, verify_checksums, write_safetensors_shards
from .hf_names import saved_names as _saved_names, state_dict_entries as _state_dict_entries
from .plain import to_plain

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be used: missing, corrupted, or written for another model."""


def is_directory_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "megatrain.json").is_file()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _hf_model_of(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The (prefix, model) of the single Hugging Face model holding every parameter of ``module``."""
    from ..engine.blocks import find_hf_models

    models = find_hf_models(module)
    if len(models) != 1:
        return None
    hf = models[0]
    prefix = next(n for n, m in module.named_modules() if m is hf)
    if sum(1 for _ in module.parameters()) != sum(1 for _ in hf.parameters()):
        return None
    return prefix, hf


def _param_keys(module: nn.Module) -> dict[str, str]:
    """LightningModule parameter name -> key in ``model/`` (HF naming when the model is HF)."""
    found = _hf_model_of(module)
    names = [n for n, _ in module.named_parameters()]
    if found is None:
        return {n: n for n in names}
    prefix, hf = found
    cut = len(prefix) + 1 if prefix else 0
    return {n: source_key(hf, n[cut:]) for n in names}


class _OneSlabWindow:
    """NVMe tier: while a checkpoint reads parameters and AdamW states (in slab order), keep only
    the current slab's regions in the host window, so a save needs one slab plus one shard of
    memory instead of a full window."""

    def __init__(self, engine: Any):
        self.nvme = engine.store.nvme if engine is not None else None
        self.engine, self.last = engine, None
        if self.nvme is not None:
            self.nvme.drop_clean()  # what training left cached goes first

    def touch(self, p: torch.Tensor) -> None:
        if self.nvme is None:
            return
        si = self.engine._param_where(p)[0]
        if self.last is not None and self.last != si:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                self.nvme.discard(self.last, kind)
        self.last = si


def _optimizer_items(engine: Any, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    opt = engine.optimizer
    window = _OneSlabWindow(engine)
    for name, p in module.named_parameters():
        window.touch(p)
        st = opt.param_state(p) if opt is not None else None
        if st is None:
            continue
        for k in ("exp_avg", "exp_avg_sq", "step"):
            yield f"{name}/{k}", st[k].reshape(()) if k == "step" else st[k]


def save_checkpoint_dir(path: str | os.PathLike, checkpoint: dict[str, Any], module: nn.Module, engine: Any,
                        tokenizer: Any = None, max_shard_bytes: int = 2 * 2**30) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a directory checkpoint at ``path``.

    Args:
        path: the final directory (Lightning's ``filepath``, e.g. ``epoch=0-step=10.ckpt``).
        checkpoint: Lightning's checkpoint dict; its ``state_dict`` and ``optimizer_states`` entries
            are ignored (tensors are read from the host store instead).
        module: the LightningModule (its parameters are views of the store, flushed).
        engine: the streaming engine (for the AdamW state).
        max_shard_bytes: shard size of the safetensors files (bytes).

    Raises:
        CheckpointError: the metadata cannot be made loadable without pickle.
        OSError: the disk is full or not writable (the previous checkpoint is untouched).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        found = _hf_model_of(module)
        on_disk = engine is not None and engine.store.nvme is not None
        if on_disk:  # tensors are copies read through the host window: keep shards small
            max_shard_bytes = max(2**26, min(max_shard_bytes, engine.budget.limit // 8))
        if found is not None:
            named = None
            if on_disk and engine.store.masters_on_disk:
                hf = found[1]
                saved = _saved_names(hf)
                window = _OneSlabWindow(engine)

                def read(t: torch.Tensor) -> torch.Tensor:
                    window.touch(t)
                    return engine.read_param(t)
                named = ((n, read(t) if isinstance(t, torch.nn.Parameter) else t)
                         for n, t in _state_dict_entries(hf) if saved[n] == n)
            save_hf_model_dir(tmp / "model", found[1], tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                              named_tensors=named)
        else:
            items = ((n, engine.read_param(p) if engine is not None else p.detach()) for n, p in module.named_parameters())
            write_safetensors_shards(tmp / "model", items, max_shard_bytes=max_shard_bytes)
        has_opt = "optimizer_states" in checkpoint and engine.optimizer is not None
        if has_opt:
            write_safetensors_shards(tmp / "optimizer", _optimizer_items(engine, module),
                                     max_shard_bytes=max_shard_bytes)
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if has_opt:
            meta["megatrain_param_groups"] = engine.optimizer.param_groups_meta(module)
        meta = to_plain(meta, where="checkpoint")
        torch.save(meta, tmp / "trainer.pt")
        _fsync_file(tmp / "trainer.pt")
        torch.load(tmp / "trainer.pt", weights_only=True)  # refuse to write what cannot be loaded safely
        info = {
            "format": FORMAT_VERSION,
            "has_optimizer": has_opt,
            "params": {n: {"shape": list(p.shape), "requires_grad": p.requires_grad}
                       for n, p in module.named_parameters()},
        }
        (tmp / "megatrain.json").write_text(json.dumps(info))
        _fsync_file(tmp / "megatrain.json")
        _fsync_dir(tmp)
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_info(path: Path) -> dict[str, Any]:
    if path.is_file():
        raise CheckpointError(
            f"{path} is a single file, not a checkpoint directory written by strategy='megatrain'. "
            "Checkpoints of this strategy are directories (model/, optimizer/, trainer.pt). To start from the "
            "weights of a plain Lightning .ckpt, load its 'state_dict' into your module before fitting."
        )
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint directory {path} does not exist.")
    if not (path / "megatrain.json").is_file():
        raise CheckpointError(f"{path} has no megatrain.json: not a complete checkpoint of strategy='megatrain'.")
    info = json.loads((path / "megatrain.json").read_text())
    if info.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {info.get('format')} is not {FORMAT_VERSION}.")
    return info


def check_compatible(path: Path, info: dict[str, Any], module: nn.Module) -> None:
    """Raise ``CheckpointError`` naming the differences if the checkpoint was written for another model."""
    saved = info["params"]
    current = {n: list(p.shape) for n, p in module.named_parameters()}
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    shapes = sorted(n for n in set(current) & set(saved) if saved[n]["shape"] != current[n])
    if missing or extra or shapes:
        detail = "; ".join(
            s for s in (
                f"missing in checkpoint: {missing[:5]}" if missing else "",
                f"not in the model: {extra[:5]}" if extra else "",
                f"shape differs: {[(n, saved[n]['shape'], current[n]) for n in shapes[:5]]}" if shapes else "",
            ) if s
        )
        raise CheckpointError(f"Checkpoint {path} was written for another model config ({detail}).")


def load_checkpoint_dir(path: str | os.PathLike, module: nn.Module, engine: Any = None) -> dict[str, Any]:
    """Verify a checkpoint directory, copy its weights into the module's (store) parameters one
    tensor at a time, and return Lightning's metadata dict (without tensors of the model).

    Raises:
        CheckpointError: not a directory checkpoint, another model config, missing/corrupted files.
    """
    p = Path(path)
    info = _read_info(p)
    check_compatible(p, info, module)
    for sub in ("model", "optimizer") if info["has_optimizer"] else ("model",):
        try:
            verify_checksums(p / sub)
        except (ValueError, FileNotFoundError) as err:
            raise CheckpointError(f"Checkpoint {p} is damaged: {err}") from err
    try:
        meta = torch.load(p / "trainer.pt", weights_only=True)
    except Exception as err:  # truncated or corrupted metadata
        raise CheckpointError(f"Checkpoint {p}: trainer.pt cannot be read ({err}).") from err
    source = SafetensorsSource(p / "model")
    keys = _param_keys(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if engine is not None:
                engine.write_param(param, source.get(keys[name]))  # either tier, one tensor at a time
            else:
                param.copy_(source.get(keys[name]))
    meta["state_dict"] = {}
    meta["optimizer_states"] = [{}] if info["has_optimizer"] else []
    return meta


def load_optimizer_dir(path: str | os.PathLike, module: nn.Module, engine: Any, meta: dict[str, Any]) -> None:
    """Load AdamW state (exp_avg, exp_avg_sq, step per parameter; param-group hyper-parameters)."""
    p = Path(path)
    opt = engine.optimizer
    if opt is None or not (p / "optimizer").exists():
        return
    source = SafetensorsSource(p / "optimizer")
    opt.load_param_groups_meta(meta.get("megatrain_param_groups"), module)
    for name, param in module.named_parameters():
        if source.has(f"{name}/exp_avg"):
            opt.load_param_state(param, source.get(f"{name}/exp_avg"), source.get(f"{name}/exp_avg_sq"),
                                 source.get(f"{name}/step"))

