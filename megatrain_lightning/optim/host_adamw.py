"""AdamW / Adam on the host, one slab at a time, with the implementation the user's optimizer selects.

The user's ``torch.optim.AdamW`` (or ``Adam``) from ``configure_optimizers``
stays the optimizer Lightning sees: its ``param_groups`` are read at every
step (so LR schedulers and ``LearningRateMonitor`` work unchanged), but its
``step`` never runs. The update itself is :func:`torch.optim.adam.adam` (what
``torch.optim.AdamW.step`` calls) over views of the slab's master weights,
gradient accumulator and fp32 ``exp_avg`` / ``exp_avg_sq``: the math of
``torch.optim.AdamW`` (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization", Algorithm 2; bias correction of Kingma & Ba, "Adam",
Algorithm 1).

Implementation (docs/architecture.md, "Fidelity"): torch has three AdamW kernels (fused, foreach,
for-loop) that round differently in the last fp32 bit. The host update runs the one the user's
optimizer would run on these (host, CPU) parameters: its param group's ``fused`` / ``foreach`` flags,
and with neither set, torch's own default for CPU tensors, the for-loop, so that a CPU run is bitwise
the plain ``torch.optim.AdamW`` loop. With neither flag set on a CUDA run the host uses the fused CPU
kernel instead: the user's optimizer would run CUDA kernels there, which no host kernel reproduces bit
for bit, and the fused kernel is the fastest (measured here: fused 1.9 G params/s, for-loop 0.72,
foreach 0.02 on 2 threads; docs/internals/fidelity.md, "Costs"). Pass ``fused=True`` to get the fused
kernel on CPU as well.

Schedule (docs/architecture.md, "Host optimizer"): :meth:`step` snapshots the
hyper-parameters of every param group and records a *pending update* per slab;
slab j's update runs before block j is next copied to the device (overlapping the
next forward), or at once when ``overlap=False``. With an update worker (the RAM
tier: ``worker``, ``update_threads`` threads) the updates run on threads of their own: the deferred ones from
the start of the next forward (:meth:`start_updates`), those of ``optimizer_in_backward``
from the moment a slab's gradients are complete (:meth:`apply_now`), through the rest of
the backward and the next forward; a copy of block j waits only for slab j's update
(:meth:`apply_pending` takes the slab's lock, which the worker holds while it updates,
and runs the update itself if the worker has not reached it). Updates of different slabs
touch disjoint state, so the worker's threads and the fetches run them at once.
Skipped steps stay exact because they happen before :meth:`step` is called.
Gradient clipping (:meth:`clip_grad_norm`, :meth:`clip_grad_value`, called by the
precision plugin for Lightning's ``gradient_clip_val``) computes the global norm
slab by slab exactly as ``torch.nn.utils.clip_grad_norm_`` does and records the
scale; the scale (or the clamp) is applied to each slab's gradients inside that
slab's deferred update, so the NVMe tier reads each accumulator once per step.
:meth:`flush` applies everything still pending.
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


def validate_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Check that the host AdamW kernel can step ``optimizer``; return ``True`` for decoupled weight decay (AdamW).
    Other optimizers (and AdamW/Adam with ``amsgrad``/``maximize``) run their own step on the host instead
    (``optim/host_generic.py`` chooses when the optimizer is taken over).

    Raises:
        UnsupportedOptimizerError: another optimizer class, or ``amsgrad``/``maximize``/``differentiable`` set (a group
            added during fit to an optimizer the kernel took over: the message says to set it in
            ``configure_optimizers``).
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
                    f"param_groups[{i}] sets {key}=True, which the host AdamW kernel ({SUPPORTED}) does not implement. "
                    f"Set {key} in configure_optimizers' param groups (the optimizer then runs its own step on the "
                    "host) rather than in a group added during fit."
                )
    return decoupled


class HostAdamW:
    """Host-side AdamW over the slabs of a :class:`HostStore`.

    Args:
        store: the slabs holding master weights and gradient accumulators.
        optimizer: the user's ``torch.optim.AdamW``/``Adam``; its ``param_groups`` are the source
            of truth for hyper-parameters and group membership.
        overlap: defer each slab's update until the engine next reads that slab (default), or
            apply all updates inside :meth:`step`.
        transport: the engine's device transport (its ``device`` picks the kernel, see :meth:`_flags`),
            or ``None``. An update waits for the last H2D copy that reads the slab's master
            (``Slab.wait_reads``, under the slab's lock).
        ownership: data parallel with a node-shared store (``store/shared.py``): this process updates only
            the slabs it owns; for the others it waits for the owner's update and keeps the same bookkeeping
            (gradient flags, AdamW step counts). Clipping norms and the fp16 inf check combine the owners'
            parts with one all-reduce over the node. ``None``: one process, every slab.
        worker: an executor the updates run on (:meth:`start_updates`, :meth:`apply_now`; one or more threads,
            taking slabs in submission order), or ``None``:
            each update runs on the thread that needs it (the H2D worker before a copy, the D2H worker in
            backward). The engine passes one on the RAM tier; on the NVMe tier the host window is sized for one
            update at a time, on the thread that also reads the block.

    State per trainable parameter the optimizer owns: ``exp_avg`` and ``exp_avg_sq`` (fp32, same
    shape as the parameter, views of one flat tensor per slab) and ``step`` (fp32 scalar tensor, as
    ``torch.optim.AdamW`` keeps it).

    Raises:
        UnsupportedOptimizerError: see :func:`validate_optimizer`.
    """

    def __init__(self, store: HostStore, optimizer: torch.optim.Optimizer, overlap: bool = True, transport: Any = None,
                 ownership: SlabOwnership | None = None, worker: Executor | None = None):
        self.decoupled = self._validate(optimizer)
        self.ownership = ownership
        self.store = store
        self.optimizer = optimizer
        self.overlap = overlap
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
        self._jobs: list[Future] = []  # updates submitted to the worker, not yet waited for (drain)
        self._errors: dict[int, BaseException] = {}  # slab -> the error its update raised on the worker
        self._jobs_lock = threading.Lock()
        self._claimed: set[int] = set()  # slabs whose update of the coming step() was scheduled in backward

    @staticmethod
    def _validate(optimizer: torch.optim.Optimizer) -> bool:
        """Check that this kernel can step ``optimizer`` (at construction and whenever its groups change); return
        ``True`` for decoupled weight decay. Raises :class:`UnsupportedOptimizerError` (:func:`validate_optimizer`)."""
        return validate_optimizer(optimizer)

    # ------------------------------------------------------------------ schedule
    def set_overlap(self, overlap: bool) -> None:
        """``True``: defer each slab's update to just before its next H2D copy (``overlap_optimizer``)."""
        self.overlap = overlap

    def _map_groups(self) -> None:
        """Map each (slab, entry) to its param group in the optimizer's current ``param_groups``, again
        whenever their members changed since the last call (``add_param_group`` during fit, as Lightning's
        ``BaseFinetuning`` does when it unfreezes, or a group's ``params`` replaced; a new parameter's state starts
        at zero at its first update). Costs one pass over the groups' parameter ids per step.

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
            lr = g["lr"]
            if isinstance(lr, torch.Tensor):
                lr = lr.detach().clone()
            beta1, beta2 = g["betas"]
            decoupled = bool(g.get("decoupled_weight_decay", self.decoupled))  # torch reads each group's own flag
            out.append(_GroupHyper(lr, float(beta1), float(beta2), float(g["eps"]), float(g["weight_decay"]), decoupled,
                                   foreach=g.get("foreach"), fused=g.get("fused")))
        return out

    def step(self) -> int:
        """Record (or, without overlap, apply) one update for every slab that received gradients.

        Must run after all gradients of the accumulation window are in the accumulators.
        Returns the number of slabs scheduled.
        """
        self._map_groups()
        hyper = _Pending(self._snapshot(), self.grad_ops)
        self.grad_ops = []
        # LR schedulers check that optimizer.step() ran before scheduler.step() via this flag
        # (torch.optim.lr_scheduler.LRScheduler.step); the user's optimizer's own step never runs.
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
        """The update the coming :meth:`step` would record (hyper-parameters and clipping), for
        updates applied during backward."""
        self._map_groups()
        return _Pending(self._snapshot(), list(self.grad_ops))

    def apply_now(self, slab_index: int, pend: _Pending) -> None:
        """Schedule one slab's update of this step now (optimizer step in backward: its gradients are
        complete): on the update worker when there is one (the slab is pending until it runs; :meth:`step` then
        skips it), else applied here. :meth:`step` skips the slab either way."""
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
        """A forward that reads the weights starts: hand the pending updates to the update worker, slab indices in
        ``order`` (the order the forward fetches them) first, then the rest (no-op without a worker)."""
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
        """Update worker: apply the slab's update if still pending (a fetch that came first ran it: the worker and
        the fetches then update different slabs at once); an error is kept for the slab's next
        :meth:`apply_pending` and for :meth:`drain`, recorded under the slab's lock (a fetch waiting for the lock
        then sees it)."""
        with self.store.slabs[slab_index].lock:
            try:
                self._apply(slab_index)
            except BaseException as e:
                with self._jobs_lock:
                    self._errors.setdefault(slab_index, e)

    def drain(self) -> None:
        """Wait for every update submitted to the worker; raise the first error one of them raised."""
        self._wait_jobs()
        self._raise_error()

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
        """Apply every pending update now (before anything reads weights directly), including those the update
        worker is running."""
        for si in list(self.pending):
            self.apply_pending(si)
        self.drain()

    def has_pending(self) -> bool:
        """Whether an update is pending or still running on the update worker."""
        with self._jobs_lock:
            running = any(not f.done() for f in self._jobs) or bool(self._errors)
        return bool(self.pending) or running

    def drop_pending(self) -> None:
        """Forget every pending update without applying it (a checkpoint's state replaces the weights and moments
        it was computed from), each under its slab's lock, as :meth:`apply_pending` takes it; updates the worker
        is running end first, and their errors are forgotten with them."""
        for si in list(self.pending):
            with self.store.slabs[si].lock:
                self.pending.pop(si, None)
        self._claimed.clear()
        self._wait_jobs()
        with self._jobs_lock:
            self._errors.clear()

    def apply_pending(self, slab_index: int) -> None:
        """Apply the recorded update of one slab (thread-safe; a no-op if none is pending). With the update worker
        running it, waits until it is done (the slab's lock) and raises the error it raised.

        Raises:
            RuntimeError: a parameter of the slab was written in place while its update was pending (the message
                says what to do).
        """
        self._apply(slab_index)
        if self._worker is not None:
            self._raise_error(slab_index)

    def _apply(self, slab_index: int) -> bool:
        """Apply the slab's pending update; ``False`` if none was pending."""
        slab = self.store.slabs[slab_index]
        own = self.ownership
        with slab.lock:
            pend = self.pending.pop(slab_index, None)
            if pend is None:
                return False
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
                return True
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
        return True

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
        """fp16 loss scaling: multiply every accumulated gradient by ``inv_scale`` in place, slab by
        slab (either tier), with torch's ``_amp_foreach_non_finite_check_and_unscale_`` as
        ``torch.amp.GradScaler.unscale_`` does. Returns ``True`` if any gradient is inf/NaN."""
        found_inf = torch.zeros(1)
        inv = torch.full((1,), inv_scale)
        by_slab: dict[int, list[int]] = {}
        for si, ei in self._grad_entries():
            by_slab.setdefault(si, []).append(ei)
        own = self.ownership
        for si, eis in by_slab.items():
            if own is not None and not own.owns(si):
                continue  # its owner unscales it in the shared accumulator
            slab = self.store.slabs[si]
            with slab.lock, self.store.hold(si, [Region.grad_accum], write=True) as t:
                torch._amp_foreach_non_finite_check_and_unscale_([slab.view(t[Region.grad_accum], ei) for ei in eis], found_inf, inv)
        if own is not None:
            own.all_reduce(found_inf, "max")  # the same skip decision on every rank
        return bool(found_inf.item())

    # ------------------------------------------------------------------ clipping
    def _grad_entries(self) -> list[tuple[int, int]]:
        """(slab, entry) of every optimizer parameter holding a gradient of this step, in param-group order.

        A slab whose previous update is still pending (it was not fetched since: a layer skipped by layer drop or
        early exit) holds that step's gradients until the update runs: they are not this step's, as ``param.grad``
        is ``None`` in plain PyTorch for a parameter that got none since ``zero_grad``."""
        out = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                si, ei = self._where[id(p)]
                slab = self.store.slabs[si]
                if (slab.entries[ei].trainable and not slab.grad_accum_empty and slab.has_grad[ei]
                        and si not in self.pending):
                    out.append((si, ei))
        return out

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Total norm of the accumulated gradients of the optimizer's parameters, computed as
        ``torch.nn.utils.clip_grad_norm_`` does (per-parameter ``_foreach_norm``, then the norm of
        the stacked norms), reading each slab's accumulator once. Returns a 0-dim fp32 tensor."""
        items = self._grad_entries()
        by_slab: dict[int, list[int]] = {}
        for si, ei in items:
            by_slab.setdefault(si, []).append(ei)
        norms: dict[tuple[int, int], torch.Tensor] = {}
        own = self.ownership
        for si, eis in by_slab.items():
            if own is not None and not own.owns(si):
                continue
            slab = self.store.slabs[si]
            with slab.lock, self.store.hold(si, [Region.grad_accum]) as t:
                for ei, n in zip(eis, torch._foreach_norm([slab.view(t[Region.grad_accum], ei) for ei in eis], norm_type)):
                    norms[(si, ei)] = n
        if not items:
            return torch.tensor(0.0)
        zero = torch.zeros((), dtype=torch.float32)
        stacked = torch.stack([norms.get(k, zero) for k in items])
        if own is not None:  # each norm comes from its owner alone (the others add 0): exact, the same everywhere
            own.all_reduce(stacked, "sum")
        return torch.linalg.vector_norm(stacked, norm_type)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the host gradients: returns the total norm (0-dim fp32) and
        records the scale ``min(1, max_norm / (norm + 1e-6))`` for the coming step (applied per slab
        in its update).

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
        """``torch.nn.utils.clip_grad_value_``: clamp every gradient to ``[-clip_value, clip_value]``
        in the coming step's updates."""
        self.grad_ops.append(("clamp", float(clip_value)))

    def apply_grad_ops(self) -> None:
        """Apply the recorded clipping to the accumulated gradients now, in place, slab by slab (either tier; with
        several processes each owner its own slabs), and forget it: what the coming updates would have applied
        (the same ops on the same tensors, so the same numbers), one extra pass over the gradients. After it the
        gradients read through ``param.grad`` are the clipped ones, later edits come after the clip and a second
        clip measures the clipped gradients, as with torch's in-place ``clip_grad_norm_``/``clip_grad_value_``."""
        ops, self.grad_ops = self.grad_ops, []
        if not ops:
            return
        slabs = sorted({si for si, _ in self._grad_entries()})
        own = self.ownership
        for si in slabs:
            if own is not None and not own.owns(si):
                continue
            slab = self.store.slabs[si]
            with slab.lock, self.store.hold(si, [Region.grad_accum], write=True) as t:
                self._apply_ops(slab, t[Region.grad_accum], ops)

    @staticmethod
    def _apply_ops(slab: Slab, acc: torch.Tensor, ops: list[tuple[str, Any]]) -> None:
        """Apply recorded clipping ops, in order, in place to the gradients in ``acc`` (slab ``slab``'s flat fp32
        accumulator) of every entry that got a gradient this window: ``("mul", 0-dim tensor)`` scales,
        ``("clamp", float)`` clamps to ``[-v, v]``."""
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
        """``(foreach, fused)`` passed to :func:`torch.optim.adam.adam`: the group's own flags (torch
        resolves ``None, None`` for CPU tensors to the for-loop, as the user's optimizer would), except
        on a CUDA run with neither set, where the fused CPU kernel runs (module docstring)."""
        device = getattr(self.transport, "device", None)
        if h.foreach is None and h.fused is None and device is not None and torch.device(device).type != "cpu":
            return None, True
        return h.foreach, h.fused

    def implementation(self, group: int = 0) -> str:
        """The kernel the host update of param group ``group`` runs: ``"fused"``, ``"foreach"`` or
        ``"for-loop"`` (resolved as :func:`torch.optim.adam.adam` resolves it for CPU tensors)."""
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
        """Another rank applied this slab's update (shared store): advance the AdamW step counts of the
        parameters it updated, as the update would have."""
        for i, e in enumerate(slab.entries):
            if self.group_of[slab.index][i] >= 0 and e.trainable and slab.has_grad[i]:
                if self.steps[slab.index][i] is None:
                    self.steps[slab.index][i] = torch.tensor(0.0, dtype=torch.float32)
                self.steps[slab.index][i] += 1

    def _update(self, slab: Slab, pend: _Pending) -> None:
        with self.store.hold(slab.index, [Region.master, Region.exp_avg, Region.exp_avg_sq], write=True) as w, \
                self.store.hold(slab.index, [Region.grad_accum]) as r:
            self._update_views(slab, pend, w[Region.master], r[Region.grad_accum], w[Region.exp_avg], w[Region.exp_avg_sq])

    def _update_views(self, slab: Slab, pend: _Pending, master: torch.Tensor, acc: torch.Tensor, m: torch.Tensor,
                      v: torch.Tensor) -> None:
        hyper = pend.hyper
        by_group: dict[int, list[int]] = {}
        for i, e in enumerate(slab.entries):
            gi = self.group_of[slab.index][i]
            if 0 <= gi < len(hyper) and e.trainable and slab.has_grad[i]:  # a group added after the step: not in it
                by_group.setdefault(gi, []).append(i)
        if pend.grad_ops:
            self._apply_ops(slab, acc, pend.grad_ops)
        for gi, idx in by_group.items():
            h = hyper[gi]
            params, grads, ms, vs, steps = [], [], [], [], []
            for i in idx:
                params.append(slab.view(master, i))
                grads.append(slab.view(acc, i))
                ms.append(slab.view(m, i))
                vs.append(slab.view(v, i))
                st = self.steps[slab.index][i]
                if st is None:
                    # this optimizer's first update of the parameter: its state starts at zero, as
                    # torch.optim.AdamW creates it lazily. The store's moments may hold the state of
                    # an earlier optimizer (a previous fit, lr_find): never reuse them.
                    st = self.steps[slab.index][i] = torch.tensor(0.0, dtype=torch.float32)
                    ms[-1].zero_()
                    vs[-1].zero_()
                steps.append(st)
            kw: dict[str, Any] = dict(
                amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps, maximize=False
            )
            foreach, fused = self._flags(h)
            with torch.no_grad():
                _functional_adam(
                    params, grads, ms, vs, [], steps, foreach=foreach, fused=fused, decoupled_weight_decay=h.decoupled, **kw
                )

    # ------------------------------------------------------------------ introspection
    def state_for(self, slab_index: int, entry: int) -> dict[str, torch.Tensor] | None:
        """The AdamW state of one parameter as ``torch.optim.AdamW`` would hold it, or ``None``.

        RAM tier: views of the live state. NVMe tier: copies read through the host window."""
        st = self.steps[slab_index][entry]
        if st is None:
            return None
        slab = self.store.slabs[slab_index]
        copy = Region.exp_avg in self.store.nvme_kinds
        own = self.ownership
        if copy and own is not None and not own.owns(slab_index):
            raise RuntimeError(
                f"megatrain: the AdamW state of {slab.entries[entry].ref.fqn} is on the disk of rank "
                f"{own.global_rank_of(own.owner[slab_index])} (local rank {own.owner[slab_index]}; "
                "offload_optimizer='nvme' with several processes: each keeps the state of "
                "the blocks it updates). Read it on that rank, or from a directory checkpoint's optimizer/ folder.")
        with self.store.hold(slab_index, [Region.exp_avg, Region.exp_avg_sq]) as t:
            m, v = slab.view(t[Region.exp_avg], entry), slab.view(t[Region.exp_avg_sq], entry)
            return {"step": st, "exp_avg": m.clone() if copy else m, "exp_avg_sq": v.clone() if copy else v}

    # ------------------------------------------------------------------ checkpoint
    def streams_state(self) -> bool:
        """Whether the state is on NVMe (``offload_optimizer="nvme"``): a checkpoint's optimizer state is then
        written slab by slab from the store, never gathered into one dict."""
        return Region.exp_avg in self.store.nvme_kinds

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """State in ``torch.optim.AdamW.state_dict()`` format (parameters numbered in param-group order).

        With ``copy=True`` the tensors are copies (8 bytes/param of host RAM while the dict lives);
        with ``copy=False`` they are views of the live state (no memory, but they change with training).

        Raises:
            RuntimeError: several processes with ``offload_optimizer="nvme"``: each rank holds only the AdamW state
                of the blocks it updates, on its own disk (raised before anything is read).
        """
        own = self.ownership
        if own is not None and Region.exp_avg in self.store.nvme_kinds and not all(map(own.owns, range(len(self.store.slabs)))):
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
        """Load a ``torch.optim.AdamW``/``Adam`` ``state_dict()`` (a plain Lightning checkpoint's
        ``optimizer_states[0]``, or :meth:`state_dict`'s): parameters are numbered in param-group order, as torch
        numbers them; each group's hyper-parameters replace the optimizer's (``params`` excepted), each parameter's
        ``exp_avg``/``exp_avg_sq``/``step`` go into the store (either tier), and a parameter without saved state has
        none afterwards, as ``torch.optim.Optimizer.load_state_dict`` leaves it.

        Raises:
            ValueError: another number of param groups, a group of another size (the messages torch gives), state
                keys of another optimizer (SGD's ``momentum_buffer``...), or a state of another shape than its
                parameter's.
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
        self.flush()
        for g, s in zip(groups, saved):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
            for p, idx in zip(g["params"], s["params"]):
                st = state.get(idx)
                if not st or not self._holds_state(st):
                    self.forget_param_state(p)
                    continue
                self.set_param_state(p, st)
        # as torch.optim.Optimizer.load_state_dict ends: the class sets its own group defaults again (AdamW keeps
        # decoupled_weight_decay=True when an Adam state is loaded)
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

    # ------------------------------------------------------------------ per-parameter access
    def set_param_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Set one parameter's state from a ``torch.optim.AdamW``-format entry (``exp_avg``, ``exp_avg_sq``: any float
        dtype, the parameter's shape; ``step``: a number or a 1-element tensor).

        Raises:
            ValueError: other keys (another optimizer's state), ``param`` not in the store, or a shape differs.
        """
        self._check_saved_keys(set(state))
        if "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
            raise ValueError(f"AdamW state needs exp_avg, exp_avg_sq and step; got {', '.join(sorted(state))}.")
        step = state["step"] if torch.is_tensor(state["step"]) else torch.tensor(float(state["step"]))
        self.load_param_state(param, state["exp_avg"].float(), state["exp_avg_sq"].float(), step)

    def param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """AdamW state of ``param`` (views: ``exp_avg``, ``exp_avg_sq`` fp32 like the parameter,
        ``step`` fp32 scalar), or ``None`` if it never took a step."""
        where = self._where.get(id(param))
        return None if where is None else self.state_for(*where)

    def load_param_state(self, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: torch.Tensor) -> None:
        """Set the AdamW state of one parameter (shapes must match the parameter).

        Raises:
            ValueError: ``param`` is not in the store or a shape differs.
        """
        if id(param) not in self._where:
            raise ValueError("load_param_state: parameter is not part of the host store.")
        si, ei = self._where[id(param)]
        slab = self.store.slabs[si]
        e = slab.entries[ei]
        if tuple(exp_avg.shape) != tuple(e.shape) or tuple(exp_avg_sq.shape) != tuple(e.shape):
            raise ValueError(f"AdamW state of {e.ref.fqn} has shape {tuple(exp_avg.shape)}, parameter {tuple(e.shape)}.")
        self.pending.pop(si, None)
        own = self.ownership
        if own is None or own.owns(si) or Region.exp_avg not in self.store.nvme_kinds:  # else: on its owner's disk
            with slab.lock, self.store.hold(si, [Region.exp_avg, Region.exp_avg_sq], write=True) as t:
                t[Region.exp_avg][e.offset : e.offset + e.numel].copy_(exp_avg.reshape(-1))
                t[Region.exp_avg_sq][e.offset : e.offset + e.numel].copy_(exp_avg_sq.reshape(-1))
        self.steps[si][ei] = step.detach().reshape(()).float().cpu().clone()

    def forget_param_state(self, param: torch.Tensor) -> None:
        """Drop the AdamW state of one parameter: its next update starts at step 0 with zero moments, as
        ``torch.optim.AdamW.load_state_dict`` leaves a parameter the loaded state has no entry for (a checkpoint
        saved before its first step, e.g. the one ``BatchSizeFinder``/``lr_find`` restore after their trials)."""
        where = self._where.get(id(param))
        if where is not None:
            self.steps[where[0]][where[1]] = None

    def param_groups_meta(self, module: torch.nn.Module) -> list[dict[str, Any]]:
        """Param groups as plain data: hyper-parameters plus the parameter *names* of each group."""
        names = {id(p): n for n, p in module.named_parameters()}
        out = []
        for g in self.optimizer.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["param_names"] = [names[id(p)] for p in g["params"]]
            out.append(d)
        return out

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
                raise ValueError("Checkpoint param groups hold other parameters than configure_optimizers returned.")
            for k, v in m.items():
                if k != "param_names":
                    g[k] = v
