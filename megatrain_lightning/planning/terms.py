"""The planner's arithmetic: bytes per memory tier, bytes moved and a lower bound on time per optimizer step.

Every number follows from the parameter counts of the real model (:mod:`.counts`, meta
device), the settings, and one :class:`~.config.Hardware` preset. Units: bytes, seconds,
FLOP; GiB = 2**30 B; bandwidths in GB/s = 1e9 B/s; compute in TFLOP/s = 1e12 FLOP/s.

Memory tiers (docs/architecture.md, "Memory tiers"), N = unique parameters (tied counted once):

* host RAM: fp32 master 4 B/param, fp32 gradient accumulator 4, AdamW exp_avg 4 and
  exp_avg_sq 4, plus the bf16/fp16 wire shadow 2 B/param under a 2-byte wire (the engine
  casts each slab once per step after its update and streams the copy); pinned D2H staging
  (2 buffers of the largest block's gradients, pinned exactly: ``store/pinned.py``); with masters
  on NVMe and a 2-byte wire, 2 H2D staging slots of the largest block's wire image (all pinned
  memory is pinned at its exact size, rounded to the 4 KiB page: no power-of-two rounding); a fixed 4 GiB for the process (Python, CUDA host side,
  data loader) -- an assumption. A part moved to NVMe leaves a window of
  (lookahead + 2) blocks of it in RAM (read-ahead, the block in use, write-behind).
* device: the largest block x (lookahead + 1) in the wire dtype, its fp32 upcast under mixed
  precision (``precision.py``: bf16 on the wire, fp32 params under autocast), the block's
  parameter gradients (device dtype) plus the packed copies queued for D2H (``transport.stage_grads``;
  at most ``D2H_INFLIGHT`` = 2 batches, the gradient sink's bound),
  the saved block inputs (ceil(L/K) + 1) x B x T x H in the residual-stream dtype (fp32
  under mixed precision), one block's recompute activations (estimate below), fp32 logits
  B x T x V x 4 and their gradient of the same size, and a 2 GiB runtime reserve (CUDA
  context, cuBLAS workspaces, allocator fragmentation; assumption). With no accelerator
  (``hbm_gib: null``) the device buffers are host RAM and are added to the host tier; there,
  under ``32-true`` with ``cpu_zero_copy`` (the strategy's default) blocks bind the fp32
  masters directly: no weight buffers and no H2D bytes.
* disk: the NVMe store (the parts moved there) + ``keep_checkpoints`` directory
  checkpoints (a save keeps the previous one complete until the new one is renamed in).
  A checkpoint is fp32 weights + both AdamW moments = 12 B/param + 16 MiB of metadata
  allowance (config, index, checksums, trainer state).

One block's recompute activations (an estimate, not a measurement): per token
(2H + 2 q_dim + 3 kv_dim + 2H + 4 I) elements in the matmul dtype (norm outputs, q and its
rotated copy, k/v and rotated k, attention output, MLP gate/up/activation/product) + 3H
fp32 elements (residual and norm inputs), x 1.5 for the transient gradients of backward;
with flash/SDPA attention no T x T score matrix is kept.

Per optimizer step (one micro-batch of ``batch_size`` x ``seq_len`` tokens):

* H2D = (2 x params read by all blocks - params of the last block) x wire bytes: the forward
  fetch plus the backward fetch that recomputes each block, except the last block of the
  forward (the LM head; the final norm's H params are counted with it), which keeps its
  graph and its weights on the device until its backward and so is fetched once (tied
  weights are fetched by both blocks that read them);
  with ``recompute_every=K`` the recompute chains fetch (K-1)/K of the layers once more;
  offloaded activations come back in backward.
* D2H = (params read by all blocks) x gradient bytes (fp32 by default, bf16 for
  ``bf16-true`` or ``grad_dtype``), plus offloaded activations in forward.
* NVMe (when offloaded): moments read 8 B/param + written 8; masters read 4 (the update is
  fused with the forward fetch) + the backward fetch in the wire dtype, written 4 + the
  2-byte shadow; gradient accumulators written 4 + read 4.
* compute FLOPs ~ 8 x N_matmul x tokens + 8 x L x T x d_attn x tokens: the 6N of
  forward + backward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
  table 1: C_forward ~ 2N + 2 n_layer n_ctx d_attn, backward = 2 x forward) plus 2N for the
  per-block recompute of the forward in backward (the engine recomputes every block but the
  last, the LM head, whose 2N_head is therefore counted 3x, not 4x), plus
  (K-1)/K x one more layer forward with K > 1. N_matmul excludes the input-embedding lookup
  (no FLOPs) unless it is tied to the LM head.
* host AdamW: N / ``host_adam_gparams_per_s`` (torch's fused CPU kernel; the shadow cast is
  folded into the presets' memory-bandwidth assumption, measured separately at 4.5 G
  params/s on the 2-core dev box).

Lower bound on step time = max(compute at peak dense TFLOP/s (bf16 for 2-byte wire modes, fp32
non-tensor for ``32-true``), H2D / h2d bandwidth, D2H / d2h bandwidth, NVMe reads / (drives x
read bandwidth), NVMe writes / (drives x write bandwidth), host AdamW): every stream is assumed
to overlap perfectly with the others. PCIe is full duplex, but H2D was measured to drop to
about half its bandwidth while D2H runs; D2H only runs during backward, so the *pessimistic*
variant charges the forward H2D at full bandwidth and the backward H2D at half bandwidth
while the D2H proceeds alongside: link = H2D_fwd / bw + max(2 x H2D_bwd / bw, D2H / d2h_bw).
"""

from __future__ import annotations

import math
from typing import Any

from .config import GIB, Hardware
from .counts import ParamCounts

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
PROCESS_OVERHEAD = 4 * GIB      # host: Python, torch, CUDA host side, data loader (assumption)
DEVICE_RESERVE = 2 * GIB        # device: CUDA context, workspaces, fragmentation (assumption)
CKPT_METADATA = 16 * 2**20      # checkpoint metadata allowance
WORKING_SET_FACTOR = 1.5        # transient gradients during one block's backward (assumption)
D2H_INFLIGHT = 2                # packed gradient batches queued for the D2H worker at most (engine/grads.py)

TERM_LABELS = {"compute": "compute", "h2d": "H2D link", "d2h": "D2H link", "nvme_read": "NVMe read",
               "nvme_write": "NVMe write", "host_adamw": "host AdamW",
               "link_duplex": "H2D+D2H (H2D halved while D2H runs)"}


def _estimate(c: ParamCounts, hw: Hardware, s: dict[str, Any]) -> dict[str, Any]:
    """Pure arithmetic for one batch size: the tiers, bytes moved and seconds per term."""
    wire, dev_param, _, act_saved, act_mm, rate_key = PRECISIONS[s["precision"]]
    grad_b = s["grad_bytes"]
    B, T, K, la = s["batch_size"], s["seq_len"], s["recompute_every"], s["lookahead"]
    N, big, L, H = c.total, c.largest_block, c.num_layers, c.hidden_size
    shadow = 2 if wire == 2 else 0          # fp32 wire streams the master itself
    window = la + 2                         # blocks of an offloaded part resident in RAM
    gpu = hw.is_gpu
    zero_copy = not gpu and wire == 4 and s["cpu_zero_copy"]  # strategy default on a CPU device

    # ---- device
    saved_calls = math.ceil(L / K) + 1
    saved_bytes = saved_calls * B * T * H * act_saved
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token = (2 * H + 2 * q_dim + 3 * kv_dim + 2 * H + 4 * c.intermediate_size) * act_mm + 3 * H * 4
    device = {
        f"block weights x{la + 1} (wire)": 0 if zero_copy else big * (la + 1) * wire,
        "fp32 upcast of computing block": big * 4 if wire < dev_param else 0,
        "block param grads + queued D2H packs": big * (dev_param + D2H_INFLIGHT * grad_b),
        "saved block inputs": 0 if s["offload_activations"] else saved_bytes,
        "restored inputs in flight": 2 * B * T * H * act_saved if s["offload_activations"] else 0,
        "one block's recompute activations": int(B * T * per_token * WORKING_SET_FACTOR),
        "logits fp32": B * T * c.vocab_size * 4,
        "logits grad fp32": B * T * c.vocab_size * 4,
        "runtime reserve": DEVICE_RESERVE if gpu else 0,
    }

    # ---- host and NVMe
    host: dict[str, int] = {}
    nvme: dict[str, int] = {}
    if s["offload_params"] == "cpu":
        host["fp32 master weights"] = 4 * N
        host["wire shadow (2 B/param)"] = shadow * N
    else:
        nvme["fp32 master weights"] = 4 * N
        nvme["wire shadow (2 B/param)"] = shadow * N
        host["master+shadow window"] = window * big * (4 + shadow)
    if s["offload_grads"] == "cpu":
        host["fp32 grad accumulators"] = 4 * N
    else:
        nvme["fp32 grad accumulators"] = 4 * N
        host["grad accumulator window"] = window * big * 4
    if s["offload_optimizer"] == "cpu":
        host["AdamW exp_avg + exp_avg_sq"] = 8 * N
    else:
        nvme["AdamW exp_avg + exp_avg_sq"] = 8 * N
        host["AdamW moments window"] = window * big * 8
    if gpu:
        host["pinned D2H staging (2 blocks)"] = 2 * big * grad_b
        if s["offload_params"] == "nvme" and shadow:
            host["pinned H2D staging ring (2 wire images)"] = 2 * big * shadow
    if s["offload_activations"]:
        host["offloaded block inputs"] = saved_bytes
    if not gpu:
        host["device buffers (CPU device)"] = sum(device.values())
    host["process overhead"] = PROCESS_OVERHEAD

    ckpt = 12 * N + CKPT_METADATA
    disk = {"NVMe store": sum(nvme.values()), f"checkpoints x{s['keep_checkpoints']}": s["keep_checkpoints"] * ckpt}

    # ---- bytes moved per step
    reads = c.reads_per_pass
    reads_b = reads - c.head_reads             # the last block keeps its graph: fetched once
    chain = c.layer_total * (K - 1) // K
    act_io = saved_bytes if s["offload_activations"] else 0
    h2d_f, h2d_b = reads * wire, (reads_b + chain) * wire + act_io
    if zero_copy:                              # CPU device bound to the fp32 masters: nothing copied
        h2d_f = h2d_b = 0
    d2h = reads * grad_b + act_io
    nv_r = nv_w = 0
    if s["offload_params"] == "nvme":
        nv_r += 4 * N + (reads_b + chain) * wire
        nv_w += (4 + shadow) * N
    if s["offload_optimizer"] == "nvme":
        nv_r += 8 * N
        nv_w += 8 * N
    if s["offload_grads"] == "nvme":
        nv_r += 4 * N
        nv_w += 4 * N
    moved = {"h2d": h2d_f + h2d_b, "h2d_forward": h2d_f, "h2d_backward": h2d_b, "d2h": d2h,
             "nvme_read": nv_r, "nvme_write": nv_w}

    # ---- compute (Kaplan et al. 2020 + the recompute forward)
    tokens = B * T
    f_layers = 2 * c.layer_total + 2 * L * T * q_dim
    f_head = 2 * (c.matmul_params - c.layer_total)
    f_attn = 2 * L * T * q_dim
    flops_parts = {
        "8 x N_matmul x tokens": 8.0 * c.matmul_params * tokens,
        "attention": (4 + (K - 1) / K) * f_attn * tokens,
        "LM head not recomputed": -1.0 * f_head * tokens,
        "recompute chains (K > 1)": (K - 1) / K * 2 * c.layer_total * tokens,
    }
    flops = sum(flops_parts.values())
    assert math.isclose(flops, tokens * (4 * f_layers + 3 * f_head + (K - 1) / K * f_layers), rel_tol=1e-9)

    gb = 1e9
    times = {
        "compute": flops / (getattr(hw, rate_key) * 1e12),
        "h2d": moved["h2d"] / (hw.h2d_gbps * gb),
        "d2h": d2h / (hw.d2h_gbps * gb),
        "nvme_read": nv_r / (hw.nvme_drives * hw.nvme_read_gbps * gb),
        "nvme_write": nv_w / (hw.nvme_drives * hw.nvme_write_gbps * gb),
        "host_adamw": N / (hw.host_adam_gparams_per_s * gb),
    }
    pess = dict(times)
    pess["link_duplex"] = h2d_f / (hw.h2d_gbps * gb) + max(2 * h2d_b / (hw.h2d_gbps * gb), d2h / (hw.d2h_gbps * gb))
    del pess["h2d"], pess["d2h"]
    return dict(host=host, device=device, nvme=nvme, disk=disk, moved=moved, flops=flops, flops_parts=flops_parts,
                times=times, pess=pess, ckpt=ckpt)
