"""``MegaTrainPrecision``: the precision plugin of the ``megatrain`` strategy.

It owns the optimizer step: Lightning's closure runs the training step and
``loss.backward()`` (the engine streams blocks and sends gradients to the host),
then the plugin waits for the gradients, exposes them as ``param.grad`` views of
the fp32 host accumulators, runs ``on_before_optimizer_step`` and gradient
clipping exactly as Lightning's base plugin does, and hands the step to the
host AdamW (never to the user's optimizer's own ``step``).

Supported now: ``"32-true"`` (fp32 compute on fp32 master weights). The mixed
precisions are tracked in issue 3; any other string raises
:class:`UnsupportedPrecisionError` naming the supported choices.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import Precision

SUPPORTED_PRECISION = ("32-true", "32", 32)


class UnsupportedPrecisionError(ValueError):
    """The requested precision is not implemented by the megatrain strategy."""


class MegaTrainPrecision(Precision):
    """Precision plugin for :class:`~megatrain_lightning.strategy.MegaTrainStrategy`.

    Args:
        precision: ``"32-true"``: fp32 master weights, fp32 compute copies, fp32 gradients.

    Raises:
        UnsupportedPrecisionError: any other precision.
    """

    def __init__(self, precision: str | int = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise UnsupportedPrecisionError(
                f"megatrain supports precision='32-true' (fp32 master weights and compute); got {precision!r}. "
                "Use Trainer(precision='32-true') (the default)."
            )
        self.precision = "32-true"  # type: ignore[assignment]
        self.engine = None  # set by the strategy

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the weight copies streamed to the device."""
        return torch.float32

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, Lightning's pre-step hooks and clipping, then the host AdamW step.

        Returns the closure's result (the loss Lightning logs), as ``Optimizer.step(closure)`` does.
        """
        engine = self.engine
        if engine is None:
            raise RuntimeError("MegaTrainPrecision is only usable with strategy='megatrain'.")
        closure_result = closure()
        engine.attach_grads()
        self._after_closure(model, optimizer)
        engine.step()
        return closure_result


def to_megatrain_precision(plugin: Precision | None) -> MegaTrainPrecision | None:
    """Convert the generic plugin Lightning's connector builds from ``precision=`` into ours.

    Raises:
        UnsupportedPrecisionError: the plugin stands for a precision we do not support.
    """
    if plugin is None or isinstance(plugin, MegaTrainPrecision):
        return plugin
    if type(plugin) is Precision:
        return MegaTrainPrecision("32-true")
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise UnsupportedPrecisionError(
        f"megatrain supports precision='32-true'; the Trainer asked for {name!r} ({type(plugin).__name__}). "
        "Use Trainer(precision='32-true')."
    )
