"""The GGUF dequantisation cache's mechanics (``checkpoint/gguf.py``): written whole or not at all, a damaged
entry replaced, an unwritable cache only warned about. The GGUF loader is replaced by a tiny Llama here; the
real SmolLM2 file's cached weights are compared bitwise with the dequantised ones in test_pretrained.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers

from megatrain_lightning.checkpoint import gguf as G
from megatrain_lightning.testing import make_model


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, gpt2_tok):
    """A file named like a GGUF, and transformers' loaders answering ``gguf_file=`` with one tiny Llama (and the
    GPT-2 tokenizer); returns ``(directory, filename, calls)`` where ``calls`` counts the GGUF loads."""
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    torch.manual_seed(0)
    model = make_model("llama")
    calls = []
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def model_loader(path, *a, gguf_file=None, **kw):
        if gguf_file is None:
            return real_model(path, *a, **kw)
        calls.append(gguf_file)
        return model

    def tok_loader(path, *a, gguf_file=None, **kw):
        return gpt2_tok if gguf_file is not None else real_tok(path, *a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_loader)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_loader)
    return d, "tiny.gguf", calls, model


def test_the_second_load_reads_the_cache_and_gives_the_same_model(tmp_path, fake_gguf):
    d, name, calls, model = fake_gguf
    m1, _ = G.load_gguf(d, name, cache_dir=tmp_path / "cache")
    m2, tok2 = G.load_gguf(d, name, cache_dir=tmp_path / "cache")
    assert calls == [name]  # dequantised once
    assert m2 is not model and tok2("hello world").input_ids == [31373, 995]
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
    # nothing but the finished entry is left in the cache folder
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [G.cache_entry(tmp_path / "cache", d / name).name]
    # a changed file is another entry (its size and time are in the key)
    (d / name).write_bytes(b"GGUF" + bytes(61))
    G.load_gguf(d, name, cache_dir=tmp_path / "cache")
    assert calls == [name, name] and len(list((tmp_path / "cache").iterdir())) == 2


def test_without_a_cache_dir_nothing_is_written(tmp_path, fake_gguf, monkeypatch):
    d, name, calls, _ = fake_gguf
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    G.load_gguf(d, name)
    G.load_gguf(d, name)
    assert calls == [name, name] and not (tmp_path / "home").exists()


def test_an_entry_without_its_complete_mark_or_damaged_is_replaced(tmp_path, fake_gguf, caplog):
    d, name, calls, _ = fake_gguf
    entry = G.cache_entry(tmp_path / "cache", d / name)
    G.load_gguf(d, name, cache_dir=tmp_path / "cache")
    (entry / G.COMPLETE_MARK).unlink()  # e.g. killed before the mark: not used
    G.load_gguf(d, name, cache_dir=tmp_path / "cache")
    assert len(calls) == 2 and (entry / G.COMPLETE_MARK).is_file()
    (entry / "model.safetensors").write_bytes(b"not safetensors")  # damaged after it was written
    with caplog.at_level(logging.WARNING):
        m, _ = G.load_gguf(d, name, cache_dir=tmp_path / "cache")
    assert len(calls) == 3 and "could not be loaded" in caplog.text and "dequantising" in caplog.text
    back, _ = G.load_gguf(d, name, cache_dir=tmp_path / "cache")  # the entry was written again
    assert len(calls) == 3
    for (n, a), (_, b) in zip(m.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), n


def test_an_unwritable_cache_is_a_warning_not_an_error(tmp_path, fake_gguf, caplog):
    d, name, calls, model = fake_gguf
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING):
        m, _ = G.load_gguf(d, name, cache_dir=blocker)
    assert m is model and "Could not cache the dequantised GGUF weights" in caplog.text
    assert blocker.read_text().startswith("a file")
