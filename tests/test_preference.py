"""Preference fine-tuning (DPO, IPO, SimPO) through ``strategy="megatrain"`` against a plain PyTorch DPO loop.

The reference loop is written here from the papers' formulas: the policy and a frozen deep copy of the starting
model (eval mode) score the response tokens with ``cross_entropy``; ``torch.optim.AdamW``, accumulation 2 and
norm clipping as Lightning runs them."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import lightning.pytorch as pl
import peft
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import megatrain_lightning  # noqa: F401  (registers the strategy)
from megatrain_lightning.data import ResumableDataLoader
from megatrain_lightning.preference import (DPOModule, chunked_sequence_logps, PreferenceDataError, PreferenceDataset, collate_pairs,
                                            encode_pair)
from megatrain_lightning.testing import VOCAB, freeze_key_biases, make_model, rel

LR, BETA, GAMMA, ACC, CLIP, STEPS = 1e-3, 0.1, 0.5, 2, 1.0, 10


class Pairs(Dataset):
    """Random token pairs: prompts of 2-5 tokens, responses of 1-6 (already encoded, with an ``index``)."""

    def __init__(self, n: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        draw = lambda lo, hi: torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),  # noqa: E731
                                            generator=g).tolist()
        self.items = [{"prompt": draw(2, 6), "chosen": draw(1, 7), "rejected": draw(1, 7)} for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"index": i, **self.items[i]}


def loader(n: int = 8) -> DataLoader:
    """Batches of 2 pairs in order; the recipes' ``ResumableDataLoader``, so that a resume continues mid-epoch."""
    return ResumableDataLoader(Pairs(n), batch_size=2, shuffle=False, collate_fn=collate_pairs)


def plain_logps(model, ids, mask, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs as TRL takes them (``selective_log_softmax``: log_softmax, then the label's
    entry), and the response lengths."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    picked = torch.log_softmax(logits, -1).gather(-1, target.masked_fill(~keep, 0)[..., None])[..., 0]
    return (picked * keep).sum(-1), keep.sum(-1)


def plain_dpo(model, data, loss_type: str, steps: int = STEPS, sft_weight: float = 0.0) -> tuple[list[float], list[float]]:
    """Train ``model`` in place with plain PyTorch; returns every micro-batch's loss and reward margin. With
    ``sft_weight``, the chosen tokens' mean negative log-likelihood is added with that weight (TRL's "sft" term)."""
    ref = copy.deepcopy(model).requires_grad_(False).eval()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.999),
                            weight_decay=0.0)
    losses, margins, done, micro, it = [], [], 0, 0, iter(data)
    model.train()
    while done < steps:
        try:
            b = next(it)
        except StopIteration:
            it = iter(data)
            b = next(it)
        ids = torch.cat([b["chosen_input_ids"], b["rejected_input_ids"]])
        mask = torch.cat([b["chosen_attention_mask"], b["rejected_attention_mask"]])
        labels = torch.cat([b["chosen_labels"], b["rejected_labels"]])
        (pc, pr), (nc, nr) = (t.chunk(2) for t in plain_logps(model, ids, mask, labels))
        with torch.no_grad():
            rc, rr = plain_logps(ref, ids, mask, labels)[0].chunk(2)
        if loss_type == "sigmoid":  # Rafailov et al. 2023, eq. 7
            c, r = BETA * (pc - rc), BETA * (pr - rr)
            loss = -F.logsigmoid(c - r).mean()
        elif loss_type == "ipo":  # Azar et al. 2023, eq. 17, per-token log-ratios as TRL
            c, r = BETA * (pc - rc), BETA * (pr - rr)
            loss = (((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * BETA)) ** 2).mean()
        else:  # SimPO, Meng et al. 2024, eq. 6
            c, r = BETA * pc / nc, BETA * pr / nr
            loss = -F.logsigmoid(c - r - GAMMA).mean()
        if sft_weight:
            loss = loss + sft_weight * -(pc.sum() / nc.sum())
        losses.append(loss.item())
        margins.append((c - r).mean().item())
        (loss / ACC).backward()
        micro += 1
        if micro == ACC:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            micro, done = 0, done + 1
    return losses, margins


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses, self.margins = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]) * ACC)  # Lightning returns the loss divided for accumulation
        self.margins.append(float(trainer.callback_metrics["rewards/margins"]))


def megatrain_dpo(model, data, loss_type: str, reference, tmp_path, steps: int = STEPS, sft_weight: float = 0.0,
                  **trainer_kw):
    module = DPOModule(model, loss_type=loss_type, beta=BETA, gamma=GAMMA, reference=reference, lr=LR,
                       cache_dir=tmp_path / "cache", sft_weight=sft_weight)
    rec = Record()
    kw = dict(strategy="megatrain", accelerator="cpu", devices=1, max_steps=steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              accumulate_grad_batches=ACC, gradient_clip_val=CLIP, callbacks=[rec])
    kw.update(trainer_kw)
    trainer = pl.Trainer(**kw)
    trainer.fit(module, data)
    return module, rec


def assert_close(got: list[float], want: list[float], what: str, tol: float = 1e-6, scale: float = 0.0) -> None:
    """Each value within ``tol`` relative of the plain one, or ``tol * scale`` absolute (a reward margin is a
    difference of rewards of size ``scale``: cancellation leaves it a larger relative error)."""
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= tol * max(abs(b), scale), f"{what} {i}: {a} vs plain {b}"


def assert_weights(model, plain, tol: float = 1e-6, per_tensor: float | None = 1e-4) -> None:
    """All weights within ``tol`` relative (as one vector), and each tensor within ``per_tensor``: a small bias
    vector carries the summation-order differences of a block-wise backward as a larger relative error (GPT-2's
    ``c_fc.bias`` up to 1.3e-5 after 10 steps), while a tensor left out of an update is off by 1e-2 or more."""
    got, want = dict(model.named_parameters()), dict(plain.named_parameters())
    assert got.keys() == want.keys()
    flat = lambda d: torch.cat([d[k].detach().reshape(-1) for k in sorted(d)])  # noqa: E731
    assert rel(flat(got), flat(want)) <= tol, f"relative weight error {rel(flat(got), flat(want)):.3e}"
    for k in want:
        r = rel(got[k].detach(), want[k].detach())
        assert r <= (tol if per_tensor is None else per_tensor), f"{k}: relative weight error {r:.3e}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_each_loss_matches_a_plain_pytorch_loop(tmp_path, arch, loss_type):
    model = make_model(arch)
    freeze_key_biases(model)  # their true gradient is zero: rounding noise, amplified by Adam, cannot be compared
    plain = copy.deepcopy(model)
    want_losses, want_margins = plain_dpo(plain, loader(), loss_type)
    reference = None if loss_type == "simpo" else "precompute"
    _, rec = megatrain_dpo(model, loader(), loss_type, reference, tmp_path)
    assert_close(rec.losses, want_losses, "loss")
    assert_close(rec.margins, want_margins, "reward margin", scale=1.0)  # rewards: beta x |log p| of about 1-3
    assert_weights(model, plain)


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_the_sft_term_matches_a_plain_pytorch_loop(tmp_path, loss_type):
    """``sft_weight``: the chosen responses' negative log-likelihood added to the preference loss, as the plain
    loop adds it."""
    model = make_model("llama")
    freeze_key_biases(model)
    plain = copy.deepcopy(model)
    want_losses, want_margins = plain_dpo(plain, loader(), loss_type, sft_weight=0.7)
    reference = None if loss_type == "simpo" else "precompute"
    _, rec = megatrain_dpo(model, loader(), loss_type, reference, tmp_path, sft_weight=0.7)
    assert_close(rec.losses, want_losses, "loss")
    assert_close(rec.margins, want_margins, "reward margin", scale=1.0)
    assert_weights(model, plain)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chunked_log_probs_match_plain_with_full_logits(tmp_path, arch):
    """``logps_chunk_size=3``: the head and log-softmax over chunks of 3 positions, never the full logits."""
    model = make_model(arch)
    freeze_key_biases(model)
    plain = copy.deepcopy(model)
    want_losses, want_margins = plain_dpo(plain, loader(), "sigmoid", steps=4)
    module = DPOModule(model, loss_type="sigmoid", beta=BETA, reference="copy", lr=LR, logps_chunk_size=3)
    rec = Record()
    pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACC,
               gradient_clip_val=CLIP, callbacks=[rec]).fit(module, loader())
    assert_close(rec.losses, want_losses, "loss")
    assert_close(rec.margins, want_margins, "reward margin", scale=1.0)
    assert_weights(model, plain)


def test_chunked_log_probs_refuse_soft_capped_logits():
    with pytest.raises(ValueError, match="soft-caps or scales its logits"):
        chunked_sequence_logps(make_model("gemma2"), torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4),
                               torch.ones(1, 4, dtype=torch.long), 2)


def _validated(reference: str, tmp_path, val_seed: int = 7) -> dict[str, float]:
    """Two optimizer steps on 8 pairs, then ``trainer.validate`` on 6 other pairs (the fit's validation data)."""
    torch.manual_seed(0)
    module = DPOModule(make_model("llama"), loss_type="sigmoid", beta=BETA, reference=reference, lr=LR,
                       cache_dir=tmp_path / "cache")
    val = ResumableDataLoader(Pairs(6, seed=val_seed), batch_size=2, shuffle=False, collate_fn=collate_pairs)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)  # 2 of 4 batches: the epoch, and its validation, do not end
    trainer.fit(module, loader(), val)
    return {**trainer.validate(module, val, verbose=False)[0], "_trainer": trainer, "_module": module}


def test_validation_with_precomputed_reference_scores_the_validation_pairs(tmp_path):
    """The precomputed reference covers the validation pairs too (their own table, not the training pairs' rows of
    the same index): validation metrics after ``fit`` equal those of a ``"copy"`` reference; validating other
    data than the fit's is refused, naming the fix."""
    pre, cp = _validated("precompute", tmp_path / "a"), _validated("copy", tmp_path / "b")
    for key in ("val_loss", "val_rewards/margins", "val_rewards/chosen", "val_rewards/rejected"):
        assert abs(pre[key] - cp[key]) <= 1e-6 * max(1.0, abs(cp[key])), (key, pre[key], cp[key])
    other = ResumableDataLoader(Pairs(6, seed=9), batch_size=2, shuffle=False, collate_fn=collate_pairs)
    with pytest.raises(RuntimeError, match="validation data other than the fit's"):
        pre["_trainer"].validate(pre["_module"], other, verbose=False)


def test_copy_reference_matches_plain(tmp_path):
    model = make_model("llama")
    plain = copy.deepcopy(model)
    want_losses, _ = plain_dpo(plain, loader(), "sigmoid", steps=4)
    _, rec = megatrain_dpo(model, loader(), "sigmoid", "copy", tmp_path, steps=4)
    assert_close(rec.losses, want_losses, "loss")
    assert_weights(model, plain)


def lora_model():
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(make_model("llama"), config)
    torch.manual_seed(3)
    for n, p in model.named_parameters():  # non-zero B: the adapter changes the outputs from the first step
        if "lora_B" in n:
            p.data.normal_(0, 0.02)
    return model


def test_adapter_reference_is_the_model_without_its_adapter(tmp_path):
    """``"adapter"`` scores with the adapter disabled; ``"copy"`` of the base model gives the same reference, so
    training a peft model with either gives the same numbers."""
    base = lora_model()
    with_copy = copy.deepcopy(base)
    _, rec_adapter = megatrain_dpo(base, loader(), "sigmoid", "adapter", tmp_path, steps=3)
    # the copy reference must be the model without its adapter: copy that, train the adapted one
    module = DPOModule(with_copy, loss_type="sigmoid", beta=BETA, reference="copy", lr=LR)
    with torch.no_grad():
        merged = copy.deepcopy(with_copy)
        for n, p in merged.named_parameters():
            if "lora_B" in n:
                p.zero_()
    module.reference_model = merged.requires_grad_(False).eval()
    rec = Record()
    pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACC,
               gradient_clip_val=CLIP, callbacks=[rec]).fit(module, loader())
    assert_close(rec_adapter.losses, rec.losses, "loss")
    assert_weights(base, with_copy)


def test_precompute_cache_is_reused_and_keyed_by_the_data(tmp_path):
    model = make_model("llama")
    megatrain_dpo(copy.deepcopy(model), loader(), "sigmoid", "precompute", tmp_path, steps=1)
    files = sorted((tmp_path / "cache").glob("*.pt"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    megatrain_dpo(copy.deepcopy(model), loader(), "sigmoid", "precompute", tmp_path, steps=1)
    assert files[0].stat().st_mtime_ns == stamp  # loaded, not written again
    megatrain_dpo(copy.deepcopy(model), loader(6), "sigmoid", "precompute", tmp_path, steps=1)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2  # other data: another key


RESUME_KW = dict(strategy="megatrain", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                 enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACC,
                 gradient_clip_val=CLIP)


def test_resume_equals_uninterrupted(tmp_path):
    """Save after 3 steps (mid-epoch), resume to 6: the same losses and weights as 6 steps in one run (the
    precomputed reference is loaded again from the starting weights' cache)."""
    model = make_model("llama")
    whole = copy.deepcopy(model)
    _, full = megatrain_dpo(whole, loader(), "sigmoid", "precompute", tmp_path, steps=6)
    first_model = copy.deepcopy(model)
    first = DPOModule(first_model, loss_type="sigmoid", beta=BETA, reference="precompute", lr=LR,
                      cache_dir=tmp_path / "cache")
    rec1, rec2 = Record(), Record()
    t1 = pl.Trainer(max_steps=3, callbacks=[rec1], **RESUME_KW)
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "ckpt")
    resumed = copy.deepcopy(model)
    second = DPOModule(resumed, loss_type="sigmoid", beta=BETA, reference="precompute", lr=LR,
                       cache_dir=tmp_path / "cache")
    pl.Trainer(max_steps=6, callbacks=[rec2], **RESUME_KW).fit(second, loader(), ckpt_path=tmp_path / "ckpt")
    assert rec1.losses + rec2.losses == full.losses
    assert_weights(resumed, whole, tol=0.0, per_tensor=None)


def test_copy_reference_checkpoint_holds_the_policy_as_a_hugging_face_directory(tmp_path):
    """With ``reference="copy"`` the module holds two Hugging Face models: the checkpoint's ``model/`` is the
    trained policy (``from_pretrained`` loads it bit for bit), the frozen copy goes to ``extra/``, and resuming
    from it equals the uninterrupted run (the reference stays the starting weights)."""
    from transformers import AutoModelForCausalLM

    model = make_model("llama")
    whole = copy.deepcopy(model)
    _, full = megatrain_dpo(whole, loader(), "sigmoid", "copy", tmp_path, steps=6)
    first = DPOModule(copy.deepcopy(model), loss_type="sigmoid", beta=BETA, reference="copy", lr=LR)
    rec1, rec2 = Record(), Record()
    t1 = pl.Trainer(max_steps=3, callbacks=[rec1], **RESUME_KW)
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert_weights(loaded, first.model, tol=0.0, per_tensor=None)
    assert (tmp_path / "ckpt" / "extra").is_dir()
    resumed = copy.deepcopy(model)
    second = DPOModule(resumed, loss_type="sigmoid", beta=BETA, reference="copy", lr=LR)
    pl.Trainer(max_steps=6, callbacks=[rec2], **RESUME_KW).fit(second, loader(), ckpt_path=tmp_path / "ckpt")
    assert rec1.losses + rec2.losses == full.losses
    assert_weights(resumed, whole, tol=0.0, per_tensor=None)
    assert_weights(second.reference_model, model, tol=0.0, per_tensor=None)


def test_nvme_tier_matches_plain(tmp_path):
    model = make_model("llama")
    plain = copy.deepcopy(model)
    want_losses, _ = plain_dpo(plain, loader(), "sigmoid", steps=3)
    from megatrain_lightning import MegaTrainStrategy
    (tmp_path / "nvme").mkdir()
    strategy = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path / "nvme"))
    _, rec = megatrain_dpo(model, loader(), "sigmoid", "precompute", tmp_path, steps=3, strategy=strategy)
    assert_close(rec.losses, want_losses, "loss")
    assert_weights(model, plain)


# ----------------------------------------------------------------------------------- bad input, before any work


class Tok:
    """A whitespace tokenizer with the parts of the Hugging Face interface the encoder uses."""
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [3 + len(w) for w in text.split()]}


@pytest.mark.parametrize("record, message", [
    ({"prompt": "a b", "chosen": "c"}, "needs the fields"),
    ({"prompt": "a b", "chosen": " ", "rejected": "d"}, "'chosen' response is empty"),
    ({"prompt": "a b c d e f g h", "chosen": "c", "rejected": "d"}, "no response token fits"),
    ({"prompt": 3, "chosen": "c", "rejected": "d"}, "must be a string or a list"),
])
def test_bad_records_are_refused_naming_the_record(record, message):
    with pytest.raises(PreferenceDataError, match=message) as err:
        PreferenceDataset([{"prompt": "x", "chosen": "y", "rejected": "z"}, record], Tok(), max_length=6)
    assert "record 1" in str(err.value)


def test_encoding_masks_the_prompt_and_ends_responses_with_eos():
    item = encode_pair({"prompt": "aa b", "chosen": "ccc", "rejected": "d ee"}, Tok(), max_length=16)
    assert item == {"prompt": [1, 5, 4], "chosen": [6, 2], "rejected": [4, 5, 2]}
    batch = collate_pairs([{"index": 0, **item}])
    assert batch["chosen_labels"].tolist() == [[-100, -100, -100, 6, 2, -100]]
    assert batch["rejected_input_ids"].tolist() == [[1, 5, 4, 4, 5, 2]]


@pytest.mark.parametrize("kw, message", [
    (dict(loss_type="kto"), "loss_type must be one of"),
    (dict(beta=0.0), "beta must be > 0"),
    (dict(loss_type="simpo", reference="copy"), "uses no reference model"),
    (dict(reference=None), "compares against a reference model"),
    (dict(reference="adapter"), "has no peft adapter"),
    (dict(reference="frozen"), "reference must be one of"),
    (dict(logps_chunk_size=0), "logps_chunk_size must be a positive int"),
    (dict(sft_weight=-0.5), "sft_weight must be a number >= 0"),
])
def test_bad_options_are_refused_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        DPOModule(make_model("llama"), **kw)


def test_two_process_data_parallel_equals_one_process_on_the_global_batch(tmp_path):
    """2 ranks (gloo) with 1 pair each per micro-batch train like one process with 2 pairs per micro-batch (the
    pair losses are averaged, as DDP averages gradients)."""
    from test_data_parallel import check, launch

    check(launch(tmp_path, "--devices", "2", timeout=600, worker=Path(__file__).with_name("dpo_worker.py")))
    model = make_model("llama")
    freeze_key_biases(model)
    plain_dpo(model, DataLoader(Pairs(), batch_size=2, shuffle=False, collate_fn=collate_pairs), "sigmoid", steps=4)
    got = torch.load(tmp_path / "weights.pt")
    for k, v in model.state_dict().items():
        assert rel(got[k], v) <= 1e-5, k


@pytest.mark.parametrize("reference", ["precompute", "copy"])
def test_bf16_mixed_equals_plain_lightnings_bf16_mixed(tmp_path, reference):
    """``precision="bf16-mixed"``: the same ``DPOModule`` through ``strategy="megatrain"`` and through plain
    Lightning (``strategy="auto"``, fp32 weights under autocast), accumulation 2 + clipping: the same losses,
    reward margins and weights, as the supervised path is to plain Lightning's bf16-mixed."""
    runs = []
    for strategy in ("auto", "megatrain"):
        model = make_model("llama")
        freeze_key_biases(model)
        module = DPOModule(model, loss_type="sigmoid", beta=BETA, reference=reference, lr=LR,
                           cache_dir=tmp_path / strategy)
        rec = Record()
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, precision="bf16-mixed",
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   accumulate_grad_batches=ACC, gradient_clip_val=CLIP, callbacks=[rec]).fit(module, loader())
        runs.append((rec, model))
    (want, plain), (got, model) = runs
    assert got.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at the starting weights
    assert got.losses == want.losses
    assert got.margins == want.margins
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach()), (name, rel(p.detach(), q.detach()))
