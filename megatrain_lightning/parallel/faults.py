"""A rank that died or hangs: the other ranks stop with an error that names it, instead of a transport message
that names no rank (docs/internals/data-parallel.md, "Faults and bad input": a rank dies).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch.distributed as dist


class PeerFailure(RuntimeError):
    """Another rank of the run died or stopped answering; this rank stops (resume from the last checkpoint)."""


_TRANSPORT_WORDS = ("connection", "timed out", "timeout", "closed", "reset by peer", "broken pipe", "socket", "nccl",
                    "gloo", "watchdog", "peer")


def is_transport_error(err: BaseException) -> bool:
    """Whether a collective's exception reports a failed peer or link: a ``torch.distributed`` ``DistError``, or a
    ``RuntimeError`` whose text says so (gloo raises plain ``RuntimeError("[...pair.cc] Connection closed ...")``)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return any(w in text for w in _TRANSPORT_WORDS)


def _place() -> str:
    """Where this process's pids mean something: host name, kernel boot id and PID namespace (containers or nodes
    sharing a host name do not compare pids)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = ns = "?"
    return f"{socket.gethostname()} {boot} {ns}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), ``None`` if it is gone
    or has exited (a zombie, state ``Z``/``X``), or on a system without ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


@dataclass
class Peers:
    """Host name, process id and process start time of every global rank (index = global rank).

    Attributes:
        rank: this process's global rank.
        hosts / pids / starts: per rank; ``starts`` tells a reused pid from the original process.
        places: per rank, where its pid means something (:func:`_place`; default: ``hosts``).
        settle_s: seconds :meth:`explain` looks for an exited process of this host before concluding none has (the
            kernel closes a killed process's sockets before it has exited).
        failure: the first :class:`PeerFailure` a :meth:`guard` raised (then the run is over).
    """

    rank: int
    hosts: list[str]
    pids: list[int]
    starts: list[str | None]
    places: list[str] | None = None
    settle_s: float = 2.0
    failure: PeerFailure | None = None

    @classmethod
    def gather(cls, group: Any) -> "Peers":
        """Every rank's host and process (a collective over ``group``)."""
        me = (socket.gethostname(), os.getpid(), _start_time(os.getpid()), _place())
        box: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(box, me, group=group)
        return cls(dist.get_rank(), *[[b[i] for b in box] for i in range(4)])

    @classmethod
    def local(cls, world_size: int, rank: int, pids: Sequence[int]) -> "Peers":
        """Peers all on this host with the given pids (tests)."""
        return cls(rank, [socket.gethostname()] * world_size, list(pids), [_start_time(p) for p in pids],
                   [_place()] * world_size)

    def _here(self) -> tuple[list[str], str]:
        """Every rank's place and this process's (host names without places)."""
        if self.places is None:
            return self.hosts, socket.gethostname()
        return self.places, _place()

    def dead(self) -> list[int]:
        """Global ranks on this host whose process has ended (or was replaced by another with the same pid).
        Empty where ``/proc`` does not exist (it cannot tell)."""
        if not os.path.isdir("/proc/self"):
            return []
        places, here = self._here()
        out = []
        for r, (h, pid, start) in enumerate(zip(places, self.pids, self.starts)):
            if r != self.rank and h == here and start is not None and _start_time(pid) != start:
                out.append(r)
        return out

    def explain(self, err: BaseException, what: str, timeout_s: float | None = None) -> PeerFailure:
        """The error to raise instead of ``err``, a transport error of the collective ``what`` ("the gradient
        all-reduce"). ``timeout_s``: the strategy's timeout, quoted."""
        cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        limit = f"within the timeout ({timeout_s:.0f} s, the strategy's timeout=)" if timeout_s else "in time"
        dead = self.dead()
        settle = time.monotonic() + self.settle_s  # a killed process closes its sockets before it has exited
        while not dead and time.monotonic() < settle:
            time.sleep(0.05)
            dead = self.dead()
        if dead:
            procs = ", ".join(f"pid {self.pids[r]} on {self.hosts[r]}" for r in dead)
            who = (f"rank {dead[0]} stopped responding: its process ({procs}) has exited" if len(dead) == 1 else
                   f"ranks {', '.join(map(str, dead))} stopped responding: their processes ({procs}) have exited")
            return PeerFailure(
                f"megatrain: {who}. "
                f"Rank {self.rank} stops in {what}. Resume from the last checkpoint (Trainer.fit(..., ckpt_path=...)); "
                f"the first error of that rank is in its own output. [{cause}]")
        places, here = self._here()
        others = [r for r, h in enumerate(places) if h != here]
        where = (f"one of ranks {', '.join(map(str, others))} on other hosts died, or a rank hangs"
                 if others else "no process of this host has exited, so a rank hangs or its connection broke")
        return PeerFailure(
            f"megatrain: a rank stopped responding to rank {self.rank} in {what} ({where}; it did not answer "
            f"{limit}). Resume from the last checkpoint (Trainer.fit(..., ckpt_path=...)). [{cause}]")

    @contextlib.contextmanager
    def guard(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
        """Run collectives; a ``RuntimeError`` from them is re-raised as :meth:`explain`'s :class:`PeerFailure`,
        chained, when it reports a failed peer or link (:func:`is_transport_error`) or a process of this host has
        exited; any other passes unchanged. After one failure every later guarded collective raises the same error
        at once instead of waiting out the timeout again (queued gradient batches, the workers' join)."""
        if self.failure is not None:
            raise PeerFailure(str(self.failure))
        try:
            yield
        except PeerFailure:
            raise
        except RuntimeError as err:
            if not (is_transport_error(err) or self.dead()):
                raise  # not about the peers (a wrong argument...): unchanged
            self.failure = self.explain(err, what, timeout_s)
            raise self.failure from err
