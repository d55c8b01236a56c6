"""Checks of the user's module before the strategy builds its store (setup; nothing is moved yet).

Refused, with what to change: compiled submodules, float64 parameters and distinct parameters that share memory.
Warned: 16-bit parameters (trained as fp32 masters). The reasons are in each check's docstring.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def refuse_compiled(module: torch.nn.Module) -> None:
    """Raise if a submodule was compiled: ``torch.compile(m)`` (an ``OptimizedModule``), ``m.compile()``, or
    ``m.forward = torch.compile(m.forward)``.

    A compiled module traces into the streaming proxy that replaces each block's forward, where Dynamo fails with
    an internal error in the first step (whole model) or falls back to eager after its recompile limit (one
    block). Lightning itself refuses a compiled LightningModule before this.

    Raises:
        RuntimeError: naming the compiled submodule and what to change.
    """
    for name, m in module.named_modules():
        # nn.Module.compile() keeps the class and stores the compiled call here (torch has no public query)
        compiled_forward = hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable")
        if isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or getattr(m, "_compiled_call_impl", None) \
                or compiled_forward:
            how = "its forward is torch.compile(...)'d" if compiled_forward else "torch.compile(...) or .compile()"
            raise RuntimeError(
                f"megatrain: submodule {name or '(the LightningModule)'} ({type(m).__name__}) is compiled "
                f"({how}), which strategy='megatrain' does not support: the engine streams each block's weights "
                "through its own forward code, which Dynamo cannot trace. Pass the uncompiled module (self.model = "
                "model instead of torch.compile(model); no model.compile() or m.forward = torch.compile(m.forward)).")


def refuse_float64(module: torch.nn.Module) -> None:
    """Raise if any parameter is float64: the store's fp32 masters would silently train it in fp32.

    Raises:
        RuntimeError: with the count and one name.
    """
    names = [n for n, p in module.named_parameters() if p.dtype == torch.float64]
    if names:
        raise RuntimeError(
            f"megatrain: {len(names)} parameters are float64 (e.g. {names[0]}); strategy='megatrain' keeps fp32 "
            "master weights and would train them in fp32. Convert the model with model.float() (and float64 inputs "
            "with .float(); a model built under torch.set_default_dtype(torch.float64) is float64), or train in "
            "float64 with strategy='auto'.")


def refuse_aliased(module: torch.nn.Module) -> None:
    """Raise if two distinct parameters overlap in memory (``b = nn.Parameter(a.data[:n])``): plain PyTorch keeps
    them coupled, the store gives each its own slot. Parameters tied as one object (``b.weight = a.weight``) are
    fine.

    Raises:
        RuntimeError: naming the two parameters.
    """
    spans: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, p in module.named_parameters():  # one entry per parameter object
        if p.device.type == "meta" or p.numel() == 0:
            continue
        size = p.element_size()
        start = p.storage_offset() * size
        extent = (sum((n - 1) * st for n, st in zip(p.shape, p.stride())) + 1) * size
        spans.setdefault(p.untyped_storage().data_ptr(), []).append((start, start + extent, name, p))
    for items in spans.values():
        items.sort(key=lambda x: x[:2])
        for i, (s0, e0, n0, p0) in enumerate(items):
            for s1, e1, n1, p1 in items[i + 1:]:
                if s1 >= e0:
                    break
                if _share_elements(p0, p1):
                    raise RuntimeError(
                    f"megatrain: parameters {n0} and {n1} share memory (one was made from the other's .data or a "
                    "view of it); strategy='megatrain' stores each parameter on its own, so they would stop being "
                    "tied. Tie them as one parameter object (module_b.weight = module_a.weight), or give each its "
                    "own copy (nn.Parameter(w.detach().clone())).")


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte ranges in one storage overlap share an element (interleaved views such as
    ``w[:, 0::2]`` and ``w[:, 1::2]`` do not). Different element sizes count as shared."""
    if a.element_size() != b.element_size():
        return True
    n = a.untyped_storage().nbytes() // a.element_size()
    marks = torch.zeros(n, dtype=torch.int8)
    marks.as_strided(a.shape, a.stride(), a.storage_offset()).fill_(1)
    return bool(marks.as_strided(b.shape, b.stride(), b.storage_offset()).any())


def warn_low_precision(module: torch.nn.Module) -> None:
    """Warn if parameters are 16-bit floats: the store keeps fp32 masters, so the run computes (and the module comes
    back) in fp32, with other numbers than plain Lightning's. One warning per dtype and trainable/frozen."""
    low: dict[tuple[torch.dtype, bool], list[str]] = {}
    for name, p in module.named_parameters():
        if p.dtype in (torch.bfloat16, torch.float16):
            low.setdefault((p.dtype, p.requires_grad), []).append(name)
    for (dtype, trained), names in low.items():
        what = ("they are trained in fp32 (plain Lightning would update the %s weights themselves, with other "
                "numbers)" % str(dtype).replace("torch.", "") if trained else
                "these frozen weights are computed with in fp32 instead of %s (e.g. a QLoRA-style 16-bit base under "
                "fp32 adapters: the adapters' numbers differ from plain Lightning's)" % str(dtype).replace("torch.", ""))
        log.warning(
            "megatrain: %d %s parameters are %s (e.g. %s): strategy='megatrain' keeps fp32 master weights, so %s, "
            "and the module's parameters are fp32 afterwards (twice the memory of %s). Load the model in float32 (no "
            "torch_dtype=...) to silence this; for 16-bit compute use precision='bf16-mixed' or 'bf16-true'.",
            len(names), "trainable" if trained else "frozen", dtype, names[0], what, dtype)
