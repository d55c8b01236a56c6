"""MegaTrainPrecision: fp32 masters on the host whatever the compute precision (issue 3)."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainPrecision
from helpers import LM, VOCAB, make_data, make_model


def learnable_data(n=64, seq=16, batch_size=4, seed=0):
    """Sequences with structure (x_{t+1} = x_t + step mod V), so the loss really falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(seq)) % VOCAB
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def fit(model, steps, data=None, **kw):
    lm = LM(model, lr=3e-3)
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=steps, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    trainer = pl.Trainer(**base)
    trainer.fit(lm, data or learnable_data())
    return lm, trainer


def test_32_true_is_bitwise_the_default_path():
    model = make_model("llama")
    runs = [fit(copy.deepcopy(model), 10, data=make_data()),
            fit(copy.deepcopy(model), 10, data=make_data(), precision="32-true"),
            fit(copy.deepcopy(model), 10, data=make_data(), plugins=[MegaTrainPrecision("32-true")])]
    for lm, _ in runs[1:]:
        assert lm.losses == runs[0][0].losses
        for a, b in zip(lm.parameters(), runs[0][0].parameters()):
            assert torch.equal(a, b)


def test_bf16_mixed_follows_fp32_and_halves_h2d():
    model = make_model("llama")
    fp32, t32 = fit(copy.deepcopy(model), 100)
    bf16, t16 = fit(copy.deepcopy(model), 100, precision="bf16-mixed")
    assert isinstance(t16.strategy.precision_plugin, MegaTrainPrecision)
    assert t16.strategy.precision_plugin.precision == "bf16-mixed"
    assert all(math.isfinite(x) for x in bf16.losses)
    assert fp32.losses[-1] < 0.5 * fp32.losses[0]  # the task is learnable: the comparison means something
    final32 = sum(fp32.losses[-10:]) / 10
    final16 = sum(bf16.losses[-10:]) / 10
    assert abs(final16 - final32) / final32 <= 0.02, (final16, final32)
    h32 = t32.strategy.engine.history[-1]["megatrain/h2d_bytes"]
    h16 = t16.strategy.engine.history[-1]["megatrain/h2d_bytes"]
    assert h16 <= 0.55 * h32, (h16, h32)
    # masters stay fp32
    assert all(p.dtype == torch.float32 for p in bf16.parameters())


def test_bf16_mixed_matches_lightnings_own_bf16_mixed():
    """Same autocast semantics as Lightning's bf16-mixed on fp32 weights; the only difference is the
    one-time bf16 rounding of the streamed weights, so the curves agree closely but not bitwise."""
    model = make_model("llama")
    ours, _ = fit(copy.deepcopy(model), 30, precision="bf16-mixed")
    ref, _ = fit(copy.deepcopy(model), 30, precision="bf16-mixed", strategy="auto")
    for a, b in zip(ours.losses, ref.losses):
        assert abs(a - b) / b < 0.02, (a, b)


def test_bf16_grads_halve_d2h():
    model = make_model("llama")
    _, t32 = fit(copy.deepcopy(model), 3, precision="bf16-mixed")
    _, t16 = fit(copy.deepcopy(model), 3, plugins=[MegaTrainPrecision("bf16-mixed", grad_dtype="bf16")])
    d32 = t32.strategy.engine.history[-1]["megatrain/d2h_bytes"]
    d16 = t16.strategy.engine.history[-1]["megatrain/d2h_bytes"]
    assert d16 == d32 / 2


def test_bf16_true_trains_with_fp32_masters():
    lm, trainer = fit(make_model("llama"), 40, precision="bf16-true")
    assert lm.losses[-1] < 0.8 * lm.losses[0]
    assert all(p.dtype == torch.float32 for p in lm.parameters())


class Snapshots(Callback):
    """Weights and AdamW state after every step (flushed, so pending updates are applied)."""

    def __init__(self):
        self.weights, self.steps, self.exp_avg = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.flush()
        opt = trainer.strategy.engine.optimizer
        self.weights.append([p.detach().clone() for p in pl_module.parameters()])
        self.steps.append([t.item() if t is not None else 0 for s in opt.steps for t in s])
        self.exp_avg.append([m.clone() for m in opt.exp_avg if m is not None])


def test_fp16_overflow_skips_exactly_that_step():
    bad_step = 3

    class Overflow(LM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if batch_idx == bad_step else loss

    model = make_model("llama")
    snaps = Snapshots()
    plugin = MegaTrainPrecision("16-mixed")
    lm = Overflow(model, lr=3e-3)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=6, plugins=[plugin], callbacks=[snaps],
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(lm, learnable_data())
    assert plugin.skipped_steps == 1
    assert plugin.scale == 2.0**16 * 0.5
    before, after = bad_step - 1, bad_step
    for a, b in zip(snaps.weights[before], snaps.weights[after]):
        assert torch.equal(a, b)
    assert snaps.steps[after] == snaps.steps[before]
    for a, b in zip(snaps.exp_avg[before], snaps.exp_avg[after]):
        assert torch.equal(a, b)
    # the steps around it did update
    assert any(not torch.equal(a, b) for a, b in zip(snaps.weights[after], snaps.weights[after + 1]))
    assert all(math.isfinite(x) for x in lm.losses)


def test_fp16_mixed_trains_and_scaler_state_roundtrips():
    plugin = MegaTrainPrecision("16-mixed", growth_interval=5)
    lm, trainer = fit(make_model("llama"), 12, plugins=[plugin])
    assert lm.losses[-1] < lm.losses[0]
    assert plugin.scale == 2.0**16 * 4  # grew twice (5 and 10 clean steps)
    state = plugin.state_dict()
    other = MegaTrainPrecision("16-mixed")
    other.load_state_dict(state)
    assert other.state_dict() == state == {"scale": 2.0**18, "growth_tracker": 2, "skipped_steps": 0}


def test_scaler_state_is_in_lightning_checkpoint(tmp_path):
    plugin = MegaTrainPrecision("16-mixed", growth_interval=3)
    lm, trainer = fit(make_model("llama"), 4, plugins=[plugin])
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ck = torch.load(tmp_path / "c.ckpt" / "trainer.pt", weights_only=True)
    assert ck["MegaTrainPrecision"]["scale"] == 2.0**17


def test_recompute_runs_under_the_forward_precision():
    """Backward recompute replays autocast: the gradients equal those of Lightning's own bf16-mixed
    step on the same bf16-rounded weights."""
    model = make_model("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # weights exactly representable in bf16
    ref = copy.deepcopy(model)
    grads = {}

    class Grab(LM):
        def on_before_optimizer_step(self, optimizer):
            for n, p in self.named_parameters():
                grads[n] = p.grad.clone()

    lm = Grab(model)
    pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=1, precision="bf16-mixed", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
               ).fit(lm, make_data())
    (ids,) = next(iter(make_data()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads["model." + n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
