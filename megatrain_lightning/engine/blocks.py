"""Block discovery: split a model into the units the engine streams.

A *block* is a unit of streaming: a module whose parameters are packed into one
host slab, copied to the compute device as one transfer, and run as one
recompute segment. Decoder layers are found from ``model._no_split_modules``
(the list Hugging Face keeps for ``device_map`` and FSDP wrapping); every other
module that owns parameters directly (input embedding, position embedding,
final norm, LM head) becomes a block of its own, so the whole model streams
(DESIGN.md section 3, "Blocks").

Tied parameters (for example ``lm_head.weight is model.embed_tokens.weight``)
are stored once, in the slab of the first block that owns them in module
order; later blocks that use them read that slab too.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn


class BlockDiscoveryError(ValueError):
    """Raised when a model cannot be split into streamable blocks."""


@dataclass
class ParamRef:
    """One parameter as a block sees it.

    Attributes:
        owner: the module whose ``_parameters`` dict holds the parameter.
        attr: the attribute name inside ``owner`` (e.g. ``"weight"``).
        fqn: fully qualified name inside the wrapped model (``model.layers.0.mlp.up_proj.weight``).
        param: the ``nn.Parameter`` object (its ``.data`` becomes a view of the host slab).
        slab: index of the slab that stores it (the first block that owns it).
        index: position of the parameter inside that slab's entry list.
    """

    owner: nn.Module
    attr: str
    fqn: str
    param: nn.Parameter
    slab: int = -1
    index: int = -1


@dataclass
class Block:
    """A streamed unit: one module and the parameters its forward reads.

    Attributes:
        index: position in module order (also the id of the slab it owns).
        name: module path inside the model (``model.layers.3``).
        module: the module object; its ``forward`` is replaced by a streaming proxy.
        params: every parameter the block reads, including tied ones stored in another slab.
    """

    index: int
    name: str
    module: nn.Module
    params: list[ParamRef] = field(default_factory=list)

    @property
    def slabs(self) -> list[int]:
        """Slab ids this block needs on the device, own slab first."""
        out: list[int] = []
        for ref in self.params:
            if ref.slab not in out:
                out.append(ref.slab)
        return out


def _matches(name: str, cls_name: str, block_classes: Sequence[str | type], block_names: Sequence[str]) -> bool:
    for c in block_classes:
        if (isinstance(c, str) and c == cls_name) or (isinstance(c, type) and cls_name == c.__name__):
            return True
    return any(fnmatch.fnmatchcase(name, pat) for pat in block_names)


def find_hf_models(root: nn.Module) -> list[nn.Module]:
    """Return the outermost submodules of ``root`` that declare ``_no_split_modules``.

    For a ``LightningModule`` holding ``self.model = AutoModelForCausalLM...`` this is ``[self.model]``.
    """
    found: list[nn.Module] = []
    prefixes: list[str] = []
    for name, mod in root.named_modules():
        if any(name.startswith(p + ".") or name == p for p in prefixes):
            continue
        if getattr(mod, "_no_split_modules", None):
            found.append(mod)
            prefixes.append(name)
    return found


def discover_blocks(
    root: nn.Module,
    block_classes: Sequence[str | type] | None = None,
    block_names: Sequence[str] | None = None,
) -> list[Block]:
    """Split ``root`` into streamed blocks, in module (= forward) order.

    Args:
        root: the module to stream (a ``LightningModule`` or a Hugging Face model).
        block_classes: class names or classes of the repeated blocks. Default: the union of
            ``_no_split_modules`` of every Hugging Face model inside ``root``.
        block_names: ``fnmatch`` patterns of module paths that are blocks (``"model.layers.*"``),
            like FSDP's wrap policy; used together with ``block_classes``.

    Returns:
        Blocks in module order. Every parameter of ``root`` belongs to exactly one slab.

    Raises:
        BlockDiscoveryError: no repeated block class/name matched (the model has no
            ``_no_split_modules`` and no override was given), or ``root`` itself owns
            parameters directly (there is no module to stream them with).
    """
    classes: list[str | type] = list(block_classes or [])
    names = list(block_names or [])
    if not classes and not names:
        for m in find_hf_models(root):
            classes.extend(m._no_split_modules)
    if not classes and not names:
        raise BlockDiscoveryError(
            f"Cannot find streamable blocks in {type(root).__name__}: no submodule declares "
            "`_no_split_modules` (Hugging Face models do). Pass "
            "`MegaTrainStrategy(block_classes=[YourLayerClass])` or "
            "`block_names=['model.layers.*']` to name the repeated layers."
        )
    if any(True for _ in root.parameters(recurse=False)):
        raise BlockDiscoveryError(
            f"{type(root).__name__} owns parameters directly "
            f"({[n for n, _ in root.named_parameters(recurse=False)]}); move them into a submodule "
            "so that they can be streamed with it."
        )

    blocks: list[Block] = []
    n_repeated = 0
    skip: list[str] = []
    for name, mod in root.named_modules():
        if name == "":
            continue
        if any(name.startswith(p + ".") for p in skip):
            continue
        is_block = _matches(name, type(mod).__name__, classes, names)
        owns = any(True for _ in mod.parameters(recurse=False))
        if is_block or owns:
            blocks.append(Block(index=len(blocks), name=name, module=mod))
            skip.append(name)
            n_repeated += int(is_block)
    if n_repeated == 0:
        raise BlockDiscoveryError(
            f"No module of {type(root).__name__} matched block classes {classes} / names {names}. "
            "Check the names (module classes are matched by class name, paths by fnmatch) or pass "
            "`block_classes=` / `block_names=` to MegaTrainStrategy."
        )

    owner_of: dict[int, tuple[int, int]] = {}
    for blk in blocks:
        for sub_name, sub in blk.module.named_modules():
            for attr, p in sub._parameters.items():
                if p is None:
                    continue
                fqn = ".".join(x for x in (blk.name, sub_name, attr) if x)
                ref = ParamRef(owner=sub, attr=attr, fqn=fqn, param=p)
                blk.params.append(ref)
    # assign slabs: first block (in module order) that reads a parameter stores it
    counts: dict[int, int] = {}
    for blk in blocks:
        for ref in blk.params:
            key = id(ref.param)
            if key not in owner_of:
                idx = counts.get(blk.index, 0)
                owner_of[key] = (blk.index, idx)
                counts[blk.index] = idx + 1
            ref.slab, ref.index = owner_of[key]
    return blocks


def iter_unique(blocks: Iterable[Block]) -> Iterable[ParamRef]:
    """Yield each stored parameter once (the reference in its owning slab)."""
    for blk in blocks:
        for ref in blk.params:
            if ref.slab == blk.index:
                yield ref


def check_floating(blocks: Sequence[Block]) -> None:
    """Raise ``TypeError`` if a parameter is not floating point (nothing to train in fp32)."""
    for ref in iter_unique(blocks):
        if not torch.is_floating_point(ref.param):
            raise TypeError(f"Parameter {ref.fqn} has dtype {ref.param.dtype}; only floating parameters are supported.")
