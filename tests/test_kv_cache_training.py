"""KV caches that hold positions in training forwards: refused with an error saying what to do.

Regression: peft prefix tuning crashed in the first training step with a shape error (its
virtual tokens, a cache the engine dropped, were still counted by the attention mask); a forward continuing an
earlier training forward's cache (``model(ids[:, 8:], past_key_values=out1.past_key_values)``) silently attended
over an empty cache (loss 4.580212 vs plain 4.579620, weights 0.9 relative off after 3 steps); a continuation of a
cache computed under ``no_grad`` crashed with a shape error. Plain PyTorch trains all three; the streamed blocks
cannot carry a cache's keys and values (or their gradients) across their autograd boundary.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning.testing import LM, batch_inputs, make_data, make_model


def _fit(module):
    pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(module, make_data(n=4, batch_size=2))


class Continued(LM):
    """The second half of each sequence attends over the first half's cache."""

    def __init__(self, model, prefix_grad: bool):
        super().__init__(model, lr=1e-2)
        self.prefix_grad = prefix_grad

    def training_step(self, batch, batch_idx):
        ids = batch_inputs(batch)["input_ids"]
        with torch.set_grad_enabled(self.prefix_grad):
            first = self.model(input_ids=ids[:, :8], use_cache=True)
        return self.model(input_ids=ids[:, 8:], past_key_values=first.past_key_values, labels=ids[:, 8:],
                          use_cache=True).loss


def test_a_forward_continuing_an_earlier_training_forwards_cache_is_refused():
    with pytest.raises(RuntimeError, match="KV cache \\(past_key_values\\) of an earlier training forward"):
        _fit(Continued(make_model("llama"), prefix_grad=True))


def test_a_training_forward_given_a_cache_holding_positions_is_refused():
    with pytest.raises(RuntimeError, match="KV cache that already holds 8 positions"):
        _fit(Continued(make_model("gpt2"), prefix_grad=False))


def test_a_single_forward_with_use_cache_still_trains():
    """The model's own empty cache of one forward (use_cache=True) is kept working (tests/test_fidelity.py)."""
    lm = LM(make_model("llama", use_cache=True), lr=1e-2)
    _fit(lm)
    assert len(lm.losses) == 1


def test_peft_prefix_tuning_is_refused_before_training():
    import peft  # the test extra installs it
    model = peft.get_peft_model(make_model("llama"), peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                             num_virtual_tokens=4))
    lm = LM(model, lr=1e-2)
    with pytest.raises(RuntimeError, match=r"peft prefix tuning \(default\) cannot be trained.*prompt tuning"):
        _fit(lm)
    assert lm.losses == []
