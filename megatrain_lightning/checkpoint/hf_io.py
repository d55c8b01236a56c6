"""Hugging Face model directories, one tensor at a time: the public names of ``hf_source`` (reading:
:class:`SafetensorsSource`), ``hf_meta`` (meta-device models and their key map: :func:`meta_model_from_pretrained`,
:func:`source_key`), ``hf_write`` (writing and checksums: :func:`write_safetensors_shards`,
:func:`save_hf_model_dir`, :func:`verify_checksums`), ``hf_names`` (which names are written), ``hf_config`` (the
config written with dense weights) and ``hf_common``.

Nothing here unpickles: weights are safetensors only (``.bin``/``.pt`` files are refused with a message), and
remote code runs only with ``trust_remote_code=True``.
"""

from .hf_common import (  # noqa: F401
    CHECKSUMS_FILE, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, CheckpointFormatError, resolve_dtype,
)
from .hf_meta import meta_model_from_config, meta_model_from_pretrained, params_on_meta, source_key, weight_sources  # noqa: F401
from .hf_source import SafetensorsSource  # noqa: F401
from .hf_write import add_checksums, file_sha256, save_hf_model_dir, verify_checksums, write_safetensors_shards  # noqa: F401

__all__ = [
    "weight_sources",
    "CheckpointFormatError",
    "SafetensorsSource",
    "add_checksums",
    "file_sha256",
    "meta_model_from_pretrained",
    "params_on_meta",
    "resolve_dtype",
    "save_hf_model_dir",
    "source_key",
    "verify_checksums",
    "write_safetensors_shards",
]
