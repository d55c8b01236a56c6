"""The error every unusable directory checkpoint raises."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used or written: missing, damaged, assembled from other checkpoints,
    written for another model, or holding tensors that would not load back. The message names the
    file or folder and says what to do."""
