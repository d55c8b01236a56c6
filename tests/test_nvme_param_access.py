"""Reading and writing weights from hooks when they live on NVMe (``offload_params="nvme"``).

Outside a block's compute the module's parameters are placeholders there. Trying the product found that a weight
read in a callback gave plausible zeros (a weight-norm logger: 0.0 against 22.48 in plain Lightning) and that
``nn.init.zeros_`` / ``fill_`` in ``on_fit_start`` were lost without a word (first loss 5.586 against 5.545).
Now a read outside gives NaN, a lost write is refused at the next step naming the parameter, torch's own refusal of
``copy_`` / ``mul_`` gets a note, and ``trainer.strategy.summon_full_params(module)`` gives the real weights to read
and edit. Reference: the same LightningModule with ``strategy="auto"`` (plain Lightning), fp32.
"""
from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch import nn

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model


def _nvme(tmp_path, **kw) -> MegaTrainStrategy:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return MegaTrainStrategy(offload_params="nvme", nvme_path=str(tmp_path), **kw)


def _fit(lm: LM, strategy, steps: int = 3, callbacks=()) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))
    trainer.fit(lm, make_data(n=2 * steps))
    return trainer


class EditLM(LM):
    """Edits the LM head in ``on_fit_start``: ``how`` = "plain" (in place, as on a plain module) or "summon" (the
    same edit inside ``summon_full_params``). The edit: ``weight * 0.5 + 0.01`` (reads the weights, then writes)."""

    def __init__(self, how: str):
        super().__init__(make_model("llama"))
        self.how = how

    def _edit(self) -> None:
        w = self.model.lm_head.weight
        with torch.no_grad():
            w.mul_(0.5).add_(0.01)

    def on_fit_start(self) -> None:
        if self.how == "summon":
            with self.trainer.strategy.summon_full_params(self.model.lm_head):
                self._edit()
        else:
            self._edit()


def test_an_edit_inside_summon_full_params_trains_as_plain(tmp_path):
    """The read-modify-write reaches the weights on NVMe: losses and final weights as plain Lightning's (after fit the
    weights come back into the module: no host_memory_limit)."""
    ours = EditLM("summon")
    _fit(ours, _nvme(tmp_path))
    plain = EditLM("plain")
    _fit(plain, "auto")
    unedited = LM(make_model("llama"))
    _fit(unedited, "auto", steps=1)
    assert plain.losses[0] != unedited.losses[0]  # the edit changes what is trained
    assert_parity(ours.model, plain.model, ours.losses, plain.losses, tol=1e-6)


@pytest.mark.parametrize("op", ["zeros_", "fill_"])
def test_a_write_into_a_placeholder_is_refused_at_the_next_step(tmp_path, op):
    """Was lost silently (the run trained the unedited weights): refused before the first step, naming the
    parameter and summon_full_params."""

    class Writes(LM):
        def on_fit_start(self) -> None:
            w = self.model.lm_head.weight
            with torch.no_grad():
                nn.init.zeros_(w) if op == "zeros_" else w.fill_(0.01)

    lm = Writes(make_model("llama"))
    with pytest.raises(RuntimeError, match="parameter model.lm_head.weight was written in place during this run.*summon_full_params"):
        _fit(lm, _nvme(tmp_path))
    assert lm.losses == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="BaseException.add_note is Python >= 3.11")
def test_torch_refusing_an_in_place_write_gets_a_note(tmp_path):
    """``copy_`` into a stride-0 placeholder is refused by torch itself with "more than one element of the
    written-to tensor refers to a single memory location"; the note says why and what to do."""

    class Copies(LM):
        def on_fit_start(self) -> None:
            w = self.model.lm_head.weight
            with torch.no_grad():
                w.copy_(torch.full_like(w, 0.01))

    with pytest.raises(RuntimeError, match="single memory location") as err:
        _fit(Copies(make_model("llama")), _nvme(tmp_path))
    assert any("summon_full_params" in n for n in getattr(err.value, "__notes__", [])), err.value


class NormLog(pl.Callback):
    """Logs the LM head's weight norm before each optimizer step: ``inside`` summon_full_params (read only), or
    directly."""

    def __init__(self, inside: bool):
        self.inside, self.norms = inside, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        w = pl_module.model.lm_head.weight
        if self.inside and isinstance(trainer.strategy, MegaTrainStrategy):
            with trainer.strategy.summon_full_params(pl_module.model.lm_head, writeback=False):
                self.norms.append(float(w.norm()))
        else:
            self.norms.append(float(w.norm()))


def test_weights_read_inside_summon_full_params_are_plain_lightnings(tmp_path):
    """Read outside it, the placeholders give NaN (they gave 0.0, which looked like a value); inside it, the
    norms per step are plain Lightning's."""
    inside, outside, plain = NormLog(True), NormLog(False), NormLog(False)
    ours = LM(make_model("llama"))
    _fit(ours, _nvme(tmp_path), callbacks=[inside, outside])
    ref = LM(make_model("llama"))
    _fit(ref, "auto", callbacks=[plain])
    assert len(outside.norms) == 3 and all(n != n for n in outside.norms)  # NaN
    assert inside.norms == pytest.approx(plain.norms, rel=1e-6, abs=0) and len(plain.norms) == 3
    assert ours.losses == pytest.approx(ref.losses, rel=1e-6, abs=0)


def test_summon_full_params_refuses_more_than_host_memory_limit_before_reading(tmp_path):
    """The whole model's fp32 weights would not fit the host budget: a clear error before any read."""
    seen = {}

    class Summons(LM):
        def on_fit_start(self) -> None:
            try:
                with self.trainer.strategy.summon_full_params():
                    seen["entered"] = True
            except ValueError as e:
                seen["error"] = str(e)

    lm = Summons(make_model("llama", num_hidden_layers=24))  # 0.9 MB of fp32 weights
    limit = 600_000  # above the NVMe tier's minimum window (384 KiB here)
    nbytes = sum(p.numel() * 4 for p in lm.parameters())
    assert nbytes > limit
    _fit(lm, _nvme(tmp_path, host_memory_limit=limit), steps=1)
    assert "entered" not in seen
    assert "summon_full_params would read" in seen["error"] and "Pass the submodule" in seen["error"]


def test_an_on_save_checkpoint_override_is_told_the_state_dict_is_empty(tmp_path):
    """With the weights on NVMe the hook's checkpoint["state_dict"] is empty (0 keys, against 30 in the RAM
    tier, without a word): a warning at setup names the override; ModelCheckpoint alone gets none."""
    class Saves(LM):
        def on_save_checkpoint(self, checkpoint) -> None:
            self.keys = len(checkpoint["state_dict"])

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)
    with pytest.warns(UserWarning, match="Saves override.*on_save_checkpoint.*state_dict'\\] is empty.*summon_full_params"):
        lm = Saves(make_model("llama"))
        _fit(lm, _nvme(tmp_path / "a"), steps=1, callbacks=[ckpt])
    assert lm.keys == 0
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _fit(LM(make_model("llama")), _nvme(tmp_path / "b"), steps=1,
             callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt2"), every_n_train_steps=1)])
    assert not [w for w in got if "on_save_checkpoint" in str(w.message)]


class SaveAtEnd(pl.Callback):
    """``save_pretrained`` of the model in ``on_train_end``: directly, or inside ``summon_full_params`` (read only)."""

    def __init__(self, out, inside: bool):
        self.out, self.inside, self.error = out, inside, None

    def on_train_end(self, trainer, pl_module) -> None:
        model = pl_module.model
        try:
            if self.inside and isinstance(trainer.strategy, MegaTrainStrategy):
                with trainer.strategy.summon_full_params(model, writeback=False):
                    model.save_pretrained(self.out)
            else:
                model.save_pretrained(self.out)
        except RuntimeError as e:
            self.error = str(e)


def test_save_pretrained_of_placeholders_is_refused_and_works_inside_summon(tmp_path):
    """``save_pretrained`` from a callback wrote an all-NaN model (143808 of 143808 values): refused, naming
    save_checkpoint and summon_full_params; inside summon_full_params it writes plain Lightning's trained weights."""
    from safetensors.torch import load_file

    direct, inside, plain = SaveAtEnd(tmp_path / "d", False), SaveAtEnd(tmp_path / "i", True), SaveAtEnd(tmp_path / "p", False)
    _fit(LM(make_model("llama")), _nvme(tmp_path / "n1"), callbacks=[direct])
    assert direct.error is not None and "would save NaN" in direct.error and "save_checkpoint" in direct.error
    assert not (tmp_path / "d" / "model.safetensors").exists()
    _fit(LM(make_model("llama")), _nvme(tmp_path / "n2"), callbacks=[inside])
    _fit(LM(make_model("llama")), "auto", callbacks=[plain])
    ours, ref = load_file(tmp_path / "i" / "model.safetensors"), load_file(tmp_path / "p" / "model.safetensors")
    assert ours.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=0, msg=k)


class Nested(pl.Callback):
    """At step 1's end: an outer ``summon_full_params`` on the whole module, an inner one on the LM head (edits it);
    after the inner one ends, the outer one reads an MLP weight's norm and halves it."""

    def __init__(self):
        self.norm = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 1:
            return
        model = pl_module.model
        up = model.model.layers[0].mlp.up_proj.weight
        with trainer.strategy.summon_full_params(pl_module) if isinstance(trainer.strategy, MegaTrainStrategy) \
                else torch.no_grad():
            with trainer.strategy.summon_full_params(model.lm_head) if isinstance(trainer.strategy, MegaTrainStrategy) \
                    else torch.no_grad():
                with torch.no_grad():
                    model.lm_head.weight.mul_(0.5)
            self.norm = float(up.norm())
            with torch.no_grad():
                up.mul_(0.5)


def test_nested_summon_full_params_keeps_the_outer_weights(tmp_path):
    """The inner context's exit took the outer one's parameters back to placeholders (the outer read gave
    NaN, its edit raised): now both edits train as in plain Lightning."""
    ours, ref = LM(make_model("llama")), LM(make_model("llama"))
    a, b = Nested(), Nested()
    _fit(ours, _nvme(tmp_path), callbacks=[a])
    _fit(ref, "auto", callbacks=[b])
    assert a.norm == pytest.approx(b.norm, rel=1e-6, abs=0) and a.norm == a.norm
    assert_parity(ours.model, ref.model, ours.losses, ref.losses, tol=1e-6)


def test_a_write_into_a_placeholder_in_on_train_end_is_refused_then(tmp_path):
    """The checks ran before each step only: a write in the run's last hooks was lost, and the next run refused its
    own first step for it (review). Now the end of the run refuses it."""

    class LateWrite(LM):
        def on_train_end(self) -> None:
            with torch.no_grad():
                self.model.lm_head.weight.fill_(0.01)

    lm = LateWrite(make_model("llama"))
    strategy = _nvme(tmp_path)
    with pytest.raises(RuntimeError, match="parameter model.lm_head.weight was written in place during this run"):
        _fit(lm, strategy, steps=2)
    assert len(lm.losses) == 2
