"""``CausalLMModule``: the LightningModule of the fine-tuning recipes.

An ordinary LightningModule around a Hugging Face causal LM: batches are dicts
``{"input_ids", "labels", "attention_mask"}`` (LongTensor ``[B, T]``, labels ``-100`` where no loss is taken),
the loss is the model's own shifted cross-entropy, validation perplexity is torchmetrics' ``Perplexity``, and the
optimizer (default ``torch.optim.AdamW``; no weight decay on 1-D parameters,
:func:`megatrain_lightning.optim.build.build_optimizer`) has a linear-warmup cosine schedule stepped every
optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics.text import Perplexity


class CausalLMModule(pl.LightningModule):
    """Fine-tune ``model`` (any ``transformers`` causal LM).

    Args:
        model: the Hugging Face model (may be on the meta device with a weights source attached).
        lr: peak learning rate.
        weight_decay: the optimizer's weight decay on parameters with ``ndim >= 2`` (AdamW: decoupled).
        betas: AdamW betas; passed to any optimizer whose constructor takes ``betas``.
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps``.
        total_steps: optimizer steps of the cosine decay to 0; ``None`` (or <= 0, as Lightning's
            ``max_steps=-1``): the Trainer's ``estimated_stepping_batches`` (epochs x batches per epoch /
            accumulation, or ``max_steps``), known when ``configure_optimizers`` runs.
        tokenizer: kept for checkpoints (saved into ``model/``) and generation.
        optimizer: the optimizer class or its dotted name (``"torch.optim.SGD"``...); ``MuonWithAdamW`` gets Muon
            for the decoder's 2-D weights and AdamW for the rest
            (:func:`~megatrain_lightning.optim.build.build_optimizer`).
        **optimizer_options: the class's other keyword arguments (``momentum=0.9``, ``eps``...).
    """

    def __init__(self, model: torch.nn.Module, lr: float = 1e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 0, total_steps: int | None = None,
                 tokenizer: Any = None, optimizer: str | type = "torch.optim.AdamW",
                 **optimizer_options: Any) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.optimizer_class = optimizer
        self.optimizer_options = optimizer_options
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.val_ppl = Perplexity(ignore_index=-100)
        self.tokens_seen = 0
        self._step_losses: tuple[int, list[torch.Tensor]] = (-1, [])  # (global step, its micro-batch losses)

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                          labels=batch["labels"], use_cache=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The model's loss of ``batch``; logs ``train_loss`` as the mean over this optimizer step's micro-batches
        so far, so the value written at the step's last micro-batch is the whole step's loss with any
        ``accumulate_grad_batches`` (Lightning divides only the returned loss by N). ``sync_dist``: the mean over
        ranks (one scalar all-reduce per micro-batch), the global batch's loss, not rank 0's share."""
        loss = self(batch).loss
        self.tokens_seen += int((batch["labels"] != -100).sum())
        step = self.trainer.global_step  # the optimizer steps done: the same for every micro-batch of a step
        if self._step_losses[0] != step:
            self._step_losses = (step, [])
        self._step_losses[1].append(loss.detach())
        self.log("train_loss", torch.stack(self._step_losses[1]).mean(), prog_bar=True,
                 batch_size=batch["input_ids"].shape[0], sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Updates ``val_ppl`` and logs ``val_loss`` weighted by the batch's loss-carrying label tokens, so that
        ``exp(val_loss) == val_ppl`` (the mean token cross-entropy). A batch with no label token logs 0 with weight
        0 instead of NaN: every rank still logs, so the ``sync_dist`` reduction runs on all of them."""
        out = self(batch)
        # Perplexity expects preds [B, T, V] and target [B, T]; shift as the model's loss does
        targets = batch["labels"][:, 1:]
        self.val_ppl.update(out.logits[:, :-1].float(), targets)
        tokens = int((targets != -100).sum())
        loss = out.loss if tokens else torch.zeros_like(out.loss)
        self.log("val_loss", loss, prog_bar=True, batch_size=tokens, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val_ppl", self.val_ppl.compute(), prog_bar=True)
        # trainer.validate() runs under inference_mode; state re-created there would be an
        # inference tensor that the next in-place update under no_grad (validation in fit) rejects
        with torch.inference_mode(False):
            self.val_ppl.reset()

    def _total_steps(self) -> int:
        """The schedule's length in optimizer steps (``total_steps``, else the Trainer's estimate).

        Raises:
            ValueError: neither is finite (``max_steps=-1`` and ``max_epochs=-1``)."""
        if self.total_steps is not None and self.total_steps > 0:
            return int(self.total_steps)
        est = self.trainer.estimated_stepping_batches
        if not math.isfinite(est):
            raise ValueError("CausalLMModule: the learning-rate schedule needs a length: set total_steps, "
                             "trainer.max_steps or trainer.max_epochs (both are unlimited now).")
        return max(1, int(est))

    def configure_optimizers(self) -> Any:
        from ..optim.build import build_optimizer

        opt = build_optimizer(self.model, self.optimizer_class, lr=self.lr, weight_decay=self.weight_decay,
                              betas=self.betas, split_1d=True, options=self.optimizer_options)
        warm, total = max(0, self.warmup_steps), self._total_steps()

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
