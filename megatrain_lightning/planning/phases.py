"""The step time by phase: what each schedule leaves exposed beyond compute, and which resource bounds the step
(docs/internals/planner.md, "Step time"; the threads: docs/architecture.md, "Threads, streams and locks").

A phase takes the longest of its *chains*, the terms one worker runs in series (:data:`CHAINS`,
:data:`CHAINS_RAM`, :data:`CHAINS_CPU`), and the step the sum of the two phases. On a CPU device the workers run
on the cores that compute, each with one intra-op thread (``engine/threads.py``): the compute, the engine's fixed
time per block call and per step (``engine``), the copies, the gradient adds and the host update form one chain;
only the NVMe transfers overlap it. On the RAM tier the updates run on the update worker (``optim/host_adamw.py``):
deferred, from the start of the forward; with ``optimizer_in_backward`` from the backward through the next
forward, split between the phases in proportion to their lengths (:func:`update_share`). Each term of
:func:`.terms._estimate`'s ``times`` is split between the phases (:func:`forward_share`).

``exposed``: the seconds a phase takes beyond its compute, given to the chain that bounds it. ``pessimistic``:
the backward's H2D copies at half bandwidth while D2H copies run (measured on PCIe).
"""

from __future__ import annotations

from typing import Any

from .terms import any_on_nvme, update_in_backward

PHASES = ("forward", "backward")
#: per phase, the chains of terms one worker runs in series (the first is compute): the NVMe tier, where the
#: H2D worker (deferred) or the D2H worker (in backward) runs the update
CHAINS: dict[str, tuple[tuple[str, ...], ...]] = {
    "forward": (("compute",), ("h2d", "host_adamw"), ("d2h",), ("nvme_read", "nvme_write"), ("host_memory",)),
    "backward": (("compute",), ("h2d",), ("d2h", "grad_add", "host_adamw"), ("nvme_read", "nvme_write"),
                 ("intra_node",), ("inter_node",), ("host_memory",)),
}
#: the RAM tier: the update worker runs the update, a chain of its own in both phases
CHAINS_RAM: dict[str, tuple[tuple[str, ...], ...]] = {
    "forward": (("compute",), ("h2d",), ("host_adamw",), ("d2h",), ("nvme_read", "nvme_write"), ("host_memory",)),
    "backward": (("compute",), ("h2d",), ("d2h", "grad_add"), ("host_adamw",), ("nvme_read", "nvme_write"),
                 ("intra_node",), ("inter_node",), ("host_memory",)),
}

#: a CPU device: every term that runs on the CPU cores in one chain (module docstring)
_ON_CORES = ("compute", "engine", "h2d", "d2h", "grad_add", "host_adamw")
CHAINS_CPU: dict[str, tuple[tuple[str, ...], ...]] = {
    "forward": (_ON_CORES, ("nvme_read", "nvme_write"), ("host_memory",)),
    "backward": (_ON_CORES, ("nvme_read", "nvme_write"), ("intra_node",), ("inter_node",), ("host_memory",)),
}


def update_worker(s: dict[str, Any]) -> bool:
    """Whether the plan's updates run on the update worker (the engine starts it on the RAM tier only)."""
    return not any_on_nvme(s)


def update_share(e: dict[str, Any], share: dict[str, float]) -> float:
    """The fraction of the host update that runs in the forward: 1 deferred; 0 in backward on the NVMe tier; in
    backward on the RAM tier, the forward's length over both phases' without the update (``share``: the forward
    fractions of the other terms)."""
    if not update_in_backward(e["settings"]):
        return 1.0
    if not update_worker(e["settings"]):
        return 0.0
    lengths = []
    for ph in PHASES:
        part = {k: t * (share[k] if ph == "forward" else 1.0 - share[k]) for k, t in e["times"].items()
                if k != "host_adamw"}
        lengths.append(max(sum(part.get(k, 0.0) for k in chain) for chain in CHAINS_RAM[ph]))
    return _frac(lengths[0], sum(lengths))


def _frac(a: float, b: float) -> float:
    return a / b if b else 0.0


def forward_share(e: dict[str, Any]) -> dict[str, float]:
    """The fraction of each term of ``e["times"]`` that runs in the forward (the rest runs in the backward)."""
    m = e["moved"]
    share = {
        "compute": _frac(e["flops_forward"], e["flops"]),
        "h2d": _frac(m["h2d_forward"], m["h2d"]),
        "d2h": _frac(m["d2h_forward"], m["d2h"]),
        "nvme_read": _frac(m["nvme_read_forward"], m["nvme_read"]),
        "nvme_write": _frac(m["nvme_write_forward"], m["nvme_write"]),
        "grad_add": 0.0,
        "host_memory": _frac(m.get("host_memory_forward", 0), m.get("host_memory", 0)),
        "intra_node": 0.0,
        "inter_node": 0.0,
        "engine": _frac(e.get("engine_forward_s", 0.0), e["times"].get("engine", 0.0)),
    }
    share["host_adamw"] = update_share(e, share)
    return share


def phase_parts(e: dict[str, Any], pessimistic: bool = False) -> dict[str, dict[str, float]]:
    """Seconds of each term in each phase."""
    share = forward_share(e)
    out = {ph: {k: t * (share[k] if ph == "forward" else 1.0 - share[k]) for k, t in e["times"].items()}
           for ph in PHASES}
    if pessimistic and out["backward"].get("d2h", 0) > 0:
        out["backward"]["h2d"] *= 2
    return out


def chains(e: dict[str, Any], pessimistic: bool = False) -> dict[str, list[tuple[str, float]]]:
    """Per phase, each chain of estimate ``e``'s device and tier (compute first: :data:`CHAINS_CPU` on a CPU
    device, else :data:`CHAINS_RAM` or :data:`CHAINS`) as (key, seconds); the key joins the chain's terms that take
    time with ``+`` (``"h2d+host_adamw"``)."""
    parts = phase_parts(e, pessimistic)
    table = CHAINS_CPU if not e.get("gpu", True) else CHAINS_RAM if update_worker(e["settings"]) else CHAINS
    out = {}
    for ph in PHASES:
        row = []
        for chain in table[ph]:
            on = [k for k in chain if parts[ph].get(k, 0) > 0]
            row.append(("+".join(on) or chain[0], sum(parts[ph].get(k, 0.0) for k in chain)))
        out[ph] = row
    return out


def phase_model(e: dict[str, Any], pessimistic: bool = False) -> dict[str, Any]:
    """The step of estimate ``e`` by phase.

    Returns:
        ``phases``: phase -> (seconds, key of the chain that bounds it, ``"compute"`` when none is longer);
        ``step_time_s``: their sum; ``dominating``: the bound of the longer phase; ``exposed``: chain key ->
        seconds beyond compute (chains that bound a phase); ``compute``: phase -> compute seconds.
    """
    phases, exposed, compute = {}, {}, {}
    parts = phase_parts(e, pessimistic)
    for ph, row in chains(e, pessimistic).items():
        comp = parts[ph].get("compute", 0.0)
        key, t = max(row, key=lambda kv: kv[1])
        if t <= comp:
            key, t = "compute", comp
        else:
            exposed[key] = exposed.get(key, 0.0) + t - comp
        phases[ph], compute[ph] = (t, key), comp
    longer = max(PHASES, key=lambda ph: phases[ph][0])
    return dict(phases=phases, step_time_s=sum(t for t, _ in phases.values()), dominating=phases[longer][1],
                exposed=exposed, compute=compute)
