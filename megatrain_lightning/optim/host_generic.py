"""Any per-parameter ``torch.optim`` optimizer on the host, one slab at a time, with the class's own ``step``: per
slab with gradients, an instance of the user's class over views of the slab's fp32 masters (each ``.grad`` a view of
the accumulator, its ``state`` the kept state), so the numbers are the class's. Schedule, clipping, fp16 unscaling
and ``optimizer_in_backward`` are :class:`~.host_adamw.HostAdamW`'s. What runs here, what is refused, where the
state lives on each tier (NVMe: :mod:`.state_packing`): docs/internals/optimizer.md, "Other optimizers".
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _MockOptimizer
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..store.host import HostStore, Slab
from ..store.regions import Region
from ..store.shared import SlabOwnership
from .build import accepted
from .host_adamw import HostAdamW, UnsupportedOptimizerError, _Pending
from .state_packing import Layout, copy_tensor, leaves, pack, packed_kind, rebuild, unpackable

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
    """Whether ``optimizer`` runs on :class:`~.host_adamw.HostAdamW`'s kernel."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    return not any(g.get(k, False) for g in optimizer.param_groups for k in ("amsgrad", "maximize", "differentiable"))


def validate_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Check that ``optimizer`` can be stepped on the host (either kernel).

    Raises:
        UnsupportedOptimizerError: no optimizer (Lightning's ``_MockOptimizer``), not a ``torch.optim.Optimizer``,
            ``LBFGS``, ``SparseAdam``, or a param group with
            ``capturable=True`` / ``differentiable=True``.
    """
    name = _name(optimizer)
    if isinstance(optimizer, _MockOptimizer):
        raise UnsupportedOptimizerError(
            "configure_optimizers returned no optimizer (Lightning then trains with its stand-in _MockOptimizer, "
            "which updates nothing); megatrain updates the weights on the host with the optimizer it returns: return "
            "one, e.g. torch.optim.AdamW(self.parameters(), lr=1e-5). To only evaluate, call trainer.validate/test/"
            "predict instead of fit.")
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
                        transport: Any = None, ownership: SlabOwnership | None = None,
                        worker: Executor | None = None) -> HostAdamW:
    """The host optimizer for ``optimizer``: :class:`~.host_adamw.HostAdamW` when :func:`uses_adamw_kernel`, else
    :class:`HostTorchOptimizer` (arguments: :class:`~.host_adamw.HostAdamW`'s).

    Raises:
        UnsupportedOptimizerError: see :func:`validate_optimizer` and :class:`HostTorchOptimizer`.
    """
    validate_optimizer(optimizer)
    cls = HostAdamW if uses_adamw_kernel(optimizer) else HostTorchOptimizer
    return cls(store, optimizer, overlap=overlap, transport=transport, ownership=ownership, worker=worker)


class HostTorchOptimizer(HostAdamW):
    """The user's optimizer class stepped on the host over the slabs of a :class:`HostStore` (module docstring).

    Args: as :class:`~.host_adamw.HostAdamW` (``transport`` is unused).

    State per parameter: what the class's ``step`` keeps in ``state[p]``, in :attr:`state` (RAM tier; the store's
    ``exp_avg``/``exp_avg_sq`` are never allocated) or packed into those regions (NVMe tier, :attr:`packed`).

    Raises:
        UnsupportedOptimizerError: :func:`validate_optimizer`; the class cannot be built over the slab views with the
            user's defaults; on the NVMe tier, state beyond 8 bytes per parameter element or fp64 (:meth:`_probe`).
    """

    def __init__(self, store: HostStore, optimizer: torch.optim.Optimizer, overlap: bool = True, transport: Any = None,
                 ownership: SlabOwnership | None = None, worker: Executor | None = None):
        # (slab, entry) -> the class's state of the parameter (NVMe tier: its 0-d values; the tensors are packed)
        self.state: dict[tuple[int, int], dict[str, Any]] = {}
        self.packed: dict[tuple[int, int], Layout] = {}  # NVMe tier: where each state tensor lives
        names, var_kw = accepted(type(optimizer).__init__)  # the defaults the constructor takes (all with **kwargs)
        self._ctor = {k: v for k, v in optimizer.defaults.items() if k != "params" and (var_kw or k in names)}
        self._instances: dict[int, tuple[tuple, torch.optim.Optimizer]] = {}  # slab -> (groups' layout, instance)
        super().__init__(store, optimizer, overlap=overlap, transport=transport, ownership=ownership, worker=worker)
        self._probe()

    @staticmethod
    def _validate(optimizer: torch.optim.Optimizer) -> bool:
        validate_optimizer(optimizer)
        return False

    def _probe(self) -> None:
        """Build the class once over small stand-ins (each dimension at most 8) of each group's parameter shapes, so
        an unbuildable constructor is refused at setup; on the NVMe tier, also take two steps and check that the
        state packs into two fp32 values per element.

        Raises:
            UnsupportedOptimizerError: see the class docstring.
        """
        real: dict[tuple[int, ...], tuple[int, ...]] = {}  # stand-in shape -> the shape of a parameter it stands for
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                real.setdefault(tuple(min(d, 8) for d in p.shape), tuple(p.shape))
        shapes = [sorted({tuple(min(d, 8) for d in p.shape) for p in g["params"]}) for g in self.optimizer.param_groups]
        stand_ins = [(h, [torch.full(s, 0.5) for s in ss]) for h, ss in zip(self._snapshot(), shapes) if ss]
        try:
            inst = self._instance(stand_ins)
        except (TypeError, ValueError) as err:
            raise UnsupportedOptimizerError(
                f"megatrain steps {_name(self.optimizer)} on the host by building it over each block's weights with "
                f"the optimizer's defaults, which failed ({type(err).__name__}: {err}). Supported: {SUPPORTED}."
            ) from err
        if not self.on_disk:
            return
        for _, ps in stand_ins:
            for p in ps:
                p.grad = torch.full_like(p, 0.25)
        with torch.no_grad():
            inst.step()
            inst.step()
        for _, ps in stand_ins:
            for p in ps:
                why = unpackable(inst.state.get(p, {}), p.numel())
                if why:
                    raise UnsupportedOptimizerError(
                        f"megatrain keeps the state of {_name(self.optimizer)} on NVMe (offload_optimizer='nvme') in "
                        f"two fp32 values per parameter element; for a parameter of shape {real[tuple(p.shape)]} it "
                        f"{why}. "
                        "Keep the optimizer state in RAM (offload_optimizer='cpu'), or choose settings with less "
                        "state (RMSprop without centered+momentum, AdamW without amsgrad).")

    def _instance(self, groups: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> torch.optim.Optimizer:
        """An instance of the user's class over ``groups`` (``(hyper-parameters, parameters)`` pairs)."""
        return type(self.optimizer)([{**h, "params": ps} for h, ps in groups], **self._ctor)

    def _slab_instance(self, slab_index: int, layout: tuple, groups: list[tuple[dict[str, Any], list[torch.Tensor]]],
                       fresh: bool) -> torch.optim.Optimizer:
        """The instance for one slab's update: rebuilt when the slab's group ``layout`` changed or ``fresh`` (some
        constructors create state, e.g. Adagrad's ``sum``), else reused with this step's params and hyper-parameters
        (a constructor can cost as much as the update). Its ``state`` is empty between updates."""
        cached = self._instances.get(slab_index)
        if fresh or cached is None or cached[0] != layout:
            inst = self._instance(groups)
            self._instances[slab_index] = (layout, inst)
            return inst
        inst = cached[1]
        for g, (h, ps) in zip(inst.param_groups, groups):
            g.update(h)
            g["params"] = ps
        return inst

    def _snapshot(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every param group's hyper-parameters (all keys but ``params``; tensors cloned) at this step."""
        return [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups]

    def implementation(self, group: int = 0) -> str:
        """``"<module>.<class>.step"``: the host runs the class's own update."""
        return f"{_name(self.optimizer)}.step"

    # ------------------------------------------------------------------ math
    def _state_kinds(self, slab: Slab) -> list[str]:
        """The optimizer regions a slab's update must hold: NVMe tier, both until every trainable parameter has its
        placements, then only those they use; RAM tier, none."""
        if not self.on_disk:
            return []
        used: set[int] = set()
        for i, e in enumerate(slab.entries):
            if not e.trainable:
                continue
            layout = self.packed.get((slab.index, i))
            if layout is None:
                return [Region.exp_avg, Region.exp_avg_sq]
            used.update(layout.regions)
        return [k for r, k in enumerate((Region.exp_avg, Region.exp_avg_sq)) if r in used]

    def _update(self, slab: Slab, pend: _Pending) -> None:
        kinds = [Region.master, *self._state_kinds(slab)]
        with self.store.hold(slab.index, kinds, write=True) as w, self.store.hold(slab.index, [Region.grad_accum]) as r:
            master, acc = w[Region.master], r[Region.grad_accum]
            if pend.grad_ops:
                self._apply_ops(slab, acc, pend.grad_ops)
            by_group = self._entries_by_group(slab, pend)
            if not by_group:
                return
            views = {i: slab.view(master, i) for idx in by_group.values() for i in idx}
            for i, p in views.items():
                p.grad = slab.view(acc, i)
            groups = [(pend.hyper[gi], [views[i] for i in idx]) for gi, idx in by_group.items()]
            regions = (w.get(Region.exp_avg), w.get(Region.exp_avg_sq)) if self.on_disk else None
            live = {i: self._live_state(slab, i, regions) for i in views}
            inst = self._slab_instance(slab.index, tuple((gi, tuple(idx)) for gi, idx in by_group.items()), groups,
                                       fresh=any(st is None for st in live.values()))
            for i, p in views.items():
                if live[i] is not None:
                    inst.state[p] = live[i]
            try:
                inst.step()
                for i, p in views.items():
                    st = inst.state.get(p)
                    if st:
                        self._keep_state(slab, i, st, regions)
                    elif regions is not None:  # no state (SGD without momentum): nothing to place on disk
                        self.packed.setdefault((slab.index, i), Layout((), {}, ()))
            finally:
                inst.state.clear()
                for g in inst.param_groups:
                    g["params"] = []
                for p in views.values():
                    p.grad = None

    def _live_state(self, slab: Slab, entry: int, regions: tuple[torch.Tensor, torch.Tensor] | None,
                    copy: bool = False) -> dict[str, Any] | None:
        """One parameter's state for the class's ``state`` (``None``: first update): the kept dict (RAM tier), or
        the 0-d values plus the packed tensors rebuilt around views (``copy``: copies) of ``regions`` (NVMe tier)."""
        st = self.state.get((slab.index, entry))
        if st is None or regions is None:
            return st
        layout = self.packed[(slab.index, entry)]
        base = slab.entries[entry].offset
        out = {**st, **rebuild(layout, lambda pl: pl.view(regions, base).clone() if copy else pl.view(regions, base))}
        return {k: out[k] for k in layout.order}

    def _keep_state(self, slab: Slab, entry: int, st: dict[str, Any],
                    regions: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Keep one parameter's state after its update: the dict (RAM tier), or its tensors copied into their packed
        ranges (unless updated there in place) and its 0-d values (NVMe tier).

        Raises:
            UnsupportedOptimizerError: NVMe tier, the state does not pack (:func:`unpackable`).
        """
        key = (slab.index, entry)
        if regions is None:
            self.state[key] = st
            return
        e = slab.entries[entry]
        layout = self.packed.get(key)
        tensors, _ = leaves(st)
        if layout is None or ([(pl.key, pl.shape, pl.dtype) for pl in layout.placements]
                               != [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]):
            why = unpackable(st, e.numel)
            if why:
                raise UnsupportedOptimizerError(
                    f"megatrain keeps the state of {_name(self.optimizer)} on NVMe in two fp32 values per parameter "
                    f"element; for {e.ref.fqn} it {why}. Keep the optimizer state in RAM (offload_optimizer='cpu').")
            layout = self.packed[key] = pack(st, e.numel)
        for pl in layout.placements:
            view = pl.view(regions, e.offset)
            v = tensors[pl.key]
            if v.data_ptr() != view.data_ptr():
                view.copy_(v)
        self.state[key] = {k: v for k, v in st.items() if not packed_kind(v)}

    def _count_steps(self, slab: Slab) -> None:
        """Another rank updated this slab (data parallel): its state lives there, nothing to count here."""

    # ------------------------------------------------------------------ state
    def state_for(self, slab_index: int, entry: int) -> dict[str, Any] | None:
        """The class's state of one parameter (``None``: no update yet, or another process owns its slab): live
        tensors (RAM tier) or copies read through the window (NVMe tier)."""
        st = self.state.get((slab_index, entry))
        if st is None or not self.on_disk:
            return st
        slab = self.store.slabs[slab_index]
        with self.store.hold(slab_index, [Region.exp_avg, Region.exp_avg_sq]) as t:
            return self._live_state(slab, entry, (t[Region.exp_avg], t[Region.exp_avg_sq]), copy=True)

    def streams_state(self) -> bool:
        """Whether the state cannot be returned as one dict (NVMe tier, or data parallel)."""
        return self.on_disk or (self.ownership is not None and
                                not all(map(self.ownership.owns, range(len(self.store.slabs)))))

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """As :meth:`HostAdamW.state_dict`, in the class's own format.

        Raises:
            RuntimeError: data parallel (each process holds only its own slabs' state).
        """
        own = self.ownership
        if own is not None and not all(map(own.owns, range(len(self.store.slabs)))):
            raise RuntimeError(
                f"megatrain: optimizer.state_dict() is not available with several processes and "
                f"{_name(self.optimizer)}: each rank keeps the state of the blocks it updates. Save a directory "
                "checkpoint (trainer.save_checkpoint(dir), on every rank): its optimizer/ folder holds the whole "
                "state in the class's format.")
        return super().state_dict(copy=copy)

    @staticmethod
    def _check_saved_keys(keys: set[str]) -> None:
        """Any keys: the class's ``step`` reads what it finds."""

    @staticmethod
    def _holds_state(entry: dict[str, Any]) -> bool:
        return bool(entry)

    def set_param_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Set one parameter's state from a ``state_dict()`` entry of the user's class, converted as
        ``torch.optim.Optimizer.load_state_dict`` does: floating tensors but ``step`` become fp32 CPU copies, other
        values are kept (tensors copied to the CPU).

        Raises:
            ValueError: ``param`` is not in the store.
        """
        if id(param) not in self._where:
            raise ValueError("set_param_state: parameter is not part of the host store.")
        si, ei = self._where[id(param)]
        if self.ownership is not None and not self.ownership.owns(si):
            return  # data parallel: the state lives in the process that owns (updates) this slab
        out: dict[str, Any] = {}
        for k, v in state.items():
            if is_traceable_wrapper_subclass(v):  # torchao's 8-bit moments: copies of its inner tensors, its own dtypes
                v = copy_tensor(v.to("cpu"))
            elif torch.is_tensor(v):
                v = v.detach().to("cpu", dtype=torch.float32 if v.is_floating_point() and k != "step" else v.dtype,
                                  copy=True)
            out[k] = v
        slab = self.store.slabs[si]
        with slab.lock:
            self.pending.pop(si, None)
            if not self.on_disk:
                self.state[(si, ei)] = out
                return
            self.packed.pop((si, ei), None)
            with self.store.hold(si, [Region.exp_avg, Region.exp_avg_sq], write=True) as t:
                self._keep_state(slab, ei, out, (t[Region.exp_avg], t[Region.exp_avg_sq]))

    def forget_param_state(self, param: torch.Tensor) -> None:
        """Drop one parameter's state: its next update is the class's first (state created afresh)."""
        where = self._where.get(id(param))
        if where is not None:
            self.state.pop(where, None)
            self.packed.pop(where, None)
