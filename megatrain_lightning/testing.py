"""Tiny models, data and the plain-PyTorch reference loop that the tests and benchmarks compare against.

Used by the test suite, ``bench/`` and users checking the strategy on their own machine; nothing in the library
imports it. The parity tests train a copy of a :func:`make_model` model through ``Trainer(strategy="megatrain")``
and compare it with :func:`reference_train` (:func:`assert_parity`).
"""

from __future__ import annotations

from typing import Callable

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["ARCHS", "LM", "SEQ", "VOCAB", "assert_parity", "batch_inputs", "freeze_key_biases", "learnable_data",
           "make_data", "make_model", "padded_data", "reference_train", "rel"]

VOCAB = 96
"""Vocabulary size of every tiny config."""
SEQ = 16
"""Sequence length of :func:`make_data` batches."""

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
"""Architecture name -> factory of a tiny config (hidden 32, 3 layers, 4 heads, vocabulary 96)."""


def make_model(arch: str, seed: int = 0, attn: str = "eager", **overrides) -> transformers.PreTrainedModel:
    """A freshly initialised tiny causal LM.

    Args:
        arch: a key of :data:`ARCHS`.
        seed: ``torch.manual_seed`` before initialisation (the same seed gives the same weights).
        attn: ``attn_implementation`` (``"eager"`` is deterministic on CPU).
        **overrides: config attributes to set (``use_cache=False``, ``num_hidden_layers=8``...).
    """
    cfg = ARCHS[arch]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def make_data(n: int = 64, seed: int = 1, batch_size: int = 2) -> DataLoader:
    """``n`` sequences of :data:`SEQ` uniformly random token ids, batched in order (no shuffle)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def learnable_data(n: int = 64, seq: int = 16, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Sequences with structure (``x[t+1] = x[t] + step mod VOCAB``, step in 1..3), so the loss really falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(seq)) % VOCAB
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def padded_data(n: int = 64, seq: int = SEQ, batch_size: int = 2, seed: int = 2, pad_id: int = 0) -> DataLoader:
    """``n`` random sequences of lengths uniform in ``[seq // 2, seq]``, right-padded to ``seq`` with ``pad_id``:
    batches of ``(ids, attention_mask, labels)`` (``[B, seq]`` int64; labels are the ids, -100 at padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids * mask + pad_id * (1 - mask)
    labels = ids.masked_fill(mask == 0, -100)
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=batch_size, shuffle=False)


def batch_inputs(batch) -> dict:
    """Keyword arguments of ``model(...)`` for a batch of :func:`make_data` (``(ids,)``: the ids are the
    labels) or of :func:`padded_data` (``(ids, attention_mask, labels)``)."""
    if len(batch) == 1:
        return {"input_ids": batch[0], "labels": batch[0]}
    ids, mask, labels = batch
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class LM(pl.LightningModule):
    """An ordinary LightningModule around a Hugging Face causal LM.

    Args:
        model: the causal LM (``model(input_ids=, labels=).loss`` is the training loss).
        lr: the optimizer's learning rate.
        sched: ``"cosine"`` for a per-step ``CosineAnnealingLR`` over ``total_steps``, or ``None``.
        total_steps: the schedule's ``T_max``.
        opt_kwargs: further arguments of the optimizer (``weight_decay``, ``fused``...).
        extra_inputs: ``extra_inputs(batch) -> dict`` of further model keyword arguments
            (``num_items_in_batch``...), or ``None``.
        optimizer: the ``torch.optim`` class ``configure_optimizers`` builds (``torch.optim.AdamW``).

    Attributes:
        losses: every training loss, as a float, in order.
    """

    def __init__(self, model, lr=1e-3, sched: str | None = None, total_steps: int = 20, opt_kwargs=None,
                 extra_inputs: Callable | None = None, optimizer: type = torch.optim.AdamW):
        super().__init__()
        self.optimizer_class = optimizer
        self.extra_inputs = extra_inputs
        self.model = model
        self.lr = lr
        self.sched = sched
        self.total_steps = total_steps
        self.opt_kwargs = opt_kwargs or {}
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        extra = self.extra_inputs(batch) if self.extra_inputs is not None else {}
        loss = self.model(**batch_inputs(batch), **extra).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch_inputs(batch)).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = self.optimizer_class(self.parameters(), lr=self.lr, **self.opt_kwargs)
        if self.sched == "cosine":
            s = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        return opt


class BackboneLM(LM):
    """:class:`LM` whose ``backbone`` (the embedding and the first decoder layer) Lightning's ``BackboneFinetuning``
    freezes at setup and unfreezes into a new param group later; the optimizer starts with the trainable rest.

    Args:
        model: a causal LM with ``model.model.embed_tokens`` and ``model.model.layers`` (llama-style).
        lr: AdamW learning rate.
    """

    def __init__(self, model, lr=1e-2):
        super().__init__(model, lr=lr)
        self.backbone = torch.nn.ModuleList([model.model.embed_tokens, model.model.layers[0]])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def reference_train(model, loader, steps: int, lr=1e-3, accumulate: int = 1, clip: float | None = None,
                    fused: bool | None = None, clip_value: float | None = None, sched: str | None = None,
                    seed: int = 0, opt_kwargs=None, on_grads: Callable | None = None,
                    on_step: Callable | None = None, extra_inputs: Callable | None = None,
                    after_backward: Callable | None = None, optimizer: type = torch.optim.AdamW) -> list[float]:
    """Train ``model`` in place with plain PyTorch: the same loop Lightning runs, on the unmodified model.

    Args:
        model: the model (trained in place).
        loader: batches of ``(ids,)`` or ``(ids, attention_mask, labels)`` (:func:`batch_inputs`);
            restarted when exhausted.
        steps: optimizer steps.
        lr: AdamW learning rate.
        accumulate: micro-batches per step (each loss divided by it, as ``accumulate_grad_batches``).
        clip: ``clip_grad_norm_`` max norm (``gradient_clip_val``), or ``None``.
        fused: ``torch.optim.AdamW(fused=)``.
        clip_value: ``clip_grad_value_`` bound (``gradient_clip_algorithm="value"``), or ``None``.
        sched: ``"cosine"``: ``CosineAnnealingLR(T_max=steps)`` stepped after every optimizer step.
        seed: ``torch.manual_seed`` before training (dropout).
        opt_kwargs: further ``torch.optim.AdamW`` arguments.
        on_grads: ``on_grads(model)`` where Lightning calls ``on_before_optimizer_step`` (gradients
            accumulated, not yet clipped).
        on_step: ``on_step(model, opt)`` after each optimizer and scheduler step.
        extra_inputs: as :class:`LM`'s (further keyword arguments of the model call).
        after_backward: ``after_backward(model)`` after every micro-batch's backward (``on_after_backward``).
        optimizer: the ``torch.optim`` class (``torch.optim.AdamW``; ``fused`` is passed only to AdamW/Adam).

    Returns:
        The loss of every micro-batch, as floats.
    """
    torch.manual_seed(seed)
    model.train()
    kw = {"fused": fused} if optimizer in (torch.optim.AdamW, torch.optim.Adam) else {}
    opt = optimizer([p for p in model.parameters()], lr=lr, **kw, **(opt_kwargs or {}))
    s = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if sched == "cosine" else None
    losses = []
    it = iter(loader)
    done = 0
    micro = 0
    while done < steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        if micro == 0:
            opt.zero_grad()
        extra = extra_inputs(batch) if extra_inputs is not None else {}
        loss = model(**batch_inputs(batch), **extra).loss
        losses.append(loss.item())
        (loss / accumulate).backward()
        if after_backward is not None:
            after_backward(model)
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
    """Relative error ``||a - b|| / ||b||`` (2-norm over all elements, in float64; ``||b||`` floored at 1e-30)."""
    return (torch.linalg.vector_norm(a.double() - b.double())
            / max(torch.linalg.vector_norm(b.double()).item(), 1e-30)).item()


def assert_parity(model_a, model_b, losses_a, losses_b, tol=1e-5) -> None:
    """Assert that two trainings agree: every loss within ``tol`` relative, and every named parameter
    within ``tol`` by :func:`rel` (``model_b`` / ``losses_b`` are the reference)."""
    assert len(losses_a) == len(losses_b), (len(losses_a), len(losses_b))
    for i, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert abs(la - lb) / abs(lb) <= tol, f"step {i}: loss {la} vs reference {lb}"
    sa = dict(model_a.named_parameters())
    sb = dict(model_b.named_parameters())
    assert sa.keys() == sb.keys()
    for k in sa:
        r = rel(sa[k].detach(), sb[k].detach())
        assert r <= tol, f"{k}: relative weight error {r:.3e}"


def freeze_key_biases(model) -> None:
    """Freeze attention key biases (``k_proj.bias``, GPT-2's ``c_attn.bias``).

    Their true gradient is exactly zero (softmax is invariant to adding the same ``q . b_k`` to every score of a
    query), so implementations 'train' them on rounding noise that Adam amplifies to +-lr per step: no two can
    match such a parameter to 1e-5.
    """
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias") or name.endswith("c_attn.bias"):
            p.requires_grad_(False)
