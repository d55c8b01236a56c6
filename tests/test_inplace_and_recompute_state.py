"""What a step does between a block's forward and its backward.

Plain PyTorch (``strategy="auto"``) is the reference: autograd refuses a backward through a tensor it saved
that was modified in place since, and computes every forward once. Trying the product found three silent departures:
token ids edited in place after a call (an R-Drop/consistency step masking tokens for a second view) gave the
embedding a gradient from the edited ids in every recompute mode; under ``recompute="none"`` an attention mask
reused as a buffer after the call gave wrong gradients (NaN weights with left padding), because autograd does
not check the version of tensors saved through ``saved_tensors_hooks``; and a hook inside a block reading
state that ``training_step`` sets before each of two calls crashed in the recompute with no word of recompute.
"""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, freeze_key_biases, make_model, padded_data, rel


def _fit(lm: LM, strategy, steps: int = 3) -> LM:
    torch.manual_seed(0)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
               ).fit(lm, padded_data(n=12, batch_size=2))
    return lm


class MaskTwoViews(LM):
    """Two calls per step; between them the token ids are masked in place (``clone=False``) or in a copy."""

    def __init__(self, clone: bool):
        super().__init__(make_model("llama", num_hidden_layers=2), lr=1e-2)
        freeze_key_biases(self.model)
        self.clone = clone

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        ids = ids.clone()  # the loader's own tensor stays as it was
        l1 = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if self.clone:
            ids = ids.clone()
        ids[:, 1::4] = 3
        l2 = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss = l1 + l2
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("recompute", ["block", "none"])
def test_token_ids_modified_in_place_after_the_call_are_refused_as_in_plain(recompute):
    """The embedding keeps its graph in every mode: its saved ids are version-checked as autograd checks them.
    Plain PyTorch refuses the step; so do we (the gradient used the edited ids: 0.53 relative off)."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _fit(MaskTwoViews(clone=False), "auto", steps=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*megatrain: a tensor saved by block"):
        _fit(MaskTwoViews(clone=False), MegaTrainStrategy(recompute=recompute), steps=1)
    ours = _fit(MaskTwoViews(clone=True), MegaTrainStrategy(recompute=recompute))
    plain = _fit(MaskTwoViews(clone=True), "auto")
    assert ours.losses == plain.losses


class ReusedMask(LM):
    """A 4D additive attention mask ``[B, 1, T, T]`` zeroed in place after the call (a reused buffer)."""

    def __init__(self, reuse: bool):
        super().__init__(make_model("llama", attn="sdpa", num_hidden_layers=2), lr=1e-2)  # SDPA saves the mask
        freeze_key_biases(self.model)
        self.reuse = reuse

    def training_step(self, batch, batch_idx):
        ids, am, labels = batch
        t = ids.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & am[:, None, None, :].bool()
        m = torch.zeros(ids.shape[0], 1, t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
        loss = self.model(input_ids=ids, attention_mask=m, labels=labels).loss
        if self.reuse:
            m.zero_()
        self.losses.append(loss.item())
        return loss


def test_a_mask_modified_in_place_under_recompute_none_is_refused():
    """Kept graphs check their saved tensors' versions (wrong gradients before: max |dW| 0.077, NaN with left
    padding); without the edit the run is plain's."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _fit(ReusedMask(reuse=True), "auto", steps=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*block model.model.layers.[01]"):
        _fit(ReusedMask(reuse=True), MegaTrainStrategy(recompute="none"), steps=1)
    ours = _fit(ReusedMask(reuse=False), MegaTrainStrategy(recompute="none"))
    plain = _fit(ReusedMask(reuse=False), "auto")
    assert ours.losses == plain.losses
    ref = dict(plain.named_parameters())
    for k, p in ours.named_parameters():
        assert torch.equal(p.detach(), ref[k].detach()), k


class SteeredTwoCalls(LM):
    """A forward hook on ``layers[1].mlp`` (inside a block) adds a fixed vector at the positions of
    ``self.where``, which ``training_step`` sets before each of two calls of different lengths (or, with
    ``cast``, makes that MLP's output float64 once ``training_step`` sets ``self.where`` after both calls)."""

    def __init__(self, cast: bool = False):
        super().__init__(make_model("llama", num_hidden_layers=2), lr=1e-2)
        freeze_key_biases(self.model)
        self.where: torch.Tensor | None = None
        self.cast = cast
        self.vec = torch.randn(32, generator=torch.Generator().manual_seed(5))
        self.model.model.layers[1].mlp.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if self.cast:
            return out.double() if self.where is not None else out
        return out + self.where[..., None] * self.vec

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        total = 0.0
        for cut in (ids.shape[1], ids.shape[1] - 2):
            self.where = None if self.cast else (torch.arange(cut) == cut - 1).float()
            out = self.model(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], labels=labels[:, :cut]).loss
            total = total + out.float()
        if self.cast:
            self.where = torch.ones(1)  # set after the calls, before the backward
        self.losses.append(float(total))
        return total


def test_a_hook_reading_state_set_per_call_names_the_recompute():
    """The recompute of the first call runs the hook with the second call's state: an error raised in it carries a
    note that it came from the recompute and what to do; ``recompute="none"`` (nothing runs twice) is plain's."""
    with pytest.raises(RuntimeError) as e:
        _fit(SteeredTwoCalls(), MegaTrainStrategy(recompute="block"), steps=1)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    if hasattr(e.value, "add_note"):  # Python >= 3.11 (CI)
        assert "ran again for its backward" in notes and "recompute='none'" in notes
    ours = _fit(SteeredTwoCalls(), MegaTrainStrategy(recompute="none"))
    plain = _fit(SteeredTwoCalls(), "auto")
    assert len(ours.losses) == 3
    for a, b in zip(ours.losses, plain.losses):
        assert abs(a - b) <= 1e-6 * abs(b)
    ref = dict(plain.named_parameters())
    for k, p in ours.named_parameters():
        assert rel(p.detach(), ref[k].detach()) <= 1e-6, k


def test_a_recompute_returning_other_dtypes_than_its_forward_is_refused():
    """As ``torch.utils.checkpoint`` checks its recompute's metadata: the block's output was float32 in the
    forward and float64 in the recompute (the hook read the later call's state)."""
    with pytest.raises(RuntimeError, match="recomputed for its backward returned outputs of other shapes or dtypes"):
        _fit(SteeredTwoCalls(cast=True), MegaTrainStrategy(recompute="block"), steps=1)
