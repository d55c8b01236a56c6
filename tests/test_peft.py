"""LoRA through peft: training matches plain Lightning, checkpoints are in peft's format and load
back with peft's own loader, resume is exact, and the merged export equals peft's merge_and_unload."""

from __future__ import annotations

import copy
import json
import logging

import lightning.pytorch as pl
import peft
import pytest
import torch
import transformers

import megatrain_lightning  # noqa: F401
from megatrain_lightning.data import ResumableDataLoader
from megatrain_lightning.export import export
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model

VARIANTS = {
    "lora_tied": ("llama_tied", {}),
    "lora_modules_to_save": ("llama", {"modules_to_save": ["lm_head"]}),
}


def lora(arch: str, **kw) -> peft.PeftModel:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **kw)
    peft_model = peft.get_peft_model(make_model(arch), config)
    torch.manual_seed(3)  # LoRA B starts at zero: make it non-zero so the adapter matters from step 0
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.02)
    return peft_model


def data() -> ResumableDataLoader:
    return ResumableDataLoader(make_data(n=12).dataset, batch_size=2, shuffle=True, seed=4)


def fit(lm, strategy="megatrain", steps=3, ckpt_path=None):
    t = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    t.fit(lm, data(), ckpt_path=ckpt_path)
    return t


def assert_same_state(loaded: torch.nn.Module, trained: torch.nn.Module) -> None:
    a, b = loaded.state_dict(), trained.state_dict()
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:6]
    for k in b:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_checkpoint_is_peft_format_and_loads_back_with_peft(tmp_path, variant):
    arch, kw = VARIANTS[variant]
    ref = LM(lora(arch, **kw))
    fit(ref, strategy="auto")
    lm = LM(lora(arch, **kw))
    t = fit(lm)
    assert_parity(lm.model, ref.model, lm.losses, ref.losses, tol=1e-5)

    t.save_checkpoint(tmp_path / "c")
    c = tmp_path / "c"
    assert not (c / "model").exists()  # the base alone is not the fine-tuned model
    assert json.loads((c / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(c / "base_model")
    assert type(base) is type(lm.model.get_base_model())
    loaded = peft.PeftModel.from_pretrained(base, c / "adapter")
    assert_same_state(loaded, lm.model)  # every base weight, adapter weight and modules_to_save copy


ADAPTERS_OUTSIDE_THE_LAYERS = {
    "lora_embedding": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    "ia3_lm_head": lambda: peft.IA3Config(target_modules=["lm_head", "down_proj"], feedforward_modules=["down_proj"]),
    "loha_lm_head": lambda: peft.LoHaConfig(r=2, target_modules=["lm_head"]),
}


@pytest.mark.parametrize("variant", ADAPTERS_OUTSIDE_THE_LAYERS)
def test_adapters_on_the_embedding_or_head_train_like_plain_lightning(tmp_path, variant):
    """Adapters whose weights peft keeps in an ``nn.ParameterDict`` of the adapted module (LoRA on an embedding:
    ``lora_embedding_A/B``; IA3's ``ia3_l``; LoHa's ``hada_w*``) outside the decoder layers: the ``ParameterDict``'s
    forward never runs, so its holder, not the dict, is the block. Bitwise plain Lightning; the checkpoint's adapter
    loads back with peft."""
    def build():
        torch.manual_seed(3)
        model = peft.get_peft_model(make_model("llama"), ADAPTERS_OUTSIDE_THE_LAYERS[variant]())
        for n, p in model.named_parameters():
            if p.requires_grad:  # LoRA B / IA3 start at zero / one: make every adapter weight matter from step 0
                p.data.add_(torch.randn_like(p) * 0.02)
        return LM(model)

    ref, lm = build(), build()
    fit(ref, strategy="auto")
    t = fit(lm)
    assert lm.losses == ref.losses
    for (name, a), b in zip(lm.named_parameters(), ref.parameters()):
        assert torch.equal(a.detach(), b.detach()), name
    t.save_checkpoint(tmp_path / "c")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c" / "base_model")
    assert_same_state(peft.PeftModel.from_pretrained(base, tmp_path / "c" / "adapter"), lm.model)


def test_dora_under_bf16_mixed_is_lightnings():
    """DoRA takes the norm of ``base_layer.weight + scale * B @ A`` in fp32, outside autocast's cast: its base
    weights travel in fp32 (``engine.wire.weights_read_outside_linear``). Before, they travelled in bf16 like any
    Linear weight and DoRA's norm saw them rounded: weights 8% off Lightning's bf16-mixed after 3 steps (probe).
    Now bitwise."""
    def run(strategy):
        torch.manual_seed(3)
        model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                                                       target_modules="all-linear"))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.02)
        lm = LM(model)
        pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, precision="bf16-mixed", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(lm, data())
        return lm

    ours, plain = run("megatrain"), run("auto")
    assert ours.losses == plain.losses
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name


def test_lora_resume_is_exact(tmp_path):
    arch, kw = VARIANTS["lora_modules_to_save"]
    full = LM(lora(arch, **kw))
    fit(full, steps=4)
    first = LM(lora(arch, **kw))
    fit(first, steps=2).save_checkpoint(tmp_path / "c")
    second = LM(lora(arch, **kw))
    fit(second, steps=4, ckpt_path=tmp_path / "c")
    assert_parity(second.model, full.model, first.losses + second.losses, full.losses, tol=1e-6)


def test_merged_export_equals_peft_merge_and_unload(tmp_path, capsys):
    arch, kw = VARIANTS["lora_modules_to_save"]
    lm = LM(lora(arch, **kw))
    fit(lm).save_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match="--merge-adapter"):
        export(tmp_path / "c", tmp_path / "base_only", quiet=True)
    assert not (tmp_path / "base_only").exists()
    capsys.readouterr()
    export(tmp_path / "c", tmp_path / "merged", merge_adapter=True)
    said = capsys.readouterr().out
    merged = f"from {tmp_path / 'c' / 'base_model'} with the adapter {tmp_path / 'c' / 'adapter'} merged to "
    assert merged in said, said
    reference = copy.deepcopy(lm.model).merge_and_unload()  # peft's own merge of the trained module
    assert_same_state(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), reference)


def test_lora_checkpoint_converts_to_one_lightning_file(tmp_path):
    from megatrain_lightning.checkpoint.lightning_file import convert_to_lightning_checkpoint

    arch, kw = VARIANTS["lora_modules_to_save"]
    lm = LM(lora(arch, **kw))
    fit(lm).save_checkpoint(tmp_path / "c")
    convert_to_lightning_checkpoint(tmp_path / "c", tmp_path / "c.ckpt")
    fresh = LM(lora(arch, **kw))
    fresh.load_state_dict(torch.load(tmp_path / "c.ckpt", weights_only=True)["state_dict"])  # strict
    assert_same_state(fresh, lm)


def test_lora_checkpoint_from_the_nvme_tier_loads_back_with_peft(tmp_path):
    """Weights and adapters read from the NVMe store (not the module) reach peft's files."""
    from megatrain_lightning import MegaTrainStrategy

    arch, kw = VARIANTS["lora_modules_to_save"]
    ram = LM(lora(arch, **kw))
    fit(ram)
    (tmp_path / "nvme").mkdir()
    strategy = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path / "nvme"),
                                 host_memory_limit=600_000)
    t = fit(LM(lora(arch, **kw)), strategy=strategy)
    t.save_checkpoint(tmp_path / "c")
    strategy.close()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c" / "base_model")
    assert_same_state(peft.PeftModel.from_pretrained(base, tmp_path / "c" / "adapter"), ram.model)  # tiers are bitwise equal


class SaveAtStep(pl.Callback):
    """``trainer.save_checkpoint(path)`` at the end of the batch that reaches ``step`` (during fit)."""

    def __init__(self, step: int, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_lora_modules_to_save_checkpoint_during_fit_on_the_nvme_tier(tmp_path):
    """peft lists a ``modules_to_save`` copy's keys through its ``state_dict()``, which the placeholder guard refused
    on the NVMe tier: every save during fit failed. The files equal the RAM tier's."""
    from megatrain_lightning import MegaTrainStrategy

    arch, kw = VARIANTS["lora_modules_to_save"]
    (tmp_path / "nvme").mkdir()
    for name, strategy in (("ram", MegaTrainStrategy()),
                           ("nvme", MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme",
                                                      nvme_path=str(tmp_path / "nvme")))):
        t = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[SaveAtStep(2, tmp_path / f"ckpt_{name}")])
        t.fit(LM(lora(arch, **kw)), data())
        strategy.close()
    loaded = {}
    for name in ("ram", "nvme"):
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"ckpt_{name}" / "base_model")
        loaded[name] = peft.PeftModel.from_pretrained(base, tmp_path / f"ckpt_{name}" / "adapter")
    assert any("modules_to_save" in k for k in loaded["nvme"].state_dict())
    assert_same_state(loaded["nvme"], loaded["ram"])
    for k, v in loaded["nvme"].state_dict().items():
        assert torch.isfinite(v).all(), k


class TokenizerName(LM):
    """A module whose ``tokenizer`` attribute is a hub id (a string), not a Hugging Face tokenizer object."""

    def __init__(self):
        super().__init__(make_model("llama"))
        self.tokenizer = "HuggingFaceTB/SmolLM2-135M"


def test_a_tokenizer_attribute_without_save_pretrained_is_not_saved(tmp_path):
    """Every save raised AttributeError ('str' object has no attribute 'save_pretrained') and stopped fit;
    now the checkpoint is written, with a warning that the tokenizer is not in it."""
    t = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveAtStep(1, tmp_path / "c")])
    with pytest.warns(UserWarning, match="tokenizer.*has no save_pretrained"):
        t.fit(TokenizerName(), data())
    assert (tmp_path / "c" / "model" / "config.json").is_file()
    assert not (tmp_path / "c" / "model" / "tokenizer_config.json").exists()


def test_prompt_learning_adapter_is_refused_before_anything_is_written(tmp_path):
    """peft builds prompt-tuning weights outside the state dict: saving them is refused, not dropped."""
    from megatrain_lightning.checkpoint.directory import CheckpointError, save_checkpoint_dir

    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    module = LM(peft.get_peft_model(make_model("llama"), config))
    with pytest.raises(CheckpointError, match="prompt_encoder.default.embedding.weight.*prompt-learning"):
        save_checkpoint_dir(tmp_path / "c", {}, module, engine=None)
    assert list(tmp_path.iterdir()) == []


def test_unsavable_adapter_is_named_before_training(caplog):
    """Prompt tuning trains (bitwise plain Lightning, probe), but its checkpoint is refused at save time: a
    warning at setup says so before the steps run, with what to do instead."""
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning"):
        fit(LM(peft.get_peft_model(make_model("llama"), config)), steps=1)
    assert any("default (PROMPT_TUNING)" in r.getMessage() and "save_pretrained" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning"):
        fit(LM(lora("llama")), steps=1)
    assert not any("cannot save" in r.getMessage() for r in caplog.records)


def test_lora_with_recompute_none_under_bf16_mixed_is_lightnings():
    """LoRA (frozen base weights, cast by autocast at every use) with recompute="none" under bf16-mixed:
    bitwise plain Lightning's losses and weights; the graphs keep less than under fp32 (no 16-bit copy
    of a frozen base weight is kept: the unpack hook casts the fetched weight again)."""
    from megatrain_lightning import MegaTrainStrategy

    base = lora("llama")
    runs, kept = {}, {}
    for name, strategy, precision in [("ours", MegaTrainStrategy(recompute="none"), "bf16-mixed"),
                                      ("plain", "auto", "bf16-mixed"),
                                      ("ours32", MegaTrainStrategy(recompute="none"), "32-true")]:
        lm = LM(copy.deepcopy(base), lr=3e-3, opt_kwargs={"fused": True})
        torch.manual_seed(0)
        t = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, precision=precision, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(lm, make_data(n=8))
        runs[name] = lm
        if name != "plain":
            kept[name] = t.strategy.engine.history[-1]["megatrain/saved_activation_bytes"]
    assert runs["ours"].losses == runs["plain"].losses
    for p, q in zip(runs["ours"].parameters(), runs["plain"].parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert kept["ours"] < kept["ours32"], kept
