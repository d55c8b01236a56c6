"""Build a ``torch.optim`` optimizer of any class over a model's trainable parameters, in the param groups the
recipes use (``recipes_lib/module.py`` ``CausalLMModule``, ``preference/module.py`` ``DPOModule``).

* Any class: ``cls(groups, lr=lr, **options)``, with ``betas`` added when the constructor takes it. With
  ``split_1d`` two groups: ``weight_decay`` on the parameters with ``ndim >= 2``, 0 on the 1-D ones (norms,
  biases); else one group with ``weight_decay``.
* :class:`~.muon.MuonWithAdamW`: the 2-D weights but the input and output embeddings in a ``use_muon=True`` group,
  the embeddings in a ``use_muon=False`` group (``adamw_weight_decay``), the 1-D parameters in a ``use_muon=False``
  group (0 weight decay with ``split_1d``); empty groups are left out.
* ``torch.optim.Muon`` itself is refused (2-D parameters only, and one optimizer per strategy): use
  ``MuonWithAdamW``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

import torch


def locate(target: str | type) -> type:
    """The class named by ``target`` (``"torch.optim.AdamW"``), or ``target`` itself.

    Raises:
        ImportError: the module or class does not exist (the message names ``target``).
    """
    if not isinstance(target, str):
        return target
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ImportError(f"optimizer {target!r} cannot be imported ({e})") from None


def accepted(fn: Callable) -> tuple[set[str], bool]:
    """``(keyword names, takes **kwargs)`` of a callable (a class: its ``__init__``)."""
    sig = inspect.signature(fn)
    names = {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names - {"self"}, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def takes(cls: type, name: str) -> bool:
    """Whether ``cls``'s constructor takes keyword ``name`` (or any keyword)."""
    names, var_kw = accepted(cls.__init__)
    return name in names or var_kw


def build_optimizer(model: torch.nn.Module, target: str | type = "torch.optim.AdamW", *, lr: float,
                    weight_decay: float = 0.0, betas: tuple[float, float] | None = None, split_1d: bool = True,
                    options: Mapping[str, Any] | None = None) -> torch.optim.Optimizer:
    """``target`` over ``model``'s trainable parameters (module docstring for the groups).

    Args:
        model: the module whose ``requires_grad`` parameters are optimized.
        target: the optimizer class or its dotted name.
        lr: learning rate (every group's; a scheduler scales each).
        weight_decay: the decayed group's weight decay.
        betas: passed when the constructor takes ``betas`` (``None``: the class's default).
        split_1d: 1-D parameters in their own group with ``weight_decay=0``.
        options: the class's other keyword arguments (``momentum``, ``eps``...; a list becomes a tuple).

    Raises:
        ImportError: see :func:`locate`.
        ValueError: ``torch.optim.Muon`` (use ``MuonWithAdamW``); the class's own checks of its arguments.
    """
    from .muon import MuonWithAdamW

    cls = locate(target)
    if cls is getattr(torch.optim, "Muon", None):
        raise ValueError("torch.optim.Muon updates 2-D weights only, and megatrain steps one optimizer (a second "
                         "one for the embeddings, the LM head and the norms is refused): use "
                         "megatrain_lightning.optim.muon.MuonWithAdamW (the recipes' optim=muon), Muon for the "
                         "decoder's 2-D weights and AdamW for the rest as one optimizer.")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in (options or {}).items()}  # YAML lists: torch's tuples
    if betas is not None and takes(cls, "betas"):
        kwargs["betas"] = tuple(betas)
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(cls, type) and issubclass(cls, MuonWithAdamW):
        skip = {id(m.weight) for m in (_embedding(model, "get_input_embeddings"), _embedding(model, "get_output_embeddings"))
                if m is not None and getattr(m, "weight", None) is not None}
        hidden = [p for p in params if p.ndim == 2 and id(p) not in skip]
        ids = {id(p) for p in hidden}
        other = [p for p in params if p.ndim >= 2 and id(p) not in ids]
        flat = [p for p in params if p.ndim < 2]
        groups = [{"params": hidden, "use_muon": True, "weight_decay": weight_decay},
                  {"params": other, "use_muon": False}, {"params": flat, "use_muon": False,
                                                        **({"weight_decay": 0.0} if split_1d else {})}]
        return cls([g for g in groups if g["params"]], lr=lr, **kwargs)
    if split_1d:
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return cls(groups, lr=lr, **kwargs)
    return cls(params, lr=lr, weight_decay=weight_decay, **kwargs)


def _embedding(model: torch.nn.Module, getter: str) -> Any:
    fn = getattr(model, getter, None)
    try:
        return fn() if callable(fn) else None
    except (NotImplementedError, AttributeError):
        return None
