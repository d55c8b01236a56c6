"""Checkpoints of the recipe: periodic ones (``checkpoint.every_n_steps``) and where ``resume`` finds one.

Periodic checkpoints are Lightning's ``ModelCheckpoint`` writing the strategy's directory checkpoints (weights,
AdamW state, loops, data position) into ``<output_dir>/checkpoints/``: ``last.ckpt`` every ``every_n_steps``
optimizer steps and at the end of training (only the newest is kept: one checkpoint's disk space, 16 B/param).
``resume=last`` continues from the newest ``last.ckpt`` below ``checkpoint.search_dir`` (default: ``outputs/``
of the working directory), ``resume=/path/to/checkpoint`` from that one; the step count, optimizer state, LR schedule and
data position continue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checks import ConfigError

CHECKPOINT_MARK = "megatrain.json"  # every directory checkpoint has it


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
    """The checkpoint directory ``resume`` names: ``None`` (a fresh run), ``"last"`` (the newest ``last.ckpt``
    below ``checkpoint.search_dir``, by modification time; without one, below the parent of ``output_dir``), or a path.

    Raises:
        ConfigError: (key ``resume``) no such checkpoint.
    """
    r = cfg.get("resume")
    if r in (None, "", False):
        return None
    if str(r) == "last":
        root = Path(str(cfg.checkpoint.get("search_dir") or Path(cfg.output_dir).parent))
        found = [p for p in root.glob("**/last.ckpt") if _is_checkpoint(p)] if root.is_dir() else []
        if not found:
            raise ConfigError("resume", f"resume=last found no last.ckpt checkpoint below {root} (checkpoint.search_dir); "
                                        "train with checkpoint.every_n_steps=N first, or give resume=/path/to/checkpoint.")
        return max(found, key=lambda p: p.stat().st_mtime)
    p = Path(str(r)).expanduser()
    if not _is_checkpoint(p):
        raise ConfigError("resume", f"{p} is not a checkpoint directory (no {CHECKPOINT_MARK}); give one written by "
                                    "checkpoint.every_n_steps (…/checkpoints/last.ckpt) or resume=last.")
    return p
