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
    """Inside this context the parameters of ``module`` (the strategy's default: the whole LightningModule) hold
    their current fp32 weights, to read or edit from a hook or callback, as
    ``FullyShardedDataParallel.summon_full_params`` does for FSDP. In the RAM tier they always do (they are views of the host masters); with the weights on NVMe
    (``offload_params="nvme"``) they are placeholders (NaN) outside it, so a weight norm read there is NaN and a
    write there (``nn.init``, ``fill_``) is refused at the next step or at the end of the run.

    Pending optimizer updates are applied first. On exit with ``writeback=True`` (the default) the values the
    parameters hold then (in-place edits, or ``param.data = tensor`` of the same shape) are written into the
    store and the prefetched copies dropped; pass ``writeback=False`` to only read (with NVMe: no disk writes).
    Do not edit weights under ``writeback=False``: as with FSDP, what happens to such an edit is not defined (the
    NVMe tier drops it, the RAM tier keeps it: its parameters are the weights). Contexts nest: an inner one
    leaves the parameters of an enclosing one as they are, and each writes back its own on exit. If the block
    raises, nothing is written back. Use it from hooks outside the model's forward and backward
    (``on_fit_start``, ``on_train_batch_start``/``_end``, ``on_before_optimizer_step``, validation hooks), not
    inside a block's forward (there the block's parameters are bound to the device copies it computes with).
    A write into a one-element placeholder by arithmetic (``mul_``, ``add_``) leaves its NaN a NaN and is not
    detected: edit such parameters inside this context too.
    With several processes and ``writeback=True`` every rank must enter it (it meets the others on entry and
    exit) and compute the same edit: each rank edits a copy of its own, as each rank of DDP edits its own
    replica, and the node's shared weights get the result once (an in-place ``mul_`` on every rank straight into the shared weights would be
    applied once per rank).

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
