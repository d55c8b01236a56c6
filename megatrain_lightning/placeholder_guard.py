"""After a run whose fp32 weights stay in the NVMe store (larger than ``host_memory_limit``), the module's
parameters are placeholders (4 bytes expanded to each shape, reading NaN). A forward of the module then
(``model.generate(...)`` after ``fit``) would silently return garbage; :func:`guard` makes it raise instead.

Every module that owns parameters gets a forward pre-hook that checks its own parameters at each call (so a
parameter given real values since, ``param.data = t``, passes); the strategy's next setup removes the hooks
(:func:`unguard`). ``copy.deepcopy`` and ``torch.save`` of such a module raise too.

The module also keeps alive the strategy whose store holds its weights (:func:`holder_of`): a new Trainer assigned
to the old one's variable would otherwise let the old strategy be collected and its store's files (the only copy
of the trained weights) be deleted; the new strategy's setup takes the weights over instead. The reference is a
cycle (module -> strategy -> module), collected with the module; copies and pickles of the module carry none.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator

from torch import nn

from .store.host import is_nvme_placeholder

_HOOKS: "weakref.WeakKeyDictionary[nn.Module, list[Any]]" = weakref.WeakKeyDictionary()
_HOLDER = "_megatrain_weights_holder"  # attribute of the root module: a _Holder


class _Holder:
    """The strategy holding a module's weights; ``copy.deepcopy`` and pickling turn it into ``None``."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())


def holder_of(root: nn.Module) -> Any:
    """The strategy whose NVMe store holds ``root``'s weights (given to :func:`guard`), or ``None``."""
    h = root.__dict__.get(_HOLDER)
    return h.strategy if isinstance(h, _Holder) else None


def guard(root: nn.Module, is_placeholder: Callable[[Any], bool], gib: float, store_dir: str,
          holder: Any = None) -> None:
    """Make a forward of any submodule of ``root`` whose own parameters are placeholders raise ``RuntimeError``.

    Args:
        root: the LightningModule (or model) left with placeholders.
        is_placeholder: the store's ``HostStore.is_placeholder``.
        gib: the fp32 weights' size, GiB (the ``host_memory_limit`` that brings them back after a run).
        store_dir: the NVMe store's directory (named in the error).
        holder: the strategy whose store holds the weights (kept alive by ``root``: :func:`holder_of`).
    """
    unguard(root)
    if holder is not None:
        root.__dict__[_HOLDER] = _Holder(holder)
    size = format_gib(gib)
    where = (f"the trained fp32 weights ({size}) exceed host_memory_limit, so after the run they are only in the NVMe "
             f"store {store_dir} and the module's parameters are placeholders (NaN)")
    fix = ("Save the weights with trainer.save_checkpoint(dir) and load dir/model with from_pretrained (or read one "
           f"with trainer.strategy.engine.read_param(p)), or set host_memory_limit >= {size} so the weights come back "
           "into the module after fit.")
    check = _Check(is_placeholder, f"megatrain: {where}: this forward would compute with them. {fix}",
                   f"megatrain: {where}: a copy or pickle of the module would hold placeholders (NaN). {fix}")
    _HOOKS[root] = [m.register_forward_pre_hook(check) for m in root.modules()
                    if next(m.parameters(recurse=False), None) is not None]


def format_gib(gib: float) -> str:
    """``"1.25 GiB"``, or MiB / KiB below 0.01 GiB."""
    if gib >= 0.01:
        return f"{gib:.2f} GiB"
    return f"{gib * 1024:.2f} MiB" if gib * 1024 >= 0.01 else f"{gib * 2**20:.1f} KiB"


class _Check:
    """The forward pre-hook :func:`guard` registers: raises ``RuntimeError(forward_msg)`` when the module's own
    parameters are placeholders, and ``RuntimeError(copy_msg)`` on ``copy.deepcopy`` or pickling of the module
    (which copy its hooks): a copy would hold unguarded zero tensors."""

    def __init__(self, is_placeholder: Callable[[Any], bool], forward_msg: str, copy_msg: str):
        self.is_placeholder, self.forward_msg, self.copy_msg = is_placeholder, forward_msg, copy_msg

    def __call__(self, module: nn.Module, args: Any) -> None:
        if any(self.is_placeholder(p) for p in module.parameters(recurse=False)):
            raise RuntimeError(self.forward_msg)

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError(self.copy_msg)

    def __reduce__(self) -> Any:
        raise RuntimeError(self.copy_msg)


_STATE_DICT_HOOKS: "weakref.WeakKeyDictionary[nn.Module, list[Any]]" = weakref.WeakKeyDictionary()
_KEYS_ONLY = threading.local()  # depth of keys_only() contexts on this thread


@contextlib.contextmanager
def keys_only() -> Iterator[None]:
    """Let ``state_dict()`` of guarded modules run on this thread (:func:`guard_state_dict`): for the checkpoint
    writer, which takes the values from the store but calls library code that lists keys through ``state_dict()``
    (peft's ``ModulesToSaveWrapper.adapter_state_dict``, in a LoRA run with ``modules_to_save`` on NVMe)."""
    _KEYS_ONLY.depth = getattr(_KEYS_ONLY, "depth", 0) + 1
    try:
        yield
    finally:
        _KEYS_ONLY.depth -= 1


def guard_state_dict(root: nn.Module, message: str) -> None:
    """Make ``state_dict()`` (``keep_vars=False``) of any submodule of ``root`` whose own parameters are NVMe
    placeholders raise ``RuntimeError(message)`` before anything is copied (``save_pretrained`` from a callback would
    silently write an all-NaN model). ``keep_vars=True``, which the checkpoint code maps by identity, is not
    refused. Installed once per module; the check is by value, so real weights (inside ``summon_full_params``)
    pass."""
    if root in _STATE_DICT_HOOKS:
        return

    def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not keep_vars and not getattr(_KEYS_ONLY, "depth", 0) \
                and any(is_nvme_placeholder(p) for p in module.parameters(recurse=False)):
            raise RuntimeError(message)

    _STATE_DICT_HOOKS[root] = [m.register_state_dict_pre_hook(pre) for m in root.modules()
                               if next(m.parameters(recurse=False), None) is not None]


def unguard(root: nn.Module) -> None:
    """Remove :func:`guard`'s hooks and holder from ``root`` (nothing if there are none)."""
    root.__dict__.pop(_HOLDER, None)
    for h in _HOOKS.pop(root, []):
        h.remove()
