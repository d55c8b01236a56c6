"""The NVMe tier's host window for an engine: its minimum size, preflight, budget and pinned arena.

One :class:`HostBudget` of ``host_memory_limit`` bytes counts the window's buffers and the H2D staging ring (one
:class:`PinnedArena`), the D2H staging buffers on CUDA and a CPU device's compute buffers (docs/architecture.md,
"NVMe tier"). The arena is pinned before any weight is read: the check that pinning works (``ulimit -l`` does not
limit CUDA's pinned memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from ..blocks import Block
from ..store import heap
from ..store.budget import HostBudget
from ..store.host import slab_layout
from ..store.nvme import NVMeConfig, NVMeStore, preflight_nvme, sweep_stale_stores
from ..store.pinned import PinnedArena, page_up
from ..store.regions import Region
from .accounting import compute_window_bytes
from .staging import RING_SLOTS, ring_bytes_bound


def d2h_staging_bytes(layout: Sequence[tuple[int, int]], device: torch.device) -> int:
    """Pinned bytes of the CUDA transport's 2 D2H staging buffers (fp32, the largest trainable slab each);
    0 on CPU. ``layout``: per slab, ``(numel, trainable numel)``."""
    return 2 * page_up(4 * max((t for _, t in layout), default=0)) if device.type == "cuda" else 0


def window_sizes(blocks: Sequence[Block], nvme: NVMeConfig, device: torch.device | str, lookahead: int,
                 reserve_frozen: bool = False) -> tuple[int, int, int]:
    """The NVMe tier's host window sizes in bytes: ``(min_window, outside, ring)``.

    ``min_window``: the least ``host_memory_limit`` (:func:`~..store.nvme.preflight_nvme` refuses less): the store's
    regions of the largest slab (:meth:`NVMeConfig.min_window`), ``outside`` (what shares the budget outside the
    arena: on CPU the compute buffers, :func:`compute_window_bytes`, less its wire image; on CUDA the D2H staging
    buffers) and ``ring`` (the H2D staging ring, masters on NVMe; a CPU copy gives its slot back at once). Reads
    only shapes: a meta-device model gives the same numbers (the planner's preflight). ``lookahead``: the engine's
    ``ahead`` (blocks fetched ahead of the one computing); ``reserve_frozen``: ``store.host.slab_layout``'s."""
    device = torch.device(device)
    slabs = slab_layout(blocks, reserve_frozen)
    layout = [(n, t) for _, n, t in slabs]
    cpu = device.type == "cpu"
    image = max((page_up(4 * n) for n, _ in layout), default=0)
    outside = compute_window_bytes(layout, blocks, lookahead) - image if cpu else d2h_staging_bytes(layout, device)
    min_window = nvme.min_window(nvme.own(layout)) + outside
    ring = ring_bytes_bound([(n, len(e)) for e, n, _ in slabs]) if Region.master in nvme.kinds else 0
    if ring:
        min_window += ring // RING_SLOTS if cpu else ring
    elif cpu:
        min_window += image
    return min_window, outside, ring


def nvme_window(blocks: Sequence[Block], nvme: NVMeConfig, device: torch.device, lookahead: int,
                pin: bool | None, reserve_frozen: bool = False) -> tuple[HostBudget, int, Callable[[list[tuple[int, int]]], NVMeStore]]:
    """Check the NVMe tier can run, then make its budget and pinned arena.

    Arguments as :func:`window_sizes`; ``pin``: ``pin_memory`` as the engine resolved it (``None``: try, fall
    back with a warning).

    Returns:
        ``(budget, min_window bytes, layout -> NVMeStore factory for build_store)``.

    Raises:
        ValueError: preflight refused the run (:func:`preflight_nvme`: disk, path, ``host_memory_limit``
            below the minimum window, which includes the D2H staging and the H2D ring on CUDA).
        HostPinningError: ``pin is True`` and the arena could not be page-locked.
    """
    # data parallel: only the slabs this process updates have regions on its disk
    mine = nvme.own([(n, t) for _, n, t in slab_layout(blocks, reserve_frozen)])
    min_window, outside, ring = window_sizes(blocks, nvme, device, lookahead, reserve_frozen)
    if Path(nvme.path).is_dir():  # stores a killed run left (another number of processes): their disk back first
        sweep_stale_stores(nvme.path, {nvme.store_dir, *nvme.run_dirs})
    preflight_nvme(nvme.path, mine, nvme.host_memory_limit, min_window, nvme.store_dir, nvme.ranks_sharing)
    budget = HostBudget(nvme.host_memory_limit)
    budget.reserve(0 if device.type == "cpu" else outside, what="D2H staging buffers")  # d2h_staging_bytes
    heap.bound_heap()  # freed buffers leave the process (the budget counts only live ones)
    # what the process holds for the tier, arena + what is outside it, is then at most host_memory_limit
    arena = PinnedArena(nvme.window_bytes(mine, reserved=outside, staging=ring), pin=pin)

    def factory(layout: list[tuple[int, int]]) -> NVMeStore:
        return NVMeStore(nvme.path, nvme.own(layout), budget, store_dir=nvme.store_dir, remote=nvme.remote_files(layout), io_threads=nvme.io_threads, io_block_size=nvme.io_block_size,
                         read_ahead=nvme.read_ahead, direct_io=nvme.direct_io, keep_files=nvme.keep_files, arena=arena)

    return budget, min_window, factory
