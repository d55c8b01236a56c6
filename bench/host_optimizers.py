"""Host optimizer update rate: each per-parameter optimizer stepped on the host, one slab at a time, against the same
class's own ``step()`` in plain PyTorch on the same tensors.

What: a Llama-style stack of realistic per-layer shapes (hidden 1024, intermediate 2816, 8 layers, vocabulary 4096:
~110M parameters; ``--quick``: hidden 128, 2 layers) is split into blocks and packed into a host store
(``build_store(discover_blocks(model))``); the user's optimizer is built over the model's parameters and handed to
``make_host_optimizer`` (AdamW on the host AdamW kernel, every other class stepped by ``HostTorchOptimizer``). Every
slab's gradient accumulator is filled with the same fixed random gradients before each step (as the engine's D2H
worker does: copied into ``grad_accum``, ``has_grad`` set per entry), and one host step is ``step()`` + ``flush()``
(every slab's update applied). The plain side is one instance of the same class over fp32 CPU parameters of the same
shapes and start values, ``.grad`` set to the same gradients, torch's default kernel choice for CPU tensors.

Optimizers: AdamW (host kernel), Adam, SGD (momentum 0.9, Nesterov), Adafactor, RMSprop, Adagrad, NAdam, RAdam,
Adamax, Muon (2-D weights only), ``lion_pytorch.Lion`` and ``torchao.optim.AdamW8bit`` when they import (a row that
cannot run says why).

How: ``torch.set_num_threads(--threads)`` (2); ``--warmup`` unmeasured steps on each side, then ``--steps`` measured
steps interleaved (host, plain, host, plain...) so that drift on a shared machine hits both sides alike; the ratio
is the median over the steps of (plain step time / host step time) of adjacent pairs (each pair ran under the same
load), the rates are from the median step times.
The gradient copies are outside the timed region on both sides.

Per optimizer:
  * state B/param: the bytes of every state tensor the host optimizer holds (``state_for(slab, entry)`` of every
    trainable entry: for AdamW views of the store's ``exp_avg``/``exp_avg_sq`` regions plus ``step``), divided by the
    parameters it updates; the same from the plain optimizer's ``state`` (they must be equal);
  * host and plain update rate (parameters/s), ratio host/plain (target >= 0.95);
  * overhead/slab: (host - plain) median step time divided by the slabs updated per step (ms), and ``build/slab``:
    the time to construct the class over one slab's parameters (median over the slabs, µs), what building an
    instance per slab per step costs at most;
  * numbers: after the same number of steps from the same start, the host masters equal the plain parameters
    bitwise (PASS), else FAIL: a speed number means something only when the update is the same;
  * llama100b host RAM: the planner's (``python -m megatrain_lightning.plan model=llama100b hardware=h200
    optim=...``, :data:`PLANNER_OPTIM`), RAM tier.

Run:
    python bench/host_optimizers.py --quick        # tiny stack, seconds
    python bench/host_optimizers.py                # ~110M parameters (a quiet machine: minutes)
    python bench/host_optimizers.py --only sgd,adafactor --steps 5
Writes bench/results/host_optimizers.json (--quick: host_optimizers_quick.json).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megatrain_lightning.blocks import discover_blocks
from megatrain_lightning.optim.host_generic import make_host_optimizer
from megatrain_lightning.store.allocator import bound_retention
from megatrain_lightning.store.host import HostStore, build_store
from megatrain_lightning.testing import make_model

TARGET = 0.95  # host rate / plain rate


def _all(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    return ps


def _two_d(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in ps if p.dim() == 2]


def _lion(ps):
    from lion_pytorch import Lion

    return Lion(ps, lr=1e-4, weight_decay=0.01)


def _adamw8bit(ps):
    from torchao.optim import AdamW8bit

    return AdamW8bit(ps, lr=1e-3, weight_decay=0.01)


# name -> (the user's optimizer over a list of parameters, which of the model's parameters it gets, module needed)
OPTIMIZERS: dict[str, tuple[Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                            Callable[[list[torch.Tensor]], list[torch.Tensor]], str | None]] = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01), _all, None),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3), _all, None),
    "sgd_nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), _all,
                     None),
    "adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=1e-2), _all, None),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), _all, None),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=1e-2), _all, None),
    "nadam": (lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.01), _all, None),
    "radam": (lambda ps: torch.optim.RAdam(ps, lr=2e-3), _all, None),
    "adamax": (lambda ps: torch.optim.Adamax(ps, lr=2e-3, weight_decay=0.01), _all, None),
    "muon_2d": (lambda ps: torch.optim.Muon(ps, lr=2e-2), _two_d, None),
    "lion": (_lion, _all, "lion_pytorch"),
    "adamw8bit": (_adamw8bit, _all, "torchao.optim"),
}


# ---------------------------------------------------------------------------------------------------------- helpers
def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a wrapper subclass (torchao's quantized state) counts its inner tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(state: dict[str, Any] | None) -> int:
    return sum(tensor_bytes(v) for v in (state or {}).values() if torch.is_tensor(v))


def build_model(quick: bool, seed: int = 0):
    if quick:
        dims = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=32, vocab_size=512)
    else:
        dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=16, head_dim=64, vocab_size=4096)
    # head_dim too: make_model sets attributes on a built config, whose head_dim came from the tiny default
    return make_model("llama", seed=seed, use_cache=False, **dims), dims


def fill_host_grads(store: HostStore, bank: dict[tuple[int, int], torch.Tensor]) -> None:
    """Put one window's gradients into every slab's accumulator, as the engine's D2H worker does."""
    for slab in store.slabs:
        if not slab.trainable_numel:
            continue
        with slab.lock:
            slab.start_window()
            fresh = ["grad_accum"] if slab.grad_accum_empty else []
            with store.hold(slab.index, ["grad_accum"], write=True, fresh=fresh) as t:
                for i, e in enumerate(slab.entries):
                    g = bank.get((slab.index, i))
                    if g is None:
                        continue
                    slab.view(t["grad_accum"], i).copy_(g)
                    slab.got_grad(i)
            slab.filled()


def fill_plain_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for p, g in pairs:
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def build_seconds(cls_factory, store: HostStore, selected: set[int]) -> float:
    """Median time to construct the class over one slab's parameters (fresh tensors of the slab's shapes)."""
    times = []
    for slab in store.slabs:
        ps = [torch.nn.Parameter(slab.master_view(i).detach()) for i, e in enumerate(slab.entries)
              if id(e.ref.param) in selected]
        if not ps:
            continue
        t0 = time.perf_counter()
        cls_factory(ps)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else 0.0


# ---------------------------------------------------------------------------------------------------------- planner
#: the planner's ``optim=`` setting for each row (a name of conf/optim/, or ``optim._target_=...`` overrides)
PLANNER_OPTIM = {"adamw": ["optim=adamw"], "adam": ["optim=adam"], "sgd_nesterov": ["optim=sgd"],
                 "adafactor": ["optim=adafactor"], "lion": ["optim=lion"], "adamw8bit": ["optim=adamw8bit"],
                 "muon_2d": ["optim=muon"], **{k: [f"optim._target_=torch.optim.{c}"] for k, c in (
                     ("rmsprop", "RMSprop"), ("adagrad", "Adagrad"), ("nadam", "NAdam"), ("radam", "RAdam"),
                     ("adamax", "Adamax"))}}


def planner_row(key: str) -> dict[str, Any]:
    """The planner's host RAM for ``model=llama100b hardware=h200`` with this row's optimizer
    (``python -m megatrain_lightning.plan model=llama100b hardware=h200 optim=...``), bytes; ``muon_2d`` is planned
    as ``optim=muon`` (Muon for the 2-D weights, AdamW for the rest)."""
    from megatrain_lightning.plan import plan_from_config
    from megatrain_lightning.planning import compose

    try:
        plan = plan_from_config(compose(["model=llama100b", "hardware=h200", *PLANNER_OPTIM[key]]))
    except Exception as err:  # noqa: BLE001 - the row says why (e.g. a package the planner measures is missing)
        return {"planner_error": f"{type(err).__name__}: {err}"[:300]}
    return {"llama100b_host_bytes": int(plan.host_bytes), "planner_optim": " ".join(PLANNER_OPTIM[key])}


# ---------------------------------------------------------------------------------------------------------- one row
def run_one(key: str, args) -> dict[str, Any]:
    factory, select, needs = OPTIMIZERS[key]
    row: dict[str, Any] = {"optimizer": key}
    if needs is not None:
        try:
            importlib.import_module(needs)
        except Exception as err:  # noqa: BLE001 - any import failure is the row's reason
            row.update(status="skipped", reason=f"import {needs}: {type(err).__name__}: {err}")
            return row
    model, _ = build_model(args.quick)
    store = build_store(discover_blocks(model))
    params = select(list(model.parameters()))
    selected = {id(p) for p in params}
    g = torch.Generator().manual_seed(1)
    bank: dict[tuple[int, int], torch.Tensor] = {}
    plain_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    compare: list[tuple[int, int, torch.Tensor]] = []
    for slab in store.slabs:
        for i, e in enumerate(slab.entries):
            if not e.trainable or id(e.ref.param) not in selected:
                continue
            grad = torch.randn(tuple(e.shape), generator=g) * 1e-2
            bank[(slab.index, i)] = grad
            q = torch.nn.Parameter(slab.master_view(i).detach().clone())
            plain_pairs.append((q, grad))
            compare.append((slab.index, i, q))
    n_params = sum(p.numel() for p, _ in plain_pairs)
    try:
        user_opt = factory(params)
        host = make_host_optimizer(store, user_opt)
        plain = factory([q for q, _ in plain_pairs])
    except Exception as err:  # noqa: BLE001 - the row records why the class does not run here
        row.update(status="failed", reason=f"setup: {type(err).__name__}: {err}"[:400])
        return row
    row.update(cls=f"{type(user_opt).__module__}.{type(user_opt).__qualname__}", host_impl=type(host).__name__,
               implementation=host.implementation(), params=n_params,
               slabs=sum(1 for s in store.slabs if any(k[0] == s.index for k in bank)))

    def host_step() -> float:
        fill_host_grads(store, bank)
        t0 = time.perf_counter()
        host.step()
        host.flush()
        return time.perf_counter() - t0

    def plain_step() -> float:
        fill_plain_grads(plain_pairs)
        t0 = time.perf_counter()
        plain.step()
        return time.perf_counter() - t0

    th: list[float] = []
    tp: list[float] = []
    try:
        for _ in range(args.warmup):
            host_step()
            plain_step()
        for _ in range(args.steps):
            th.append(host_step())
            tp.append(plain_step())
    except Exception as err:  # noqa: BLE001
        row.update(status="failed", reason=f"step: {type(err).__name__}: {err}"[:400])
        return row
    # state bytes: every trainable entry's state as the host optimizer holds it, and the plain optimizer's
    host_state = sum(state_bytes(host.state_for(s.index, i)) for s in store.slabs for i, e in enumerate(s.entries)
                     if e.trainable)
    plain_state = sum(state_bytes(st) for st in plain.state.values())
    mismatched = [store.slabs[si].entries[ei].ref.fqn for si, ei, q in compare
                  if not torch.equal(store.slabs[si].master_view(ei), q.detach())]
    region = sum(tensor_bytes(t) for s in store.slabs for t in (s.exp_avg, s.exp_avg_sq) if t is not None)
    host_s, plain_s = statistics.median(th), statistics.median(tp)
    paired = statistics.median(p / h for h, p in zip(th, tp))  # adjacent host/plain steps share the machine's load
    row.update(
        status="ok", steps=args.steps, warmup=args.warmup,
        state_bytes_host=host_state, state_bytes_plain=plain_state,
        state_bytes_per_param_host=host_state / n_params, state_bytes_per_param_plain=plain_state / n_params,
        state_bytes_equal=host_state == plain_state, store_adamw_region_bytes=region,
        host_s=host_s, plain_s=plain_s, host_s_all=th, plain_s_all=tp,
        host_params_per_s=n_params / host_s, plain_params_per_s=n_params / plain_s,
        ratio=paired, ratio_of_medians=plain_s / host_s, meets_target=paired >= TARGET,
        overhead_ms_per_slab=1e3 * (host_s - plain_s) / max(row["slabs"], 1),
        build_us_per_slab=1e6 * build_seconds(factory, store, selected),
        numbers="PASS" if not mismatched else "FAIL", mismatched=mismatched[:10],
    )
    row.update(planner_row(key))
    return row


# ---------------------------------------------------------------------------------------------------------- main
def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.1f}M"


def print_table(rows: list[dict[str, Any]], label: str) -> None:
    print(f"\n{label}")
    print(f"{'optimizer':<13} {'kernel':<18} {'state B/p host':>14} {'plain':>6} {'host p/s':>9} {'plain p/s':>9} "
          f"{'host/plain':>10} {'ovh ms/slab':>11} {'build us/slab':>13} {'numbers':>7} {'llama100b host RAM':>18}")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['optimizer']:<13} {r.get('status', '?').upper()}: {r.get('reason', '')}")
            continue
        ram = f"{r['llama100b_host_bytes'] / 2**30:.0f} GiB" if "llama100b_host_bytes" in r else "n/a"
        kernel = ".".join(r["implementation"].split(".")[-2:])[:18]  # "for-loop" (host AdamW kernel), "SGD.step"...
        ratio = f"{r['ratio']:.2f}{'' if r['meets_target'] else ' <'}"
        print(f"{r['optimizer']:<13} {kernel:<18} {r['state_bytes_per_param_host']:>14.3f} "
              f"{r['state_bytes_per_param_plain']:>6.2f} {_fmt_rate(r['host_params_per_s']):>9} "
              f"{_fmt_rate(r['plain_params_per_s']):>9} {ratio:>10} {r['overhead_ms_per_slab']:>11.2f} "
              f"{r['build_us_per_slab']:>13.0f} {r['numbers']:>7} {ram:>18}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny stack (hidden 128, 2 layers), 3 steps")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per side (default 20; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps per side first (default 2; --quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated optimizer names: " + ",".join(OPTIMIZERS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    out = Path(args.out or Path(__file__).parent / "results" /
               ("host_optimizers_quick.json" if args.quick else "host_optimizers.json"))
    keys = [k for k in args.only.split(",") if k] or list(OPTIMIZERS)
    unknown = sorted(set(keys) - set(OPTIMIZERS))
    if unknown:
        ap.error(f"unknown optimizer(s) {', '.join(unknown)}; choose from {', '.join(OPTIMIZERS)}")
    torch.set_num_threads(args.threads)
    # the process's malloc as in a training run, for both sides: the strategy fixes glibc's mmap threshold when it
    # sets up (store/allocator.py). Under glibc's dynamic threshold instead, the host side (one kernel call per slab)
    # ran at 0.93-0.95 of the plain step for Adam here, against 0.98-0.99 with the training run's settings
    malloc = bound_retention()
    _, dims = build_model(args.quick)
    rows = []
    for k in keys:
        t0 = time.perf_counter()
        rows.append(run_one(k, args))
        rows[-1]["wall_s"] = time.perf_counter() - t0
        r = rows[-1]
        print(f"  {k}: {r.get('status')} in {r['wall_s']:.1f} s", flush=True)
    n = rows[0].get("params") if rows else None
    label = (f"{'QUICK (tiny stack: not a speed measurement) ' if args.quick else ''}"
             f"model {dims}, {args.steps} steps after {args.warmup} warm-up, {args.threads} threads"
             + (f", {n / 1e6:.1f}M params" if n else ""))
    print_table(rows, label)
    ok = [r for r in rows if r.get("status") == "ok"]
    failed = [r["optimizer"] for r in ok if r["numbers"] != "PASS" or not r["state_bytes_equal"]]
    print(f"numbers check: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)} "
          f"({len(ok)} rows ran, {len(rows) - len(ok)} did not)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "host_optimizers", "args": vars(args), "model": dims, "target_ratio": TARGET,
                               "torch": torch.__version__, "malloc": malloc, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
