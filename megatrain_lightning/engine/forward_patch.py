"""Replace modules' ``forward`` and put the originals back: the one mechanism behind the block proxies
(``streaming.py``), the chunked MLP (``chunked_mlp.py``) and the chunked head + loss (``head_loss.py``)."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


class ForwardPatches:
    """Modules whose ``forward`` was replaced, with what to restore (an instance attribute the module
    had, or nothing: the class's ``forward`` shows through again)."""

    def __init__(self) -> None:
        self._saved: list[tuple[nn.Module, bool, Any]] = []

    def __bool__(self) -> bool:
        return bool(self._saved)

    def patch(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self._saved.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
        module.forward = forward

    def restore(self) -> None:
        """Put back every replaced ``forward``, last patched first."""
        for module, had, fwd in reversed(self._saved):
            if had:
                module.forward = fwd
            else:
                del module.forward
        self._saved = []
