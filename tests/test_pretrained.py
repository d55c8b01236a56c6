"""The real SmolLM2-135M (GGUF, DATA.md) loads into the strategy and fine-tunes on real text."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import megatrain_lightning  # noqa: F401
from megatrain_lightning.checkpoint.gguf import COMPLETE_MARK, SMOLLM2_GGUF, cache_entry, load_gguf, smollm2_gguf_dir
from megatrain_lightning.testing import LM


def license_text() -> str:
    texts = sorted(Path("/usr/share/common-licenses").glob("*"))
    if texts:
        return "\n".join(p.read_text(errors="replace") for p in texts if p.is_file())[:20000]
    import torch.nn as nn  # any real English text on every machine: a stdlib module docstring

    return nn.Module.__doc__ * 20


def test_smollm2_gguf_finetunes_a_few_steps(tmp_path, monkeypatch):
    model, tok = load_gguf(smollm2_gguf_dir(), SMOLLM2_GGUF, attn_implementation="sdpa", cache_dir=tmp_path / "c")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # the dequantised weights were cached: the next load reads them (the GGUF loader is not called) and gives the
    # same fp32 tensors and the same tokenizer
    entry = cache_entry(tmp_path / "c", smollm2_gguf_dir() / SMOLLM2_GGUF)
    assert (entry / COMPLETE_MARK).is_file() and (entry / "model.safetensors").is_file()
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def no_gguf(*a, **kw):
        assert "gguf_file" not in kw, "the cached weights were not used"
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    cached, cached_tok = load_gguf(smollm2_gguf_dir(), SMOLLM2_GGUF, attn_implementation="sdpa",
                                   cache_dir=tmp_path / "c")
    monkeypatch.undo()
    assert getattr(cached.config, "quantization_config", None) is None  # dense weights, said so
    ref = dict(model.named_parameters())
    assert [n for n, _ in cached.named_parameters()] == list(ref)
    for n, p in cached.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, ref[n]), n
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    assert cached_tok(license_text()[:2000]).input_ids == tok(license_text()[:2000]).input_ids
    assert (cached_tok.chat_template, cached_tok.eos_token, cached_tok.bos_token) == (
        tok.chat_template, tok.eos_token, tok.bos_token)
    del cached
    ids = tok(license_text(), return_tensors="pt").input_ids[0]
    seq = 64
    chunks = ids[: (ids.numel() // seq) * seq].view(-1, seq)[:4]
    lm = LM(model, lr=1e-4)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, DataLoader(TensorDataset(chunks[:1].repeat(4, 1)), batch_size=1))
    # a pretrained model on real English: low initial loss, and it falls when fitting one chunk
    assert lm.losses[0] < 4.0, lm.losses
    assert lm.losses[-1] < lm.losses[0]
    trainer.save_checkpoint(tmp_path / "ck")
    import transformers

    # transformers' GGUF loader leaves quantization_config=gguf on the dequantised model; the checkpoint
    # holds dense weights, so its config must not say quantized (or transformers refuses to re-save it)
    assert model.config.quantization_config is not None
    assert "quantization_config" not in json.loads((tmp_path / "ck" / "model" / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "model")
    assert not getattr(back, "is_quantized", False)
    for (n, a), (_, b) in zip(back.named_parameters(), lm.model.named_parameters()):
        assert torch.equal(a, b), n
    back.save_pretrained(tmp_path / "resaved")
    prompt = tok("Permission is hereby granted", return_tensors="pt").input_ids
    out = back.generate(prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + 8
