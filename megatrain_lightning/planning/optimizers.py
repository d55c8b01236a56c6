"""Bytes of optimizer state per parameter tensor: the one rule the planner's host RAM, NVMe and checkpoint terms read.

The planner's ``optim`` setting and the recipes' ``optim=`` config group (``conf/optim/<name>.yaml``) use the same
names. Each entry counts the bytes the optimizer class keeps in ``state[p]`` after its first step, for one fp32
parameter of shape ``shape`` (``n`` = its elements), from the class's own source (torch 2.13, lion-pytorch 0.2.5,
torchao 0.18):

==========  ==============================  ====================================================================
name        ``_target_``                    state bytes of one fp32 parameter (and where that comes from)
==========  ==============================  ====================================================================
adamw       ``torch.optim.AdamW``           8 n: ``exp_avg`` + ``exp_avg_sq``, fp32; the host AdamW kernel keeps them
                                            in the store's two optimizer regions (``optim/host_adamw.py``), its step
                                            counts per slab (not counted)
adam        ``torch.optim.Adam``            8 n: as ``adamw`` (the same kernel, ``optim/host_generic.py``
                                            ``uses_adamw_kernel``)
sgd         ``torch.optim.SGD``             4 n ``momentum_buffer`` when ``momentum`` != 0, else 0 (``torch/optim/sgd.py``:
                                            no buffer without momentum, no step counter)
adafactor   ``torch.optim.Adafactor``       4 (``step``, a 0-d fp32 tensor) + for ``ndim`` >= 2 ``row_var`` (shape with
                                            the last dim 1) + ``col_var`` (shape with dim -2 set to 1): 4 (rows + cols)
                                            for a matrix; for a 1-D parameter ``variance`` 4 n
                                            (``torch/optim/_adafactor.py`` ``_init_group``)
lion        ``lion_pytorch.Lion``           4 n: ``exp_avg`` only (``lion_pytorch/lion_pytorch.py``)
muon        ``megatrain_lightning.optim.    decoder layers' 2-D weights: 4 n ``momentum_buffer`` (``torch/optim/_muon.py``);
            muon.MuonWithAdamW``            every other parameter (embeddings, LM head, norms, biases) is updated by
                                            torch's AdamW: 8 n + 4 (``step``)
adamw8bit   ``torchao.optim.AdamW8bit``     a tensor with n >= 4096 and n % 256 == 0 (``block_size``): 2 x (n codes
                                            (uint8) + n / 256 x 4 scales (fp32) + 256 x 4 qmap (fp32)); smaller ones
                                            keep fp32 ``exp_avg``/``exp_avg_sq``: 8 n; + 4 (``step``)
                                            (``torchao/optim/adam.py`` ``_new_buffer``, ``subclass_8bit.py``; measured on
                                            CPU tensors: 17,040,384 B per state of a 4096 x 4096 weight, 2.03 B/param)
==========  ==============================  ====================================================================

Any other ``_target_`` (``torch.optim.RMSprop``...) is measured (:func:`measured_rule`): the class is stepped once
on a CPU fp32 matrix of 64 x 48 and 128 x 48 and vectors of 48 and 96 elements, and its state is taken as
``a x n + b`` per tensor of each rank (linear in n, fitted on the two sizes; a state that is not linear in n, as
Adafactor's, is wrong for other shapes and should get an entry here).

Tiers: the RAM tier (``offload_optimizer="cpu"``) holds this state (:func:`state_bytes`); the NVMe tier the store's
two fp32 optimizer regions, 8 B/param on disk whatever the optimizer (:data:`NVME_STATE_BYTES`), with a host window
of them; each update reads and writes only the regions its block's state packs into (:func:`nvme_region_bytes`).
Units: bytes.

Update time (:func:`update_work`): each entry's host update time per element relative to AdamW
(:data:`UPDATE_COST`) scales the preset's ``hardware.host_adam_gparams_per_s``; Muon adds its Newton-Schulz matmuls
at ``hardware.host_bf16_tflops``. Measured ``_target_`` classes are planned at AdamW's rate, and the plan says so.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .config import CONF_DIR, as_plain_dict

#: the store's two fp32 optimizer regions (``exp_avg``, ``exp_avg_sq``): bytes per parameter on the NVMe tier
NVME_STATE_BYTES = 8
#: torchao AdamW8bit: tensors quantised from this many elements (bitsandbytes' rule) and block size (its default)
AO_MIN_NUMEL, AO_BLOCK = 4096, 256
STEP_BYTES = 4  # a 0-d fp32 ``step`` tensor (torch's ``_get_scalar_dtype``)


@dataclass(frozen=True)
class OptimSpec:
    """One optimizer of the planner and the recipes.

    Attributes:
        name: the ``optim=`` name (``conf/optim/<name>.yaml``).
        target: the class the recipe builds (``_target_``).
        label: how the plan names its state (a host RAM line).
        rule: ``(shape, kind, options) -> bytes`` of one parameter's state; ``kind`` is ``"embedding"``,
            ``"layer"`` or ``"head"`` (the streamed block holding it), ``options`` the config's hyper-parameters.
        cost: ``(shape, kind, options) -> (time, flops)`` of one parameter's host update: ``time`` in AdamW
            element updates (elements x the class's time per element / AdamW's, :data:`UPDATE_COST`), ``flops``
            host matmul FLOPs besides (Muon's Newton-Schulz iterations); ``None``: not measured, planned as AdamW.
    """

    name: str
    target: str
    label: str
    rule: Callable[[tuple[int, ...], str, Mapping[str, Any]], int]
    cost: Callable[[tuple[int, ...], str, Mapping[str, Any]], tuple[float, float]] | None = None


def _adamw(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
    return 8 * math.prod(shape)


def _sgd(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
    return 4 * math.prod(shape) if float(o.get("momentum", 0.0) or 0.0) != 0.0 else 0


def _adafactor(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
    if len(shape) >= 2:
        rows = math.prod(shape[:-1])
        cols = math.prod(shape[:-2]) * shape[-1]
        return STEP_BYTES + 4 * (rows + cols)
    return STEP_BYTES + 4 * math.prod(shape)


def _lion(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
    return 4 * math.prod(shape)


def muon_param(shape: Sequence[int], kind: str) -> bool:
    """Whether Muon updates a parameter: a 2-D weight of a decoder layer (the torch docs pair Muon with AdamW for
    the embeddings, the LM head and every 1-D parameter)."""
    return len(shape) == 2 and kind == "layer"


def _muon(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
    return 4 * math.prod(shape) if muon_param(shape, kind) else 8 * math.prod(shape) + STEP_BYTES


def _adamw8bit(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
    n, block = math.prod(shape), int(o.get("block_size", AO_BLOCK))
    if n >= AO_MIN_NUMEL and n % block == 0:
        return STEP_BYTES + 2 * (n + n // block * 4 + 256 * 4)
    return STEP_BYTES + 8 * n


#: host update time per element relative to torch's AdamW on the same CPU tensors: AdamW's plain ``step()`` rate /
#: the class's, measured by ``bench/host_optimizers.py`` (torch's default CPU kernels, 2 threads), the median over
#: three runs on two hosts (SGD 0.44 / 0.43 / 0.54, Adafactor 1.87 / 2.06 / 1.58, Lion 0.73 / 0.51 on the 2-core dev
#: box only; ``bench/results/host_optimizers*.json``, docs/benchmarks.md). Elementwise updates are bound by memory
#: traffic and passes over it, so the ratio carries to other hosts better than either rate (it moved by up to 25%).
#: ``adamw8bit``: torchao 0.18's compiled CPU kernel on its 8-bit tensors (dequantise, update, requantise per block),
#: one run on the 2-core dev box (64.8M params/s against AdamW's 449M in the same run); its fp32 tensors (under
#: 4,096 elements) at AdamW's cost.
UPDATE_COST = {"adamw": 1.0, "sgd": 0.45, "adafactor": 1.9, "lion": 0.6, "adamw8bit": 6.9}


def _relative(name: str) -> Callable[[tuple[int, ...], str, Mapping[str, Any]], tuple[float, float]]:
    def cost(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> tuple[float, float]:
        return UPDATE_COST[name] * math.prod(shape), 0.0
    return cost


def newton_schulz_flops(shape: Sequence[int], steps: int) -> float:
    """FLOPs of Muon's orthogonalisation of one ``m x n`` gradient (``torch/optim/_muon.py``
    ``_zeropower_via_newtonschulz``: the smaller side ``m`` first; per iteration ``X X^T`` (2 m^2 n), ``b A + c A A``
    (2 m^3) and ``a X + B X`` (2 m^2 n); bf16 matmuls)."""
    m, n = sorted(shape[-2:])
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def _adamw8bit_cost(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> tuple[float, float]:
    n, block = math.prod(shape), int(o.get("block_size", AO_BLOCK))
    return UPDATE_COST["adamw8bit" if n >= AO_MIN_NUMEL and n % block == 0 else "adamw"] * n, 0.0


def _muon_cost(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> tuple[float, float]:
    if muon_param(shape, kind):  # the momentum update (SGD's passes) + the Newton-Schulz matmuls
        return UPDATE_COST["sgd"] * math.prod(shape), newton_schulz_flops(shape, int(o.get("ns_steps", 5) or 5))
    return UPDATE_COST["adamw"] * math.prod(shape), 0.0


OPTIMIZERS: dict[str, OptimSpec] = {s.name: s for s in (
    OptimSpec("adamw", "torch.optim.AdamW", "AdamW exp_avg + exp_avg_sq", _adamw, _relative("adamw")),
    OptimSpec("adam", "torch.optim.Adam", "Adam exp_avg + exp_avg_sq", _adamw, _relative("adamw")),
    OptimSpec("sgd", "torch.optim.SGD", "SGD momentum_buffer", _sgd, _relative("sgd")),
    OptimSpec("adafactor", "torch.optim.Adafactor", "Adafactor row/col variance + step", _adafactor,
              _relative("adafactor")),
    OptimSpec("lion", "lion_pytorch.Lion", "Lion exp_avg", _lion, _relative("lion")),
    OptimSpec("muon", "megatrain_lightning.optim.muon.MuonWithAdamW",
              "Muon momentum + AdamW moments (the rest)", _muon, _muon_cost),
    OptimSpec("adamw8bit", "torchao.optim.AdamW8bit", "AdamW8bit 8-bit moments + block scales", _adamw8bit,
              _adamw8bit_cost),
)}
#: other spellings of the targets above (``torch.optim.adamw.AdamW``, torch's own Muon for the 2-D weights alone)
ALIASES = {"torch.optim.adamw.AdamW": "adamw", "torch.optim.adam.Adam": "adam", "torch.optim.sgd.SGD": "sgd",
           "torch.optim._adafactor.Adafactor": "adafactor", "lion_pytorch.lion_pytorch.Lion": "lion",
           "torchao.optim.adam.AdamW8bit": "adamw8bit"}


def resolve(optim: Any) -> tuple[OptimSpec, dict[str, Any]]:
    """The spec and hyper-parameters of an ``optim`` setting.

    Args:
        optim: a name of :data:`OPTIMIZERS` (its ``conf/optim/<name>.yaml`` hyper-parameters), ``None``
            (``"adamw"``), or a mapping with ``_target_`` and hyper-parameters (recipe-only keys such as
            ``warmup_steps`` are ignored). Another ``_target_`` gets :func:`measured_rule`.

    Raises:
        ValueError: an unknown name (lists the known ones), a mapping without ``_target_``, or a ``_target_`` that
            cannot be imported or stepped on a CPU tensor.
    """
    if optim is None:
        optim = "adamw"
    if isinstance(optim, str):
        if optim not in OPTIMIZERS:
            raise ValueError(f"optim must be one of {', '.join(OPTIMIZERS)} (conf/optim/<name>.yaml), or a mapping "
                             f"with _target_ (optim._target_=torch.optim.RMSprop); got {optim!r}")
        return OPTIMIZERS[optim], dict(_conf_options(optim))
    d = as_plain_dict(optim)
    target = d.pop("_target_", None)
    if not target:
        raise ValueError(f"optim: a mapping needs _target_ (the optimizer class), got keys {sorted(d)}")
    name = ALIASES.get(target) or next((s.name for s in OPTIMIZERS.values() if s.target == target), None)
    if name is not None:
        return OPTIMIZERS[name], d
    from ..optim.build import locate, takes

    try:  # as build_optimizer: betas (the recipes' default optim entry has them) only where the class takes them
        if "betas" in d and not takes(locate(target), "betas"):
            d.pop("betas")
    except ImportError:
        pass  # measured_rule says it cannot be imported
    return OptimSpec(target.rpartition(".")[2].lower(), target, f"{target.rpartition('.')[2]} state (measured)",
                     measured_rule(target, tuple(sorted((k, repr(v)) for k, v in d.items())))), d


@functools.lru_cache(maxsize=16)
def _conf_options(name: str) -> dict[str, Any]:
    """The hyper-parameters of ``conf/optim/<name>.yaml`` (``{}`` without one): a name means the recipes' optimizer
    of that name, e.g. SGD with its ``momentum``."""
    import yaml

    path = CONF_DIR / "optim" / f"{name}.yaml"
    d = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return {k: v for k, v in (d or {}).items() if k != "_target_"}


@functools.lru_cache(maxsize=16)
def measured_rule(target: str, options: tuple[tuple[str, str], ...] = ()) -> Callable[..., int]:
    """A rule for a class without an entry, measured as the module docstring says. ``options``: ``(key,
    repr(value))`` pairs of its hyper-parameters (numbers, lists and strings), passed to the constructor.

    Raises:
        ValueError: the class cannot be imported, built or stepped on CPU tensors (the message names it).
    """
    import ast
    import importlib

    import torch

    module, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"optim._target_={target}: cannot be imported ({e})") from None
    kwargs = {k: ast.literal_eval(v) for k, v in options if k not in ("warmup_steps",)}

    def bytes_of(shape: tuple[int, ...]) -> int:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.full(shape, 1e-3)
        try:
            opt = cls([p], **kwargs)
            opt.step()
        except Exception as e:  # noqa: BLE001 - any failure of a user class is reported with its name
            raise ValueError(f"optim._target_={target}: stepping it once on a CPU tensor failed "
                             f"({type(e).__name__}: {e}); the planner measures its state that way") from None
        return sum(_tensor_bytes(v) for v in opt.state[p].values())

    fits = {}
    for rank, (small, big) in {1: ((48,), (96,)), 2: ((64, 48), (128, 48))}.items():
        b1, b2 = bytes_of(small), bytes_of(big)
        a = (b2 - b1) / (math.prod(big) - math.prod(small))
        fits[rank] = (a, b1 - a * math.prod(small))

    def rule(shape: tuple[int, ...], kind: str, o: Mapping[str, Any]) -> int:
        a, b = fits[2 if len(shape) >= 2 else 1]
        return max(0, round(a * math.prod(shape) + b))

    return rule


def _tensor_bytes(v: Any) -> int:
    """Bytes of a state value: a tensor's storage, a tensor subclass's inner tensors (torchao's
    ``__tensor_flatten__``), 0 for anything else."""
    import torch

    if not torch.is_tensor(v):
        return 0
    if hasattr(v, "__tensor_flatten__") and type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
        names, _ = v.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(v, n)) for n in names)
    return v.numel() * v.element_size()


def state_bytes(optim: Any, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of optimizer state on the RAM tier: the rule of ``optim`` (:func:`resolve`) summed over ``shapes``,
    ``(kind, shape)`` of every unique trainable parameter (:attr:`.counts.ParamCounts.shapes`).

    Raises:
        ValueError: see :func:`resolve`.
    """
    spec, options = resolve(optim)
    return sum(spec.rule(tuple(shape), kind, options) for kind, shape in shapes)


def nvme_region_bytes(optim: Any, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the store's two fp32 optimizer regions that the NVMe tier's updates read, and write, per step.

    A parameter of n elements has 4 n bytes in each region; its state (the spec's rule less a 0-d ``step``) packs
    into the first region while it fits in 4 n bytes, else into both (``optim/state_packing.py`` ``pack``; AdamW's
    two moments take both, SGD-momentum's buffer, Lion's, Adafactor's factors and 8-bit AdamW's codes one, SGD
    without momentum none). A block's update holds a region when any of its parameters uses it
    (``optim/host_generic.py`` ``_state_kinds``), so per block kind (embedding, layer, head): 4 B x that kind's
    elements x the most regions one of its parameters uses (8-bit AdamW's 1-D norms keep fp32 moments, so its
    layers hold both). Arguments as :func:`state_bytes`.

    Raises:
        ValueError: see :func:`resolve`.
    """
    spec, options = resolve(optim)
    numel: dict[str, int] = {}
    regions: dict[str, int] = {}
    for kind, shape in shapes:
        n = math.prod(shape)
        if not n:
            continue
        packed = max(0, spec.rule(tuple(shape), kind, options) - STEP_BYTES)
        numel[kind] = numel.get(kind, 0) + n
        regions[kind] = max(regions.get(kind, 0), min(2, math.ceil(packed / (4 * n))))
    return sum(4 * regions[k] * numel[k] for k in numel)


def update_work(optim: Any, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[float, float, bool]:
    """The host update's work for a model's parameters (arguments as :func:`state_bytes`).

    Returns:
        ``factor``: the update's time per parameter relative to AdamW's (its cost over ``shapes`` / their elements;
        1.0 for AdamW/Adam), ``flops``: host matmul FLOPs per step (Muon's Newton-Schulz, 0 for the others),
        ``measured``: ``False`` when the class has no measured cost (planned as AdamW: ``factor`` 1.0).
    """
    spec, options = resolve(optim)
    n = sum(math.prod(shape) for _, shape in shapes)
    if spec.cost is None or not n:
        return 1.0, 0.0, spec.cost is not None
    time = flops = 0.0
    for kind, shape in shapes:
        t, f = spec.cost(tuple(shape), kind, options)
        time, flops = time + t, flops + f
    return time / n, flops, True
