"""Block groups: several consecutive blocks fetched as one transfer unit (``block_group``), paying a fetch's fixed
cost once per group where blocks are small (SmolLM2-135M: 14 MB per decoder layer). The rules:
docs/internals/streaming.md, "Block groups"; which blocks group: :func:`form_groups`; what a fetch copies:
:meth:`GroupSchedule.run_at`.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from ..blocks import Block
from ..config import check_block_group


def form_groups(blocks: Sequence[Block], size: int) -> list[tuple[int, ...]]:
    """Partition the block indices into transfer units of at most ``size`` (``block_group``) consecutive blocks.

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
    """Which group each block is in (``groups`` from :func:`form_groups`; a group's key: its first block index),
    and the group fetches a fetch sequence will make."""

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
        """The fetches of the fetch sequence ``seq`` after position ``pos`` (the one served now), lazily, each as
        :meth:`run_at` (a run fetched twice, in a recompute chain, comes at each position). ``left``: the members
        of the current fetch not used yet (next in ``seq``, no new fetch)."""
        left, p = set(left), pos + 1
        while p < len(seq) and seq[p] in left:
            left.discard(seq[p])
            p += 1
        while p < len(seq):
            run = self.run_at(seq, p)
            yield run
            p += len(run)
