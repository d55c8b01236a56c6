"""CPU threads of the engine's host work: how many intra-op threads the H2D, D2H and update workers use.

The H2D worker (casts to the wire dtype; deferred updates on the NVMe tier), the D2H worker (gradient adds
into the fp32 accumulators; in-backward updates on the NVMe tier) and the update worker (the host
optimizer's updates on the RAM tier) run torch CPU kernels that use torch's
intra-op thread pool. On a CUDA run the Python thread that launches the GPU kernels needs a core of
its own: with every core busy in a host add, kernel launches queue behind it and the GPU idles.
``host_threads`` sets the workers' intra-op threads; the default on CUDA is
``torch.get_num_threads() - 1`` (torch's default is the number of physical cores, so one core stays
for the launching thread), at least 1. It is derived, not measured on a GPU (no GPU was available
when it was chosen; bench/gpu_check.py reports the D2H worker's add time with it). On a CPU device
the compute thread's own kernels already use every core, so the default there is 1: a worker with
a team of its own oversubscribes the cores, and OpenMP threads spin while they wait. Measured on the
2-core machine (SmolLM2-135M shape, batch 1 x 512, ``recompute="none"``, ``python
bench/recompute_policy.py``): torch's setting (2 per worker) stepped in 1.06-1.08 x plain PyTorch, 1
thread per worker in 1.00 x.

With PyTorch's OpenMP backend (its default on Linux) ``torch.set_num_threads`` called in a thread
sets that thread's team size, but also torch's process-wide count, which every thread started later
takes as its own when it first runs a parallel op. :func:`start_worker` therefore starts the worker at
once and then sets the process-wide count back to the starting thread's: the compute thread and the
threads started later keep their setting, the worker keeps its own.

A worker on a CUDA run also makes the run's device current on itself first (the current device is
per thread and starts at ``cuda:0``): what it creates without an explicit device (events, pinned
registrations, streams) then belongs to that device, not to another rank's GPU 0.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch


def resolve_host_threads(host_threads: int | None, device: torch.device) -> int | None:
    """The workers' intra-op thread count: ``host_threads`` if given, else on CUDA
    ``max(1, torch.get_num_threads() - 1)`` and on CPU 1 (module docstring); ``host_threads`` is checked by
    :class:`~megatrain_lightning.config.MegaTrainConfig`.
    """
    if host_threads is not None:
        return host_threads
    if torch.device(device).type == "cuda":
        return max(1, torch.get_num_threads() - 1)
    return 1


def worker_initializer(threads: int | None, device: torch.device | None = None) -> Callable[[], None] | None:
    """``ThreadPoolExecutor(initializer=...)`` for a host worker: makes ``device`` current when it is a CUDA
    device (``torch.cuda.set_device``), then sets the worker's intra-op threads to ``threads``; ``None`` when
    there is nothing to do (no CUDA device, ``threads=None``: torch's setting)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if threads is None and not cuda:
        return None
    # "cuda" without an index is the caller's current device, resolved here on the calling thread (the worker's
    # own current device would be cuda:0, and torch.cuda.set_device refuses a device without an index)
    index = (torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()) \
        if cuda else None

    def init() -> None:
        if cuda:
            torch.cuda.set_device(index)
        if threads is not None:
            torch.set_num_threads(threads)
            # torch reads its process-wide count once per thread, at the thread's first parallel op or query:
            # done now, while it is ``threads``, so that start_worker's restore cannot reach this thread
            torch.get_num_threads()

    return init


_START_LOCK = threading.Lock()


def start_worker(name: str, threads: int | None, device: torch.device | None = None,
                 workers: int = 1) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads (names ``name``) started now, each with
    :func:`worker_initializer`'s setup; afterwards the process-wide intra-op thread count is the calling
    thread's again (module docstring), so only the workers run with ``threads``."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=worker_initializer(threads, device))
    if threads is None:
        return pool
    with _START_LOCK:
        mine = torch.get_num_threads()
        started = threading.Barrier(workers + 1)
        # each job holds its thread until all have started, so every thread exists and ran its initializer
        jobs = [pool.submit(started.wait) for _ in range(workers)]
        started.wait()
        for job in jobs:
            job.result()
        torch.set_num_threads(mine)
    return pool
