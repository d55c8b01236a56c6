"""A directory checkpoint as one Lightning ``.ckpt`` file, for ``LightningModule.load_from_checkpoint``
and for resuming under another strategy (like DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict``).

Lightning opens a checkpoint path as a file, so :func:`convert_to_lightning_checkpoint` (``python -m
megatrain_lightning.export CKPT --lightning-ckpt OUT.ckpt``) writes what Lightning's own
``trainer.save_checkpoint`` would have: ``state_dict`` under the LightningModule's keys (tied names included),
``optimizer_states`` in the training optimizer's ``state_dict()`` format, and the rest of ``trainer.pt``.
Everything is held in memory while writing: 4 bytes/parameter for the weights, 8 more for the AdamW state
(another optimizer: the size of its state).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..optim.state_packing import unflatten_named
from .atomic import check_name_length, fsync_path, temporary_path
from .directory import saved_state_keys, verified_info
from .errors import CheckpointError
from .hf_source import SafetensorsSource
from .layout import open_part
from .metadata import TRAINER_FILE


def _state_dict(root: Path, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    sources: dict[str, SafetensorsSource] = {}
    read: dict[tuple[str, str], torch.Tensor] = {}
    out = {}
    for name, (part, key) in info["tensors"].items():
        if (part, key) not in read:  # a tied duplicate gets the same tensor, as in the module
            if part not in sources:
                sources[part] = open_part(root, part)
            read[(part, key)] = sources[part].get(key)
        out[name] = read[(part, key)]
    return out


def _optimizer_state(root: Path, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``state_dict()`` (torch's format) of the saved optimizer state: parameters numbered in param-group order."""
    src = SafetensorsSource(root / "optimizer")
    saved = saved_state_keys(src)
    state: dict[int, dict[str, torch.Tensor]] = {}
    param_groups = []
    index = 0
    for g in groups:
        ids = []
        for name in g["param_names"]:
            keys = saved.get(name)
            if keys:
                state[index] = unflatten_named({k: src.get(key) for k, key in keys.items()})
            ids.append(index)
            index += 1
        param_groups.append({**{k: v for k, v in g.items() if k != "param_names"}, "params": ids})
    return {"state": state, "param_groups": param_groups}


def convert_to_lightning_checkpoint(ckpt_dir: str | os.PathLike, out_path: str | os.PathLike, *,
                                    optimizer: bool = True) -> dict[str, Any]:
    """Write the directory checkpoint ``ckpt_dir`` as a single-file Lightning checkpoint ``out_path`` (fp32 CPU
    tensors, loadable with ``torch.load(weights_only=True)``; another strategy resumes from it).

    Args:
        ckpt_dir: a checkpoint directory written by ``strategy="megatrain"`` (format 2).
        out_path: the file to write (replaced atomically if it exists).
        optimizer: include the AdamW state as ``optimizer_states``; without it Lightning refuses to resume
            training from the file.

    Returns:
        ``{"tensors": number of state_dict keys, "bytes": bytes of distinct weight tensors,
        "optimizer": whether optimizer_states was written, "out_path": str}``.

    Raises:
        CheckpointError: not a checkpoint directory, damaged, assembled from several checkpoints, or format 1
            (no key map: resume it with strategy="megatrain" and save it again).
        IsADirectoryError: ``out_path`` is a directory.
        OSError: ``ENAMETOOLONG`` (:func:`~.atomic.check_name_length`), before anything is read or written.
    """
    root, out = Path(ckpt_dir), Path(out_path)
    check_name_length(out, what="Lightning checkpoint file", shorter="choose a shorter output path")
    info = verified_info(root)
    if info["format"] < 2:
        raise CheckpointError(f"Checkpoint {root} (format 1) does not record the LightningModule's state_dict keys: "
                              "resume from it with strategy='megatrain', save it again, and convert that checkpoint.")
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a directory: pass the path of the .ckpt file to write.")
    meta = torch.load(root / TRAINER_FILE, weights_only=True)
    groups = meta.pop("megatrain_param_groups", None)
    meta["state_dict"] = _state_dict(root, info)
    ours = meta.get("MegaTrainPrecision")
    if isinstance(ours, dict) and "scale" in ours and "MixedPrecision" not in meta:
        # 16-mixed: the loss scale also in torch.amp.GradScaler.state_dict() format, for Lightning's MixedPrecision
        # plugin under another strategy (missing fields: GradScaler's defaults)
        meta["MixedPrecision"] = {"scale": float(ours["scale"]), "growth_factor": float(ours.get("growth_factor", 2.0)),
                                  "backoff_factor": float(ours.get("backoff_factor", 0.5)),
                                  "growth_interval": int(ours.get("growth_interval", 2000)),
                                  "_growth_tracker": int(ours["growth_tracker"])}
    with_opt = optimizer and info["has_optimizer"] and groups is not None
    if with_opt:
        meta["optimizer_states"] = [_optimizer_state(root, groups)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out)
    try:
        torch.save(meta, tmp)
        fsync_path(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    distinct = {t.data_ptr(): t for t in meta["state_dict"].values()}
    return {"tensors": len(meta["state_dict"]), "bytes": sum(t.numel() * t.element_size() for t in distinct.values()),
            "optimizer": with_opt, "out_path": str(out)}
