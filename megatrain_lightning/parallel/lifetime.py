"""Child processes that end with the process that started them (a hanging rank keeps its CPU, memory and port):
:func:`dies_with_this_process` for a ``subprocess.Popen``/``run`` of this package or its tests, and
:func:`parent_env` / :func:`follow_parent_from_env` for the ranks Lightning's subprocess script launcher starts (its
``Popen`` call is Lightning's): each watches its parent (:class:`ParentWatch`) and, once it is gone, gets ``grace_s``
seconds to stop with its own :class:`~.faults.PeerFailure`, as :class:`~.launcher.ChildWatch` treats the other side.
Linux only: elsewhere both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
from typing import Callable, MutableMapping

from ..checkpoint.atomic import pid_alive

ENV = "MEGATRAIN_PARENT"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIGKILL = int(signal.SIGKILL)


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _find_prctl()  # resolved here: a preexec_fn must not import or load anything between fork and exec


def die_with_parent(parent_pid: int) -> None:
    """In a child of ``parent_pid``: have Linux SIGKILL this process when its parent ends; if the parent has
    already ended (this process was re-parented before the request), end now (``os._exit(1)``).

    The signal comes when the *thread* that started the child ends, so start children from a thread that lives as
    long as they should (the main thread). Does nothing off Linux.

    Raises:
        OSError: ``prctl`` refused the request.
    """
    if _PRCTL is None:
        return
    if _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os._exit(1)


def dies_with_this_process() -> Callable[[], None] | None:
    """``subprocess.Popen(..., preexec_fn=dies_with_this_process())``: the child is SIGKILLed when this process
    (the calling thread, see :func:`die_with_parent`) ends. ``None`` off Linux (no ``preexec_fn``)."""
    return functools.partial(die_with_parent, os.getpid()) if _PRCTL is not None else None


def parent_env(grace_s: float) -> dict[str, str]:
    """The environment entry that makes a child started by this process follow it (:func:`follow_parent_from_env`)."""
    return {ENV: f"{os.getpid()}:{grace_s:g}"}


class ParentWatch(threading.Thread):
    """Once this process is re-parented (its parent ended), waits ``grace_s`` seconds for it to stop by itself,
    then says so on stderr and calls ``kill``.

    Args:
        parent_pid: the pid of the process that started this one (for the message).
        grace_s: seconds this process gets to stop with its own error once the parent is gone.
        poll_s: seconds between looks.
        kill: what ends this process after the grace period (default: SIGKILL to this process).
        first_ppid: ``os.getppid()`` while the parent was known to live (default: now).
    """

    def __init__(self, parent_pid: int, grace_s: float, poll_s: float = 0.2, kill: Callable[[], None] | None = None,
                 first_ppid: int | None = None):
        super().__init__(daemon=True, name="megatrain-parent-watch")  # ends with the process
        self.parent_pid, self.grace_s, self.poll_s = parent_pid, grace_s, poll_s
        self.kill = kill or (lambda: os.kill(os.getpid(), signal.SIGKILL))
        self.first_ppid = os.getppid() if first_ppid is None else first_ppid

    def run(self) -> None:
        while os.getppid() == self.first_ppid:
            time.sleep(self.poll_s)
        time.sleep(self.grace_s)
        print(f"megatrain: the process that started this one (pid {self.parent_pid}) has ended and this one "
              f"(pid {os.getpid()}) did not stop within {self.grace_s:g} s; killing it.", file=sys.stderr, flush=True)
        self.kill()


def follow_parent_from_env(environ: MutableMapping[str, str] = os.environ) -> ParentWatch | None:
    """If ``environ`` holds :func:`parent_env`'s entry, remove it (so this process's own children do not inherit it)
    and start a :class:`ParentWatch` on the parent it names; if that parent has already ended, exit now
    (``os._exit(1)``, with a line on stderr). Called when the package is imported.

    Returns:
        The started watch, or ``None`` when the entry is absent, unreadable, or this is not Linux.
    """
    value = environ.pop(ENV, None)
    if not value or _PRCTL is None:
        return None
    try:
        pid_text, grace_text = value.split(":")
        parent_pid, grace_s = int(pid_text), float(grace_text)
    except ValueError:
        return None
    first_ppid = os.getppid()  # the parent itself, or a wrapper between them (then the parent must be alive)
    if first_ppid != parent_pid and not pid_alive(parent_pid):  # it ended before this process got here
        print(f"megatrain: the process that started this one (pid {parent_pid}) has already ended; exiting.",
              file=sys.stderr, flush=True)
        os._exit(1)
    watch = ParentWatch(parent_pid, grace_s, first_ppid=first_ppid)
    watch.start()
    return watch
