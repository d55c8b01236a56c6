"""Meta-device models bound to their safetensors weights, and the parameter -> checkpoint key map."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from .hf_common import _HUB_ID, INDEX_FILE, _close, _tied_targets, resolve_dtype
from .hf_names import saved_names
from .hf_source import SafetensorsSource


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
    for target, src in _tied_targets(model).items():
        if target not in key_map and src in key_map:
            key_map[target] = key_map[src]
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in key_map]
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
    """Create every ``nn.Parameter`` registered inside the context on the ``meta`` device, buffers on the CPU as
    usual. Each parameter is moved to meta at registration (its uninitialised pages never touched), so the
    initialisers that run after it (``reset_parameters``) cost nothing."""
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

    No weight memory is allocated: parameters are ``meta`` tensors with the checkpoint's shapes, loaded one at a
    time when the strategy builds its store (:func:`weight_sources`); buffers (rotary ``inv_freq``...) are built on
    the CPU by the modules' own ``__init__``. Only ``strategy="megatrain"`` / ``"megatrain_nvme"`` can run such a
    model; any other strategy fails with torch's "Cannot copy out of meta tensor" (use ``from_pretrained`` there).

    Args:
        path_or_id: a local model directory (config.json + model.safetensors or a sharded index), or a Hugging
            Face Hub id (``huggingface_hub.snapshot_download`` of its json, safetensors and tokenizer files).
        trust_remote_code: allow the config/model classes of the repository to run.
        attn_implementation: passed to ``from_config``; ``None``: transformers' default.
        dtype: dtype of the meta parameters (default float32, the master-weight dtype; ``None`` keeps the
            config's dtype).
        **config_overrides: passed to ``AutoConfig.from_pretrained``.

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
    """The checkpoint key holding ``param_name`` (a ``model.state_dict()`` name of ``model``): for a model from
    :func:`meta_model_from_pretrained`, its key in the source (base-model prefix, ties and transformers' one-to-one
    renamings resolved); for any other model, the name :func:`~.hf_names.saved_names` gives it.

    Raises:
        KeyError: ``param_name`` is not a parameter/persistent buffer of ``model`` (nearby names listed).
    """
    keys = getattr(model, "_megatrain_key_map", None)
    what = "a parameter of {} found in its checkpoint" if keys is not None else "a parameter or persistent buffer of {}"
    keys = keys if keys is not None else saved_names(model)
    if param_name not in keys:
        raise KeyError(f"{param_name!r} is not {what.format(type(model).__name__)}; "
                       f"nearby names: {_close(param_name, keys)}")
    return keys[param_name]


class RandomInitSource:
    """A weights source that makes each tensor when asked, deterministically from ``seed`` and the key:
    ``N(0, std)`` for matrices and embeddings (not a model-specific initialisation), ones for 1-D tensors named
    ``*norm*``, zeros for other 1-D tensors."""

    def __init__(self, shapes: dict[str, torch.Size], std: float, seed: int = 0):
        self.shapes, self.std, self.seed = shapes, std, seed

    def has(self, key: str) -> bool:
        return key in self.shapes

    def get(self, key: str) -> torch.Tensor:
        import zlib

        shape = self.shapes[key]
        if len(shape) == 1:
            return torch.ones(shape) if "norm" in key else torch.zeros(shape)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        return torch.empty(shape).normal_(0.0, self.std, generator=g)


def meta_model_from_config(config: Any, *, seed: int = 0, attn_implementation: str | None = None) -> torch.nn.Module:
    """A causal LM of ``config`` on the ``meta`` device whose weights are made one tensor at a time while the
    strategy builds its store (:class:`RandomInitSource`, std = ``config.initializer_range``): how to run a model
    larger than RAM from scratch (``conf/model/llama100b.yaml`` with no weights, benchmarks).

    Returns:
        The model, with ``model._megatrain_source`` and ``model._megatrain_key_map`` set.
    """
    import transformers

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    saved = saved_names(model)
    shapes = {saved[n]: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    model._megatrain_key_map = {n: saved[n] for n, _ in model.named_parameters(remove_duplicate=False)}
    model._megatrain_source = RandomInitSource(shapes, float(getattr(config, "initializer_range", 0.02)), seed)
    return model


def weight_sources(root: torch.nn.Module) -> dict[int, Any]:
    """``id(param) -> loader()`` for the ``meta``-device parameters of every Hugging Face model under ``root``
    that has a source (:func:`meta_model_from_pretrained`, :func:`meta_model_from_config`); each loader returns the
    tensor (the parameter's shape, stored dtype) and is called once by the engine while it builds the host store."""
    from ..blocks import find_hf_models

    out: dict[int, Any] = {}
    for m in find_hf_models(root):
        src = getattr(m, "_megatrain_source", None)
        if src is None:
            continue
        for name, p in m.named_parameters(remove_duplicate=False):
            if p.is_meta and id(p) not in out:
                key = source_key(m, name)
                out[id(p)] = lambda src=src, key=key: src.get(key)
    return out
