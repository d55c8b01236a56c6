"""Lightning's subprocess script launcher, with a watch on the child ranks that names the one that died and stops
the rest (docs/internals/data-parallel.md, "Faults and bad input": the launcher). Lightning's own observer SIGKILLs
local rank 0 with the others when a child fails, often before it can say why. The rendezvous settings are checked
before this launcher is made (:func:`~.preflight.check_rendezvous`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from .lifetime import ENV, parent_env


def how_it_ended(returncode: int) -> str:
    """``"was killed by signal 9 (SIGKILL)"`` for a negative Popen return code, else ``"exited with code N"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


class ChildWatch(threading.Thread):
    """Watches local ranks 1..N-1 (``procs[i]`` is local rank ``i + 1``) of node ``node_rank``.

    Args:
        procs: the children, as the launcher started them.
        first_rank: the global rank of local rank 0 (``node_rank * devices``).
        poll_s: seconds between looks.
        grace_s: seconds local rank 0 gets to stop by itself once a child died.
        kill_main: what stops local rank 0 after the grace period (default: SIGKILL to this process).
    """

    def __init__(self, procs: Sequence[subprocess.Popen], first_rank: int, poll_s: float = 0.5, grace_s: float = 5.0,
                 kill_main: Callable[[], None] | None = None):
        super().__init__(daemon=True, name="megatrain-child-watch")  # ends with the main process
        self.procs, self.first_rank, self.poll_s, self.grace_s = list(procs), first_rank, poll_s, grace_s
        self.kill_main = kill_main or (lambda: os.kill(os.getpid(), signal.SIGKILL))
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            codes = [p.poll() for p in self.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                self.on_failure(*failed[0])
                return
            if all(c == 0 for c in codes):
                return

    def on_failure(self, i: int, code: int) -> None:
        rank = self.first_rank + i + 1
        print(f"megatrain: rank {rank} (local rank {i + 1}, pid {self.procs[i].pid}) {how_it_ended(code)}. "
              f"Stopping the other ranks of this node; resume from the last checkpoint.", file=sys.stderr, flush=True)
        kill_all(self.procs)
        if not self.stopped.wait(self.grace_s):  # local rank 0 had its chance to raise its own error
            print(f"megatrain: rank {self.first_rank} did not stop within {self.grace_s:.0f} s after rank {rank} "
                  "died; killing it.", file=sys.stderr, flush=True)
            self.kill_main()


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every process of ``procs`` still running (SIGTERM does not stop one blocked in a collective)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)


def stop_children(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` seconds in all for the children to end by themselves, then SIGKILL the rest."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    kill_all(procs)


def wait_for_children(procs: Sequence[subprocess.Popen]) -> None:
    """At local rank 0's exit: wait until every process of ``procs`` has ended. Not after an uncaught exception
    (``sys.last_value`` set): children waiting for this process in a collective stop by their parent watch."""
    if getattr(sys, "last_value", None) is not None:
        return
    for p in procs:
        p.wait()


class MegaTrainLauncher(_SubprocessScriptLauncher):
    """``_SubprocessScriptLauncher`` with :class:`ChildWatch` instead of Lightning's observer (module docstring).

    Args:
        cluster_environment, num_processes, num_nodes: as for ``_SubprocessScriptLauncher``.
        grace_s: seconds local rank 0 and the children get to stop by themselves after the other side failed.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int, grace_s: float = 5.0):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.grace_s = grace_s

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Start the children (unless a cluster started every process), watch them, run ``function``.

        Raises:
            whatever ``function`` raises, after the children still running ``grace_s`` seconds later were killed.
        """
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        watch = None
        if not env.creates_processes_externally:
            self._call_children_scripts()
            atexit.register(wait_for_children, list(self.procs))
            watch = ChildWatch(self.procs, env.node_rank() * self.num_processes, grace_s=self.grace_s)
            watch.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except Exception:
            if watch is not None:
                watch.stopped.set()
            stop_children(self.procs, self.grace_s)
            raise

    def _call_children_scripts(self) -> None:
        """Lightning's start of local ranks 1..N-1, with :func:`~.lifetime.parent_env` in their environment."""
        before = os.environ.get(ENV)
        os.environ.update(parent_env(self.grace_s))
        try:
            super()._call_children_scripts()
        finally:
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before
