"""Host <-> device transfers: CUDA streams, pinned memory and events, or CPU threads.

Both transports offer the same operations. On CPU the "device" buffer is a separate host tensor, so CI runs the same
schedule (docs/internals/streaming.md, "Threads and streams"). Every CUDA event the host waits on is made with
``blocking=True``: the waiting thread sleeps instead of spinning on a core the host AdamW and adds need.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
import threading
from typing import Callable, Sequence

import torch

from ..store.pinned import try_host_buffer
from .cpu_buffers import BufferPool
from .wire import WireLayout

log = logging.getLogger(__name__)


class GradCopy:
    """One gradient batch's copy device -> host, queued by ``stage_grads`` on the compute thread and finished on
    the D2H worker.

    Args:
        host: the host tensors the copy fills (wire dtype, the gradients' shapes).
        done / start: CUDA events recorded on the D2H stream after / before the copy (CPU: ``None``, done).
        release: gives the pinned staging buffer back, or ``None``.
        busy_s: seconds the copy ran (CPU: known now; CUDA: set by :meth:`wait`).
    """

    def __init__(self, host: list[torch.Tensor], done: object = None, start: object = None,
                 release: "Callable[[], None] | None" = None, busy_s: float = 0.0):
        self.host, self._done, self._start, self._release = host, done, start, release
        self.busy_s = busy_s

    def wait(self) -> list[torch.Tensor]:
        """Block until the copy is done; return the host tensors, valid until :meth:`release`."""
        if self._done is not None:
            self._done.synchronize()  # type: ignore[attr-defined]
            if self._start is not None:
                self.busy_s = self._start.elapsed_time(self._done) / 1e3  # type: ignore[attr-defined]
            self._done = None
        return self.host

    def release(self) -> None:
        """The host tensors were consumed: their staging buffer may take the next copy (once)."""
        self.host = []
        if self._release is not None:
            self._release, rel = None, self._release
            rel()


class CPUTransport:
    """Transfers for ``device.type == "cpu"``: copies done by worker threads.

    Args:
        zero_copy: bind blocks straight to the host master slabs (no memcpy per fetch; same schedule).
        reuse_buffers: copy into buffers reused once free (:class:`~.cpu_buffers.BufferPool`); off where freed
            memory must leave the process (the NVMe tier's ``host_memory_limit`` counts live buffers only).
    """

    def __init__(self, device: torch.device, zero_copy: bool = False, reuse_buffers: bool = False):
        self.device = device
        self.zero_copy = zero_copy
        self.pool = BufferPool() if reuse_buffers and not zero_copy else None

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.pool.take(numel, dtype) if self.pool is not None else torch.empty(numel, dtype=dtype)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype = torch.float32,
                  layout: WireLayout | None = None) -> tuple[torch.Tensor, None]:
        """Copy ``host`` (``[n]``, fp32 master or 16-bit wire copy; a mixed ``layout``'s uint8 image) into a new
        ``dtype`` buffer (``[n]`` / ``[layout.numel]``); returns ``(buffer, None)``."""
        if layout is not None and layout.dtype is None:
            return layout.decode(host, self._empty(layout.numel, dtype)), None
        if self.zero_copy and dtype == host.dtype:
            return host, None
        buf = self._empty(host.numel(), dtype).view(host.shape)
        buf.copy_(host)
        return buf, None

    def ready(self, buf: torch.Tensor, event: object) -> None:
        self.last_read_done(event)

    def offload(self, t: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Copy a saved activation to a separate host tensor (the original can be freed)."""
        return t.detach().clone(), None

    def restore(self, host: torch.Tensor, event: object) -> torch.Tensor:
        return host

    def restore_async(self, host: torch.Tensor, event: object) -> tuple[torch.Tensor, None]:
        return host, None

    def last_read_done(self, event: object) -> None:
        """Block until a copy out of a host slab is done (``None``: CPU copies are synchronous)."""
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]

    def when_done(self, event: object, fn: Callable[[], None]) -> None:
        fn()  # a CPU copy is complete when to_device returns

    def settle(self) -> None:
        """Nothing pending on CPU."""

    def released(self) -> None:
        """Nothing to track on CPU."""

    def stage_grads(self, grads: Sequence[torch.Tensor], wire: torch.dtype = torch.float32,
                    reduce: Callable[[torch.Tensor], int | None] | None = None) -> GradCopy:
        """The gradients as host tensors of dtype ``wire`` (``grads``' shapes; converted on the compute thread):
        a finished :class:`GradCopy`.

        Raises:
            ValueError: ``reduce`` given (a CPU device reduces gradients on the host, in the gradient sink)."""
        if reduce is not None:
            raise ValueError("megatrain: a CPU device reduces gradients on the host (gloo), not before the copy.")
        t0 = time.perf_counter()
        host = [self.grad_to_host(g, wire) for g in grads]
        return GradCopy(host, busy_s=time.perf_counter() - t0)

    @staticmethod
    def grad_to_host(g: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        """One gradient on a CPU device's "D2H link": itself, or converted to ``wire``."""
        return g if g.dtype == wire else g.to(wire)

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int | None:
        return None


class CUDATransport:
    """Transfers for CUDA: dedicated H2D and D2H streams, pinned staging buffers, events.

    Args:
        staging_numel: elements of each pinned D2H staging buffer (the largest trainable slab).
        n_staging: number of staging buffers (2: one batch copies while the previous one is added).
    """

    def __init__(self, device: torch.device, staging_numel: int, n_staging: int = 2, max_inflight: int = 2,
                 pin: bool | None = None):
        self.device = device
        # compute-stream events of released blocks: the H2D worker waits for the oldest before allocating more,
        # so the host cannot queue work (and unreusable device buffers) unboundedly ahead of the GPU
        self._inflight: "collections.deque[torch.cuda.Event]" = collections.deque()
        self.max_inflight = max_inflight
        self.h2d_stream = torch.cuda.Stream(device=device)
        self.d2h_stream = torch.cuda.Stream(device=device)
        self.n_staging = n_staging
        self._staging: "queue.Queue[torch.Tensor]" = queue.Queue()
        # callbacks run once an H2D copy's event completed, in submission order (one stream: in order)
        self._done: "queue.Queue[tuple[object, Callable[[], None]]]" = queue.Queue()
        self._done_thread: threading.Thread | None = None
        nbytes = 4 * max(staging_numel, 1)
        for _ in range(n_staging):
            # exactly pinned (store/pinned.py), not rounded up to a power of two; pin_memory's rule
            buf, _ = try_host_buffer(nbytes, pin, "the D2H staging buffers")
            self._staging.put(buf[:nbytes].view(torch.float32))

    def to_device(self, host: torch.Tensor, dtype: torch.dtype = torch.float32,
                  layout: WireLayout | None = None) -> tuple[torch.Tensor, object]:
        """Asynchronous H2D copy of the pinned ``host`` slab on the H2D stream, converted to ``dtype`` on the
        device (a mixed ``layout``: one copy of its image, then run by run); returns ``(buffer, event)``. Waits
        first until at most ``max_inflight`` released blocks are still computing on the GPU."""
        while len(self._inflight) > self.max_inflight:
            self._inflight.popleft().synchronize()
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
            buf = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            buf.copy_(host, non_blocking=True)
            if layout is not None and layout.dtype is None:
                buf = layout.decode(buf, torch.empty(layout.numel, dtype=dtype, device=self.device))
            elif dtype != host.dtype:
                buf = buf.to(dtype)
            ev = torch.cuda.Event(blocking=True)  # the host waits on it (last_read_done)
            ev.record(self.h2d_stream)
        return buf, ev

    def when_done(self, event: object, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a helper thread once ``event`` (from :meth:`to_device`) completed, so the H2D worker
        need not wait to release a copy's source (a window buffer's hold, a staging slot)."""
        if event is None:
            fn()
            return
        if self._done_thread is None:
            self._done_thread = threading.Thread(target=self._run_done, name="megatrain-h2d-done", daemon=True)
            self._done_thread.start()
        self._done.put((event, fn))

    def _run_done(self) -> None:
        while True:
            event, fn = self._done.get()
            try:
                event.synchronize()  # type: ignore[attr-defined]
                fn()
            except Exception:  # noqa: BLE001 - a failed release must not stop the ones after it
                log.exception("megatrain: releasing an H2D copy's source failed")
            finally:
                self._done.task_done()

    def settle(self) -> None:
        """Block until every :meth:`when_done` callback ran (before the window or the ring is torn down)."""
        self._done.join()

    def ready(self, buf: torch.Tensor, event: object) -> None:
        """Compute stream waits for the copy; the allocator learns the buffer is used there."""
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        buf.record_stream(cur)

    def offload(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Asynchronous D2H of a saved activation into pinned memory on the D2H stream, after the compute stream
        (``t`` is ``record_stream``-ed there); returns ``(host tensor, event)``."""
        cur = torch.cuda.current_stream(self.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_stream(cur)
            t.record_stream(self.d2h_stream)
            host.copy_(t.detach(), non_blocking=True)
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.d2h_stream)
        return host, ev

    def restore(self, host: torch.Tensor, event: object) -> torch.Tensor:
        """H2D of an offloaded activation, ready for the compute stream (:meth:`restore_async` + :meth:`ready`)."""
        buf, ev = self.restore_async(host, event)
        self.ready(buf, ev)
        return buf

    def restore_async(self, host: torch.Tensor, event: object) -> tuple[torch.Tensor, object]:
        """Start the H2D copy of an offloaded activation (pinned ``host``) after its D2H copy's ``event``; returns
        ``(device buffer, event)``: call :meth:`ready` before the compute stream reads the buffer."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
            if event is not None:
                self.h2d_stream.wait_event(event)
            buf = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            buf.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return buf, ev

    def released(self) -> None:
        """Record on the compute stream where the block just released finishes."""
        ev = torch.cuda.Event(blocking=True)  # the H2D worker waits on it in to_device
        ev.record(torch.cuda.current_stream(self.device))
        self._inflight.append(ev)

    def last_read_done(self, event: object) -> None:
        """Block the host until a previous H2D read of a master slab finished (before the optimizer writes it)."""
        if event is not None:
            event.synchronize()

    def stage_grads(self, grads: Sequence[torch.Tensor], wire: torch.dtype = torch.float32,
                    reduce: Callable[[torch.Tensor], int | None] | None = None) -> GradCopy:
        """Pack gradients into one flat ``wire``-dtype tensor on the compute stream and queue its copy into a free
        pinned staging buffer on the D2H stream (the packed tensor is ``record_stream``-ed there: its memory is
        free when the copy ends); returns the copy (host views of the gradients' shapes, valid until ``release``).
        On an error the staging buffer is given back first.

        ``reduce`` (data parallel, NCCL: :meth:`~.reduce.GradReducer.reduce_device`, whose ``(out, keep)`` says what
        to copy; the host views get ``out``'s dtype): called on the packed tensor with the D2H stream current, before
        the copy, so the collective is ordered between them while the compute stream goes on.

        Raises:
            RuntimeError: every staging buffer is taken (a caller queued more than ``n_staging`` batches).
        """
        cur = torch.cuda.current_stream(self.device)
        flat = torch.cat([g.reshape(-1).to(wire) for g in grads]) if grads else torch.empty(0, device=self.device, dtype=wire)
        ev_compute = torch.cuda.Event()  # waited on by the D2H stream only, never by the host
        ev_compute.record(cur)
        try:
            staging = self._staging.get_nowait()
        except queue.Empty:
            raise RuntimeError(f"megatrain: more gradient batches in flight than the {self.n_staging} pinned "
                               "D2H staging buffers (the gradient sink bounds them: report this).") from None
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(ev_compute)
                flat.record_stream(self.d2h_stream)
                src, keep = reduce(flat) if reduce is not None else (flat, None)
                host = (staging.view(src.dtype) if src.dtype.itemsize <= 4 else staging)[: src.numel()]
                start = torch.cuda.Event(enable_timing=True, blocking=True)
                start.record(self.d2h_stream)
                if keep is None:
                    host.copy_(src, non_blocking=True)
                else:  # only the tail (another rank owns the gradients)
                    host[src.numel() - keep :].copy_(src[src.numel() - keep :], non_blocking=True)
                done = torch.cuda.Event(enable_timing=True, blocking=True)
                done.record(self.d2h_stream)
        except BaseException:
            # a copy into it queued before the error is ordered before the next batch's on the D2H stream
            self._staging.put(staging)
            raise
        out = [part.view(g.shape) for part, g in zip(host.split([g.numel() for g in grads]), grads)]
        return GradCopy(out, done, start, lambda: self._staging.put(staging))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)


def make_transport(device: torch.device, staging_numel: int, zero_copy_cpu: bool = False,
                   pin: bool | None = None, reuse_cpu_buffers: bool = False):
    """The transport for ``device`` (``pin``: the ``pin_memory`` option for CUDA's pinned D2H staging buffers).

    Raises:
        ValueError: a device type other than ``cpu`` and ``cuda``.
        HostPinningError: ``pin is True`` and the staging buffers cannot be page-locked."""
    if device.type == "cpu":
        return CPUTransport(device, zero_copy=zero_copy_cpu, reuse_buffers=reuse_cpu_buffers)
    if device.type == "cuda":
        return CUDATransport(device, staging_numel, pin=pin)
    raise ValueError(f"megatrain supports accelerator 'cpu' and 'gpu' (CUDA); got device {device}.")
