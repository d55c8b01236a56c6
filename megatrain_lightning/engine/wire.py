"""What crosses the H2D link for each slab under mixed precision, and how the device rebuilds it.

Under ``bf16-mixed`` / ``16-mixed`` a weight travels in bf16/fp16 only when autocast would cast it at every use
anyway (:func:`autocast_casts`), else in fp32; the device rebuilds one fp32 buffer per slab (the upcast is exact,
and autocast's cast back gives the same bits): docs/internals/precision.md, "Wire rule (mixed modes)".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

_ALIGN = 16  # bytes: every run of a wire image starts at a multiple of this


_CASTABLE_FORWARDS: tuple = (nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward,
                              nn.ConvTranspose1d.forward, nn.ConvTranspose2d.forward, nn.ConvTranspose3d.forward)
try:
    from transformers.pytorch_utils import Conv1D  # GPT-2's projections: torch.addmm
except Exception:  # pragma: no cover - transformers always installed with this package
    pass
else:
    _CASTABLE_FORWARDS += (Conv1D.forward,)


def autocast_casts(module: nn.Module, attr: str) -> bool:
    """Whether autocast casts parameter ``attr`` of ``module`` to the autocast dtype at every use: ``weight`` and
    ``bias`` of a module whose ``forward`` is that of ``nn.Linear``, ``nn.Conv{1,2,3}d``, ``nn.ConvTranspose{1,2,3}d``
    or transformers' ``Conv1D`` (ops on autocast's lower-precision list on CPU and CUDA). A False never changes
    results (autocast still casts at use), it only moves 4 instead of 2 bytes.

    Not detected (documented limitation): a Linear called with autocast disabled, or a hook that uses the weight
    in another op; such a weight would see the rounded value where Lightning uses fp32.
    """
    return attr in ("weight", "bias") and type(module).forward in _CASTABLE_FORWARDS


def weights_read_outside_linear(modules: Iterable[nn.Module]) -> set[int]:
    """``id`` of the Linear weights another module also reads outside ``F.linear``, so they travel in fp32: the
    base layer of a peft layer with DoRA (``use_dora`` takes the norm of ``base_layer.weight + scale * B @ A`` in
    fp32; measured: bf16 wire weights 8% off Lightning's bf16-mixed after 3 steps)."""
    out: set[int] = set()
    for m in modules:
        dora = getattr(m, "use_dora", None)
        base = getattr(m, "base_layer", None)
        if isinstance(dora, dict) and any(dora.values()) and isinstance(getattr(base, "weight", None), torch.Tensor):
            out.add(id(base.weight))
    return out


@dataclass(frozen=True)
class WireLayout:
    """How one slab travels H2D: ranges of its fp32 master, each in one wire dtype.

    Attributes:
        numel: elements of the slab (and of the buffer rebuilt on the device).
        runs: ``(start, stop, dtype, byte_offset)`` per range: ``master[start:stop]`` travels as
            ``dtype`` at bytes ``[byte_offset, byte_offset + (stop - start) * dtype.itemsize)`` of
            the image. Ranges are consecutive and cover ``[0, numel)``.
        nbytes: bytes per transfer of the slab: ``numel * itemsize`` (uniform) or the image size (runs padded to
            16 bytes).
    """

    numel: int
    runs: tuple[tuple[int, int, torch.dtype, int], ...]
    nbytes: int

    @staticmethod
    def build(sizes: Sequence[int], dtypes: Sequence[torch.dtype]) -> "WireLayout":
        """Layout of a slab whose entries have ``sizes`` elements (in slab order) and travel as ``dtypes``."""
        runs: list[list] = []
        start = 0
        for n, dt in zip(sizes, dtypes):
            if n == 0:
                continue
            if runs and runs[-1][2] == dt and runs[-1][1] == start:
                runs[-1][1] += n
            else:
                runs.append([start, start + n, dt, 0])
            start += n
        if len({r[2] for r in runs}) <= 1:
            return WireLayout.uniform(start, runs[0][2] if runs else torch.float32)
        off = 0
        for r in runs:
            r[3] = off
            off += -(-(r[1] - r[0]) * r[2].itemsize // _ALIGN) * _ALIGN
        return WireLayout(start, tuple(tuple(r) for r in runs), off)  # type: ignore[misc]

    @staticmethod
    def uniform(numel: int, dtype: torch.dtype) -> "WireLayout":
        """The whole slab in one dtype (``32-true``: the master itself; ``bf16-true``: all bf16)."""
        return WireLayout(numel, ((0, numel, dtype, 0),), numel * dtype.itemsize)

    @property
    def dtype(self) -> torch.dtype | None:
        """The single wire dtype of a uniform layout, ``None`` for a mixed one (a byte image)."""
        return self.runs[0][2] if len(self.runs) == 1 else None

    def empty(self, pin_memory: bool = False) -> torch.Tensor:
        """A host buffer for one encoded slab: ``[numel]`` of the wire dtype (uniform) or ``[nbytes]`` uint8."""
        if self.dtype is not None:
            return torch.empty(self.numel, dtype=self.dtype, pin_memory=pin_memory)
        return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin_memory)

    def image_in(self, raw: torch.Tensor) -> torch.Tensor:
        """The first ``nbytes`` of uint8 ``raw`` as an image: ``[numel]`` of the wire dtype (uniform), else uint8."""
        raw = raw[: self.nbytes]
        return raw.view(self.dtype) if self.dtype is not None else raw

    def _views(self, image: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        if self.dtype is not None:
            return [(0, self.numel, image)]
        return [(s, e, image[off : off + (e - s) * dt.itemsize].view(dt)) for s, e, dt, off in self.runs]

    def encode(self, master: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write fp32 ``master`` (``[numel]``) into ``out`` (from :meth:`empty`), each run cast by ``copy_`` (round
        to nearest even: bitwise autocast's cast); returns ``out``."""
        for s, e, view in self._views(out):
            view.copy_(master[s:e])
        return out

    def decode(self, image: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (``[numel]``, the compute dtype, same device as ``image``) from an encoded image
        (upcasting bf16/fp16 runs: exact); returns ``out``."""
        for s, e, view in self._views(image):
            out[s:e].copy_(view)
        return out
