"""Block groups: several consecutive blocks fetched as one transfer unit.

A fetch has a fixed cost besides its bytes (docs/internals/streaming.md, "Per-block cost"), not hidden
where blocks are small (SmolLM2-135M: 14 MB per decoder layer). With ``block_group=G`` the H2D worker
fetches ``G`` consecutive decoder layers in one task; each member completes its own future and keeps its
own buffers (exact live-byte accounting and release; members not used are released unused). Which blocks
group: :func:`form_groups`. A fetch copies only the members the fetch sequence uses from it
(:meth:`GroupSchedule.run_at`; ``recompute_every`` chains and ``recompute="none"`` may use fewer).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from ..blocks import Block
from ..config import check_block_group


def form_groups(blocks: Sequence[Block], size: int) -> list[tuple[int, ...]]:
    """Partition the block indices into transfer units of at most ``size`` consecutive blocks.

    Args:
        blocks: the model's blocks, indexed by ``Block.index``.
        size: blocks per group (``block_group``); 1 gives one group per block.

    Returns:
        Groups in index order, each a tuple of block indices; every block is in exactly one group. A block
        joins its neighbours only when they share its module class, it owns exactly one slab no other block
        reads, and it is not a container's own parameters (``Block.direct``).

    Raises:
        ValueError: ``size`` is not an int >= 1.
    """
    check_block_group(size)
    readers: dict[int, set[int]] = {}
    for blk in blocks:
        for si in blk.slabs:
            readers.setdefault(si, set()).add(blk.index)
    groups: list[tuple[int, ...]] = []
    run: list[int] = []
    for blk in blocks:
        alone = blk.direct or blk.slabs != [blk.index] or readers.get(blk.index, set()) != {blk.index}
        other = bool(run) and type(blocks[run[-1]].module) is not type(blk.module)
        if alone or other or len(run) == size:
            if run:
                groups.append(tuple(run))
            run = []
        if alone:
            groups.append((blk.index,))
        else:
            run.append(blk.index)
    if run:
        groups.append(tuple(run))
    return groups


class GroupSchedule:
    """Which group each block is in, and the group fetches a fetch sequence will make.

    Args:
        groups: output of :func:`form_groups` (group key: its first block index).
    """

    def __init__(self, groups: Sequence[tuple[int, ...]]):
        self.group_of: dict[int, int] = {bi: g[0] for g in groups for bi in g}
        self.size = max((len(g) for g in groups), default=1)

    def run_at(self, seq: Sequence[int], p: int) -> tuple[int, ...]:
        """The blocks one fetch at position ``p`` of ``seq`` serves: ``seq[p]`` and the following other members of
        its group, up to another group's block or a repeated member."""
        g = self.group_of[seq[p]]
        out = [seq[p]]
        for bi in seq[p + 1:]:
            if self.group_of[bi] != g or bi in out:
                break
            out.append(bi)
        return tuple(out)

    def iter_upcoming(self, seq: Sequence[int], pos: int, left: set[int]) -> Iterator[tuple[int, ...]]:
        """The fetches of ``seq`` after position ``pos``, lazily, each as :meth:`run_at` (a run fetched
        twice, in a recompute chain, comes at each position).

        Args:
            seq: the fetch sequence (block indices).
            pos: position of the fetch being served now.
            left: the members of the current fetch not used yet (next in ``seq``, no new fetch).
        """
        left, p = set(left), pos + 1
        while p < len(seq) and seq[p] in left:
            left.discard(seq[p])
            p += 1
        while p < len(seq):
            run = self.run_at(seq, p)
            yield run
            p += len(run)
