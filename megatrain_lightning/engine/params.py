"""Access to parameters the engine owns. A parameter's value is its fp32 master in the host store (RAM slab or
NVMe file), possibly with a deferred AdamW update pending; every read or write of a weight outside a block call
goes through :class:`ParamAccess`.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..optim.host_adamw import HostAdamW
from ..optim.state_packing import flatten_named
from ..store.host import HostStore, is_nvme_placeholder
from ..store.regions import Region


class ParamAccess:
    """Read and write parameters' fp32 masters (in ``store``, either tier); materialize them after a run."""

    def __init__(self, store: HostStore):
        self.store = store
        self.optimizer: HostAdamW | None = None  # its pending update of a slab: applied before a read, dropped before a write
        self.materialized = False
        self.summoned: set[int] = set()  # id(param) of the parameters :meth:`summon` gave real weights (nesting)

    def read(self, p: torch.Tensor) -> torch.Tensor:
        """The current fp32 value of ``p`` (pending updates applied): a view of the RAM slab, or a copy read
        through the NVMe window when masters are on disk.

        Raises:
            KeyError: ``p`` is not a parameter of the streamed module.
        """
        si, ei = self.store.locate(p)
        opt = self.optimizer
        if opt is not None:
            opt.apply_pending(si)
        slab = self.store.slabs[si]
        with self.store.hold(si, [Region.master]) as t:
            v = slab.view(t[Region.master], ei)
            return v.clone() if self.store.masters_on_disk else v

    def write(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``p``'s master to ``value`` (same shape, any float dtype). Data parallel with masters on disk:
        only the slab's owner writes, so every rank must write the same values, and the node's ranks then meet
        (``NodeStore.weights_written``) before anyone reads them.

        Raises:
            KeyError: ``p`` is not a parameter of the streamed module.
            ValueError: shapes differ.
        """
        si, ei = self.store.locate(p)
        slab = self.store.slabs[si]
        if tuple(value.shape) != tuple(slab.entries[ei].shape):
            raise ValueError(f"{slab.entries[ei].ref.fqn}: value has shape {tuple(value.shape)}, "
                             f"parameter {tuple(slab.entries[ei].shape)}.")
        if self.store.master_is_remote(si):
            return  # data parallel, masters on disk: its owner writes the same value (every rank writes alike)
        opt = self.optimizer
        if opt is not None:
            opt.pending.pop(si, None)
        with slab.lock, self.store.hold(si, [Region.master], write=True) as t, torch.no_grad():
            slab.wait_reads()  # an H2D copy (a prefetch) may still read the master
            slab.view(t[Region.master], ei).copy_(value)
            slab.updated()  # invalidates the bf16/fp16 wire image

    def _is_store_data(self, slab, i: int, data: torch.Tensor) -> bool:
        """Whether ``data`` is what the store made entry ``i``'s ``.data``: the master's view in the RAM slab, or
        the store's placeholder when masters are on disk."""
        if self.store.masters_on_disk:
            return self.store.is_placeholder(data) and tuple(data.shape) == tuple(slab.entries[i].shape)
        mv = slab.master_view(i)
        return (data.data_ptr() == mv.data_ptr() and data.dtype == mv.dtype and data.device == mv.device
                and data.shape == mv.shape and data.stride() == mv.stride())

    def replaced(self) -> list[tuple[int, int]]:
        """``(slab, entry)`` of every parameter whose ``.data`` is no longer the store's (``param.data = tensor``,
        or another Trainer's engine took the module), one pointer comparison each. Parameters inside an open
        :meth:`summon` are left out, and all while :meth:`materialize`'d: those are written back when that ends."""
        if self.materialized:
            return []
        return [(slab.index, i) for slab in self.store.slabs for i, e in enumerate(slab.entries)
                if id(e.ref.param) not in self.summoned and not self._is_store_data(slab, i, e.ref.param.data)]

    def adopt(self, found: list[tuple[int, int]]) -> list[str]:
        """Write the current ``.data`` of each :meth:`replaced` parameter into its master (:meth:`write`) and
        point ``.data`` back at the store; returns their names. The caller flushes pending updates first (the
        assigned value comes after the step).

        Raises:
            ValueError: a replacement has another shape than the parameter (the store's layout is fixed).
            RuntimeError: a replacement is another store's placeholder (no values to take).
        """
        names = []
        for si, i in found:
            slab = self.store.slabs[si]
            e = slab.entries[i]
            d = e.ref.param.data
            if is_nvme_placeholder(d):
                raise RuntimeError(
                    f"megatrain: parameter {e.ref.fqn} holds no weights: its .data is the placeholder of another "
                    "Trainer's NVMe store (that run ended without enough host RAM to give the module its weights "
                    "back). Continue with that Trainer, or load its checkpoint into the module before using this one.")
            self.write(e.ref.param, e.ref.param.data)
            e.ref.param.data = self.store.placeholder(si, i) if self.store.masters_on_disk else slab.master_view(i)
            names.append(e.ref.fqn)
        return names

    def materialize(self) -> None:
        """Masters on disk, after a run: give every parameter a real fp32 copy (4 bytes/param of host memory) so
        the module works on its own; undone by :meth:`dematerialize`."""
        if not self.store.masters_on_disk or self.materialized:
            return
        self.store.placeholder_writes()  # their values start NaN again when the placeholders come back
        nvme = self.store.nvme
        nvme.drop_clean()  # the copies replace the window, not add to it
        for slab in self.store.slabs:
            for e in slab.entries:
                e.ref.param.data = self.read(e.ref.param).clone()
            nvme.discard(slab.index, Region.master)  # read through the window, not kept in it
        self.materialized = True

    def write_back_materialized(self) -> None:
        """Copy the materialized parameters (possibly changed by the user) into the store, which checkpoints
        read; a no-op unless :meth:`materialize` ran."""
        if not self.materialized:
            return
        for slab in self.store.slabs:
            for e in slab.entries:
                self.write(e.ref.param, e.ref.param.data)

    def dematerialize(self) -> None:
        """Before the engine owns the module again: write materialized weights back, then point the
        parameters at their 4-byte placeholders."""
        if not self.materialized:
            return
        self.write_back_materialized()
        for slab in self.store.slabs:
            for i, e in enumerate(slab.entries):
                e.ref.param.data = self.store.placeholder(slab.index, i)
        self.materialized = False

    def placeholder_writes(self) -> list[str]:
        """Names of the parameters written in place while their masters were on disk (the write went into the
        placeholder, not the weights: :meth:`HostStore.placeholder_writes`); empty in the RAM tier."""
        if not self.store.masters_on_disk or self.materialized:
            return []
        return [self.store.slabs[si].entries[i].ref.fqn for si, i in self.store.placeholder_writes()]

    def summon(self, params: list[nn.Parameter], private: bool = False) -> list[nn.Parameter]:
        """Give each streamed parameter of ``params`` a real fp32 copy of its master as ``.data`` (pending updates
        applied), with masters on disk or with ``private`` (data parallel: the RAM masters are shared by the node,
        so an edit made on every rank would land once per rank). Returns those parameters, for :meth:`unsummon`;
        the others (not streamed, already summoned, RAM tier without ``private``) keep their ``.data``."""
        if self.materialized or not (self.store.masters_on_disk or private):
            return []
        done = []
        try:
            for p in params:
                loc = self.store.index.get(id(p))
                if loc is None or id(p) in self.summoned or not self._is_store_data(self.store.slabs[loc[0]], loc[1], p.data):
                    continue
                p.data = self.read(p).clone()
                done.append(p)
                self.summoned.add(id(p))
        except BaseException:
            self.unsummon(done, writeback=False)
            raise
        return done

    def unsummon(self, summoned: list[nn.Parameter], writeback: bool) -> None:
        """Undo :meth:`summon`; with ``writeback``, each parameter's current ``.data`` is written into its master
        first."""
        try:
            if writeback:
                for p in summoned:
                    self.write(p, p.data)
        finally:
            for p in summoned:
                si, i = self.store.locate(p)
                slab = self.store.slabs[si]
                p.data = self.store.placeholder(si, i) if self.store.masters_on_disk else slab.master_view(i)
                self.summoned.discard(id(p))

    # ------------------------------------------------------------------ checkpoints
    def reader(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function giving the current value of a module tensor for a checkpoint: the tensor itself (detached)
        with masters in RAM, else for a parameter a copy read through a :class:`_OneSlabWindow` (read in slab
        order, a save needs one slab plus one shard of host memory)."""
        if not self.store.masters_on_disk:
            return lambda t: t.detach()
        window = _OneSlabWindow(self.store)

        def read(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, nn.Parameter):
                window.touch(t)
                return self.read(t)
            return t.detach()
        return read

    def named_optimizer_state(self, module: nn.Module, keep: Callable[[nn.Parameter], bool] | None = None
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """``("<param name>/<state key>", tensor)`` for every parameter of ``module`` with optimizer state, in
        parameter order, through a :class:`_OneSlabWindow` (AdamW: ``exp_avg``, ``exp_avg_sq`` fp32 of the
        parameter's shape, ``step`` a 0-d fp32 tensor; other optimizers: their tensors, a 1-element ``step`` as 0-d;
        a tensor subclass as its inner tensors, :func:`~..optim.state_packing.flatten_named`). ``keep``: only the
        parameters it accepts (data parallel: the slabs this process owns).

        Raises:
            TypeError: a state value that is not a tensor (a directory checkpoint stores tensors only)."""
        opt = self.optimizer
        if opt is None:
            return
        window = _OneSlabWindow(self.store)
        for name, p in module.named_parameters():
            if keep is not None and not keep(p):
                continue
            window.touch(p)
            st = opt.param_state(p)
            if st is None:
                continue
            for k in [k for k in ("exp_avg", "exp_avg_sq", "step") if k in st] + \
                    [k for k in st if k not in ("exp_avg", "exp_avg_sq", "step")]:
                v = st[k]
                if not torch.is_tensor(v):
                    raise TypeError(f"megatrain: the optimizer state {k!r} of {name} is a {type(v).__name__}, not a "
                                    "tensor; a directory checkpoint stores tensors only.")
                yield from flatten_named(f"{name}/{k}", v.reshape(()) if k == "step" and v.numel() == 1 else v)


class _OneSlabWindow:
    """NVMe tier: while a checkpoint reads parameters and AdamW states (in slab order), keep only the
    current slab's regions in the host window."""

    def __init__(self, store: HostStore):
        self.store, self.last = store, None
        if store.nvme is not None:
            store.nvme.drop_clean()  # what training left cached goes first

    def touch(self, p: torch.Tensor) -> None:
        nvme = self.store.nvme
        if nvme is None:
            return
        si = self.store.locate(p)[0]
        if self.last is not None and self.last != si:
            for kind in (Region.master, Region.exp_avg, Region.exp_avg_sq):
                nvme.discard(self.last, kind)
        self.last = si
