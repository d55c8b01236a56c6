"""Directory checkpoints and the LightningModule's own tensors, against plain Lightning (``strategy="auto"``):
persistent buffers restored on resume and by ``validate(ckpt_path=...)`` (RAM and NVMe tiers), tensors outside the
Hugging Face model kept out of ``model/`` (``extra/``), ``strict_loading = False``, and ``on_load_checkpoint``'s
empty ``state_dict``."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.checkpoint.directory import CheckpointError
from megatrain_lightning.testing import LM, SEQ, VOCAB, make_model


def data(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g)), batch_size=2)


def trainer(strategy, steps, **kw):
    base = dict(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
                logger=False, enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    return pl.Trainer(**base)


def strategy_for(kind, tmp_path, n=[0]):  # noqa: B006 (a counter: a fresh NVMe folder per trainer)
    if kind == "auto":
        return "auto"
    if kind == "ram":
        return "megatrain"
    n[0] += 1
    folder = tmp_path / f"nvme{n[0]}"
    folder.mkdir()
    return MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(folder),
                             host_memory_limit="8MiB")


class BufferLM(LM):
    """A persistent buffer updated in ``training_step`` that scales the loss (so it changes the updates), and a
    class-weighted cross entropy whose weight is a persistent buffer outside the Hugging Face model."""

    def __init__(self, model, class_weight=None):
        super().__init__(model, lr=1e-2)
        self.register_buffer("running", torch.zeros(()))
        w = torch.linspace(0.5, 1.5, VOCAB) if class_weight is None else class_weight
        self.loss_fn = torch.nn.CrossEntropyLoss(weight=w)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.model(input_ids=ids).logits
        loss = self.loss_fn(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        with torch.no_grad():
            self.running.mul_(0.5).add_(loss.detach())
        return loss * (1.0 + self.running)


def _resumed(kind, tmp_path, base):
    """Fit 2 steps, save, resume into a fresh module (other class weights) up to 4 steps; also validate a fresh
    module from the checkpoint. Returns (resumed module, validated module, checkpoint path, first module)."""
    first = BufferLM(copy.deepcopy(base))
    t = trainer(strategy_for(kind, tmp_path), 2)
    t.fit(first, data())
    path = tmp_path / f"{kind}.ckpt"
    t.save_checkpoint(path)
    second = BufferLM(copy.deepcopy(base), class_weight=torch.ones(VOCAB))
    trainer(strategy_for(kind, tmp_path), 4).fit(second, data(), ckpt_path=path)
    fresh = BufferLM(copy.deepcopy(base), class_weight=torch.ones(VOCAB))
    trainer(strategy_for(kind, tmp_path), 4, limit_val_batches=1).validate(fresh, data(n=2, seed=3), ckpt_path=path,
                                                                           verbose=False)
    return second, fresh, path, first


@pytest.mark.parametrize("kind", ["ram", "nvme"])
def test_persistent_buffers_resume_exactly_like_plain_lightning(tmp_path, kind):
    base = make_model("llama")
    ref, ref_fresh, _, ref_first = _resumed("auto", tmp_path, base)
    got, fresh, path, first = _resumed(kind, tmp_path, base)
    assert first.running.item() == ref_first.running.item() != 0.0
    assert got.losses == ref.losses
    assert torch.equal(got.running, ref.running) and torch.equal(got.loss_fn.weight, ref.loss_fn.weight)
    assert torch.equal(got.loss_fn.weight, torch.linspace(0.5, 1.5, VOCAB))  # the saved buffer, not the fresh one
    for (n, a), (_, b) in zip(got.model.state_dict().items(), ref.model.state_dict().items()):
        assert torch.equal(a, b), n
    # validate(ckpt_path=dir) on a fresh module: the saved buffers, as plain Lightning
    assert torch.equal(fresh.running, first.running) and torch.equal(fresh.running, ref_fresh.running)
    assert torch.equal(fresh.loss_fn.weight, ref_fresh.loss_fn.weight)


def test_tensors_outside_the_hf_model_keep_model_dir_loadable(tmp_path):
    base = make_model("llama")
    lm = BufferLM(copy.deepcopy(base))
    t = trainer("megatrain", 2)
    t.fit(lm, data())
    t.save_checkpoint(tmp_path / "c")
    assert (tmp_path / "c" / "model" / "config.json").is_file()
    assert (tmp_path / "c" / "extra").is_dir()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c" / "model")
    for (n, a), (_, b) in zip(loaded.state_dict().items(), lm.model.state_dict().items()):
        assert torch.equal(a, b), n


class Extra(LM):
    """The checkpoint's module with one more layer (``strict_loading`` set per test)."""

    def __init__(self, model, strict):
        super().__init__(model)
        self.strict_loading = strict
        torch.manual_seed(7)
        self.extra = torch.nn.Linear(4, 2)

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss + 0.0 * self.extra.weight.sum()
        self.log("val_loss", loss)
        return loss


def test_strict_loading_false_loads_what_matches_like_plain_lightning(tmp_path):
    base = make_model("llama")
    results = {}
    for kind in ("auto", "megatrain"):
        lm = LM(copy.deepcopy(base), lr=1e-2)
        t = trainer(kind, 2)
        t.fit(lm, data())
        t.save_checkpoint(tmp_path / kind)
        e = Extra(copy.deepcopy(base), strict=False)
        init = copy.deepcopy(e.extra.state_dict())
        out = trainer(kind, 2, limit_val_batches=1).validate(e, data(n=2, seed=3), ckpt_path=tmp_path / kind,
                                                             verbose=False)
        for k, v in e.extra.state_dict().items():
            assert torch.equal(v, init[k]), k  # missing in the checkpoint: its current value kept
        for (n, a), (_, b) in zip(e.model.state_dict().items(), lm.model.state_dict().items()):
            assert torch.equal(a, b), n
        results[kind] = out[0]["val_loss"]
    assert results["megatrain"] == results["auto"]
    with pytest.raises(CheckpointError, match="another model config.*strict_loading"):
        trainer("megatrain", 2, limit_val_batches=1).validate(Extra(copy.deepcopy(base), strict=True), data(n=2),
                                                              ckpt_path=tmp_path / "megatrain", verbose=False)
    other = Extra(make_model("llama", intermediate_size=48), strict=False)
    with pytest.raises(CheckpointError, match="shape differs"):  # a different config is refused all the same
        trainer("megatrain", 2, limit_val_batches=1).validate(other, data(n=2), ckpt_path=tmp_path / "megatrain",
                                                              verbose=False)


def test_on_load_checkpoint_sees_an_empty_state_dict_and_the_weights_are_loaded(tmp_path):
    """Documented behaviour: the strategy loads the weights before the hook; ``state_dict`` is ``{}``."""
    seen = {}

    class Hooked(LM):
        def on_load_checkpoint(self, checkpoint):
            seen["state_dict"] = checkpoint["state_dict"]
            seen["weight"] = self.model.lm_head.weight.detach().clone()

    base = make_model("llama")
    lm = LM(copy.deepcopy(base), lr=1e-2)
    t = trainer("megatrain", 2)
    t.fit(lm, data())
    t.save_checkpoint(tmp_path / "c")
    trainer("megatrain", 2, limit_val_batches=1).validate(Hooked(copy.deepcopy(base)), data(n=2),
                                                          ckpt_path=tmp_path / "c", verbose=False)
    assert seen["state_dict"] == {}
    assert torch.equal(seen["weight"], lm.model.lm_head.weight)
