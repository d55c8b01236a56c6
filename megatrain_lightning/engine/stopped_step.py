"""Whether the weights and optimizer state are one step's: a step stopped after part of its in-backward updates is
remembered, and training, evaluation and saving are refused on it until a checkpoint is loaded.

Why refuse rather than undo (``optimizer_in_backward`` updates slabs during the backward; undoing needs 16 bytes
per trainable parameter of copies): docs/internals/optimizer.md, "A step that stops".
"""

from __future__ import annotations

from .grads import GradientSink

MIXED_STEP = (
    "megatrain: optimizer step {step} stopped after its backward had already applied part of the updates "
    "(optimizer_in_backward), so the weights and optimizer state mix two steps: {action} is refused on them (it "
    "would continue from, or save, weights no training run ever had). Load the last checkpoint to go on "
    "(trainer.fit(model, ckpt_path=...) restores a consistent state). To have any exception leave a consistent "
    "model, set optimizer_in_backward=False: every update then runs in the optimizer step (on the NVMe tier the "
    "gradient accumulators are then written to NVMe and read back: 8 bytes more I/O per trainable parameter and "
    "step). Ctrl-C is safe either way: it stops the run once the step is complete.")


class StoppedStep:
    """Tracks the optimizer step a stop left half applied (``grads.updates_started``: the backward queued one).

    Attributes:
        step: the description of that step (e.g. ``"3 (global_step 2 -> 3, stopped by RuntimeError)"``), or ``None``
            while the weights and optimizer state are one step's.
    """

    def __init__(self, grads: GradientSink):
        self._grads = grads
        self.step: str | None = None

    def stopped(self, step: str) -> None:
        """The optimizer step ``step`` (a description for messages) was stopped by an exception: remember it if its
        backward had queued an update; the step's update plan is over either way."""
        if self._grads.updates_started():
            self.step = step
        self._grads.close_plan()

    def completed(self) -> None:
        """The optimizer step completed: its in-backward updates are all in, its update plan is over."""
        self._grads.close_plan()

    def check(self, action: str, error: type[Exception] = RuntimeError) -> None:
        """Refuse ``action`` (e.g. ``"training"``, ``"saving a checkpoint"``) on a half-applied step.

        Raises:
            error: the message names the step, why and what to do.
        """
        if self.step is not None:
            raise error(MIXED_STEP.format(step=self.step, action=action))

    def restored(self) -> None:
        """Every weight and optimizer state was just loaded from a checkpoint: consistent again."""
        self.step = None
