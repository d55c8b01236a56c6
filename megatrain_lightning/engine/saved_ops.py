"""The op outputs a ``"selective"`` block call keeps for its backward (:mod:`.recompute_policy`), with PyTorch's
selective activation checkpointing (SAC): the caching mode around the block's forward, the cached mode around its
recompute. Both run with autograd on and the same leaves, so both see the same op sequence (matched op by op).

Beyond the public API this reads torch's SAC cache (``storage``: op -> index -> pytree of
``_VersionWrapper(val, version)``, and the ``_RECOMPUTE`` marker) to count, offload and retain the kept outputs
and to turn an output modified in place back into a recompute; checked against torch 2.13
(tests/test_recompute_policy.py fails if that layout changes).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten
from torch.utils import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .op_kinds import cheap, expensive, storage_bytes, written_args

# torch's marker of a cache entry to recompute (what a PREFER_RECOMPUTE op gets in the cache); torch releases
# without it (2.11 has none) cannot run "selective": config.check_recompute refuses it there before any work
_RECOMPUTE = getattr(_torch_checkpoint, "_RECOMPUTE", None)


class SavedOps:
    """The op outputs one ``"selective"`` block call keeps, with torch's two SAC modes.

    ``nbytes``: bytes kept (unique storages). Not thread-safe (compute thread only).
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.nbytes = 0
        self._fwd, self._cached = create_selective_checkpoint_contexts(self._policy)
        self._offloaded: list[tuple[Any, tuple]] = []
        self._restoring: list[tuple] | None = None  # per offloaded output: (device copy, its event), once started
        self._kept_storages: set[int] = set()  # storages of the outputs kept so far in this forward

    def _policy(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        written = written_args(func)
        if written and self._kept_storages:
            self._recompute_written(written, args, kwargs)
        if cheap(func, args, kwargs) or (self.mode == "selective" and not expensive(func, args, kwargs)):
            return CheckpointPolicy.PREFER_RECOMPUTE
        for t in tree_flatten(ctx.op_output)[0]:
            if isinstance(t, torch.Tensor):
                self._kept_storages.add(t.untyped_storage().data_ptr())
        return CheckpointPolicy.MUST_SAVE

    def _recompute_written(self, written: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> None:
        """An op wrote into tensors (in place, ``out=``): kept outputs sharing their storages are recomputed
        instead. Torch's version check (:meth:`forward`) misses a write through an alias with its own version
        counter (Falcon's eager attention: ``scores /= c`` after ``bmm`` then ``_unsafe_view``)."""
        hit = set()
        for i, name in written:
            for t in tree_flatten(kwargs.get(name, args[i] if i < len(args) else None))[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._kept_storages:
                    hit.add(t.untyped_storage().data_ptr())
        if hit:
            for entries, i, ws in list(self._entries()):
                if any(w.val.untyped_storage().data_ptr() in hit for w in ws):
                    entries[i] = _RECOMPUTE

    def _entries(self) -> Iterator[tuple[dict, int, list]]:
        # torch's cache: op -> {index: pytree of _VersionWrapper(val, version) or a marker}
        for entries in self._fwd.storage.values():
            for i, entry in entries.items():
                ws = [w for w in tree_flatten(entry)[0] if isinstance(getattr(w, "val", None), torch.Tensor)]
                if ws:
                    yield entries, i, ws

    def _wrappers(self) -> Iterator[Any]:
        for _, _, ws in self._entries():
            yield from ws

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context of the call's forward (autograd on): keeps the outputs the policy selects. An output
        modified in place later in the block (Mixtral's routing weights) is recomputed instead."""
        try:
            with self._fwd:
                yield
        finally:
            self._kept_storages = set()
        for entries, i, ws in list(self._entries()):
            if any(w.val._version != w.version for w in ws):
                entries[i] = _RECOMPUTE
        self.nbytes = storage_bytes([w.val for w in self._wrappers()], set())

    def recompute_returned(self, outputs: list[torch.Tensor]) -> None:
        """After the forward: kept op outputs that the block returns (a block ending in a Linear) are recomputed
        instead, since the caller may change them in place (``y = block(x); y += x``), which torch's SAC refuses
        ("Tensor cached during selective activation checkpoint has been mutated")."""
        mine = {t.untyped_storage().data_ptr() for t in outputs}
        hit = False
        for entries, i, ws in list(self._entries()):
            if any(w.val.untyped_storage().data_ptr() in mine for w in ws):
                entries[i], hit = _RECOMPUTE, True
        if hit:
            self.nbytes = storage_bytes([w.val for w in self._wrappers()], set())

    @contextlib.contextmanager
    def recompute(self, keep_graph: bool) -> Iterator[None]:
        """Context of the call's recompute in backward: kept outputs are returned instead of computed.
        ``keep_graph`` (``retain_graph=True``): the cache stays usable for a further backward."""
        storage = self._fwd.storage
        snapshot = {k: dict(v) for k, v in storage.items()} if keep_graph else None
        try:
            with self._cached:
                yield
        finally:
            if snapshot is not None:
                storage.clear()
                storage.update(snapshot)

    def offload(self, transport: Any) -> int:
        """Move the kept outputs to host memory (``transport.offload``); returns the bytes moved."""
        n = 0
        for w in self._wrappers():
            n += w.val.numel() * w.val.element_size()
            self._offloaded.append((w, transport.offload(w.val)))
            w.val = None
        return n

    @property
    def offloaded(self) -> bool:
        """Kept outputs are in host memory, waiting for :meth:`restore`."""
        return bool(self._offloaded)

    def prefetch(self, transport: Any) -> int:
        """Start bringing the offloaded outputs back (``transport.restore_async``), one block call ahead of
        :meth:`restore`. Returns the bytes whose copy started (0 if already started, or used in place on CPU)."""
        if self._restoring is not None or not self._offloaded:
            return 0
        self._restoring = [transport.restore_async(*host) for _, host in self._offloaded]
        return sum(dev.numel() * dev.element_size() for (dev, _), (_, host) in zip(self._restoring, self._offloaded)
                   if dev is not host[0])

    def restore(self, transport: Any) -> int:
        """Bring the offloaded outputs back for the recompute (the compute stream waits for their copies).
        Returns the bytes whose copy started here (0 when prefetched)."""
        n = self.prefetch(transport)
        for (w, _), (dev, ev) in zip(self._offloaded, self._restoring or []):
            transport.ready(dev, ev)
            w.val = dev
            w.version = w.val._version
        self._offloaded, self._restoring = [], None
        return n

    def free(self) -> None:
        """Drop every kept output (the call's backward ran without ``retain_graph``)."""
        self._fwd.storage.clear()
        self._offloaded, self._restoring = [], None
