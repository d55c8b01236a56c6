"""Fidelity: strategy="megatrain" on the CPU in fp32 is bitwise plain PyTorch (docs/architecture.md, "Fidelity").

For every architecture of megatrain_lightning.testing.ARCHS: 20 optimizer steps with gradient accumulation 3, norm clipping
that really clips and a cosine schedule, through Lightning, against ``reference_train`` (the plain loop
with ``torch.optim.AdamW`` and its default arguments) from the same weights. Per step, every micro-batch
loss, every gradient ``on_before_optimizer_step`` sees, and after the step every weight, ``exp_avg``,
``exp_avg_sq`` and ``step`` must be bitwise equal; attention key biases included (their exact gradient is
zero, so they train on rounding noise: equal only because every operation rounds alike).

What it took (before: 2.6e-7 relative in one step's gradients of GPT-2, 1.5e-5 in its weights after 4
steps): the host AdamW runs the kernel the user's optimizer runs (for-loop by default on CPU, not the
fused one), a tied parameter's contributions of one backward are summed before they reach its
accumulator, and GPT-2's blocks get the fresh empty KV cache plain PyTorch gives them.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning.testing import ARCHS, LM, make_data, make_model, reference_train, rel
from megatrain_lightning.engine.kv_cache import training_call

STEPS, ACC, CLIP = 20, 3, 0.05


def _after_step(model, state_of) -> dict[str, tuple[torch.Tensor, ...]]:
    out = {}
    for n, p in model.named_parameters():
        st = state_of(p)
        out[n] = (p.detach().clone(),) + (() if st is None else
                                           (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["step"].clone()))
    return out


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


class _RecordAfter(pl.Callback):
    """What Lightning's hooks see after each step: weights and AdamW state (no gradient hook: a callback reading
    gradients keeps ``optimizer_in_backward`` from applying updates in the backward)."""

    def __init__(self):
        self.grads, self.after = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % ACC == 0:  # the step ran in this batch
            trainer.strategy.flush()  # apply the deferred updates before reading weights
            self.after.append(_after_step(pl_module.model, trainer.strategy.engine.optimizer.param_state))


class _Record(_RecordAfter):
    """What Lightning's hooks see: gradients before each step, weights and AdamW state after it."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(_grads(pl_module.model))


def _same(a, b, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a is None=} {b is None=}"
        return
    assert torch.equal(a, b), f"{what}: not bitwise, relative difference {rel(a, b):.3e}"


def _fit_both(arch: str, steps: int, opt_kwargs: dict | None = None, strategy="megatrain", clip: float | None = CLIP,
              record_grads: bool = True):
    model = make_model(arch)
    ref = copy.deepcopy(model)
    opt_kwargs = dict(opt_kwargs or {})
    rec = _Record() if record_grads else _RecordAfter()
    lm = LM(model, sched="cosine", total_steps=steps, opt_kwargs=opt_kwargs)
    torch.manual_seed(0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=ACC,
                         gradient_clip_val=clip, callbacks=[rec], enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, make_data(n=steps * ACC * 2))
    ref_grads, ref_after = [], []
    fused = opt_kwargs.pop("fused", None)
    ref_losses = reference_train(ref, make_data(n=steps * ACC * 2), steps, accumulate=ACC, clip=clip, sched="cosine",
                                 fused=fused, opt_kwargs=opt_kwargs, on_grads=lambda m: ref_grads.append(_grads(m)),
                                 on_step=lambda m, o: ref_after.append(_after_step(m, lambda p: o.state.get(p))))
    return lm, trainer, rec, ref_losses, ref_grads, ref_after


def _assert_bitwise(lm, rec, ref_losses, ref_grads, ref_after, steps, grads: bool = True):
    """Step by step, in the order they are computed, so that a failure names the first difference."""
    assert len(lm.losses) == len(ref_losses) == steps * ACC
    assert len(rec.after) == len(ref_after) == steps and (not grads or len(rec.grads) == len(ref_grads) == steps)
    for s in range(steps):
        for i in range(s * ACC, (s + 1) * ACC):
            assert lm.losses[i] == ref_losses[i], f"micro-batch {i}: loss {lm.losses[i]!r} vs plain {ref_losses[i]!r}"
        for n, g in ref_grads[s].items() if grads else ():
            _same(rec.grads[s][n], g, f"step {s} gradient of {n}")
        for n, want in ref_after[s].items():
            got = rec.after[s][n]
            assert len(got) == len(want), f"step {s}: {n} has AdamW state on one side only"
            for what, a, b in zip(("weight", "exp_avg", "exp_avg_sq", "step"), got, want):
                _same(a, b, f"step {s} {what} of {n}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bitwise_plain_pytorch_with_accumulation_clipping_and_cosine(arch):
    lm, trainer, rec, ref_losses, ref_grads, ref_after = _fit_both(arch, STEPS)
    # the clipping really clips (the unclipped norm is far above the threshold) and the schedule really ran
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads[0].values() if g is not None]))
    assert norm > 4 * CLIP
    assert trainer.optimizers[0].param_groups[0]["lr"] < 1e-5
    assert trainer.strategy.engine.optimizer.implementation() == "for-loop"  # torch's default for CPU tensors
    _assert_bitwise(lm, rec, ref_losses, ref_grads, ref_after, STEPS)


@pytest.mark.parametrize("flags,kernel", [({"fused": True}, "fused"), ({"foreach": True}, "foreach")])
def test_users_adamw_kernel_flags_are_honoured(flags, kernel):
    """AdamW(fused=True) / AdamW(foreach=True): the host update runs that kernel, bitwise the plain loop's."""
    lm, trainer, rec, ref_losses, ref_grads, ref_after = _fit_both("llama_tied", 5, flags)
    assert trainer.strategy.engine.optimizer.implementation() == kernel
    _assert_bitwise(lm, rec, ref_losses, ref_grads, ref_after, 5)


def test_tied_weights_with_updates_in_backward():
    """optimizer_in_backward: each slab's update runs as soon as its last gradient of the step is in, so
    the tied embedding's per-backward sum goes into its accumulator before that update (the gradients
    are consumed by then: no gradient hook may run, or the deferred schedule would; so only losses, weights and
    AdamW state are compared)."""
    from megatrain_lightning import MegaTrainStrategy

    strategy = MegaTrainStrategy(optimizer_in_backward=True)
    lm, trainer, rec, ref_losses, ref_grads, ref_after = _fit_both("llama_tied", 5, strategy=strategy, clip=None,
                                                                   record_grads=False)
    assert trainer.strategy.engine.optimizer.updates_in_backward > 0
    _assert_bitwise(lm, rec, ref_losses, ref_grads, ref_after, 5, grads=False)


def test_empty_kv_cache_is_fresh_for_every_block_run():
    """An empty DynamicCache passed to a block under grad mode stays in the call; each run (forward,
    recompute) gets its own copy, and the user's object is never written. A cache holding positions is refused."""
    from transformers import DynamicCache, GPT2Config

    cfg = GPT2Config(n_layer=2)
    user = DynamicCache(config=cfg)
    seen = []

    def block(x, cache=None, use_cache=False):
        seen.append(cache)
        k, v = cache.update(x, x, 0)
        return k

    x = torch.randn(1, 2, 3, 4).transpose(2, 3)  # a transposed view, like GPT-2's keys
    args, kwargs, forward, stripped = training_call((x,), {"cache": user, "use_cache": True}, block)
    assert not stripped and kwargs["cache"] is user and kwargs["use_cache"] is True
    first, second = forward(*args, **kwargs), forward(*args, **kwargs)
    assert seen[0] is not seen[1] and user not in seen
    assert torch.equal(first, x) and torch.equal(second, x) and first.is_contiguous()  # what plain PyTorch attends over
    assert user.get_seq_length() == 0 and seen[0].get_seq_length() == x.shape[-2]

    # a cache holding positions is refused (dropping it changed the loss): tests/test_kv_cache_training.py
    full = DynamicCache(config=cfg)
    full.update(x, x, 0)
    with pytest.raises(RuntimeError, match="already holds 4 positions"):
        training_call((x,), {"cache": full, "use_cache": True}, block, "b0", 0)  # in this block's slot (layer 0)
    # positions in another layer's slot are this forward's (an earlier frozen block ran like evaluation and wrote
    # them, as in plain PyTorch): dropped for this block, which has no past of its own
    args, kwargs, forward, stripped = training_call((x,), {"cache": full, "use_cache": True}, block, "b1", 1)
    assert stripped and kwargs["cache"] is None and kwargs["use_cache"] is False
