"""One block's weights to the device: its pending AdamW update, the cast to the wire dtypes, the copy.

Runs on the H2D worker thread (:mod:`megatrain_lightning.engine.prefetch` schedules it); the wire rule is
:mod:`megatrain_lightning.engine.wire`'s (docs/internals/precision.md, "Wire images and the fetch").
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
from torch import nn

from ..blocks import Block
from ..optim.host_adamw import HostAdamW
from ..store.host import HostStore
from ..store.pinned import try_host_buffer
from ..store.regions import Region
from ..store.shared import SharedWireImages, SlabOwnership
from .accounting import ByteAccounting
from .staging import StagingRing
from .wire import WireLayout, autocast_casts, weights_read_outside_linear


class WeightFetcher:
    """Copies blocks' fp32 masters (or their wire images) to the device.

    Args:
        blocks: the model's blocks (each parameter's owners tell which weights autocast casts).
        acct: live-byte accounting (a fetched buffer counts until the compute thread releases it).
        pin_memory: page-lock the RAM tier's wire images (``None``: on CUDA, pageable with a warning if
            pinning fails).
        ring: the H2D staging ring for on-disk masters (``None`` without masters on disk).
        shared_images / ownership: data parallel with a node-shared store: ``nbytes per slab ->
            SharedWireImages`` (collective) and the slab owners; one image per node, written by the slab's
            owner (``store/shared.py``).
    """

    def __init__(self, blocks: list[Block], store: HostStore, transport: Any, acct: ByteAccounting,
                 device: torch.device, pin_memory: bool | None = None,
                 ring: StagingRing | None = None,
                 shared_images: Callable[[list[int]], SharedWireImages] | None = None,
                 ownership: SlabOwnership | None = None):
        self.blocks, self.store, self.transport, self.acct = blocks, store, transport, acct
        self._shared_images, self.ownership = shared_images, ownership
        self.images: SharedWireImages | None = None
        self.optimizer: HostAdamW | None = None  # its pending update of a slab is applied first
        self.pin_memory = pin_memory if device.type == "cuda" else False
        self.ring = ring
        self.wire_dtype = torch.float32  # dtype of (castable, under mixed precision) weights on the H2D link
        self.param_dtype = torch.float32  # dtype the block's parameters have while it computes
        self.autocast_castable: list[list[bool]] = self._castable()
        self.wire_layouts: list[WireLayout] = [WireLayout.uniform(s.numel, torch.float32) for s in store.slabs]
        # slab index -> (its wire image, _written(slab) when encoded): RAM tier only
        self.shadows: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}

    def fetch(self, blk: Block) -> dict[int, tuple[torch.Tensor, Any]]:
        """H2D worker: apply pending optimizer updates of the block's slabs, then copy them as their wire layout
        says (:meth:`configure`): the fp32 master, or the wire image (RAM tier: the cached shadow; NVMe tier: cast
        at this fetch). ``stats.h2d_bytes`` counts bytes copied: 0 where the transport binds the source itself
        (``cpu_zero_copy`` with a source in the compute dtype: a ``32-true`` CPU run by default).

        Returns:
            slab index -> ``(device buffer, event)``."""
        out = {}
        for si in blk.slabs:
            slab = self.store.slabs[si]
            self.acct.track(slab.numel * self.param_dtype.itemsize)  # before the buffer exists (CPU + NVMe: budget)
            # the lock is taken after the reservation (it may wait for budget) and held from the update until the
            # copy's event is published: a writer on another thread (in-backward update, write_param) sees the event
            # in slab.last_read and waits for it
            with slab.lock:
                layout = self.wire_layouts[si]
                opt = self.optimizer
                if opt is not None:
                    opt.apply_pending(si)
                if not self.store.masters_on_disk:  # the transports decode only a mixed layout (dtype None)
                    src = slab.master if layout.dtype == torch.float32 else self._shadow(slab)
                    buf, ev = self.transport.to_device(src, self.param_dtype, layout)
                else:
                    src, buf, ev = self._from_window(si, layout)
                slab.read_by(ev)
                if buf is not src:  # a copy was made (zero-copy binding hands back the source itself)
                    self.acct.add(h2d_bytes=src.numel() * src.element_size())
                out[si] = (buf, ev)
        self.acct.add(blocks_fetched=1)
        return out

    def _from_window(self, si: int, layout: WireLayout) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Copy slab ``si``'s master from the NVMe window without waiting for the copy (docs/internals/nvme.md,
        "Masters to the device"); returns ``(what travelled, device buffer, event)``."""
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(self.store.hold(si, [Region.master]))[Region.master]
            if layout.dtype == torch.float32:
                buf, ev = self.transport.to_device(src, self.param_dtype)
                self.transport.when_done(ev, stack.pop_all().close)
                return src, buf, ev
            assert self.ring is not None, "masters on disk with a 16-bit wire need the H2D staging ring"
            slot = self.ring.acquire(layout.nbytes)
            try:
                image = self._encode(layout, src, layout.image_in(slot.raw))
                stack.close()  # the cast was synchronous: the window's master is free again
                buf, ev = self.transport.to_device(image, self.param_dtype, layout)
            except BaseException:
                self.ring.release_after(slot, None)
                raise
            self.ring.release_after(slot, ev)
            return image, buf, ev

    def _castable(self) -> list[list[bool]]:
        """Per slab, per entry: autocast casts the parameter at every use: every (owner module, attribute) holding
        it is castable (:func:`~megatrain_lightning.engine.wire.autocast_casts`; a tied LM head's weight is not: the
        embedding lookup must see fp32), DoRA base weights excluded."""
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for blk in self.blocks:
            for ref in blk.params:
                owners.setdefault(id(ref.param), []).append((ref.owner, ref.attr))
        fp32 = weights_read_outside_linear(m for blk in self.blocks for m in blk.module.modules())
        return [[id(e.ref.param) not in fp32 and all(autocast_casts(m, a) for m, a in owners[id(e.ref.param)])
                 for e in s.entries] for s in self.store.slabs]

    def configure(self, wire: torch.dtype, param: torch.dtype) -> None:
        """Set the dtypes of the H2D weight copies and of the bound parameters (the caller drops prefetched copies
        first when they change).

        Args:
            wire: dtype weights travel in: every weight when ``param == wire`` (``32-true``, ``bf16-true``), else
                (mixed modes) only the ``autocast_castable`` ones, the others in fp32.
            param: dtype of the device buffer the block's parameters are bound to (fp32 in mixed modes).
        """
        self.wire_dtype, self.param_dtype = wire, param
        layouts = [WireLayout.uniform(s.numel, wire) if wire == param else
                   WireLayout.build([e.numel for e in s.entries], [wire if c else torch.float32 for c in castable])
                   for s, castable in zip(self.store.slabs, self.autocast_castable)]
        for slab, old, new in zip(self.store.slabs, self.wire_layouts, layouts):
            if old != new:
                with slab.lock:
                    self.transport.last_read_done(slab.last_read)  # an async H2D may still read the shadow
                    self.shadows.pop(slab.index, None)
        changed = layouts != self.wire_layouts
        self.wire_layouts = layouts
        if self._shared_images is not None and changed:  # every rank decides the same: the same layouts
            need = [lay.nbytes if lay.dtype != torch.float32 else 0 for lay in layouts]
            self.images = self._shared_images(need) if any(need) else None

    def forget_images(self) -> None:
        """Re-encode every cached wire image at its slab's next fetch (the masters were written where no version
        counter shows it: ``param.data.copy_``)."""
        for si, (shadow, _) in list(self.shadows.items()):
            with self.store.slabs[si].lock:
                self.shadows[si] = (shadow, None)

    def _shadow(self, slab) -> torch.Tensor:
        """Host wire image of the master slab, re-encoded when :func:`_written` moved: one cast per slab per
        optimizer step, right after its update, instead of one per fetch (each block is fetched twice per step).
        With the node's shared images the owner rewrites a stale image (a new generation); another rank waits for
        a generation newer than the one it last used."""
        layout, images, own = self.wire_layouts[slab.index], self.images, self.ownership
        with slab.lock:
            v = _written(slab)
            shadow, version = self.shadows.get(slab.index, (None, None))
            if images is not None:
                assert own is not None
                shadow = layout.image_in(images.images[slab.index])
            elif shadow is None:  # pinned exactly (store/pinned.py), not rounded up to a power of two
                raw, pinned = try_host_buffer(layout.nbytes, self.pin_memory, "wire images")
                if not pinned and self.pin_memory is None:
                    self.pin_memory = False  # warned once: the next ones are pageable too
                shadow = layout.image_in(raw)
            if version != v:
                if images is None or own.owns(slab.index):  # type: ignore[union-attr]
                    self.transport.last_read_done(slab.last_read)  # an async H2D may still read the image
                    self._encode(layout, slab.master, shadow)
                    if images is not None:
                        images.written(slab.index)
                else:
                    rank = own.global_rank_of(own.owner[slab.index])  # type: ignore[union-attr]
                    images.wait_newer(slab.index, rank, lambda: own.exited(rank))  # type: ignore[union-attr]
            self.shadows[slab.index] = (shadow, v)
            return shadow

    def _encode(self, layout: WireLayout, master: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`WireLayout.encode`, its time counted in ``cast_s``."""
        t0 = time.perf_counter()
        layout.encode(master, out)
        self.acct.add(cast_s=time.perf_counter() - t0)
        return out


def _written(slab) -> tuple[int, int, int]:
    """What the slab's wire image is valid for: optimizer updates applied (the fused AdamW kernel moves no version
    counter), the masters' version counter and the sum of its parameters' own (``p.mul_(0.9)`` moves only ``p``'s)."""
    return slab.updates, slab.master._version, slab.param_versions()
