"""``DPOModule``: preference fine-tuning (DPO, IPO, SimPO) of a Hugging Face causal LM as a LightningModule.

Batches are those of :func:`.data.collate_pairs`. Each training step runs the chosen and the rejected
sequences of the batch as one concatenated forward (``[2B, T]``: chosen rows first), takes the
log-probabilities of the response tokens (the prompt and padding masked by ``labels == -100``), and computes
the loss of :mod:`.losses` against the reference model's log-probabilities of the same tokens. The choices of
``reference`` (``"precompute"``, ``"adapter"``, ``"copy"``, ``None``) and their memory and compute:
docs/guide/preference.md, "The reference model".
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from .losses import LOSS_TYPES, needs_reference, preference_loss, sft_nll

log = logging.getLogger(__name__)

REFERENCES = ("precompute", "adapter", "copy")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the label tokens of each sequence, and their counts.

    Args:
        logits: ``[N, T, V]`` (any float dtype; reduced in float32).
        labels: ``[N, T]`` int64, ``-100`` where no token is scored; shifted by one as a causal LM's loss is
            (the logits at ``t`` score the label at ``t + 1``).

    Returns:
        (sums ``[N]`` float32, counts ``[N]`` int64)."""
    labels = labels[:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def chunked_sequence_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                           chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logps` without the full logits: the decoder's hidden states go through the LM head
    ``chunk`` positions at a time, each chunk's log-softmax under ``torch.utils.checkpoint`` (non-reentrant), so
    forward and backward hold one chunk's ``[N, chunk, V]`` logits at a time.

    Args:
        model: a Hugging Face causal LM (or a peft model around one) whose logits are its output embedding applied
            to the decoder's last hidden state (no soft-capping or logit scaling).
        ids, mask, labels: ``[N, T]`` int64 (see :func:`sequence_logps`).
        chunk: positions per chunk (>= 1).

    Raises:
        ValueError: the model post-processes its logits (``final_logit_softcapping``, ``logit_scale``), which the
            chunks would miss, or has no ``base_model_prefix`` decoder."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = hf.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1.0):
        raise ValueError(f"megatrain: logps_chunk_size: {type(hf).__name__} soft-caps or scales its logits, which "
                         "chunked log-probs do not apply; set logps_chunk_size=None.")
    decoder = getattr(hf, hf.base_model_prefix, None)
    if decoder is None:
        raise ValueError(f"megatrain: logps_chunk_size: {type(hf).__name__} has no decoder at "
                         f"'{hf.base_model_prefix}'; set logps_chunk_size=None.")
    head = hf.get_output_embeddings()
    hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(head(h).float(), dim=-1)
        return logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)

    parts = [checkpoint(piece, hidden[:, s: s + chunk], target[:, s: s + chunk], use_reentrant=False)
             for s in range(0, hidden.shape[1], chunk)]
    picked = torch.cat(parts, dim=1)
    return (picked * keep).sum(-1), keep.sum(-1)


def _concat(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` ``[2B, T]``: the chosen rows, then the rejected rows."""
    return tuple(torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "attention_mask",
                                                                                       "labels"))


class DPOModule(pl.LightningModule):
    """Preference fine-tuning of ``model`` (any ``transformers`` causal LM, or a peft model around one).

    Args:
        model: the policy, at its starting weights.
        loss_type: ``"sigmoid"`` (DPO), ``"ipo"`` or ``"simpo"`` (:mod:`.losses`).
        beta: the loss's beta (> 0): DPO's KL weight, IPO's tau, SimPO's reward scale.
        gamma: SimPO's target reward margin (TRL's ``simpo_gamma``); only ``"simpo"`` reads it.
        sft_weight: weight (>= 0) of the chosen responses' negative log-likelihood added to the loss
            (:func:`.losses.sft_nll`; RPO, TRL's ``"sft"`` loss type); 0 (default): the preference loss alone.
        reference: ``"precompute"``, ``"adapter"``, ``"copy"`` or ``None``; default: ``"precompute"`` for the
            losses that need a reference, ``None`` for ``"simpo"``.
        lr, betas, weight_decay: the optimizer's (``betas`` when its constructor takes it).
        optimizer: the optimizer class or its dotted name (default ``torch.optim.AdamW``): one param group of every
            trainable parameter (:func:`~megatrain_lightning.optim.build.build_optimizer`; ``MuonWithAdamW`` gets
            Muon's and AdamW's).
        **optimizer_options: the class's other keyword arguments (``momentum=0.9``...).
        cache_dir: directory of the ``"precompute"`` cache (default ``~/.cache/megatrain_lightning/reference_logps``).
        logps_chunk_size: positions per chunk of the LM head + log-softmax (:func:`chunked_sequence_logps`): the
            ``[2B, T, V]`` fp32 logits are never materialised, for long sequences or large vocabularies. ``None``
            (default): one full-logits forward.
        tokenizer: saved with the model in a checkpoint's ``model/`` (as a ``LightningModule``'s ``self.tokenizer``,
            docs/guide/checkpoints.md); ``None``: none saved.

    Logged metrics (``train_loss``, ``rewards/*``, ``logps/*``, ``nll_loss``): docs/guide/preference.md, "Options".

    Raises:
        ValueError: an unknown ``loss_type`` or ``reference``, ``beta <= 0``, ``sft_weight < 0``, a reference for
            ``"simpo"`` or none for the others, or ``"adapter"`` for a model without a peft adapter (at
            construction)."""

    def __init__(self, model: torch.nn.Module, loss_type: str = "sigmoid", beta: float = 0.1, gamma: float = 0.5,
                 reference: str | None = "default", lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, cache_dir: str | os.PathLike | None = None,
                 logps_chunk_size: int | None = None, sft_weight: float = 0.0,
                 optimizer: str | type = "torch.optim.AdamW", tokenizer: Any = None,
                 **optimizer_options: Any) -> None:
        super().__init__()
        reference = self.check_options(loss_type, beta, reference, logps_chunk_size, sft_weight)
        if reference == "adapter" and not (hasattr(model, "disable_adapter") and getattr(model, "peft_config", None)):
            raise ValueError("megatrain: reference='adapter' takes the model with its adapter disabled as the "
                             "reference, but this model has no peft adapter: wrap it with peft.get_peft_model, or "
                             "use reference='precompute' or 'copy'.")
        self.model = model
        self.tokenizer = tokenizer
        self.loss_type, self.beta, self.gamma, self.reference = loss_type, float(beta), float(gamma), reference
        self.sft_weight = float(sft_weight)
        self.lr, self.betas, self.weight_decay = lr, tuple(betas), weight_decay
        self.optimizer_class, self.optimizer_options = optimizer, optimizer_options
        self.logps_chunk_size = logps_chunk_size
        self.cache_dir = Path(cache_dir) if cache_dir is not None else (
            Path.home() / ".cache" / "megatrain_lightning" / "reference_logps")
        self.reference_model = copy.deepcopy(model).requires_grad_(False).eval() if reference == "copy" else None
        self.reference_logps: torch.Tensor | None = None  # "precompute": [N, 4] (chosen sum, count, rejected sum, count)
        self.val_reference_logps: torch.Tensor | None = None  # the same for the fit's validation pairs
        self._val_dataset: Any = None  # the dataset val_reference_logps scores
        self._policy_is_reference = False  # starting_weights_as_reference()

    @staticmethod
    def check_options(loss_type: str, beta: float, reference: str | None = "default",
                      logps_chunk_size: int | None = None, sft_weight: float = 0.0) -> str | None:
        """Check the options that need no model; returns ``reference`` with ``"default"`` resolved.

        Raises:
            ValueError: as the constructor (every case but ``"adapter"`` without a peft model)."""
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"megatrain: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
            raise ValueError(f"megatrain: beta must be > 0 (a number), got {beta!r}.")
        if isinstance(sft_weight, bool) or not isinstance(sft_weight, (int, float)) or not sft_weight >= 0:
            raise ValueError(f"megatrain: sft_weight must be a number >= 0, got {sft_weight!r}.")
        if logps_chunk_size is not None and (isinstance(logps_chunk_size, bool) or not isinstance(logps_chunk_size, int)
                                             or logps_chunk_size < 1):
            raise ValueError(f"megatrain: logps_chunk_size must be a positive int or None, got {logps_chunk_size!r}.")
        if reference == "default":
            reference = "precompute" if needs_reference(loss_type) else None
        if reference is not None and reference not in REFERENCES:
            raise ValueError(f"megatrain: reference must be one of {REFERENCES} or None, got {reference!r}.")
        if needs_reference(loss_type) and reference is None:
            raise ValueError(f"megatrain: loss_type={loss_type!r} compares against a reference model: set reference "
                             f"to one of {REFERENCES} (or use loss_type='simpo', which needs none).")
        if not needs_reference(loss_type) and reference is not None:
            raise ValueError(f"megatrain: loss_type='simpo' uses no reference model; reference={reference!r} does not "
                             "apply: leave it unset (None).")
        return reference

    def train(self, mode: bool = True) -> "DPOModule":
        """As ``nn.Module.train``; the ``"copy"`` reference stays in eval mode (no dropout), as TRL's."""
        super().train(mode)
        if self.reference_model is not None:
            self.reference_model.eval()
        return self

    # ---------------------------------------------------------------- log-probabilities
    def _logps(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
               labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.logps_chunk_size is not None:
            return chunked_sequence_logps(model, ids, mask, labels, self.logps_chunk_size)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return sequence_logps(logits, labels)

    def _reference(self, batch: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
                   labels: torch.Tensor, prefix: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Summed reference log-probs ``[B]`` of the chosen and the rejected responses (``prefix``: ``"train"`` or
        ``"val"``, whose precomputed tables differ).

        Raises:
            RuntimeError: ``"precompute"`` outside the fit that computed the tables, or on validation data other
                than the fit's."""
        if self.reference is None:
            return None, None
        if self.reference == "precompute":
            table = self.reference_logps if prefix == "train" else self.val_reference_logps
            if table is None:
                raise RuntimeError("megatrain: the reference log-probs are computed at the start of fit, for its "
                                   "training and validation data; DPOModule's steps run only inside Trainer.fit, "
                                   "or in Trainer.validate after it on the fit's validation data.")
            if prefix != "train":
                val = self.trainer.val_dataloaders  # the running validation's
                if (val.dataset if isinstance(val, DataLoader) else None) is not self._val_dataset:
                    raise RuntimeError("megatrain: reference='precompute' scored the fit's validation pairs; "
                                       "validation data other than the fit's has no reference log-probs: validate on "
                                       "the fit's validation data (the same DataLoader or dataset object that fit "
                                       "ran, not a new one over the same records), or use reference='copy'.")
            rows = table[batch["index"].cpu()]  # float64: fp32 sums and token counts, exact
            return rows[:, 0].float().to(ids.device), rows[:, 2].float().to(ids.device)
        with torch.no_grad():
            if self.reference == "adapter":
                with self.model.disable_adapter():
                    sums, _ = self._logps(self.model, ids, mask, labels)
            else:
                sums, _ = self._logps(self.reference_model, ids, mask, labels)
        return sums.chunk(2)

    @contextlib.contextmanager
    def starting_weights_as_reference(self) -> Iterator[None]:
        """Inside, the reference log-probs are the policy's own: for a ``Trainer.validate`` before ``fit`` (whose
        ``"precompute"`` tables exist only inside ``fit``) at the starting weights (rewards 0, the loss at equal
        log-probs)."""
        self._policy_is_reference = True
        try:
            yield
        finally:
            self._policy_is_reference = False

    def _step(self, batch: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        ids, mask, labels = _concat(batch)
        if self._policy_is_reference and needs_reference(self.loss_type):
            sums, counts = self._logps(self.model, ids, mask, labels)
            ref_c, ref_r = sums.detach().chunk(2)
        else:
            ref_c, ref_r = self._reference(batch, ids, mask, labels, prefix)
            sums, counts = self._logps(self.model, ids, mask, labels)
        (pol_c, pol_r), (n_c, n_r) = sums.chunk(2), counts.chunk(2)
        losses, chosen, rejected = preference_loss(self.loss_type, pol_c, pol_r, ref_c, ref_r, n_c, n_r, self.beta,
                                                   self.gamma)
        loss = losses.mean()
        n = ids.shape[0] // 2
        extra = {}
        if self.sft_weight:
            nll = sft_nll(pol_c, n_c)
            loss = loss + self.sft_weight * nll
            extra["nll_loss"] = nll.detach()
        metrics = {"loss": loss.detach(), **extra, "rewards/chosen": chosen.detach().mean(),
                   "rewards/rejected": rejected.detach().mean(),
                   "rewards/accuracies": (chosen > rejected).float().mean(),
                   "rewards/margins": (chosen - rejected).detach().mean(),
                   "logps/chosen": pol_c.detach().mean(), "logps/rejected": pol_r.detach().mean()}
        for name, value in metrics.items():
            key = f"{prefix}_loss" if name == "loss" else (name if prefix == "train" else f"{prefix}_{name}")
            self.log(key, value, batch_size=n, prog_bar=name in ("loss", "rewards/accuracies"), sync_dist=True)
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The mean loss over the batch's pairs (Lightning divides it by ``accumulate_grad_batches``)."""
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> Any:
        from ..optim.build import build_optimizer

        return build_optimizer(self.model, self.optimizer_class, lr=self.lr, weight_decay=self.weight_decay,
                               betas=self.betas, split_1d=False, options=self.optimizer_options)

    # ---------------------------------------------------------------- the precomputed reference
    def on_fit_start(self) -> None:
        """``"precompute"``: load the cache or compute it now. Lightning calls this hook after the strategy's setup
        and before a checkpoint's weights are restored, so the pass sees the starting weights, on resume too."""
        if self.reference != "precompute":
            return
        self.reference_logps = self._load_or_precompute(self._fit_loader("training"))
        self.val_reference_logps = self._val_dataset = None
        val = self._fit_loader("validation")
        if val is not None:
            self.val_reference_logps, self._val_dataset = self._load_or_precompute(val), val.dataset

    def _load_or_precompute(self, loader: DataLoader) -> torch.Tensor:
        """The cached table of ``loader``'s pairs (keyed by :meth:`_cache_key`), or :meth:`_precompute` and cache it."""
        path = self.cache_dir / f"{self._cache_key(loader.dataset)}.pt"
        if path.exists():
            log.info("megatrain: reference log-probs loaded from %s", path)
            return torch.load(path, weights_only=True)
        table = self._precompute(loader)
        if self.trainer.global_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            torch.save(table, tmp)
            os.replace(tmp, path)
            log.info("megatrain: reference log-probs of %d pairs cached in %s", len(table), path)
        return table

    def _fit_loader(self, which: str) -> DataLoader | None:
        """The DataLoader ``fit`` trains (``"training"``) or validates (``"validation"``) on; its dataset's items
        carry an ``index`` (:class:`.data.PreferenceDataset`). ``None``: no validation data, or validation off.

        Raises:
            TypeError: the data is not one DataLoader over an indexable dataset."""
        # Lightning keeps fit's data sources on its loops (a DataLoader, a LightningDataModule or this module)
        if which == "training":
            loader = self.trainer.fit_loop._data_source.dataloader()
        else:
            source = self.trainer.fit_loop.epoch_loop.val_loop._data_source
            if self.trainer.limit_val_batches == 0 or not source.is_defined():
                return None
            loader = source.dataloader()
            if isinstance(loader, (list, tuple)) and not loader:
                return None
        if not isinstance(loader, DataLoader) or not hasattr(loader.dataset, "__getitem__"):
            raise TypeError(f"megatrain: reference='precompute' needs the {which} data as one DataLoader over an "
                            f"indexable dataset of preference pairs with an 'index' (PreferenceDataset); got "
                            f"{type(loader).__name__}. Use reference='copy' for other data.")
        return loader

    def _cache_key(self, dataset: Any) -> str:
        """SHA-256 of what the reference log-probs depend on: the model's config and source, a digest of its input
        embeddings where they are readable, the token ids of every pair, and the precision."""
        h = hashlib.sha256()
        config = getattr(self.model, "config", None)
        h.update(config.to_json_string().encode() if hasattr(config, "to_json_string") else repr(config).encode())
        h.update(str(getattr(config, "_name_or_path", "")).encode())
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        try:  # after the strategy's setup: a view of the host store's masters on the RAM tier
            h.update(emb.weight.detach().double().sum().item().hex().encode())
        except Exception:  # no embeddings, or a placeholder of the NVMe tier (its masters are on disk)
            log.warning("megatrain: the reference cache key cannot include a digest of the starting weights (they "
                        "are not in host memory): a cache of other weights with the same config and data would be "
                        "reused; give each starting checkpoint its own cache_dir.")
        for i in range(len(dataset)):
            item = dataset[i]
            h.update(json.dumps([int(item["index"]), item["prompt"], item["chosen"], item["rejected"]]).encode())
        h.update(str(self.trainer.precision).encode())
        return h.hexdigest()[:32]

    def _precompute(self, loader: DataLoader) -> torch.Tensor:
        """One no-grad pass in dataset order: ``[N, 4]`` float64 (chosen sum, chosen count, rejected sum, count),
        under the precision plugin's forward context as the training step's forward, so at the starting weights
        the policy's log-probs equal the reference's."""
        out = torch.zeros(len(loader.dataset), 4, dtype=torch.float64)
        ordered = DataLoader(loader.dataset, batch_size=loader.batch_size or 1, shuffle=False,
                             collate_fn=loader.collate_fn)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.trainer.precision_plugin.forward_context():
                every = max(1, len(ordered) // 10)
                for i, batch in enumerate(ordered):
                    if i % every == 0:
                        log.info("megatrain: reference log-probs, batch %d/%d", i + 1, len(ordered))
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    ids, mask, labels = _concat(batch)
                    sums, counts = self._logps(self.model, ids, mask, labels)
                    c_sum, r_sum = sums.double().cpu().chunk(2)
                    c_n, r_n = counts.double().cpu().chunk(2)
                    out[batch["index"].cpu()] = torch.stack([c_sum, c_n, r_sum, r_n], dim=1)
        finally:
            self.model.train(was_training)
        return out
