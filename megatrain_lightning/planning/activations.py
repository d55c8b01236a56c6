"""Activation memory per token: what a streamed training step keeps for the backward, by option.

Bytes for ``tokens`` = batch_size x seq_len, from the model's shapes (:class:`.counts.ParamCounts`) and the
settings. Symbols: H hidden size, q = heads x head_dim, kv = kv_heads x head_dim, I intermediate size (x
``experts_per_token`` for a mixture of experts), V vocabulary, L decoder layers, K = ``recompute_every``; r = bytes
of the residual stream (fp32, bf16 under ``bf16-true``), a = bytes of a matmul's activations (bf16/fp16 under
autocast, else r).

Source: the tensors autograd saves in Hugging Face's decoder layer (``transformers.models.llama.modeling_llama``:
``LlamaRMSNorm``, ``LlamaAttention`` with ``sdpa_attention_forward``, ``LlamaMLP``; Mistral, Qwen 2/3, Mixtral's
experts follow the same structure), per token and layer, listed with ``torch.autograd.graph.saved_tensors_hooks`` on
a real layer (``tests/test_plan.py`` checks :func:`layer_saved_per_token` against it exactly, in ``32-true`` and
``bf16-mixed``):

* each RMSNorm: its fp32 input (``hidden.to(float32)``, kept by ``pow`` and the ``rsqrt`` multiply) 4H, the
  normalized tensor the weight multiply keeps rH, and the rsqrt, 4 B;
* attention: the projections' input: under autocast each of q/k/v casts the normed input itself (autocast caches
  only weight casts), 3Ha, else one shared rH; the rotary cos and sin (fp32, 2 x head_dim x 4); the rotated q, k
  and v that SDPA keeps (q + 2kv)a, its output qa (the o_proj input is a view of it) and its log-sum-exp, 4 B per
  head; flash/memory-efficient SDPA keeps no T x T score matrix;
* MLP: the input of gate/up, 2Ha under autocast (else rH), then the gate output (kept by SiLU), the SiLU and up
  outputs (kept by their product) and the product (the down projection's input): 4Ia.

The engine keeps one decoder layer's graph at a time (its backward recomputes it from the saved block input), so
these count once, x ``WORKING_SET_FACTOR`` for the activation gradients alive during that layer's backward (an
assumption). Besides that working set:

* saved block inputs: (ceil(L / K) + 1) x H x r per token (every K-th layer input and the LM head's input), on
  the device or, with ``offload_activations``, in pinned host memory with ``RESTORE_IN_FLIGHT`` on the device;
* with K > 1, the K - 1 inputs of a recompute chain rebuilt during its backward;
* the LM head phase (the last block keeps its graph): the final norm as above, the head's input (Ha under
  autocast, else rH), the int64 labels (8 B), and the logits: HF's loss upcasts them to fp32 and runs
  ``cross_entropy`` (``log_softmax`` + ``nll_loss``), so the backward's peak holds the saved fp32
  log-probabilities, their gradient and the logits' gradient, V x 12 B per token (forward: V x (a + 4 + 4)), and
  the logits themselves, V x a B per token (the head block's output, kept until its backward, or with a chunked
  loss each chunk's recomputed logits). Measured: peak RSS of the head and HF's loss alone, forward and backward,
  on a CPU at 2,048 and 4,096 tokens of a 4,096-entry vocabulary: 16.0 B per entry and token in fp32, 12-14 under
  bf16 autocast; the chunked loss's backward (``engine/chunked_loss.py``, 1,365-token chunks of a 49,152-entry
  vocabulary): 16.0 in fp32, 14.9 under bf16 autocast, besides the head weight's fp32 gradient. The head phase
  and a layer's phase do not overlap: the larger counts (on a CPU device, see :func:`heap_keeps_layer_phase`).

Options that cap a term at a chunk of tokens (the term is per token x min(tokens, chunk)):

* ``loss_chunk_size`` = C: the LM head and the cross-entropy over chunks of C tokens, each chunk's logits
  recomputed and freed in backward: the logits terms hold C tokens;
* ``mlp_chunk_size`` = M: each layer's MLP over chunks of M tokens (forward and recompute): the MLP's input casts
  and intermediate hold M tokens (``recompute="block"`` only: in the other modes the chunks run without a
  checkpoint, ``chunked_mlp.plain_chunks``). GPU presets only: on a CPU device the chunks were measured to add
  host RSS (a 4k-vocabulary Llama at 1 x 8192: 1.60 GiB peak without, 1.73-1.77 GiB with 1024-token chunks), so
  the plan counts the MLP uncapped there and does not suggest the option.

The ``recompute`` option (``engine/recompute_policy.py``; docs/architecture.md, "Recompute policy") sets what each
decoder layer keeps between its forward and its backward, per token:

* ``"block"``: its input only (the saved block inputs above); the layer phase is the recomputed graph.
* ``"selective"``: also the outputs of its matmuls and attention (torch's SAC cache, ``SavedOps``):
  :func:`selective_per_token`. The layer phase is still the recomputed graph.
* ``"none"``: its whole autograd graph, weights excluded (``engine/boundary/kept.py``): the
  :func:`layer_saved_per_token` sum (its first norm's fp32 input is the block input, so no separate input is
  kept; under ``bf16-true`` it is the input's fp32 cast) for every layer, plus the final norm's graph
  ((4 + r)H + 4) and the embedding's int64 indices (8 B); under autocast not the weights' casts
  (the engine casts the fetched weight again in backward). The layer phase is then the activation gradients
  only, x (``WORKING_SET_FACTOR`` - 1).
* ``"auto"``: per layer one of the three, chosen by :func:`.terms.resolve_auto`.

With ``offload_activations`` the kept op outputs and graphs go to pinned host memory with the block inputs
(``transport.offload``), two layers' worth in flight on the device. Checked against the engine's measured
``megatrain/saved_activation_bytes`` on tiny Llama models (``tests/test_plan_recompute.py``: within 10% for each
mode, two sequence lengths, fp32 and bf16-mixed; "selective" and "block" exactly; "none" is above by the rotary
tables, counted per token here but per position in the model, and the LM head's input, which the engine keeps but
does not report).
"""

from __future__ import annotations

import math
from typing import Any

from .counts import ParamCounts

WORKING_SET_FACTOR = 1.5   # activation gradients alive during one layer's backward (assumption)
RESTORE_IN_FLIGHT = 2      # offloaded block inputs on the device: the one in use + one prefetched


def _dtypes(s: dict[str, Any]) -> tuple[int, int, bool]:
    from .terms import PRECISIONS

    _, _, _, r, a, _ = PRECISIONS[s["precision"]]
    return r, a, a < r


def layer_saved_per_token(c: ParamCounts, s: dict[str, Any]) -> dict[str, float]:
    """Bytes per token autograd saves in one decoder layer's forward (no working-set factor):
    ``{"attention": ..., "mlp norm": ..., "mlp": ...}``; ``"mlp"`` is what ``mlp_chunk_size`` caps."""
    r, a, mixed = _dtypes(s)
    H = c.hidden_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    norm = (4 + r) * H + 4
    return {
        "attention": norm + (3 * H * a if mixed else H * r) + 2 * c.head_dim * 4 + (2 * q + 2 * kv) * a + 4 * c.num_heads,
        "mlp norm": norm,
        "mlp": (2 * H * a if mixed else H * r) + 4 * c.intermediate_size * max(1, c.experts_per_token) * a,
    }


def selective_per_token(c: ParamCounts, s: dict[str, Any]) -> float:
    """Bytes per token ``recompute="selective"`` keeps in one decoder layer, in the matmul dtype ``a``: the
    q, k, v, o projections' outputs (q + 2kv + H), gate/up/down's (2I + H, per expert a token passes through), the
    SDPA output q and its fp32 log-sum-exp (4 B per head)."""
    _, a, _ = _dtypes(s)
    H = c.hidden_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    experts = max(1, c.experts_per_token)
    return (q + 2 * kv + H) * a + experts * (2 * c.intermediate_size + H) * a + q * a + 4 * c.num_heads


def layer_mix(c: ParamCounts, s: dict[str, Any]) -> dict[str, int]:
    """Decoder layers per policy, ``{"block": n, "selective": n, "none": n}``; for ``"auto"``
    ``s["recompute_mix"]`` (:func:`.terms.resolve_auto`; ``"block"`` everywhere until set)."""
    mode = s.get("recompute", "block")
    mix = (s.get("recompute_mix") or {"block": c.num_layers}) if mode == "auto" else {mode: c.num_layers}
    return {k: int(mix.get(k, 0)) for k in ("block", "selective", "none")}


def kept_per_token(c: ParamCounts, s: dict[str, Any]) -> dict[str, float]:
    """What the engine keeps between forward and backward, bytes per token by part (its ``saved_activation_bytes``
    plus the LM head's input): ``"block inputs"``, ``"embedding indices"`` (the embedding keeps its graph under
    every mode, ``engine/recompute_policy.py`` ``is_lookup``), ``"selective op outputs"``, ``"none: layer graphs"``
    (with the final norm when every layer keeps its graph)."""
    r, _, _ = _dtypes(s)
    H, K = c.hidden_size, s.get("recompute_every", 1)
    mix = layer_mix(c, s)
    recomputed = mix["block"] + mix["selective"]
    lay = sum(layer_saved_per_token(c, s).values())
    none = mix["none"] * lay + ((4 + r) * H + 4 if mix["none"] == c.num_layers else 0)  # + the final norm's graph
    return {"block inputs": (math.ceil(recomputed / K) + 1) * H * r, "embedding indices": 8,
            "selective op outputs": mix["selective"] * selective_per_token(c, s),
            "none: layer graphs": none}


def kept_bytes(c: ParamCounts, s: dict[str, Any]) -> int:
    """:func:`kept_per_token` x ``batch_size x seq_len``: the engine's ``megatrain/saved_activation_bytes`` plus
    the LM head's input (H x r per token)."""
    tokens = s["batch_size"] * s["seq_len"]
    return int(sum(kept_per_token(c, s).values()) * tokens)


def head_per_token(c: ParamCounts, s: dict[str, Any]) -> dict[str, float]:
    """LM head phase bytes per token (module docstring): ``"final norm + input"``, ``"logits"`` (the backward's
    fp32 peak), ``"logits output"`` (the logits in the matmul dtype) and ``"logits saved"`` (what autograd saves in
    the forward: 4 B per entry + the int64 label); ``loss_chunk_size`` caps the two logits terms."""
    r, a, mixed = _dtypes(s)
    H, V = c.hidden_size, c.vocab_size
    return {"final norm + input": (4 + r) * H + 4 + (H * a if mixed else H * r),
            "logits": 12 * V + 8, "logits output": a * V, "logits saved": 4 * V + 8}


def per_token_terms(c: ParamCounts, s: dict[str, Any], gpu: bool = True) -> dict[str, tuple[float, int | None, str]]:
    """Activation terms as ``label -> (bytes per token, chunk cap in tokens or None, where)``; ``where`` is
    ``"device"``, ``"host"`` or a phase, ``"layer"`` / ``"head"`` (device memory, the larger counts).

    ``gpu=False`` (the CPU device): an offloaded input is used where it lies in host memory
    (``CPUTransport.restore``), so none is in flight.
    """
    r, _, _ = _dtypes(s)
    H, K = c.hidden_size, s["recompute_every"]
    mix = layer_mix(c, s)
    recomputes = mix["block"] + mix["selective"] > 0
    # "none" everywhere: the layer phase holds the activation gradients only (the graph is kept)
    ws = WORKING_SET_FACTOR if recomputes else WORKING_SET_FACTOR - 1
    lay, head = layer_saved_per_token(c, s), head_per_token(c, s)
    kept = kept_per_token(c, s)
    saved = kept["block inputs"] + kept["embedding indices"]
    ops = kept["selective op outputs"] + kept["none: layer graphs"]
    per_layer_kept = max(selective_per_token(c, s) if mix["selective"] else 0,
                         sum(lay.values()) if mix["none"] else 0)
    off = s["offload_activations"]
    return {
        "saved block inputs": (0 if off else saved, None, "device"),
        f"kept op outputs / graphs (recompute={s.get('recompute', 'block')})": (0 if off else ops, None, "device"),
        "restored inputs in flight": ((RESTORE_IN_FLIGHT * (H * r + per_layer_kept)) if off and gpu else 0,
                                      None, "device"),
        "recompute chain inputs (K > 1)": ((K - 1) * H * r if recomputes else 0, None, "device"),
        "layer: norms + attention": (ws * (lay["attention"] + lay["mlp norm"]), None, "layer"),
        # a GPU's cap only (module docstring)
        "layer: MLP input + intermediate": (ws * lay["mlp"], s["mlp_chunk_size"] if mix["block"] == c.num_layers and gpu
                                            else None, "layer"),
        "head: final norm + input": (head["final norm + input"], None, "head"),
        "head: logits, log-probs, grads (fp32)": (head["logits"], s["loss_chunk_size"], "head"),
        # a chunk's backward holds its recomputed logits with the three fp32 tensors above: capped alike
        "head: logits (the head's output, or one chunk's recomputed)": (
            head["logits output"], s["loss_chunk_size"], "head"),
        "offloaded block inputs": (saved if off else 0, None, "host"),
        "offloaded op outputs / graphs": (ops if off else 0, None, "host"),
    }


def activation_bytes(c: ParamCounts, s: dict[str, Any], gpu: bool = True) -> tuple[dict[str, int], dict[str, int]]:
    """Device and host activation bytes for ``batch_size x seq_len`` tokens.

    Returns:
        ``(device, host)``: label -> bytes. ``device`` holds the always-resident terms and one
        ``"computing block activations (...)"`` entry: the larger of the layer phase and the LM
        head phase, named by the phase.
    """
    tokens = s["batch_size"] * s["seq_len"]
    dev: dict[str, int] = {}
    host: dict[str, int] = {}
    phase = {"layer": 0, "head": 0}
    for label, (pt, cap, where) in per_token_terms(c, s, gpu).items():
        cap = None if cap is None else (cap * s["batch_size"] if label.startswith("layer") else cap)
        n = int(pt * (tokens if cap is None else min(tokens, cap)))  # a chunk option caps the term
        if where in phase:
            phase[where] += n
        elif where == "host":
            host[label] = n
        else:
            dev[label] = n
    which = "head" if phase["head"] > phase["layer"] else "layer"
    label = {"head": "computing block activations (LM head: logits + grad)",
             "layer": "computing block activations (one decoder layer)"}[which]
    dev[label] = phase[which]
    if not gpu and heap_keeps_layer_phase(c, s):
        dev[HEAP_KEPT] = min(phase.values())
    return dev, host


#: the CPU device's term for what glibc's heap keeps of the smaller phase (:func:`heap_keeps_layer_phase`)
HEAP_KEPT = "the other phase's freed buffers (CPU device: kept by glibc's heap)"


def heap_keeps_layer_phase(c: ParamCounts, s: dict[str, Any]) -> bool:
    """Whether, on a CPU device, the C heap keeps a decoder layer's freed activations resident while the LM head
    computes (and the other way round), so that both phases count in host RAM instead of the larger.

    A layer's activations are mostly ``[tokens, hidden]`` tensors; below glibc's mmap threshold (fixed by the
    strategy at ``store.allocator.MMAP_THRESHOLD_BYTES``, 8 MiB) they come from the heap, whose freed space stays
    resident (glibc ``free`` gives back only the top of the heap), while the head's larger tensors are mapped.
    Measured (``mallinfo2`` during ``bench/plan_vs_run.py``'s ``t-ram-fp32-block-1x8192``, a hidden-128 Llama,
    4 MiB residual tensors): the arena held 119-155 MiB free while the head ran, the layer phase's planned 131 MiB;
    peak RSS was the head phase plus that (plan with both phases: 0.99 of the measured peak, with the larger only:
    1.17). Above the threshold nothing stays: the larger phase counts, as on a GPU.
    """
    from ..store.allocator import MMAP_THRESHOLD_BYTES

    r, _, _ = _dtypes(s)
    return s["batch_size"] * s["seq_len"] * c.hidden_size * max(r, 4) < MMAP_THRESHOLD_BYTES
