"""Resume from a plain Lightning ``.ckpt`` file: a checkpoint another strategy wrote (single device, ``ddp``,
``deepspeed`` converted with its ``convert_zero_checkpoint_to_fp32_state_dict``, or this project's
``python -m megatrain_lightning.export CKPT --lightning-ckpt OUT.ckpt``).

Lightning's own loader reads the whole file into host RAM (4 bytes/param of weights and 8 of AdamW state, as
with any other strategy) and restores loops, callbacks, LR schedulers and precision state as usual; the strategy
copies the weights into the host store (:func:`load_lightning_weights`) and the AdamW state into its optimizer
(:func:`load_lightning_optimizer`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .errors import CheckpointError


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def load_lightning_weights(checkpoint: Mapping[str, Any], module: nn.Module, engine: Any, strict: bool = True,
                           source: str = "the checkpoint") -> None:
    """Copy ``checkpoint["state_dict"]`` (LightningModule keys) into ``module``: parameters into the host store
    (``engine.write_param``, either tier, cast to fp32; tied ones once), persistent buffers in place.

    Args:
        checkpoint: the loaded ``.ckpt`` dict.
        module: the LightningModule being restored.
        engine: the streaming engine (``write_param``).
        strict: as ``nn.Module.load_state_dict`` (Lightning passes ``LightningModule.strict_loading``).
        source: the file, for messages.

    Raises:
        CheckpointError: no ``state_dict``; ``strict`` and keys missing or unexpected (both listed); a shape
            that differs from the module's.
    """
    sd = checkpoint.get("state_dict")
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{source} has no 'state_dict': not a checkpoint written by Lightning's "
                              "trainer.save_checkpoint.")
    expected = list(module.state_dict(keep_vars=True).keys())
    if strict:
        missing = [k for k in expected if k not in sd]
        unexpected = [k for k in sd if k not in set(expected)]
        if missing or unexpected:
            raise CheckpointError(
                f"{source} does not fit this module: missing keys {_listed(missing) or 'none'}; unexpected keys "
                f"{_listed(unexpected) or 'none'}. It was written for another model (or set "
                "`self.strict_loading = False` in the LightningModule to load what matches).")
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name, param in module.named_parameters():  # tied parameters once, under their first name
            if name not in sd:
                continue
            value = sd[name]
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{source}: {name} has shape {tuple(value.shape)}, the module's parameter "
                                      f"{tuple(param.shape)}.")
            engine.write_param(param, value)
        for name in expected:
            if name in buffers and name in sd and buffers[name] is not None:
                buffers[name].copy_(sd[name])


def load_lightning_optimizer(checkpoint: Mapping[str, Any], optimizer: Any, source: str = "the checkpoint") -> None:
    """Load ``checkpoint["optimizer_states"][0]`` (``torch.optim.AdamW``/``Adam`` format) into the strategy's
    ``HostAdamW`` (``load_state_dict``).

    Raises:
        CheckpointError: no optimizer state (a weights-only checkpoint: Lightning's own resume refuses it the
            same way), several optimizers, or groups that do not match ``configure_optimizers``'.
    """
    states = checkpoint.get("optimizer_states")
    if not states:
        raise CheckpointError(f"{source} holds no optimizer state (saved with weights only?): it cannot resume "
                              "training. Load its weights with `model.load_state_dict(torch.load(...)['state_dict'])` "
                              "and fit without ckpt_path.")
    if len(states) != 1:
        raise CheckpointError(f"{source} holds {len(states)} optimizers' states; strategy='megatrain' trains with one.")
    try:
        optimizer.load_state_dict(states[0])
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None
