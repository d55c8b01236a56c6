"""AdamW / Adam on the host, one slab at a time, with the implementation the user's optimizer selects.

The user's ``torch.optim.AdamW`` (or ``Adam``) stays the optimizer Lightning sees: its ``param_groups`` are read
at every step, its ``step`` never runs. The update is :func:`torch.optim.adam.adam` (what ``torch.optim.AdamW.step``
calls) over views of the slab's master, accumulator and fp32 moments: Loshchilov & Hutter, "Decoupled Weight Decay
Regularization", Algorithm 2; bias correction of Kingma & Ba, "Adam", Algorithm 1.

Kernel: the user's group's ``fused`` / ``foreach`` flags; with neither, torch's CPU default (the for-loop, so a CPU
run is bitwise plain ``torch.optim.AdamW``), except on a CUDA run, where no host kernel reproduces the CUDA one and
the fused CPU kernel is the fastest (fused 1.9 G params/s, for-loop 0.72, foreach 0.02 on 2 threads;
docs/internals/fidelity.md, "Costs").

Schedule: :meth:`step` snapshots every group's hyper-parameters and records a pending update per slab, applied
before the slab's next H2D copy (:meth:`apply_pending`, under the slab's lock), on the update worker
(:meth:`start_updates`, :meth:`apply_now`), or at once without overlap. Clipping is recorded and applied inside each
slab's update, so the NVMe tier reads each accumulator once per step. docs/architecture.md, "Host optimizer".
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.optim.adam import adam as _functional_adam
from torch.optim.optimizer import _default_to_fused_or_foreach

from ..store.host import HostStore, Slab
from ..store.shared import SlabOwnership
from ..store.regions import Region
from .state_packing import copy_tensor

SUPPORTED = "torch.optim.AdamW and torch.optim.Adam (amsgrad=False, maximize=False)"


class UnsupportedOptimizerError(TypeError):
    """The optimizer returned by ``configure_optimizers`` cannot run on the host slabs."""


@dataclass
class _GroupHyper:
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    foreach: bool | None = None  # the param group's flags (None: not set), see HostAdamW.implementation
    fused: bool | None = None


@dataclass
class _Pending:
    hyper: list[_GroupHyper]
    grad_ops: list[tuple[str, Any]]  # ("mul", 0-dim tensor) | ("clamp", float), applied in order


WRITTEN_WHILE_PENDING = (
    "megatrain: a parameter ({name}, or another of its block) was written in place after optimizer.step() while "
    "that step's update was still pending (overlap_optimizer=True runs each block's update on a host thread until "
    "the next forward fetches it): plain PyTorch would have written the updated weights, this run wrote the old "
    "ones. Call "
    "trainer.strategy.flush() before writing weights in hooks that run after the step (on_train_batch_end, "
    "on_train_batch_start, an optimizer_step override after optimizer.step()), or set overlap_optimizer=False.")


class HostAdamW:
    """Host-side AdamW over the slabs of a :class:`HostStore`.

    Args:
        store: the slabs holding master weights and gradient accumulators.
        optimizer: the user's ``torch.optim.AdamW``/``Adam``; its ``param_groups`` are the source
            of truth for hyper-parameters and group membership.
        overlap: defer each slab's update until the engine next reads that slab (default), or
            apply all updates inside :meth:`step`.
        transport: the engine's device transport (its ``device`` picks the kernel), or ``None``.
        ownership: data parallel with a node-shared store (``store/shared.py``): this process updates only
            the slabs it owns and waits for the owners' updates of the others; norms and the fp16 inf check
            are all-reduced over the node. ``None``: one process, every slab.
        worker: an executor the updates run on (RAM tier), or ``None``: each update runs on the thread that
            needs it (the H2D worker before a copy, the D2H worker in backward; the NVMe window is sized
            for one update at a time).

    State per trainable parameter: ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape, views of one
    flat tensor per slab) and ``step`` (fp32 scalar tensor), as ``torch.optim.AdamW`` keeps them.

    Raises:
        UnsupportedOptimizerError: see :meth:`_validate`.
    """

    def __init__(self, store: HostStore, optimizer: torch.optim.Optimizer, overlap: bool = True, transport: Any = None,
                 ownership: SlabOwnership | None = None, worker: Executor | None = None):
        self.decoupled = self._validate(optimizer)
        self.ownership = ownership
        self.store = store
        self.optimizer = optimizer
        self.overlap = overlap
        self.on_disk = Region.exp_avg in store.nvme_kinds  # optimizer state on NVMe
        self._where = store.index
        self.group_of: list[list[int]] = []  # group of each (slab, entry); -1 = not optimized
        self._group_members: list[list[int]] | None = None  # ids of each group's parameters when last mapped
        self._map_groups()
        self.steps: list[list[torch.Tensor | None]] = [[None] * len(s.entries) for s in store.slabs]
        self.pending: dict[int, _Pending] = {}
        # slab -> (the deferred update, its parameters' version counters when it was deferred)
        self._versions: dict[int, tuple[_Pending, int]] = {}
        self.grad_ops: list[tuple[str, Any]] = []  # clipping recorded for the coming step
        self.updates_in_backward = 0  # slab updates applied during backward (optimizer_in_backward)
        self.optimizer_seconds = 0.0
        self._seconds_lock = threading.Lock()
        self.transport = transport
        self._worker = worker
        self._jobs: list[Future] = []  # updates submitted to the worker, not yet waited for (flush)
        self._errors: dict[int, BaseException] = {}  # slab -> the error its update raised on the worker
        self._jobs_lock = threading.Lock()
        self._claimed: set[int] = set()  # slabs whose update of the coming step() was scheduled in backward

    @staticmethod
    def _validate(optimizer: torch.optim.Optimizer) -> bool:
        """Check that the host AdamW kernel can step ``optimizer``; return ``True`` for decoupled weight decay (AdamW).
        Other optimizers run their own step (``optim/host_generic.py``).

        Raises:
            UnsupportedOptimizerError: another optimizer class, or ``amsgrad``/``maximize``/``differentiable`` set.
        """
        if type(optimizer) is torch.optim.AdamW:
            decoupled = True
        elif type(optimizer) is torch.optim.Adam:
            decoupled = bool(optimizer.defaults.get("decoupled_weight_decay", False))
        else:
            raise UnsupportedOptimizerError(
                f"the host AdamW kernel steps {SUPPORTED}; got "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__} (other optimizers run their own step on "
                "the host: megatrain_lightning.optim.host_generic.make_host_optimizer)."
            )
        for i, g in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "maximize", "differentiable"):
                if g.get(key, False):
                    raise UnsupportedOptimizerError(
                        f"param_groups[{i}] sets {key}=True, which the host AdamW kernel ({SUPPORTED}) does not "
                        f"implement. Set {key} in configure_optimizers' param groups (the optimizer then runs its own "
                        "step on the host) rather than in a group added during fit."
                    )
        return decoupled

    # ------------------------------------------------------------------ schedule
    def set_overlap(self, overlap: bool) -> None:
        """``True``: defer each slab's update to just before its next H2D copy (``overlap_optimizer``)."""
        self.overlap = overlap

    def _map_groups(self) -> None:
        """Map each (slab, entry) to its param group, again whenever the groups' members changed (e.g.
        ``BaseFinetuning``'s ``add_param_group``; a new parameter's state starts at zero). One pass over the
        groups' parameter ids per step.

        Raises:
            UnsupportedOptimizerError: a parameter that is not in the store, or a group with an unsupported flag.
        """
        members = [list(map(id, g["params"])) for g in self.optimizer.param_groups]
        if members == self._group_members:
            return
        if self._group_members is not None:
            self._validate(self.optimizer)
        group_of = [[-1] * len(s.entries) for s in self.store.slabs]
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                if id(p) not in self._where:
                    raise UnsupportedOptimizerError(
                        "The optimizer holds a parameter that is not part of the LightningModule; "
                        "build it from self.parameters() (or a subset) in configure_optimizers."
                    )
                si, ei = self._where[id(p)]
                group_of[si][ei] = gi
        self.group_of, self._group_members = group_of, members

    def _snapshot(self) -> list[_GroupHyper]:
        out = []
        for g in self.optimizer.param_groups:
            lr = g["lr"].detach().clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
            beta1, beta2 = g["betas"]
            decoupled = bool(g.get("decoupled_weight_decay", self.decoupled))  # torch reads each group's own flag
            out.append(_GroupHyper(lr, float(beta1), float(beta2), float(g["eps"]), float(g["weight_decay"]), decoupled,
                                   foreach=g.get("foreach"), fused=g.get("fused")))
        return out

    def step(self) -> int:
        """Record (or, without overlap, apply) one update for every slab that received gradients, once all of
        the window's gradients are in the accumulators. Returns the number of slabs scheduled."""
        hyper = self.snapshot()
        self.grad_ops = []
        # torch.optim.lr_scheduler.LRScheduler.step checks this flag; the user's optimizer's own step never runs
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        n = 0
        claimed, self._claimed = self._claimed, set()
        for slab in self.store.slabs:
            if slab.index in claimed:  # this step's update was scheduled in backward (apply_now)
                n += 1
                continue
            if slab.index in self.pending:
                self.apply_pending(slab.index)
            if slab.grad_accum_empty:
                continue
            self.pending[slab.index] = hyper
            self._versions[slab.index] = (hyper, slab.param_versions())
            n += 1
        if not self.overlap:
            self.flush()
        return n

    def snapshot(self) -> _Pending:
        """The update the coming :meth:`step` would record, for updates applied during backward."""
        self._map_groups()
        return _Pending(self._snapshot(), list(self.grad_ops))

    def apply_now(self, slab_index: int, pend: _Pending) -> None:
        """Schedule one slab's update of this step now that its gradients are complete (optimizer step in
        backward): on the update worker if any, else here; :meth:`step` then skips the slab."""
        slab = self.store.slabs[slab_index]
        with slab.lock:
            if slab.grad_accum_empty or slab_index in self._claimed:
                return
            if slab_index in self.pending:  # the previous step's deferred update comes first
                self.apply_pending(slab_index)
            self.pending[slab_index] = pend
            self._versions[slab_index] = (pend, slab.param_versions())
            self.updates_in_backward += 1
            if self._worker is None:
                self.apply_pending(slab_index)
                return
            self._claimed.add(slab_index)
        self._submit(slab_index)

    def start_updates(self, order: Iterable[int]) -> None:
        """Hand the pending updates to the update worker, those in ``order`` (the forward's fetch order) first
        (no-op without a worker)."""
        if self._worker is None or not self.pending:
            return
        for si in dict.fromkeys([*order, *sorted(self.pending)]):
            if si in self.pending:
                self._submit(si)

    def _submit(self, slab_index: int) -> None:
        assert self._worker is not None
        fut = self._worker.submit(self._job, slab_index)
        with self._jobs_lock:
            self._jobs = [f for f in self._jobs if not f.done()] + [fut]

    def _job(self, slab_index: int) -> None:
        """Update worker: apply the slab's update if still pending; an error is recorded under the slab's lock
        (so a fetch waiting for it sees it) for :meth:`apply_pending` and :meth:`flush`."""
        with self.store.slabs[slab_index].lock:
            try:
                self._apply(slab_index)
            except BaseException as e:
                with self._jobs_lock:
                    self._errors.setdefault(slab_index, e)

    def _wait_jobs(self) -> None:
        """Wait for every update submitted to the worker (their errors stay recorded)."""
        with self._jobs_lock:
            jobs, self._jobs = self._jobs, []
        for f in jobs:
            f.result()

    def _raise_error(self, slab_index: int | None = None) -> None:
        """Raise the error an update of the worker raised (of ``slab_index``, or of any slab), once."""
        with self._jobs_lock:
            if slab_index is not None:
                err = self._errors.pop(slab_index, None)
            else:
                err = next(iter(self._errors.values()), None)
                self._errors.clear()
        if err is not None:
            raise err

    def flush(self) -> None:
        """Apply every pending update now, wait for those the update worker is running, and raise the first error
        one of them raised."""
        for si in list(self.pending):
            self.apply_pending(si)
        self._wait_jobs()
        self._raise_error()

    def has_pending(self) -> bool:
        """Whether an update is pending or still running on the update worker."""
        with self._jobs_lock:
            running = any(not f.done() for f in self._jobs) or bool(self._errors)
        return bool(self.pending) or running

    def drop_pending(self) -> None:
        """Forget every pending update without applying it (a loaded checkpoint replaces its inputs), each under
        its slab's lock; updates the worker is running end first, and their errors are forgotten."""
        for si in list(self.pending):
            with self.store.slabs[si].lock:
                self.pending.pop(si, None)
        self._claimed.clear()
        self._wait_jobs()
        with self._jobs_lock:
            self._errors.clear()

    def apply_pending(self, slab_index: int) -> None:
        """Apply one slab's pending update (thread-safe; no-op if none), or wait for the worker's and raise its error.

        Raises:
            RuntimeError: a parameter of the slab was written in place while its update was pending.
        """
        self._apply(slab_index)
        if self._worker is not None:
            self._raise_error(slab_index)

    def _apply(self, slab_index: int) -> None:
        """Apply the slab's pending update, if any."""
        slab = self.store.slabs[slab_index]
        own = self.ownership
        with slab.lock:
            pend = self.pending.pop(slab_index, None)
            if pend is None:
                return
            deferred = self._versions.pop(slab_index, None)
            if deferred is not None and deferred[0] is pend and deferred[1] != slab.param_versions():
                raise RuntimeError(WRITTEN_WHILE_PENDING.format(name=slab.entries[0].ref.fqn))
            t0 = time.perf_counter()
            if own is not None and not own.owns(slab_index):
                own.wait(slab_index)  # its owner wrote the shared master and moments; count the steps
                self.store.master_changed_elsewhere(slab_index)  # masters on disk: a copy held here is stale
                self._count_steps(slab)
                slab.updated()
                slab.clear_grads()
                return
            slab.wait_reads()  # an H2D copy may still read the master
            self._update(slab, pend)
            if own is not None:
                self.store.master_published(slab_index)  # masters on disk: written before the others read it
                own.published(slab_index)
            slab.updated()
            slab.clear_grads()
            self.store.discard_grad_accum(slab_index)
            with self._seconds_lock:  # the update worker and a fetch may update different slabs at once
                self.optimizer_seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        """Seconds spent in AdamW updates since the last call (any thread), and reset the count to 0."""
        with self._seconds_lock:
            sec, self.optimizer_seconds = self.optimizer_seconds, 0.0
        return sec

    def discard_grads(self) -> None:
        """Forget accumulated gradients that no step consumed (``optimizer.zero_grad()`` semantics)."""
        self.grad_ops = []
        for slab in self.store.slabs:
            with slab.lock:
                if slab.index not in self.pending:
                    slab.clear_grads()
                    self.store.discard_grad_accum(slab.index)

    # ------------------------------------------------------------------ loss scaling
    def unscale_(self, inv_scale: float) -> bool:
        """fp16 loss scaling: multiply every accumulated gradient by ``inv_scale`` in place, slab by slab, as
        ``torch.amp.GradScaler.unscale_`` does. Returns ``True`` if any gradient is inf/NaN."""
        found_inf = torch.zeros(1)
        inv = torch.full((1,), inv_scale)
        for si, eis in self._owned_by_slab(self._grad_entries()).items():
            slab = self.store.slabs[si]
            with slab.lock, self.store.hold(si, [Region.grad_accum], write=True) as t:
                torch._amp_foreach_non_finite_check_and_unscale_([slab.view(t[Region.grad_accum], ei) for ei in eis], found_inf, inv)
        if self.ownership is not None:
            self.ownership.all_reduce(found_inf, "max")  # the same skip decision on every rank
        return bool(found_inf.item())

    # ------------------------------------------------------------------ clipping
    def _grad_entries(self) -> list[tuple[int, int]]:
        """(slab, entry) of every optimizer parameter holding a gradient of this step, in param-group order.

        A slab whose previous update is still pending (a layer skipped since) holds that step's gradients, not
        this one's, so it is left out (``param.grad`` would be ``None`` in plain PyTorch)."""
        out = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                si, ei = self._where[id(p)]
                slab = self.store.slabs[si]
                if (slab.entries[ei].trainable and not slab.grad_accum_empty and slab.has_grad[ei]
                        and si not in self.pending):
                    out.append((si, ei))
        return out

    def _owned_by_slab(self, items: list[tuple[int, int]]) -> dict[int, list[int]]:
        """The entries of ``items`` by slab, without the slabs another process owns (the owner unscales, norms and
        clips those in the shared accumulator)."""
        by_slab: dict[int, list[int]] = {}
        for si, ei in items:
            if self.ownership is None or self.ownership.owns(si):
                by_slab.setdefault(si, []).append(ei)
        return by_slab

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Total norm of the optimizer's accumulated gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it,
        reading each slab's accumulator once. Returns a 0-dim fp32 tensor."""
        items = self._grad_entries()
        norms: dict[tuple[int, int], torch.Tensor] = {}
        for si, eis in self._owned_by_slab(items).items():
            slab = self.store.slabs[si]
            with slab.lock, self.store.hold(si, [Region.grad_accum]) as t:
                for ei, n in zip(eis, torch._foreach_norm([slab.view(t[Region.grad_accum], ei) for ei in eis], norm_type)):
                    norms[(si, ei)] = n
        if not items:
            return torch.tensor(0.0)
        zero = torch.zeros((), dtype=torch.float32)
        stacked = torch.stack([norms.get(k, zero) for k in items])
        own = self.ownership
        if own is not None:  # each norm comes from its owner alone (the others add 0): exact, the same everywhere
            own.all_reduce(stacked, "sum")
        return torch.linalg.vector_norm(stacked, norm_type)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the host gradients: returns the total norm (0-dim fp32) and
        records the scale ``min(1, max_norm / (norm + 1e-6))`` for the coming step's updates.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is inf/NaN (nothing recorded), as torch's.
        """
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.grad_ops.append(("mul", coef))
        return total

    def clip_grad_value(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_``, recorded for the coming step's updates."""
        self.grad_ops.append(("clamp", float(clip_value)))

    def apply_grad_ops(self) -> None:
        """Apply the recorded clipping to the accumulators now, in place (each owner its own slabs), and forget
        it: the same numbers the updates would get, one extra pass, and ``param.grad`` then shows the clipped
        gradients, as with torch's in-place ``clip_grad_norm_``/``clip_grad_value_``."""
        ops, self.grad_ops = self.grad_ops, []
        if not ops:
            return
        for si in sorted(self._owned_by_slab(self._grad_entries())):
            slab = self.store.slabs[si]
            with slab.lock, self.store.hold(si, [Region.grad_accum], write=True) as t:
                self._apply_ops(slab, t[Region.grad_accum], ops)

    @staticmethod
    def _apply_ops(slab: Slab, acc: torch.Tensor, ops: list[tuple[str, Any]]) -> None:
        """Apply ``ops`` (see ``_Pending.grad_ops``) in order, in place, to the gradients in ``acc`` (the slab's flat
        fp32 accumulator) of every entry that got one; ``clamp`` clamps to ``[-v, v]``."""
        grads = [slab.view(acc, i) for i, e in enumerate(slab.entries) if e.trainable and slab.has_grad[i]]
        for op, val in ops:
            if not grads:
                break
            if op == "mul":
                torch._foreach_mul_(grads, val)
            else:
                torch._foreach_clamp_min_(grads, -val)
                torch._foreach_clamp_max_(grads, val)

    # ------------------------------------------------------------------ math
    def _flags(self, h: _GroupHyper) -> tuple[bool | None, bool | None]:
        """``(foreach, fused)`` for :func:`torch.optim.adam.adam`: the group's flags, or fused on a CUDA run with
        neither set (module docstring)."""
        device = getattr(self.transport, "device", None)
        if h.foreach is None and h.fused is None and device is not None and torch.device(device).type != "cpu":
            return None, True
        return h.foreach, h.fused

    def implementation(self, group: int = 0) -> str:
        """The kernel param group ``group``'s update runs: ``"fused"``, ``"foreach"`` or ``"for-loop"``."""
        foreach, fused = self._flags(self._snapshot()[group])
        if fused:
            return "fused"
        if foreach is None:  # torch's default for CPU parameters
            foreach = _default_to_fused_or_foreach([torch.empty(0)], False, False)[1]
        return "foreach" if foreach else "for-loop"

    @property
    def exp_avg(self) -> list[torch.Tensor | None]:
        """Per slab, the flat ``exp_avg`` (RAM tier; ``None`` before the first update)."""
        return [s.exp_avg for s in self.store.slabs]

    def _count_steps(self, slab: Slab) -> None:
        """Another rank applied this slab's update (shared store): advance the step counts as it would have."""
        for i, e in enumerate(slab.entries):
            if self.group_of[slab.index][i] >= 0 and e.trainable and slab.has_grad[i]:
                if self.steps[slab.index][i] is None:
                    self.steps[slab.index][i] = torch.tensor(0.0, dtype=torch.float32)
                self.steps[slab.index][i] += 1

    def _entries_by_group(self, slab: Slab, pend: _Pending) -> dict[int, list[int]]:
        """The slab's entries ``pend`` updates (trainable, with a gradient) by param group (a group added after the
        step is not in it)."""
        by_group: dict[int, list[int]] = {}
        for i, e in enumerate(slab.entries):
            gi = self.group_of[slab.index][i]
            if 0 <= gi < len(pend.hyper) and e.trainable and slab.has_grad[i]:
                by_group.setdefault(gi, []).append(i)
        return by_group

    def _update(self, slab: Slab, pend: _Pending) -> None:
        with self.store.hold(slab.index, [Region.master, Region.exp_avg, Region.exp_avg_sq], write=True) as w, \
                self.store.hold(slab.index, [Region.grad_accum]) as r:
            master, acc, m, v = w[Region.master], r[Region.grad_accum], w[Region.exp_avg], w[Region.exp_avg_sq]
            by_group = self._entries_by_group(slab, pend)
            if pend.grad_ops:
                self._apply_ops(slab, acc, pend.grad_ops)
            for gi, idx in by_group.items():
                h = pend.hyper[gi]
                params, grads, ms, vs = ([slab.view(t, i) for i in idx] for t in (master, acc, m, v))
                steps = self.steps[slab.index]
                for i, mi, vi in zip(idx, ms, vs):
                    if steps[i] is None:
                        # first update: state starts at zero, as torch.optim.AdamW creates it lazily; the store's
                        # moments may hold an earlier optimizer's state (a previous fit, lr_find)
                        steps[i] = torch.tensor(0.0, dtype=torch.float32)
                        mi.zero_()
                        vi.zero_()
                foreach, fused = self._flags(h)
                with torch.no_grad():
                    _functional_adam(params, grads, ms, vs, [], [steps[i] for i in idx], foreach=foreach, fused=fused,
                                     amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay,
                                     eps=h.eps, maximize=False, decoupled_weight_decay=h.decoupled)

    # ------------------------------------------------------------------ introspection
    def state_for(self, slab_index: int, entry: int) -> dict[str, torch.Tensor] | None:
        """The AdamW state of one parameter as ``torch.optim.AdamW`` would hold it, or ``None``.

        RAM tier: views of the live state. NVMe tier: copies read through the host window."""
        st = self.steps[slab_index][entry]
        if st is None:
            return None
        slab = self.store.slabs[slab_index]
        own = self.ownership
        if self.on_disk and own is not None and not own.owns(slab_index):
            raise RuntimeError(
                f"megatrain: the AdamW state of {slab.entries[entry].ref.fqn} is on the disk of rank "
                f"{own.global_rank_of(own.owner[slab_index])} (local rank {own.owner[slab_index]}; "
                "offload_optimizer='nvme' with several processes: each keeps the state of "
                "the blocks it updates). Read it on that rank, or from a directory checkpoint's optimizer/ folder.")
        with self.store.hold(slab_index, [Region.exp_avg, Region.exp_avg_sq]) as t:
            m, v = slab.view(t[Region.exp_avg], entry), slab.view(t[Region.exp_avg_sq], entry)
            return {"step": st, "exp_avg": m.clone() if self.on_disk else m,
                    "exp_avg_sq": v.clone() if self.on_disk else v}

    # ------------------------------------------------------------------ checkpoint
    def streams_state(self) -> bool:
        """Whether the state is on NVMe: a checkpoint then writes it slab by slab, never as one dict."""
        return self.on_disk

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """State in ``torch.optim.AdamW.state_dict()`` format (parameters numbered in param-group order).

        With ``copy=True`` the tensors are copies (8 bytes/param of host RAM while the dict lives);
        with ``copy=False`` they are views of the live state (no memory, but they change with training).

        Raises:
            RuntimeError: several processes with ``offload_optimizer="nvme"`` (each rank holds only its slabs' state).
        """
        own = self.ownership
        if own is not None and self.on_disk and not all(map(own.owns, range(len(self.store.slabs)))):
            raise RuntimeError(
                "megatrain: optimizer.state_dict() is not available with several processes and "
                "offload_optimizer='nvme': each rank keeps only the AdamW state of the blocks it updates, on its own "
                "disk. Save a directory checkpoint (trainer.save_checkpoint(dir), on every rank): its optimizer/ "
                "folder holds the whole state in torch.optim.AdamW format; or keep the optimizer state in RAM "
                "(offload_optimizer='cpu').")
        self.flush()
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        idx = 0
        for g in self.optimizer.param_groups:
            ids = []
            for p in g["params"]:
                st = self.state_for(*self._where[id(p)])
                if st is not None:
                    state[idx] = {k: (copy_tensor(v) if copy and torch.is_tensor(v) else v) for k, v in st.items()}
                ids.append(idx)
                idx += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW``/``Adam`` ``state_dict()`` (e.g. a Lightning checkpoint's
        ``optimizer_states[0]``) as ``torch.optim.Optimizer.load_state_dict`` would: group hyper-parameters replace
        the optimizer's; a parameter without saved state has none afterwards.

        Raises:
            ValueError: param groups of another number or size, another optimizer's state keys, or a state shape
                other than its parameter's.
        """
        groups, saved = self.optimizer.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved):
            raise ValueError(f"loaded state dict has {len(saved)} parameter groups, the optimizer {len(groups)}.")
        for i, (g, s) in enumerate(zip(groups, saved)):
            if len(g["params"]) != len(s["params"]):
                raise ValueError(f"loaded state dict's parameter group {i} has {len(s['params'])} parameters, the "
                                 f"optimizer's {len(g['params'])}.")
        state = state_dict["state"]
        self._check_saved_keys({k for st in state.values() for k in st})
        for s in saved:
            self._check_saved_group(s)
        self.flush()
        for g, s in zip(groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
            for p, idx in zip(g["params"], s["params"]):
                st = state.get(idx)
                if not st or not self._holds_state(st):
                    self.forget_param_state(p)
                    continue
                self.set_param_state(p, st)
        # as torch's load_state_dict ends: the class resets its group defaults (AdamW keeps decoupled_weight_decay)
        self.optimizer.__setstate__({"state": self.optimizer.state, "param_groups": self.optimizer.param_groups})

    @staticmethod
    def _holds_state(entry: dict[str, Any]) -> bool:
        """Whether a saved per-parameter entry holds state to load (else the parameter has none afterwards)."""
        return "exp_avg" in entry

    @staticmethod
    def _check_saved_keys(keys: set[str]) -> None:
        """Raise ``ValueError`` if saved per-parameter state has keys this optimizer does not keep."""
        other = sorted(keys - {"step", "exp_avg", "exp_avg_sq"})
        if other:
            raise ValueError(f"the saved optimizer state has {', '.join(other)}: not Adam/AdamW state (another "
                             "optimizer's, e.g. SGD's momentum_buffer, or amsgrad's max_exp_avg_sq); resume with the "
                             "optimizer that wrote it, or load only the weights.")

    def _check_saved_group(self, saved: dict[str, Any]) -> None:
        """Raise ``ValueError`` if a saved param group lacks a numeric hyper-parameter of this optimizer's
        ``defaults`` (SGD's ``momentum`` in AdamW's group): another optimizer wrote it, and torch's ``step`` would
        stop with a ``KeyError`` on it. Flags (``bool``/``None`` defaults) are left out: the class's
        ``__setstate__`` fills those, as for a checkpoint of an older torch."""
        numeric = (int, float, tuple, torch.Tensor)
        missing = sorted(k for k, v in self.optimizer.defaults.items()
                         if k not in saved and not isinstance(v, bool) and isinstance(v, numeric))
        if missing:
            raise ValueError(f"the saved param groups lack {', '.join(missing)}, hyper-parameters of "
                             f"{type(self.optimizer).__name__}: the checkpoint was written by another optimizer; "
                             "resume with the optimizer that wrote it, or load only the weights.")

    # ------------------------------------------------------------------ per-parameter access
    def set_param_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Set one parameter's state from a ``torch.optim.AdamW``-format entry (``exp_avg``, ``exp_avg_sq``: any float
        dtype, the parameter's shape; ``step``: a number or a 1-element tensor). With several processes and the state
        on NVMe only the slab's owner writes the moments (they are on its disk).

        Raises:
            ValueError: other keys (another optimizer's state), ``param`` not in the store, or a shape differs.
        """
        self._check_saved_keys(set(state))
        if "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
            raise ValueError(f"AdamW state needs exp_avg, exp_avg_sq and step; got {', '.join(sorted(state))}.")
        step = state["step"] if torch.is_tensor(state["step"]) else torch.tensor(float(state["step"]))
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        if id(param) not in self._where:
            raise ValueError("set_param_state: parameter is not part of the host store.")
        si, ei = self._where[id(param)]
        slab = self.store.slabs[si]
        e = slab.entries[ei]
        if tuple(exp_avg.shape) != tuple(e.shape) or tuple(exp_avg_sq.shape) != tuple(e.shape):
            raise ValueError(f"AdamW state of {e.ref.fqn} has shape {tuple(exp_avg.shape)}, parameter {tuple(e.shape)}.")
        self.pending.pop(si, None)
        own = self.ownership
        if own is None or own.owns(si) or not self.on_disk:
            with slab.lock, self.store.hold(si, [Region.exp_avg, Region.exp_avg_sq], write=True) as t:
                t[Region.exp_avg][e.offset : e.offset + e.numel].copy_(exp_avg.reshape(-1))
                t[Region.exp_avg_sq][e.offset : e.offset + e.numel].copy_(exp_avg_sq.reshape(-1))
        self.steps[si][ei] = step.detach().reshape(()).float().cpu().clone()

    def param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """AdamW state of ``param`` (views: ``exp_avg``, ``exp_avg_sq`` fp32 like the parameter,
        ``step`` fp32 scalar), or ``None`` if it never took a step."""
        where = self._where.get(id(param))
        return None if where is None else self.state_for(*where)

    def forget_param_state(self, param: torch.Tensor) -> None:
        """Drop the AdamW state of one parameter: its next update starts at step 0 with zero moments, as torch's
        ``load_state_dict`` leaves a parameter without a saved entry."""
        where = self._where.get(id(param))
        if where is not None:
            self.steps[where[0]][where[1]] = None

    def param_groups_meta(self, module: torch.nn.Module) -> list[dict[str, Any]]:
        """Param groups as plain data: hyper-parameters plus the parameter *names* of each group."""
        names = {id(p): n for n, p in module.named_parameters()}
        return [{**{k: v for k, v in g.items() if k != "params"}, "param_names": [names[id(p)] for p in g["params"]]}
                for g in self.optimizer.param_groups]

    def load_param_groups_meta(self, meta: list[dict[str, Any]] | None, module: torch.nn.Module,
                               rename: Callable[[str], str] | None = None) -> None:
        """Restore param-group hyper-parameters saved by :meth:`param_groups_meta`; ``rename`` maps a parameter name
        of ``module`` to its name in ``meta`` (default: the same).

        Raises:
            ValueError: the groups hold other parameters than the current optimizer's.
        """
        if not meta:
            return
        names = {id(p): (rename(n) if rename else n) for n, p in module.named_parameters()}
        if len(meta) != len(self.optimizer.param_groups):
            raise ValueError(f"Checkpoint has {len(meta)} param groups, the optimizer {len(self.optimizer.param_groups)}.")
        for g, m in zip(self.optimizer.param_groups, meta):
            if [names[id(p)] for p in g["params"]] != list(m["param_names"]):
                raise ValueError(
                    "Checkpoint param groups hold other parameters than the optimizer's: the checkpoint is of another "
                    "model or another grouping of its parameters, so its optimizer state cannot be resumed (a "
                    "non-strict load takes only weights). To start from its weights with a fresh optimizer, load them "
                    "alone and train without resuming: Trainer: from_pretrained on the checkpoint's model/ folder, "
                    "then fit without ckpt_path; Fabric: fabric.load(path, {'model': model}).")
            self._check_saved_group(m)
            g.update({k: v for k, v in m.items() if k != "param_names"})
