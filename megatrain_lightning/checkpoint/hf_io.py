"""Hugging Face model directories, one tensor at a time.

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

from __future__ import annotations

import contextlib

import copy
import difflib
import hashlib
import json
import os
import re
import struct
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKSUMS_FILE = "checksums.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HASH_CHUNK = 8 * 2**20

_ST_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "U16": "uint16", "U32": "uint32", "U64": "uint64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    }.items()
    if hasattr(torch, attr)
}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


class CheckpointFormatError(ValueError):
    """A safetensors file or index is truncated, corrupted or inconsistent."""


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``None``/a floating ``torch.dtype``/one of ``fp32 bf16 fp16 float32 bfloat16 float16`` -> dtype.

    Raises:
        ValueError: an unknown name or a non-floating dtype.
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating-point dtype; use one of fp32, bf16, fp16.")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of fp32, bf16, fp16 (or float32, bfloat16, float16).")
    return _DTYPE_NAMES[key]


def _close(word: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    cands = list(candidates)
    near = difflib.get_close_matches(word, cands, n=n, cutoff=0.5)
    return near or cands[:n]


# ----------------------------------------------------------------------------- reading


class SafetensorsSource:
    """Read single tensors from a safetensors checkpoint without loading the whole file.

    Args:
        path: a directory holding ``model.safetensors.index.json`` (+ the shards it names) or
            ``model.safetensors``, or the path of one ``.safetensors`` file.

    Every shard's header is validated once here (so truncation is reported before any
    tensor is read); tensor data is read only by :meth:`get`.

    Raises:
        FileNotFoundError: ``path`` does not exist, a directory has neither file, or the index
            names a shard that is missing.
        CheckpointFormatError: a shard is truncated or corrupted, the index is not valid JSON,
            or a key listed in the index is not in its shard.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"Checkpoint path {p} does not exist: expected a directory holding {SINGLE_FILE} "
                f"or {INDEX_FILE} (+ its shards), or a single .safetensors file."
            )
        self._key_file: dict[str, Path] = {}
        self._file_keys: dict[Path, list[str]] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        if p.is_file():
            if p.suffix != ".safetensors":
                raise CheckpointFormatError(
                    f"{p} is not a .safetensors file. Pass a safetensors file or a Hugging Face model directory"
                    + (" (pickle checkpoints such as .bin/.pt are not loaded: convert them with "
                       "transformers' save_pretrained(safe_serialization=True))." if p.suffix in _PICKLE_SUFFIXES else ".")
                )
            self.root = p.parent
            self._files = [p]
        elif (p / INDEX_FILE).is_file():
            self.root = p
            self._files = self._read_index(p / INDEX_FILE)
        elif (p / SINGLE_FILE).is_file():
            self.root = p
            self._files = [p / SINGLE_FILE]
        else:
            present = sorted(x.name for x in p.iterdir())
            hint = ""
            if any(n.endswith(_PICKLE_SUFFIXES) for n in present):
                hint = (" It holds pickle weights (.bin/.pt), which are not loaded: re-save the model with "
                        "transformers' save_pretrained(safe_serialization=True).")
            raise FileNotFoundError(
                f"No safetensors weights in {p}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards "
                f"(found: {present[:10]}).{hint}"
            )
        for f in self._files:
            self._read_header(f)
        if not self._key_file:  # single file: the header is the key list
            for f in self._files:
                for k in self._file_keys[f]:
                    self._key_file[k] = f

    # -- construction helpers
    def _read_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointFormatError(f"{index} is not a valid safetensors index ({err}).") from err
        files: dict[str, Path] = {}
        for key, shard in weight_map.items():
            if Path(shard).name != shard:
                raise CheckpointFormatError(f"{index} names shard {shard!r}, which is not a plain file name.")
            f = files.setdefault(shard, index.parent / shard)
            self._key_file[key] = f
        for shard, f in files.items():
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {shard}, which is missing from {index.parent}.")
        return list(files.values())

    def _read_header(self, f: Path) -> None:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                keys = list(h.keys())
                for k in keys:
                    s = h.get_slice(k)
                    self._meta.setdefault(k, (tuple(s.get_shape()), s.get_dtype()))
        except (SafetensorError, OSError) as err:
            raise CheckpointFormatError(f"Safetensors file {f} is truncated or corrupted: {err}") from err
        self._file_keys[f] = keys
        mine = set(keys)
        wrong = [k for k, ff in self._key_file.items() if ff == f and k not in mine]
        if wrong:
            raise CheckpointFormatError(f"The index says {wrong[:5]} are in {f}, but that file does not hold them.")

    def _file(self, key: str) -> Path:
        try:
            return self._key_file[key]
        except KeyError:
            raise KeyError(
                f"{key!r} is not in the checkpoint at {self.root} ({len(self._key_file)} tensors); "
                f"nearby keys: {_close(key, self._key_file)}"
            ) from None

    # -- public API
    @property
    def files(self) -> list[Path]:
        """The safetensors files of this checkpoint."""
        return list(self._files)

    def keys(self) -> list[str]:
        """All tensor names (index order for a sharded checkpoint, file order otherwise)."""
        return list(self._key_file)

    def has(self, key: str) -> bool:
        """Whether ``key`` names a tensor of this checkpoint."""
        return key in self._key_file

    __contains__ = has

    def __len__(self) -> int:
        return len(self._key_file)

    def file_of(self, key: str) -> Path:
        """The file holding ``key``. Raises KeyError (with nearby keys) if absent."""
        return self._file(key)

    def shape(self, key: str) -> torch.Size:
        """Shape of ``key`` from the header (no data read). Raises KeyError if absent."""
        self._file(key)
        return torch.Size(self._meta[key][0])

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of ``key`` from the header (no data read). Raises KeyError if absent."""
        self._file(key)
        name = self._meta[key][1]
        if name not in _ST_DTYPES:
            raise CheckpointFormatError(f"{key!r} has dtype {name}, which this torch build cannot represent.")
        return _ST_DTYPES[name]

    def nbytes(self, key: str) -> int:
        """Size of ``key``'s data in bytes (from the header)."""
        return self.shape(key).numel() * self.dtype(key).itemsize

    def get(self, key: str) -> torch.Tensor:
        """Load one tensor: CPU, stored dtype and shape; only this tensor's bytes are read.

        Raises:
            KeyError: ``key`` is not in the checkpoint (the message lists nearby keys).
            CheckpointFormatError: the file holding it cannot be read (names the file).
        """
        f = self._file(key)
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                return h.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointFormatError(f"Cannot read {key!r} from {f} (truncated or corrupted?): {err}") from err

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` for every key, loading one tensor at a time."""
        for k in self.keys():
            yield k, self.get(k)

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.root)!r}, {len(self)} tensors in {len(self._files)} file(s))"


# ----------------------------------------------------------------------------- meta model


def _tied_targets(model: torch.nn.Module) -> dict[str, str]:
    """``{tied parameter name: name it is tied to}`` as transformers declares it for ``model``."""
    ties = getattr(model, "all_tied_weights_keys", None)
    if ties is None and hasattr(model, "get_expanded_tied_weights_keys"):
        ties = model.get_expanded_tied_weights_keys(all_submodels=True)
    return dict(ties or {})


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ValueError(
            f"{p} is a file; pass a model directory holding config.json and model.safetensors "
            f"(or {INDEX_FILE} + shards), e.g. one written by save_pretrained."
        )
    s = str(path_or_id)
    if isinstance(path_or_id, os.PathLike) or not _HUB_ID.match(s):
        raise FileNotFoundError(f"Model directory {p} does not exist.")
    try:
        import huggingface_hub

        return Path(huggingface_hub.snapshot_download(
            s, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as err:  # no network, unknown repo, auth: all end here
        raise OSError(
            f"{s!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(err).__name__}: {err}). If the hub is unreachable from this machine, download the model "
            "elsewhere and pass its local directory (config.json + *.safetensors)."
        ) from err


def _conversion_rules(model: torch.nn.Module) -> tuple[list, list, Any]:
    """transformers' (renamings, converters, rename_fn) for ``model``; empty when unavailable."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # older/newer transformers without this API: prefix handling only
        return [], [], None
    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)], rename_source_key)


def _model_key(source_key_: str, meta_sd: dict, prefix: str, rules) -> tuple[str, bool]:
    """(model state_dict name, produced by a many-to-one converter?) for one checkpoint key."""
    renamings, converters, rename = rules
    if rename is not None:
        new, pattern = rename(source_key_, renamings, converters, prefix or None, meta_sd)
        if new not in meta_sd and source_key_ in meta_sd:
            new, pattern = source_key_, None
        return new, pattern is not None
    if source_key_ in meta_sd or not prefix:
        return source_key_, False
    if source_key_.startswith(prefix + ".") and source_key_[len(prefix) + 1:] in meta_sd:
        return source_key_[len(prefix) + 1:], False
    return f"{prefix}.{source_key_}", False


def _build_key_map(model: torch.nn.Module, source: SafetensorsSource) -> dict[str, str]:
    """``{model state_dict name: source key}``; raises ValueError naming what cannot be resolved."""
    meta_sd = {n: True for n in model.state_dict(keep_vars=True)}
    prefix = getattr(model, "base_model_prefix", "") or ""
    rules = _conversion_rules(model)
    try:
        from transformers.core_model_loading import dot_natural_key
        order = sorted(source.keys(), key=dot_natural_key)
    except ImportError:
        order = source.keys()
    key_map: dict[str, str] = {}
    converted: dict[str, list[str]] = {}
    for k in order:
        name, is_converted = _model_key(k, meta_sd, prefix, rules)
        if is_converted:
            converted.setdefault(name, []).append(k)
        elif name in meta_sd:
            key_map.setdefault(name, k)
    ties = _tied_targets(model)
    for target, src in ties.items():
        if target not in key_map and src in key_map:
            key_map[target] = key_map[src]
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    missing = [n for n in params if n not in key_map]
    if missing:
        fused = [n for n in missing if n in converted]
        msg = (f"The checkpoint at {source.root} does not hold {len(missing)} parameter(s) of "
               f"{type(model).__name__}: {missing[:8]}")
        if fused:
            msg += (f". {len(fused)} of them (e.g. {fused[0]} <- {converted[fused[0]][:2]}...) are built by transformers "
                    "from several checkpoint tensors (a weight conversion), which one-tensor-at-a-time streaming "
                    "does not do: load the model once with from_pretrained and re-save it with save_hf_model_dir "
                    "(which writes the fused names).")
        else:
            msg += (f"; checkpoint keys near the first one: {_close(missing[0], source.keys())}. "
                    "Is the config (num_hidden_layers, tie_word_embeddings, model_type) the one of this checkpoint?")
        raise ValueError(msg)
    bad = [(n, tuple(source.shape(key_map[n])), tuple(p.shape))
           for n, p in model.named_parameters(remove_duplicate=False) if source.shape(key_map[n]) != p.shape]
    if bad:
        raise ValueError(f"Checkpoint {source.root} has other shapes than the config of {type(model).__name__} "
                         f"(name, checkpoint, model): {bad[:5]}")
    return key_map


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` registered inside the context on the ``meta`` device, buffers on
    the CPU as usual. Each parameter is allocated (uninitialised, so untouched pages) and moved to
    meta at registration, so the initialisers that run after it (``reset_parameters``) cost nothing."""
    orig = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        orig(module, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(param)
            module._parameters[name] = cls(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = orig  # type: ignore[method-assign]


def meta_model_from_pretrained(path_or_id: str | os.PathLike, *, trust_remote_code: bool = False,
                               attn_implementation: str | None = None,
                               dtype: torch.dtype | str | None = torch.float32,
                               **config_overrides: Any) -> torch.nn.Module:
    """Build a causal LM on the ``meta`` device with its safetensors checkpoint attached.

    No weight memory is allocated: parameters are ``meta`` tensors with the checkpoint's shapes
    (the store builder loads each one with ``model._megatrain_source.get(source_key(model, name))``);
    buffers (rotary ``inv_freq``, embedding scales) are built on the CPU by the modules' own
    ``__init__``, as small as they are.

    Args:
        path_or_id: a local model directory (config.json + model.safetensors or a sharded index),
            or a Hugging Face Hub id (fetched with ``huggingface_hub.snapshot_download``, json,
            safetensors and tokenizer files only).
        trust_remote_code: allow the config/model classes of the repository to run (off by default).
        attn_implementation: passed to ``from_config`` (``"eager"``, ``"sdpa"``, ...); ``None``: transformers' default.
        dtype: dtype of the meta parameters (default float32, the master-weight dtype; ``None``
            keeps the config's dtype).
        **config_overrides: set on the config (``AutoConfig.from_pretrained(..., **config_overrides)``).

    Returns:
        The model, with ``model._megatrain_source`` (a :class:`SafetensorsSource`) and
        ``model._megatrain_key_map`` (parameter/buffer name -> source key).

    Raises:
        FileNotFoundError: a local path that does not exist, or a directory without safetensors weights.
        OSError: a hub id that cannot be fetched (e.g. the hub is unreachable: pass a local directory).
        ValueError: parameters of the model are absent from the checkpoint or have other shapes
            (the message lists them), or ``path_or_id`` is a file.
        CheckpointFormatError: a shard is truncated/corrupted.
    """
    import transformers

    root = _resolve_model_dir(path_or_id)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json: not a Hugging Face model directory.")
    source = SafetensorsSource(root)
    config = transformers.AutoConfig.from_pretrained(str(root), trust_remote_code=trust_remote_code,
                                                     **config_overrides)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    dt = resolve_dtype(dtype)
    if dt is not None:
        kwargs["dtype"] = dt
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    model._megatrain_key_map = _build_key_map(model, source)
    model._megatrain_source = source
    return model


def source_key(model: torch.nn.Module, param_name: str) -> str:
    """The checkpoint key holding ``param_name`` (a ``model.state_dict()`` name of ``model``).

    For a model from :func:`meta_model_from_pretrained`: the resolved key in its source
    (prefix, tie and renaming resolved). For any other model: the key
    :func:`save_hf_model_dir` writes it under (the name itself, or for a tied duplicate such
    as ``lm_head.weight`` the name of the weight it is tied to).

    Raises:
        KeyError: ``param_name`` is not a parameter/persistent buffer of ``model`` (nearby names listed).
    """
    key_map = getattr(model, "_megatrain_key_map", None)
    if key_map is not None:
        if param_name in key_map:
            return key_map[param_name]
        raise KeyError(f"{param_name!r} is not a parameter of {type(model).__name__} found in its checkpoint; "
                       f"nearby names: {_close(param_name, key_map)}")
    saved = _saved_names(model)
    if param_name not in saved:
        raise KeyError(f"{param_name!r} is not a parameter or persistent buffer of {type(model).__name__}; "
                       f"nearby names: {_close(param_name, saved)}")
    return saved[param_name]


# ----------------------------------------------------------------------------- writing


def _state_dict_entries(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) ``model.state_dict()`` would hold, in its order, without building it."""
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        pre = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                yield pre + n, p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                yield pre + n, b


def _saved_names(model: torch.nn.Module) -> dict[str, str]:
    """``{state_dict name: name it is saved under}``: tied duplicates map to the kept name.

    Like ``save_pretrained``: of names sharing one tensor object, those declared as tied
    targets are dropped; if none (or all) are, the first in state_dict order is kept.
    """
    groups: dict[int, list[str]] = {}
    for name, t in _state_dict_entries(model):
        groups.setdefault(id(t), []).append(name)
    ties = _tied_targets(model)
    out: dict[str, str] = {}
    for names in groups.values():
        keep = [n for n in names if n not in ties] or names
        for n in names:
            out[n] = n if n == keep[0] else keep[0]
    return out


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems/platforms refuse fsync on directories
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def add_checksums(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, str]:
    """Hash (sha256) and fsync the files ``names`` of ``directory`` and merge them into its
    ``checksums.json`` (written atomically, then the directory is fsynced). Returns the full mapping.

    Raises:
        FileNotFoundError: one of the files does not exist.
    """
    d = Path(directory)
    path = d / CHECKSUMS_FILE
    sums = json.loads(path.read_text()) if path.is_file() else {}
    for n in names:
        _fsync_path(d / n)
        sums[n] = _sha256(d / n)
    _write_json(path, dict(sorted(sums.items())))
    _fsync_path(d)
    return sums


def _existing_weights(d: Path) -> list[str]:
    if not d.is_dir():
        return []
    return sorted(x.name for x in d.iterdir() if x.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(x.name))


def _prepare(t: torch.Tensor, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor.")
    if t.device.type == "meta":
        raise ValueError(f"{name!r} is on the meta device (never materialised): there is no data to write.")
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(device="cpu", dtype=dtype).contiguous()
    return t.to("cpu").contiguous()


def _out_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    item = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
    return t.numel() * item


def write_safetensors_shards(out_dir: str | os.PathLike, items: Iterable[tuple[str, torch.Tensor]], *,
                             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                             dtype: torch.dtype | str | None = None,
                             metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream ``(name, tensor)`` pairs into safetensors shards, transformers-style.

    Tensors are grouped in order until the next one would push the shard past
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own); each shard is
    converted (to CPU, to ``dtype`` for floating tensors, made contiguous) only when written,
    so at most one shard of converted tensors exists at a time. Tensors may be views sharing
    one storage as long as they do not overlap. Shards are written under temporary names and
    renamed to ``model-00001-of-0000N.safetensors`` at the end, with
    ``model.safetensors.index.json``; a single shard is written as ``model.safetensors`` with
    no index. Every file is fsynced, then the directory; ``checksums.json`` gets each file's sha256.

    Args:
        out_dir: created if missing; must not already hold weight files.
        items: ``(name, tensor)`` pairs, any dtype/device (meta excluded), names unique.
        max_shard_bytes: shard size limit in bytes (of the converted tensors).
        dtype: floating tensors are cast to it (a torch dtype or ``"fp32"``/``"bf16"``/``"fp16"``);
            integer/bool tensors keep theirs. ``None``: keep every dtype.
        metadata: string key/values stored in every shard header (``format: pt`` is always added).

    Returns:
        The index dict ``{"metadata": {"total_size": bytes, "total_parameters": n},
        "weight_map": {name: file}}`` (also for a single file, where it is not written).

    Raises:
        FileExistsError: ``out_dir`` already holds model.safetensors / shards / an index.
        ValueError: a duplicate name, a meta tensor, ``max_shard_bytes`` <= 0, an unknown dtype.
        TypeError: an item is not a tensor.
        OSError: the disk is full or not writable (temporary shards are removed).
    """
    d = Path(out_dir)
    dt = resolve_dtype(dtype)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}.")
    if clash := _existing_weights(d):
        raise FileExistsError(f"{d} already holds weight files {clash[:5]}: write into a new or empty directory.")
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    tag = uuid.uuid4().hex[:8]
    written: list[Path] = []  # temporary shard paths, in order
    shard_names: list[list[str]] = []
    sums: dict[str, str] = {}
    seen: set[str] = set()
    total_size = total_params = 0

    def flush(pending: list[tuple[str, torch.Tensor]]) -> None:
        tmp = d / f".tmp-{tag}-{len(written) + 1:05d}.safetensors"
        written.append(tmp)
        shard = {n: _prepare(t, n, dt) for n, t in pending}
        save_file(shard, str(tmp), metadata=meta)
        del shard
        _fsync_path(tmp)
        sums[tmp.name] = _sha256(tmp)
        shard_names.append([n for n, _ in pending])

    try:
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        for name, t in items:
            if name in seen:
                raise ValueError(f"Tensor name {name!r} appears twice; names must be unique.")
            seen.add(name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor.")
            if t.device.type == "meta":
                raise ValueError(f"{name!r} is on the meta device (never materialised): there is no data to write.")
            size = _out_bytes(t, dt)
            if pending and pending_bytes + size > max_shard_bytes:
                flush(pending)
                pending, pending_bytes = [], 0
            pending.append((name, t))
            pending_bytes += size
            total_size += size
            total_params += t.numel()
        if pending or not written:
            flush(pending)
        del pending

        n = len(written)
        finals = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for tmp, final in zip(written, finals):
            os.replace(tmp, d / final)
        final_sums = {final: sums[tmp.name] for tmp, final in zip(written, finals)}
        written = []
        index = {
            "metadata": {"total_size": total_size, "total_parameters": total_params},
            "weight_map": {name: final for final, names in zip(finals, shard_names) for name in names},
        }
        if n > 1:
            _write_json(d / INDEX_FILE, index)
            final_sums[INDEX_FILE] = _sha256(d / INDEX_FILE)
        path = d / CHECKSUMS_FILE
        old = json.loads(path.read_text()) if path.is_file() else {}
        _write_json(path, dict(sorted({**old, **final_sums}.items())))
        _fsync_path(d)
        return index
    finally:
        for tmp in written:  # only on error: remove the partial shards
            tmp.unlink(missing_ok=True)


def _safetensors_expected_size(path: Path) -> tuple[int | None, str | None]:
    """(size the header implies, problem) for a safetensors file; problem is set when unreadable."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, f"truncated ({size} bytes, shorter than a safetensors header)"
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            return None, "corrupted (header length is implausible)"
        raw = f.read(n)
    if len(raw) < n:
        return None, f"truncated ({size} bytes; its header alone needs {8 + n})"
    try:
        header = json.loads(raw)
        end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
    except (ValueError, KeyError, TypeError, IndexError):
        return None, "corrupted (its header is not valid safetensors JSON)"
    return 8 + n + end, None


def verify_checksums(directory: str | os.PathLike) -> dict[str, str]:
    """Check every file listed in ``directory/checksums.json`` against its sha256.

    Returns:
        The verified ``{file name: sha256 hex}`` mapping.

    Raises:
        FileNotFoundError: ``directory`` or its ``checksums.json`` does not exist.
        ValueError: one or more listed files are missing, truncated (size differs from what the
            safetensors header implies) or corrupted (hash differs); the message names each file.
    """
    d = Path(directory)
    path = d / CHECKSUMS_FILE
    if not d.is_dir():
        raise FileNotFoundError(f"Directory {d} does not exist.")
    if not path.is_file():
        raise FileNotFoundError(f"{d} has no {CHECKSUMS_FILE}: it was not written completely by megatrain "
                                "(or is not a megatrain checkpoint), so its files cannot be verified.")
    try:
        sums = json.loads(path.read_text())
        assert isinstance(sums, dict)
    except (ValueError, AssertionError) as err:
        raise ValueError(f"{path} is corrupted (not a JSON object of file -> sha256).") from err
    problems = []
    for name, digest in sums.items():
        f = d / name
        if Path(name).name != name:
            problems.append(f"{name}: not a plain file name")
        elif not f.is_file():
            problems.append(f"{name}: missing")
        else:
            expected, problem = (_safetensors_expected_size(f) if name.endswith(".safetensors") else (None, None))
            actual = f.stat().st_size
            if problem is None and expected is not None and actual != expected:
                problem = (f"truncated ({actual} bytes, header says {expected})" if actual < expected
                           else f"corrupted ({actual} bytes, header says {expected})")
            if problem is None and _sha256(f) != digest:
                problem = "corrupted (sha256 differs)"
            if problem:
                problems.append(f"{name}: {problem}")
    if problems:
        raise ValueError(f"Checksum verification failed in {d}: " + "; ".join(problems))
    return sums


def save_hf_model_dir(out_dir: str | os.PathLike, model: torch.nn.Module, *, dtype: torch.dtype | str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: Any = None,
                      named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Write a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    Writes the weights through :func:`write_safetensors_shards` under ``model.state_dict()``
    names, one parameter/persistent buffer at a time (no state_dict is built), skipping tied
    duplicates like ``save_pretrained`` (of names sharing one tensor, the declared tie targets,
    e.g. ``lm_head.weight``); then ``config.json`` (with ``dtype`` and ``architectures`` set, as
    ``save_pretrained`` does, on a copy: the model's config is not modified),
    ``generation_config.json`` when the model can generate, the tokenizer when given, and
    adds all these files to ``checksums.json``.

    Names are the model's own: for models whose checkpoints transformers converts on load
    (e.g. Mixtral's per-expert weights fused into ``experts.gate_up_proj``) the fused names are
    written; transformers >= 5 loads them as they are.

    Args:
        out_dir: created if missing; must not already hold weight files.
        model: a transformers ``PreTrainedModel`` with materialised (non-meta) weights, unless
            ``named_tensors`` is given.
        dtype: cast floating tensors to it (``None``: keep).
        max_shard_bytes: shard size limit in bytes.
        tokenizer: anything with ``save_pretrained(dir)``.
        named_tensors: write these ``(state_dict name, tensor)`` pairs instead of the model's
            own tensors (the caller then skips tied duplicates itself).

    Returns:
        The index dict of :func:`write_safetensors_shards`.

    Raises:
        FileExistsError: ``out_dir`` already holds weights.
        ValueError: a parameter is on the meta device, or an unknown dtype.
    """
    d = Path(out_dir)
    dt = resolve_dtype(dtype)
    if clash := _existing_weights(d):
        raise FileExistsError(f"{d} already holds weight files {clash[:5]}: write into a new or empty directory.")
    d.mkdir(parents=True, exist_ok=True)
    before = {x.name for x in d.iterdir()}
    if named_tensors is None:
        saved = _saved_names(model)
        named_tensors = ((n, t) for n, t in _state_dict_entries(model) if saved[n] == n)
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    if ignore:  # exact names, as save_pretrained treats them
        named_tensors = ((n, t) for n, t in named_tensors if n not in ignore)
    index = write_safetensors_shards(d, named_tensors, max_shard_bytes=max_shard_bytes, dtype=dt)

    config = copy.deepcopy(model.config)
    out_dtype = dt or getattr(model, "dtype", None)
    if isinstance(out_dtype, torch.dtype):
        config.dtype = str(out_dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(d))
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if gen is not None and can_generate():
        gen.save_pretrained(str(d))
    if getattr(model, "is_remote_code", lambda: False)():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, str(d), config=config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(d))
    weights = set(index["weight_map"].values()) | {INDEX_FILE, CHECKSUMS_FILE}
    new = sorted(x.name for x in d.iterdir() if x.is_file() and x.name not in before and x.name not in weights)
    add_checksums(d, new)
    return index


__all__ = [
    "CheckpointFormatError",
    "SafetensorsSource",
    "add_checksums",
    "meta_model_from_pretrained",
    "resolve_dtype",
    "save_hf_model_dir",
    "source_key",
    "verify_checksums",
    "write_safetensors_shards",
]
