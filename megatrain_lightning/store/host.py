"""Host-RAM parameter store: one contiguous fp32 slab per block.

Each block's parameters are packed into one flat fp32 tensor (the *master*
weights), trainable parameters first, frozen ones after, so one copy moves a
whole block to the device and the trainable part is one contiguous range for
the gradient accumulator and the AdamW states (DESIGN.md sections 2 and 3).

After :func:`build_store`, every ``nn.Parameter`` of the model has its ``.data``
replaced by a view of its slab: the module keeps working as a plain PyTorch
module (``state_dict()``, ``save_pretrained()``) and nothing is stored twice.

Bytes per parameter on the host (fp32): master 4, gradient accumulator 4
(trainable only, allocated at the first backward), exp_avg 4 and exp_avg_sq 4
(trainable parameters the optimizer owns, allocated at the first step).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..engine.blocks import Block, ParamRef


@dataclass
class SlabEntry:
    """Placement of one parameter inside its slab.

    Attributes:
        ref: the parameter reference (owner module, name, Parameter object).
        offset: first element of the parameter in the slab (elements, not bytes).
        numel: number of elements.
        shape: the parameter's shape.
        trainable: ``requires_grad`` at the time the store was built.
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
        acc: fp32 gradient accumulator, shape ``[trainable_numel]`` (``None`` until the first gradient).
        has_grad: per entry, whether a gradient arrived in the current accumulation window
            (``False`` entries behave like ``p.grad is None`` in PyTorch: no optimizer update).
        acc_empty: ``True`` when ``acc`` holds nothing of the current window (the next gradient is copied, not added).
        lock: serialises optimizer updates and gradient writes on this slab across threads.
        last_read: CUDA event of the last H2D copy out of ``master`` (the optimizer waits on it before writing).
        shadow: bf16/fp16 copy of ``master`` streamed instead of it under mixed precision (2 bytes/param).
        shadow_version: ``(updates, master._version)`` when ``shadow`` was last written.
        updates: optimizer updates applied to ``master`` (the fused kernel does not bump ``_version``).
    """

    index: int
    entries: list[SlabEntry]
    master: torch.Tensor
    trainable_numel: int
    acc: torch.Tensor | None = None
    has_grad: list[bool] = field(default_factory=list)
    acc_empty: bool = True
    lock: threading.RLock = field(default_factory=threading.RLock)
    last_read: object | None = None
    shadow: torch.Tensor | None = None
    shadow_version: tuple[int, int] = (-1, -1)
    updates: int = 0

    @property
    def numel(self) -> int:
        return self.master.numel()

    def master_view(self, i: int) -> torch.Tensor:
        e = self.entries[i]
        return self.master[e.offset : e.offset + e.numel].view(e.shape)

    def acc_view(self, i: int) -> torch.Tensor:
        e = self.entries[i]
        assert self.acc is not None and e.trainable
        return self.acc[e.offset : e.offset + e.numel].view(e.shape)

    def ensure_acc(self) -> torch.Tensor:
        if self.acc is None:
            self.acc = torch.zeros(self.trainable_numel, dtype=torch.float32)
            self.has_grad = [False] * len(self.entries)
        return self.acc


class HostStore:
    """All slabs of a model plus byte accounting.

    Args:
        slabs: one slab per block, indexed by block index (blocks without parameters own an empty slab).
    """

    def __init__(self, slabs: Sequence[Slab]):
        self.slabs = list(slabs)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slabs)


    def max_slab_numel(self, trainable: bool = False) -> int:
        return max((s.trainable_numel if trainable else s.numel) for s in self.slabs) if self.slabs else 0


def build_store(blocks: Sequence[Block], pin_memory: bool = False,
                sources: dict[int, Callable[[], torch.Tensor]] | None = None) -> HostStore:
    """Pack every parameter into fp32 host slabs and repoint ``param.data`` at them.

    Args:
        blocks: output of :func:`~megatrain_lightning.engine.blocks.discover_blocks`.
        pin_memory: allocate the masters in page-locked memory (CUDA runs: H2D copies
            then run asynchronously at full link speed).
        sources: ``id(param) -> loader`` for parameters on the ``meta`` device (a model from
            :func:`~megatrain_lightning.checkpoint.hf_io.meta_model_from_pretrained`): each loader
            returns that one tensor (CPU, any float dtype), read straight into the slab, so the
            whole model is never materialised a second time. A meta parameter is replaced by a new
            ``nn.Parameter`` (a meta tensor cannot take CPU ``.data``) in every module that holds it,
            so build the optimizer after the store (Lightning's ``configure_optimizers`` runs later).

    Raises:
        ValueError: a parameter is on the meta device and no source provides it.

    Returns:
        The store. Parameters keep their identity (the same ``nn.Parameter`` objects,
        so optimizers and schedulers that hold them keep working); their dtype becomes fp32.

    Peak extra memory while building: one slab (each block's original storage is
    released once its parameters point into the slab, if nothing else holds it).
    """
    slabs: list[Slab] = []
    for blk in blocks:
        seen: set[int] = set()
        own = []
        for r in sorted((r for r in blk.params if r.slab == blk.index), key=lambda r: r.index):
            if id(r.param) not in seen:
                seen.add(id(r.param))
                own.append(r)
        order = [r for r in own if r.param.requires_grad] + [r for r in own if not r.param.requires_grad]
        entries: list[SlabEntry] = []
        off = 0
        trainable_numel = 0
        for r in order:
            n = r.param.numel()
            entries.append(SlabEntry(ref=r, offset=off, numel=n, shape=r.param.shape, trainable=r.param.requires_grad))
            off += n
            if r.param.requires_grad:
                trainable_numel = off
        master = torch.empty(off, dtype=torch.float32, pin_memory=pin_memory)
        for e in entries:
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
                    raise ValueError(f"{e.ref.fqn}: source tensor has shape {tuple(value.shape)}, parameter {tuple(p.shape)}.")
            else:
                value = p.detach()
            master[e.offset : e.offset + e.numel].copy_(value.reshape(-1))
            del value
        slab = Slab(index=blk.index, entries=entries, master=master, trainable_numel=trainable_numel)
        for i, e in enumerate(entries):
            old = e.ref.param
            if old.is_meta:
                new = torch.nn.Parameter(slab.master_view(i), requires_grad=old.requires_grad)
                for b in blocks:
                    for r in b.params:
                        if r.param is old:
                            r.owner._parameters[r.attr] = new
                            r.param = new
            else:
                old.data = slab.master_view(i)
        slabs.append(slab)
    # every reference (tied parameters included) points at the final packed position
    where = {id(e.ref.param): (s.index, i) for s in slabs for i, e in enumerate(s.entries)}
    for blk in blocks:
        for r in blk.params:
            r.slab, r.index = where[id(r.param)]
    return HostStore(slabs)

