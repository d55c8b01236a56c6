"""The planner's arithmetic: bytes per memory tier, bytes moved and the seconds of each term per optimizer step.

Every number follows from the parameter counts of the real model (:mod:`.counts`, meta device), the settings and
one :class:`~.config.Hardware` preset. Units: bytes, seconds, FLOP; GiB = 2**30 B; GB/s = 1e9 B/s; TFLOP/s = 1e12
FLOP/s.

Memory tiers (docs/architecture.md, "Memory tiers"), N = unique parameters (tied counted once):

* host RAM: fp32 master 4 B/param, fp32 gradient accumulator 4, the optimizer's state (:mod:`.optimizers`; on the
  NVMe tier the store's two fp32 regions, 8 B/param on disk whatever the optimizer); the cached wire image of each
  slab under a 2-byte wire (cast once per step after its update, ``engine/wire.py``: under the mixed modes only
  weights autocast casts travel in 2 B, the others in 4 B, and an all-fp32 slab streams its master and has no
  image; ``bf16-true``: 2 B for every parameter); 2 pinned D2H staging buffers of the largest slab's gradients in
  the gradient wire dtype (``CUDATransport``'s ``n_staging``). Masters, wire images and staging buffers are pinned
  at their exact size (``store/pinned.py``, 4 KiB pages); offloaded block inputs go through torch's caching host
  allocator, which rounds each up to a power of two (its own line). Plus offloaded activations
  (:mod:`.activations`) and :func:`process_overhead`. A part moved to NVMe leaves the engine's minimum window in
  RAM (``store/nvme.py`` ``NVMeConfig.min_window``: the largest slab's master, ``exp_avg``, ``exp_avg_sq`` and
  accumulator, and one more accumulator being filled), with NVMe masters also the H2D staging ring in the same
  budget (2 slots of the largest slab at 4 B, one on a CPU device: ``engine/window.py`` ``window_sizes``); on a
  GPU preset these rows and the D2H staging sum to the engine's own minimum (``tests/test_plan_block_group.py``).
  Above the minimum the window caches regions up to ``host_memory_limit`` (:func:`window_fill`).
* device: ``lookahead + 1`` fetches in the compute dtype (fp32 under the mixed modes: the wire image is upcast on
  the device, ``transport.to_device``), each one block or, with ``block_group=G`` > 1, up to G consecutive decoder
  layers (``engine/block_groups.py``); plus the wire image being decoded, under autocast
  its cache of the castable weights' casts (alive while the block computes), the computing block's parameter
  gradients (compute dtype), at most ``D2H_INFLIGHT`` = 2 packed gradient batches queued for the D2H worker
  (``transport.stage_grads``, ``GradientSink``'s ``max_inflight``), the activations (:mod:`.activations`) and a
  2 GiB runtime reserve (CUDA context, cuBLAS workspaces, allocator fragmentation; assumption). Without an
  accelerator (``hbm_gib: null``) the device buffers are host RAM, added to the host tier; there, under
  ``32-true`` with ``cpu_zero_copy`` (the strategy's default) blocks bind the fp32 masters: no weight buffers, no
  H2D.
* disk: the NVMe store + ``keep_checkpoints`` directory checkpoints (a save keeps the previous one complete until
  the new one is renamed in). A checkpoint is fp32 weights + the optimizer's state (AdamW: 12 B/param in all; the
  NVMe tier's two regions: 12 B/param whatever the optimizer) + 16 MiB of metadata allowance (config, index,
  checksums, trainer state).

Per optimizer step (one micro-batch of ``batch_size`` x ``seq_len`` tokens):

* H2D = the wire bytes (:func:`wire_bytes`) of 2 x the params read by all blocks - those of the last block: the
  forward fetch plus the backward fetch that recomputes each block, except the LM head, which keeps its graph and
  weights on the device until its backward (the final norm before it is its own block, fetched twice:
  ``ParamCounts.head_refetched``; tied weights are fetched by both blocks that read them); the embedding's
  backward fetches nothing under every ``recompute`` mode (its graph holds only the token indices). On a CPU
  device with ``cpu_zero_copy`` what already has the compute dtype is bound, not copied (:func:`binds_in_place`).
  Checked against the engine's measured ``megatrain/h2d_bytes`` (tests/test_plan_recompute.py, with and without
  ``cpu_zero_copy``). With ``recompute_every=K`` the recompute chains fetch (K-1)/K of the layers once more;
  offloaded activations come back in backward.
* D2H = (params read by all blocks) x gradient bytes (fp32 by default, bf16 for ``bf16-true`` or
  ``grad_dtype``), plus offloaded activations in forward; the input embedding's gradient counts as the rows its
  tokens read, B x T x (H x gradient bytes + 8), when that is less than its V x H table (engine/row_grads.py;
  data parallel: dense).
* NVMe (when offloaded): AdamW's moments read 8 B/param + written 8 (another optimizer: the regions its state packs
  into, :func:`.optimizers.nvme_region_bytes`); masters read 4 (the update is fused with the forward fetch) + 4
  for the backward fetch (cast to the wire image on the host), written 4; gradient accumulators, deferred schedule
  only, written 4 + read 4. Written per step (AdamW): 12 B/param under ``optimizer_in_backward`` (the NVMe tier's
  default), 16 deferred. Source: a region is written back only when a ``hold(..., write=True)`` ends
  (``store/nvme.py`` ``_unpin`` -> ``_write_back``); the update holds master, ``exp_avg`` and ``exp_avg_sq`` for
  writing and the accumulator for reading (``optim/host_adamw.py`` ``_update``); the D2H worker's add holds the
  accumulator with ``write=not final`` (``engine/grads.py`` ``_accumulate``), so in backward the update drops it
  unwritten (``discard_grad_accum``). Checked against the engine's ``megatrain/nvme_write_bytes``
  (tests/test_plan_nvme_io.py). The 4 KiB padding of each region on disk (``store/nvme.py`` ``align_up``) is not
  counted (a few KiB per block).
* compute FLOPs ~ 6 x N_matmul x tokens + 6 x L x T x d_attn x tokens: forward + backward (Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models", table 1: C_forward ~ 2N + 2 n_layer n_ctx d_attn, backward = 2 x
  forward), plus the recompute by ``recompute`` mode (:func:`recompute_flops`), plus, with ``mlp_chunk_size``
  shorter than the sequence, one more MLP forward per ``"block"`` layer (each chunk's checkpoint re-runs it in
  backward, ``engine/chunked_mlp.py``): 2 x 3 x H x I per token and layer. N_matmul excludes the input-embedding
  lookup unless it is tied to the LM head (:attr:`.counts.ParamCounts.matmul_params`).
* host AdamW: N / ``host_adam_gparams_per_s`` (torch's fused CPU kernel; the shadow cast is folded into the
  presets' memory-bandwidth assumption, measured separately at 4.5 G params/s on the 2-core dev box); other
  optimizers: :func:`host_update_seconds`.

Compute runs at peak dense TFLOP/s (bf16 for 2-byte wire modes, fp32 non-tensor for ``32-true``). The step time by
phase, its fastest estimate (the largest term) and the pessimistic variant (PCIe is full duplex, but H2D was
measured to drop to about half its bandwidth while D2H runs): :mod:`.phases`.

With ``devices`` > 1 or ``num_nodes`` > 1 (data parallel) :func:`.parallel.scale_out` turns the one-process
numbers into per-node tiers and shared-host terms, and adds the gradient collectives.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import optimizer_in_backward_on
from .config import GIB, Hardware
from .activations import (activation_bytes, kept_per_token, layer_mix, layer_saved_per_token,
                          selective_per_token)
from .counts import ParamCounts
from .optimizers import NVME_STATE_BYTES, nvme_region_bytes, resolve as resolve_optim, state_bytes, update_work
from .parallel import host_mem_rate, scale_out
from ..engine.staging import RING_SLOTS
from ..preference.module import REFERENCES as DPO_REFERENCES

#: precision -> (wire bytes, device param bytes, default grad bytes, saved residual bytes,
#: matmul activation bytes, compute rate key). Mirrors ``MegaTrainPrecision``.
PRECISIONS: dict[str, tuple[int, int, int, int, int, str]] = {
    "32-true": (4, 4, 4, 4, 4, "fp32_tflops"),
    "bf16-mixed": (2, 4, 4, 4, 2, "bf16_tflops"),
    "16-mixed": (2, 4, 4, 4, 2, "bf16_tflops"),
    "bf16-true": (2, 2, 2, 2, 2, "bf16_tflops"),
}
PRECISION_ALIASES = {"32": "32-true", 32: "32-true", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TIERS = ("cpu", "nvme")
PROCESS_OVERHEAD_GPU = 4 * GIB  # host, GPU preset: Python, torch, CUDA host side, data loader (assumption)
PROCESS_OVERHEAD_CPU = int(0.41 * GIB)  # host, CPU preset: measured 418 MiB (bench/process_overhead.py), rounded up
AUTOCAST_OVERHEAD_CPU = 16 * 2**20      # host, CPU preset under bf16-mixed: measured 16-17 MiB more (the same script)
DEVICE_RESERVE = 2 * GIB        # device: CUDA context, workspaces, fragmentation (assumption)
CKPT_METADATA = 16 * 2**20      # checkpoint metadata allowance
D2H_INFLIGHT = 2                # packed gradient batches queued for the D2H worker at most (GradientSink max_inflight)
D2H_STAGING = 2                 # pinned D2H staging buffers (CUDATransport n_staging)

TERM_LABELS = {"compute": "compute", "h2d": "H2D copies", "d2h": "D2H copies", "nvme_read": "NVMe reads",
               "nvme_write": "NVMe writes", "host_adamw": "host AdamW", "grad_add": "host gradient adds",
               "host_memory": "host memory", "intra_node": "intra-node reduce", "inter_node": "inter-node all-reduce",
               "engine": "engine CPU time"}
#: host DRAM bytes per gradient element of the D2H worker's add into the fp32 accumulator, by gradient wire bytes:
#: fp32: gradient read 4 + accumulator read 4 and written 4; 2-byte: read 2, cast to an fp32 temporary first
#: (torch casts a CPU operand of another dtype before the kernel: written 4, read 4), then the 8 of the add
GRAD_ADD_BYTES = {4: 12, 2: 18}


def term_label(key: str, settings: dict[str, Any] | None = None) -> str:
    """The label of a term or chain of terms (``"h2d+host_adamw"`` -> ``"H2D copies + host AdamW"``,
    :mod:`.phases`); with ``settings`` the host update names a non-AdamW optimizer (``"host Adafactor"``)."""
    title = optim_title(settings) if settings else "AdamW"
    own = {} if title in ("AdamW", "Adam") else {"host_adamw": f"host {title}"}
    return " + ".join(own.get(k, TERM_LABELS[k]) for k in key.split("+"))


def optim_title(s: dict[str, Any]) -> str:
    """The optimizer's short name (``"AdamW"``, ``"Adafactor"``...) of settings ``s``."""
    return resolve_optim(s.get("optim"))[0].label.split()[0]


def optim_state_bytes(c: ParamCounts, s: dict[str, Any]) -> int:
    """Host bytes of the optimizer's state on the RAM tier: :func:`.optimizers.state_bytes` over
    :attr:`.counts.ParamCounts.shapes`.

    Raises:
        ValueError: see :func:`.optimizers.resolve`.
    """
    return state_bytes(s.get("optim"), c.shapes)


def host_update_work(c: ParamCounts, s: dict[str, Any]) -> tuple[float, float, bool]:
    """:func:`.optimizers.update_work` over :attr:`.counts.ParamCounts.shapes`: ``(time per parameter relative to AdamW,
    Newton-Schulz FLOPs, measured)``."""
    return update_work(s.get("optim"), c.shapes)


def host_update_seconds(c: ParamCounts, hw: Hardware, s: dict[str, Any]) -> float:
    """Seconds of the host update per step: N x (time per parameter relative to AdamW) /
    ``hw.host_adam_gparams_per_s``, plus Muon's Newton-Schulz FLOPs / ``hw.host_bf16_tflops`` when the preset has it."""
    factor, flops, _ = host_update_work(c, s)
    t = c.total * factor / (hw.host_adam_gparams_per_s * 1e9)
    return t + (flops / (hw.host_bf16_tflops * 1e12) if flops and hw.host_bf16_tflops else 0.0)


def block_calls(c: ParamCounts, s: dict[str, Any]) -> tuple[int, int]:
    """Block calls per step ``(forward, backward)``: every block once each way, plus the backward's recompute of
    the ``"block"``/``"selective"`` layers (:func:`.activations.layer_mix`)."""
    mix = layer_mix(c, s)
    blocks = c.num_layers + 2
    return blocks, blocks + mix["block"] + mix["selective"]


def engine_seconds(c: ParamCounts, hw: Hardware, s: dict[str, Any], activations: int = 0) -> tuple[float, float] | None:
    """The engine's own CPU time per step, seconds ``(forward with the per-step part, backward)``: block calls x
    ``hw.block_call_ms`` + ``hw.step_overhead_ms``, and in the forward the ``activations`` bytes faulted in again at
    ``hw.page_fill_gbps`` (:class:`~.config.Hardware`); ``None`` on a GPU preset or without the per-call figures."""
    if hw.is_gpu or hw.block_call_ms is None or hw.step_overhead_ms is None:
        return None
    fwd, bwd = block_calls(c, s)
    fill = activations / (hw.page_fill_gbps * 1e9) if hw.page_fill_gbps else 0.0
    return (fwd * hw.block_call_ms + hw.step_overhead_ms) / 1e3 + fill, bwd * hw.block_call_ms / 1e3


def checkpoint_state_bytes(c: ParamCounts, s: dict[str, Any]) -> int:
    """Optimizer bytes in a checkpoint: :func:`optim_state_bytes` on the RAM tier, ``NVME_STATE_BYTES`` x N on the
    NVMe tier."""
    return optim_state_bytes(c, s) if s["offload_optimizer"] == "cpu" else NVME_STATE_BYTES * c.total


def any_on_nvme(s: dict[str, Any]) -> bool:
    """Whether the settings put any state (masters, optimizer state, gradient accumulators) on NVMe."""
    return "nvme" in (s.get("offload_params"), s.get("offload_optimizer"), s.get("offload_grads"))


def update_in_backward(s: dict[str, Any]) -> bool:
    """Whether each slab's update runs in the backward after its last gradient add (``optimizer_in_backward``: on
    the update worker on the RAM tier, the D2H worker on the NVMe tier), else deferred to the next forward before
    its copy; ``None``: :func:`~megatrain_lightning.config.optimizer_in_backward_on` (on when any state is on NVMe)."""
    return bool(optimizer_in_backward_on(s.get("optimizer_in_backward"), any_on_nvme(s)))


def _pow2_waste(nbytes: int) -> int:
    return 0 if nbytes <= 0 else (1 << (nbytes - 1).bit_length()) - nbytes


def wire_bytes(params: int, castable: int, precision: str) -> int:
    """Bytes of ``params`` parameters on the H2D link: all 2-byte under ``bf16-true``; under a mixed precision's
    2-byte wire only the ``castable`` ones (:func:`megatrain_lightning.engine.wire.autocast_casts`) travel in 2 B,
    the rest (embeddings, norms, tied weights) in fp32 (``engine/wire.py``; the up-to-15-byte alignment of each run
    of a mixed image not counted)."""
    wire = PRECISIONS[precision][0]
    if precision == "bf16-true":
        return 2 * params
    return params * 4 if wire == 4 else castable * wire + (params - castable) * 4


def group_size(c: ParamCounts, s: dict[str, Any]) -> int:
    """Decoder layers one fetch moves at most: ``block_group`` capped at the layer count (the engine's
    ``max(map(len, groups))`` for one decoder-layer class, ``engine/block_groups.py``)."""
    return max(1, min(int(s.get("block_group", 1)), c.num_layers or 1))


def layers_in_flight(c: ParamCounts, s: dict[str, Any]) -> int:
    """Decoder layers whose weights the device may hold at once: ``(lookahead + 1) x`` :func:`group_size`,
    at most all of them (``form_groups`` then makes one group; the other fetches in flight are the embedding and
    the head)."""
    return min((s["lookahead"] + 1) * group_size(c, s), c.num_layers)


def layer_wire_bytes(c: ParamCounts, s: dict[str, Any]) -> int:
    """Bytes of the largest decoder layer on the H2D link (:func:`wire_bytes`; all 2-byte under ``bf16-true``);
    0 without decoder layers."""
    reads = list(zip(c.block_reads, c.castable))[1:-1]
    return max((wire_bytes(n, k, s["precision"]) for n, k in reads), default=0)


def transfer_bytes(c: ParamCounts, s: dict[str, Any]) -> int:
    """Bytes of one decoder-layer fetch: :func:`layer_wire_bytes` x :func:`group_size` (the embedding and the LM
    head are never grouped); the size a copy would have where none is made (:func:`zero_copy`)."""
    return layer_wire_bytes(c, s) * group_size(c, s)


def zero_copy(hw: Hardware, s: dict[str, Any]) -> bool:
    """Whether blocks bind the fp32 masters without a copy: no accelerator, a 4-byte wire, ``cpu_zero_copy`` and
    the masters in host RAM (with ``offload_params="nvme"`` the engine turns ``cpu_zero_copy`` off: its compute
    buffers are copies counted in the window, ``engine/streaming.py``)."""
    return binds_in_place(hw, s) and PRECISIONS[s["precision"]][0] == 4


def binds_in_place(hw: Hardware, s: dict[str, Any]) -> bool:
    """Whether a fetch binds, instead of copying, what already has the compute dtype: a CPU device with
    ``cpu_zero_copy`` and the masters in host RAM (``CPUTransport.to_device``). ``32-true`` binds the fp32
    masters, ``bf16-true`` the cached bf16 wire images, the mixed modes the all-fp32 slabs (an untied embedding, a
    final norm); none of these is an H2D copy (``megatrain/h2d_bytes`` counts copies only)."""
    return not hw.is_gpu and bool(s["cpu_zero_copy"]) and s.get("offload_params", "cpu") == "cpu"


def process_overhead(hw: Hardware, precision: str = "32-true") -> int:
    """Host bytes of the process apart from its training state and buffers (Python, torch, Lightning,
    transformers, the data loader, thread stacks, the allocator's slack).

    * CPU preset (``hbm_gib: null``): :data:`PROCESS_OVERHEAD_CPU`, measured: peak RSS of a 2-step
      ``Trainer(strategy="megatrain", accelerator="cpu")`` fit of a 34k-parameter Llama minus its state (16
      B/param, 0.5 MiB): 418 MiB on the 2-core dev box (torch 2.13 CPU build; with the test extra transformers
      imports torchao, 13 MiB of it), ``PYTHONPATH=. python bench/process_overhead.py``; rounded up to 0.41 GiB.
      Under ``bf16-mixed`` :data:`AUTOCAST_OVERHEAD_CPU` more (oneDNN's bf16 kernels and scratch: 434-435 MiB
      against 418, ``--precision bf16-mixed``).
    * GPU preset: :data:`PROCESS_OVERHEAD_GPU`, 4 GiB, an assumption: the above plus the CUDA context's host
      side, the CUDA/cuBLAS/cuDNN libraries (a CUDA build of torch maps several GiB of kernels) and pinned-memory
      pools outside the planner's own terms."""
    if hw.is_gpu:
        return PROCESS_OVERHEAD_GPU
    return PROCESS_OVERHEAD_CPU + (AUTOCAST_OVERHEAD_CPU if precision == "bf16-mixed" else 0)


def resolve_auto(c: ParamCounts, hw: Hardware, s: dict[str, Any]) -> dict[str, Any]:
    """``recompute="auto"``: the settings with ``activation_budget`` (bytes) and ``recompute_mix`` (decoder layers
    per policy) as the engine would choose them; other modes unchanged.

    Budget = ``activation_memory_limit``, else half the memory the plan leaves free with every layer in
    ``"block"`` (device memory; host RAM on a CPU device), as the engine's ``default_activation_limit``. The saved
    block inputs come out of it, the rest goes to op outputs chosen by the engine's own
    :func:`~megatrain_lightning.engine.recompute_policy.decide` from per-layer bytes (:mod:`.activations`) and
    FLOPs (forward: 2 x layer params + 2 x seq_len x q per token; ``"selective"``'s recompute: one FLOP per element
    the graph keeps beyond the op outputs, the engine's elementwise estimate)."""
    if s.get("recompute") != "auto":
        return s
    from ..engine.recompute_policy import decide

    L, tokens = c.num_layers, s["batch_size"] * s["seq_len"]
    base = {**s, "recompute": "block", "recompute_mix": None}
    budget = s.get("activation_memory_limit")
    if budget is None:
        tier, have = ("device", hw.hbm_gib) if hw.is_gpu else ("host", hw.host_ram_gib)
        budget = max(int(have * GIB) - sum(_estimate(c, hw, base)[tier].values()), 0) // 2
    kept0 = kept_per_token(c, base)  # what the measured forward keeps: block inputs, the embedding's indices
    inputs = 0 if s["offload_activations"] else int((kept0["block inputs"] + kept0["embedding indices"]) * tokens)
    sel = selective_per_token(c, s) * tokens
    none = sum(layer_saved_per_token(c, s).values()) * tokens
    flops = (2 * c.layer_active / L + 2 * s["seq_len"] * c.num_heads * c.head_dim) * tokens
    r = PRECISIONS[s["precision"]][3]
    measured = {i: dict(selective=sel, none=none, flops=flops, flops_selective=(none - sel) / r) for i in range(L)}
    # offloaded kept activations take no device memory: the engine's meter counts device bytes only
    choice = decide(measured, 1 << 62 if s["offload_activations"] else max(budget - inputs, 0))
    mix = {k: sum(v == k for v in choice.values()) for k in ("block", "selective", "none")}
    return {**s, "recompute_mix": mix, "activation_budget": int(budget)}


def recompute_flops(c: ParamCounts, s: dict[str, Any]) -> dict[str, float]:
    """Recompute FLOPs per token by ``recompute`` mode (:func:`_estimate`'s ``flops_parts``; ``"auto"`` per layer
    as its mix): ``"block"`` layers re-run their forward (2 x the layer params a token reads + attention 2 x seq_len
    x q; the LM head keeps its graph and the embedding is a lookup: neither is recomputed), with
    ``recompute_every=K`` > 1 (K-1)/K of them once more (chains, also under ``"selective"``: a linked call's chain
    runs without its cache); ``"selective"`` re-runs only norms, activations and elementwise ops (counted as 0: no
    matmul); ``"none"`` nothing."""
    L, T, K = c.num_layers, s["seq_len"], s["recompute_every"]
    mix = layer_mix(c, s)
    f_layers = 2 * c.layer_active + 2 * L * T * c.num_heads * c.head_dim
    # mlp_chunk_size (module docstring): gate, up, down = 3 H I per expert a token passes through
    M = s.get("mlp_chunk_size")
    mlp = 2 * 3 * c.hidden_size * c.intermediate_size * max(1, c.experts_per_token) * mix["block"] \
        if M is not None and T > M else 0
    return {"recompute (block layers)": mix["block"] / L * f_layers,
            "recompute chains (K > 1)": (K - 1) / K * (mix["block"] + mix["selective"]) / L * f_layers,
            "MLP chunks' second forward (mlp_chunk_size)": float(mlp)}


#: values of the planner's ``reference`` setting: ``None`` and those of ``DPOModule(reference=...)``
REFERENCES = (None, *DPO_REFERENCES)


#: host RAM terms of a plan that the NVMe tier's ``host_memory_limit`` bounds (the window's buffers, the staging
#: buffers in its budget, and on a CPU device the compute buffers: ``engine/window.py``)
WINDOW_TERMS = ("window", "staging", "device buffers (CPU device)")
#: the host RAM term of what the NVMe window keeps beyond its minimum (:func:`window_fill`)
NVME_CACHE = "NVMe regions kept in RAM between steps (up to host_memory_limit)"


def window_bytes(host: dict[str, int]) -> int:
    """Bytes of the ``host`` terms that ``host_memory_limit`` bounds (:data:`WINDOW_TERMS`)."""
    return sum(v for k, v in host.items() if any(t in k for t in WINDOW_TERMS))


def window_fill(host: dict[str, int], read_back: int, limit: int, gpu: bool) -> int:
    """Host bytes of the NVMe window and the buffers counted in ``host_memory_limit`` once the window has cached
    what it can: at least :func:`window_bytes` of ``host``, else ``min(limit, need)``, ``need`` being those terms
    with the master and optimizer-state windows replaced by every region a step reads back (``read_back``, bytes)
    -- the engine's arena is the limit less the buffers outside it, never more than the regions
    (``NVMeConfig.window_bytes``), and what it caches stays resident.

    Measured (``bench/nvme_window.py``, peak RSS against the limit; a 16-layer fp32 and a 4-layer bf16-mixed Llama):
    RSS grew with the limit until the window held what a step writes; a CPU device's H2D staging ring did not add
    to it (left out of ``need`` there; with ``gpu`` it is pinned and counted). With this term RSS was 1.03-1.07 of
    the plan's host total (16 layers) and 0.95-0.96 (4 layers) at limits from the minimum window to the minimum +
    1.5 x the regions rewritten; with the minimum alone up to 1.30 (16 layers)."""
    replaced = ("master window", "AdamW moments window", "optimizer state window") + (() if gpu else ("H2D staging",))
    held = sum(v for k, v in host.items() if k.startswith(replaced))
    inside = window_bytes(host)
    return max(inside, min(limit, inside - held + read_back))


def nvme_kept_share(spare: int, rewritten: int) -> float:
    """The share of a step's NVMe reads the host window saves, in [0, 1]: ``spare / rewritten``, capped at 1.

    ``spare``: bytes of ``host_memory_limit`` (per process) beyond the engine's minimum window (:mod:`.window`);
    ``rewritten``: the region bytes a step writes back to NVMe (master, optimizer state, the accumulators when
    deferred), which are the regions it reads, plus a reference copy's weights on NVMe (read, never written). The
    window caches those regions (``store/nvme.py``: least recently used out first, those the schedule needs next
    last). Measured (``bench/nvme_window.py``, a 16-layer fp32 and a 4-layer bf16-mixed Llama, ``spare`` = 0 to 1.5
    x ``rewritten``): 0 bytes read from ``spare >= rewritten`` on (the 4-layer one from 0.75 x); in between,
    1.03-1.29 x the reads this share leaves; at the minimum window 1.13-1.21 x the schedule's count (regions
    evicted between the backward fetch and the update are read again)."""
    if spare <= 0 or rewritten <= 0:
        return 0.0
    return min(1.0, spare / rewritten)


def _estimate(c: ParamCounts, hw: Hardware, s: dict[str, Any]) -> dict[str, Any]:
    """Pure arithmetic for one batch size: the tiers, bytes moved and seconds per term."""
    s = resolve_auto(c, hw, s)
    wire, dev_param, _, _, _, rate_key = PRECISIONS[s["precision"]]
    grad_b = s["grad_bytes"]
    B, T, K, la = s["batch_size"], s["seq_len"], s["recompute_every"], s["lookahead"]
    N, L = c.total, c.num_layers
    bf16_true = s["precision"] == "bf16-true"
    G = group_size(c, s)                    # decoder layers per fetch (block_group)
    gpu = hw.is_gpu
    no_copy = zero_copy(hw, s)              # strategy default on a CPU device
    wire_of = [wire_bytes(n, k, s["precision"]) for n, k in zip(c.block_reads, c.castable)]
    big = c.largest_block                   # tied included
    big_wire = max(wire_of)
    slab = c.largest_slab                   # the D2H staging size; the NVMe minimum window holds one update of it

    # ---- device
    act_dev, act_host = activation_bytes(c, s, gpu)
    # parameters of the weights in flight: (lookahead + 1) x max(largest block, G x largest layer), capped at all L
    # layers plus ``lookahead`` largest blocks when (lookahead + 1) x G exceeds L (:func:`layers_in_flight`)
    layer = max(c.layers, default=0)
    full = (la + 1) * max(big, G * layer)
    weights = min(full, L * layer + la * big) if (la + 1) * G > L else full
    if weights < full:
        weights_label = f"block weights: all {L} layers + {la} fetch(es) (compute dtype)"
    else:
        weights_label = f"block weights x{la + 1}" + (f" fetches x{G} layers" if G > 1 else "") + " (compute dtype)"
    device = {
        weights_label: 0 if no_copy else weights * dev_param,
        "wire image being decoded": big_wire if wire < dev_param else 0,
        "autocast weight casts (computing block)": max(c.castable) * wire if wire < dev_param else 0,
        "block param grads": big * dev_param,
        f"queued D2H gradient packs x{D2H_INFLIGHT}": big * D2H_INFLIGHT * grad_b,
        **act_dev,
        "runtime reserve": DEVICE_RESERVE if gpu else 0,
    }

    # ---- host and NVMe
    host: dict[str, int] = {}
    nvme: dict[str, int] = {}
    # each slab's cached wire image (``engine/fetch.py`` ``_shadow``): none under a 4-byte wire or for an all-fp32
    # slab (it streams the master); all 2-byte under ``bf16-true``
    shadow_total = sum(wire_bytes(n, k, s["precision"]) if wire < 4 and (k or bf16_true) else 0
                       for n, k in zip(c.stored, c.castable))
    copy_ref = s.get("reference") == "copy"  # a frozen fp32 copy of the weights, streamed like the policy's
    if s["offload_params"] == "cpu":
        host["fp32 master weights"] = 4 * N
        host["wire shadow (castable 2 B, rest 4 B)"] = shadow_total
        if copy_ref:
            host["reference copy: fp32 weights + wire shadow"] = 4 * N + shadow_total
    else:
        nvme["fp32 master weights"] = 4 * N
        host["master window"] = 4 * slab
        # engine/staging.py ``ring_bytes_bound``; a CPU device counts one slot (engine/window.py ``window_sizes``)
        slots = RING_SLOTS if gpu else 1
        host[f"H2D staging ring x{slots} (largest slab at 4 B)"] = slots * 4 * slab
        if copy_ref:
            nvme["reference copy: fp32 weights"] = 4 * N
    if s["offload_grads"] == "cpu":
        host["fp32 grad accumulators"] = 4 * N
    else:
        nvme["fp32 grad accumulators"] = 4 * N
        host["grad accumulator window (the update's + one being filled)"] = 2 * 4 * slab
    if s["offload_optimizer"] == "cpu":  # the chosen optimizer's state (planning/optimizers.py)
        host[resolve_optim(s.get("optim"))[0].label] = optim_state_bytes(c, s)
    else:  # the store's two fp32 optimizer regions, whatever the optimizer
        adam = resolve_optim(s.get("optim"))[0].name in ("adamw", "adam")
        nvme["AdamW exp_avg + exp_avg_sq" if adam else "optimizer state (the store's 2 fp32 regions)"] = \
            NVME_STATE_BYTES * N
        host["AdamW moments window" if adam else "optimizer state window"] = NVME_STATE_BYTES * slab
    if gpu:
        host[f"pinned D2H staging x{D2H_STAGING} (largest slab)"] = D2H_STAGING * slab * grad_b
        if act_host.get("offloaded block inputs") and s["pinned_round"]:
            # one pinned tensor per saved block input, each rounded on its own, and one of the token ids
            kept, tokens = kept_per_token(c, s), s["batch_size"] * s["seq_len"]
            n_saved = math.ceil(L / K) + 1
            host["pinned pow2 rounding (offloaded inputs)"] = \
                n_saved * _pow2_waste(int(kept["block inputs"] * tokens) // n_saved) \
                + _pow2_waste(int(kept["embedding indices"] * tokens))
    host.update(act_host)
    if not gpu:  # the device is the CPU: its buffers and activations are host RAM
        acts = sum(act_dev.values())
        host["device buffers (CPU device): weights, gradients"] = sum(device.values()) - acts
        host["activations (CPU device)"] = acts
    host["process overhead"] = process_overhead(hw, s["precision"])

    # fp32 weights + the optimizer's state (state_dict() in the class's format; the store's regions on NVMe)
    ckpt = 4 * N + checkpoint_state_bytes(c, s) + (4 * N if copy_ref else 0) + CKPT_METADATA
    disk = {"NVMe store": sum(nvme.values()), f"checkpoints x{s['keep_checkpoints']}": s["keep_checkpoints"] * ckpt}

    # ---- bytes moved per step
    mix = layer_mix(c, s)
    reads = c.reads_per_pass
    # backward fetch: not the embedding (engine/recompute_policy.py ``is_lookup``, engine/boundary/kept.py
    # ``needs_weights``) nor the LM head, which keep their graphs; the final norm again
    reads_b = reads - c.head_reads + c.head_refetched - c.embedding
    chained = (mix["block"] + mix["selective"]) / L  # "none" layers rebuild nothing: no chain fetch
    chain = int(c.layer_total * (K - 1) // K * chained)
    norm_wire = wire_bytes(c.head_refetched, 0, s["precision"])  # norms: not castable
    act_io = act_host.get("offloaded block inputs", 0) + act_host.get("offloaded op outputs / graphs", 0)
    if binds_in_place(hw, s):  # CPU zero-copy: what already has the compute dtype is bound, not copied
        copied = [0 if (wire == 4 or bf16_true or k == 0) else w for w, k in zip(wire_of, c.castable)]
        if copied[-1]:  # the head entry includes the final norm, its own all-fp32 block: bound, not copied
            copied[-1] = wire_bytes(c.block_reads[-1] - c.head_refetched, c.castable[-1], s["precision"])
        norm_wire, wire_of = 0, copied
    layer_wire = sum(wire_of[1:-1])
    chain_wire = int(layer_wire * (K - 1) // K * chained)
    h2d_f = sum(wire_of)
    h2d_b = layer_wire + norm_wire + chain_wire + (act_io if gpu else 0)  # CPU: an offloaded input is used in place
    if copy_ref:                               # the reference's no-grad forward fetches every block once more
        h2d_f *= 2
    if no_copy:                                # CPU device bound to the fp32 masters: nothing copied
        h2d_f = h2d_b = 0
    # the embedding's gradient as rows when smaller than the table (engine/row_grads.py ``use_row_grads``)
    table = c.vocab_size * c.hidden_size if c.embedding >= c.vocab_size * c.hidden_size else 0
    dense = table * grad_b <= B * T * (c.hidden_size * grad_b + 8)
    d2h = (reads - table) * grad_b + (table * grad_b if dense else B * T * (c.hidden_size * grad_b + 8)) + act_io
    # NVMe bytes by phase (forward, backward): the update's I/O lands in the phase that runs it
    in_bwd = update_in_backward(s)
    upd = 1 if in_bwd else 0                # index of the phase holding the update
    nv_r, nv_w = [0, 0], [0, 0]
    if s["offload_params"] == "nvme":
        nv_r[0] += 4 * N * (2 if copy_ref else 1)  # forward fetch (fused with the deferred update), + the reference
        nv_r[1] += 4 * (reads_b + chain)    # the backward fetch reads the fp32 master again and casts it
        nv_w[upd] += 4 * N
    if s["offload_optimizer"] == "nvme":     # the optimizer regions the state packs into (AdamW: both)
        state_io = nvme_region_bytes(s.get("optim"), c.shapes)
        nv_r[upd] += state_io
        nv_w[upd] += state_io
    if s["offload_grads"] == "nvme" and not in_bwd:  # accumulators written and read back only deferred (module
        nv_w[1] += 4 * N                    # docstring, "NVMe")
        nv_r[0] += 4 * N
    # a step reads only the share of the regions it rewrites that the window could not keep (:func:`nvme_kept_share`)
    uncached = sum(nv_r)
    ref_on_disk = 4 * N if copy_ref and s["offload_params"] == "nvme" else 0  # read every step, never rewritten
    read_back = sum(nv_w) + ref_on_disk     # what the window must hold beyond its minimum to read nothing
    kept = nvme_kept_share(s.get("nvme_window_spare", 0), read_back)
    nv_r = [round(r * (1 - kept)) for r in nv_r]
    # gradient elements the D2H worker adds into the accumulators (the embedding's rows, as on the link)
    grad_elems = reads - table + (table if dense else B * T * c.hidden_size)
    moved = {"h2d": h2d_f + h2d_b, "h2d_forward": h2d_f, "h2d_backward": h2d_b, "d2h": d2h, "d2h_forward": act_io,
             "nvme_read": sum(nv_r), "nvme_read_uncached": uncached, "nvme_read_back_regions": read_back,
             "nvme_write": sum(nv_w), "nvme_read_forward": nv_r[0], "nvme_write_forward": nv_w[0],
             "grad_add": grad_elems * GRAD_ADD_BYTES[grad_b]}

    # ---- compute (Kaplan et al. 2020 + the recompute forward, by recompute mode)
    tokens = B * T
    q_dim = c.num_heads * c.head_dim
    f_attn = 2 * L * T * q_dim
    rec = recompute_flops(c, s)
    flops_parts = {
        "6 x N_matmul x tokens": 6.0 * c.matmul_params * tokens,
        "attention (forward + backward)": 3.0 * f_attn * tokens,
        f"recompute (recompute={s.get('recompute', 'block')}: block layers)": rec["recompute (block layers)"] * tokens,
        "recompute chains (K > 1)": rec["recompute chains (K > 1)"] * tokens,
        "MLP chunks' second forward (mlp_chunk_size)": rec["MLP chunks' second forward (mlp_chunk_size)"] * tokens,
        "reference copy's forward (reference=copy)": (2.0 * c.matmul_params + f_attn) * tokens if copy_ref else 0.0,
    }
    flops = sum(flops_parts.values())
    flops_forward = 2.0 * c.matmul_params * tokens + f_attn * tokens  # Kaplan: backward = 2 x forward

    gb = 1e9
    times = {
        "compute": flops / (getattr(hw, rate_key) * 1e12),
        "h2d": moved["h2d"] / (hw.h2d_gbps * gb),
        "d2h": d2h / (hw.d2h_gbps * gb),
        "nvme_read": moved["nvme_read"] / (hw.nvme_drives * hw.nvme_read_gbps * gb),
        "nvme_write": moved["nvme_write"] / (hw.nvme_drives * hw.nvme_write_gbps * gb),
        "host_adamw": host_update_seconds(c, hw, s),
        "grad_add": moved["grad_add"] / (host_mem_rate(hw) * gb),
    }
    engine = engine_seconds(c, hw, s, host.get("activations (CPU device)", 0))
    if engine is not None:
        times["engine"] = sum(engine)
    e = dict(host=host, device=device, nvme=nvme, disk=disk, moved=moved, flops=flops, flops_parts=flops_parts,
             flops_forward=flops_forward, times=times, ckpt=ckpt, parallel=None, settings=s, gpu=gpu,
             engine_forward_s=engine[0] if engine else 0.0)
    if s.get("devices", 1) * s.get("num_nodes", 1) > 1:
        on_nvme = s["offload_params"] == "nvme"
        e = scale_out(hw, s, e, n_params=N, grads=reads * grad_b, largest_grads=max(c.block_reads) * grad_b,
                      accum_reads=reads, act_io=act_io, master_fetch=4 * N + 4 * (reads_b + chain) if on_nvme else 0,
                      master_fetch_forward=4 * N if on_nvme else 0,
                      shadow=shadow_total if s["offload_params"] == "cpu" else 0)
    if s.get("nvme_window_limit"):  # state on NVMe: a node's windows cache up to its limit (host is per node)
        e["host"][NVME_CACHE] = window_fill(e["host"], read_back, s["nvme_window_limit"], gpu) - window_bytes(e["host"])
    return e
