"""Plain-text tables of a :class:`~.estimate.Plan` (what ``python -m megatrain_lightning.plan`` prints)."""

from __future__ import annotations

from .estimate import TERM_LABELS, Plan, gib


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
        "host_adamw": f"{hw.host_adam_gparams_per_s:g} G params/s",
    }[key]


def _tier(title: str, items: dict[str, int], need: int, have: int | None, note: str = "") -> list[str]:
    ok = "" if have is None else ("  fits" if need <= have else "  SHORT")
    out = [f"  {title:<44} {'GiB':>10}"]
    out += [f"    {k:<42} {gib(v):>10}" for k, v in items.items() if v]
    out.append(f"    {'total' + note:<42} {gib(need):>10}   have {gib(have)}{ok}")
    return out


def format_plan(p: Plan) -> str:
    """The full single-preset report."""
    c, s, hw = p.counts, p.settings, p.hardware
    layers = f"{c.num_layers} layers x {c.layers[0]:,}" if len(set(c.layers)) == 1 else f"{c.num_layers} layers, {c.layer_total:,}"
    lines = [
        f"megatrain plan: {p.model} on {hw.name}",
        f"settings: precision={s['precision']} batch_size={s['batch_size']} seq_len={s['seq_len']} "
        f"({p.tokens:,} tokens/step) lookahead={s['lookahead']} recompute_every={s['recompute_every']} "
        f"offload params/optimizer/grads={s['offload_params']}/{s['offload_optimizer']}/{s['offload_grads']} "
        f"offload_activations={s['offload_activations']} grad bytes={s['grad_bytes']}",
        f"parameters: {c.total:,} = embedding {c.embedding:,} + {layers} + head+norm {c.head:,}"
        f"{f' (tied: {c.tied:,} read by the head, stored once)' if c.tied else ''}; "
        f"largest block {c.largest_block:,}",
        "",
        "memory",
    ]
    lines += _tier("host RAM", p.host, p.host_bytes, p.capacity["host"])
    dev_title = "device" if hw.is_gpu else "device buffers (CPU: counted in host RAM)"
    lines += _tier(dev_title, p.device, p.device_bytes, p.capacity["device"])
    if p.nvme:
        lines += _tier("NVMe store", p.nvme, p.nvme_bytes, None)
    lines += _tier("disk (NVMe store + checkpoints)", p.disk, p.disk_bytes, p.capacity["disk"])
    lines += ["", f"per optimizer step                {'amount':>16} {'rate':>24} {'seconds':>10}"]
    amounts = {
        "compute": f"{p.flops / 1e12:,.1f} TFLOP",
        "h2d": f"{gib(p.moved['h2d'])} GiB",
        "d2h": f"{gib(p.moved['d2h'])} GiB",
        "nvme_read": f"{gib(p.moved['nvme_read'])} GiB",
        "nvme_write": f"{gib(p.moved['nvme_write'])} GiB",
        "host_adamw": f"{c.total / 1e9:,.2f} G params",
    }
    for k, t in p.times.items():
        mark = "  <- dominates" if k == p.dominating else ""
        lines.append(f"  {TERM_LABELS[k]:<31} {amounts[k]:>16} {_rate(p, k):>24} {t:>10.3f}{mark}")
    parts = [f"{k} {v / 1e12:+,.1f}" for k, v in p.flops_parts.items() if v]
    lines.append("  (compute TFLOP = " + ", ".join(parts) + f"; N_matmul = {c.matmul_params:,})")
    lines += [
        "",
        f"lower bound: {p.step_time_s:,.3f} s/step, dominated by {TERM_LABELS[p.dominating]} "
        f"({_num(p.tokens / p.step_time_s)} tokens/s at most)",
        f"pessimistic (H2D at half bandwidth while D2H runs): {p.step_time_pessimistic_s:,.3f} s/step, "
        f"dominated by {TERM_LABELS[p.dominating_pessimistic]}",
        f"checkpoint: {gib(p.checkpoint_bytes)} GiB (fp32 weights + 2 AdamW moments, 12 B/param), "
        f"write {p.checkpoint_write_s:,.1f} s at {hw.nvme_drives} x {hw.nvme_write_gbps:g} GB/s",
    ]
    b = p.compute_bound_batch_size
    if b is None:
        lines.append("compute dominates: never (a transfer term grows as fast as compute with the batch)")
    else:
        lines.append(f"compute dominates from batch_size={b} ({b * s['seq_len']:,} tokens/step at seq_len={s['seq_len']})")
    if p.max_device_batch_size is not None:
        lines.append(f"device memory holds batch_size <= {p.max_device_batch_size} at seq_len={s['seq_len']}")
    lines.append("fits: yes" if p.fits else "fits: NO: " + "; ".join(p.reasons))
    return "\n".join(lines)


def format_comparison(plans: list[Plan]) -> str:
    """One row per hardware preset: needs vs capacity, fit, step-time bound and dominating term."""
    p0 = plans[0]
    s = p0.settings
    head = (f"megatrain plan: {p0.model}, precision={s['precision']} batch_size={s['batch_size']} seq_len={s['seq_len']} "
            f"offload params/optimizer/grads={s['offload_params']}/{s['offload_optimizer']}/{s['offload_grads']}")
    cols = (f"{'hardware':<13} {'host GiB need/have':>20} {'device GiB need/have':>21} {'fits':>5} "
            f"{'bound s':>9} {'dominating':<12} {'pessim. s':>10} {'compute-bound batch':>20}")
    out = [head, "", cols, "-" * len(cols)]
    for p in plans:
        dev = f"{gib(p.device_bytes)}/{gib(p.capacity['device'])}" if p.hardware.is_gpu else "(in host)"
        b = "never" if p.compute_bound_batch_size is None else str(p.compute_bound_batch_size)
        out.append(f"{p.hardware.name:<13} {gib(p.host_bytes) + '/' + gib(p.capacity['host']):>20} {dev:>21} "
                   f"{'yes' if p.fits else 'NO':>5} {p.step_time_s:>9.2f} {TERM_LABELS[p.dominating]:<12} "
                   f"{p.step_time_pessimistic_s:>10.2f} {b:>20}")
    for p in plans:
        if not p.fits:
            out.append(f"  {p.hardware.name}: " + "; ".join(p.reasons))
    return "\n".join(out)
