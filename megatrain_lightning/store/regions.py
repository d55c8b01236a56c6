"""The regions of a slab, by name."""

from __future__ import annotations

from enum import Enum


class Region(str, Enum):
    """The fp32 regions of a slab: ``master`` (all its parameters), and for its trainable prefix the AdamW states
    and the gradient accumulator (``HostStore.hold``'s keys; the NVMe block file's regions). A ``str`` enum."""

    master = "master"
    exp_avg = "exp_avg"
    exp_avg_sq = "exp_avg_sq"
    grad_accum = "grad_accum"

    def __str__(self) -> str:
        return self.value
