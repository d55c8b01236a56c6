"""Bad input gets a clear error, naming the fix, before any training step runs."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import megatrain_lightning  # noqa: F401
from megatrain_lightning import (BlockDiscoveryError, MegaTrainPrecision, MegaTrainStrategy,
                                 UnsupportedOptimizerError, UnsupportedPrecisionError, discover_blocks)
from helpers import LM, make_data, make_model


def _fit(lm, **kw):
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=2, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    pl.Trainer(**base).fit(lm, make_data(n=4))


class _Counting(LM):
    steps_run = 0

    def training_step(self, batch, batch_idx):
        type(self).steps_run += 1
        return super().training_step(batch, batch_idx)


class PlainNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.b(self.a(batch[0].float()[:, :4])).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_model_without_blocks():
    with pytest.raises(BlockDiscoveryError, match="block_classes"):
        _fit(PlainNet())


def test_override_makes_a_plain_module_streamable():
    blocks = discover_blocks(PlainNet(), block_names=["a", "b"])
    assert [b.name for b in blocks] == ["a", "b"]
    with pytest.raises(BlockDiscoveryError, match="matched"):
        discover_blocks(PlainNet(), block_classes=["NoSuchLayer"])


def test_unsupported_optimizer_class():
    class SGDLM(_Counting):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    SGDLM.steps_run = 0
    with pytest.raises(UnsupportedOptimizerError, match="torch.optim.AdamW"):
        _fit(SGDLM(make_model("llama")))
    assert SGDLM.steps_run == 0


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_unsupported_adamw_flags(flag):
    class FlagLM(_Counting):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), **{flag: True})

    with pytest.raises(UnsupportedOptimizerError, match=flag):
        _fit(FlagLM(make_model("llama")))


def test_two_optimizers():
    class TwoLM(_Counting):
        def __init__(self, m):
            super().__init__(m)
            self.automatic_optimization = False

        def configure_optimizers(self):
            ps = list(self.parameters())
            return [torch.optim.AdamW(ps[:2]), torch.optim.AdamW(ps[2:])]

    TwoLM.steps_run = 0
    with pytest.raises(UnsupportedOptimizerError, match="exactly one optimizer"):
        _fit(TwoLM(make_model("llama")))
    assert TwoLM.steps_run == 0


def test_more_than_one_device():
    with pytest.raises(Exception, match="devices=1"):
        pl.Trainer(strategy="megatrain", accelerator="cpu", devices=2)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-true", "64-true", "bf16-true"])
def test_unsupported_precision(precision):
    with pytest.raises(UnsupportedPrecisionError, match="32-true"):
        pl.Trainer(strategy="megatrain", accelerator="cpu", precision=precision)
    with pytest.raises(UnsupportedPrecisionError):
        MegaTrainPrecision(precision)


def test_parameter_on_root_module():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))
            self.layer = nn.Linear(2, 2)

    with pytest.raises(BlockDiscoveryError, match="owns parameters directly"):
        discover_blocks(Root(), block_names=["layer"])


def test_negative_lookahead():
    lm = LM(make_model("llama"))
    with pytest.raises(ValueError, match="lookahead"):
        _fit(lm, strategy=MegaTrainStrategy(lookahead=-1))
