"""Hugging Face model directories, one tensor at a time (public names; the code lives in
``hf_source`` (reading), ``hf_meta`` (meta-device models, key map), ``hf_write`` (writing,
checksums), ``hf_names`` (which names are written), ``hf_config`` (the config written with dense
weights) and ``hf_common``).

Reading: :class:`SafetensorsSource` opens a ``model.safetensors`` file or a sharded
``model.safetensors.index.json`` and returns single tensors on request (headers are read
once; data is read only by :meth:`SafetensorsSource.get`). :func:`meta_model_from_pretrained`
builds a model on the ``meta`` device (no weight memory) and attaches such a source, and
:func:`source_key` maps each parameter name to its key in the source (base-model prefix,
tied weights and transformers' one-to-one renamings resolved).

Writing: :func:`write_safetensors_shards` streams ``(name, tensor)`` pairs into shards named
like transformers names them, holding at most one shard of converted tensors at a time; every
file is fsynced and listed with its sha256 in ``checksums.json``, which
:func:`verify_checksums` checks. :func:`save_hf_model_dir` writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Nothing here unpickles: weights are safetensors only (``.bin``/``.pt`` files are refused with a
message), and remote code runs only with ``trust_remote_code=True``.
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
