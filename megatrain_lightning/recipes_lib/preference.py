"""The steps of the preference recipe (``recipes/dpo.py``): pairs, module, trainer, evaluation, report.

The offline default turns the biomedical corpus's MeSH-category questions (``data/source_biomedical.py``) into
preference pairs: ``chosen`` is the short correct category (what the exact-match probe expects), ``rejected`` is
either another category (every other pair) or the correct category in a full sentence ("The MeSH category of X is
Y."), the form the instruct model answers in before training. Only questions with one category are used, so that
the probe's exact match is reachable; pairs are split into training and held-out questions by a hash of the drug.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from ..data import ResumableDataLoader
from ..data.corpus import unit_hash
from ..data.formatting import generation_prompt
from ..data.probes import biomedical_probe
from ..preference import DPOModule, PreferenceDataError, PreferenceDataset, collate_pairs
from .checks import (ConfigError, check_booleans, check_int, check_keys, command_line_overrides,
                     refuse_config_with_weights)
from .console import RecipeProgressBar
from .models import tokenizer_for
from .results import format_table, peak_rss_bytes
from .run import inference_weights, make_trainer, optimizer_kwargs

log = logging.getLogger(__name__)


def biomedical_preference_records(seed: int = 0, val_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` preference records in the conversational form (see the module docstring), each with
    ``"answer"``: the correct category (what the probe compares with)."""
    from ..data.source_biomedical import biomedical_pairs

    docs = [d for d in biomedical_pairs(["mesh_category"]) if ";" not in d["response"]]
    categories = sorted({d["response"] for d in docs})
    train, held = [], []
    for i, d in enumerate(docs):
        drug = d["prompt"].removeprefix("What is the MeSH category of ").removesuffix("?")
        if i % 2 == 0:
            pick = int(hashlib.sha256(d["id"].encode()).hexdigest(), 16) % (len(categories) - 1)
            rejected = [c for c in categories if c != d["response"]][pick]
        else:
            rejected = f"The MeSH category of {drug} is {d['response']}."
        rec = {"prompt": [{"role": "user", "content": d["prompt"]}],
               "chosen": [{"role": "assistant", "content": d["response"]}],
               "rejected": [{"role": "assistant", "content": rejected}], "answer": d["response"]}
        (held if unit_hash(d["group"], seed) < val_fraction else train).append(rec)
    return train, held


def load_preference_records(source: str, limit: int | None = None) -> list[dict]:
    """Records with ``prompt``/``chosen``/``rejected`` from a ``.jsonl``, ``.json`` (a list, or ``{"data": [...]}``)
    or ``.parquet`` file, or a Hugging Face dataset id (its ``train`` split; needs ``datasets``).

    Raises:
        ConfigError: (key ``preference.source``) the file does not exist, its type is unknown, or ``datasets`` is
            missing for a dataset id."""
    path = Path(source).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
        rows = data["data"] if isinstance(data, dict) and "data" in data else data
    elif path.suffix == ".parquet" and path.is_file():
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json", ".parquet"):
        raise ConfigError("preference.source", f"{path} does not exist.")
    elif "/" in source and not path.exists():
        try:
            import datasets
        except ImportError:
            raise ConfigError("preference.source", f"{source!r} looks like a Hugging Face dataset id: "
                              "pip install datasets, or give a .jsonl/.json/.parquet file.") from None
        rows = list(datasets.load_dataset(source, split="train"))
    else:
        raise ConfigError("preference.source", f"{source!r} is not a .jsonl/.json/.parquet file or a dataset id.")
    return rows[:limit] if limit else rows


class PreferenceData(pl.LightningDataModule):
    """Training and held-out pairs as :class:`PreferenceDataset`s, batched by ``collate_pairs`` in order (the
    recipes' ``ResumableDataLoader``), and the held-out questions the probe asks (``probe_items``)."""

    def __init__(self, train: PreferenceDataset, val: PreferenceDataset | None, batch_size: int, pad_id: int,
                 probe_items: list[dict]) -> None:
        super().__init__()
        self.train, self.val, self.batch_size, self.pad_id = train, val, batch_size, pad_id
        self.probe_items = probe_items

    def _loader(self, pairs: PreferenceDataset) -> ResumableDataLoader:
        return ResumableDataLoader(pairs, batch_size=self.batch_size,
                                   collate_fn=functools.partial(collate_pairs, pad_id=self.pad_id))

    def train_dataloader(self) -> ResumableDataLoader:
        return self._loader(self.train)

    def val_dataloader(self) -> Any:
        return [] if self.val is None else self._loader(self.val)


#: ``recipes/dpo.py``'s own keys and sub-keys (``conf/dpo.yaml``); the groups are checked against signatures
DPO_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": None, "strategy": None, "trainer": None, "hardware": None, "optim": None,
    "seed": (), "plot": (), "output_dir": (),
    "preference": ("source", "max_length", "batch_size", "val_fraction", "max_train", "max_val"),
    "dpo": ("loss_type", "beta", "gamma", "sft_weight", "reference", "logps_chunk_size", "cache_dir"),
    "probe": ("enabled", "max_items", "max_new_tokens", "batch_size"),
    "sample": ("prompt", "max_new_tokens"),
    "checkpoint": ("save_final",),
}


DPO_BOOLEANS = ("checkpoint.save_final", "plot", "probe.enabled", "trainer.enable_checkpointing",
                "trainer.enable_progress_bar")
"""The keys of ``recipes/dpo.py`` whose value is ``true`` or ``false`` (a test compares them with ``conf/``)."""


def check_values(cfg: DictConfig) -> None:
    """The recipe's own numbers and yes/no keys have usable values (the Trainer checks ``trainer.*`` when built).

    Raises:
        ConfigError: the first bad value, naming its key."""
    check_booleans(cfg, DPO_BOOLEANS)
    refuse_config_with_weights(cfg.model, command_line_overrides())
    p = cfg.preference
    check_int("preference.batch_size", p.batch_size, 1, "a positive int (pairs per micro-batch)")
    check_int("preference.max_length", p.max_length, 2, "an int >= 2 (tokens of prompt and answer)")
    for key in ("max_train", "max_val"):
        check_int(f"preference.{key}", p.get(key), 1, "a positive int (pairs) or null (all)", extra=(None,))
    vf = p.val_fraction
    if isinstance(vf, bool) or not isinstance(vf, (int, float)) or not 0.0 <= vf < 1.0:
        raise ConfigError("preference.val_fraction", f"must be a number in [0, 1) (the share of pairs held out for "
                                                     f"validation; 0: none), got {vf!r}.")
    check_int("probe.max_items", cfg.probe.max_items, 0, "an int >= 0 (held-out questions asked; 0: none)")
    check_int("probe.max_new_tokens", cfg.probe.max_new_tokens, 1, "a positive int (tokens per answer)")
    check_int("probe.batch_size", cfg.probe.batch_size, 1, "a positive int (questions per generate call)")
    check_int("sample.max_new_tokens", cfg.sample.max_new_tokens, 0, "an int >= 0 (tokens; 0: no sample)")


def preflight(cfg: DictConfig) -> Any:
    """What can be checked before the model is built: every key is one something takes (:data:`DPO_KEYS`,
    :func:`~.checks.check_keys`), required keys, the ``dpo`` options, and the tokenizer (the pairs are checked by
    :func:`build_pairs`, still before the weights load). Returns the tokenizer.

    Raises:
        ConfigError: naming the Hydra key to change."""
    check_keys(OmegaConf.to_container(cfg, resolve=False), DPO_KEYS)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(missing[0], f"is required and has no value: add {missing[0]}=... to the command line.")
    check_values(cfg)
    if cfg.dpo.loss_type == "simpo" and cfg.dpo.reference is not None:  # the library says "leave it unset"
        raise ConfigError("dpo.reference", f"dpo.loss_type=simpo uses no reference model, and dpo.reference is "
                          f"{cfg.dpo.reference!r} (conf/dpo.yaml's default): add dpo.reference=null.")
    try:
        DPOModule.check_options(cfg.dpo.loss_type, cfg.dpo.beta, cfg.dpo.reference, cfg.dpo.logps_chunk_size,
                                cfg.dpo.get("sft_weight", 0.0))
    except ValueError as e:
        raise ConfigError("dpo", str(e).removeprefix("megatrain: ")) from None
    if cfg.dpo.reference == "adapter":  # the recipe builds no peft model (the library path takes one)
        raise ConfigError("dpo.reference", "'adapter' takes a peft model with its adapter disabled as the reference, "
                          "but this recipe trains the full model: use dpo.reference=precompute or copy, or "
                          "DPOModule(peft_model, reference='adapter') in your own script (docs/guide/preference.md).")
    return tokenizer_for(**OmegaConf.to_container(cfg.model, resolve=True))


def build_pairs(cfg: DictConfig, tokenizer: Any) -> PreferenceData:
    """The data of ``cfg.preference``, encoded and checked before the model is built.

    Raises:
        ConfigError: (key ``preference.source``) a record cannot be trained on (the message names it and why)."""
    p = cfg.preference
    if p.source == "offline":
        train, held = biomedical_preference_records(int(cfg.seed), float(p.val_fraction))
    else:
        rows = load_preference_records(str(p.source))
        held = [r for i, r in enumerate(rows) if unit_hash(str(i), int(cfg.seed)) < float(p.val_fraction)]
        train = [r for i, r in enumerate(rows) if not unit_hash(str(i), int(cfg.seed)) < float(p.val_fraction)]
    train = train[: int(p.max_train)] if p.max_train else train
    val = held[: int(p.max_val)] if p.max_val else held
    try:
        train_ds = PreferenceDataset(train, tokenizer, int(p.max_length))
        val_ds = PreferenceDataset(val, tokenizer, int(p.max_length)) if val else None
    except PreferenceDataError as e:
        raise ConfigError("preference.source", str(e).removeprefix("megatrain: ")) from None
    probe = [{"prompt": r["prompt"][0]["content"], "response": r["answer"]} for r in held if "answer" in r]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    log.info("preference pairs: %d training, %d held out", len(train_ds), len(val_ds) if val_ds else 0)
    return PreferenceData(train_ds, val_ds, int(p.batch_size), int(pad or 0), probe)


def build_module(cfg: DictConfig, model: torch.nn.Module, tokenizer: Any) -> DPOModule:
    """``DPOModule`` with ``cfg.dpo`` and ``cfg.optim`` (``conf/optim/<name>.yaml`` with
    ``conf/optim_dpo/<name>.yaml``'s values for preference training); ``tokenizer`` is saved in the checkpoint's
    ``model/``."""
    return DPOModule(model, **OmegaConf.to_container(cfg.dpo, resolve=True), **optimizer_kwargs(cfg.optim),
                     tokenizer=tokenizer)


class StepHistory(pl.Callback):
    """Loss and reward margin after each optimizer step (the last micro-batch's values)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step > len(self.steps):
            m = trainer.callback_metrics
            self.steps.append({"step": trainer.global_step, "loss": float(m.get("train_loss", float("nan"))),
                               "margin": float(m.get("rewards/margins", float("nan"))),
                               "accuracy": float(m.get("rewards/accuracies", float("nan")))})
            log.info("step %d: loss %.4f, reward margin %.4f", trainer.global_step, self.steps[-1]["loss"],
                     self.steps[-1]["margin"])


def evaluate(cfg: DictConfig, trainer: pl.Trainer, module: DPOModule, data: PreferenceData,
             tokenizer: Any) -> dict[str, float]:
    """Held-out preference metrics (``val_loss``, ``val_rewards/accuracies``, ``val_rewards/margins``) and, where the
    data has answers (the offline default), the exact-match probe (``probe/exact_match``). Before ``fit`` with
    ``"precompute"``: :meth:`DPOModule.starting_weights_as_reference`."""
    metrics: dict[str, float] = {}
    start = module.reference == "precompute" and module.reference_logps is None
    if data.val is not None and cfg.trainer.limit_val_batches != 0:
        with module.starting_weights_as_reference() if start else contextlib.nullcontext():
            out = trainer.validate(module, datamodule=data, verbose=False)
        metrics.update({k: float(v) for k, v in (out[0] if out else {}).items()
                        if k in ("val_loss", "val_rewards/accuracies", "val_rewards/margins")})
    if cfg.probe.enabled and data.probe_items:
        t0 = time.perf_counter()
        log.info("probe: %d held-out questions, greedy answers...", min(len(data.probe_items), int(cfg.probe.max_items)))
        with inference_weights(trainer) as dev:
            out = biomedical_probe(module.model, tokenizer, data.probe_items, device=dev,
                                   max_items=int(cfg.probe.max_items), batch_size=int(cfg.probe.batch_size),
                                   max_new_tokens=int(cfg.probe.max_new_tokens))
        metrics.update({f"probe/{k}": float(v) for k, v in out.items()})
        log.info("probe: exact match %.3f in %.1f s", out["exact_match"], time.perf_counter() - t0)
    return metrics


def sample(cfg: DictConfig, trainer: pl.Trainer, module: DPOModule, tokenizer: Any,
           data: PreferenceData) -> dict[str, str]:
    """A greedy answer to the first held-out question (or ``sample.prompt``); ``{}`` with ``sample.max_new_tokens=0``."""
    if int(cfg.sample.max_new_tokens) == 0 or not (cfg.sample.prompt or data.probe_items):
        return {}
    prompt = str(cfg.sample.prompt or data.probe_items[0]["prompt"])
    chat = bool(getattr(tokenizer, "chat_template", None))
    text, special = generation_prompt(tokenizer, prompt, chat)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids
    model = module.model.eval()
    with inference_weights(trainer) as dev, torch.no_grad():
        out = model.generate(ids.to(dev) if dev is not None else ids, max_new_tokens=int(cfg.sample.max_new_tokens), do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return {"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1]:].cpu(), skip_special_tokens=True)}


def report(cfg: DictConfig, trainer: pl.Trainer, before: dict[str, float], after: dict[str, float],
           run: dict[str, Any], timings: dict[str, float], history: StepHistory, text: dict[str, str],
           ckpt: Path | None) -> dict[str, Any]:
    """Print the table; write ``summary.json``, ``summary.md`` and (``plot=true``) ``loss.png`` (loss and reward
    margin per step) into ``cfg.output_dir``. Returns the summary."""
    summary = {"metrics": {k: {"before": before.get(k), "after": after.get(k)} for k in sorted({*before, *after})},
               "run": run, "timings": timings, "steps": history.steps, "sample": text,
               "checkpoint": str(ckpt) if ckpt else None, "config": OmegaConf.to_container(cfg, resolve=True)}
    if not trainer.is_global_zero:
        return summary
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    rows = [(k, "" if v["before"] is None else f"{v['before']:.4f}", "" if v["after"] is None else f"{v['after']:.4f}")
            for k, v in summary["metrics"].items()]
    rows += [("optimizer steps", "", str(run["steps"])), ("train seconds", "", f"{run['seconds']:.1f}"),
             ("peak RSS", "", f"{run['peak_rss_bytes'] / 2**30:.2f} GiB")]
    table = format_table(rows)
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    (out / "summary.md").write_text(f"# Preference run\n\n```\n{table}\n```\n\nwall time per phase: {phases}\n")
    if cfg.plot and history.steps:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            steps = [s["step"] for s in history.steps]
            ax.plot(steps, [s["loss"] for s in history.steps], label="loss")
            ax.plot(steps, [s["margin"] for s in history.steps], label="reward margin")
            ax.set_xlabel("optimizer step")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "loss.png", dpi=100)
            plt.close(fig)
        except ImportError:
            log.info("no loss.png: pip install 'megatrain-lightning[plots]'")
    print("\n" + table)
    print("wall time per phase: " + phases)
    if ckpt:
        print(f"\ncheckpoint: {ckpt}")
    if text:
        print(f"\nsample ({text['prompt']!r}):\n{text['completion']}\n")
    return summary


def build_trainer(cfg: DictConfig, history: StepHistory) -> pl.Trainer:
    """The Trainer: ``cfg.trainer`` keyword arguments, ``cfg.strategy``, a CSV logger under ``<output_dir>/logs``, the
    recipes' progress bar (as ``recipes/finetune.py``'s)."""
    from lightning.pytorch.loggers import CSVLogger

    kw = OmegaConf.to_container(cfg.trainer, resolve=True)
    bar = [RecipeProgressBar()] if kw.get("enable_progress_bar", True) else []
    return make_trainer(cfg, kw, logger=CSVLogger(str(Path(cfg.output_dir) / "logs")), callbacks=[history, *bar])


def fit(trainer: pl.Trainer, module: DPOModule, data: PreferenceData) -> dict[str, Any]:
    """``trainer.fit``; the run's steps, seconds and peak RSS."""
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    return {"steps": trainer.global_step, "seconds": time.perf_counter() - t0, "peak_rss_bytes": peak_rss_bytes()}
