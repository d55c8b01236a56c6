"""Hugging Face model directories: our reader/writer against transformers' own
from_pretrained / save_pretrained, checksums, and the export CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatrain_lightning.checkpoint.hf_io import (CheckpointFormatError, SafetensorsSource,
                                                  meta_model_from_pretrained, save_hf_model_dir, source_key,
                                                  verify_checksums, write_safetensors_shards)
from megatrain_lightning.export import export
from megatrain_lightning.testing import make_model

ROOT = Path(__file__).resolve().parents[1]


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def _tiny_tokenizer():
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _shards(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".safetensors")


# ----------------------------------------------------------------------------- save_hf_model_dir


@pytest.mark.parametrize("arch", ["llama_tied", "gpt2", "llama"])
def test_save_hf_model_dir_round_trips_through_from_pretrained(tmp_path, arch):
    model = make_model(arch)
    save_hf_model_dir(tmp_path, model, tokenizer=_tiny_tokenizer())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_state(model, loaded)
    on_disk = load_file(tmp_path / "model.safetensors")
    if model.config.tie_word_embeddings:  # the tied duplicate is not written, and is tied again on load
        assert "lm_head.weight" not in on_disk
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    else:
        assert "lm_head.weight" in on_disk
    # same tensor names as transformers' own save_pretrained writes
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    assert on_disk.keys() == load_file(ref / "model.safetensors").keys()
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(model).__name__]
    assert transformers.AutoTokenizer.from_pretrained(tmp_path)("hello world").input_ids == [1, 2]
    sums = verify_checksums(tmp_path)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= sums.keys()


def test_sharded_write_loads_and_respects_the_shard_limit(tmp_path):
    model = make_model("llama")
    limit = 20_000
    index = save_hf_model_dir(tmp_path, model, max_shard_bytes=limit)
    files = _shards(tmp_path)
    assert len(files) > 2
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left
    on_disk = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert on_disk == index
    sd = model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    for f in files:
        tensors = load_file(tmp_path / f)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, f
        assert all(index["weight_map"][k] == f for k in tensors)
    _assert_same_state(model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    verify_checksums(tmp_path)


def test_write_shards_views_of_one_slab_and_integer_tensors(tmp_path):
    """What the strategy passes: non-contiguous views of a shared host slab, plus 0-dim step counters."""
    slab = torch.randn(4 * 6 + 5)
    items = [("a", slab[:24].view(4, 6).t()), ("b", slab[24:]), ("step", torch.tensor(7, dtype=torch.int64))]
    write_safetensors_shards(tmp_path, iter(items), dtype="bf16", max_shard_bytes=40)
    src = SafetensorsSource(tmp_path)
    assert torch.equal(src.get("a"), items[0][1].to(torch.bfloat16))
    assert torch.equal(src.get("b"), items[1][1].to(torch.bfloat16))
    assert src.get("step").dtype == torch.int64 and src.get("step").item() == 7
    verify_checksums(tmp_path)
    with pytest.raises(FileExistsError, match="already holds weight files"):
        write_safetensors_shards(tmp_path, iter(items))


def test_write_shards_with_no_tensors_gives_a_readable_empty_file(tmp_path):
    index = write_safetensors_shards(tmp_path, iter([]))
    assert index["weight_map"] == {} and SafetensorsSource(tmp_path).keys() == []


def _gguf_dequantised(arch: str = "llama") -> transformers.PreTrainedModel:
    """What transformers' GGUF loader returns (see tests/test_pretrained.py, the real file): dense fp32
    weights, yet ``config.quantization_config`` is a GgufConfig."""
    from transformers.utils.quantization_config import GgufConfig

    model = make_model(arch)
    model.config.quantization_config = GgufConfig()
    return model


def _loads_as_dense_and_resaves(d: Path, reference: torch.nn.Module, tmp: Path) -> None:
    """The user's way: from_pretrained gives a plain model equal to ``reference``, and save_pretrained works."""
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert not getattr(loaded, "is_quantized", False) and getattr(loaded, "hf_quantizer", None) is None
    _assert_same_state(reference, loaded)
    loaded.save_pretrained(tmp)  # transformers refuses this for a model it believes quantized
    _assert_same_state(reference, transformers.AutoModelForCausalLM.from_pretrained(tmp))


def test_dense_weights_are_written_without_the_gguf_quantization_config(tmp_path):
    model = _gguf_dequantised()
    save_hf_model_dir(tmp_path / "d", model)
    _loads_as_dense_and_resaves(tmp_path / "d", model, tmp_path / "resaved")
    assert model.config.quantization_config is not None  # the model's own config is left alone


def test_export_drops_the_gguf_quantization_config_of_an_older_directory(tmp_path):
    model = _gguf_dequantised()
    old = tmp_path / "old"
    save_hf_model_dir(old, model)
    cfg = json.loads((old / "config.json").read_text())  # as directories written before the fix were
    cfg["quantization_config"] = model.config.quantization_config.to_dict()
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "checksums.json").unlink()
    export(old, tmp_path / "out", quiet=True)
    _loads_as_dense_and_resaves(tmp_path / "out", model, tmp_path / "resaved")


def test_really_quantized_model_is_refused_before_writing(tmp_path):
    model = make_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    model.model.layers[0].mlp.up_proj.register_buffer("SCB", torch.zeros(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="quantized \\(bitsandbytes\\).*SCB.*dequantize"):
        save_hf_model_dir(tmp_path / "d", model)
    assert not (tmp_path / "d").exists()


def test_undeclared_shared_weight_is_written_under_every_name(tmp_path, caplog, monkeypatch):
    """transformers' save_pretrained refuses this model; dropping the second name would make
    from_pretrained initialise it at random. Both names are written, with a warning."""
    from megatrain_lightning.checkpoint import hf_names

    monkeypatch.setattr(hf_names, "_warned", set())  # the warning comes once per process; earlier tests saw it
    model = make_model("llama")
    model.model.layers[2].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    with caplog.at_level("WARNING"):
        save_hf_model_dir(tmp_path, model, max_shard_bytes=10**9)
    assert "model.layers.0.mlp.up_proj.weight and model.layers.2.mlp.up_proj.weight" in caplog.text
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_state(model, loaded)  # every name, the shared one included
    on_disk = load_file(tmp_path / "model.safetensors")  # one shard: the alias was copied for safetensors
    assert torch.equal(on_disk["model.layers.2.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)


# ----------------------------------------------------------------------------- SafetensorsSource


@pytest.mark.parametrize("max_shard_size", [None, "20KB"])
def test_source_reads_directories_written_by_save_pretrained(tmp_path, max_shard_size):
    model = make_model("llama_tied")
    model.save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    src = SafetensorsSource(tmp_path)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size is not None)
    sd = model.state_dict()
    assert set(src.keys()) == set(sd) - {"lm_head.weight"}
    for k in src.keys():
        t = src.get(k)
        assert src.shape(k) == t.shape == sd[k].shape and src.dtype(k) == t.dtype == sd[k].dtype
        assert torch.equal(t, sd[k])
    assert src.has("model.norm.weight") and not src.has("lm_head.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        src.get("model.norm.weigth")
    one = src.file_of("model.norm.weight")
    assert SafetensorsSource(one).get("model.norm.weight").equal(sd["model.norm.weight"])


def test_source_reads_bf16_as_stored(tmp_path):
    model = make_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    src = SafetensorsSource(tmp_path)
    assert src.dtype("model.norm.weight") == torch.bfloat16
    assert torch.equal(src.get("lm_head.weight"), model.lm_head.weight)


def test_source_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*model.safetensors"):
        SafetensorsSource(tmp_path / "nope")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="pickle"):
        SafetensorsSource(tmp_path)

    d = tmp_path / "sharded"
    make_model("llama").save_pretrained(d, max_shard_size="20KB")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.rename(d / "gone")
    with pytest.raises(FileNotFoundError, match=victim.name):
        SafetensorsSource(d)
    (d / "gone").rename(victim)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 10)
    with pytest.raises(CheckpointFormatError, match=victim.name):
        SafetensorsSource(d)


# ----------------------------------------------------------------------------- meta model


@pytest.mark.parametrize("arch", ["llama_tied", "gpt2", "llama", "gemma2"])
def test_meta_model_resolves_every_parameter(tmp_path, arch):
    model = make_model(arch)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    meta = meta_model_from_pretrained(tmp_path, attn_implementation="eager")
    assert type(meta) is type(model)
    assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in meta.parameters())
    src, ref = meta._megatrain_source, model.state_dict()
    names = [n for n, _ in meta.named_parameters(remove_duplicate=False)]
    assert names == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    for name, p in meta.named_parameters(remove_duplicate=False):
        t = src.get(source_key(meta, name))
        assert t.shape == p.shape and torch.equal(t, ref[name]), name
    if model.config.tie_word_embeddings:
        assert source_key(meta, "lm_head.weight") == source_key(meta, names[0])


def test_meta_model_accepts_checkpoints_without_the_base_model_prefix(tmp_path):
    """A checkpoint of the bare LlamaModel (keys without 'model.') loads into LlamaForCausalLM when tied."""
    model = make_model("llama_tied")
    save_hf_model_dir(tmp_path, model, named_tensors=((k.removeprefix("model."), v)
                                                      for k, v in model.model.state_dict().items()))
    meta = meta_model_from_pretrained(tmp_path)
    assert source_key(meta, "model.embed_tokens.weight") == "embed_tokens.weight"
    assert source_key(meta, "lm_head.weight") == "embed_tokens.weight"
    assert torch.equal(meta._megatrain_source.get(source_key(meta, "model.layers.1.mlp.up_proj.weight")),
                       model.model.layers[1].mlp.up_proj.weight)


def test_meta_model_reports_missing_and_fused_parameters(tmp_path):
    model = make_model("llama")
    drop = "model.layers.1.self_attn.k_proj.weight"
    save_hf_model_dir(tmp_path / "a", model, named_tensors=((k, v) for k, v in model.state_dict().items() if k != drop))
    with pytest.raises(ValueError, match=drop):
        meta_model_from_pretrained(tmp_path / "a")
    # transformers saves Mixtral experts one tensor per expert and fuses them on load
    mixtral = make_model("mixtral")
    mixtral.save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match="gate_up_proj.*several checkpoint tensors"):
        meta_model_from_pretrained(tmp_path / "b")
    save_hf_model_dir(tmp_path / "c", mixtral)  # our own writer keeps the fused names: streams fine
    meta = meta_model_from_pretrained(tmp_path / "c")
    assert torch.equal(meta._megatrain_source.get(source_key(meta, "model.layers.0.mlp.experts.gate_up_proj")),
                       mixtral.model.layers[0].mlp.experts.gate_up_proj)


def test_meta_model_path_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        meta_model_from_pretrained(str(tmp_path / "missing" / "dir"))

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OSError, match="unreachable.*local directory"):
        meta_model_from_pretrained("some-org/some-model")


def test_source_key_without_a_source_follows_ties():
    model = make_model("llama_tied")
    assert source_key(model, "lm_head.weight") == "model.embed_tokens.weight"
    assert source_key(model, "model.norm.weight") == "model.norm.weight"
    with pytest.raises(KeyError, match="model.norm.weight"):
        source_key(model, "model.norm.weigth")


# ----------------------------------------------------------------------------- checksums


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 7)
    else:  # flip one byte of tensor data, size unchanged
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "corrupted"])
def test_checksums_name_the_damaged_shard(tmp_path, how):
    save_hf_model_dir(tmp_path, make_model("llama"), max_shard_bytes=20_000)
    verify_checksums(tmp_path)
    victim = tmp_path / _shards(tmp_path)[2]
    _damage(victim, how)
    with pytest.raises(ValueError, match=f"{victim.name}: {how}"):
        verify_checksums(tmp_path)


def test_checksums_report_a_missing_file(tmp_path):
    save_hf_model_dir(tmp_path, make_model("gpt2"))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json: missing"):
        verify_checksums(tmp_path)


# ----------------------------------------------------------------------------- export


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain_lightning.export", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_export_cli_bf16(tmp_path):
    model = make_model("llama_tied")
    ckpt = tmp_path / "epoch=0-step=1.ckpt"
    save_hf_model_dir(ckpt / "model", model, max_shard_bytes=20_000, tokenizer=_tiny_tokenizer())
    out = tmp_path / "out"
    res = _cli(str(ckpt), str(out), "--dtype", "bf16", "--max-shard-bytes", "15000")
    assert res.returncode == 0, res.stderr
    assert "exported" in res.stdout and "tensors" in res.stdout and len(res.stdout.strip().splitlines()) == 1
    src = SafetensorsSource(out)
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        assert src.dtype(k) == torch.bfloat16
        assert torch.equal(src.get(k), v.to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    _assert_same_state(model.to(torch.bfloat16), loaded)
    assert transformers.AutoTokenizer.from_pretrained(out)("world hello").input_ids == [2, 1]
    verify_checksums(out)


def test_export_refuses_a_ckpt_file(tmp_path):
    f = tmp_path / "last.ckpt"
    f.write_bytes(b"PK\x03\x04 not for us")
    res = _cli(str(f), str(tmp_path / "out"))
    assert res.returncode == 2
    assert "strategy='megatrain'" in res.stderr and "save_pretrained" in res.stderr
    assert not (tmp_path / "out").exists()


def test_export_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export(tmp_path / "nope", tmp_path / "out")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        export(tmp_path, tmp_path / "out")
    save_hf_model_dir(tmp_path / "hf", make_model("gpt2"))
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        export(tmp_path / "hf", tmp_path / "out", dtype="int8")
    _damage(tmp_path / "hf" / "model.safetensors", "corrupted")
    with pytest.raises(ValueError, match="model.safetensors: corrupted"):
        export(tmp_path / "hf", tmp_path / "out")
