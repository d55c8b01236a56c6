"""Checkpoints of the recipe: periodic ones (``checkpoint.every_n_steps``) and where ``resume`` finds one.

Periodic checkpoints are Lightning's ``ModelCheckpoint`` writing the strategy's directory checkpoints (weights,
AdamW state, loops, data position) as ``<output_dir>/checkpoints/last.ckpt`` every ``every_n_steps`` optimizer
steps and at the end of training (only the newest is kept: one checkpoint's disk space, 16 B/param). How
``resume`` picks one: :func:`resolve_resume`.

Every checkpoint the recipe writes records :func:`run_identity` (the ``model`` group and the ``data`` settings that
decide which examples and in which order; not steps, learning rate or batch size, which a resumed run may change)
under the key ``"recipe"`` of Lightning's checkpoint dict (``trainer.pt``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

from .checks import ConfigError

CHECKPOINT_MARK = "megatrain.json"  # every directory checkpoint has it
IDENTITY_DATA_KEYS = ("_target_", "domain", "source", "shape", "source_options", "seq_len", "val_fraction", "seed",
                      "max_documents", "use_chat_template")
LAST_NAME = re.compile(r"last(-v\d+)?\.ckpt")  # ModelCheckpoint's CHECKPOINT_NAME_LAST, with its version counter
log = logging.getLogger(__name__)


def _absolute(value: Any) -> Any:
    """A string naming an existing local path, as an absolute resolved path (one file, one spelling); anything
    else unchanged."""
    if isinstance(value, str) and value:
        p = Path(value).expanduser()
        if p.exists():
            return str(p.resolve())
    return value


def run_identity(cfg: Any) -> dict[str, Any]:
    """What makes two recipe runs the same training: ``{"model": the model group, "data": its
    :data:`IDENTITY_DATA_KEYS`}`` as plain (JSON-able) values, local paths (``data.source``, ``model.weights``,
    ``model.tokenizer``) made absolute."""
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    data = plain.get("data") or {}
    model = {k: _absolute(v) if k in ("weights", "tokenizer") else v for k, v in (plain.get("model") or {}).items()}
    ident = {k: _absolute(data[k]) if k == "source" else data[k] for k in IDENTITY_DATA_KEYS if k in data}
    return {"model": model, "data": ident}


class RecordRunIdentity(pl.Callback):
    """Writes :func:`run_identity` into every checkpoint Lightning saves (key ``"recipe"``)."""

    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = identity

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["recipe"] = self.identity


def saved_identity(ckpt: Path) -> dict[str, Any] | None:
    """The :func:`run_identity` a checkpoint directory records, or ``None`` (none recorded, or ``trainer.pt``
    unreadable: the checkpoint's own load reports that)."""
    try:
        return torch.load(ckpt / "trainer.pt", weights_only=True, map_location="cpu").get("recipe")
    except Exception:  # noqa: BLE001 - damaged files are reported by the checkpoint load, with the file named
        return None


def identity_differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """``"data.source: A there, B here"`` for every identity setting that differs (model group compared key by key)."""
    out = []
    for group in ("model", "data"):
        a, b = saved.get(group) or {}, mine.get(group) or {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"{group}.{k}: {a.get(k)!r} there, {b.get(k)!r} here")
    return out


def checkpoint_callback(cfg: Any) -> Any:
    """A ``ModelCheckpoint`` saving ``last.ckpt`` every ``checkpoint.every_n_steps`` steps, or ``None`` when unset
    (the value was checked at preflight: :func:`~.checks.check_values`)."""
    n = cfg.checkpoint.get("every_n_steps")
    if n is None:
        return None
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=Path(cfg.output_dir) / "checkpoints", every_n_train_steps=n, save_top_k=0,
                           save_last=True)


def _is_checkpoint(p: Path) -> bool:
    return p.is_dir() and (p / CHECKPOINT_MARK).is_file()


def resolve_resume(cfg: Any) -> Path | None:
    """The checkpoint directory ``resume`` names: ``None`` (a fresh run), ``"last"`` (the newest ``last.ckpt`` or
    ``last-vN.ckpt`` below ``checkpoint.search_dir``, by modification time, among those of the same model and data
    (:func:`run_identity`; one recording no identity counts as the same); without a search dir, below the parent
    of ``output_dir``), or a path (used as given; a warning lists what differs from this run).

    Raises:
        ConfigError: (key ``resume``) no such checkpoint, a checkpoint of the weights only (no AdamW state: the
            recipe's final ``checkpoint/`` by default), or ``resume=last`` and every ``last.ckpt`` found is of
            another model or data (the newest one and its differences are named).
    """
    r = cfg.get("resume")
    if r in (None, "", False):
        return None
    mine = run_identity(cfg)
    if str(r) == "last":
        root = Path(str(cfg.checkpoint.get("search_dir") or Path(cfg.output_dir).parent))
        # ModelCheckpoint writes last-vN.ckpt when the directory already holds a last.ckpt of another run
        found = [p for p in root.glob("**/last*.ckpt") if LAST_NAME.fullmatch(p.name) and _is_checkpoint(p)] \
            if root.is_dir() else []
        if not found:
            raise ConfigError("resume", f"resume=last found no last.ckpt checkpoint below {root} (checkpoint.search_dir); "
                                        "train with checkpoint.every_n_steps=N first, or give resume=/path/to/checkpoint.")
        found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for p in found:
            saved = saved_identity(p)
            if saved is None or not identity_differences(saved, mine):
                return p
        diff = identity_differences(saved_identity(found[0]) or {}, mine)
        raise ConfigError("resume", f"resume=last found {len(found)} last.ckpt below {root}, none from a run of this "
                                    f"model on this data; the newest, {found[0]}, differs in {'; '.join(diff)}. Give "
                                    "resume=/path/to/checkpoint to continue from one of them anyway (e.g. to go on "
                                    "training on new data), or start a fresh run (no resume).")
    p = Path(str(r)).expanduser()
    if not p.exists():
        raise ConfigError("resume", f"{p} does not exist; give a checkpoint directory written by "
                                    "checkpoint.every_n_steps (…/checkpoints/last.ckpt) or resume=last.")
    if not _is_checkpoint(p):
        raise ConfigError("resume", f"{p} is not a checkpoint directory (no {CHECKPOINT_MARK}); give one written by "
                                    "checkpoint.every_n_steps (…/checkpoints/last.ckpt) or resume=last.")
    try:  # has_optimizer is false for trainer.save_checkpoint(weights_only=True)
        resumable = json.loads((p / CHECKPOINT_MARK).read_text()).get("has_optimizer", True) is not False
    except (OSError, ValueError, AttributeError):  # the checkpoint's own load reports it, naming the file
        resumable = True
    if not resumable:
        raise ConfigError("resume", f"{p} holds the model weights only, no AdamW state or training state (step "
                                    "count, schedule, data position): it cannot be resumed (the recipe's final "
                                    "checkpoint/ is written so with checkpoint.save_optimizer=false, the default). "
                                    "Resume from the run's checkpoints/last.ckpt (written with checkpoint."
                                    "every_n_steps=N), or save the final checkpoint with checkpoint.save_optimizer="
                                    f"true; to start a new run from these weights, give model.weights={p / 'model'} "
                                    "model.gguf=null and no resume.")
    saved = saved_identity(p)
    diff = identity_differences(saved, mine) if saved is not None else []
    if diff:
        log.warning("resume=%s is from a run with other settings (%s): its weights, AdamW state, step count and "
                    "data position are continued with this run's data.", p, "; ".join(diff))
    return p
