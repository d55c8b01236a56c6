"""CPU threads of the engine's host work: how many intra-op threads the H2D, D2H and update workers use.

Why (docs/internals/streaming.md, "Threads and streams"): on CUDA one core stays for the thread launching GPU
kernels (default ``torch.get_num_threads() - 1``, derived, not measured on a GPU: bench/gpu_check.py reports the D2H
add time); on a CPU device the default is 1 (measured, 2 cores, SmolLM2-135M shape, ``recompute="none"``,
``bench/recompute_policy.py``: torch's setting 1.06-1.08 x plain PyTorch, 1 thread 1.00 x).

With PyTorch's OpenMP backend ``torch.set_num_threads`` in a thread also sets the process-wide count that threads
started later take, so :func:`start_worker` starts the worker at once and sets the count back. A worker on a CUDA run
makes the run's device current first (the current device is per thread and starts at ``cuda:0``), so what it creates
without an explicit device (events, pinned registrations, streams) belongs to that device.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch


def resolve_host_threads(host_threads: int | None, device: torch.device) -> int | None:
    """The workers' intra-op thread count: ``host_threads`` (checked by
    :class:`~megatrain_lightning.config.MegaTrainConfig`) or the device's default (module docstring)."""
    if host_threads is not None:
        return host_threads
    return max(1, torch.get_num_threads() - 1) if torch.device(device).type == "cuda" else 1


_START_LOCK = threading.Lock()


def start_worker(name: str, threads: int | None, device: torch.device | None = None,
                 workers: int = 1) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads (names ``name``) started now; each makes a CUDA ``device``
    current, then sets its intra-op threads to ``threads``. Afterwards the process-wide intra-op thread count is
    the calling thread's again (module docstring)."""
    cuda = device is not None and torch.device(device).type == "cuda"
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
            # done now, while it is ``threads``, so that the restore below cannot reach this thread
            torch.get_num_threads()

    pool = ThreadPoolExecutor(workers, thread_name_prefix=name,
                              initializer=init if threads is not None or cuda else None)
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
