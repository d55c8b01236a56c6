"""Global batches of one epoch's order, and each data-parallel rank's share of them.

Definitions (used by :class:`~megatrain_lightning.data.ResumableDataLoader`): an epoch is one order of the
``n`` sample indices (the same list on every rank). With ``world_size`` ranks of ``batch_size`` samples
each, the global batch is ``G = batch_size * world_size`` samples and the global step that starts at
position ``p`` (samples of the order already consumed) takes ``order[p : p + G]``; rank ``r`` takes the
contiguous slice ``order[p + r * batch_size : p + (r + 1) * batch_size]``. Concatenating the ranks' batches
of a step in rank order gives exactly the batch of one process with batch size ``G`` at that step.

The tail (``t = n - p < G`` samples left):

* ``drop_last=True``: dropped, at every world size (as ``DataLoader(drop_last=True)`` with batch ``G``).
* ``drop_last=False`` and ``t >= world_size``: one last step, split as evenly as possible in rank order
  (``t // world_size`` samples each, one more for the first ``t % world_size`` ranks), so its union is
  still the one-process tail batch; the per-rank batches then differ by at most one sample.
* ``drop_last=False`` and ``0 < t < world_size``: dropped (a rank cannot take an empty batch: every rank
  must run the same number of steps). Only then does a run with several ranks see fewer samples than one
  process (at most ``world_size - 1`` per epoch). One process (``world_size == 1``) never drops here.
"""

from __future__ import annotations


def _check(n: int, start: int, batch_size: int, world_size: int, rank: int = 0) -> None:
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    if not 0 <= start <= n:
        raise ValueError(f"start must be in [0, {n}] (samples of the epoch consumed), got {start}.")


def steps_left(n: int, start: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    """Global steps of an epoch of ``n`` samples from position ``start`` (= batches each rank yields); the other
    arguments as in :func:`rank_share`.

    Raises:
        ValueError: a size below 1 or ``start`` outside ``[0, n]``.
    """
    _check(n, start, batch_size, world_size)
    full, tail = divmod(n - start, batch_size * world_size)
    return full + int(tail > 0 and not drop_last and tail >= world_size)


def consumed(n: int, start: int, steps: int, batch_size: int, world_size: int) -> int:
    """Position (samples of the order consumed) after ``steps`` global steps from ``start``; at most ``n``."""
    return min(n, start + steps * batch_size * world_size)


def share_size(n: int, start: int, batch_size: int, world_size: int, rank: int, drop_last: bool) -> int:
    """``len(rank_share(order, ...))`` for ``len(order) == n``, without building it (same arguments and errors)."""
    _check(n, start, batch_size, world_size, rank)
    steps = steps_left(n, start, batch_size, world_size, drop_last)
    full = min(steps, (n - start) // (batch_size * world_size))
    if steps == full:
        return full * batch_size
    each, extra = divmod(n - start - full * batch_size * world_size, world_size)
    return full * batch_size + each + int(rank < extra)


def rank_share(order: list[int], start: int, batch_size: int, world_size: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s sample indices of every global step of ``order`` from position ``start``, in step order.

    Batching the result by ``batch_size`` (as ``DataLoader`` does) gives the rank's batch of each step (a tail
    batch may be smaller, module docstring).

    Args:
        order: the epoch's sample indices (the same on every rank).
        start: samples of ``order`` already consumed, ``0 <= start <= len(order)``.
        batch_size: samples per rank per step.
        world_size: data-parallel ranks.
        rank: this rank, ``0 <= rank < world_size``.
        drop_last: drop an incomplete last global batch.

    Raises:
        ValueError: a size below 1, ``rank`` outside ``[0, world_size)`` or ``start`` outside ``[0, len(order)]``.
    """
    n = len(order)
    _check(n, start, batch_size, world_size, rank)
    g = batch_size * world_size
    steps = steps_left(n, start, batch_size, world_size, drop_last)
    full = min(steps, (n - start) // g)
    out: list[int] = []
    for k in range(full):
        lo = start + k * g + rank * batch_size
        out += order[lo : lo + batch_size]
    if steps > full:  # the tail, split as evenly as possible
        p = start + full * g
        each, extra = divmod(n - p, world_size)
        lo = p + rank * each + min(rank, extra)
        out += order[lo : lo + each + int(rank < extra)]
    return out
