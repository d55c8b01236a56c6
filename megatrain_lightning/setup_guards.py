"""Every check of user code at setup that refuses or warns, in one place: :func:`check_setup` (the strategy's
``setup``, before any work), :func:`check_new_store` (before a host store is built from the module), and the
checks of the lifecycle hooks (:func:`refuse_unfrozen` before each training batch, :func:`refuse_placeholder_writes`
before and after each step and evaluation loop). The module's own tensors are checked by :mod:`.module_checks`.

Each refusal and warning has a row in docs/compatibility.md (what, why, what to do instead, the test).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback, ModelPruning
from lightning.pytorch.callbacks import StochasticWeightAveraging as _StochasticWeightAveraging
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .callbacks import _WeightAveraging
from .checkpoint.errors import CheckpointError
from .checkpoint.location import local_path
from .checkpoint.peft_io import unsavable_adapters
from .engine import recorded_outputs
from .engine.kv_cache import prefix_tuning_adapters
from .module_checks import refuse_aliased, refuse_compiled, refuse_float64, warn_low_precision
from .store.host import is_nvme_placeholder
from .store.regions import Region

log = logging.getLogger(__name__)


def check_setup(strategy: Any, trainer: Any) -> None:
    """The refusals and warnings about the Trainer, its callbacks, plugins and the module's adapters, run by
    ``MegaTrainStrategy.setup`` before anything is built (in this order).

    Raises:
        CheckpointError: a checkpoint plugin that would not be used; ``WeightAveraging`` with checkpointing.
        RuntimeError: ``ModelPruning``; an averaging or finetuning callback with the weights on NVMe; peft
            prefix tuning; router logits with a transformers version whose recorder cannot be streamed.
    """
    module = strategy.lightning_module
    nvme = strategy.config.nvme
    fitting = trainer.state.fn == TrainerFn.FITTING
    refuse_checkpoint_plugin(strategy.checkpoint_io)  # before any work: it would never be called
    if fitting:
        if nvme is not None and Region.master in nvme.kinds:
            refuse_callbacks_reading_masters_on_disk(trainer.callbacks)
            warn_save_hooks_see_no_weights(module, trainer.callbacks)
        if any(isinstance(cb, ModelPruning) for cb in trainer.callbacks):
            # torch.nn.utils.prune re-registers each pruned ``weight`` as ``weight_orig`` during fit, which the store
            # (laid out at setup) cannot follow; unrefused, the first block call after the first pruning would fail
            # (``ParamRef.registered``), an epoch later
            raise RuntimeError(
                "megatrain: the ModelPruning callback prunes during fit (torch.nn.utils.prune re-registers each pruned "
                "'weight' as 'weight_orig' with a mask), which strategy='megatrain' cannot follow: its host store is "
                "laid out from the module at setup. Prune before trainer.fit instead (torch.nn.utils.prune on the "
                "model, then prune.remove to make it permanent), or between two fit calls, and remove ModelPruning.")
        prefix = prefix_tuning_adapters(module)
        if prefix:  # its first training forward would be refused (engine/kv_cache.py)
            raise RuntimeError(f"megatrain: peft prefix tuning ({', '.join(prefix)}) cannot be trained with "
                               "strategy='megatrain': its virtual tokens enter every attention layer as a KV "
                               "cache, whose gradients the streamed blocks cannot carry. Use prompt tuning or "
                               "P-tuning (peft PromptTuningConfig / PromptEncoderConfig: virtual tokens as input "
                               "embeddings), or LoRA.")
        unsavable = unsavable_adapters(module)
        if unsavable:  # before the training that a final save_checkpoint would then refuse
            log.warning("megatrain: peft adapter(s) %s train, but directory checkpoints cannot save them "
                        "(trainer.save_checkpoint and ModelCheckpoint will raise CheckpointError); save the adapter "
                        "with model.save_pretrained(...) after fit, or use LoRA, DoRA, IA3, LoHa, LoKr or VeRA.",
                        ", ".join(unsavable))
        if not recorded_outputs.supported():
            refuse_router_aux_loss(module)
        if _WeightAveraging is not None and trainer.checkpoint_callbacks \
                and any(isinstance(cb, _WeightAveraging) for cb in trainer.callbacks):
            raise CheckpointError(
                "megatrain: a WeightAveraging / EMAWeightAveraging callback and checkpointing (ModelCheckpoint; "
                "Trainer(enable_checkpointing=True) is the default) are both in this Trainer: its checkpoints' "
                "state_dict would be the average, which the directory checkpoint cannot hold. Pass "
                "enable_checkpointing=False (the average is in the module after fit: save it with "
                "save_pretrained), or drop the averaging callback.")
        for cb in trainer.checkpoint_callbacks:  # before training, not at the first save
            if getattr(cb, "dirpath", None) is not None:
                local_path(cb.dirpath)
    if user_code_after_clip(module) and strategy.groups is not None:
        rank_zero_warn("megatrain: with several processes gradient clipping is applied in the optimizer step: "
                       "param.grad read or edited after clip_gradients (manual optimization, a "
                       "configure_gradient_clipping override) shows the gradients before the clip, and edits "
                       "made after it are clipped too (one process applies the clip at once, as plain Lightning).")
    if strategy.config.optimizer_in_backward is True and fitting:
        why = [w for w, on in (("gradient_clip_val (the clip needs the global norm first)", trainer.gradient_clip_val),
                               ("manual optimization", not module.automatic_optimization),
                               ("fp16 loss scaling", getattr(strategy.precision_plugin, "scaling", False)),
                               ("code that sees the step's gradients", user_code_sees_step_gradients(module, trainer)))
               if on]
        if why:  # asked for explicitly: say why the deferred schedule runs instead
            rank_zero_warn(f"megatrain: optimizer_in_backward=True is not used with {', '.join(why)}: the update "
                           "runs in the optimizer step (same numbers; host memory holds the step's gradients).")
    if nvme is not None and Region.grad_accum in nvme.kinds and fitting:
        hooks = gradient_hooks(module, trainer)
        if hooks:  # they would see param.grad None and their edits would be no-ops, silently
            rank_zero_warn(f"megatrain: the gradient accumulators are on NVMe (offload_optimizer='nvme'), where "
                           f"they are never all in memory, so param.grad is None in {', '.join(hooks)}: that code "
                           "cannot read or change the gradients. Clip with Trainer(gradient_clip_val=...) (applied "
                           "slab by slab), or keep the optimizer state in RAM (offload_optimizer='cpu') to see "
                           "param.grad there.")


def refuse_checkpoint_plugin(checkpoint_io: Any) -> None:
    """Raise if a checkpoint plugin other than Lightning's default is set: the strategy writes its directory
    checkpoints itself, so it would never be called.

    Raises:
        CheckpointError: naming the plugin.
    """
    if type(checkpoint_io) is not TorchCheckpointIO:
        raise CheckpointError(
            f"megatrain: the checkpoint plugin {type(checkpoint_io).__name__} (plugins=[...]) would not be used: "
            "strategy='megatrain' writes its directory checkpoints itself (safetensors shards, atomic rename). "
            "Remove the plugin; to upload or post-process checkpoints, do it after the save.")


def check_new_store(module: torch.nn.Module) -> None:
    """Before a host store is built from ``module``: :func:`refuse_placeholders` and the checks of
    :mod:`.module_checks` (each raises ``RuntimeError``)."""
    refuse_placeholders(module)
    refuse_compiled(module)
    refuse_float64(module)
    refuse_aliased(module)
    warn_low_precision(module)


def user_code_after_clip(module: Any) -> bool:
    """User code may read or edit ``param.grad`` between the clip and the step (manual optimization or a
    ``configure_gradient_clipping`` override)."""
    return not module.automatic_optimization or is_overridden("configure_gradient_clipping", module)


def gradient_hooks(module: Any, trainer: Any) -> list[str]:
    """The module's and callbacks' ``on_after_backward`` / ``on_before_optimizer_step`` overrides, as
    ``"Class.hook"``: user hooks that see the step's gradients before the optimizer step."""
    hooks = ("on_after_backward", "on_before_optimizer_step")
    found = [f"{type(module).__name__}.{h}" for h in hooks if is_overridden(h, module)]
    return found + [f"{type(cb).__name__}.{h}" for cb in trainer.callbacks for h in hooks
                    if is_overridden(h, cb, Callback)]


def user_code_sees_step_gradients(module: Any, trainer: Any) -> bool:
    """Whether user code sees the step's complete gradients before the optimizer step (:func:`gradient_hooks`,
    or a ``configure_gradient_clipping`` / ``optimizer_step`` override): an update applied in the backward would
    run before it, so the deferred schedule runs instead."""
    return (any(is_overridden(h, module) for h in ("configure_gradient_clipping", "optimizer_step"))
            or bool(gradient_hooks(module, trainer)))


def refuse_placeholder_writes(engine: Any) -> None:
    """Raise if user code wrote into NVMe placeholder parameters since the last check (before and after every
    training step and evaluation loop).

    Raises:
        RuntimeError: naming the parameter."""
    if engine is None or engine.closed:
        return
    written = engine.params.placeholder_writes()
    if written:
        more = f" and {len(written) - 1} more" if len(written) > 1 else ""
        raise RuntimeError(
            f"megatrain: parameter {written[0]}{more} was written in place during this run (nn.init, fill_ or zero_ in "
            "a hook), but its weights are on NVMe (offload_params='nvme') and outside a block's compute the module's "
            "parameters are placeholders: the write did not reach the weights. Make the edit inside "
            "`with trainer.strategy.summon_full_params(module):` (reads and writes there see the real weights), "
            "or assign param.data = new_tensor.")


def warn_save_hooks_see_no_weights(module: Any, callbacks: Sequence[Callback]) -> None:
    """Warn (once, at setup) when the LightningModule or a callback overrides ``on_save_checkpoint`` while the weights
    are on NVMe: the hook's ``checkpoint["state_dict"]`` is then empty (the weights are written into ``model/`` one
    slab at a time; a dict of them would need the whole model in host RAM)."""
    who = [type(module).__name__] if is_overridden("on_save_checkpoint", module) else []
    who += [type(cb).__name__ for cb in callbacks if is_overridden("on_save_checkpoint", cb, Callback)
            and not type(cb).__module__.startswith("megatrain_lightning.")]  # the recipes' run record adds metadata only
    if who:
        rank_zero_warn(
            f"megatrain: {', '.join(who)} override(s) on_save_checkpoint; with offload_params='nvme' the hook's "
            "checkpoint['state_dict'] is empty: the weights are written to the checkpoint directory's model/ "
            "(safetensors) one slab at a time. Read weights there after the save, or in a hook inside "
            "`with trainer.strategy.summon_full_params(submodule, writeback=False):`.")


def refuse_callbacks_reading_masters_on_disk(callbacks: Sequence[Callback]) -> None:
    """Raise if a callback would read (or write) parameter values through ``param.data`` while the masters are on
    NVMe, where those tensors are placeholders: ``StochasticWeightAveraging`` and ``WeightAveraging`` would average
    placeholders; ``BaseFinetuning`` tells parameters already in the optimizer by value (``torch.equal``), and
    placeholders of one shape are all equal, so the unfrozen parameters would silently not train.

    Raises:
        RuntimeError: naming the callback.
    """
    kinds = tuple(k for k in (_WeightAveraging, _StochasticWeightAveraging) if k is not None)
    for cb in callbacks:
        if kinds and isinstance(cb, kinds):
            raise RuntimeError(
                f"megatrain: the {type(cb).__name__} callback averages the parameters by reading and writing them "
                "directly, but with offload_params='nvme' the weights live in the NVMe store's files and the "
                "parameters are placeholders. Keep the weights in host RAM (offload_params='cpu'; "
                "offload_optimizer='nvme' still moves the AdamW state to disk), or remove the callback.")
        if isinstance(cb, BaseFinetuning):
            raise RuntimeError(
                f"megatrain: the {type(cb).__name__} callback finds the parameters it unfreezes in the optimizer by "
                "comparing their values, but with offload_params='nvme' the weights live in the NVMe store's files "
                "and the parameters are placeholders (all equal), so it would add no param group and the unfrozen "
                "parameters would not train. Keep the weights in host RAM (offload_params='cpu'; "
                "offload_optimizer='nvme' still moves the AdamW state to disk), or unfreeze in a callback of your own "
                "(requires_grad_(True) and optimizer.add_param_group) with MegaTrainStrategy(unfreeze_during_fit=True).")


def refuse_placeholders(module: torch.nn.Module) -> None:
    """Raise if the module's parameters are NVMe placeholders (stride-0 views of one 4-byte NaN): a store built from
    them would train or evaluate NaN.

    Raises:
        RuntimeError: naming the parameter.
    """
    for name, p in module.named_parameters():
        if is_nvme_placeholder(p):
            raise RuntimeError(
                f"megatrain: parameter {name} holds no weights (an NVMe placeholder: its weights are in the NVMe store "
                "of another strategy, or were, if that store was closed). Use the Trainer whose strategy holds them, "
                "or load them again: from a checkpoint saved before the close (fit(module, ckpt_path=...)) or "
                "from_pretrained on its model/ folder."
            )


def refuse_router_aux_loss(module: torch.nn.Module) -> None:
    """Raise if a mixture-of-experts model returns router logits (``config.output_router_logits=True``: Mixtral,
    Qwen-MoE...), whose auxiliary loss the model adds to the loss.

    Called only when this transformers version does not record per-layer outputs as ``engine/recorded_outputs.py``
    handles: the logits are then kept by hooks inside a streamed block, whose forward keeps nothing for a backward,
    so the backward through the auxiliary loss would fail mid-step, even with ``router_aux_loss_coef=0`` (the
    backward still reaches the logits).

    Raises:
        RuntimeError: naming the submodule.
    """
    for name, m in module.named_modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "output_router_logits", False):
            raise RuntimeError(
                f"megatrain: {name or '(the LightningModule)'} ({type(m).__name__}) has config.output_router_logits="
                "True, which strategy='megatrain' does not support with this transformers version: the router logits "
                "are gathered by hooks inside the streamed decoder layers, whose forward keeps nothing for a backward, so the "
                "backward through the router auxiliary loss (even with router_aux_loss_coef=0) would fail. Set config.output_router_logits=False (the loss is "
                "then the language-modelling loss alone) before fit.")


def refuse_unfrozen(module: torch.nn.Module, trainable: Sequence[bool], option_off: bool = False) -> None:
    """Raise if a parameter frozen when the engine was built (``trainable[i]`` False, in
    ``module.parameters()`` order) has ``requires_grad`` True now.

    Without ``unfreeze_during_fit`` the store holds gradient accumulators and AdamW state only for the parameters
    trainable at setup, so such a parameter's gradient has nowhere to go. Freezing during fit works.

    Raises:
        RuntimeError: naming the first such parameter.
    """
    for (name, p), was in zip(module.named_parameters(), trainable):
        if p.requires_grad and not was:
            raise RuntimeError(
                f"megatrain: parameter {name} was frozen (requires_grad=False) when fit started and is trainable now "
                "(requires_grad_(True) during fit); strategy='megatrain' "
                "allocates gradient and AdamW state at setup, for the parameters trainable then"
                + (" (unfreeze_during_fit=False was passed). " if option_off else ". ")
                + "Pass MegaTrainStrategy(unfreeze_during_fit=True) (Hydra: strategy.unfreeze_during_fit=true; the "
                "default None turns it on with a BaseFinetuning callback) to keep state for the frozen parameters too, "
                "or train in two fits (fit with it frozen, then unfreeze, raise max_epochs/max_steps and call "
                "trainer.fit again).")
