"""Block discovery: split a model into the units the engine streams.

A *block* is a module whose parameters are packed into one host slab, copied to the compute device as one
transfer, and run as one recompute segment. The rules are in :func:`discover_blocks` (docs/architecture.md,
"A training step": setup).

A *container*'s direct parameters (``Block.direct``) are bound for the whole of its ``forward`` (they are used
there, outside any block call) as autograd-tracked device views, kept until backward. Tied parameters
(``lm_head.weight is model.embed_tokens.weight``) are stored once, in the slab of the first block that owns them
in module order; later blocks read that slab too.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)


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

    def registered(self) -> nn.Parameter:
        """The parameter ``owner`` holds under ``attr``, which must still be :attr:`param`.

        Raises:
            RuntimeError: the parameter was removed, renamed or replaced since ``setup`` laid out the store
                (``torch.nn.utils.prune`` renames ``weight`` to ``weight_orig``).
        """
        cur = self.owner._parameters.get(self.attr)
        if cur is self.param:
            return cur
        now = "removed" if cur is None else "replaced by another tensor or Parameter"
        renamed = [k for k, v in self.owner._parameters.items() if v is self.param]
        if renamed:
            now = f"re-registered as {renamed[0]!r}"
        raise RuntimeError(
            f"megatrain: parameter {self.fqn} was {now} during fit (e.g. torch.nn.utils.prune or Lightning's "
            "ModelPruning callback, which rename 'weight' to 'weight_orig', an assignment of a new nn.Parameter, or "
            "torch.func.functional_call with other weights, which streamed blocks do not support). "
            "The strategy lays out the host store from the module at setup and cannot follow parameters that change "
            "while it trains: apply such changes before trainer.fit (then they are part of the layout), or between "
            "two fit calls.")


@dataclass
class Block:
    """A streamed unit: one module and the parameters its forward reads.

    Attributes:
        index: position in module order (also the id of the slab it owns).
        name: module path inside the model (``model.layers.3``).
        module: the module object; its ``forward`` is replaced by a streaming proxy.
        params: every parameter the block reads, including tied ones stored in another slab.
        direct: ``True`` for the direct parameters of a container (not its children's), bound for the
            container's whole ``forward`` instead of proxying a leaf computation.
    """

    index: int
    name: str
    module: nn.Module
    params: list[ParamRef] = field(default_factory=list)
    direct: bool = False

    @property
    def slabs(self) -> list[int]:
        """Slab ids this block needs on the device, own slab first."""
        return list(dict.fromkeys(ref.slab for ref in self.params))


KNOWN_BLOCKS = (("litgpt.model", "Block"),)
"""``(module, class name)`` of the decoder layers of libraries whose models declare no ``_no_split_modules``
(LitGPT's ``GPT`` repeats ``litgpt.model.Block``): discovered without ``block_classes``."""


def known_block_classes(root: nn.Module) -> list[type]:
    """The classes of :data:`KNOWN_BLOCKS` (matched exactly, by module and name) found in ``root``, in module
    order."""
    classes = (type(m) for m in root.modules())
    return list(dict.fromkeys(c for c in classes if (c.__module__, c.__name__) in KNOWN_BLOCKS))


def find_hf_models(root: nn.Module) -> list[nn.Module]:
    """Return the outermost submodules of ``root`` that declare ``_no_split_modules``.

    For a ``LightningModule`` holding ``self.model = AutoModelForCausalLM...`` this is ``[self.model]``; for the
    Hugging Face model itself (a Fabric loop's module) ``[root]``.
    """
    found: list[nn.Module] = []
    prefixes: list[str] = []
    for name, mod in root.named_modules():
        if any(p == "" or name.startswith(p + ".") or name == p for p in prefixes):
            continue
        if getattr(mod, "_no_split_modules", None):
            found.append(mod)
            prefixes.append(name)
    return found


def output_embedding_blocks(root: nn.Module, blocks: Sequence["Block"]) -> set[int]:
    """Indices of the blocks whose module is a model's ``get_output_embeddings()`` (``lm_head``): the engine keeps
    their graph (the logits the loss reads) from the first forward on, before the forward order is known."""
    heads = set()
    for m in root.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except Exception:  # noqa: BLE001 - a model without one (NotImplementedError, encoders): none
                continue
            if isinstance(head, nn.Module):
                heads.add(id(head))
    return {b.index for b in blocks if not b.direct and id(b.module) in heads}


class HFRunSettings:
    """Hugging Face model features that would undo block streaming, off for a run and back on as they were afterwards.

    * Gradient checkpointing: ``recompute`` decides what each block keeps; each submodule's
      ``gradient_checkpointing`` flag (with its checkpoint function) is recorded and set to ``False``.
    * Hub kernels (``use_kernels``, on by default in transformers 5 with ``kernels`` installed): a ``train()`` /
      ``eval()`` that changes mode re-runs ``kernels.kernelize``, which pops the instance ``forward`` of
      kernel-decorated modules (``LlamaRMSNorm``), so a block's streaming proxy would vanish mid-run.

    Args:
        root: the module the strategy streams; every Hugging Face model under it (:func:`find_hf_models`) is handled.
            Those that had checkpointing on are listed in :attr:`names` (the engine warns about each).
    """

    def __init__(self, root: nn.Module):
        self.names: list[str] = []
        self._saved: list[tuple[nn.Module, object]] = []  # (submodule, its checkpoint function)
        self._kernels: list[tuple[nn.Module, object]] = []  # (HF model, its kernels mode)
        for m in find_hf_models(root):
            flag = "is_activation_checkpointing" if hasattr(type(m), "is_activation_checkpointing") else "is_gradient_checkpointing"
            if getattr(m, flag, False):
                self.names.append(type(m).__name__)
                for sub in m.modules():
                    if getattr(sub, "gradient_checkpointing", False) is True:
                        self._saved.append((sub, getattr(sub, "_gradient_checkpointing_func", None)))
                        sub.gradient_checkpointing = False
            if getattr(m, "use_kernels", False) is True:
                self._kernels.append((m, getattr(m, "_kernels_mode", None)))
                m.use_kernels = False

    def restore(self) -> None:
        """Turn checkpointing and hub kernels back on where they were on, as they were; idempotent. A model whose
        kernels no longer load keeps its PyTorch forwards (with a warning)."""
        for sub, fn in self._saved:
            sub.gradient_checkpointing = True
            if fn is not None:
                sub._gradient_checkpointing_func = fn
        self._saved = []
        for m, mode in self._kernels:
            try:
                m.set_use_kernels(True, mode=mode)
            except Exception as err:  # a hub kernel that no longer loads: the PyTorch forward is the same maths
                log.warning("megatrain: hub kernels of %s could not be turned back on after the run (%s); it keeps "
                            "its PyTorch forwards.", type(m).__name__, err)
        self._kernels = []


def _module_listing(root: nn.Module, limit: int = 60) -> str:
    """Module paths of ``root`` with their class names, numeric path parts shown as ``*``
    (``net.layers.* (Layer)``), one entry per distinct path pattern, at most ``limit`` entries."""
    seen: dict[str, str] = {}
    for name, mod in root.named_modules():
        if not name:
            continue
        pat = ".".join("*" if part.isdigit() else part for part in name.split("."))
        seen.setdefault(pat, type(mod).__name__)
    items = [f"{p} ({c})" for p, c in seen.items()]
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _own_params(mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of ``mod`` itself (if it has direct parameters) and of its ``nn.ParameterDict`` /
    ``nn.ParameterList`` children with parameters: the modules whose parameters ``mod``'s forward reads itself."""
    out = [("", mod)] if any(True for _ in mod.parameters(recurse=False)) else []
    return out + [(n, c) for n, c in mod.named_children()
                  if isinstance(c, (nn.ParameterDict, nn.ParameterList)) and any(True for _ in c.parameters())]


def _example_pattern(root: nn.Module, wanted: Sequence[str] = ()) -> str | None:
    """A ``block_names`` example from ``root``'s paths: ``<path>.*`` of an ``nn.ModuleList`` of >= 2 children,
    preferring one ending with a pattern in ``wanted`` (the user's ``"model.layers.*"`` gives
    ``"model.model.layers.*"``), then the longest list. ``None``: no such list."""
    lists = [f"{name}.*" for name, mod in root.named_modules()
             if name and isinstance(mod, nn.ModuleList) and len(mod) >= 2]
    if not lists:
        return None
    suffixed = [p for p in lists if any(p.endswith("." + w) for w in wanted)]
    if suffixed:
        return suffixed[0]
    return max(lists, key=lambda p: len(root.get_submodule(p[:-2])))


def discover_blocks(
    root: nn.Module,
    block_classes: Sequence[str | type] | None = None,
    block_names: Sequence[str] | None = None,
) -> list[Block]:
    """Split ``root`` into streamed blocks, in module (= forward) order.

    Rules, for each module in ``named_modules()`` order that is not inside a block already:

    * it matches ``block_classes`` / ``block_names``: a block (with everything below it);
    * it owns parameters directly and some module below it matches: a *container*; its direct
      parameters only form a ``direct`` block and discovery goes on into its children;
    * it owns parameters directly otherwise (embedding, norm, LM head): a block (with everything
      below it).

    Parameters in an ``nn.ParameterDict`` / ``nn.ParameterList`` child count as owned directly by the module
    holding it, which reads them (peft's ``lora_embedding_A`` on an embedding).

    Args:
        root: the module to stream (a ``LightningModule`` or a Hugging Face model).
        block_classes: class names or classes of the repeated blocks (one alone is a list of one). Default: the
            union of ``_no_split_modules`` of every Hugging Face model inside ``root``; without one, the classes
            of :data:`KNOWN_BLOCKS` found in ``root``.
        block_names: ``fnmatch`` patterns of module paths that are blocks (``"model.layers.*"``), like FSDP's wrap
            policy (one alone is a list of one); used together with ``block_classes``.

    Returns:
        Blocks in module order. Every parameter of ``root`` belongs to exactly one slab.

    Raises:
        BlockDiscoveryError: no repeated block class/name matched, a ``block_names`` pattern matches no module
            path, or ``root`` itself owns parameters directly (no module to stream them with).
    """
    classes: list[str | type] = [block_classes] if isinstance(block_classes, (str, type)) else list(block_classes or [])
    names = [block_names] if isinstance(block_names, str) else list(block_names or [])
    if not classes and not names:
        for m in find_hf_models(root):
            classes.extend(m._no_split_modules)
    if not classes and not names:
        classes = known_block_classes(root)
    if not classes and not names:
        raise BlockDiscoveryError(
            f"Cannot find streamable blocks in {type(root).__name__}: no submodule declares "
            "`_no_split_modules` (Hugging Face models do). Pass "
            "`MegaTrainStrategy(block_classes=[YourLayerClass])` (the class of the layer the model repeats or "
            "reuses)" + (f" or `block_names=[{example!r}]`" if (example := _example_pattern(root)) else "")
            + " to name the repeated layers. "
            f"Module paths of {type(root).__name__}: {_module_listing(root)}."
        )
    if _own_params(root):
        own = [".".join(x for x in (sub_name, n) if x)
               for sub_name, sub in _own_params(root) for n, _ in sub.named_parameters(recurse=False)]
        raise BlockDiscoveryError(
            f"{type(root).__name__} owns parameters directly ({own}): they belong to no "
            "submodule, so there is no block to stream them with. Move each into a small nn.Module whose forward "
            "returns it (class Prompt(nn.Module): __init__ sets self.weight = nn.Parameter(...); "
            "forward(self) returns self.weight), assign that module as an attribute and read the parameter by "
            "calling the module (self.prompt() instead of self.prompt); see docs/guide/models-and-hooks.md, \"What a block's forward may do\"."
        )
    modules = [(name, mod) for name, mod in root.named_modules() if name]
    unmatched = [pat for pat in names if not any(fnmatch.fnmatchcase(n, pat) for n, _ in modules)]
    if unmatched:
        example = _example_pattern(root, unmatched)
        raise BlockDiscoveryError(
            f"block_names {unmatched} match no module path of {type(root).__name__}. Module paths "
            f"(numeric indices shown as *): {_module_listing(root)}. Patterns are fnmatch patterns of "
            "these paths, relative to the module given to the strategy (the LightningModule)"
            + (f", e.g. {example!r}." if example else ".")
        )
    class_names = {c if isinstance(c, str) else c.__name__ for c in classes if isinstance(c, (str, type))}
    matched = [name for name, mod in modules
               if type(mod).__name__ in class_names or any(fnmatch.fnmatchcase(name, pat) for pat in names)]
    matched_set = set(matched)

    blocks: list[Block] = []
    n_repeated = 0
    skip: list[str] = []
    for name, mod in modules:
        if any(name.startswith(p + ".") for p in skip) or isinstance(mod, (nn.ParameterDict, nn.ParameterList)):
            continue  # inside a block, or read by the module holding it (_own_params)
        is_block = name in matched_set
        owns = bool(_own_params(mod))
        if not is_block and owns and any(m.startswith(name + ".") for m in matched):
            blocks.append(Block(index=len(blocks), name=name, module=mod, direct=True))
        elif is_block or owns:
            blocks.append(Block(index=len(blocks), name=name, module=mod))
            skip.append(name)
            n_repeated += int(is_block)
    if n_repeated == 0:
        raise BlockDiscoveryError(
            f"No module of {type(root).__name__} matched block classes {classes} / names {names}. "
            "Check the names (module classes are matched by class name, paths by fnmatch) or pass "
            "`block_classes=` / `block_names=` to MegaTrainStrategy. Module paths (numeric indices "
            f"shown as *, class in parentheses): {_module_listing(root)}."
        )

    # slabs: the first block (in module order) that reads a parameter stores it
    owner_of: dict[int, tuple[int, int]] = {}
    for blk in blocks:
        subs = _own_params(blk.module) if blk.direct else blk.module.named_modules()
        stored = 0
        for sub_name, sub in subs:
            for attr, p in sub._parameters.items():
                if p is None:
                    continue
                if id(p) not in owner_of:
                    owner_of[id(p)] = (blk.index, stored)
                    stored += 1
                slab, index = owner_of[id(p)]
                fqn = ".".join(x for x in (blk.name, sub_name, attr) if x)
                blk.params.append(ParamRef(owner=sub, attr=attr, fqn=fqn, param=p, slab=slab, index=index))
    return blocks


def check_floating(blocks: Sequence[Block]) -> None:
    """Raise ``TypeError`` if a parameter is not floating point (nothing to train in fp32)."""
    for ref in (ref for blk in blocks for ref in blk.params if ref.slab == blk.index):  # each stored one once
        if not torch.is_floating_point(ref.param):
            raise TypeError(f"Parameter {ref.fqn} has dtype {ref.param.dtype}; only floating parameters are supported.")
