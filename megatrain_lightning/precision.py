"""``MegaTrainPrecision``: the precision plugin of the ``megatrain`` strategy.

Master weights, gradient accumulators and AdamW states are fp32 on the host in every mode; the precision only
decides what crosses the link and how the device computes (docs/guide/precision.md). The mixed modes give exactly
Lightning's own numbers: only *castable* weights (:func:`~megatrain_lightning.engine.wire.autocast_casts`) travel in
bf16/fp16, and the device rebuilds the slab in fp32. ``"bf16-true"`` keeps fp32 masters, unlike Lightning's.

``"16-mixed"`` uses dynamic loss scaling with ``torch.amp.GradScaler``'s semantics (init 2**16, x0.5 on inf/NaN,
x2 after 2000 clean steps): gradients are unscaled on the host before ``on_before_optimizer_step`` and clipping; a
step with inf/NaN gradients is skipped without touching weights or AdamW state. The scaler state is in
:meth:`state_dict` (saved in Lightning checkpoints).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden

_ALIASES = {"32": "32-true", 32: "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed",
            "16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed", "bf16-true": "bf16-true"}
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_GRAD_NAMES = {v: k for k, v in _GRAD_DTYPES.items()}


class UnsupportedPrecisionError(ValueError):
    """The requested precision is not implemented by the megatrain strategy."""


def _unsupported(name: Any) -> UnsupportedPrecisionError:
    hint = {
        "16-true": " fp16 without loss scaling underflows; use '16-mixed'.",
        "64-true": " fp64 is not streamed.",
        "transformer-engine": " FP8 via Transformer Engine is not implemented.",
    }.get(str(name).split("-float")[0], "")
    return UnsupportedPrecisionError(
        f"megatrain supports precision in {SUPPORTED_PRECISION}; got {name!r}.{hint}"
    )


def check_precision(name: Any) -> str:
    """The canonical name (one of :data:`SUPPORTED_PRECISION`) of a Lightning ``precision`` setting (``32``,
    ``"16"``, ``"bf16-mixed"``...).

    Raises:
        UnsupportedPrecisionError: a precision the strategy does not implement, with the supported ones.
    """
    if name not in _ALIASES:
        raise _unsupported(name)
    return _ALIASES[name]


class MegaTrainPrecision(Precision):
    """Precision plugin for :class:`~megatrain_lightning.strategy.MegaTrainStrategy`.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` (see the
            module docstring for what each streams and computes).
        grad_dtype: dtype of parameter gradients on the D2H link: ``"fp32"`` (default for ``32-true`` and the
            mixed modes) or ``"bf16"``/``"fp16"`` (see the module docstring). Host accumulation is always fp32.
        init_scale, growth_factor, backoff_factor, growth_interval: dynamic loss scaling for
            ``"16-mixed"`` (defaults of ``torch.amp.GradScaler``).
        device_type: ``"cpu"`` or ``"cuda"`` for autocast; set by the strategy from its device.
        loss_scaling: ``False``: ``"16-mixed"`` without loss scaling (a ``GradScaler(enabled=False)`` given to
            Lightning's ``MixedPrecision``). The scale is the plain attribute :attr:`scale` (with ``growth_tracker``,
            ``skipped_steps``), not a ``scaler`` object.

    Raises:
        UnsupportedPrecisionError: any other precision or grad dtype.
    """

    def __init__(
        self,
        precision: str | int = "32-true",
        grad_dtype: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device_type: str = "cpu",
        loss_scaling: bool = True,
    ) -> None:
        self.precision = check_precision(precision)  # type: ignore[assignment]
        half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}
        # H2D dtype of every weight (32-true, bf16-true) or of the castable ones (mixed modes)
        self.wire_dtype = half.get(self.precision, torch.float32)
        self.param_dtype = torch.bfloat16 if self.precision == "bf16-true" else torch.float32
        self.autocast_dtype = half.get(self.precision) if self.precision.endswith("mixed") else None
        default_grad = "bf16" if self.precision == "bf16-true" else "fp32"
        grad_dtype = grad_dtype or default_grad
        if grad_dtype not in _GRAD_DTYPES:
            raise UnsupportedPrecisionError(f"grad_dtype must be one of {sorted(_GRAD_DTYPES)}, got {grad_dtype!r}.")
        self.grad_dtype = _GRAD_DTYPES[grad_dtype]
        self.device_type = device_type
        self.scaling = self.precision == "16-mixed" and loss_scaling
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        self.skipped_steps = 0
        self.engine = None  # the strategy's engine, from attach_engine()
        self.clip_in_place = False  # apply clipping at once (user code may read or edit param.grad after it)
        self._attached: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]] = []  # param.grad as attached
        self._found_inf: bool | None = None  # Fabric, 16-mixed: inf seen once unscaled (clip_gradients or the step)

    def attach_engine(self, engine: Any, device_type: str) -> None:
        """Use ``engine`` (a ``StreamingEngine``) for the optimizer step, clipping and unscaling, and set its
        streaming dtypes; called at every setup, once the engine is built."""
        self.engine = engine
        self.device_type = device_type
        engine.configure_precision(self.wire_dtype, self.param_dtype, self.grad_dtype)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``"bf16-true"``: the module's floating-point buffers (e.g. a rotary ``inv_freq``) cast to bf16 in place,
        as Lightning's ``HalfPrecision`` casts the whole module; the parameters stay the fp32 masters (each block's
        bf16 copy is made when it is streamed). Other modes: unchanged. Returns ``module``."""
        if self.precision == "bf16-true":
            for m in module.modules():
                for name, b in list(m.named_buffers(recurse=False)):
                    if b.is_floating_point() and b.dtype != torch.bfloat16:
                        setattr(m, name, b.to(torch.bfloat16))
        return module

    # ------------------------------------------------------------------ contexts
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast around training/validation/test/predict steps for the mixed modes; under ``"bf16-true"``
        bf16 as torch's default dtype (tensors the step creates are bf16), as Lightning's ``HalfPrecision``."""
        if self.precision == "bf16-true":
            return _DtypeContextManager(torch.bfloat16)
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def convert_input(self, data: Any) -> Any:
        """``"bf16-true"``: the batch's floating-point tensors cast to bf16, as ``HalfPrecision``; else unchanged."""
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, torch.Tensor,
                                   lambda t: t.to(torch.bfloat16) if torch.is_floating_point(t) else t)

    # ------------------------------------------------------------------ loss scaling
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        self._settle_grads()  # manual optimization: param.grad shown since the last backward
        self._detach_grads()
        if self.scaling:
            tensor = tensor * self.scale
        return super().pre_backward(tensor, module)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """Lightning's ``on_after_backward`` hooks, with ``param.grad`` = the fp32 host accumulators so far (with
        16-mixed still scaled, as in Lightning). Shown only where something can look (:func:`_looks_at_grads`),
        since it waits for the backward's gradient copies; under manual optimization until ``opt.step()`` or the
        next backward. ``None`` with ``optimizer_in_backward`` (the update consumed them) or the NVMe gradient
        tier. With several processes, they are averaged over the ranks so far (DDP shows each rank's own until the
        last micro-batch)."""
        engine = self.engine
        show = engine is not None and not engine.update_in_backward and _looks_at_grads(module)
        if show:
            engine.attach_grads()
            self._attached = [(n, p, p.grad) for n, p in module.named_parameters()]
        out = super().post_backward(tensor, module)
        if show and module.automatic_optimization:
            self._settle_grads()
            self._detach_grads()
        return out

    def _settle_grads(self) -> None:
        """The hooks' edits of the shown ``param.grad`` into the accumulators (with several processes a collective:
        every rank calls it at the same points). Every shown gradient set to ``None`` (``module.zero_grad()``) drops
        them all, as ``optimizer.zero_grad()`` does."""
        if self._attached:
            if all(p.grad is None for _, p, _ in self._attached) and any(v is not None for _, _, v in self._attached):
                self.engine.grads.zero()
                self._detach_grads()
                return
            self._keep_replaced_grads()
            self.engine.grads.commit()

    def _detach_grads(self) -> None:
        if self._attached:
            self.engine.grads.detach()
            self._attached = []

    grads_zeroed = _detach_grads  # ``optimizer.zero_grad()`` ran: nothing is shown any more

    # ------------------------------------------------------------------ clipping
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Lightning's ``gradient_clip_algorithm="norm"``: the global norm over the host gradients, as
        ``torch.nn.utils.clip_grad_norm_``; the scale is applied in each slab's AdamW update
        (``HostAdamW.clip_grad_norm``), or at once with ``clip_in_place``, so that code after the clip sees the
        clipped ``param.grad`` (``HostAdamW.apply_grad_ops``)."""
        if self.engine is None or self.engine.optimizer is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self._settle_grads()  # edits a configure_gradient_clipping override made before calling it
        self.engine.grads.wait()
        self.engine.optimizer.clip_grad_norm(float(clip_val))
        if self.clip_in_place:
            self.engine.optimizer.apply_grad_ops()

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        """Lightning's ``gradient_clip_algorithm="value"``: every gradient clamped to ``[-clip_val, clip_val]``
        in its slab's AdamW update."""
        if self.engine is None or self.engine.optimizer is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        self._settle_grads()
        self.engine.optimizer.clip_grad_value(float(clip_val))
        if self.clip_in_place:
            self.engine.optimizer.apply_grad_ops()

    def _clip_gradients(self, model: Any, optimizer: Any, clip_val: Any = None,
                        gradient_clip_algorithm: Any = None) -> None:
        """Lightning's clipping step (after the ``on_before_optimizer_step`` hooks), on the gradients the hooks left."""
        self._settle_grads()
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)

    def _keep_replaced_grads(self) -> None:
        """Copy a ``param.grad`` that a hook replaced by a new tensor (``p.grad = p.grad * 0.5``) into the
        accumulator the host AdamW steps from, and attach the accumulator again. In-place edits need nothing (the
        views are the accumulators).

        Raises:
            RuntimeError: a hook set ``param.grad`` to ``None`` where a gradient was attached, or gave a gradient to
                a parameter that had none (or whose gradients are on NVMe).
        """
        for name, p, view in self._attached:
            g = p.grad
            if g is view:
                continue
            if g is None or view is None:
                raise RuntimeError(
                    f"megatrain: a hook set {name}.grad to {'None' if g is None else 'a tensor'} where the step had "
                    f"{'a gradient' if g is None else 'none (no gradient arrived, or gradients are on NVMe)'}; "
                    "strategy='megatrain' steps every trainable parameter from its own gradient buffer. Edit "
                    "param.grad in place or assign a tensor of its shape where it has one; to leave a parameter "
                    "untrained, freeze it (requires_grad_(False)) before fit; to drop every gradient, call "
                    "optimizer.zero_grad() or module.zero_grad().")
            view.copy_(g)
            p.grad = view

    # ------------------------------------------------------------------ step
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Closure, unscale (16-mixed), Lightning's pre-step hooks and clipping, then the host AdamW step.

        Returns the closure's result (the loss Lightning logs), as ``Optimizer.step(closure)`` does.
        """
        engine = self.engine
        if engine is None:
            raise RuntimeError("MegaTrainPrecision is only usable with strategy='megatrain'.")
        closure_result = closure()
        self._settle_grads()  # manual optimization: edits between manual_backward and opt.step()
        engine.grads.wait()
        found_inf = engine.optimizer.unscale_(1.0 / self.scale) if self.scaling else False  # True: inf/NaN
        engine.attach_grads()
        self._attached = [(n, p, p.grad) for n, p in model.named_parameters()]
        self._after_closure(model, optimizer)
        self._settle_grads()  # a configure_gradient_clipping override may edit them after clipping
        self._finish_step(found_inf)
        return closure_result

    def _finish_step(self, found_inf: bool) -> None:
        """The host AdamW step, or a skipped one on inf/NaN gradients (16-mixed), then the loss scale's update."""
        self._attached = []
        if found_inf:
            self.engine.skip_step()
        else:
            self.engine.step()
        if self.scaling and found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        elif self.scaling:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if not self.scaling:
            return {}
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaling and state_dict:
            self.scale = float(state_dict["scale"])
            self.growth_tracker = int(state_dict["growth_tracker"])
            self.skipped_steps = int(state_dict.get("skipped_steps", 0))
            self.growth_factor = float(state_dict.get("growth_factor", self.growth_factor))
            self.backoff_factor = float(state_dict.get("backoff_factor", self.backoff_factor))
            self.growth_interval = int(state_dict.get("growth_interval", self.growth_interval))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resuming from another strategy's Lightning ``.ckpt``: its loss scale, under ``MixedPrecision`` in
        ``torch.amp.GradScaler.state_dict()`` format, is taken over as ``GradScaler.load_state_dict`` would, when the
        file holds no state of ours (Lightning calls :meth:`load_state_dict` only with ours)."""
        if type(self).__qualname__ in checkpoint or not self.scaling:
            return
        st = checkpoint.get("MixedPrecision")
        if isinstance(st, dict) and "scale" in st:
            self.scale = float(st["scale"])
            self.growth_tracker = int(st.get("_growth_tracker", 0))
            self.growth_factor = float(st.get("growth_factor", self.growth_factor))
            self.backoff_factor = float(st.get("backoff_factor", self.backoff_factor))
            self.growth_interval = int(st.get("growth_interval", self.growth_interval))


class MegaTrainFabricPrecision(MegaTrainPrecision):
    """The precision plugin of ``Fabric(strategy="megatrain")``: :class:`MegaTrainPrecision`'s dtypes, autocast and
    loss scaling with Fabric's calls (``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``).

    As under the Trainer's manual optimization, after every ``fabric.backward`` each ``.grad`` is a view of its fp32
    host accumulator (``None`` where no gradient arrived), edits of it reach the step, and ``optimizer.zero_grad()``
    drops them. Inputs and outputs are cast as Fabric's own plugins cast them (floating inputs to the 16-bit dtype,
    floating outputs back to the default dtype).

    Args: as :class:`MegaTrainPrecision`.
    """

    def convert_input(self, data: Any) -> Any:
        if self.autocast_dtype is None:
            return super().convert_input(data)
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.autocast_dtype)

    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor,
                                   dst_type=torch.get_default_dtype())

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """Edits of the ``.grad`` shown since the last backward into the accumulators; ``.grad`` hidden."""
        self._settle_grads()
        self._detach_grads()
        return tensor

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """``tensor.backward(*args, **kwargs)``; under ``"16-mixed"`` of ``tensor`` times the loss scale."""
        if self.scaling:
            tensor = tensor * self.scale
        tensor.backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """``param.grad`` = the host accumulators (waits for this backward's gradient copies); not with the NVMe
        gradient tier (``None`` there)."""
        engine = self.engine
        if engine is not None and not engine.update_in_backward:
            engine.attach_grads()
            self._attached = [(n, p, p.grad) for n, p in engine.root.named_parameters()]
        return tensor

    def unscale_gradients(self, optimizer: Any) -> None:
        """``"16-mixed"``: divide the accumulated gradients by the loss scale, once per step (the first of
        ``fabric.clip_gradients`` and ``optimizer.step()``); other modes: nothing."""
        if not self.scaling or self._found_inf is not None or self.engine is None:
            return
        self._settle_grads()
        self.engine.grads.wait()
        self._found_inf = self.engine.optimizer.unscale_(1.0 / self.scale)

    def clip_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """``fabric.clip_gradients(max_norm=...)``: the total norm of the host gradients (0-dim fp32, before
        clipping), as ``torch.nn.utils.clip_grad_norm_``; applied at once with ``clip_in_place`` (one process), else
        in the step's updates.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is inf/NaN.
        """
        self._settle_grads()
        self.engine.grads.wait()
        total = self.engine.optimizer.clip_grad_norm(float(max_norm), float(norm_type), error_if_nonfinite)
        if self.clip_in_place:
            self.engine.optimizer.apply_grad_ops()
        return total

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``optimizer.step(closure=None)``: the closure (if any), unscaling (16-mixed), then the host AdamW step (or
        a skipped step on inf/NaN). Returns the closure's result."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("MegaTrainFabricPrecision is only usable with Fabric(strategy='megatrain').")
        closure = kwargs.pop("closure", None)
        result = closure() if closure is not None else None
        self._settle_grads()
        engine.grads.wait()
        self.unscale_gradients(optimizer)
        found_inf, self._found_inf = bool(self._found_inf), None
        self._finish_step(found_inf)
        return result


def _looks_at_grads(module: Any) -> bool:
    """Whether anything may read ``param.grad`` after a backward: manual optimization, or an ``on_after_backward``
    of the module or of a callback."""
    if not module.automatic_optimization or is_overridden("on_after_backward", module):
        return True
    return any(is_overridden("on_after_backward", cb, Callback) for cb in module.trainer.callbacks)


def to_megatrain_fabric_precision(plugin: Any) -> MegaTrainFabricPrecision | None:
    """Convert the generic plugin Fabric's connector builds from ``Fabric(precision=...)`` into ours; a
    :class:`MegaTrainPrecision` given by the user keeps its settings.

    Raises:
        UnsupportedPrecisionError: the plugin stands for a precision we do not support.
    """
    if plugin is None or isinstance(plugin, MegaTrainFabricPrecision):
        return plugin
    if isinstance(plugin, MegaTrainPrecision):
        return MegaTrainFabricPrecision(plugin.precision, _GRAD_NAMES[plugin.grad_dtype], plugin.scale,
                                        plugin.growth_factor, plugin.backoff_factor, plugin.growth_interval,
                                        plugin.device_type, plugin.scaling or plugin.precision != "16-mixed")
    return _convert(plugin, MegaTrainFabricPrecision, FabricPrecision, FabricMixedPrecision, FabricHalfPrecision)


def to_megatrain_precision(plugin: Precision | None) -> MegaTrainPrecision | None:
    """Convert the generic plugin Lightning's connector builds from ``precision=`` (or a user's
    ``MixedPrecision(..., scaler=GradScaler(...))``, whose loss-scaling settings are kept) into ours.

    Raises:
        UnsupportedPrecisionError: the plugin stands for a precision we do not support.
    """
    if plugin is None or isinstance(plugin, MegaTrainPrecision):
        return plugin
    return _convert(plugin, MegaTrainPrecision, Precision, MixedPrecision, HalfPrecision)


def _convert(plugin: Any, cls: type[MegaTrainPrecision], generic: type, mixed: type, half: type) -> MegaTrainPrecision:
    """``cls`` for one of Lightning's (or Fabric's) generic plugins: ``generic`` (32-true), ``mixed`` (keeping a
    user's ``GradScaler`` settings; ``enabled=False``: fp16 autocast without loss scaling, as Lightning), ``half``
    with bf16-true.

    Raises:
        UnsupportedPrecisionError: any other plugin or precision.
    """
    if type(plugin) is generic:
        return cls("32-true")
    if type(plugin) is mixed:
        scaler = getattr(plugin, "scaler", None)
        enabled = scaler is not None and scaler.is_enabled()
        kw = {} if not enabled else dict(init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                                         backoff_factor=scaler.get_backoff_factor(),
                                         growth_interval=scaler.get_growth_interval())
        return cls(plugin.precision, device_type=str(plugin.device), loss_scaling=scaler is None or enabled, **kw)
    if type(plugin) is half and plugin.precision == "bf16-true":
        return cls("bf16-true")
    raise _unsupported(getattr(plugin, "precision", type(plugin).__name__))
