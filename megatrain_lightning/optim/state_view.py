"""What ``optimizer.state`` shows while the strategy steps the optimizer on the host.

The user's optimizer never steps, so its ``state`` is empty: this view answers reads with an error that says where
the state is, and resets (``clear()``, ``del``, ``pop``) forget the host state as torch would forget its own.
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
        forget: ``forget(param)`` drops one parameter's state (as ``del opt.state[p]`` in torch),
            ``forget(None)`` every parameter's; pending updates are applied first.

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
