"""What a block's forward saw of its modules: their ``training`` flags, the values of its buffers
(BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``) and the module hooks, replayed when the block
is recomputed.

A recomputed block runs its forward twice per step (the forward, then its recompute in backward). Three kinds of
module state can differ between the two runs:

* ``training`` flags: a ``training_step`` that switches modes between a block's forward and its backward
  (a forward under ``model.eval()`` followed by ``model.train()``, BatchNorm layers set to eval inside a block,
  ``eval()`` before ``backward()``) would otherwise recompute with the backward-time flags: other dropout masks
  (dropout acts only in training mode), other BatchNorm statistics (batch vs running), so other gradients than
  plain PyTorch's, which differentiates the forward it ran. The flags of every submodule are recorded at the
  forward and set for the recompute (then put back).
* buffers: a buffer the forward updates in training mode would be updated twice where plain PyTorch updates it
  once, and the recompute would see the updated value where the forward saw the old one (also when another
  forward updated it after this one: an eval-mode forward, then a train-mode one, then one backward). A copy of
  the buffer values the forward started from is kept; the recompute runs on a fresh copy of them and the current
  values are put back afterwards, so the module keeps exactly the forwards' updates.

* module hooks: a forward hook, pre-hook or backward hook on a submodule of the block (or one of torch's global
  module hooks, ``register_module_forward_hook``) that the user registers or removes between the forward and its
  backward (an intervention context manager, activation steering, a hook
  removed right after the forward) would otherwise be in or out of the recompute as it is at backward time,
  where plain PyTorch's graph has what the forward ran. The hook dictionaries of every submodule are recorded at
  the forward (a shallow copy where not empty) and installed for the recompute. The hooks run again there, as
  in ``torch.utils.checkpoint``: a hook whose output depends on state it changes (a call counter) sees another
  call.

Decoder layers of Hugging Face models hold no buffers (rotary tables live on the model): for them a snapshot is
one walk over the block's submodules (about ten for a decoder layer) and one flag per submodule, nothing cloned.
A block with buffers (BatchNorm) has them cloned at every training-mode block call (2 x channels values each).
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
        """Within the context every submodule has the ``training`` flag the forward saw and the buffers hold
        (copies of) the values the forward started from, and each submodule's hooks are the ones it had then; on exit
        the flags and hooks are the current ones again and each buffer is the tensor it was on entry, so what the
        recompute wrote into them is dropped."""
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


def snapshot(module: nn.Module, name: str = "", warned: set[str] | None = None) -> BlockState:
    """The ``training`` flags of ``module`` and its submodules, a copy of their buffers and of their hook
    dictionaries, before a block call's forward. The copies are kept until the call's backward even when its
    forward changed no buffer: a later forward before that backward may (an eval-mode forward reads BatchNorm's
    running statistics, a train-mode one then updates them in place), and the recompute must read what its forward
    read. ``name``: the block's path, for the one warning about user forward hooks inside it
    (:func:`warn_inner_forward_hooks`); ``warned``: the block paths already warned about (one set per engine)."""
    modules = list(module.modules())
    state = BlockState(modules)
    if warned is not None and name not in warned:
        warn_inner_forward_hooks(name, module, modules[1:], warned)
    return state


# library code whose hooks inside a block are known to be handled (transformers' output recorder: recorded_outputs)
_KNOWN = ("transformers.", "torch.", "megatrain_lightning.", "peft.", "accelerate.")


def has_user_hooks(m: nn.Module, backward: bool = False) -> bool:
    """Whether ``m`` has a forward hook or pre-hook (``backward``: or a backward hook) registered by code other than
    the libraries whose hooks are known to be handled (:data:`_KNOWN`: transformers' output recorder...)."""
    if not (m._forward_hooks or m._forward_pre_hooks or (backward and (m._backward_hooks or m._backward_pre_hooks))):
        return False
    dicts = (m._forward_hooks, m._forward_pre_hooks) + ((m._backward_hooks, m._backward_pre_hooks) if backward else ())
    return any(not (getattr(h, "__module__", None) or type(h).__module__ or "").startswith(_KNOWN)
               for d in dicts for h in d.values())


def warn_inner_forward_hooks(name: str, block: nn.Module, inner: list[nn.Module], warned: set[str]) -> None:
    """Warn (and add ``name`` to ``warned``) if a submodule inside the block (not the block itself) has a forward hook or
    pre-hook from user code: the block's forward keeps no autograd history past its return (it is recomputed in backward), so
    a tensor such a hook keeps (activation capture) cannot be differentiated: a backward through a loss computed from
    it raises (engine/boundary/forward.py), where plain PyTorch would differentiate it. The hook also runs again in the
    recompute. A hook on the block itself sees the block call's outputs, which have their history."""
    hooked = [m for m in inner if has_user_hooks(m)]
    if hooked:
        paths = {id(m): n for n, m in block.named_modules()}
        users = [paths.get(id(m), "?") for m in hooked]
        warned.add(name)
        log.warning(
            "megatrain: forward hooks on %s inside streamed block %s run in a forward that keeps no autograd history past its return "
            "(the block is recomputed in backward, where the hooks run again): a tensor they keep cannot be "
            "differentiated, so a backward through a loss term computed from it raises (plain PyTorch would train "
            "it). Register the hook on the block itself (its outputs keep their history), or keep such hooks for "
            "logging only (detach what they keep).",
            ", ".join(users[:3]) + (" ..." if len(users) > 3 else ""), name or type(block).__name__)
