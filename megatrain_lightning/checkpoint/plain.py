"""Convert Lightning checkpoint metadata to types ``torch.load(weights_only=True)`` accepts.

Lightning's checkpoint dict may hold numpy arrays and scalars (RNG states, metrics), OmegaConf configs,
``AttributeDict`` hyper-parameters, enums, paths and config objects, none of which load without unpickling
arbitrary classes. Types the weights_only loader restores stay as they are (``OrderedDict``, ``set``,
``torch.dtype``, ``torch.device``, ``torch.Size``, tuples, and dict keys of those types), so a callback's state
comes back as plain Lightning gives it; numpy scalars become Python numbers and OmegaConf containers dicts/lists;
numpy arrays become tensors, enums their values, paths strings, frozensets lists and other dict keys strings, each
with a warning naming where (outside hyper-parameters). Anything else raises, except inside hyper-parameters
(informational on resume): there an object with ``to_dict()`` becomes that dict, any other ``{"__repr__": repr(obj)}``.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from pathlib import PurePath
from typing import Any

import torch

log = logging.getLogger(__name__)
_LENIENT = ("hyper_parameters", "datamodule_hyper_parameters")


def _changed(where: str, obj: Any, lenient: bool, into: str) -> None:
    """Warn that the value at ``where`` is stored as another type (not inside hyper-parameters)."""
    if not lenient:
        log.warning("megatrain: checkpoint metadata at %s is a %s, stored as %s (it is read back so on resume: "
                    "torch.load(weights_only=True) cannot restore that type)", where, type(obj).__name__, into)


class MetadataError(TypeError):
    """A value in the checkpoint metadata cannot be stored without pickle."""


def _key(key: Any, where: str, lenient: bool) -> Any:
    """A dict key converted as :func:`to_plain` converts a value when the result can still be a key; else its
    ``str``, with a warning."""
    try:
        plain = to_plain(key, f"{where} key {key!r}", lenient)
        hash(plain)
        return plain
    except (MetadataError, TypeError):
        _changed(f"{where} key {key!r}", key, lenient, "a str")
        return str(key)


def to_plain(obj: Any, where: str = "checkpoint", lenient: bool = False) -> Any:
    """Return ``obj`` with every value converted to a weights_only-loadable type.

    Raises:
        MetadataError: an unsupported object outside hyper-parameters (``where`` names its path).
    """
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device, torch.Size)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, PurePath):
        _changed(where, obj, lenient, "a str")
        return str(obj)
    if isinstance(obj, enum.Enum):
        _changed(where, obj, lenient, "its value")
        return to_plain(obj.value, where, True)
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            _changed(where, obj, lenient, "a torch.Tensor" if obj.dtype != object else "a list")
            return torch.from_numpy(obj.copy()) if obj.dtype != object else [to_plain(x, where, lenient) for x in obj]
        if isinstance(obj, np.generic):
            return obj.item()
    except ImportError:  # pragma: no cover
        pass
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return to_plain(OmegaConf.to_container(obj, resolve=True), where, lenient)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        items = [(_key(k, where, lenient), to_plain(v, f"{where}.{k}", lenient or k in _LENIENT)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, tuple):
        return tuple(to_plain(x, f"{where}[{i}]", lenient) for i, x in enumerate(obj))
    if isinstance(obj, set):
        return {to_plain(x, f"{where}[{i}]", lenient) for i, x in enumerate(obj)}
    if isinstance(obj, frozenset):
        _changed(where, obj, lenient, "a list")
    if isinstance(obj, (list, frozenset)):
        return [to_plain(x, f"{where}[{i}]", lenient) for i, x in enumerate(obj)]
    if lenient:
        if hasattr(obj, "to_dict"):
            return to_plain(obj.to_dict(), where, lenient)
        log.warning("megatrain: storing %s (%s) in the checkpoint as its repr", where, type(obj).__name__)
        return {"__repr__": repr(obj)}
    raise MetadataError(
        f"Checkpoint metadata at {where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which cannot be "
        "stored without pickle. Convert it to plain types (dict/list/str/number/tensor) in the state_dict of the "
        "callback or module that returns it."
    )
