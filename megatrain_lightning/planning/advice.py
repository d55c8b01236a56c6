"""What to change when a plan does not fit: the NVMe tier for host RAM, and for device memory the
options that bound activations (the longest sequence with each).

Every suggestion is re-planned (:func:`.estimate.replan`) and carries its numbers. Option names are spelled as the
caller's ``keys`` say (:func:`key`). Units: GiB = 2**30 B.
"""

from __future__ import annotations

import math

from typing import Any, Mapping

from .config import GIB, SUGGESTED_CHUNK
from .estimate import Plan, fits_memory, gib, max_batch_size, max_seq_len, replan
from .terms import (NVME_CACHE, group_size, layer_wire_bytes, optim_state_bytes, optim_title, term_label, window_bytes,
                    window_fill)

#: The planner's bytes-per-transfer threshold for suggesting a ``block_group``. An engineering choice, NOT a
#: measurement (GPU profiling must confirm or replace it): at the presets' ~55 GB/s H2D, 64 MiB takes ~1.2 ms, so a
#: fixed cost of some tens of microseconds per fetch ("Per-block cost" in docs/internals/streaming.md) would be a
#: few percent of it.
TRANSFER_TARGET_BYTES = 64 * 2**20
MIB = 2**20
#: how far above its plan a CPU-device run's peak host RAM may be (the target of ``bench/plan_vs_run.py``, +5%);
#: the sequence, batch and activation suggestions for host RAM leave that room (:func:`host_short_advice`)
RUN_ABOVE_PLAN = 0.05

#: the recipe's Hydra keys for the planner's settings (``recipes/finetune.py`` with conf/finetune.yaml)
RECIPE_KEYS = {"seq_len": "data.seq_len", "batch_size": "data.batch_size", "precision": "trainer.precision",
               "devices": "trainer.devices", "num_nodes": "trainer.num_nodes"}


def key(name: str, keys: Mapping[str, str] | None, cli: str | None = None) -> str:
    """How the user sets planner setting ``name``: ``keys[name]``, else ``strategy.<name>`` (``keys`` the recipe's,
    :data:`RECIPE_KEYS`); with ``keys=None`` (the planner's CLI) ``cli`` or ``name`` itself."""
    if keys is None:
        return cli or name
    return keys.get(name, f"strategy.{name}")


def _value(v: Any) -> str:
    return "true" if v is True else "false" if v is False else "null" if v is None else str(v)


def nvme_limit(q: Plan, have: int) -> tuple[int, int, int]:
    """For a plan ``q`` with state on NVMe and ``have`` bytes of host RAM: ``(host_memory_limit to set, host RSS it
    gives, bytes outside the window)``.

    The limit is whole GiB: what 90% of ``have`` leaves beside the host terms the limit does not bound, but never
    below the engine's minimum window (:attr:`~.estimate.Plan.nvme_window`) or the window the plan counts. The RSS
    is those other terms plus :func:`~.terms.window_fill` at that limit."""
    inside = window_bytes(q.host)
    other = q.host_bytes - inside - q.host.get(NVME_CACHE, 0)
    floor_ = max(inside, (q.nvme_window or {}).get("min_window", 0))
    limit = max(-(-floor_ // GIB), (int(have * 0.9) - other) // GIB) * GIB
    fill = window_fill(q.host, q.moved["nvme_read_back_regions"], limit, q.hardware.is_gpu)
    return limit, other + fill, other


def nvme_override(keys: Mapping[str, str] | None, limit: int, params: bool) -> str:
    """The complete override that puts the state on NVMe with ``host_memory_limit=limit`` (bytes, whole GiB), in
    the recipe's Hydra keys (``conf/strategy/megatrain_nvme.yaml``) or the planner's (``keys=None``);
    ``params=False`` keeps the masters in RAM."""
    lim = f"{limit // GIB}GiB"
    if keys is None:
        return ("offload_params=nvme " if params else "") + f"offload_optimizer=nvme offload_grads=nvme host_memory_limit={lim}"
    return "strategy=megatrain_nvme " + ("" if params else "strategy.offload_params=cpu ") + \
        f"strategy.host_memory_limit={lim}"


def host_advice(p: Plan, have: int, keys: Mapping[str, str] | None = None) -> list[str]:
    """Ways to fit host RAM ``have`` (bytes): the optimizer state on NVMe, then every state, each a complete
    override (:func:`nvme_override`) with :func:`nvme_limit`'s numbers, the disk and the step time; else fewer
    processes or a bigger machine."""
    s = p.settings
    out = []
    where = "" if keys is None else " (the store's directory: MEGATRAIN_NVME_PATH or strategy.nvme_path=)"

    def host_words(q: Plan) -> str:
        limit, rss, other = nvme_limit(q, have)
        mw = (q.nvme_window or {}).get("min_window", 0)
        return (f"the host then uses about {gib(rss)} GiB (the NVMe window up to host_memory_limit={limit // GIB}GiB, "
                f"at least {gib(mw)} GiB for this model, + {gib(other)} GiB besides)")

    def device_words(q: Plan) -> str:
        dev = q.capacity.get("device")
        if dev is None or q.device_bytes <= dev:
            return ""
        return (f"; this leaves the device short (need {gib(q.device_bytes)} GiB, have {gib(dev)} GiB: the device "
                "lines' changes, or a larger device)")

    if s["offload_optimizer"] == "cpu":
        q = replan(p, offload_optimizer="nvme", offload_grads="nvme")
        limit, rss, _ = nvme_limit(q, have)
        q = replan(q, host_memory_limit=limit)  # the step time with the window that limit gives (its cache)
        if rss <= have:
            out.append(f"set {nvme_override(keys, limit, params=False)}{where}: {_state_words(p)} go to NVMe; "
                       f"{host_words(q)}, disk "
                       f"{gib(q.disk_bytes)} GiB; step {q.step_time_s:,.1f} s ({term_label(q.dominating, q.settings)})"
                       f"{device_words(q)}")
    if "nvme" not in (s["offload_params"], s["offload_optimizer"], s["offload_grads"]) or not out:
        q = replan(p, offload_params="nvme", offload_optimizer="nvme", offload_grads="nvme")
        limit, rss, _ = nvme_limit(q, have)
        q = replan(q, host_memory_limit=limit)
        if rss <= have:
            disk = q.capacity["disk"] or 0
            out.append(f"use the NVMe tier: {nvme_override(keys, limit, params=True)}{where}: masters, gradients "
                       f"and moments ({gib(q.nvme_bytes)} GiB) go to NVMe; {host_words(q)}, disk "
                       f"{gib(q.disk_bytes)} GiB ({disk_words(q, disk)}), and "
                       f"the step is bound by {term_label(q.dominating, q.settings)} at {q.step_time_s:,.1f} s "
                       f"(was {p.step_time_s:,.1f} s){device_words(q)}")
        else:
            out.append(f"even with every state on NVMe ({nvme_override(keys, limit, params=True)}) the host needs "
                       f"{gib(rss)} GiB (the engine's minimum NVMe window, the activations and the process): use a "
                       f"machine with more RAM (plan it with {ram_override(rss)})")
    R = s.get("devices", 1)
    if R > 1:  # data parallel: each process holds its own buffers (planning/parallel.py)
        fit = next((r for r in range(R - 1, 0, -1) if replan(p, devices=r).host_bytes <= have), None)
        if fit:
            out.append(f"or fewer processes per node: {key('devices', keys, 'trainer.devices')}={fit} fits "
                       f"(host then needs {gib(replan(p, devices=fit).host_bytes)} GiB per node)")
    out.append(f"or a machine with >= {gib(p.host_bytes)} GiB of free RAM (plan it with {ram_override(p.host_bytes)})")
    return out


def _state_words(p: Plan) -> str:
    """What moving the optimizer tier to NVMe frees in host RAM, in words with GiB."""
    freed = optim_state_bytes(p.counts, p.settings) + 4 * p.counts.total
    name = optim_title(p.settings)
    what = "AdamW moments" if name in ("AdamW", "Adam") else f"the {name} state"
    return f"{what} and gradient accumulators ({gib(freed)} GiB)"


def disk_words(q: Plan, disk: int) -> str:
    """``fits``, or that the preset's NVMe is short, with the ``hardware.nvme_drives=<n>`` that suffices."""
    if q.disk_bytes <= disk:
        return "fits"
    drives = math.ceil(q.disk_bytes / (q.hardware.nvme_capacity_gib * GIB))  # >= 1: Hardware refuses a size <= 0
    return f"the preset has {gib(disk)} GiB: SHORT; plan {drives} drives with hardware.nvme_drives={drives}"


def ram_override(need: int) -> str:
    """``hardware.host_ram_gib=<GiB, rounded up to 0.1>`` for a machine with ``need`` bytes of RAM (planner and
    recipes alike)."""
    return f"hardware.host_ram_gib={math.ceil(need / GIB * 10) / 10:g}"


def _activation_options(p: Plan) -> list[dict[str, Any]]:
    """Option sets that bound activations, cheapest first: each option alone, then accumulated."""
    s = p.settings
    # layers that keep op outputs or their graph: recompute more
    more = {"none": ("selective", "block"), "auto": ("block",), "selective": ("block",)}
    single: list[dict[str, Any]] = [{"recompute": m} for m in more.get(s.get("recompute", "block"), ())]
    if s["loss_chunk_size"] is None:
        single.append({"loss_chunk_size": SUGGESTED_CHUNK["loss_chunk_size"]})
    if s["mlp_chunk_size"] is None and p.hardware.is_gpu:  # no saving on a CPU device (planning/activations.py)
        single.append({"mlp_chunk_size": SUGGESTED_CHUNK["mlp_chunk_size"]})
    if not s["offload_activations"] and p.hardware.is_gpu:  # on a CPU device the inputs are host RAM already
        single.append({"offload_activations": True})
    if s["recompute_every"] == 1:
        single.append({"recompute_every": 4})
    out, acc = list(single), {}
    for d in single:
        if "recompute" in d and d["recompute"] != "block":
            continue  # accumulate the cheapest-memory recompute only
        acc = {**acc, **d}
        if len(acc) > 1 and acc not in out:
            out.append(dict(acc))
    return out


def seq_len_advice(p: Plan, host: int | None, device: int | None, keys: Mapping[str, str] | None = None) -> list[str]:
    """For a plan whose activations do not fit: each change that makes it fit, as a complete override with its
    numbers (``host``/``device``: bytes available; None: the preset's): the longest ``seq_len`` that fits at the
    plan's ``batch_size``; with ``batch_size`` > 1 the largest that fits; the first option set
    (:func:`_activation_options`) with which this batch and ``seq_len`` fit, with its longest ``seq_len``.

    The lengths count memory alone; one beyond the model's ``max_position_embeddings`` says so
    (:func:`~.estimate.position_warnings`), and the suggestion is then that limit when shorter than ``seq_len``."""
    s = p.settings
    B, T = s["batch_size"], s["seq_len"]
    sk, bk = key("seq_len", keys), key("batch_size", keys)
    mp = p.counts.max_position_embeddings
    at = f"{bk}={B}"

    def beyond(n: int) -> str:
        return f", beyond the model's max_position_embeddings={mp:,}" if mp and n > mp else ""

    out = []
    longest = max_seq_len(p, host, device, batch_size=B)
    if not longest:
        out.append(f"no {sk} fits at {at} with these options (the memory that does not grow with the sequence "
                   f"alone does not fit)")
    elif longest < T:
        if mp and longest > mp:
            out.append(f"set {sk}={mp}: the model's max_position_embeddings, which fits at {at} (memory alone would "
                       f"allow {longest:,}{beyond(longest)}; a config with RoPE scaling (rope_scaling) extends the "
                       f"positions)")
        else:
            out.append(f"set {sk}={longest}: the longest {sk} that fits at {at} with these options")
    if B > 1:
        b = max_batch_size(p, host, device)
        if b:
            out.append(f"set {bk}={b}: the largest {bk} that fits at {sk}={T} with these options")
    found = False
    for opts in _activation_options(p):
        if found and set(opts) != {"recompute"}:
            break  # after the first that fits, only the other recompute mode (more recompute, less memory)
        q = replan(p, **opts)
        if fits_memory(q, host, device):
            setting = " ".join(f"{key(k, keys)}={_value(v)}" for k, v in opts.items())
            where = f"device then needs {gib(q.device_bytes)} GiB" if p.hardware.is_gpu else \
                f"host then needs {gib(q.host_bytes)} GiB"
            n = max_seq_len(p, host, device, batch_size=B, **opts)
            out.append(f"{'or set' if found else 'set'} {setting}: {at} {sk}={T} then fits ({where}; the longest {sk} "
                       f"at {at} with it: {n:,}{beyond(n)}; {q.step_time_s:,.3g} s/step, was {p.step_time_s:,.3g})")
            second, found = found, True
            if set(opts) != {"recompute"} or second:
                break
    if not found:
        out.append(f"no activation option makes {at} {sk}={T} fit here")
    return out


def host_short_advice(p: Plan, host: int, keys: Mapping[str, str] | None = None) -> list[str]:
    """What to change when host RAM ``host`` (bytes) is short: on a CPU device whose activations are a tenth of
    the need or more, :func:`seq_len_advice` first, sized to ``host`` / (1 + :data:`RUN_ABOVE_PLAN`) so that the
    run's peak stays within the RAM even above its plan by as much as ``bench/plan_vs_run.py`` allows; then
    :func:`host_advice`."""
    out = []
    if not p.hardware.is_gpu and activation_share(p) > 0.1:
        out += seq_len_advice(p, int(host / (1 + RUN_ABOVE_PLAN)), None, keys)
    return out + host_advice(p, host, keys)


def device_advice(p: Plan, device: int | None, host: int | None = None,
                  keys: Mapping[str, str] | None = None) -> list[str]:
    """What uses the device memory and what to change, sequence-length options first."""
    s = p.settings
    big = sorted(p.device.items(), key=lambda kv: -kv[1])[:3]
    out = ["needed for: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in big)]
    if host is not None and p.host_bytes > host:  # host RAM short: its own advice; judge the device alone here
        host = 1 << 62
    out += ["change: " + a for a in seq_len_advice(p, host, device, keys)]
    if s["lookahead"] > 1:
        out.append(f"change: {key('lookahead', keys)}=1 (one fetch prefetched instead of {s['lookahead']})")
    if (G := group_size(p.counts, s)) > 1:
        n = s["lookahead"] + 1
        out.append(f"change: {key('block_group', keys)}=1 (the weights of {n} blocks in flight instead of "
                   f"{n} fetches of {G} decoder layers)")
    if s["precision"] == "32-true":
        out.append(f"change: {key('precision', keys)}=bf16-mixed (halves the matmul activations and the weights on the link)")
    return out


def recompute_advice(p: Plan, keys: Mapping[str, str] | None = None) -> str | None:
    """With ``recompute="block"`` on a GPU preset, when ``"selective"`` fits too: a tip with what it saves and
    costs; else None."""
    s = p.settings
    if not p.hardware.is_gpu or s.get("recompute", "block") != "block" or not p.fits:
        return None
    q = replan(p, recompute="selective")
    if not q.fits:
        return None
    return (f"tip: {key('recompute', keys)}=selective also fits (device {gib(q.device_bytes)} GiB, was "
            f"{gib(p.device_bytes)} GiB): it keeps the matmul and attention outputs and skips their recompute, "
            f"{(p.flops - q.flops) / 1e12:,.1f} TFLOP less per step (" +
            (f"step {q.step_time_s:,.3f} s, was {p.step_time_s:,.3f} s)" if q.step_time_s < p.step_time_s else
             f"the step stays {p.step_time_s:,.3f} s, set by {term_label(p.dominating, p.settings)})"))


def window_advice(p: Plan, keys: Mapping[str, str] | None = None) -> str | None:
    """With state on NVMe, one process and NVMe reads left: a tip with the ``host_memory_limit`` that keeps every
    region a step reads back (the minimum window + those bytes, whole GiB; :func:`~.terms.nvme_kept_share`), or the
    largest :func:`nvme_limit` allows when less, re-planned, when it is above the limit in use and saves reads;
    else None."""
    w, ram = p.nvme_window, p.capacity["host"]
    if not w or not p.fits or p.moved["nvme_read"] <= 0 or p.parallel or not ram:
        return None
    every = -(-(w["min_window"] + p.moved["nvme_read_back_regions"]) // GIB) * GIB
    fit, _, other = nvme_limit(p, ram)
    limit = min(every, fit)
    if limit <= w["limit"] or other + limit > 0.9 * ram:  # 90% of the RAM at most, as the NVMe suggestions
        return None
    q = replan(p, host_memory_limit=limit)
    if q.moved["nvme_read"] >= p.moved["nvme_read"] or q.step_time_s > 0.99 * p.step_time_s:  # 1% faster at least
        return None
    kept = "keeps every region in RAM: no NVMe reads" if q.moved["nvme_read"] == 0 else (
        f"the most this RAM allows: NVMe reads {gib(q.moved['nvme_read'])} GiB per step (was {gib(p.moved['nvme_read'])})")
    return (f"tip: {key('host_memory_limit', keys)}={limit // GIB}GiB (now {gib(w['limit'])} GiB): the NVMe window "
            f"{kept}; step {q.step_time_s:,.3f} s, was {p.step_time_s:,.3f} s ({term_label(p.dominating, p.settings)}); "
            f"the host then uses about {gib(q.host_bytes)} GiB (the window caching up to the limit)")


def block_group_advice(p: Plan, keys: Mapping[str, str] | None = None) -> str | None:
    """A ``block_group`` tip when a decoder-layer fetch is small, else None (also when the plan does not fit).

    On a GPU preset (the threshold is about the H2D link; a CPU device's copies are host memcpy), when one fetch
    (:func:`.terms.transfer_bytes`) is below :data:`TRANSFER_TARGET_BYTES`: the smallest ``block_group`` whose
    fetch reaches it (at most every decoder layer), when host RAM and device memory still fit; else the largest
    ``block_group`` above the current one that fits, if any.
    """
    s, c = p.settings, p.counts
    per = layer_wire_bytes(c, s)
    G = group_size(c, s)
    if not p.hardware.is_gpu or not per or per * G >= TRANSFER_TARGET_BYTES or not fits_memory(p):
        return None
    want = min(-(-TRANSFER_TARGET_BYTES // per), c.num_layers)
    if want <= G:  # every decoder layer is in one fetch already
        return None
    name = key("block_group", keys)
    was = f"was {G} x {per / MIB:,.1f} MiB"

    def line(g: int, q: Plan, why: str) -> str:
        return (f"tip: {name}={g}: {g} decoder layers per transfer, {g * per / MIB:,.1f} MiB each ({was}); {why}; "
                f"device then needs {gib(q.device_bytes)} GiB (was {gib(p.device_bytes)} GiB; weights of up to "
                f"{(s['lookahead'] + 1) * g} layers in flight)")

    q = replan(p, block_group=want)
    if fits_memory(q):
        why = (f">= {TRANSFER_TARGET_BYTES // MIB} MiB, the planner's threshold for a transfer that pays "
               f"bandwidth rather than per-fetch latency (not yet measured on a GPU)")
        if want * per < TRANSFER_TARGET_BYTES:
            why = f"every decoder layer in one transfer, still below the planner's {TRANSFER_TARGET_BYTES // MIB} MiB"
        return line(want, q, why)
    for g in range(want - 1, G, -1):
        q = replan(p, block_group=g)
        if fits_memory(q):
            return line(g, q, f"the largest that fits; {want} would reach the planner's "
                              f"{TRANSFER_TARGET_BYTES // MIB} MiB but does not fit")
    return None


def activation_share(p: Plan) -> float:
    """Fraction of the memory that runs short (device; host RAM on a CPU device) that grows with the
    sequence (activations and saved inputs)."""
    act = sum(v for k, v in p.device.items() if "activations" in k or "inputs" in k or k.startswith("kept"))
    return act / max(1, p.device_bytes if p.hardware.is_gpu else p.host_bytes)
