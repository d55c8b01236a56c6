"""What ``optimizer.state`` shows while the strategy steps the optimizer on the host.

The user's ``torch.optim.AdamW`` never steps (:class:`~.host_adamw.HostAdamW` does, on the host store), so its
``state`` stays empty. Left as torch's ``defaultdict``, code that reads it (``opt.state[p]["exp_avg"]``) got a
bare ``KeyError`` and left an empty entry behind, and code that resets it (``opt.state.clear()``, to restart AdamW
moments at an epoch boundary) changed nothing. This view answers reads with an error that says where the state
is, and resets the host state where torch's optimizer would forget its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class HostStateError(KeyError):
    """``optimizer.state[p]`` read while the strategy holds the AdamW state in its host store."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class HostStateView(dict):
    """An empty ``optimizer.state`` whose reset operations reach the host AdamW state.

    Args:
        forget: ``forget(param)`` drops one parameter's AdamW state (its next update starts at step 0 with zero
            moments, as after ``del opt.state[p]`` in torch), ``forget(None)`` every parameter's; pending updates
            are applied first (they belong to the state being dropped).

    Raises:
        HostStateError: (a ``KeyError``) on ``view[param]``: read the state with ``optimizer.state_dict()``.
    """

    def __init__(self, forget: Callable[[torch.Tensor | None], None]):
        super().__init__()
        self._forget = forget

    def __missing__(self, key: Any) -> Any:
        raise HostStateError(
            "megatrain: optimizer.state is empty while strategy='megatrain' trains: the optimizer state (AdamW's "
            "exp_avg, exp_avg_sq, step, or another class's) lives in the strategy's host store. Read it with "
            "optimizer.state_dict() (torch's format); reset it with optimizer.state.clear() or del optimizer.state[param].")

    def clear(self) -> None:
        self._forget(None)

    def __delitem__(self, key: Any) -> None:
        self._forget(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._forget(key)
        return default[0] if default else {}
