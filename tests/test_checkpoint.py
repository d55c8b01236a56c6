"""Directory checkpoints: exact resume (mid-epoch included), HF-loadable model/, bad input."""

from __future__ import annotations

import copy
import json
import re
import shutil

import lightning.pytorch as pl
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

import megatrain_lightning  # noqa: F401
from megatrain_lightning.checkpoint.directory import CheckpointError
from megatrain_lightning.data import ResumableDataLoader
from megatrain_lightning.testing import LM, SEQ, VOCAB, assert_parity, make_model


def loader(n=24, batch_size=2, seed=5):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ResumableDataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=True, seed=seed)


def trainer(steps, tmp_path=None, **kw):
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=steps, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    base.update(kw)
    return pl.Trainer(**base)


def lm_for(model):
    return LM(copy.deepcopy(model), sched="cosine", total_steps=10)


@pytest.mark.parametrize("n_first", [3, 4])  # 3 steps = 6 batches: mid-epoch (12 batches per epoch)
def test_save_and_resume_is_exact(tmp_path, n_first):
    model = make_model("llama_tied")
    full = lm_for(model)
    trainer(10).fit(full, loader())

    first = lm_for(model)
    t1 = trainer(n_first)
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model" / "config.json").is_file()

    second = lm_for(model)
    trainer(10).fit(second, loader(), ckpt_path=tmp_path / "ckpt")
    assert_parity(second.model, full.model, first.losses + second.losses, full.losses, tol=1e-6)


def test_model_checkpoint_callback_top_k_last_and_resume_last(tmp_path):
    model = make_model("llama")
    full = lm_for(model)
    trainer(8).fit(full, loader())

    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                         save_last=True)
    first = lm_for(model)
    trainer(6, enable_checkpointing=True, callbacks=[cb]).fit(first, loader())
    dirs = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert dirs == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"], dirs
    assert all((tmp_path / d).is_dir() for d in dirs)

    second = lm_for(model)
    cb2 = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(8, enable_checkpointing=True, callbacks=[cb2]).fit(second, loader(), ckpt_path="last")
    assert_parity(second.model, full.model, first.losses + second.losses, full.losses, tol=1e-6)


def test_model_dir_loads_in_transformers_and_generates(tmp_path):
    model = make_model("llama_tied")
    lm = lm_for(model)
    t = trainer(3)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c" / "model")
    for (n, a), (_, b) in zip(hf.named_parameters(), lm.model.named_parameters()):
        assert torch.equal(a, b), n
    out = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("strategy", ["megatrain", "megatrain_nvme"])
def test_a_plain_lightning_checkpoint_resumes_exactly(tmp_path, monkeypatch, strategy):
    """A ``.ckpt`` written by plain Lightning (``strategy="auto"``) mid-epoch (step 3 of 6 per epoch, cosine LR,
    accumulation 2, tied embedding) resumes with ``strategy="megatrain"`` and ends bitwise where plain Lightning's
    uninterrupted run ends (the NVMe tier: within 1e-6, docs/architecture.md "Fidelity" on tied accumulators on
    NVMe): weights, AdamW moments and step counts, the LR schedule and the loader's position all come from the
    file. Before, any ``.ckpt`` was refused. The NVMe variant also covers a tied model's empty head slab, whose
    0-byte window buffer shared an arena offset with the next buffer (KeyError at the end of fit)."""
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path))
    model = make_model("llama_tied")
    full = lm_for(model)
    trainer(8, strategy="auto").fit(full, loader())
    first = lm_for(model)
    t1 = trainer(3, strategy="auto")
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "plain.ckpt")
    second = lm_for(model)
    t2 = trainer(8, strategy=strategy)
    t2.fit(second, loader(), ckpt_path=tmp_path / "plain.ckpt")
    assert len(second.losses) == 10
    if strategy == "megatrain":
        for a, b in zip(first.losses + second.losses, full.losses):
            assert a == b
        for (n, a), (_, b) in zip(second.model.named_parameters(), full.model.named_parameters()):
            assert torch.equal(a, b), n
    else:  # a tied parameter's accumulator on NVMe adds contributions as they arrive: last-bit rounding
        assert_parity(second.model, full.model, first.losses + second.losses, full.losses, tol=1e-6)
    t2.strategy.close()


def test_a_plain_lightning_checkpoint_restores_the_fp16_loss_scale(tmp_path):
    """Plain Lightning's 16-mixed ``.ckpt`` keeps the loss scale under ``MixedPrecision`` in GradScaler's format;
    the resumed run continues from it and ends with plain Lightning's scale, not the plugin's initial scale (8 here:
    weights 2e-2 off after 4 more steps)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin(init):
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init, growth_interval=2))

    model = make_model("llama")
    full, p_full = lm_for(model), plugin(2.0**20)
    trainer(8, strategy="auto", plugins=[p_full]).fit(full, loader())
    first = lm_for(model)
    t1 = trainer(4, strategy="auto", plugins=[plugin(2.0**20)])
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "plain.ckpt")
    second = lm_for(model)
    t2 = trainer(8, plugins=[plugin(8.0)])
    t2.fit(second, loader(), ckpt_path=tmp_path / "plain.ckpt")
    assert t2.precision_plugin.scale == p_full.scaler.get_scale() > 2.0**10  # not from the resumed plugin's 8
    for a, b in zip(first.losses + second.losses, full.losses):
        assert abs(a - b) <= 1e-3 * abs(b)


def test_a_plain_lightning_checkpoint_of_another_optimizer_is_refused(tmp_path):
    """An SGD state resumed into AdamW: plain Lightning fails with ``KeyError: 'step'``; the host optimizer trained
    on from zeroed moments without a word. Now a CheckpointError names the foreign state."""
    class SGDLM(LM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    first = SGDLM(copy.deepcopy(make_model("llama")))
    t1 = trainer(2, strategy="auto")
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="momentum_buffer: not Adam/AdamW state"):
        trainer(4).fit(lm_for(make_model("llama")), loader(), ckpt_path=tmp_path / "plain.ckpt")


def test_a_plain_lightning_checkpoint_of_another_model_is_refused_with_its_keys(tmp_path):
    lm = lm_for(make_model("llama"))
    t1 = trainer(1, strategy="auto")
    t1.fit(lm, loader())
    t1.save_checkpoint(tmp_path / "plain.ckpt")
    other = lm_for(make_model("llama", num_hidden_layers=4))
    with pytest.raises(CheckpointError, match=r"does not fit this module: missing keys model.model.layers.3.*"
                                              r"unexpected keys none"):
        trainer(2).fit(other, loader(), ckpt_path=tmp_path / "plain.ckpt")


def test_other_model_config_is_refused(tmp_path):
    lm = lm_for(make_model("llama"))
    t = trainer(1)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    other = lm_for(make_model("llama", num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="another model config"):
        trainer(2).fit(other, loader(), ckpt_path=tmp_path / "c")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_names_the_file(tmp_path, damage):
    lm = lm_for(make_model("llama"))
    t = trainer(1)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    shard = next((tmp_path / "c" / "optimizer").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        trainer(2).fit(lm_for(make_model("llama")), loader(), ckpt_path=tmp_path / "c")


def test_metadata_loads_without_pickle(tmp_path):
    from omegaconf import OmegaConf

    class HP(LM):
        def __init__(self, model):
            super().__init__(model)
            self.save_hyperparameters({"cfg": OmegaConf.create({"a": 1}), "arr": __import__("numpy").arange(3)})

    lm = HP(make_model("llama"))
    t = trainer(1)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    meta = torch.load(tmp_path / "c" / "trainer.pt", weights_only=True)
    assert meta["hyper_parameters"]["cfg"] == {"a": 1}
    assert "loops" in meta and "lr_schedulers" in meta


@pytest.mark.parametrize("arch", ["llama_tied", "gpt2", "gemma2"])
def test_streaming_load_from_pretrained_trains_like_from_pretrained(tmp_path, arch):
    """meta_model_from_pretrained + strategy: weights go from safetensors straight into the store;
    training matches plain PyTorch on the model transformers loads from the same directory."""
    from megatrain_lightning.testing import make_data, reference_train
    from megatrain_lightning.checkpoint.hf_io import meta_model_from_pretrained

    make_model(arch).save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded on purpose
    meta = meta_model_from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert all(p.is_meta for p in meta.parameters())
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    for name, p in ref.named_parameters():  # see test_parity: zero-gradient key biases are frozen
        if name.endswith("c_attn.bias"):
            p.requires_grad_(False)
            meta.get_parameter(name).requires_grad_(False)
    lm = LM(meta)
    pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(lm, make_data(n=10))
    ref_losses = reference_train(ref, make_data(n=10), 5)
    assert not any(p.is_meta for p in lm.parameters())
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_resizing_a_meta_model_is_refused_with_what_to_do(tmp_path):
    """``resize_token_embeddings`` on a ``meta_model_from_pretrained`` model gives embedding and head parameters
    the checkpoint has no weights for: setup refuses with the two shapes and the fix (resize a materialised model,
    or stream the resized model saved with ``save_pretrained``); that fix trains."""
    from megatrain_lightning.checkpoint.hf_io import meta_model_from_pretrained
    from megatrain_lightning.testing import make_data

    make_model("llama").save_pretrained(tmp_path / "hf")
    meta = meta_model_from_pretrained(tmp_path / "hf", attn_implementation="eager")
    meta.resize_token_embeddings(VOCAB + 4, mean_resizing=False)
    fit = dict(strategy="megatrain", accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError) as e:
        pl.Trainer(**fit).fit(LM(meta), make_data(n=4))
    msg = str(e.value)
    assert f"source tensor has shape ({VOCAB}, " in msg and f"parameter ({VOCAB + 4}, " in msg, msg
    assert "cannot be resized before fit" in msg
    assert "transformers.AutoModelForCausalLM.from_pretrained(path)" in msg
    assert "model.resize_token_embeddings(n), then fit it" in msg
    assert "save that resized model (save_pretrained) and stream it with meta_model_from_pretrained" in msg

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    model.resize_token_embeddings(VOCAB + 4, mean_resizing=False)
    model.save_pretrained(tmp_path / "resized")
    streamed = meta_model_from_pretrained(tmp_path / "resized", attn_implementation="eager")
    lm = LM(streamed)
    pl.Trainer(**fit).fit(lm, make_data(n=4))
    assert lm.model.get_input_embeddings().weight.shape[0] == VOCAB + 4 and len(lm.losses) == 1


# ----------------------------------------------------------------------------- what model/ and the export hold


def _assert_same_state(loaded: torch.nn.Module, trained: torch.nn.Module) -> None:
    """Every state_dict name and tensor of ``trained`` (tied and shared names included) in ``loaded``."""
    a, b = loaded.state_dict(), trained.state_dict()
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _gguf_dequantised():
    """What transformers' GGUF loader returns (tests/test_pretrained.py loads the real file): dense
    fp32 weights with a GgufConfig left on the config."""
    from transformers.utils.quantization_config import GgufConfig

    model = make_model("llama")
    model.config.quantization_config = GgufConfig()
    return model


def _shared_undeclared():
    model = make_model("llama")
    model.model.layers[2].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    return model


@pytest.mark.parametrize("build", [lambda: make_model("llama_tied"), _gguf_dequantised, _shared_undeclared],
                         ids=["tied", "gguf_config", "shared_undeclared"])
def test_trained_model_loads_back_with_from_pretrained_and_from_the_export(tmp_path, build):
    """The user's loaders (from_pretrained on model/ and on the export, resume) give back every
    tensor of the trained module, and the loaded model is a plain one transformers re-saves."""
    from megatrain_lightning.export import export

    lm = LM(build())
    t = trainer(2)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / "c")
    export(tmp_path / "c", tmp_path / "out", quiet=True)
    for d in (tmp_path / "c" / "model", tmp_path / "out"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(d)
        _assert_same_state(hf, lm.model)
        assert not getattr(hf, "is_quantized", False)
        hf.save_pretrained(tmp_path / "resaved" / d.name)  # refused by transformers for a "quantized" model
    again = LM(build())
    trainer(2).fit(again, loader(), ckpt_path=tmp_path / "c")  # max_steps reached: only restores
    _assert_same_state(again.model, lm.model)


# ----------------------------------------------------------------------------- megatrain.json and the parts


def _saved(tmp_path, name="c", steps=1):
    lm = lm_for(make_model("llama"))
    t = trainer(steps)
    t.fit(lm, loader())
    t.save_checkpoint(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("damage", ["not_json", "missing_field", "wrong_type", "edited"])
def test_damaged_megatrain_json_names_the_file_and_the_field(tmp_path, damage):
    ckpt = _saved(tmp_path)
    f = ckpt / "megatrain.json"
    info = json.loads(f.read_text())
    if damage == "not_json":
        f.write_text(f.read_text()[:40])
        match = "megatrain.json is damaged: not valid JSON"
    elif damage == "missing_field":
        del info["tensors"]
        f.write_text(json.dumps(info))
        match = "megatrain.json is damaged: the field 'tensors' is missing"
    elif damage == "wrong_type":
        info["params"] = ["model.lm_head.weight"]
        f.write_text(json.dumps(info))
        match = "megatrain.json is damaged: the field 'params' is a list"
    else:  # still valid JSON with every field: only the digest it records tells
        name = next(iter(info["params"]))
        info["params"][name]["requires_grad"] = not info["params"][name]["requires_grad"]
        f.write_text(json.dumps(info))
        match = "megatrain.json is damaged: its content does not match the sha256 recorded in it"
    with pytest.raises(CheckpointError, match=match):
        trainer(2).fit(lm_for(make_model("llama")), loader(), ckpt_path=ckpt)


@pytest.mark.parametrize("part", ["optimizer", "model", "trainer.pt"])
def test_part_copied_from_another_checkpoint_is_refused_by_name(tmp_path, part):
    """Each part is complete and consistent on its own; megatrain.json ties them to one save."""
    ckpt, other = _saved(tmp_path, "c", steps=2), _saved(tmp_path, "other", steps=1)
    if (ckpt / part).is_dir():
        shutil.rmtree(ckpt / part)
        shutil.copytree(other / part, ckpt / part)
    else:
        shutil.copyfile(other / part, ckpt / part)
    what = f"{part}/" if (ckpt / part).is_dir() else part
    with pytest.raises(CheckpointError, match=f"{re.escape(what)} does not belong to this checkpoint"):
        trainer(3).fit(lm_for(make_model("llama")), loader(), ckpt_path=ckpt)


def test_format1_checkpoint_still_resumes_and_is_not_converted(tmp_path):
    """Checkpoints written before megatrain.json recorded the key map and the part digests."""
    from megatrain_lightning.checkpoint.lightning_file import convert_to_lightning_checkpoint

    model = make_model("llama_tied")
    first = lm_for(model)
    t = trainer(2)
    t.fit(first, loader())
    t.save_checkpoint(tmp_path / "c")
    f = tmp_path / "c" / "megatrain.json"
    info = json.loads(f.read_text())
    f.write_text(json.dumps({"format": 1, "has_optimizer": info["has_optimizer"], "params": info["params"]}))
    again = lm_for(model)
    trainer(2).fit(again, loader(), ckpt_path=tmp_path / "c")
    _assert_same_state(again.model, first.model)
    with pytest.raises(CheckpointError, match="format 1.*save it again"):
        convert_to_lightning_checkpoint(tmp_path / "c", tmp_path / "c.ckpt")
