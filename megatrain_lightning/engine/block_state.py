"""What a block's forward saw of its modules, replayed when the block is recomputed in backward, so the
recompute differentiates the forward that ran (docs/internals/block-calls.md has the table):

* ``training`` flags of every submodule: a ``training_step`` may switch modes between forward and backward
  (other dropout masks, BatchNorm batch vs running statistics otherwise);
* buffer values the forward started from (BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``):
  the recompute runs on a fresh copy and the current values are put back, so each buffer keeps exactly the
  forwards' updates (also when a later forward updated it before this backward);
* module hooks of every submodule and torch's global module hooks (``register_module_forward_hook``), shallow
  copies: a hook added or removed between forward and backward is as at the forward. They run again in the
  recompute, as in ``torch.utils.checkpoint`` (a call counter sees another call).

Cost: Hugging Face decoder layers hold no buffers (rotary tables live on the model), so a snapshot is one walk
over about ten submodules, nothing cloned; a block with buffers (BatchNorm) clones them at every training-mode
call (2 x channels values each).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Iterator

from torch import nn
from torch.nn.modules import module as _torch_module


log = logging.getLogger(__name__)

# nn.Module's hook dictionaries (torch/nn/modules/module.py), all keyed by the hook handle's id
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


# torch's global module hooks (register_module_forward_hook...): module-level dictionaries of torch.nn.modules.module,
# looked up by name at every module call
_GLOBAL_DICTS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
                 "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")


def _hooks_of(m: nn.Module) -> tuple[tuple[str, OrderedDict], ...]:
    d = m.__dict__
    if not (d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks")
            or d.get("_backward_pre_hooks")):  # the usual case (the other dictionaries only qualify these)
        return ()
    return tuple((name, OrderedDict(d[name])) for name in _HOOK_DICTS if d.get(name))


class BlockState:
    """The module state one block call's forward started from.

    Args:
        modules: every submodule of the block (the block itself included), in ``modules()`` order.
    """

    def __init__(self, modules: list[nn.Module]):
        self._modes = [(m, m.training) for m in modules]
        entries = [(m, n, b) for m in modules for n, b in m.named_buffers(recurse=False) if b is not None]
        self._buffers = [(m, n, b.clone()) for m, n, b in entries]
        self._hooks = [(m, _hooks_of(m), m.__dict__.get("_is_full_backward_hook")) for m in modules]
        g = vars(_torch_module)
        self._global = {n: OrderedDict(g[n]) for n in _GLOBAL_DICTS if g.get(n)}
        self._global_full = g.get("_global_is_full_backward_hook")

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Within the context, flags, hooks and (copies of) buffer values are as the forward saw them; on exit
        they are the current ones again, and what the recompute wrote into the buffers is dropped."""
        flags = [(m, m.training) for m, _ in self._modes]
        for m, was in self._modes:
            if m.training != was:
                m.training = was  # this module only: its children have their own entries
        current = [getattr(m, n) for m, n, _ in self._buffers]
        for m, n, before in self._buffers:
            setattr(m, n, before.clone())
        swap = [(m, saved, full) for m, saved, full in self._hooks if saved or _hooks_of(m)]  # usually none
        live = [(m, [(name, m.__dict__.get(name)) for name in _HOOK_DICTS], m.__dict__.get("_is_full_backward_hook"))
                for m, _, _ in swap]
        for m, saved, full in swap:
            as_saved = dict(saved)
            for name in _HOOK_DICTS:
                if name in m.__dict__:
                    m.__dict__[name] = OrderedDict(as_saved.get(name, ()))
            m.__dict__["_is_full_backward_hook"] = full
        g = vars(_torch_module)
        swap_global = bool(self._global) or any(g.get(n) for n in _GLOBAL_DICTS)  # usually neither
        live_global = {n: g[n] for n in _GLOBAL_DICTS if n in g} if swap_global else {}
        live_full = g.get("_global_is_full_backward_hook")
        for n in live_global:
            g[n] = OrderedDict(self._global.get(n, ()))
        if swap_global:
            g["_global_is_full_backward_hook"] = self._global_full
        try:
            yield
        finally:
            if swap_global:
                g.update(live_global)
                g["_global_is_full_backward_hook"] = live_full
            for m, dicts, full in live:
                for name, d in dicts:
                    if d is not None:
                        m.__dict__[name] = d
                m.__dict__["_is_full_backward_hook"] = full
            for (m, n, _), cur in zip(self._buffers, current):
                setattr(m, n, cur)
            for m, now in flags:
                m.training = now


# library code whose hooks inside a block are known to be handled (transformers' output recorder: recorded_outputs)
_KNOWN = ("transformers.", "torch.", "megatrain_lightning.", "peft.", "accelerate.")


def has_user_hooks(m: nn.Module, backward: bool = False) -> bool:
    """Whether ``m`` has a forward hook or pre-hook (``backward``: or a backward hook) from code outside
    :data:`_KNOWN`."""
    if not (m._forward_hooks or m._forward_pre_hooks or (backward and (m._backward_hooks or m._backward_pre_hooks))):
        return False
    dicts = (m._forward_hooks, m._forward_pre_hooks) + ((m._backward_hooks, m._backward_pre_hooks) if backward else ())
    return any(not (getattr(h, "__module__", None) or type(h).__module__ or "").startswith(_KNOWN)
               for d in dicts for h in d.values())


def snapshot(module: nn.Module, name: str, warned: set[str]) -> BlockState:
    """The :class:`BlockState` of ``module`` before a block call's forward. Buffers are copied even when the
    forward changes none: a later forward before this backward may update them in place.

    Warns once per block path ``name`` (``warned``: the paths already warned about, one set per engine) if a
    submodule inside the block (not the block itself) has a user forward hook or pre-hook: a tensor it keeps has
    no autograd history (a backward through it raises in engine/boundary/forward.py), and it runs again in the
    recompute. A hook on the block sees outputs with history."""
    modules = list(module.modules())
    state = BlockState(modules)
    hooked = [m for m in modules[1:] if has_user_hooks(m)] if name not in warned else []
    if hooked:
        paths = {id(m): n for n, m in module.named_modules()}
        users = [paths.get(id(m), "?") for m in hooked]
        warned.add(name)
        log.warning(
            "megatrain: forward hooks on %s inside streamed block %s run in a forward that keeps no autograd history past its return "
            "(the block is recomputed in backward, where the hooks run again): a tensor they keep cannot be "
            "differentiated, so a backward through a loss term computed from it raises (plain PyTorch would train "
            "it). Register the hook on the block itself (its outputs keep their history), or keep such hooks for "
            "logging only (detach what they keep).",
            ", ".join(users[:3]) + (" ..." if len(users) > 3 else ""), name or type(module).__name__)
    return state
