"""Plain-text tables of a :class:`~.estimate.Plan` (what ``python -m megatrain_lightning.plan`` prints)."""

from __future__ import annotations

from .activations import kept_bytes, per_token_terms
from .advice import block_group_advice, device_advice, host_short_advice, recompute_advice, window_advice
from .config import Hardware
from .estimate import Plan, gib, long_sequence_variants, max_seq_len
from .parallel import host_mem_rate, intra_rate
from .phases import update_worker
from .terms import (NVME_CACHE, TERM_LABELS, block_calls, checkpoint_state_bytes, group_size, host_update_work,
                    layer_wire_bytes, layers_in_flight, optim_title, term_label, update_in_backward, zero_copy)

#: data parallel: the terms that are per node (the rest are per GPU)
NODE_TERMS = ("nvme_read", "nvme_write", "host_adamw", "grad_add", "host_memory", "inter_node")


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _rate(p: Plan, key: str) -> str:
    hw = p.hardware
    rk = "fp32_tflops" if p.settings["precision"] == "32-true" else "bf16_tflops"
    return {
        "compute": f"{getattr(hw, rk):g} TFLOP/s ({rk.split('_')[0]})",
        "h2d": f"{hw.h2d_gbps:g} GB/s",
        "d2h": f"{hw.d2h_gbps:g} GB/s",
        "nvme_read": f"{hw.nvme_drives} x {hw.nvme_read_gbps:g} GB/s",
        "nvme_write": f"{hw.nvme_drives} x {hw.nvme_write_gbps:g} GB/s",
        "host_adamw": _update_rate(p),
        "grad_add": f"{host_mem_rate(hw):g} GB/s host memory",
        "host_memory": f"{host_mem_rate(hw):g} GB/s",
        "intra_node": "{:g} GB/s {}".format(*intra_rate(hw)),
        "inter_node": f"{hw.network_gbps or 0:g} GB/s network",
        "engine": (f"{hw.block_call_ms:g} ms/call + {hw.step_overhead_ms:g} ms"
                   + (f" + activations at {hw.page_fill_gbps:g} GB/s" if hw.page_fill_gbps else "")
                   if hw.block_call_ms is not None else ""),
    }[key]


def _fit_word(need: int, have: int | None) -> str:
    if have is None:
        return ""
    if need > have:
        return "  SHORT"
    room = (have - need) / have
    return f"  fits, TIGHT: {room:.1%} headroom (< 5%)" if room < 0.05 else f"  fits ({room:.0%} free)"


def _tier(title: str, items: dict[str, int], need: int, have: int | None, note: str = "") -> list[str]:
    out = [f"  {title:<54} {'GiB':>10}"]
    out += [f"    {k:<52} {gib(v):>10}" for k, v in items.items() if v]
    out.append(f"    {'total' + note:<52} {gib(need):>10}   have {gib(have)}{_fit_word(need, have)}")
    return out


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def format_activations(p: Plan) -> list[str]:
    """Activation memory per token for the plan's options (device and host), and the chunk-capped terms."""
    s = p.settings
    terms = per_token_terms(p.counts, s, p.hardware.is_gpu)
    where = {"device": "device", "layer": "device, layer phase", "head": "device, head phase", "host": "host, pinned"}
    out = [f"activations (loss_chunk_size={s['loss_chunk_size']} mlp_chunk_size={s['mlp_chunk_size']} "
           f"offload_activations={s['offload_activations']} recompute_every={s['recompute_every']}; "
           "formulas: planning/activations.py)"]
    out.append("  " + recompute_line(p))
    for k, (pt, cap, w) in terms.items():
        if not pt:
            continue
        size = f"{_kib(pt):>14} per token"
        if cap is not None:
            size += f", up to {cap:,} tokens: {gib(pt * cap)} GiB at most"
        out.append(f"    {k:<40} {size}   ({where[w]})")

    def per_token(w: str) -> float:
        return sum(pt for pt, cap, ww in terms.values() if ww == w and cap is None)

    dev, phase = per_token("device"), max(per_token("layer"), per_token("head"))
    out.append(f"  per token beyond the chunks: device {_kib(dev + phase)} (resident {_kib(dev)} + the larger phase "
               f"{_kib(phase)}), host {_kib(per_token('host'))}"
               + ("" if p.hardware.is_gpu else " (CPU device: the device's bytes are host RAM too)"))
    return out


def recompute_line(p: Plan) -> str:
    """The ``recompute`` mode, the activation bytes it keeps between forward and backward (the engine's
    ``saved_activation_bytes``, plus the LM head's input), and for ``"auto"`` its budget and mix."""
    s = p.settings
    kept = kept_bytes(p.counts, s)
    where = "host, pinned" if s["offload_activations"] else "device"
    line = (f"recompute={s.get('recompute', 'block')}: keeps {gib(kept)} GiB of activations from forward to backward "
            f"({where})")
    if s.get("recompute") == "auto":
        mix = s.get("recompute_mix") or {}
        src = "activation_memory_limit" if s.get("activation_memory_limit") is not None else \
            "half the free " + ("device memory" if p.hardware.is_gpu else "host RAM")
        line += (f"; budget {gib(s.get('activation_budget'))} GiB ({src}); expected layers block/selective/none: "
                 f"{mix.get('block', 0)}/{mix.get('selective', 0)}/{mix.get('none', 0)} (the engine decides after "
                 f"its first forward and logs it)")
    return line


def format_longest(p: Plan) -> list[str]:
    """The longest sequence at batch 1 for the plan's options and with the long-sequence options added."""
    hw = p.hardware
    what = (f"device {gib(p.capacity['device'])} GiB, host {gib(p.capacity['host'])} GiB" if hw.is_gpu
            else f"host {gib(p.capacity['host'])} GiB")
    out = [f"longest seq_len at batch_size=1 on {hw.name} ({what}):",
           f"    {'these options':<64} {max_seq_len(p):>12,}"]
    out += [f"    {label:<64} {n:>12,}" for label, n in longest_rows([p])[0][2]]
    mp = p.counts.max_position_embeddings
    if mp:
        out.append(f"    (the model's max_position_embeddings is {mp:,}; memory alone is counted above)")
    return out


def transfer_line(p: Plan) -> str:
    """The decoder-layer fetch: ``block_group``, its bytes per transfer (the largest layer in the wire
    dtype x ``block_group``) and the decoder layers whose weights the device holds in flight."""
    s, c = p.settings, p.counts
    G = group_size(c, s)
    per = layer_wire_bytes(c, s)
    asked, flight = s.get("block_group", 1), layers_in_flight(c, s)
    line = (f"transfers: block_group={asked}: {p.transfer_bytes / 2**20:,.1f} MiB per decoder-layer "
            f"fetch ({G} x {per / 2**20:,.1f} MiB in the wire dtype); weights of up to {flight} "
            f"decoder layers in flight ("
            + (f"(lookahead + 1) x {G}" if flight == (s["lookahead"] + 1) * G else f"all {c.num_layers} layers")
            + ")")
    if asked > G:
        line += (f"; block_group={asked} is more than the model's {c.num_layers} decoder layers: the strategy "
                 f"fetches them as one group of {G} (as block_group={G})")
    if zero_copy(p.hardware, s):
        line += "; no copies here (CPU device, cpu_zero_copy: blocks bind the fp32 masters)"
    return line


def assumption_lines(hw: Hardware) -> list[str]:
    """The hardware figures a plan rests on, each with its source (``Hardware.sources``: datasheet, measured,
    assumed, or set on the command line), first in every plan."""
    src = dict(hw.sources or {})
    why = lambda k: src.get(k, "source not given in the preset")  # noqa: E731
    nvme = (f"{hw.nvme_drives} x {hw.nvme_capacity_gib:,.0f} GiB, {hw.nvme_read_gbps:g} / {hw.nvme_write_gbps:g} GB/s "
            "read / write per drive")
    rows = [
        ("device memory", f"{hw.hbm_gib:,.1f} GiB" if hw.is_gpu else "none (CPU: the device is host RAM)", "device"),
        ("compute", f"{hw.bf16_tflops:g} TFLOP/s bf16, {hw.fp32_tflops:g} fp32", "compute"),
        ("host link", f"{hw.h2d_gbps:g} / {hw.d2h_gbps:g} GB/s H2D / D2H", "link"),
        ("host RAM", f"{hw.host_ram_gib:,.1f} GiB", "host_ram"),
        ("NVMe", nvme, "nvme"),
        ("host AdamW", f"{hw.host_adam_gparams_per_s:g} G params/s", "host_adam"),
        ("host memory", f"{host_mem_rate(hw):g} GB/s (gradient adds: 12 B per fp32 gradient, 18 per 2-byte)",
         "host_mem"),
    ]
    if "host_mem" not in src:
        src["host_mem"] = ("hardware.host_mem_gbps" if hw.host_mem_gbps is not None else
                           "assumed: no host_mem_gbps, derived from the host AdamW rate x 30 B/param")
    out = [f"hardware assumptions ({hw.name}: {src.get('scope', 'conf/hardware/' + hw.name + '.yaml')}; "
           "override any figure with hardware.<field>=...):"]
    out += [f"  {label:<14} {value:<52} {why(key)}" for label, value, key in rows]
    return out


GLOSSARY = {
    "wire": "wire dtype: the dtype a block's weights cross the host->device link in (bf16/fp16 for the weights "
            "autocast casts under mixed precision, else fp32)",
    "wire shadow": "wire shadow: the host-RAM copy of the weights in the wire dtype, cast once after each "
                   "update so that every fetch copies it as is",
    "wire image being decoded": "wire image being decoded: the device copy of one fetch in the wire dtype, while it "
                                "is upcast to the compute dtype",
}


def glossary_lines(p: Plan) -> list[str]:
    """Definitions of the planner's own terms: the wire dtype (the ``transfers`` line of every plan), and those
    of :data:`GLOSSARY` that name a line of this plan's memory tiers."""
    labels = " ".join(k for tier in (p.host, p.device, p.nvme) for k, v in tier.items() if v)
    return ["terms: " + GLOSSARY["wire"]] + [f"  {v}" for k, v in GLOSSARY.items() if k != "wire" and k in labels]


def format_plan(p: Plan) -> str:
    """The full single-preset report: the hardware assumptions first (:func:`assumption_lines`)."""
    c, s, hw = p.counts, p.settings, p.hardware
    layers = f"{c.num_layers} layers x {c.layers[0]:,}" if len(set(c.layers)) == 1 else f"{c.num_layers} layers, {c.layer_total:,}"
    lines = assumption_lines(hw) + [
        "",
        f"megatrain plan: {p.model} on {hw.name}",
        f"settings: precision={s['precision']} batch_size={s['batch_size']} seq_len={s['seq_len']} "
        f"({p.tokens:,} tokens/step) lookahead={s['lookahead']} block_group={s.get('block_group', 1)} "
        f"recompute_every={s['recompute_every']} "
        f"offload params/optimizer/grads={s['offload_params']}/{s['offload_optimizer']}/{s['offload_grads']} "
        f"offload_activations={s['offload_activations']} recompute={s.get('recompute', 'block')} "
        f"grad bytes={s['grad_bytes']}",
        f"parameters: {c.total:,} = embedding {c.embedding:,} + {layers} + head+norm {c.head:,}"
        f"{f' (tied: {c.tied:,} read by the head, stored once)' if c.tied else ''}; "
        f"largest block {c.largest_block:,}",
        transfer_line(p),
        "",
        "memory",
    ]
    lines += _tier("host RAM", p.host, p.host_bytes, p.capacity["host"])
    dev_title = "device" if hw.is_gpu else "device buffers (CPU: counted in host RAM)"
    lines += _tier(dev_title, p.device, p.device_bytes, p.capacity["device"])
    if not hw.is_gpu:
        lines.append("    (the engine's megatrain/peak_device_bytes on a CPU device is its budget meter of block weight and "
                     "gradient buffers at fp32 size, bound masters included: not these activations, wire images or "
                     "autocast casts; compare host RSS with the host RAM total)")
    if p.nvme:
        lines += _tier("NVMe store", p.nvme, p.nvme_bytes, None)
    lines += _tier("disk (NVMe store + checkpoints)", p.disk, p.disk_bytes, p.capacity["disk"])
    lines += glossary_lines(p)
    lines += ["", f"per optimizer step                {'amount':>16} {'rate':>24} {'seconds':>10}"]
    _, ns, measured = host_update_work(c, s)
    amounts = {
        "compute": f"{p.flops / 1e12:,.1f} TFLOP",
        "host_adamw": f"{c.total / 1e9:,.2f} G params" + (f" + {ns / 1e12:,.0f} TFLOP" if ns else ""),
        "engine": "{} + {} calls".format(*block_calls(c, s)),
        **{k: f"{gib(p.moved[k])} GiB" for k in ("h2d", "d2h", "nvme_read", "nvme_write", "grad_add", "host_memory",
                                                  "intra_node", "inter_node") if k in p.moved},
    }
    unit = "GPU" if hw.is_gpu else "rank"
    if p.parallel:
        lines[-1] += f"   (data parallel: [{unit}] per rank, [node] per node)"
    for k, t in p.times.items():
        mark = "  <- bounds the step" if k in p.dominating.split("+") else ""
        node = k in NODE_TERMS or k == "compute" and not hw.is_gpu  # a CPU device's ranks share its cores
        label = _label(p, k)
        if k == "host_adamw" and label != TERM_LABELS[k] and not measured:  # not AdamW/Adam, time not measured
            label += " (AdamW rate)"
        label += (" [node]" if node else f" [{unit}]") if p.parallel else ""
        lines.append(f"  {label:<31} {amounts[k]:>16} {_rate(p, k):>24} {t:>10.3f}{mark}")
    full = p.moved.get("nvme_read_uncached", 0)
    saved = int(100 * (1 - p.moved["nvme_read"] / full)) if full else 0  # whole percent, rounded down
    if saved >= 1:
        lim = (p.nvme_window or {}).get("limit")
        lines.append(f"  (NVMe reads: {gib(full)} GiB without the window's cache; host_memory_limit="
                     f"{gib(lim)} GiB saves {saved}% of them, kept in host RAM (counted in its total above): "
                     "docs/guide/nvme.md, \"What reaches the disk per step\")")
    parts = [f"{k} {v / 1e12:+,.1f}" for k, v in p.flops_parts.items() if v]
    lines.append("  (compute TFLOP = " + ", ".join(parts) + f"; N_matmul = {c.matmul_params:,})")
    if ns and not hw.host_bf16_tflops:
        lines.append(f"  Muon's Newton-Schulz iterations: {ns / 1e12:,.0f} TFLOP of bf16 matmuls per step on the host, "
                     "not in the step time (the preset has no host matmul rate): set "
                     "hardware.host_bf16_tflops=<TFLOP/s>")
    if p.parallel:
        lines += [""] + format_parallel(p)
    lines += [""] + step_time_lines(p) + [
        f"checkpoint: {gib(p.checkpoint_bytes)} GiB ({_checkpoint_words(p)}), "
        f"write {p.checkpoint_write_s:,.1f} s at {hw.nvme_drives} x {hw.nvme_write_gbps:g} GB/s",
    ]
    if p.nvme:  # what a stopped step leaves (docs/internals/optimizer.md, "A step that stops")
        lines.append(f"stopped step: with optimizer_in_backward (the NVMe tier's default) Ctrl-C stops once the step "
                     f"is complete, and another exception inside a backward leaves the model refused until a checkpoint "
                     f"is loaded; optimizer_in_backward=False leaves every stop consistent for "
                     f"{gib(8 * c.total)} GiB more NVMe I/O per step (gradient accumulators written and read back)")
    b, m = p.compute_bound_batch_size, p.max_device_batch_size
    if b is None:
        lines.append("compute dominates: never (a transfer term grows as fast as compute with the batch)")
    else:
        lines.append(f"compute dominates from batch_size={b} ({b * s['seq_len']:,} tokens/step at seq_len={s['seq_len']})"
                     + (f", but device memory holds only batch_size <= {m} there: raise the batch with gradient "
                        f"accumulation or shorten seq_len" if m and b > m else ""))
    if m == 0:
        lines.append(f"device memory does not hold even batch_size=1 at seq_len={s['seq_len']}")
    elif m is not None:
        lines.append(f"device memory holds batch_size <= {m} at seq_len={s['seq_len']}")
    lines += [""] + format_activations(p) + [""] + format_longest(p) + [""]
    lines += [f"warning: {w}" for w in p.warnings]
    lines.append(_fits_line(p))
    lines += ["  " + a for a in advice(p)]
    return "\n".join(lines)


def advice(p: Plan) -> list[str]:
    """What the report suggests below its verdict, one line each: the ``tip:`` lines, then, when the plan does not
    fit, what to change. ``json=true`` prints them as the plan's ``"advice"``."""
    out = [tip for tip in (recompute_advice(p), block_group_advice(p), window_advice(p)) if tip]
    if any(r.startswith("device memory short") for r in p.reasons):
        out += device_advice(p, p.capacity["device"], p.capacity["host"], None)
    if any(r.startswith("host RAM short") for r in p.reasons):
        out += ["change: " + a for a in host_short_advice(p, p.capacity["host"], None)]  # type: ignore[arg-type]
    return out


def schedule_words(in_backward: bool, worker: bool) -> str:
    """The AdamW schedule in words, with the strategy option that selects it (``worker``:
    :func:`.phases.update_worker`)."""
    if in_backward:
        return ("optimizer_in_backward=True (each slab's update starts when its gradients are complete, "
                + ("on the update worker, through the next forward)" if worker else "on the D2H worker)"))
    return ("optimizer_in_backward=False (each slab's update deferred to the next forward, "
            + ("on the update worker)" if worker else "on the H2D worker before its fetch)"))


def _phases_text(p: Plan, phases: dict[str, tuple[float, str]] | None = None) -> str:
    """``phases`` (default the plan's) as "forward 1.000 s (host AdamW), ..."."""
    return ", ".join(f"{ph} {t:,.3f} s ({_label(p, k)})" for ph, (t, k) in (phases or p.phases).items())


def _label(p: Plan, key: str) -> str:
    """:func:`.terms.term_label` with the plan's optimizer named in the host update's label."""
    return term_label(key, p.settings)


def _update_rate(p: Plan) -> str:
    """The host update's rate column: the preset's AdamW rate over the optimizer's relative time per parameter,
    and Muon's matmul rate (:func:`.terms.host_update_seconds`)."""
    hw = p.hardware
    factor, flops, _ = host_update_work(p.counts, p.settings)
    words = f"{hw.host_adam_gparams_per_s / factor:.3g} G params/s"
    if flops:
        words += f" + {hw.host_bf16_tflops:g} TFLOP/s" if hw.host_bf16_tflops else " + ? TFLOP/s"
    return words


def _checkpoint_words(p: Plan) -> str:
    """What a checkpoint holds besides the fp32 weights: the optimizer's state in B/param (:func:`.terms._estimate`)."""
    per = checkpoint_state_bytes(p.counts, p.settings) / max(p.counts.total, 1)
    if p.settings["offload_optimizer"] != "cpu":
        return f"fp32 weights + the optimizer's 2 fp32 regions, {4 + per:.0f} B/param"
    if optim_title(p.settings) in ("AdamW", "Adam"):
        return f"fp32 weights + 2 {optim_title(p.settings)} moments, {4 + per:.0f} B/param"
    return f"fp32 weights + {optim_title(p.settings)} state, {4 + per:.2f} B/param"


def step_time_lines(p: Plan) -> list[str]:
    """The step time by phase with the bound of each, the seconds exposed beyond compute per resource, the
    other AdamW schedule's step time, the fastest estimate (:func:`fastest_line`) and the pessimistic variant."""
    hw, t = p.hardware, p.step_time_s
    unit = "GPU" if hw.is_gpu else "rank"
    rate = (f"{_num(p.tokens / t)} tokens/s"
            + (f" per {unit}, {_num(p.node_tokens / t)} per node, {_num(p.cluster_tokens / t)} "
               f"for the {p.settings['num_nodes']} node(s)" if p.parallel else ""))
    # a CPU device's cores chain ("compute+engine+..."): what it adds beyond compute is its other terms
    exposed = ", ".join(f"{_label(p, '+'.join(t for t in k.split('+') if t != 'compute'))} {v:,.3f} s"
                        for k, v in sorted(p.exposed.items(), key=lambda kv: -kv[1]))
    comp = p.times["compute"]
    out = [f"step time: {t:,.3f} s/step ({rate}), bound by {_label(p, p.dominating)}; phases in series, "
           f"each as long as its longest chain: {_phases_text(p)}",
           f"  exposed beyond compute ({comp:,.3f} s): " + (exposed or "none (compute-bound)")]
    in_bwd = update_in_backward(p.settings)
    o = p.other_schedule
    if o:
        d = o["step_time_s"] - t
        faster = "faster" if d < -1e-9 else "slower" if d > 1e-9 else "the same"
        out.append(f"  schedule: {schedule_words(in_bwd, update_worker(p.settings))}; with optimizer_in_backward={o['optimizer_in_backward']}: "
                   f"{o['step_time_s']:,.3f} s/step ({faster}; {_phases_text(p, o['phases'])})")
    out += [fastest_line(p),
            f"pessimistic (backward H2D at half bandwidth while D2H runs): {p.step_time_pessimistic_s:,.3f} s/step, "
            f"bound by {_label(p, p.dominating_pessimistic)}"]
    return out


#: ``Hardware.sources`` key of the figure each term's rate comes from (:func:`assumption_lines`)
TERM_SOURCES = {"compute": "compute", "h2d": "link", "d2h": "link", "nvme_read": "nvme", "nvme_write": "nvme",
                "host_adamw": "host_adam", "grad_add": "host_mem", "host_memory": "host_mem"}


def fastest_line(p: Plan) -> str:
    """The fastest estimate (:attr:`~.estimate.Plan.step_time_fastest_s`) with the resource whose rate it rests on
    and that rate's source; not a lower bound: a machine whose real rate is higher than the preset's runs faster."""
    k = p.dominating_fastest
    src = (p.hardware.sources or {}).get(TERM_SOURCES.get(k, ""), "")
    return (f"fastest estimate (every term overlapping): {p.step_time_fastest_s:,.3f} s/step, the {_label(p, k)} "
            f"term at {_rate(p, k)}" + (f" ({src})" if src else "") + "; an estimate at that rate, not a lower bound "
            "(a machine faster than that rate steps faster)")


def format_parallel(p: Plan) -> list[str]:
    """The data parallel block: host RAM and ``/dev/shm`` per node, gradient traffic, the shared-host
    terms and the binding resource, tokens/s per node and cluster (``p.parallel`` set)."""
    d, hw, s = p.parallel, p.hardware, p.settings
    R, M, G = d["devices"], d["num_nodes"], d["grads"]
    ib, link = intra_rate(hw)
    unit = "GPU" if hw.is_gpu else "rank"
    out = [f"data parallel: {R} process(es) per node x {M} node(s) = {d['world_size']} ranks; batch_size="
           f"{s['batch_size']} per process: {p.node_tokens:,} tokens/step per node, {p.cluster_tokens:,} in all",
           f"  host RAM per node {gib(p.host_bytes)} GiB = training state once per node {gib(d['shm_bytes'])} GiB "
           f"(/dev/shm) + {R} x {gib(d['per_process_bytes'])} GiB per process ("
           + ", ".join(f"{k} {gib(v)}" for k, v in d["per_process"].items() if v) + ")"
           + (f" + {gib(p.host[NVME_CACHE])} GiB of NVMe regions the node's windows keep" if p.host.get(NVME_CACHE) else "")]
    need, dflt = d["shm_bytes"], d["shm_default_bytes"]
    size = -(-need // 2**30) + 1
    if not need:
        out.append("  /dev/shm: none needed (the training state is on NVMe, one store per node)")
    else:
        out.append(f"  /dev/shm needed: {gib(need)} GiB; "
                   + (f"more than Linux's default tmpfs size (half of RAM: {gib(dflt)} GiB): "
                      f"mount -o remount,size={size}G /dev/shm" if need > dflt else
                      f"within Linux's default tmpfs size (half of RAM: {gib(dflt)} GiB)")
                   + f"; in a container --shm-size={size}g or --ipc=host (Docker's default is 64 MiB)")
    if p.nvme:
        out.append(f"  NVMe per node: {gib(p.nvme_bytes)} GiB (each process stores the AdamW states and accumulators of "
                   f"the blocks it owns); reads {gib(p.moved['nvme_read'])} GiB/step"
                   + (" (every rank reads the fp32 masters it streams)" if s["offload_params"] == "nvme" else ""))
    out.append(f"  gradients per rank and step: G = {gib(G)} GiB ({s['grad_bytes']} B x every block read)")
    out.append(f"    intra-node, each block reduced to its owner (reduce-scatter-like): (R-1)/R x G = "
               f"{gib(p.moved['intra_node'])} GiB sent per rank: {p.times['intra_node']:.3f} s at {ib:g} GB/s ({link})"
               if R > 1 else "    intra-node: none (one process per node)")
    out.append(f"    inter-node, ring all-reduce among each block's owners: 2(M-1)/M x G = "
               f"{gib(p.moved['inter_node'])} GiB sent per node: {p.times['inter_node']:.3f} s at "
               f"{hw.network_gbps:g} GB/s (hardware.network_gbps)" if M > 1 else "    inter-node: none (one node)")
    out.append(f"    D2H per {unit}: its own blocks' reduced gradients {gib(p.moved['d2h'])} GiB (one process: {gib(G)} GiB)")
    out.append(f"  shared by the node's {R} {unit}(s): {_label(p, 'host_adamw')} {p.times['host_adamw']:.3f} s (all {p.counts.total / 1e9:,.2f} "
               f"G params once per node, as one process), host memory {gib(p.moved['host_memory'])} GiB / "
               f"{host_mem_rate(hw):g} GB/s = {p.times['host_memory']:.3f} s ("
               + ", ".join(f"{k} {gib(v)}" for k, v in d["host_traffic"].items() if v) + ")")
    shadow = next((v for k, v in d["per_process"].items() if k.startswith("wire shadow")), 0)
    if shadow and R > 1:
        out.append(f"  wire shadows: {R} x {gib(shadow)} GiB, one per process; one shared copy per node would need "
                   f"{gib((R - 1) * shadow)} GiB less (host RAM per node {gib(p.host_bytes - (R - 1) * shadow)} GiB)")
    ranked = sorted(p.times.items(), key=lambda kv: -kv[1])
    top = [k for k, _ in ranked[:4]]
    out.append(f"  binds: {_label(p, p.dominating)} {p.step_time_s:.3f} s/step (the longer phase's bound); "
               "largest terms: " + ", ".join(f"{_label(p, k)} {p.times[k]:.3f} s" for k in top)
               + ("" if "compute" in top else f"; compute per {unit} {p.times['compute']:.3f} s"))
    return out


def _fits_line(p: Plan) -> str:
    if not p.fits:
        return "fits: NO: " + "; ".join(p.reasons)
    where = f" (on the hardware assumptions at the top: {p.hardware.name})"
    if p.tight:
        return "fits: yes, but TIGHT: " + ", ".join(f"{k} {p.headroom[k]:.1%} headroom" for k in p.tight) + \
            " (< 5%: the reserve and working-set assumptions are larger than that margin)" + where
    return "fits: yes" + where


def format_comparison(plans: list[Plan]) -> str:
    """One row per hardware preset: needs vs capacity, fit, step time (phase model), what bounds it, the
    fastest estimate (every term overlapping) and the pessimistic step."""
    p0 = plans[0]
    s = p0.settings
    head = (f"megatrain plan: {p0.model}, precision={s['precision']} batch_size={s['batch_size']} seq_len={s['seq_len']} "
            f"offload params/optimizer/grads={s['offload_params']}/{s['offload_optimizer']}/{s['offload_grads']}"
            + (f" devices={s['devices']} num_nodes={s['num_nodes']} (host per node; bound per step of every rank)"
               if p0.parallel else ""))
    cols = (f"{'hardware':<13} {'host GiB need/have':>20} {'device GiB need/have':>21} {'fits':>6} "
            f"{'step s':>9} {'bound by':<34} {'fastest s':>9} {'pessim. s':>10} {'compute-bound batch (device holds)':>35} "
            f"{'max seq_len':>12}")
    out = []
    for p in plans:  # the figures each row rests on, first
        out += assumption_lines(p.hardware)
    out += ["", head, "", cols, "-" * len(cols)]
    for p in plans:
        dev = f"{gib(p.device_bytes)}/{gib(p.capacity['device'])}" if p.hardware.is_gpu else "(in host)"
        b, m = p.compute_bound_batch_size, p.max_device_batch_size
        bb = "never" if b is None else str(b)
        if m is not None:
            bb += f" (<= {m}{', too big' if b is not None and b > m else ''})"
        fit = ("yes*" if p.tight else "yes") if p.fits else "NO"
        out.append(f"{p.hardware.name:<13} {gib(p.host_bytes) + '/' + gib(p.capacity['host']):>20} {dev:>21} "
                   f"{fit:>6} {p.step_time_s:>9.2f} {_label(p, p.dominating):<34} {p.step_time_fastest_s:>9.2f} "
                   f"{p.step_time_pessimistic_s:>10.2f} {bb:>35} {max_seq_len(p):>12,}")
    if any(p.tight for p in plans):
        out.append("  yes* = fits with under 5% headroom in a tier: " + "; ".join(
            f"{p.hardware.name} " + ", ".join(f"{k} {p.headroom[k]:.1%}" for k in p.tight) for p in plans if p.tight))
    for p in plans:
        if not p.fits:
            out.append(f"  {p.hardware.name}: " + "; ".join(p.reasons))
            if any(r.startswith("host RAM short") for r in p.reasons):
                out += [f"    change: {a}" for a in host_short_advice(p, p.capacity["host"], None)[:-1]]  # type: ignore[arg-type]
    out += [f"  warning: {w}" for w in p0.warnings]  # the model's limits: the same on every preset
    out.append("  step s: forward + backward, each as long as its longest chain; bound by: the longer phase's; fastest s: "
               "the largest term, the fastest estimate (every term overlapping; an estimate at the preset's rates, not "
               "a lower bound)")
    out.append("  compute-bound batch: the batch size from which compute bounds both phases; (<= N): the largest "
               "batch device memory holds at this seq_len; max seq_len: at batch_size=1, these options")
    return "\n".join(out)


def format_longest_table(rows: list[tuple[str, str, list[tuple[str, int]]]]) -> str:
    """Markdown-ready table of the longest sequence: one row per (model, hardware), one column per
    option set (``rows`` from :func:`longest_rows`)."""
    labels = [lab for lab, _ in rows[0][2]]
    head = "| model | hardware | " + " | ".join(labels) + " |"
    out = [head, "|" + "---|" * (len(labels) + 2)]
    for model, hw, vals in rows:
        out.append(f"| {model} | {hw} | " + " | ".join(f"{v:,}" for _, v in vals) + " |")
    return "\n".join(out)


def longest_rows(plans: list[Plan]) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """For each plan: (model, hardware, [(option set, longest seq_len at batch 1)...])."""
    return [(p.model, p.hardware.name, [(lab, max_seq_len(p, **ch)) for lab, ch in long_sequence_variants(p)])
            for p in plans]
