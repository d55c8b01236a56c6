"""The ``config.json`` written next to dense safetensors weights: it must describe what was written.

transformers' GGUF loader dequantises every weight to dense fp32 but leaves ``quantization_config = {"quant_method":
"gguf"}`` on the model's config; written next to dense safetensors, it makes ``from_pretrained`` return a model
flagged as quantized, which transformers refuses to ``save_pretrained`` or fine-tune. So the config written with
plain tensors carries no quantization config.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch

DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def quant_method(q: Any) -> str | None:
    """The ``quant_method`` of a quantization config (object or dict), as a plain string; ``None`` if absent."""
    if q is None:
        return None
    m = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return None if m is None else str(getattr(m, "value", m))


def saved_config(model: torch.nn.Module, dtype: torch.dtype | None) -> Any:
    """A copy of ``model.config`` describing the dense weights written: ``architectures`` = the model class,
    ``dtype`` = the written dtype, no ``quantization_config``.

    Args:
        model: a transformers model.
        dtype: dtype floating weights are written in (``None``: the model's own).

    Raises:
        ValueError: the model is really quantized (a parameter or persistent buffer is not a plain
            fp16/bf16/fp32/fp64 tensor, e.g. bitsandbytes or packed GGUF weights).
    """
    from .hf_names import state_dict_entries

    config = copy.deepcopy(model.config)
    method = quant_method(getattr(config, "quantization_config", None))
    if method is not None:
        packed = [n for n, t in state_dict_entries(model)
                  if not (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in DENSE_DTYPES)]
        if packed:
            raise ValueError(
                f"{type(model).__name__} is quantized ({method}) and holds packed tensors ({packed[:3]}): this writer "
                "stores plain dense tensors only. Dequantize it first (model.dequantize()) or save it with "
                "transformers' save_pretrained.")
        del config.quantization_config  # the weights written are dense: nothing is quantized any more
    out_dtype = dtype or getattr(model, "dtype", None)
    if isinstance(out_dtype, torch.dtype):
        config.dtype = str(out_dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    return config


def dense_config_dict(cfg: dict[str, Any], dtypes: Iterable[torch.dtype]) -> dict[str, Any]:
    """``config.json`` contents for an export whose tensors have ``dtypes``: the quantization config
    is dropped when it is GGUF's (safetensors never hold GGUF blocks: transformers dequantised them)
    or when every tensor is a dense float, and kept otherwise (e.g. GPTQ's int32 ``qweight``)."""
    method = quant_method(cfg.get("quantization_config"))
    if method is not None and (method == "gguf" or all(d in DENSE_DTYPES for d in dtypes)):
        cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return cfg
