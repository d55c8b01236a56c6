"""The body of ``recipes/finetune.py``: preflight, build, evaluate, fit, evaluate, save, report."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..planning import plan, preflight
from .models import build_model
from .module import CausalLMModule
from .report import format_table, peak_rss_bytes, summary_rows

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = {
    "legal": "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "biomedical": "Question: What is the MeSH category of aspirin?\nAnswer:",
    "code": "def read_config(path):\n    \"\"\"Read a configuration file",
}


def run_preflight(cfg: DictConfig) -> None:
    """Plan this run on ``cfg.hardware`` and refuse to start when RAM, disk or device memory is short.

    Raises:
        PreflightError: with the numbers and what to change (before anything is allocated).
    """
    p = plan(OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.hardware, resolve=True),
             batch_size=int(cfg.data.batch_size), seq_len=int(cfg.data.seq_len), precision=str(cfg.trainer.precision),
             lookahead=int(cfg.strategy.get("lookahead", 1)),
             recompute_every=int(cfg.strategy.get("recompute_every", 1)),
             offload_activations=bool(cfg.strategy.get("offload_activations", False)),
             offload_params=str(cfg.strategy.get("offload_params", "cpu")),
             offload_optimizer=str(cfg.strategy.get("offload_optimizer", "cpu")),
             offload_grads=str(cfg.strategy.get("offload_optimizer", "cpu")))  # accumulators follow the optimizer
    nvme = cfg.strategy.get("nvme_path")
    preflight(p, path=nvme if nvme and Path(nvme).is_dir() else cfg.output_dir)  # a missing nvme_path: the strategy says so


@contextlib.contextmanager
def inference_weights(trainer: pl.Trainer) -> Iterator[Any]:
    """Where inference after ``fit`` finds the trained weights; yields the device for the inputs.

    Weights in host memory (the RAM tier, or the NVMe tier when 4 B/param fit in
    ``host_memory_limit``: the strategy gave the module its weights back): the plain module, ``None``.
    Weights only on disk (larger than the host budget): the engine is installed again, so every
    forward streams the blocks (the KV cache is kept in inference), and yields its device.
    """
    eng = getattr(trainer.strategy, "engine", None)
    if eng is None or eng.closed or not eng.store.masters_on_disk or eng.materialized:
        yield None
        return
    eng.install()
    try:
        with torch.no_grad():
            yield eng.device
    finally:
        eng.uninstall()


def evaluate(trainer: pl.Trainer, lm: CausalLMModule, dm: Any) -> dict[str, float]:
    """Validation loss/perplexity (streamed through the strategy) and the domain probe."""
    out = trainer.validate(lm, datamodule=dm, verbose=False)[0]
    metrics = {"val_loss": float(out["val_loss"]), "val_ppl": float(out["val_ppl"])}
    with inference_weights(trainer) as dev:
        metrics.update({f"probe/{k}": float(v) for k, v in dm.run_probe(lm.model, device=dev).items()})
    return metrics


def sample(lm: CausalLMModule, tok: Any, prompt: str, max_new_tokens: int, trainer: pl.Trainer | None = None) -> str:
    """Greedy generation with the KV cache (no recompute in inference) on the trained weights:
    directly on the module when they are in host memory, streamed block by block when they are only
    on disk (see :func:`inference_weights`)."""
    model = lm.model.eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with (inference_weights(trainer) if trainer is not None else contextlib.nullcontext()) as dev, torch.no_grad():
        out = model.generate(ids.to(dev) if dev is not None else ids, max_new_tokens=max_new_tokens, do_sample=False,
                             use_cache=True, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0].cpu(), skip_special_tokens=True)


def make_logger(cfg: DictConfig) -> Any:
    if cfg.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(cfg.output_dir, name="logs")
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(cfg.output_dir, name="logs")


def finetune(cfg: DictConfig) -> dict[str, Any]:
    """Run one recipe; returns ``{"before", "after", "run", "sample", "checkpoint"}``."""
    pl.seed_everything(cfg.seed, workers=True)
    if cfg.preflight:
        run_preflight(cfg)
    model, tok = build_model(cfg.model)
    dm = instantiate(cfg.data, tokenizer=tok, max_seq_len=int(cfg.model.max_seq_len))
    lm = CausalLMModule(model, tokenizer=tok, total_steps=int(cfg.trainer.max_steps),
                        **OmegaConf.to_container(cfg.optim, resolve=True))
    trainer = pl.Trainer(strategy=instantiate(cfg.strategy), logger=make_logger(cfg),
                         default_root_dir=cfg.output_dir, **OmegaConf.to_container(cfg.trainer, resolve=True))
    before = evaluate(trainer, lm, dm)
    t0 = time.perf_counter()
    trainer.fit(lm, datamodule=dm)
    seconds = time.perf_counter() - t0
    after = evaluate(trainer, lm, dm)
    ckpt = Path(cfg.output_dir) / "checkpoint"
    trainer.save_checkpoint(ckpt)
    hist = trainer.strategy.engine.history
    last = hist[-1] if hist else {}
    run = {"steps": trainer.global_step, "seconds": seconds, "tokens_per_s": lm.tokens_seen / max(seconds, 1e-9),
           "peak_rss_bytes": peak_rss_bytes(), "h2d_bytes": last.get("megatrain/h2d_bytes", 0),
           "d2h_bytes": last.get("megatrain/d2h_bytes", 0)}
    prompt = cfg.sample.prompt or DEFAULT_PROMPTS.get(str(cfg.data.get("domain")), "The")
    text = sample(lm, tok, prompt, int(cfg.sample.max_new_tokens), trainer)
    print("\n" + format_table(summary_rows(before, after, run)))
    print(f"\nHF checkpoint: {ckpt / 'model'}")
    print(f"\nsample ({prompt!r}):\n{text}\n")
    return {"before": before, "after": after, "run": run, "sample": text, "checkpoint": str(ckpt)}
