"""Gradient batches queued for the D2H worker are bounded whatever the depth (issue 17, item 1).

Each queued batch keeps its packed gradients on the device until the D2H worker copies them; when the
host add is slower than a block's backward (the normal case for large layers), an unbounded queue
would keep every layer's gradients on the device. The CPU path shares the queue and the accounting,
so a slowed host add shows the bound here."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning.engine.grads import GradientSink
from megatrain_lightning.testing import LM, make_data, make_model


def _fit(deep: int) -> tuple[LM, list[dict]]:
    lm = LM(make_model("llama", num_hidden_layers=deep))
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=3, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    trainer.fit(lm, make_data(n=16))
    return lm, trainer.strategy.engine.history


def test_queue_stays_within_its_bound_with_a_slow_host_add(monkeypatch):
    fast, _ = _fit(deep=8)
    add = GradientSink._accumulate

    def slow_add(self, *args, **kwargs):  # the host add of a large layer: slower than its backward
        time.sleep(0.02)
        return add(self, *args, **kwargs)

    monkeypatch.setattr(GradientSink, "_accumulate", slow_add)
    slow, history = _fit(deep=8)
    peaks = [h["megatrain/d2h_queue_peak"] for h in history]
    assert max(peaks) == 2, peaks  # the queue filled up to its bound (the slow add is real) and never beyond
    for (name, a), b in zip(slow.named_parameters(), fast.parameters()):
        assert torch.equal(a, b), name  # the wait changes nothing in the numbers
