"""The user's optimizer while the host AdamW steps it: ``zero_grad``, ``state_dict``/``load_state_dict`` and
``state`` of the torch optimizer that ``configure_optimizers`` returned reach the host store.

The torch optimizer never steps and holds no state; :class:`OptimizerTakeover` sets these methods on the instance
(and on Lightning's wrappers of it) and removes them again (:meth:`OptimizerTakeover.restore`,
:meth:`OptimizerTakeover.close`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .state_view import HostStateView


class OptimizerTakeover:
    """Which optimizer is taken over, and its own methods to put back.

    Attributes:
        zero_grad_of: ``(optimizer, its own zero_grad set on the instance or None)`` while taken over.
        state_dict_of: the optimizer whose ``state_dict()`` reads the host AdamW state (kept after fit, so that
            ``trainer.save_checkpoint`` and user code still read it; :meth:`close` removes it).
    """

    def __init__(self) -> None:
        self.zero_grad_of: tuple[Any, Any] | None = None
        self.state_dict_of: Any = None

    @property
    def active(self) -> bool:
        return self.zero_grad_of is not None

    def take_over(self, opt: Any, engine: Any, on_zeroed: Callable[[], None] | None = None) -> None:
        """Route ``opt.zero_grad()`` to the engine's accumulators (then ``on_zeroed``), ``state_dict()``/
        ``load_state_dict()`` to the host optimizer (:meth:`patch_state_dict`) and ``opt.state`` to a
        :class:`HostStateView`. ``engine`` has the optimizer attached (``StreamingEngine.attach_optimizer``)."""
        had = "zero_grad" in opt.__dict__
        orig = opt.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            global _ZERO_GRAD_WARNED
            if not set_to_none and not _ZERO_GRAD_WARNED:  # once per process
                _ZERO_GRAD_WARNED = True
                rank_zero_warn(
                    "megatrain: optimizer.zero_grad(set_to_none=False) acts as set_to_none=True here (gradients "
                    "live in host accumulators): a parameter that gets no gradient in a step is not updated, where "
                    "torch's AdamW would still apply weight decay and momentum with a zero gradient. Parameters "
                    "that get a gradient every step are unaffected; for the others use strategy='auto' or give "
                    "them a gradient every step (e.g. add 0 * their output to the loss).", category=UserWarning)
            orig(set_to_none=set_to_none)
            engine.grads.zero()
            if on_zeroed is not None:
                on_zeroed()

        self.zero_grad_of = (opt, orig if had else None)
        opt.zero_grad = zero_grad  # type: ignore[method-assign]
        self.patch_state_dict(opt, engine)

        def forget(param: torch.Tensor | None) -> None:
            host = engine.optimizer
            if host is None or engine.closed:
                return
            host.flush()
            for p in ([param] if param is not None else [p for g in opt.param_groups for p in g["params"]]):
                host.forget_param_state(p)

        opt.state = HostStateView(forget)  # type: ignore[assignment]

    def patch_state_dict(self, opt: Any, engine: Any) -> None:
        """``opt.state_dict()`` / ``opt.load_state_dict(sd)`` read and write the host optimizer's state in torch's
        format (``HostAdamW.state_dict(copy=True)``: 8 bytes/param of host RAM while the dict lives). Kept after fit
        (for ``trainer.save_checkpoint``); :meth:`close` removes them."""
        def state_dict() -> dict[str, Any]:
            if engine.closed or engine.optimizer is None:
                raise RuntimeError("megatrain: this optimizer's state lived in the strategy's host store, which "
                                   "trainer.strategy.close() removed; save it (or a checkpoint) before closing.")
            return engine.optimizer.state_dict(copy=True)

        def load_state_dict(state: dict[str, Any]) -> None:
            if engine.closed or engine.optimizer is None:
                raise RuntimeError("megatrain: the strategy's host store was closed (trainer.strategy.close()); "
                                   "load the optimizer state in a new run (fit(ckpt_path=...)).")
            engine.optimizer.load_state_dict(state)

        opt.state_dict = state_dict  # type: ignore[method-assign]
        opt.load_state_dict = load_state_dict  # type: ignore[method-assign]
        self.state_dict_of = opt

    def wrap_lightning_optimizers(self, wrappers: Iterable[Any]) -> None:
        """Set the routed methods on Lightning's wrappers too (``self.optimizers()``: a subclass of the optimizer's
        class, so it would call the class's ``zero_grad``). Call once the wrappers are final."""
        if self.zero_grad_of is not None:
            opt = self.zero_grad_of[0]
            for wrapper in wrappers:
                if wrapper.optimizer is opt:
                    wrapper.zero_grad = opt.zero_grad  # type: ignore[method-assign]
                    wrapper.state_dict = opt.state_dict  # type: ignore[method-assign]
                    wrapper.load_state_dict = opt.load_state_dict  # type: ignore[method-assign]

    def restore(self, wrappers: Iterable[Any]) -> None:
        """The optimizer's own ``zero_grad`` and torch's ``state`` again (end of a run, or a new optimizer);
        ``state_dict`` stays routed until :meth:`close`."""
        if self.zero_grad_of is not None:
            opt, orig = self.zero_grad_of
            if orig is None:
                opt.__dict__.pop("zero_grad", None)
            else:
                opt.zero_grad = orig
            self.zero_grad_of = None
            if isinstance(opt.state, HostStateView):
                opt.state = defaultdict(dict)  # torch's own, empty: the state is read through state_dict()
        for wrapper in wrappers:
            wrapper.__dict__.pop("zero_grad", None)

    def close(self) -> None:
        """The torch optimizer's own ``state_dict``/``load_state_dict`` again (the host store is closed)."""
        opt = self.state_dict_of
        if opt is not None:
            opt.__dict__.pop("state_dict", None)
            opt.__dict__.pop("load_state_dict", None)
            self.state_dict_of = None


_ZERO_GRAD_WARNED = False
