"""``MegaTrainStrategy.summon_full_params``: the module's parameters hold their current fp32 weights inside the
context (with several processes: every rank enters it, and the node's shared weights get the edit once).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator

import torch

from ..placeholder_guard import format_gib
from .groups import ProcessGroups
from .node_share import weights_written


@contextlib.contextmanager
def summon_full_params(engine: Any, module: torch.nn.Module, writeback: bool, groups: ProcessGroups | None,
                       barrier: Callable[[str], None]) -> Generator[None, None, None]:
    """Inside this context the parameters of ``module`` hold their current fp32 weights, to read or edit from a hook
    or callback, as FSDP's ``summon_full_params`` (docs/guide/models-and-hooks.md, "Weights on NVMe:
    ``summon_full_params``": placeholders, ``writeback=False``, the ``host_memory_limit`` check).

    Pending optimizer updates are applied first. On exit with ``writeback=True`` the values the parameters hold
    (in-place edits, or ``param.data = tensor`` of the same shape) are written into the store and the prefetched
    copies dropped; if the block raises, nothing is written back. Contexts nest: an inner one leaves an enclosing
    one's parameters as they are, and each writes back its own. Use it from hooks outside the model's forward and
    backward, not inside a block's forward (there the parameters are bound to the device copies). An arithmetic
    write (``mul_``) into a one-element NVMe placeholder leaves its NaN a NaN undetected: edit such parameters
    inside this context too. With several processes and ``writeback=True`` every rank must enter it (it meets the
    others on entry and exit) and compute the same edit: each rank edits its own copy, as under DDP, and the
    node's shared weights get the result once.

    Example (a weight-norm callback on the NVMe tier)::

        with trainer.strategy.summon_full_params(pl_module.model.lm_head, writeback=False):
            norm = pl_module.model.lm_head.weight.norm()

    Raises:
        ValueError: with the weights on NVMe, the requested parameters' fp32 bytes exceed ``host_memory_limit``
            (checked before anything is read): pass a submodule.
    """
    if engine is None:
        yield
        return
    params = list(module.parameters())
    if engine.store.masters_on_disk and engine.host_memory_limit is not None:
        need = sum(p.numel() * 4 for p in params if id(p) in engine.store.index)
        if need > engine.host_memory_limit:
            raise ValueError(
                f"megatrain: summon_full_params would read {format_gib(need / 2**30)} of fp32 weights from NVMe into "
                f"host RAM, more than host_memory_limit ({format_gib(engine.host_memory_limit / 2**30)}). Pass the "
                "submodule you need (e.g. pl_module.model.lm_head), or raise host_memory_limit.")
    engine.flush()
    # several processes, writing back: each rank edits its own copy; the result is written once per value
    private = groups is not None and writeback
    summoned = engine.params.summon(params, private)
    if private:
        barrier("summon_full_params: every rank has read the weights")
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            if private and not failed:
                barrier("summon_full_params: every rank is done with its copy")
            engine.params.unsummon(summoned, writeback and not failed)  # a half-made edit is not written
            if private and not failed:
                if engine.store.masters_on_disk:  # owners' writes reach their files; window copies dropped
                    weights_written(groups, engine.store)
                else:
                    barrier("summon_full_params: the weights are written")
        finally:
            if writeback:
                engine.weights_written()
