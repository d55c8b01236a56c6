"""peft models in directory checkpoints: the base model as a Hugging Face directory, the adapters in
peft's own format.

A ``LightningModule`` holding a ``peft.PeftModel`` (e.g. ``get_peft_model(base, LoraConfig(...))``) is
saved as::

    CKPT/base_model/   the base model without the adapter layers (what peft's ``unload()`` gives, with
                       the weights as they are now): AutoModelForCausalLM.from_pretrained loads it
    CKPT/adapter/      adapter_config.json + adapter_model.safetensors written by peft's own
                       ``PeftModel.save_pretrained`` (other adapters than "default" in adapter/<name>/):
                       PeftModel.from_pretrained(base, CKPT/"adapter") loads it

There is deliberately no ``model/``: the base weights alone are not the fine-tuned model, and a
``from_pretrained(CKPT/"model")`` that silently returned the base would be wrong.
``python -m megatrain_lightning.export CKPT OUT --merge-adapter`` writes the merged dense model.
peft is an optional dependency (``pip install megatrain-lightning[peft]``); nothing here imports it
unless the module already holds a peft model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch

BASE_DIR = "base_model"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``False`` when peft was never imported)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def unsavable_adapters(root: torch.nn.Module) -> list[str]:
    """``"name (TYPE)"`` of every peft adapter in ``root`` that directory checkpoints cannot save: prompt learning
    (peft keeps its weights outside the module's state dict) and AdaLoRA (peft's adapter state dict leaves out its
    rank counters and returns resized copies); :func:`~.layout.plan_layout` refuses them at save time."""
    out = []
    for m in root.modules():
        if is_peft_model(m):
            for name, cfg in m.peft_config.items():
                kind = str(getattr(cfg, "peft_type", "?")).split(".")[-1]
                if getattr(cfg, "is_prompt_learning", False) or kind == "ADALORA":
                    out.append(f"{name} ({kind})")
    return out


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module peft's ``unload()`` leaves in place of ``module`` (adapter layers and
    modules_to_save wrappers give back the original layer)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    while True:
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        elif isinstance(module, AuxiliaryTrainingWrapper):
            module = module.original_module
        else:
            return module


def base_model_entries(peft_model: Any) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
    """``(the transformers base model, [(Hugging Face name, tensor)])``: the base model's state
    dict as ``unload()`` would leave it, built from the module's own tensor objects (no copy and no
    change to the model). Adapter weights and modules_to_save copies are not in it."""
    from .hf_names import state_dict_entries

    base = peft_model.get_base_model()
    return base, list(state_dict_entries(base, unwrap=_unwrap))


def adapter_part(adapter_name: str) -> str:
    """The part (folder) peft's ``save_pretrained`` writes adapter ``adapter_name`` to."""
    return ADAPTER_DIR if adapter_name == "default" else f"{ADAPTER_DIR}/{adapter_name}"


def adapter_entries(peft_model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``{part: [(key in adapter_model.safetensors, tensor)]}`` for every adapter, selected by peft's
    own ``get_peft_model_state_dict`` from ``state_dict`` (the module's own tensor objects)."""
    from peft import get_peft_model_state_dict

    return {adapter_part(name): list(get_peft_model_state_dict(peft_model, state_dict=state_dict,
                                                                adapter_name=name).items())
            for name in peft_model.peft_config}


def write_adapters(root: Path, peft_model: Any, entries: dict[str, list[tuple[str, torch.Tensor]]],
                   read: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """Write every adapter with peft's own ``save_pretrained`` into ``root/adapter`` and checksum
    each folder written. ``read`` gives the current value of a module tensor (the store's copy when
    weights live on NVMe). Returns the parts written."""
    from .hf_write import add_checksums

    state_dict = peft_model.state_dict(keep_vars=True)
    chosen = {id(t) for part in entries.values() for _, t in part}
    values = {k: read(v) if id(v) in chosen else v for k, v in state_dict.items()}
    peft_model.save_pretrained(str(root / ADAPTER_DIR), state_dict=values)
    for part in entries:
        d = root / part
        add_checksums(d, sorted(f.name for f in d.iterdir() if f.is_file() and f.name != "checksums.json"))
    return list(entries)


def merged_model(ckpt_dir: Path) -> torch.nn.Module:
    """The dense model of a peft checkpoint: its base model with its "default" adapter merged by peft
    (``PeftModel.from_pretrained(base, CKPT/"adapter").merge_and_unload()``), fp32, in memory.

    Raises:
        ImportError: peft is not installed (``pip install megatrain-lightning[peft]``).
    """
    import transformers

    try:
        from peft import PeftModel
    except ImportError as err:
        raise ImportError(f"{ckpt_dir} holds a peft adapter; merging it needs peft: pip install 'peft>=0.13' "
                          "(or megatrain-lightning[peft]).") from err
    base = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt_dir / BASE_DIR), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(ckpt_dir / ADAPTER_DIR)).merge_and_unload()
