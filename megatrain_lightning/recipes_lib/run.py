"""The steps of ``recipes/finetune.py``, each a function of the composed config: preflight, build, evaluate, fit,
save, evaluate, sample, report. The recipe file calls them in order (the save right after fit, so that a failure
in a later step keeps the trained weights); copy it to change one."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..data.formatting import generation_prompt
from ..data.resume_alignment import ResumedEpochAlignment
from ..planning import PreflightError, plan_for_run, preflight as plan_preflight
from .checks import ConfigError, check_all, local_model_config
from .console import RecipeProgressBar, StepLog
from .checkpoints import RecordRunIdentity, checkpoint_callback, resolve_resume, run_identity
from .module import CausalLMModule
from .results import LossHistory, build_summary, format_table, peak_rss_bytes, summary_rows, write_results

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = {
    "legal": "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "biomedical": "What is the MeSH category of aspirin?",
    "code": "def read_config(path):\n    \"\"\"Read a configuration file",
}


def preflight(cfg: DictConfig) -> Path | None:
    """Everything that can be checked before the model is built (:func:`~.checks.check_all`, ``resume``, then with
    ``cfg.preflight`` the memory plan). Returns the checkpoint directory ``resume`` names
    (:func:`~.checkpoints.resolve_resume`; ``None`` for a fresh run), resolved once here so that its warning comes
    before the model loads and the later steps use that same checkpoint.

    Raises:
        ConfigError: naming the Hydra key to change (see :mod:`~megatrain_lightning.recipes_lib.checks`).
        PreflightError: RAM, disk or device memory is short (numbers and what to change).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(missing[0], f"is required and has no value: add {missing[0]}=... to the command line.")
    check_all(OmegaConf.to_container(cfg, resolve=True))
    resumed = resolve_resume(cfg)
    if not cfg.preflight:
        return resumed
    devices = cfg.trainer.get("devices", 1)
    devices = len(devices) if OmegaConf.is_list(devices) else devices if isinstance(devices, int) else 1  # "auto": 1
    model: Any = cfg.model
    local = local_model_config(OmegaConf.to_container(cfg.model, resolve=True))
    if local is not None:  # a local model is planned from its own config.json: the planner reads a directory `config`
        model = {**OmegaConf.to_container(cfg.model, resolve=True), "name": str(local[0]), "config": str(local[0])}
    try:
        p = plan_for_run(model, cfg.hardware, cfg.strategy, batch_size=int(cfg.data.batch_size),
                         seq_len=int(cfg.data.seq_len), precision=str(cfg.trainer.precision), devices=devices,
                         num_nodes=int(cfg.trainer.get("num_nodes", 1) or 1),
                         gradient_clip_val=cfg.trainer.get("gradient_clip_val"), optim=cfg.get("optim"),
                         keep_checkpoints=recipe_checkpoints(cfg))
    except PreflightError:
        raise
    except (ValueError, TypeError) as e:  # a setting the planner cannot take (precision=fp16, ...)
        raise ConfigError("preflight", f"{e} (the planner checks the model, hardware, strategy and trainer "
                          "settings; preflight=false skips it)") from None
    run_dir = Path(cfg.output_dir).absolute()
    while not run_dir.exists():  # the run directory is made later: measure the disk it will be on
        run_dir = run_dir.parent
    nvme = cfg.strategy.get("nvme_path")
    store = Path(nvme) if nvme and Path(nvme).is_dir() else run_dir
    plan_preflight(p, path=str(store), checkpoint_path=str(run_dir))
    return resumed


def recipe_checkpoints(cfg: DictConfig) -> int:
    """Checkpoints on disk at once in a recipe run: 2 with ``checkpoint.every_n_steps`` (``last.ckpt``: the new one
    is written beside the old before it replaces it), else 1 with ``checkpoint.save_final`` (counted with the
    optimizer state, though by default it holds the weights only), else 0."""
    return 2 if cfg.checkpoint.get("every_n_steps") else 1 if cfg.checkpoint.save_final else 0


@contextlib.contextmanager
def refusals_exit(output_dir: str | Path) -> Iterator[None]:
    """Turn a :class:`ConfigError` / ``PreflightError`` into one ``error:`` line on stderr and exit status 2, and
    remove the run directory Hydra made when it holds nothing but Hydra's own files (``.hydra/``, ``*.log``)."""
    try:
        yield
    except (ConfigError, PreflightError) as e:
        out = Path(output_dir)
        if out.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in out.iterdir()):
            shutil.rmtree(out)
            with contextlib.suppress(OSError):
                out.parent.rmdir()  # Hydra's date directory, when this was its only run
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def build_model(cfg: DictConfig) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` from ``cfg.model`` (its ``_target_``, e.g. :func:`~.models.causal_lm`)."""
    return instantiate(cfg.model)


def build_data(cfg: DictConfig, tokenizer: Any) -> Any:
    """The data module from ``cfg.data`` (its ``_target_``), capped at ``cfg.model.max_seq_len`` positions, built
    here so that data that cannot train is one error line.

    Raises:
        ConfigError: (key ``data``) the data module refused the data once tokenized.
    """
    dm = instantiate(cfg.data, tokenizer=tokenizer, max_seq_len=int(cfg.model.max_seq_len))
    if hasattr(dm, "setup"):
        try:
            dm.setup("fit")
        except ValueError as e:
            raise ConfigError("data", str(e)) from None
    return dm


def build_module(cfg: DictConfig, model: torch.nn.Module, tokenizer: Any) -> CausalLMModule:
    """The LightningModule, with :func:`optimizer_kwargs` of ``cfg.optim``; the cosine schedule spans
    ``trainer.max_steps``, or with ``max_steps=-1`` the steps Lightning estimates for ``trainer.max_epochs``."""
    return CausalLMModule(model, tokenizer=tokenizer, total_steps=int(cfg.trainer.max_steps),  # -1: estimated
                          **optimizer_kwargs(cfg.optim))


def optimizer_kwargs(optim: Any) -> dict[str, Any]:
    """A recipe's ``optim`` section as module keywords: ``_target_`` becomes ``optimizer``, the rest stays."""
    d = dict(OmegaConf.to_container(optim, resolve=True)) if not isinstance(optim, dict) else dict(optim)
    if "_target_" in d:
        d["optimizer"] = d.pop("_target_")
    return d


def make_loggers(cfg: DictConfig) -> list[Any]:
    """The Lightning loggers named by ``cfg.logger``, writing under ``<output_dir>/logs`` (files:
    docs/guide/recipes.md, "Loggers"). A wandb run stays open until :func:`closing_loggers` ends it."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    names = [cfg.logger] if isinstance(cfg.logger, str) else list(cfg.logger)
    out = []
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardLogger(cfg.output_dir, name="logs"))
        elif name == "wandb":
            save_dir = Path(cfg.output_dir) / "logs"
            save_dir.mkdir(parents=True, exist_ok=True)  # wandb.init(dir=...) does not create it
            out.append(WandbLogger(save_dir=str(save_dir), offline=True, project="megatrain-lightning"))
        else:
            out.append(CSVLogger(cfg.output_dir, name="logs"))
    return out


@contextlib.contextmanager
def closing_loggers(trainer: pl.Trainer) -> Iterator[None]:
    """Ends the trainer's wandb run when the block exits (also on an error). Lightning's ``WandbLogger`` never
    finishes its run, and a second ``WandbLogger`` in the same process reuses an open one: without this, a second
    ``finetune(cfg)`` in one process (a notebook, the tests) would log into the first run's directory."""
    try:
        yield
    finally:
        if any(type(logger).__name__ == "WandbLogger" for logger in trainer.loggers):
            import wandb

            wandb.finish()  # no-op when no run was started


def log_every(configured: int, max_steps: int) -> int:
    """``trainer.log_every_n_steps``, lowered to ``max_steps // 4`` (at least 1) so a short run still logs."""
    if max_steps is None or max_steps < 1:
        return configured
    return max(1, min(configured, max_steps // 4))


def make_trainer(cfg: DictConfig, kw: dict[str, Any], **options: Any) -> pl.Trainer:
    """``pl.Trainer(strategy=<cfg.strategy>, default_root_dir=cfg.output_dir, **kw, **options)``; a value Lightning
    refuses (``trainer.accelerator=gpu`` without one, ``trainer.val_check_interval=abc``) as a :class:`ConfigError`.
    The recipes build the Trainer before the model, so such a refusal costs no model load.

    Raises:
        ConfigError: (key ``trainer``) Lightning's message."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return pl.Trainer(strategy=instantiate(cfg.strategy), default_root_dir=cfg.output_dir, **kw, **options)
    except (MisconfigurationException, TypeError, ValueError) as e:
        raise ConfigError("trainer", str(e)) from None


def build_trainer(cfg: DictConfig) -> tuple[pl.Trainer, LossHistory]:
    """The Trainer (``cfg.trainer`` kwargs, ``cfg.strategy``, loggers, periodic checkpoints) and the callback that
    records the training loss of every step.

    Raises:
        ConfigError: a ``trainer.*`` value Lightning refuses (:func:`make_trainer`)."""
    kw = OmegaConf.to_container(cfg.trainer, resolve=True)
    kw["log_every_n_steps"] = log_every(int(kw.get("log_every_n_steps", 50)), int(kw.get("max_steps", -1)))
    if cfg.eval.max_batches is not None:
        kw["limit_val_batches"] = int(cfg.eval.max_batches)
    history = LossHistory()
    # resume=last finds runs like this one; a resume with another batch size, accumulation or world size trains
    # every remaining sample of the epoch once (ResumedEpochAlignment)
    callbacks: list[Any] = [history, RecordRunIdentity(run_identity(cfg)), ResumedEpochAlignment(), StepLog()]
    if kw.get("enable_progress_bar", True):  # Lightning's bar, with the epoch total only where max_epochs bounds the run
        callbacks.append(RecipeProgressBar())
    ckpt_cb = checkpoint_callback(cfg)
    if ckpt_cb is not None:
        callbacks.append(ckpt_cb)
        kw["enable_checkpointing"] = True
    return make_trainer(cfg, kw, logger=make_loggers(cfg), callbacks=callbacks), history


@contextlib.contextmanager
def inference_weights(trainer: pl.Trainer) -> Iterator[Any]:
    """Where inference after ``fit`` finds the trained weights; yields the device for the inputs.

    Weights in host memory (the RAM tier, or the NVMe tier when 4 B/param fit in ``host_memory_limit``): the
    plain module, ``None``. Weights only on disk: the engine is installed again, so every forward streams the
    blocks (the KV cache is kept in inference), and yields its device.
    """
    eng = getattr(trainer.strategy, "engine", None)
    if eng is None or eng.closed or not eng.store.masters_on_disk or eng.params.materialized:
        yield None
        return
    eng.install()
    try:
        with torch.no_grad():
            yield eng.device
    finally:
        eng.uninstall()


def evaluate(trainer: pl.Trainer, lm: CausalLMModule, dm: Any, weights: Path | None = None) -> dict[str, float]:
    """Validation loss/perplexity and the domain probe, as ``{"val_loss", "val_ppl", "probe/<key>"...}``; of the
    module's weights, or with ``weights`` of that checkpoint's (a resumed run's "before"). Without validation
    (``data.val_fraction=0`` or ``trainer.limit_val_batches=0``) there is no ``val_loss``/``val_ppl``."""
    outs = trainer.validate(lm, datamodule=dm, verbose=False, ckpt_path=str(weights) if weights else None)
    out = outs[0] if outs else {}
    metrics = {k: float(out[k]) for k in ("val_loss", "val_ppl") if k in out}
    if not metrics:
        log.info("No validation loss: no validation batch ran (data.val_fraction=0 or trainer.limit_val_batches=0).")
    if getattr(dm, "probe", None) is not None:
        t0 = time.perf_counter()
        log.info("probe %s: running...", dm.probe)  # its tqdm bar shows only on a terminal
        with inference_weights(trainer) as dev:
            metrics.update({f"probe/{k}": float(v) for k, v in dm.run_probe(lm.model, device=dev).items()})
        log.info("probe %s: done in %.1f s", dm.probe, time.perf_counter() - t0)
    return metrics


def fit(cfg: DictConfig, trainer: pl.Trainer, lm: CausalLMModule, dm: Any, ckpt: Path | None = None) -> dict[str, Any]:
    """``trainer.fit`` (from ``ckpt``, which :func:`preflight` resolved; ``None``: a fresh run); returns the run
    statistics of the summary table: ``steps`` (the global step at the end), ``steps_run`` (of this ``fit``: fewer
    after a resume), ``seconds``, ``tokens_per_s`` (loss-carrying tokens),
    ``peak_rss_bytes``, ``h2d_bytes``/``d2h_bytes`` (of the last step), ``device``, ``resumed_from``, and for
    instruction data ``examples_left_out`` / ``examples_cut`` (the data module's ``dropped`` / ``truncated``)."""
    t0 = time.perf_counter()
    trainer.fit(lm, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
    seconds = time.perf_counter() - t0
    data = dm.stats().get("train", {}) if hasattr(dm, "stats") else {}
    hist = trainer.strategy.engine.history
    last = hist[-1] if hist else {}
    # every rank's tokens (data parallel: each rank counted its own micro-batches)
    tokens = float(trainer.strategy.reduce(torch.tensor(float(lm.tokens_seen), dtype=torch.float64), reduce_op="sum"))
    return {"steps": trainer.global_step, "steps_run": len(hist), "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
            "peak_rss_bytes": peak_rss_bytes(), "h2d_bytes": last.get("megatrain/h2d_bytes", 0),
            "d2h_bytes": last.get("megatrain/d2h_bytes", 0), "device": trainer.strategy.root_device.type,
            "resumed_from": str(ckpt) if ckpt else None,
            "examples_left_out": data.get("dropped"), "examples_cut": data.get("truncated")}


def save(cfg: DictConfig, trainer: pl.Trainer) -> Path | None:
    """The final checkpoint ``<output_dir>/checkpoint``: ``model/`` (Hugging Face) always, the AdamW state only with
    ``checkpoint.save_optimizer=true`` (``recipes/dpo.py`` has no such key: weights only); ``None`` with
    ``checkpoint.save_final=false``."""
    if not cfg.checkpoint.save_final:
        return None
    path = Path(cfg.output_dir) / "checkpoint"
    trainer.save_checkpoint(path, weights_only=not cfg.checkpoint.get("save_optimizer", False))
    return path


def sample_prompt(cfg: DictConfig, dm: Any) -> str:
    """``sample.prompt``; else, with your data (``data.source`` set), the first held-out record (its prompt, or the
    first 200 characters of its text); else the domain's default prompt."""
    if cfg.sample.prompt:
        return str(cfg.sample.prompt)
    user = cfg.data.get("source") not in (None, "", "offline")
    docs = getattr(dm, "documents", {}).get("val") or getattr(dm, "documents", {}).get("train") or []
    if user and docs:
        d = docs[0]
        if "prompt" in d:
            return d["prompt"]
        if "messages" in d:
            return next((m["content"] for m in d["messages"] if m["role"] == "user"), d["messages"][0]["content"])
        return d["text"][:200]
    return DEFAULT_PROMPTS.get(str(cfg.data.get("domain")), "The")


def sample(cfg: DictConfig, trainer: pl.Trainer, lm: CausalLMModule, tok: Any, dm: Any) -> dict[str, str]:
    """Greedy generation (KV cache, no recompute) on the trained weights, as ``{"prompt", "completion"}``; an
    instruction-shaped run asks in its training format. ``sample.max_new_tokens=0``: ``{}``."""
    if int(cfg.sample.max_new_tokens) == 0:
        return {}
    prompt = sample_prompt(cfg, dm)
    text, special = prompt, True
    if getattr(dm, "shape", "text") == "instruction":
        text, special = generation_prompt(tok, prompt, bool(getattr(dm, "use_chat_template", False)))
    ids = tok(text, return_tensors="pt", add_special_tokens=special).input_ids
    model = lm.model.eval()
    with inference_weights(trainer) as dev, torch.no_grad():
        out = model.generate(ids.to(dev) if dev is not None else ids, max_new_tokens=int(cfg.sample.max_new_tokens),
                             do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id)
    return {"prompt": prompt, "completion": tok.decode(out[0, ids.shape[1]:].cpu(), skip_special_tokens=True)}


def report(cfg: DictConfig, trainer: pl.Trainer, before: dict[str, float], after: dict[str, float], run: dict[str, Any],
           timings: dict[str, float], history: LossHistory, text: dict[str, str], ckpt: Path | None) -> dict[str, Any]:
    """Print the summary table, the checkpoint path and the sample; write ``summary.json``, ``summary.md`` and
    ``loss.png`` (``plot=true``) into ``cfg.output_dir``. Returns the summary mapping."""
    summary = build_summary(before, after, run, timings, history.steps, text, str(ckpt) if ckpt else None,
                            OmegaConf.to_container(cfg, resolve=True))
    if not trainer.is_global_zero:  # data parallel: rank 0 writes and prints the results
        return summary
    paths = write_results(Path(cfg.output_dir), summary, plot=bool(cfg.plot))
    print("\n" + format_table(summary_rows(before or {}, after, run)))
    print("wall time per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    if ckpt:
        print(f"\nHF checkpoint: {ckpt / 'model'}")
    print(f"results: {', '.join(str(p) for p in paths.values())}")
    if text:
        print(f"\nsample ({text['prompt']!r}):\n{text['completion']}\n")
    return summary
