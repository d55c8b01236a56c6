"""What a directory checkpoint writes where, and under which key every tensor of the module is found.

The plan is made from the module before anything is written: with one Hugging Face model, ``model/`` holds its
tensors under its own names (a ``peft.PeftModel``: ``base_model/`` + ``adapter/``, :mod:`.peft_io`) and the
LightningModule's other state_dict tensors (e.g. ``nn.CrossEntropyLoss(weight=w)``'s buffer) go to ``extra/``
under their LightningModule names, so ``model/`` stays loadable by ``from_pretrained``; otherwise ``model/`` holds
the module's state_dict tensors under their own names.

Every ``module.state_dict()`` key is mapped, by tensor identity, to the ``(part, key)`` it is written under (tied
duplicates map to the written source). A key that maps to nothing would be silently lost, so planning raises
instead; after writing, :func:`verify_written` checks that every mapped key is in the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .hf_names import saved_names, state_dict_entries, undeclared_sharing, warn_undeclared_sharing
from .hf_source import SafetensorsSource
from .peft_io import ADAPTER_WEIGHTS, BASE_DIR, adapter_entries, base_model_entries, is_peft_model


@dataclass
class Part:
    """One folder of the checkpoint: ``kind`` is ``"hf"`` (a Hugging Face model directory of
    ``hf_model``), ``"plain"`` (safetensors keyed by name) or ``"adapter"`` (peft's format)."""

    name: str
    kind: str
    entries: list[tuple[str, torch.Tensor]]  # (key in the part, the module's own tensor object)
    hf_model: nn.Module | None = None


@dataclass
class Layout:
    parts: list[Part]
    tensors: dict[str, tuple[str, str]]  # LightningModule state_dict key -> (part, key)
    peft_model: Any = None


EXTRA_DIR = "extra"  # the LightningModule's state_dict tensors outside its Hugging Face model


def hf_model_of(module: nn.Module, whole: bool = True) -> tuple[str, nn.Module] | None:
    """``(prefix, model)`` of the Hugging Face (or peft) model of ``module``: the single one, or of several the single
    one with trainable parameters (a policy beside a frozen reference copy, as ``DPOModule(reference="copy")``);
    ``None`` if there is none or no such one, or (``whole``: the format-1 layout) if a state_dict tensor lies outside
    it."""
    from ..blocks import find_hf_models

    models = find_hf_models(module)
    if len(models) > 1:
        models = [m for m in models if any(p.requires_grad for p in m.parameters())]
    if len(models) != 1:
        return None
    hf = models[0]
    prefix = next(n for n, m in module.named_modules() if m is hf)
    inside = {id(t) for _, t in state_dict_entries(hf)}
    if whole and any(id(t) not in inside for t in module.state_dict(keep_vars=True).values()):
        return None
    return prefix, hf


def _hf_written(model: nn.Module, entries: list[tuple[str, torch.Tensor]]) -> tuple[list, set[int]]:
    """(entries written to a HF directory of ``model``, ids of tensors the model declares not saved)."""
    saved = saved_names(model, entries)
    warn_undeclared_sharing(undeclared_sharing(model, entries), type(model).__name__)
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return ([(n, t) for n, t in entries if saved[n] == n and n not in ignore],
            {id(t) for n, t in entries if n in ignore})


def plan_layout(module: nn.Module) -> Layout:
    """The parts of a checkpoint of ``module`` and the (part, key) of every state_dict key.

    Raises:
        CheckpointError: a state_dict tensor would not be written by any part (e.g. a peft prompt-learning
            adapter: :func:`~.peft_io.unsavable_adapters`).
    """
    found = hf_model_of(module, whole=False)
    peft_model, ignored = None, set()
    if found is None:
        parts = [Part("model", "plain", _outside(module, set()))]
    elif is_peft_model(found[1]):
        peft_model = found[1]
        base, entries = base_model_entries(peft_model)
        written, ignored = _hf_written(base, entries)
        parts = [Part(BASE_DIR, "hf", written, base)]
        parts += [Part(name, "adapter", e) for name, e in
                  adapter_entries(peft_model, peft_model.state_dict(keep_vars=True)).items()]
    else:
        hf = found[1]
        written, ignored = _hf_written(hf, list(state_dict_entries(hf)))
        parts = [Part("model", "hf", written, hf)]
    if found is not None:
        inside = {id(t) for _, t in state_dict_entries(found[1])}
        extra = _outside(module, inside)
        if extra:
            parts.append(Part(EXTRA_DIR, "plain", extra))

    owners: dict[int, list[tuple[str, str]]] = {}
    for part in parts:
        for key, t in part.entries:
            owners.setdefault(id(t), []).append((part.name, key))
    tensors: dict[str, tuple[str, str]] = {}
    lost = []
    for key, t in module.state_dict(keep_vars=True).items():
        cands = owners.get(id(t))
        if cands:
            tensors[key] = next((c for c in cands if key == c[1] or key.endswith("." + c[1])), cands[0])
        elif id(t) not in ignored:  # not declared unsaved by the model (_keys_to_ignore_on_save)
            lost.append(key)
    if lost:
        raise CheckpointError(
            f"Cannot save a checkpoint of {type(module).__name__}: {len(lost)} tensor(s) of its state_dict would be "
            f"written by no part of the checkpoint, so they could not be loaded back: {lost[:5]}. "
            + (f"peft's adapter state dict ({_peft_types(peft_model)}) does not hold them as the module's own "
               "tensors (prompt-learning adapters keep their weights elsewhere; AdaLoRA leaves out its rank counters "
               "and returns resized copies), so directory checkpoints do not support this adapter; LoRA, DoRA, IA3, "
               "LoHa, LoKr and VeRA are supported. " if peft_model is not None else "")
            + "Nothing was written.")
    return Layout(parts, tensors, peft_model)


def _outside(module: nn.Module, inside: set[int]) -> list[tuple[str, torch.Tensor]]:
    """The state_dict entries of ``module`` whose tensor is not in ``inside`` (ids), each tensor once."""
    seen = set(inside)
    entries = []
    for k, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            entries.append((k, t))
    return entries


def _peft_types(peft_model: Any) -> str:
    """The adapters' peft types, e.g. ``"ADALORA"`` (from ``peft_model.peft_config``)."""
    cfgs = getattr(peft_model, "peft_config", {}) or {}
    return ", ".join(sorted({str(getattr(c, "peft_type", "?")).split(".")[-1] for c in cfgs.values()})) or "?"


def open_part(root: Path, part: str) -> SafetensorsSource:
    """The tensors of ``part`` of the checkpoint at ``root`` (a HF/plain folder or a peft adapter folder).

    Raises:
        FileNotFoundError, CheckpointFormatError: as :class:`SafetensorsSource`.
    """
    d = root / part
    return SafetensorsSource(d / ADAPTER_WEIGHTS if (d / ADAPTER_WEIGHTS).is_file() else d)


def verify_written(root: Path, tensors: dict[str, tuple[str, str]]) -> None:
    """Check that every mapped key is in the files written under ``root``.

    Raises:
        CheckpointError: keys missing from a part (names them); the checkpoint must not be used.
    """
    by_part: dict[str, list[tuple[str, str]]] = {}
    for name, (part, key) in tensors.items():
        by_part.setdefault(part, []).append((name, key))
    for part, names in by_part.items():
        src = open_part(root, part)
        missing = [(n, k) for n, k in names if not src.has(k)]
        if missing:
            raise CheckpointError(f"The checkpoint written to {root} lacks {len(missing)} tensor(s) in {part}/ "
                                  f"(module name, key): {missing[:5]}; it was not kept.")
