"""Any per-parameter ``torch.optim`` optimizer on the host, one slab at a time, with the class's own ``step``.

``torch.optim.AdamW`` and ``Adam`` (without ``amsgrad``/``maximize``) run on :class:`~.host_adamw.HostAdamW`'s kernel
over the store's ``exp_avg``/``exp_avg_sq`` regions. Every other optimizer whose update of a parameter reads only
that parameter, its gradient, its own state and its group's hyper-parameters (SGD, Adamax, NAdam, RAdam, RMSprop,
Adagrad, Adadelta, ASGD, Rprop, Adafactor, Muon, AdamW with ``amsgrad``/``maximize``, and user subclasses that keep
that contract) runs here: for each slab that got gradients, an instance of the user's optimizer class is built
over views of the slab's fp32 master weights (its param groups: the step's snapshot of the user's groups'
hyper-parameters), each view's ``.grad`` is the view of the gradient accumulator, the per-parameter state
this module keeps in host RAM is put into the instance's ``state``, and the class's own ``step()`` runs: the
numbers are the class's, as with the user's optimizer on CPU parameters (for-loop kernels by torch's default).

The user's optimizer stays the one Lightning sees (``param_groups`` read at every step, ``state_dict()`` in
torch's format); the schedule (deferred per-slab updates), clipping, fp16 unscaling, accumulation and
``optimizer_in_backward`` are :class:`~.host_adamw.HostAdamW`'s.

Optimizers refused (:func:`validate_optimizer`): ``LBFGS`` (its step re-evaluates the model through a closure),
``SparseAdam`` (sparse gradients), any group with ``capturable=True`` or ``differentiable=True``. An optimizer
whose update couples parameters (a group-wide norm or a line search) is not detected: it would see one slab's
parameters at a time. Tiers refused (:class:`HostTorchOptimizer`): the optimizer on NVMe (``offload_optimizer=
"nvme"``) and data parallel (a node-shared store), where the state of these optimizers has no place yet; masters on
NVMe with the optimizer in RAM work.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..store.host import HostStore, Slab
from ..store.regions import Region
from ..store.shared import SlabOwnership
from .host_adamw import HostAdamW, UnsupportedOptimizerError, _Pending

SUPPORTED = ("any torch.optim optimizer whose update is per parameter (torch.optim.AdamW/Adam on the host AdamW "
             "kernel; SGD, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, ASGD, Rprop, Adafactor, Muon and "
             "subclasses with their own step, optimizer state in RAM, one process); not LBFGS or SparseAdam, not "
             "capturable=True or differentiable=True")

_REFUSED_CLASSES: tuple[tuple[type, str], ...] = (
    (torch.optim.LBFGS, "its step re-evaluates the model through a closure (several forward/backward passes per "
                        "step), which the host update of one slab at a time cannot run"),
    (torch.optim.SparseAdam, "it needs sparse gradients; the host gradient accumulators are dense"),
)

_REFUSED_FLAGS = {
    "capturable": "capturable=True keeps the state on the accelerator for CUDA graphs; the host update runs on "
                  "CPU tensors",
    "differentiable": "differentiable=True differentiates through the update, which runs on the host outside "
                      "autograd",
}


def _name(optimizer: Any) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def uses_adamw_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` runs on the host AdamW kernel (:class:`~.host_adamw.HostAdamW`): exactly
    ``torch.optim.AdamW`` or ``Adam`` with no group setting ``amsgrad``, ``maximize`` or ``differentiable``."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    return not any(g.get(k, False) for g in optimizer.param_groups for k in ("amsgrad", "maximize", "differentiable"))


def validate_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Check that ``optimizer`` can be stepped on the host (either kernel).

    Raises:
        UnsupportedOptimizerError: not a ``torch.optim.Optimizer``, ``LBFGS``, ``SparseAdam``, or a param group with
            ``capturable=True`` / ``differentiable=True``; the message names the optimizer and the reason.
    """
    name = _name(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"megatrain steps a torch.optim.Optimizer on the host; configure_optimizers returned {name}. "
            f"Supported: {SUPPORTED}.")
    for cls, why in _REFUSED_CLASSES:
        if isinstance(optimizer, cls):
            raise UnsupportedOptimizerError(
                f"megatrain cannot step {name} on the host: {why}. Use a per-parameter optimizer "
                "(torch.optim.AdamW, SGD, Adafactor...), or strategy='auto'.")
    for i, g in enumerate(optimizer.param_groups):
        for key, why in _REFUSED_FLAGS.items():
            if g.get(key, False):
                raise UnsupportedOptimizerError(
                    f"megatrain cannot step {name} with param_groups[{i}] setting {why}. Leave {key}=False.")


def make_host_optimizer(store: HostStore, optimizer: torch.optim.Optimizer, overlap: bool = True,
                        transport: Any = None, ownership: SlabOwnership | None = None) -> HostAdamW:
    """The host optimizer for ``optimizer``: :class:`~.host_adamw.HostAdamW` when :func:`uses_adamw_kernel`, else
    :class:`HostTorchOptimizer` (arguments: :class:`~.host_adamw.HostAdamW`'s).

    Raises:
        UnsupportedOptimizerError: see :func:`validate_optimizer` and :class:`HostTorchOptimizer`.
    """
    validate_optimizer(optimizer)
    cls = HostAdamW if uses_adamw_kernel(optimizer) else HostTorchOptimizer
    return cls(store, optimizer, overlap=overlap, transport=transport, ownership=ownership)


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``cls.__init__`` takes as keyword arguments (all with ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in defaults.items() if k != "params"}
    return {k: v for k, v in defaults.items()
            if k in params and k != "params" and params[k].kind is not inspect.Parameter.VAR_POSITIONAL}


class HostTorchOptimizer(HostAdamW):
    """The user's optimizer class stepped on the host over the slabs of a :class:`HostStore` (module docstring).

    Args: as :class:`~.host_adamw.HostAdamW` (``transport`` is unused: the class's own kernels run on the host).

    State per trainable parameter the optimizer updated: what the class's ``step`` keeps in ``state[p]`` (e.g.
    SGD's ``momentum_buffer``; Adafactor's ``step``, ``row_var``, ``col_var``), CPU tensors in host RAM owned by this
    object (the store's ``exp_avg``/``exp_avg_sq`` regions are never allocated on the RAM tier).

    Masters on NVMe (``offload_params="nvme"``, ``offload_optimizer="cpu"``) work: the views are built inside the
    update's hold of the slab's master window.

    Raises:
        UnsupportedOptimizerError: :func:`validate_optimizer`; the class cannot be built over the slab views with the
            user's defaults (a constructor that takes other arguments); the optimizer regions on NVMe
            (``offload_optimizer="nvme"``) or data parallel with a node-shared store (``ownership``).
    """

    def __init__(self, store: HostStore, optimizer: torch.optim.Optimizer, overlap: bool = True, transport: Any = None,
                 ownership: SlabOwnership | None = None):
        name = _name(optimizer)
        if store.nvme_kinds & {Region.exp_avg, Region.exp_avg_sq, Region.grad_accum}:
            raise UnsupportedOptimizerError(
                f"megatrain steps {name} on the host with its state in host RAM; the NVMe tier for the optimizer "
                "(offload_optimizer='nvme') keeps only AdamW state on disk. Use the RAM tier for the optimizer "
                "(offload_optimizer='cpu'; offload_params='nvme' works with it) or torch.optim.AdamW.")
        if ownership is not None:
            raise UnsupportedOptimizerError(
                f"megatrain steps {name} on the host in one process only; data parallel (several processes sharing "
                "the node's host store) keeps only AdamW state. Train in one process (the RAM tier) or use "
                "torch.optim.AdamW.")
        self.state: dict[tuple[int, int], dict[str, Any]] = {}  # (slab, entry) -> the class's state of the parameter
        self._ctor = _constructor_kwargs(type(optimizer), optimizer.defaults)
        super().__init__(store, optimizer, overlap=overlap, transport=transport, ownership=ownership)
        self._probe()

    @staticmethod
    def _validate(optimizer: torch.optim.Optimizer) -> bool:
        validate_optimizer(optimizer)
        return False

    def _probe(self) -> None:
        """Build the class once over a stand-in parameter of each group's first shape, so that a constructor that
        cannot be rebuilt from the user's ``defaults`` is refused at setup, not at the first step."""
        groups = self.optimizer.param_groups
        try:
            self._instance([(h, [torch.zeros(tuple(g["params"][0].shape))])
                            for h, g in zip(self._snapshot(), groups) if g["params"]])
        except (TypeError, ValueError) as err:
            raise UnsupportedOptimizerError(
                f"megatrain steps {_name(self.optimizer)} on the host by building it over each block's weights with "
                f"the optimizer's defaults, which failed ({type(err).__name__}: {err}). Supported: {SUPPORTED}."
            ) from err

    def _instance(self, groups: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> torch.optim.Optimizer:
        """An instance of the user's class over ``groups`` (``(hyper-parameters, parameters)`` pairs)."""
        return type(self.optimizer)([{**h, "params": ps} for h, ps in groups], **self._ctor)

    def _snapshot(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every param group's hyper-parameters (all keys but ``params``; tensors cloned) at this step."""
        return [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups]

    def implementation(self, group: int = 0) -> str:
        """``"<module>.<class>.step"``: the host runs the class's own update."""
        return f"{_name(self.optimizer)}.step"

    # ------------------------------------------------------------------ math
    def _update(self, slab: Slab, pend: _Pending) -> None:
        with self.store.hold(slab.index, [Region.master], write=True) as w, \
                self.store.hold(slab.index, [Region.grad_accum]) as r:
            master, acc = w[Region.master], r[Region.grad_accum]
            if pend.grad_ops:
                self._apply_ops(slab, acc, pend.grad_ops)
            by_group: dict[int, list[int]] = {}
            for i, e in enumerate(slab.entries):
                gi = self.group_of[slab.index][i]
                if 0 <= gi < len(pend.hyper) and e.trainable and slab.has_grad[i]:
                    by_group.setdefault(gi, []).append(i)
            if not by_group:
                return
            views: dict[int, torch.Tensor] = {}
            groups = []
            for gi, idx in by_group.items():
                ps = []
                for i in idx:
                    p = slab.view(master, i)
                    p.grad = slab.view(acc, i)
                    views[i] = p
                    ps.append(p)
                groups.append((pend.hyper[gi], ps))
            inst = self._instance(groups)
            for i, p in views.items():
                st = self.state.get((slab.index, i))
                if st is not None:
                    inst.state[p] = st
            inst.step()
            for i, p in views.items():
                st = inst.state.get(p)
                if st:
                    self.state[(slab.index, i)] = st
                p.grad = None

    def _count_steps(self, slab: Slab) -> None:  # pragma: no cover - data parallel is refused at construction
        raise AssertionError("HostTorchOptimizer runs in one process")

    # ------------------------------------------------------------------ state
    def state_for(self, slab_index: int, entry: int) -> dict[str, Any] | None:
        """The class's state of one parameter (live tensors), or ``None`` before its first update."""
        return self.state.get((slab_index, entry))

    @staticmethod
    def _check_saved_keys(keys: set[str]) -> None:
        """Any keys: the class's ``step`` reads what it finds."""

    @staticmethod
    def _holds_state(entry: dict[str, Any]) -> bool:
        return bool(entry)

    def set_param_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Set one parameter's state from a ``state_dict()`` entry of the user's class, converted as
        ``torch.optim.Optimizer.load_state_dict`` converts it: floating tensors other than ``step`` become fp32
        CPU copies (the masters' dtype), ``step`` and other values are kept (tensors copied to the CPU).

        Raises:
            ValueError: ``param`` is not in the store.
        """
        if id(param) not in self._where:
            raise ValueError("set_param_state: parameter is not part of the host store.")
        si, ei = self._where[id(param)]
        out: dict[str, Any] = {}
        for k, v in state.items():
            if torch.is_tensor(v):
                v = v.detach().to("cpu", dtype=torch.float32 if v.is_floating_point() and k != "step" else v.dtype,
                                  copy=True)
            out[k] = v
        with self.store.slabs[si].lock:
            self.pending.pop(si, None)
            self.state[(si, ei)] = out

    def load_param_state(self, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: torch.Tensor) -> None:
        """AdamW-shaped state (the store's AdamW interface): kept as the class's state with those keys.

        Raises:
            ValueError: ``param`` is not in the store.
        """
        self.set_param_state(param, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})

    def forget_param_state(self, param: torch.Tensor) -> None:
        """Drop one parameter's state: its next update is the class's first (state created afresh)."""
        where = self._where.get(id(param))
        if where is not None:
            self.state.pop(where, None)

    @property
    def exp_avg(self) -> list[torch.Tensor | None]:
        """Per slab, the store's flat ``exp_avg`` (``None``: this optimizer keeps its own state)."""
        return [s.exp_avg for s in self.store.slabs]
