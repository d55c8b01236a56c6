"""Checks of ``MegaTrainStrategy``'s switch options, run when the strategy is built (before any work).

The numeric and named options are checked by the modules that own them (``lookahead`` by
``engine/prefetch.py``, ``recompute`` by ``engine/recompute_policy.py``, the NVMe settings by
``store/nvme.py``...); here: the on/off switches, and options that only take effect together with another.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any


def check_switches(optional: tuple[str, ...] = (), **switches: Any) -> None:
    """Each switch is ``True`` or ``False`` (those named in ``optional`` may also be ``None``: automatic).

    A string such as ``"false"`` is truthy in Python and would silently mean the opposite, so it is refused.

    Raises:
        ValueError: the first switch that is not a bool, naming its option and Hydra key.
    """
    for name, value in switches.items():
        if isinstance(value, bool) or (value is None and name in optional):
            continue
        allowed = "True, False or None (automatic)" if name in optional else "True or False"
        raise ValueError(f"megatrain: {name} must be {allowed}, got {value!r}. Set strategy option / Hydra key "
                         f"strategy.{name} (true/false{'/null' if name in optional else ''}).")


def warn_unused_activation_limit(recompute: str, activation_memory_limit: Any) -> None:
    """Warn when ``activation_memory_limit`` is given with a ``recompute`` mode other than ``"auto"`` (only
    ``"auto"`` reads it)."""
    if activation_memory_limit is not None and recompute != "auto":
        warnings.warn(f"megatrain: activation_memory_limit has no effect with recompute={recompute!r}; only "
                      "recompute='auto' chooses per block from that budget.", UserWarning, stacklevel=3)


def check_timeout(timeout: Any) -> timedelta | None:
    """The strategy's ``timeout`` as a ``timedelta``: seconds (int/float > 0), a positive ``timedelta`` or ``None``.

    Raises:
        ValueError: anything else (zero or negative: every collective would fail at once), naming the Hydra key.
    """
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"megatrain: timeout must be a number of seconds > 0, a positive datetime.timedelta or None, "
                         f"got {timeout!r}. Set strategy option / Hydra key strategy.timeout.")
    return timeout
