"""Host <-> device transfers: CUDA streams, pinned memory and events, or CPU threads.

The engine calls the same operations on every device:

* :meth:`to_device` (on the H2D worker thread): copy a host slab (the fp32 master, a
  bf16/fp16 shadow, or a mixed wire image, see :mod:`.wire`) into a fresh device buffer
  of the compute dtype, return it with an event that marks the copy done;
* :meth:`ready` (on the compute thread): make the compute stream wait for that
  event before the buffer is read;
* :meth:`stage_grads` (compute thread, then the D2H worker thread): pack a block's
  parameter gradients on the compute stream and return ``run(consume)``, which the D2H
  worker calls to copy them to the host and hand host views to the accumulation;
* :meth:`offload` / :meth:`restore_async` + :meth:`ready`: saved activations to host memory and back
  (the restore is started one block call ahead of backward by :mod:`.offload`);
* :meth:`released` / :meth:`last_read_done`: bound how far the H2D worker runs ahead of the
  compute stream, and make the optimizer wait for the last read of a master it writes.

On CUDA the H2D and D2H copies run on their own streams from pinned memory, so
they overlap kernels on the compute stream; on CPU the "device" buffer is a
separate host tensor filled by a worker thread, so CI runs the same schedule.
"""

from __future__ import annotations

import collections
import queue
from typing import Callable, Sequence

import torch

from .wire import WireLayout


class CPUTransport:
    """Transfers for ``device.type == "cpu"``: copies done by worker threads.

    Args:
        zero_copy: bind blocks straight to the host master slabs instead of copying
            them into a separate buffer (saves one memcpy of the block per fetch; the
            schedule, prefetch and accounting are unchanged).
    """

    def __init__(self, device: torch.device, zero_copy: bool = False):
        self.device = device
        self.zero_copy = zero_copy

    def to_device(self, host: torch.Tensor, dtype: torch.dtype = torch.float32,
                  layout: WireLayout | None = None) -> tuple[torch.Tensor, None]:
        """Copy ``host`` (``[n]``, fp32 master or bf16/fp16 wire copy) into a new buffer of ``dtype``
        (converting on the way); returns ``(buffer, None)``. With a mixed ``layout``, ``host`` is its
        uint8 image and the buffer (``[layout.numel]``) is decoded from it run by run."""
        if layout is not None and layout.dtype is None:
            return layout.decode(host, torch.empty(layout.numel, dtype=dtype)), None
        if self.zero_copy and dtype == host.dtype:
            return host, None
        buf = torch.empty(host.shape, dtype=dtype)
        buf.copy_(host)
        return buf, None

    def ready(self, buf: torch.Tensor, event: object) -> None:
        """Nothing to wait for: the worker's future already completed the copy."""

    def offload(self, t: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Copy a saved activation to host memory (a separate tensor, so the original can be freed)."""
        return t.detach().clone(), None

    def restore(self, host: torch.Tensor, event: object) -> torch.Tensor:
        """Bring an offloaded activation back (on CPU the host copy is used directly)."""
        return host

    def restore_async(self, host: torch.Tensor, event: object) -> tuple[torch.Tensor, None]:
        """Start bringing an offloaded activation back: on CPU the host copy itself, nothing to wait for."""
        return host, None

    def last_read_done(self, event: object) -> None:
        """Nothing to wait for on CPU."""

    def released(self) -> None:
        """A block's buffers were released by the compute thread (nothing to track on CPU)."""

    def stage_grads(self, grads: Sequence[torch.Tensor], wire: torch.dtype = torch.float32
                    ) -> Callable[[Callable[[list[torch.Tensor]], None]], None]:
        """Return ``run(consume)`` (called on the D2H worker) that hands ``consume`` the gradients as
        host tensors of dtype ``wire`` (same shapes as ``grads``); ``consume`` adds them into fp32."""
        grads = list(grads)

        def run(consume: Callable[[list[torch.Tensor]], None]) -> None:
            consume([g if g.dtype == wire else g.to(wire) for g in grads])

        return run


    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int | None:
        return None


class CUDATransport:
    """Transfers for CUDA: dedicated H2D and D2H streams, pinned staging buffers, events.

    Args:
        device: the CUDA device.
        staging_numel: elements of each pinned D2H staging buffer (the largest trainable slab).
        n_staging: number of staging buffers (2 lets one block's gradients copy while the
            previous block's are being added on the host).
    """

    def __init__(self, device: torch.device, staging_numel: int, n_staging: int = 2, max_inflight: int = 2):
        self.device = device
        # events recorded on the compute stream when a block's buffers were released; the H2D
        # worker waits for the oldest before allocating more, so the host cannot queue work
        # (and device buffers the allocator cannot reuse yet) unboundedly ahead of the GPU
        self._inflight: "collections.deque[torch.cuda.Event]" = collections.deque()
        self.max_inflight = max_inflight
        self.h2d_stream = torch.cuda.Stream(device=device)
        self.d2h_stream = torch.cuda.Stream(device=device)
        self._staging: "queue.Queue[torch.Tensor]" = queue.Queue()
        for _ in range(n_staging):
            self._staging.put(torch.empty(max(staging_numel, 1), dtype=torch.float32, pin_memory=True))

    def to_device(self, host: torch.Tensor, dtype: torch.dtype = torch.float32,
                  layout: WireLayout | None = None) -> tuple[torch.Tensor, object]:
        """Asynchronous H2D copy of the pinned ``host`` slab on the H2D stream; returns ``(buffer, event)``.

        The buffer has ``dtype`` (converted on the device after the copy). With a mixed ``layout``,
        ``host`` is its uint8 image: one H2D copy of the image, then each run is converted into the
        ``[layout.numel]`` buffer on the H2D stream. Waits first until at most ``max_inflight``
        released blocks are still being computed on the GPU."""
        while len(self._inflight) > self.max_inflight:
            self._inflight.popleft().synchronize()
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
            buf = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            buf.copy_(host, non_blocking=True)
            if layout is not None and layout.dtype is None:
                buf = layout.decode(buf, torch.empty(layout.numel, dtype=dtype, device=self.device))
            elif dtype != host.dtype:
                buf = buf.to(dtype)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return buf, ev

    def ready(self, buf: torch.Tensor, event: object) -> None:
        """Compute stream waits for the copy; the allocator learns the buffer is used there."""
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        buf.record_stream(cur)

    def offload(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Asynchronous D2H of a saved activation into pinned memory on the D2H stream.

        The D2H stream waits for the compute stream (``t`` is produced there); ``t`` is
        ``record_stream``-ed so its memory is not reused before the copy ends. Returns the
        pinned host tensor and the copy's completion event.
        """
        cur = torch.cuda.current_stream(self.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_stream(cur)
            t.record_stream(self.d2h_stream)
            host.copy_(t.detach(), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h_stream)
        return host, ev

    def restore(self, host: torch.Tensor, event: object) -> torch.Tensor:
        """H2D of an offloaded activation, ready for the compute stream (:meth:`restore_async` + :meth:`ready`)."""
        buf, ev = self.restore_async(host, event)
        self.ready(buf, ev)
        return buf

    def restore_async(self, host: torch.Tensor, event: object) -> tuple[torch.Tensor, object]:
        """Start the H2D copy of an offloaded activation (pinned ``host``) on the H2D stream, after its D2H
        copy's ``event``; returns ``(device buffer, event of the copy)``. Before the compute stream reads
        the buffer, call :meth:`ready` (waits on the event and ``record_stream``-s the buffer there)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
            if event is not None:
                self.h2d_stream.wait_event(event)
            buf = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            buf.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return buf, ev

    def released(self) -> None:
        """Record on the compute stream that the block just released finishes there."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._inflight.append(ev)

    def last_read_done(self, event: object) -> None:
        """Block the host until a previous H2D read of a master slab finished (before the optimizer writes it)."""
        if event is not None:
            event.synchronize()

    def stage_grads(self, grads: Sequence[torch.Tensor], wire: torch.dtype = torch.float32
                    ) -> Callable[[Callable[[list[torch.Tensor]], None]], None]:
        """Pack gradients into one flat ``wire``-dtype tensor on the compute stream and return ``run(consume)``.

        ``run`` (called on the D2H worker thread) takes a pinned staging buffer, copies the flat
        gradient into it on the D2H stream after the compute stream's event, waits for the copy,
        hands ``consume`` host views (same shapes as ``grads``) and returns the buffer to the pool.
        """
        cur = torch.cuda.current_stream(self.device)
        flat = torch.cat([g.reshape(-1).to(wire) for g in grads]) if grads else torch.empty(0, device=self.device, dtype=wire)
        ev_compute = torch.cuda.Event()
        ev_compute.record(cur)
        shapes = [g.shape for g in grads]

        def run(consume: Callable[[list[torch.Tensor]], None]) -> None:
            staging = self._staging.get()
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
                    self.d2h_stream.wait_event(ev_compute)
                    flat.record_stream(self.d2h_stream)
                    host = staging.view(wire) if wire.itemsize <= 4 else staging
                    host[: flat.numel()].copy_(flat, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.d2h_stream)
                done.synchronize()
                out, off = [], 0
                for shp in shapes:
                    n = shp.numel()
                    out.append(host[off : off + n].view(shp))
                    off += n
                consume(out)
            finally:
                self._staging.put(staging)

        return run


    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)


def make_transport(device: torch.device, staging_numel: int, zero_copy_cpu: bool = False):
    """Pick the transport for ``device`` (``cpu`` or ``cuda``); raises ``ValueError`` for others."""
    if device.type == "cpu":
        return CPUTransport(device, zero_copy=zero_copy_cpu)
    if device.type == "cuda":
        return CUDATransport(device, staging_numel)
    raise ValueError(f"megatrain supports accelerator 'cpu' and 'gpu' (CUDA); got device {device}.")
