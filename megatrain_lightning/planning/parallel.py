"""Data parallel across devices and nodes: per-node host RAM and ``/dev/shm``, gradient traffic, and
the step-time bound of N GPUs sharing one host (docs/internals/planner.md, "Data parallel").

R = ``trainer.devices`` (processes, one per GPU, per node), M = ``trainer.num_nodes``, W = R x M ranks.
``batch_size`` is per process (as Lightning's): a step trains W x ``batch_size`` x ``seq_len`` tokens. The terms
(summarised in docs/internals/planner.md, "Data parallel"):

* **Host RAM per node.** The training state on the RAM tier and the wire shadows (written by each slab's owner)
  once per node in ``/dev/shm`` (:data:`SHARED_STATE` and the optimizer's state), whatever R; everything else per
  process, R times.
* **NVMe per node.** The state once per node: each process stores what the blocks it owns keep on NVMe (the
  strategy's ``nvme_for_rank``). With the masters on NVMe (one node, optimizer on NVMe; other combinations are
  refused by the strategy and the plan says "fits: NO") the owner's update is fused with its forward fetch, the
  R - 1 others read the fp32 master again for their forward fetch, and every rank for its backward fetch (no
  shared read cache assumed): NVMe reads = one process's + (R - 1) x (4 N + 4 x backward fetch reads).
* **Gradients.** G = one process's D2H gradient bytes. Inside a node each block is reduced on the devices to its
  owner (blocks split among the R ranks, balanced by bytes): like a ring reduce-scatter, each rank sends and
  receives (R - 1)/R x G per step and copies max(G/R, the largest block's gradients) to the host (+ its offloaded
  activations). Across nodes the owners ring all-reduce: each node sends and receives 2 (M - 1)/M x G (the
  bus-bandwidth factors of NCCL's ``nccl-tests`` doc/PERFORMANCE.md; Patarasuk & Yuan 2009 for the ring
  all-reduce's optimality).
* **Shared host.** The host AdamW runs once per node over all N parameters (each rank updates its 1/R of the
  blocks on the host's cores): one process's time, while the node's compute is R times one GPU's. Host DRAM
  carries, per node and step: R x H2D, the D2H writes (G + R x offloaded activations), the gradient accumulation
  (G + :data:`ACCUMULATE_BYTES` x reads), :data:`ADAMW_HOST_BYTES` x N + the wire-shadow cast, and the NVMe
  traffic.

Without an accelerator the R ranks share the node's CPU cores: compute is R x one process's. Each GPU is assumed to
have its own host link (where two share a PCIe switch uplink, halve ``hardware.h2d_gbps``); without NVLink
(``hardware.nvlink_gbps: null``) the intra-node reduce is planned at ``d2h_gbps``, its sharing of the PCIe link not
counted. Units: bytes, seconds; bandwidths GB/s = 1e9 B/s.
"""

from __future__ import annotations

from typing import Any

from .optimizers import resolve

#: host tier entries held once per node in shared memory (labels of :func:`.terms._estimate`)
SHARED_STATE = ("fp32 master weights", "fp32 grad accumulators", "AdamW exp_avg + exp_avg_sq",
                "wire shadow (castable 2 B, rest 4 B)")
#: host DRAM bytes per parameter of the fused AdamW update: reads param, grad, exp_avg, exp_avg_sq
#: (16 B), writes param, exp_avg, exp_avg_sq (12 B); the wire-shadow cast is counted on its own
ADAMW_HOST_BYTES = 28
#: host DRAM bytes per incoming gradient element besides the element itself: fp32 accumulator read + write
ACCUMULATE_BYTES = 8
#: ``host_mem_gbps`` when a hardware mapping leaves it out: bytes per parameter the presets assume for
#: the memory-bound AdamW (``conf/hardware/*.yaml``: ~30 B/param with the 2-byte shadow)
PRESET_ADAMW_BYTES = 30
SHARED_SUFFIX = " (shared, /dev/shm)"
#: Linux tmpfs default size: half of the physical RAM (kernel Documentation/filesystems/tmpfs.rst)
TMPFS_DEFAULT_FRACTION = 0.5


def positive_count(value: Any, key: str) -> int:
    """``value`` as a positive integer (an int or a string of digits); ``key``: the Hydra key, for the message.

    Raises:
        ValueError: anything else; names ``key``.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer (processes per node for trainer.devices, nodes for "
                         f"trainer.num_nodes), got {value!r}; e.g. {key}=8")
    return value


def host_mem_rate(hw: Any) -> float:
    """Sustained host DRAM bandwidth in GB/s: ``hardware.host_mem_gbps``, else the presets' AdamW
    assumption (``host_adam_gparams_per_s`` x 30 B/param)."""
    if hw.host_mem_gbps is not None:
        return float(hw.host_mem_gbps)
    return float(hw.host_adam_gparams_per_s * PRESET_ADAMW_BYTES)


def intra_rate(hw: Any) -> tuple[float, str]:
    """GB/s per GPU and direction of the intra-node reduce, and which link: NVLink (or AMD Infinity
    Fabric) when ``hardware.nvlink_gbps`` is set, else PCIe at ``d2h_gbps``."""
    if hw.nvlink_gbps:
        return float(hw.nvlink_gbps), "NVLink"
    return float(hw.d2h_gbps), "PCIe" if hw.is_gpu else "host memory"


def scale_out(hw: Any, s: dict[str, Any], e: dict[str, Any], *, n_params: int, grads: int, largest_grads: int,
              accum_reads: int, act_io: int, master_fetch: int, shadow: int,
              master_fetch_forward: int = 0) -> dict[str, Any]:
    """One process's estimate ``e`` (:func:`.terms._estimate`) for R x M ranks (module docstring).

    Args:
        hw: the :class:`~.config.Hardware`.
        s: settings with ``devices`` (R) and ``num_nodes`` (M).
        e: the one-process estimate (``host``, ``nvme``, ``moved``, ``times``, ``pess``); not changed.
        n_params: N, unique parameters.
        grads: G, gradient bytes one rank produces per step (bytes).
        largest_grads: gradient bytes of the largest block read: no owner copies less than
            max(G/R, this) (blocks are not split between owners).
        accum_reads: gradient elements accumulated per step (every block read).
        act_io: offloaded activation bytes one rank writes (and reads back) per step.
        master_fetch: NVMe bytes one extra rank reads to stream the fp32 masters (0 on the RAM tier).
        master_fetch_forward: the part of ``master_fetch`` read in the forward (its forward fetch).
        shadow: bytes of the wire shadows one AdamW pass writes (the cast after the update).

    Returns:
        A new estimate: ``host`` per node (shared lines suffixed ``(shared, /dev/shm)``, per-process
        lines multiplied by R), ``moved`` with per-rank ``d2h`` and the keys ``intra_node`` (bytes
        each rank sends), ``inter_node`` (bytes each node sends), ``host_memory`` (host DRAM bytes
        per node; ``host_memory_forward`` the forward's part), ``times`` with ``host_memory``, ``intra_node``,
        ``inter_node`` and ``grad_add`` (the node's gradient adds, which its ranks share), and
        ``parallel``: ``devices``, ``num_nodes``, ``world_size``, ``shm_bytes`` (shared state per node),
        ``per_process_bytes`` and ``per_process`` (its breakdown), ``grads`` (G), ``host_traffic``
        (the host DRAM bytes per node by cause), ``shm_default_bytes`` (half the preset's RAM).

    Raises:
        ValueError: ``num_nodes`` > 1 on a preset without ``network_gbps`` (names the key).
    """
    from .terms import GRAD_ADD_BYTES, update_in_backward

    R, M = s["devices"], s["num_nodes"]
    if M > 1 and not hw.network_gbps:
        raise ValueError(f"hardware {hw.name!r} has no network_gbps: set the inter-node bandwidth per node "
                         "(GB/s, all NICs together), e.g. hardware.network_gbps=50 for one 400 Gb/s NIC")
    state = SHARED_STATE + (resolve(s.get("optim"))[0].label,)  # the chosen optimizer's state, held with the rest
    shared = {k: v for k, v in e["host"].items() if k in state}
    own = {k: v for k, v in e["host"].items() if k not in state}
    host = {k + SHARED_SUFFIX: v for k, v in shared.items()}
    host.update({(f"{k} x{R} processes" if R > 1 else k): R * v for k, v in own.items()})

    gb = 1e9
    moved = dict(e["moved"])
    moved["d2h"] = max(-(-grads // R), largest_grads) + act_io  # own blocks' reduced gradients + own activations
    moved["nvme_read"] += (R - 1) * master_fetch
    moved["nvme_read_uncached"] += (R - 1) * master_fetch
    moved["nvme_read_forward"] += (R - 1) * master_fetch_forward
    moved["grad_add"] = accum_reads * GRAD_ADD_BYTES[s["grad_bytes"]]  # dense gradients, each added once per node
    moved["intra_node"] = (R - 1) * grads // R
    moved["inter_node"] = 2 * (M - 1) * grads // M
    host_traffic = {
        f"H2D reads x{R} ranks": R * moved["h2d"],
        "D2H writes (reduced gradients + offloaded activations)": grads + R * act_io,
        "gradient accumulation (read incoming, read + write fp32)": grads + ACCUMULATE_BYTES * accum_reads,
        "AdamW (28 B/param) + wire-shadow cast": ADAMW_HOST_BYTES * n_params + shadow,
        "NVMe reads + writes": moved["nvme_read"] + moved["nvme_write"],
    }
    moved["host_memory"] = sum(host_traffic.values())
    in_bwd = update_in_backward(s)
    moved["host_memory_forward"] = (R * moved["h2d_forward"] + R * act_io + moved["nvme_read_forward"]
                                    + moved["nvme_write_forward"]
                                    + (0 if in_bwd else host_traffic["AdamW (28 B/param) + wire-shadow cast"]))
    ib, _ = intra_rate(hw)
    times = dict(e["times"])
    if not hw.is_gpu:  # a CPU "device": the R ranks compute on the same cores, the node's rate is shared
        times["compute"] = R * e["times"]["compute"]
    times.update(
        d2h=moved["d2h"] / (hw.d2h_gbps * gb),
        nvme_read=moved["nvme_read"] / (hw.nvme_drives * hw.nvme_read_gbps * gb),
        host_memory=moved["host_memory"] / (host_mem_rate(hw) * gb),
        intra_node=moved["intra_node"] / (ib * gb),
        inter_node=moved["inter_node"] / (hw.network_gbps * gb) if M > 1 else 0.0,
        grad_add=moved["grad_add"] / (host_mem_rate(hw) * gb),
    )
    per_process = sum(own.values())
    parallel = dict(devices=R, num_nodes=M, world_size=R * M, shm_bytes=sum(shared.values()),
                    per_process_bytes=per_process, per_process=own, grads=grads, host_traffic=host_traffic,
                    shm_default_bytes=int(TMPFS_DEFAULT_FRACTION * hw.host_ram_gib * 2**30))
    return {**e, "host": host, "moved": moved, "times": times, "parallel": parallel}
