"""Shared test fixtures: tiny Hugging Face models, a LightningModule wrapper, and the
plain-PyTorch reference loop every parity test compares against."""

from __future__ import annotations

from typing import Callable

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 96
SEQ = 16

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

ARCHS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama_tied": lambda: transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=8),
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=8),
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=8),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=8, sliding_window=8,
                                                final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "phi3": lambda: transformers.Phi3Config(**{**_COMMON, "num_key_value_heads": 4}, pad_token_id=0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def make_model(arch: str, seed: int = 0, attn: str = "eager", **overrides) -> transformers.PreTrainedModel:
    cfg = ARCHS[arch]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model


def make_data(n: int = 64, seed: int = 1, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


class LM(pl.LightningModule):
    """An ordinary LightningModule around a Hugging Face causal LM."""

    def __init__(self, model, lr=1e-3, sched: str | None = None, total_steps: int = 20, opt_kwargs=None):
        super().__init__()
        self.model = model
        self.lr = lr
        self.sched = sched
        self.total_steps = total_steps
        self.opt_kwargs = opt_kwargs or {}
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, **self.opt_kwargs)
        if self.sched == "cosine":
            s = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        return opt


def reference_train(model, loader, steps: int, lr=1e-3, accumulate: int = 1, clip: float | None = None, fused: bool | None = None,
                    clip_value: float | None = None,
                    sched: str | None = None, seed: int = 0, opt_kwargs=None, on_grads: Callable | None = None,
                    on_step: Callable | None = None):
    """Plain PyTorch: the same loop Lightning runs, on the unmodified model.

    ``on_grads(model)`` runs where Lightning calls ``on_before_optimizer_step`` (gradients accumulated,
    not yet clipped); ``on_step(model, opt)`` after each optimizer and scheduler step."""
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=lr, fused=fused, **(opt_kwargs or {}))
    s = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if sched == "cosine" else None
    losses = []
    it = iter(loader)
    done = 0
    micro = 0
    while done < steps:
        try:
            (ids,) = next(it)
        except StopIteration:
            it = iter(loader)
            (ids,) = next(it)
        if micro == 0:
            opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        (loss / accumulate).backward()
        micro += 1
        if micro == accumulate:
            if on_grads is not None:
                on_grads(model)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            if s is not None:
                s.step()
            if on_step is not None:
                on_step(model, opt)
            micro = 0
            done += 1
    return losses


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a.double() - b.double()) / max(torch.linalg.vector_norm(b.double()).item(), 1e-30)).item()


def assert_parity(model_a, model_b, losses_a, losses_b, tol=1e-5):
    assert len(losses_a) == len(losses_b), (len(losses_a), len(losses_b))
    for i, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert abs(la - lb) / abs(lb) <= tol, f"step {i}: loss {la} vs reference {lb}"
    sa = dict(model_a.named_parameters())
    sb = dict(model_b.named_parameters())
    assert sa.keys() == sb.keys()
    for k in sa:
        r = rel(sa[k].detach(), sb[k].detach())
        assert r <= tol, f"{k}: relative weight error {r:.3e}"
