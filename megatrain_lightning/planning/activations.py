"""Activation memory per token: what a streamed training step keeps for the backward, by option.

Bytes for ``tokens`` = batch_size x seq_len tokens, from the model's shapes (:class:`.counts.ParamCounts`)
and the settings. Symbols: H hidden size, q = heads x head_dim, kv = kv_heads x head_dim,
I intermediate size (x ``experts_per_token`` for a mixture of experts), V vocabulary,
L decoder layers, K = ``recompute_every``; r = bytes of the residual stream (fp32 under
``32-true`` and the mixed modes, bf16 under ``bf16-true``), a = bytes of a matmul's
activations (bf16/fp16 under autocast, else as r).

Source: the tensors autograd saves for the backward in Hugging Face's decoder layer
(``transformers.models.llama.modeling_llama``: ``LlamaRMSNorm``, ``LlamaAttention`` with
``sdpa_attention_forward``, ``LlamaMLP``; Mistral, Qwen 2/3, Mixtral's experts follow the same
structure), per token and layer, listed from ``torch.autograd.graph.saved_tensors_hooks`` on a
real layer (``tests/test_plan.py`` checks :func:`layer_saved_per_token` against that count,
exactly, in ``32-true`` and ``bf16-mixed``):

* each RMSNorm: its fp32 input (``hidden.to(float32)``, kept by ``pow`` and the ``rsqrt``
  multiply) 4H, the normalized tensor the weight multiply keeps rH, and the rsqrt, 4 B;
* attention: the projections' input: under autocast each of q/k/v casts the normed input itself
  (autocast caches only weight casts), 3Ha, else one shared rH; the rotary cos and sin (fp32,
  2 x head_dim x 4); the rotated q, k and v that SDPA keeps (q + 2kv)a, its output qa (the
  o_proj input is a view of it) and its log-sum-exp, 4 B per head; flash/memory-efficient SDPA
  keeps no T x T score matrix;
* MLP: the input of gate/up, 2Ha under autocast (else rH), then the gate output (kept by
  SiLU), the SiLU and up outputs (kept by their product) and the product (the down
  projection's input): 4Ia.

The engine keeps one decoder layer's graph at a time (its backward recomputes it from the saved
block input), so these count once, x ``WORKING_SET_FACTOR`` for the activation gradients alive
during that layer's backward (an assumption). Besides that working set:

* saved block inputs: (ceil(L / K) + 1) x H x r per token (every K-th layer input and the LM
  head's input), on the device or, with ``offload_activations``, in pinned host memory with two
  inputs in flight on the device (the one in use and the one prefetched);
* with K > 1, the K - 1 inputs of a recompute chain rebuilt during its backward;
* the LM head phase (the last block keeps its graph, no recompute): the final norm as above and
  the head's input (Ha under autocast, else rH), the int64 labels (8 B), and the logits: HF's
  loss upcasts them to fp32 and runs ``cross_entropy`` (``log_softmax`` + ``nll_loss``), so
  the backward's peak holds the saved fp32 log-probabilities, their gradient and the logits'
  gradient, V x 12 B per token (forward: V x (a + 4 + 4), not more); the issue's estimate
  "vocab x seq x 4 B x ~2" is the first two of these. The head phase and a layer's phase do
  not overlap: the larger counts.

Options that cap a term at a chunk of tokens (the term is per token x min(tokens, chunk)):

* ``loss_chunk_size`` = C: the LM head and the cross-entropy over chunks of C tokens, each
  chunk's logits recomputed and freed in backward: the logits term holds C tokens, not all;
* ``mlp_chunk_size`` = M: each layer's MLP over chunks of M tokens (in forward and in the
  recompute): the MLP's input casts and intermediate hold M tokens.
"""

from __future__ import annotations

import math
from typing import Any

from .counts import ParamCounts

WORKING_SET_FACTOR = 1.5   # activation gradients alive during one layer's backward (assumption)
RESTORE_IN_FLIGHT = 2      # offloaded block inputs on the device: the one in use + one prefetched


def _capped(per_token: float, tokens: int, chunk: int | None) -> int:
    return int(per_token * (tokens if chunk is None else min(tokens, chunk)))


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


def head_per_token(c: ParamCounts, s: dict[str, Any]) -> dict[str, float]:
    """LM head phase bytes per token: ``"final norm + input"`` and ``"logits"`` (the backward's peak,
    12 B per vocabulary entry: what ``loss_chunk_size`` caps); ``"logits saved"`` is the part autograd
    saves in the forward (4 B per entry + the int64 label)."""
    r, a, mixed = _dtypes(s)
    H, V = c.hidden_size, c.vocab_size
    return {"final norm + input": (4 + r) * H + 4 + (H * a if mixed else H * r),
            "logits": 12 * V + 8, "logits saved": 4 * V + 8}


def per_token_terms(c: ParamCounts, s: dict[str, Any], gpu: bool = True) -> dict[str, tuple[float, int | None, str]]:
    """Activation terms as ``label -> (bytes per token, chunk cap in tokens or None, where)``.

    ``gpu=False`` (the CPU device): an offloaded input is used where it lies in host memory
    (``CPUTransport.restore``), so none is in flight.

    ``where`` is ``"device"``, ``"host"`` or one of the two phases ``"layer"`` / ``"head"``
    (device memory, the larger phase counts). Bytes of a term = per token x min(tokens, cap).
    """
    r, _, _ = _dtypes(s)
    H, L, K = c.hidden_size, c.num_layers, s["recompute_every"]
    ws = WORKING_SET_FACTOR
    lay, head = layer_saved_per_token(c, s), head_per_token(c, s)
    saved = (math.ceil(L / K) + 1) * H * r
    off = s["offload_activations"]
    return {
        "saved block inputs": (0 if off else saved, None, "device"),
        "restored inputs in flight": (RESTORE_IN_FLIGHT * H * r if off and gpu else 0, None, "device"),
        "recompute chain inputs (K > 1)": ((K - 1) * H * r, None, "device"),
        "layer: norms + attention": (ws * (lay["attention"] + lay["mlp norm"]), None, "layer"),
        "layer: MLP input + intermediate": (ws * lay["mlp"], s["mlp_chunk_size"], "layer"),
        "head: final norm + input": (head["final norm + input"], None, "head"),
        "head: logits, log-probs, grads (fp32)": (head["logits"], s["loss_chunk_size"], "head"),
        "offloaded block inputs": (saved if off else 0, None, "host"),
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
        n = _capped(pt, tokens, cap)
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
    return dev, host
