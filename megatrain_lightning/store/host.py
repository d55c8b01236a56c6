"""Host-RAM parameter store: one contiguous fp32 slab per block.

Each block's parameters are packed into one flat fp32 tensor (the *master* weights), trainable first, so one copy
moves a block to the device and the trainable part is one contiguous range for the accumulator and the AdamW
states (docs/architecture.md, "Memory tiers"). After :func:`build_store` every ``param.data`` is a view of its slab,
so the module keeps working as plain PyTorch and nothing is stored twice. With the NVMe tier some regions live in
per-block files (:mod:`megatrain_lightning.store.nvme`); :meth:`HostStore.hold` serves both tiers.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import torch

from ..blocks import Block, ParamRef
from .pinned import try_host_buffer
from .regions import Region

if TYPE_CHECKING:
    from .shared import SharedRegions


@dataclass
class SlabEntry:
    """Placement of one parameter inside its slab.

    Attributes:
        ref: the parameter reference (owner module, name, Parameter object).
        offset: first element of the parameter in the slab (elements, not bytes).
        trainable: the store holds an accumulator and AdamW state for it (``requires_grad`` when the store
            was built, or ``reserve_frozen``: :func:`slab_layout`).
    """

    ref: ParamRef
    offset: int
    numel: int
    shape: torch.Size
    trainable: bool


@dataclass
class Slab:
    """The fp32 host storage of one block.

    Attributes:
        index: slab id (equals the owning block's index).
        entries: parameters in slab order (trainable first).
        master: fp32 master weights, shape ``[numel]``; pinned on CUDA runs.
        trainable_numel: the trainable prefix ``master[:trainable_numel]``.
        grad_accum: fp32 gradient accumulator, shape ``[trainable_numel]`` (``None`` until the first gradient).
        has_grad: per entry, whether a gradient arrived in the current accumulation window
            (``False``: like ``p.grad is None``, no optimizer update).
        grad_accum_empty: ``grad_accum`` holds nothing of the current window (the next gradient is copied).
        lock: serialises optimizer updates and gradient writes on this slab across threads.
        last_read: event (``synchronize()``) of the last H2D copy out of ``master`` or its wire image, or
            ``None``. Every writer takes ``lock`` and calls :meth:`wait_reads` first, so no write overlaps a copy.
        updates: writes of ``master`` (the fused kernel does not bump ``_version``); wire images are
            refreshed when it changes.
        exp_avg / exp_avg_sq: fp32 AdamW states, shape ``[trainable_numel]`` (RAM tier; ``None`` until the
            first update or while they live on disk).
        numel: elements of the slab (of ``master``).
    """

    index: int
    entries: list[SlabEntry]
    master: torch.Tensor
    trainable_numel: int
    grad_accum: torch.Tensor | None = None
    has_grad: list[bool] = field(default_factory=list)
    grad_accum_empty: bool = True
    lock: threading.RLock = field(default_factory=threading.RLock)
    last_read: object | None = None
    updates: int = 0
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    numel: int = 0

    def param_versions(self) -> int:
        """Sum of the slab's parameters' version counters: an in-place write through a parameter moves it, an
        optimizer update on the masters does not."""
        return sum(e.ref.param._version for e in self.entries)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Entry ``i``'s view (its parameter's shape) of a flat slab region (master, grad_accum, exp_avg...)."""
        e = self.entries[i]
        return flat[e.offset : e.offset + e.numel].view(e.shape)

    def master_view(self, i: int) -> torch.Tensor:
        return self.view(self.master, i)

    def grad_accum_view(self, i: int) -> torch.Tensor:
        assert self.grad_accum is not None and self.entries[i].trainable
        return self.view(self.grad_accum, i)

    # state changes go through these methods (called under ``lock``)
    def start_window(self) -> None:
        """Before adding gradients: reset ``has_grad`` if the accumulator holds nothing of the current window."""
        if self.grad_accum_empty:
            self.has_grad = [False] * len(self.entries)

    def got_grad(self, i: int) -> None:
        """Entry ``i`` got a gradient in the current window (the next one is added, not copied)."""
        self.has_grad[i] = True

    def filled(self) -> None:
        """The accumulator now holds gradients of the current window."""
        self.grad_accum_empty = False

    def clear_grads(self) -> None:
        """The window's gradients were consumed by an update or discarded (``zero_grad``)."""
        self.grad_accum_empty = True
        self.has_grad = [False] * len(self.entries)

    def updated(self) -> None:
        """``master`` was written (an AdamW update or a direct write): wire images of it are stale."""
        self.updates += 1

    def read_by(self, event: object) -> None:
        """Record the latest H2D copy's event (``lock`` held since the copy was queued); copies run in order on
        one stream, so it covers the earlier ones."""
        self.last_read = event

    def wait_reads(self) -> None:
        """Block until the last H2D copy out of ``master`` is done (writers: with ``lock`` held, before writing)."""
        ev = self.last_read
        if ev is not None:
            ev.synchronize()  # type: ignore[attr-defined]


_SLOT_STORAGES: set[int] = set()  # storages of every store's placeholder values (grow-only: a few per run)
_SLOT_TENSORS: list[torch.Tensor] = []  # ...kept alive (4 bytes per parameter), so no other tensor gets their address


def is_nvme_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a placeholder (:meth:`HostStore.placeholder`) of any store of this process, closed ones
    included."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and all(st == 0 for st in t.stride())
            and t.untyped_storage().data_ptr() in _SLOT_STORAGES)


class HostStore:
    """All slabs of a model plus byte accounting.

    Args:
        slabs: one slab per block, indexed by block index (blocks without parameters own an empty slab).
    """

    def __init__(self, slabs: Sequence[Slab], nvme=None, nvme_kinds: Iterable[str] = ()):
        self.slabs = list(slabs)
        self.nvme = nvme  # NVMeStore or None
        self.nvme_kinds = frozenset(nvme_kinds)
        self._placeholder_slots: dict[int, torch.Tensor] = {}  # slab index -> one NaN per entry (placeholder)
        self._slot_storages: set[int] = set()  # their storages' addresses
        self._index: dict[int, tuple[int, int]] | None = None
        self.shared: "SharedRegions | None" = None  # data parallel: the node's shared file (store/shared.py)

    @property
    def index(self) -> dict[int, tuple[int, int]]:
        """``id(parameter) -> (slab index, entry index)``, built at the first lookup."""
        if self._index is None:
            self._index = {id(e.ref.param): (s.index, i) for s in self.slabs for i, e in enumerate(s.entries)}
        return self._index

    def locate(self, param: torch.Tensor) -> tuple[int, int]:
        """``(slab index, entry index)`` of a parameter of the stored module.

        Raises:
            KeyError: ``param`` is not a parameter of the stored module."""
        try:
            return self.index[id(param)]
        except KeyError:
            raise KeyError(f"parameter of shape {tuple(param.shape)} is not part of the streamed module") from None

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slabs)

    def placeholder(self, si: int, i: int) -> torch.Tensor:
        """The ``.data`` of entry ``i`` of slab ``si`` while its master is on disk: one fp32 NaN of its own
        expanded to the parameter's shape (stride 0, 4 bytes); docs/internals/nvme.md, "Parameters"."""
        slots = self._placeholder_slots.get(si)
        if slots is None:
            slots = self._placeholder_slots[si] = torch.full((len(self.slabs[si].entries),), float("nan"))
            _SLOT_STORAGES.add(slots.untyped_storage().data_ptr())
            _SLOT_TENSORS.append(slots)
            self._slot_storages.add(slots.untyped_storage().data_ptr())
        return slots[i].expand(self.slabs[si].entries[i].shape)

    def is_placeholder(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of this store's placeholders."""
        return is_nvme_placeholder(t) and t.untyped_storage().data_ptr() in self._slot_storages

    def placeholder_writes(self) -> list[tuple[int, int]]:
        """``(slab, entry)`` of every placeholder written since the last call (no longer NaN), each reset to NaN."""
        found = []
        for si, slots in self._placeholder_slots.items():
            bad = ~torch.isnan(slots)
            if bool(bad.any()):
                found += [(si, int(i)) for i in bad.nonzero().flatten()]
                slots.fill_(float("nan"))
        return found

    @property
    def masters_on_disk(self) -> bool:
        return Region.master in self.nvme_kinds

    def _ram(self, slab: Slab, kind: str) -> torch.Tensor:
        if kind == Region.master:
            return slab.master
        if kind == Region.grad_accum:
            if slab.grad_accum is None:
                slab.grad_accum = torch.zeros(slab.trainable_numel, dtype=torch.float32)
                slab.has_grad = [False] * len(slab.entries)
            return slab.grad_accum
        if slab.exp_avg is None:
            slab.exp_avg = torch.zeros(slab.trainable_numel, dtype=torch.float32)
            slab.exp_avg_sq = torch.zeros(slab.trainable_numel, dtype=torch.float32)
        return slab.exp_avg if kind == Region.exp_avg else slab.exp_avg_sq  # type: ignore[return-value]

    @contextlib.contextmanager
    def hold(self, i: int, kinds: Iterable[str], write: bool = False, fresh: Iterable[str] = ()) -> Iterator[dict[str, torch.Tensor]]:
        """Slab ``i``'s regions as flat fp32 host tensors for the ``with`` body, from either tier.

        Args:
            i: slab index.
            kinds: any of ``master`` (``[numel]``), ``exp_avg``, ``exp_avg_sq``, ``grad_accum`` (``[trainable_numel]``).
            write: the body modifies them (NVMe: written back afterwards).
            fresh: regions whose old content is not needed (NVMe: not read from disk).

        RAM-tier regions are the live tensors (zeros when first asked for); NVMe regions are window buffers,
        valid only inside the body.
        """
        kinds = tuple(kinds)
        slab = self.slabs[i]
        out = {k: self._ram(slab, k) for k in kinds if k not in self.nvme_kinds}
        disk = [k for k in kinds if k in self.nvme_kinds]
        with self.nvme.hold(i, disk, write=write, fresh=fresh) if disk else contextlib.nullcontext({}) as got:
            out.update(got)
            yield out

    def master_is_remote(self, i: int) -> bool:
        """Data parallel with the masters on disk: slab ``i``'s master is in another local rank's store."""
        return self.masters_on_disk and i in self.nvme.remote

    def master_published(self, i: int) -> None:
        """Owner, data parallel: make slab ``i``'s new master visible before the others are told (NVMe: wait for
        its write-behind)."""
        if self.masters_on_disk:
            self.nvme.wait_written(i, Region.master)

    def master_changed_elsewhere(self, i: int) -> None:
        """Another rank updated slab ``i``'s master: drop a stale copy in this process's NVMe window."""
        if self.master_is_remote(i):
            self.nvme.invalidate(i, Region.master)

    def discard_grad_accum(self, i: int) -> None:
        """The accumulator of slab ``i`` was consumed: NVMe drops its window buffer unwritten."""
        if Region.grad_accum in self.nvme_kinds:
            self.nvme.discard(i, Region.grad_accum)

    def close(self) -> None:
        if self.nvme is not None:
            self.nvme.close()

    def max_slab_numel(self, trainable: bool = False) -> int:
        return max((s.trainable_numel if trainable else s.numel) for s in self.slabs) if self.slabs else 0


def slab_layout(blocks: Sequence[Block], reserve_frozen: bool = False) -> list[tuple[list[SlabEntry], int, int]]:
    """Per block: its slab entries (trainable first), slab numel and trainable numel (elements).

    ``reserve_frozen``: lay out frozen parameters as trainable too (for ``BaseFinetuning`` unfreezing during
    fit): 12 more bytes per frozen element once allocated."""
    out = []
    for blk in blocks:
        seen: set[int] = set()
        own = []
        for r in sorted((r for r in blk.params if r.slab == blk.index), key=lambda r: r.index):
            if id(r.param) not in seen:
                seen.add(id(r.param))
                own.append(r)
        train = {id(r.param): reserve_frozen or r.param.requires_grad for r in own}
        order = [r for r in own if train[id(r.param)]] + [r for r in own if not train[id(r.param)]]
        entries: list[SlabEntry] = []
        off = 0
        trainable_numel = 0
        for r in order:
            n = r.param.numel()
            entries.append(SlabEntry(ref=r, offset=off, numel=n, shape=r.param.shape, trainable=train[id(r.param)]))
            off += n
            if train[id(r.param)]:
                trainable_numel = off
        out.append((entries, off, trainable_numel))
    return out


def build_store(blocks: Sequence[Block], pin_memory: bool | None = False,
                sources: dict[int, Callable[[], torch.Tensor]] | None = None,
                nvme_factory: Callable[[list[tuple[int, int]]], object] | None = None,
                nvme_kinds: Iterable[str] = (),
                shared: Callable[[list[tuple[int, int]]], "SharedRegions"] | None = None,
                reserve_frozen: bool = False) -> HostStore:
    """Pack every parameter into fp32 host slabs and repoint ``param.data`` at them.

    Args:
        blocks: output of :func:`~megatrain_lightning.blocks.discover_blocks`.
        pin_memory: page-lock the masters: ``True`` pins or raises, ``None`` pins while the driver can, then
            warns once and makes the rest pageable (:func:`~.pinned.try_host_buffer`), ``False`` never pins.
        sources: ``id(param) -> loader`` for parameters on the ``meta`` device (a model from
            :func:`~megatrain_lightning.checkpoint.hf_io.meta_model_from_pretrained`): each loader
            returns that one tensor (CPU, any float dtype), read straight into the slab. A meta parameter is
            replaced by a new ``nn.Parameter`` in every module that holds it, so build the optimizer after the store.
        nvme_factory: ``layout -> NVMeStore`` for the NVMe tier (``layout = [(numel, trainable numel)]``
            per slab); ``None``: everything in RAM.
        nvme_kinds: regions kept on disk: ``{"master"}`` (``offload_params="nvme"``) and/or
            ``{"exp_avg", Region.exp_avg_sq, Region.grad_accum}`` (``offload_optimizer="nvme"``).
        shared: data parallel: ``layout -> SharedRegions`` mapping the node's shared file (``store/shared.py``),
            of which every RAM region is a view; the node's writer (local rank 0) copies the weights in, or, with
            the masters on disk, each owner its own slabs'.
        reserve_frozen: gradient and AdamW state for frozen parameters too (:func:`slab_layout`).

    Raises:
        ValueError: a meta parameter without a source, or whose source has another shape; ``shared`` with the
            masters on NVMe but the optimizer state in RAM.
        HostPinningError: ``pin_memory=True`` and a master slab cannot be page-locked.

    Returns:
        The store. Parameters keep their identity (non-meta ones) and become fp32; with masters on disk
        their ``.data`` is a placeholder (:meth:`HostStore.placeholder`).

    Peak extra memory while building: one slab (each block's original storage is released once repointed).
    """
    layout = slab_layout(blocks, reserve_frozen)
    nvme_kinds = frozenset(nvme_kinds)
    optimizer_on_disk = nvme_factory is not None and Region.grad_accum in nvme_kinds
    masters_on_disk = nvme_factory is not None and Region.master in nvme_kinds
    if shared is not None and masters_on_disk and not optimizer_on_disk:
        raise ValueError("build_store: a shared (data-parallel) store with the masters on NVMe needs the optimizer "
                         "state on NVMe too.")
    # the shared file holds what is in RAM (with everything on disk, only the update counts)
    regions = shared([(0 if masters_on_disk else n, 0 if optimizer_on_disk else t) for _, n, t in layout]) \
        if shared is not None else None
    nvme = nvme_factory([(n, t) for _, n, t in layout]) if nvme_factory is not None and nvme_kinds else None
    store = HostStore([], nvme=nvme, nvme_kinds=nvme_kinds if nvme is not None else ())
    store.shared = regions
    try:
        for blk, (entries, numel, trainable_numel) in zip(blocks, layout):
            slab = Slab(index=blk.index, entries=entries, master=None, trainable_numel=trainable_numel,  # type: ignore[arg-type]
                        numel=numel)
            if regions is not None:
                if not masters_on_disk:
                    slab.master = regions.region(slab.index, Region.master)
                if not optimizer_on_disk:
                    slab.grad_accum = regions.region(slab.index, Region.grad_accum)
                    slab.exp_avg = regions.region(slab.index, Region.exp_avg)
                    slab.exp_avg_sq = regions.region(slab.index, Region.exp_avg_sq)
                slab.has_grad = [False] * len(entries)
            elif not masters_on_disk:
                # pinned at its exact size (store/pinned.py), not rounded up to a power of two
                buf, pinned = try_host_buffer(4 * numel, pin_memory, "the master weights")
                if pin_memory is None and not pinned:
                    pin_memory = False  # warned once: the remaining slabs are pageable too
                slab.master = buf[: 4 * numel].view(torch.float32)
            store.slabs.append(slab)
            # data parallel, masters on disk: each owner writes its own slabs' masters
            with contextlib.nullcontext({}) if store.master_is_remote(slab.index) else \
                    store.hold(slab.index, [Region.master], write=True, fresh=[Region.master]) as t:
                master = t.get(Region.master)
                for e in entries if master is not None else ():  # None: another rank's slab, it writes it
                    p = e.ref.param
                    if p.is_meta:
                        if not sources or id(p) not in sources:
                            raise ValueError(
                                f"Parameter {e.ref.fqn} is on the meta device and no weights source provides it. Build the "
                                "model with megatrain_lightning.checkpoint.hf_io.meta_model_from_pretrained(path), or "
                                "materialise it before training."
                            )
                        value = sources[id(p)]()
                        if tuple(value.shape) != tuple(p.shape):
                            raise ValueError(
                                f"{e.ref.fqn}: source tensor has shape {tuple(value.shape)}, parameter "
                                f"{tuple(p.shape)}. The parameter is on the meta device and its weights come from "
                                "the checkpoint as saved, so it cannot be resized before fit (resize_token_embeddings "
                                "on a model from meta_model_from_pretrained makes parameters with no weights). "
                                "Resize a materialised model instead: load the weights "
                                "(transformers.AutoModelForCausalLM.from_pretrained(path)), call "
                                "model.resize_token_embeddings(n), then fit it; or save that resized model "
                                "(save_pretrained) and stream it with meta_model_from_pretrained."
                            )
                    else:
                        value = p.detach()
                    if regions is None or regions.writer or masters_on_disk:
                        master[e.offset : e.offset + e.numel].copy_(value.reshape(-1))
                    del value
            for i, e in enumerate(entries):
                old = e.ref.param
                data = store.placeholder(slab.index, i) if masters_on_disk else slab.master_view(i)
                if old.is_meta:
                    new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
                    for b in blocks:
                        for r in b.params:
                            if r.param is old:
                                r.owner._parameters[r.attr] = new
                                r.param = new
                else:
                    old.data = data
    except BaseException:
        store.close()
        raise
    # every reference (tied parameters included) points at the final packed position
    for blk in blocks:
        for r in blk.params:
            r.slab, r.index = store.index[id(r.param)]
    return store
