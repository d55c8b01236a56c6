"""peft models in directory checkpoints: the base model as a Hugging Face directory, the adapters in
peft's own format.

A ``LightningModule`` holding a ``peft.PeftModel`` is saved as ``CKPT/base_model/`` (the base model as peft's
``unload()`` would leave it, loadable by ``from_pretrained``) and ``CKPT/adapter/`` (written by peft's own
``PeftModel.save_pretrained``; adapters other than "default" in ``adapter/<name>/``). There is deliberately no
``model/``: a ``from_pretrained(CKPT/"model")`` silently returning the base alone would be wrong;
``python -m megatrain_lightning.export CKPT OUT --merge-adapter`` writes the merged dense model. peft is optional
(``pip install megatrain-lightning[peft]``); nothing here imports it unless the module already holds a peft model.
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
    """``"name (TYPE)"`` of every peft adapter in ``root`` that :func:`~.layout.plan_layout` refuses at save time:
    prompt learning (weights outside the module's state dict) and AdaLoRA (its adapter state dict leaves out the
    rank counters and returns resized copies)."""
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
    """``(the transformers base model, [(Hugging Face name, tensor)])``: its state dict as ``unload()`` would leave
    it, from the module's own tensor objects (no copy, no change to the model), without adapter weights or
    modules_to_save copies."""
    from .hf_names import state_dict_entries

    base = peft_model.get_base_model()
    return base, list(state_dict_entries(base, unwrap=_unwrap))


def adapter_entries(peft_model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``{part: [(key in adapter_model.safetensors, tensor)]}`` for every adapter, selected by peft's
    own ``get_peft_model_state_dict`` from ``state_dict`` (the module's own tensor objects)."""
    from peft import get_peft_model_state_dict

    # each under the part (folder) peft's save_pretrained writes it to
    return {(ADAPTER_DIR if name == "default" else f"{ADAPTER_DIR}/{name}"):
            list(get_peft_model_state_dict(peft_model, state_dict=state_dict, adapter_name=name).items())
            for name in peft_model.peft_config}


def write_adapters(root: Path, peft_model: Any, entries: dict[str, list[tuple[str, torch.Tensor]]],
                   read: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """Write every adapter with peft's own ``save_pretrained`` into ``root/adapter`` and checksum each folder
    written. ``read`` gives a module tensor's current value (the store's copy on the NVMe tier). Returns the parts."""
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
