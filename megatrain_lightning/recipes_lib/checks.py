"""Checks of a composed recipe config that run before anything is built: seconds, not a model load.

:func:`check_all` runs them: the keys (:func:`check_keys`: every key is one something will take), paths and
packages (:func:`check_environment`), values (:func:`check_values`, :func:`check_model`, :func:`check_optim`; the
strategy is built, so its constructor checks its options) and the data (:func:`check_data`: the records read and
split as the run will). Every error is a :class:`ConfigError` naming the Hydra key to change and, where one is
known, the exact override.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..optim.build import accepted, locate
from ..precision import UnsupportedPrecisionError, check_precision
from ..store.nvme import path_refusal

# the recipe's own top-level keys and sub-keys (conf/finetune.yaml); the groups are checked against signatures
RECIPE_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": None, "data": None, "strategy": None, "trainer": None, "hardware": None, "optim": None,
    "seed": (), "preflight": (), "logger": (), "output_dir": (), "resume": (), "plot": (),
    "eval": ("before", "max_batches"),
    "sample": ("prompt", "max_new_tokens"),
    "checkpoint": ("every_n_steps", "save_final", "save_optimizer", "search_dir"),
}
log = logging.getLogger(__name__)
HYDRA_SPECIAL = {"_target_", "_convert_", "_partial_", "_recursive_", "_args_"}
# Trainer arguments the recipe sets itself -> the recipe key to use instead
TRAINER_SET_BY_RECIPE = {"strategy": "strategy=... / strategy.*", "logger": "logger=", "default_root_dir": "output_dir=",
                         "callbacks": "checkpoint.*"}
LOGGERS = {"csv": None, "tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}


class ConfigError(ValueError):
    """A recipe setting that cannot work, found before the model is built.

    Attributes:
        key: the Hydra key to change (``"strategy.lookahead"``, ``"data.source_options.prompt_field"``...).
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def _unknown(prefix: str, given: Iterable[str], allowed: Iterable[str], what: str) -> None:
    allowed = sorted(set(allowed))
    for k in sorted(set(given) - set(allowed) - HYDRA_SPECIAL):
        near = difflib.get_close_matches(k, allowed, n=1)
        hint = f"did you mean {prefix}{near[0]}? " if near else ""
        raise ConfigError(f"{prefix}{k}", f"unknown option ({what}: no {k!r}); {hint}known: {', '.join(allowed)}.")


def check_keys(cfg: Mapping[str, Any], recipe_keys: Mapping[str, tuple[str, ...] | None] = RECIPE_KEYS) -> None:
    """Every key of the composed config is one that something takes: ``strategy.*``/``model.*`` against their
    ``_target_`` (``MegaTrainStrategy``: its config's fields), ``trainer.*`` against ``lightning.pytorch.Trainer``,
    ``optim.*``, ``data.*`` (with ``data.probe.*`` and ``data.source_options.*``; when the recipe has ``data``), and
    the recipe's own keys and groups, ``recipe_keys`` (default: ``recipes/finetune.py``'s).

    Raises:
        ConfigError: the first unknown key, with the closest known one and the list of known ones.
    """
    _unknown("", cfg.keys(), recipe_keys, "the recipe")
    for group, keys in recipe_keys.items():
        if keys and isinstance(cfg.get(group), Mapping):
            _unknown(f"{group}.", cfg[group].keys(), keys, f"the recipe's {group!r} group")
    _check_target("strategy", cfg.get("strategy") or {})
    _check_target("model", cfg.get("model") or {})
    import lightning.pytorch as pl

    trainer = cfg.get("trainer") or {}
    names, _ = accepted(pl.Trainer.__init__)
    _unknown("trainer.", trainer.keys(), names, "lightning.pytorch.Trainer")
    for k, instead in TRAINER_SET_BY_RECIPE.items():
        if k in trainer:
            raise ConfigError(f"trainer.{k}", f"is set by the recipe; use the recipe's own key instead ({instead}).")
    _check_optim_keys(cfg.get("optim") or {})
    if "data" in recipe_keys:
        _check_data_keys(cfg.get("data") or {})


def refuse_misspelt_override(args: list[str], config_name: str, conf_dir: str | os.PathLike,
                              recipe_keys: Mapping[str, tuple[str, ...] | None] = RECIPE_KEYS) -> None:
    """A key override without ``+`` that Hydra cannot apply (``trainer.max_stpes=3``: "not in struct") and that no
    group takes either: one ``error:`` line naming the key meant (``did you mean trainer.max_steps?``), exit 2,
    instead of Hydra's advice to add ``+``. A key some group does take (``trainer.max_epochs=3``, not in
    ``conf/trainer/default.yaml``) and every other case are left to Hydra (its own message). Command lines with
    flags (``--help``, ``-m``, ``--cfg``) are not checked.

    Args:
        args: the command line's overrides (``sys.argv[1:]``).
        config_name, conf_dir: the recipe's Hydra config (``conf_dir/config_name.yaml``).
        recipe_keys: the recipe's own keys, for :func:`check_keys`.

    Raises:
        SystemExit: status 2, after the ``error:`` line on stderr.
    """
    import sys

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    if any(a.startswith("-") for a in args):
        return
    conf, overrides = str(Path(conf_dir).resolve()), list(args)
    for _ in range(len(overrides)):
        try:
            with initialize_config_dir(config_dir=conf, version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=overrides)
            break
        except Exception as e:  # noqa: BLE001 - every other composition error: Hydra's main reports it
            if not isinstance(e, ConfigCompositionException) or "is not in struct" not in str(e.__cause__) \
                    or not str(e).startswith("Could not override '"):
                return
            key = str(e).split("'")[1]
            at = next((i for i, o in enumerate(overrides) if o.split("=", 1)[0] == key), None)
            if at is None:
                return
            overrides[at] = "+" + overrides[at]  # as Hydra suggests; then the project's own check of the keys
        finally:
            GlobalHydra.instance().clear()
    else:
        return
    if overrides == list(args):
        return
    try:
        check_keys(OmegaConf.to_container(cfg, resolve=False), recipe_keys)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _check_optim_keys(optim: Mapping[str, Any]) -> None:
    """``optim.*``: ``CausalLMModule``'s own keys (``lr``, ``weight_decay``, ``betas``, ``warmup_steps``) and the
    keyword arguments of the class ``optim._target_`` names (none: ``torch.optim.AdamW``).

    Raises:
        ConfigError: ``optim._target_`` cannot be imported (with the package to install where known) or is
            ``torch.optim.Muon`` (use ``optim=muon``), or a key neither takes.
    """
    from .module import CausalLMModule

    names, _ = accepted(CausalLMModule.__init__)
    own = names - {"model", "tokenizer", "total_steps", "optimizer"}
    target = str(optim.get("_target_") or "torch.optim.AdamW")
    try:
        cls = locate(target)
    except ImportError as e:
        pkg = {"lion_pytorch": "lion-pytorch", "torchao": "torchao"}.get(target.split(".")[0])
        hint = f" pip install {pkg} (or megatrain-lightning[optim])," if pkg else ""
        raise ConfigError("optim._target_", f"{e}:{hint} or pick another optim= (conf/optim/).") from None
    if target in ("torch.optim.Muon", "torch.optim._muon.Muon"):
        raise ConfigError("optim._target_", "torch.optim.Muon updates 2-D weights only and the strategy steps one "
                          "optimizer: use optim=muon (megatrain_lightning.optim.muon.MuonWithAdamW: Muon for the "
                          "decoder's 2-D weights, AdamW for the rest).")
    cls_names, var_kw = accepted(cls.__init__)
    if not var_kw:
        _unknown("optim.", optim.keys(), own | (cls_names - {"params"}), f"CausalLMModule and {target}")


def _check_target(group: str, node: Mapping[str, Any]) -> None:
    target = node.get("_target_")
    if not target:
        raise ConfigError(f"{group}._target_", f"missing: the {group} entry must name what it builds with _target_.")
    try:
        fn = locate(str(target))
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{group}._target_", f"{target!r} cannot be imported ({e}).") from None
    names, var_kw = accepted(fn)
    options = getattr(fn, "config_class", None)  # MegaTrainStrategy: its **options are MegaTrainConfig's fields
    if options is not None:
        names, var_kw = names | set(options.defaults()), False
    if not var_kw:
        _unknown(f"{group}.", node.keys(), names, str(target).rpartition(".")[2])


def _check_data_keys(data: Mapping[str, Any]) -> None:
    from ..data import DomainDataModule, make_datamodule
    from ..data.datamodule import probe_option_names
    from ..data.factory import OFFLINE
    from ..data.source_user import USER_OPTIONS

    if data.get("_target_") != "megatrain_lightning.data.make_datamodule":
        _check_target("data", data)
        return
    own, _ = accepted(make_datamodule)
    dm, _ = accepted(DomainDataModule.__init__)
    _unknown("data.", data.keys(), (own | dm) - {"tokenizer", "documents", "max_seq_len", "probe_options"},
             "make_datamodule")
    domain, source = data.get("domain"), data.get("source")
    if domain is not None and domain not in OFFLINE:
        raise ConfigError("data.domain", f"unknown domain {domain!r}; choose from {sorted(OFFLINE)} or null (your data).")
    opts = data.get("source_options") or {}
    if source == "offline":
        if domain is None:
            raise ConfigError("data.source", "is required for this data group: data.source=/path/to/your/data.jsonl.")
        names, _ = accepted(OFFLINE[domain][0])
        _unknown("data.source_options.", opts.keys(), names, f"the offline {domain} corpus")
    else:
        _unknown("data.source_options.", opts.keys(), USER_OPTIONS, "a user data source")
    probe = data.get("probe") or {}
    if domain is not None and probe and probe.get("enabled", True):
        _unknown("data.probe.", probe.keys(), probe_option_names(domain) | {"enabled"}, f"the {domain} probe")


def check_data(data: Mapping[str, Any]) -> list[dict]:
    """Read the data source (every record up to :data:`FULL_CHECK_BYTES`, see :func:`_check_whole_source`) and map
    it as the run will; returns its first records (``[]`` for an offline corpus or a Hugging Face dataset id).

    Raises:
        ConfigError: a missing path (``data.source``), a field the records lack (the override that fixes it,
            e.g. ``data.source_options.prompt_field=question``), a shape the source cannot give (``data.shape``),
            a malformed or empty source (``data.source``), a split with no record (``data.val_fraction``).
    """
    from ..data.factory import OFFLINE
    from ..data.records import FieldError
    from ..data.source_user import peek_user_source

    if data.get("_target_") != "megatrain_lightning.data.make_datamodule":
        return []
    domain, source, shape = data.get("domain"), data.get("source"), data.get("shape")
    if source in (None, "", "offline"):
        if domain is None:
            raise ConfigError("data.source", "is required for this data group: data.source=/path/to/your/data.jsonl.")
        native = OFFLINE[domain][1]
        if shape not in (None, native):
            raise ConfigError("data.shape", f"data={domain}'s offline corpus is {native!r} data, not {shape!r}; drop "
                                            f"data.shape (or set data.shape={native}), or point data.source at "
                                            f"{shape} data (e.g. data=instruction data.source=/path/to/pairs.jsonl).")
        return []
    shape = shape or OFFLINE[domain][1]
    options = dict(data.get("source_options") or {})
    try:
        docs = peek_user_source(source, shape, **options)
        _check_whole_source(data, source, shape, options)
        return docs
    except ConfigError:
        raise
    except FileNotFoundError as e:
        raise ConfigError("data.source", str(e)) from None
    except FieldError as e:
        key = "data.shape" if e.option == "shape" else f"data.source_options.{e.option}"
        wanted = ({e.option: e.suggestion} if e.suggestion else {}) | e.also  # the error's option first
        fixes = [("data.shape" if o == "shape" else f"{'' if o in options else '+'}data.source_options.{o}") + f"={v}"
                 for o, v in wanted.items()]
        fix = f" Run with {' '.join(fixes)}." if fixes else ""
        raise ConfigError(key, f"{e}{fix}") from None
    except (ValueError, ImportError) as e:
        raise ConfigError("data.source", str(e)) from None


FULL_CHECK_BYTES = 2**30  # local sources up to this size are read whole in preflight (records, splits)


def _check_whole_source(data: Mapping[str, Any], source: str, shape: str, options: dict) -> None:
    """Read every record of a local source of at most :data:`FULL_CHECK_BYTES` and split it as the data module will
    (:func:`~megatrain_lightning.data.datamodule.split_corpus`), so that a malformed record anywhere, an empty source
    or an empty split is refused before the model loads. Larger sources: checked when the data module is built.

    Raises:
        the errors of ``load_user_source`` and ``split_corpus`` (ValueError, FieldError, TypeError).
    """
    from ..data.datamodule import split_corpus
    from ..data.source_user import load_user_source, source_files

    path = Path(str(source)).expanduser()
    if not path.exists():  # a Hugging Face dataset id: read when the data module is built
        return
    size = sum(p.stat().st_size for p in source_files(path, shape))  # the files the run reads, not the others
    if size > FULL_CHECK_BYTES:
        log.info("data.source %s holds %.1f GiB: preflight checked its first records; the rest is checked when the "
                 "data is built, after the model loads.", source, size / 2**30)
        return
    docs = load_user_source(path, shape, **options)  # raises for a source with no record
    if shape == "instruction" and all("messages" in d and not any(m["role"] == "assistant" for m in d["messages"])
                                      for d in docs):
        raise ValueError(f"{source}: no record has an assistant turn, so there is nothing to train on (chat records "
                         "need the answer as a message with role 'assistant', ShareGPT's from='gpt').")
    try:
        split_corpus(docs, shape, float(data.get("val_fraction", 0.05)), int(data.get("seed", 0)),
                     data.get("max_documents"))
    except ValueError as e:
        if "validation split" in str(e):
            raise ConfigError("data.val_fraction", f"{e} ({source})") from None
        raise


def check_environment(cfg: Mapping[str, Any]) -> None:
    """Paths and packages: the NVMe directory, the logger's package (and a warning when ``plot=true`` has no
    matplotlib: the run goes on without ``loss.png``).

    Raises:
        ConfigError: naming ``strategy.nvme_path`` (or the ``MEGATRAIN_NVME_PATH`` variable), ``logger``, ``resume``.
    """
    s = cfg.get("strategy") or {}
    if "nvme" in (s.get("offload_params"), s.get("offload_optimizer")):
        path = s.get("nvme_path") or os.environ.get("MEGATRAIN_NVME_PATH")
        if not path:
            raise ConfigError("strategy.nvme_path", "the NVMe tier needs a directory on a fast local disk: set "
                                                    "strategy.nvme_path=/mnt/nvme or export MEGATRAIN_NVME_PATH=/mnt/nvme.")
        if not Path(path).is_dir():
            src = "strategy.nvme_path" if s.get("nvme_path") else "MEGATRAIN_NVME_PATH"
            raise ConfigError("strategy.nvme_path", f"{path} (from {src}) is not an existing directory; create it or "
                                                    "set strategy.nvme_path= / MEGATRAIN_NVME_PATH to one.")
        refusal = path_refusal(Path(path))  # a read-only or another user's directory
        if refusal:
            raise ConfigError("strategy.nvme_path", refusal)
    loggers = cfg.get("logger")
    names = [loggers] if isinstance(loggers, str) else list(loggers or [])
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError("logger", f"{twice} listed more than once: each logger writes its own files under "
                                    "output_dir, so two of one kind would write the same files; list each once.")
    for logger in names:
        if logger not in LOGGERS:
            raise ConfigError("logger", f"unknown logger {logger!r}; choose from {sorted(LOGGERS)} (or a list of them).")
        pkgs = LOGGERS[logger]
        if pkgs and not any(importlib.util.find_spec(p) for p in pkgs):
            raise ConfigError("logger", f"logger={logger} needs the {pkgs[0]!r} package: pip install "
                                        f"'megatrain-lightning[loggers]' (or pip install {pkgs[0]}), or use logger=csv.")
    if cfg.get("plot") and importlib.util.find_spec("matplotlib") is None:  # said now, not after the run
        log.warning("plot=true but matplotlib is not installed: this run writes no loss.png (pip install "
                    "'megatrain-lightning[plots]'; plot=false silences this).")


def check_int(key: str, value: Any, low: int, what: str, extra: tuple = ()) -> None:
    """Raise ``ConfigError(key, ...)`` unless ``value`` is an int >= ``low`` or one of ``extra`` (-1, None)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not ((is_int and (value >= low or value in extra)) or (value is None and None in extra)):
        raise ConfigError(key, f"must be {what}; got {value!r}.")


FINETUNE_BOOLEANS = ("preflight", "eval.before", "checkpoint.save_final", "checkpoint.save_optimizer", "plot",
                     "data.probe.enabled", "trainer.enable_checkpointing", "trainer.enable_progress_bar")
"""The keys of ``recipes/finetune.py`` whose value is ``true`` or ``false`` (a test compares them with ``conf/``)."""


def check_booleans(cfg: Mapping[str, Any], keys: Iterable[str]) -> None:
    """Raise ``ConfigError(key, ...)`` for the first of ``keys`` (dotted) set to anything but ``true``/``false``
    (or null). Hydra reads only ``true``/``false`` as booleans: ``eval.before=no`` would stay the string ``"no"``,
    which the recipe would take as true."""
    for key in keys:
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None and not isinstance(node, bool):
            raise ConfigError(key, f"must be true or false; got {node!r}.")


def _devices_ok(value: Any) -> bool:
    """``Trainer(devices=)`` as Lightning takes it: an int >= 1 or -1, ``"auto"``, a list of GPU indices, or a
    string of them (``"0,1"``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1 or value == -1
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if isinstance(value, str):
        v = value.strip()
        return v == "auto" or v == "-1" or bool(v) and all(p.strip().isdigit() for p in v.rstrip(",").split(","))
    return False


def local_model_config(model: Mapping[str, Any]) -> tuple[Path, Any] | None:
    """``(directory, transformers config)`` of the local model the run loads (``model.weights`` a directory; it
    wins over ``model.gguf``), read from its ``config.json`` (no weights loaded, nothing downloaded);
    ``None`` for a hub id, a GGUF or a random initialisation (``model.config``).

    Raises:
        ConfigError: (``model.weights``) written as a local path but no directory, no ``config.json`` in it, or a
            ``config.json`` transformers cannot read.
    """
    weights = model.get("weights")
    if not weights or not isinstance(weights, str):
        return None
    d = Path(weights).expanduser()
    if not (d.is_absolute() or weights.startswith((".", "~")) or d.exists() or Path(d.parts[0]).exists()):
        return None  # written as a hub id (``org/name``), not as a local path
    if not d.is_dir():
        raise ConfigError("model.weights", f"{weights} is not an existing directory (a local Hugging Face model "
                                           "directory: config.json + safetensors); fix the path, or give a hub id.")
    if not (d / "config.json").is_file():
        raise ConfigError("model.weights", f"{weights} has no config.json: it is not a Hugging Face model directory "
                                           "(e.g. a run's <run>/checkpoint/model).")
    from ..planning.config import load_hf_config

    try:
        return d, load_hf_config(d)
    except (OSError, ValueError) as e:
        raise ConfigError("model.weights", str(e)) from None


def command_line_overrides() -> list[str]:
    """The run's command-line overrides (Hydra's ``hydra.overrides.task``); ``[]`` outside a Hydra run (a config
    composed in a script or test)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def refuse_config_with_weights(model: Mapping[str, Any], overrides: Iterable[str]) -> None:
    """With ``model.weights`` the model's shapes are those of its ``config.json``: a ``model.config.*`` override
    would be ignored, and the run would train another model than the one asked for.

    Raises:
        ConfigError: naming the first ``model.config.*`` override."""
    if not model.get("weights"):
        return
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith("model.config."):
            raise ConfigError(key, f"does not apply with model.weights={model['weights']}: the model is built from "
                                   "the weights' own config.json. Drop the model.config overrides, or drop "
                                   "model.weights (and give model.gguf=null) to train a random initialisation of "
                                   "model.config.")


def check_model(model: Mapping[str, Any], data: Mapping[str, Any], overrides: Iterable[str] = ()) -> None:
    """``model.max_seq_len`` is a positive int, ``model.weights`` (a local path) is a model directory, no
    ``model.config.*`` override comes with it (:func:`refuse_config_with_weights`), and ``data.seq_len`` is within
    ``model.max_seq_len`` and the positions of the local model's ``config.json``.

    Raises:
        ConfigError: naming ``model.max_seq_len``, ``model.weights``, ``model.config.<key>`` or ``data.seq_len``,
            with the numbers.
    """
    refuse_config_with_weights(model, overrides)
    check_int("model.max_seq_len", model.get("max_seq_len"), 1, "a positive int (the recipe's sequence cap, tokens)")
    limit, seq = model["max_seq_len"], data.get("seq_len")
    if isinstance(seq, int) and seq > limit:
        raise ConfigError("data.seq_len", f"={seq} is longer than the model's maximum of {limit} positions "
                                          f"(model.max_seq_len); use data.seq_len={limit} or less.")
    local = local_model_config(model)
    # the positions the config allows (max_position_embeddings, GPT-2's n_positions)
    limits = (getattr(local[1], n, None) for n in ("max_position_embeddings", "n_positions", "n_ctx")) if local else ()
    positions = next((v for v in limits if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
    if isinstance(seq, int) and positions is not None and seq > positions:
        raise ConfigError("data.seq_len", f"={seq} is longer than the model's maximum of {positions} positions "
                          f"({local[0] / 'config.json'}, model.weights); use data.seq_len={positions} or less.")


def _float(key: str, value: Any, low: float, high: float | None, what: str, low_open: bool = False) -> None:
    """Raise ``ConfigError(key, ...)`` unless ``value`` is a number in ``[low, high)`` (``(low, high)`` with
    ``low_open``; no upper bound with ``high=None``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        raise ConfigError(key, f"must be {what}; got {value!r}.")


def check_optim(optim: Mapping[str, Any]) -> None:
    """``optim.lr`` > 0, ``optim.weight_decay`` >= 0, ``optim.betas`` two numbers in [0, 1), ``optim.warmup_steps``
    an int >= 0 (:class:`~.module.CausalLMModule`'s settings; the optimizer class checks its own keywords).

    Raises:
        ConfigError: the first bad value, naming its key.
    """
    if "lr" in optim:
        _float("optim.lr", optim["lr"], 0.0, None, "a number > 0 (the peak learning rate, e.g. 1e-4)", low_open=True)
    if "weight_decay" in optim:
        _float("optim.weight_decay", optim["weight_decay"], 0.0, None, "a number >= 0 (the optimizer's weight decay)")
    betas = optim.get("betas", (0.9, 0.95))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ConfigError("optim.betas", f"must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]; got {betas!r}.")
    for b in betas:
        _float("optim.betas", b, 0.0, 1.0, "two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
    check_int("optim.warmup_steps", optim.get("warmup_steps", 0), 0, "an int >= 0 (optimizer steps)")


def check_values(cfg: Mapping[str, Any]) -> None:
    """The recipe's numeric settings have usable values, and the strategy group builds (its constructor checks
    every strategy option).

    Raises:
        ConfigError: the first bad value, naming its key.
    """
    trainer, data = cfg.get("trainer") or {}, cfg.get("data") or {}
    check_int("trainer.max_steps", trainer.get("max_steps", -1), 1, "a positive int (optimizer steps), or -1 to train "
         "trainer.max_epochs epochs", extra=(-1,))
    if "max_epochs" in trainer:
        check_int("trainer.max_epochs", trainer["max_epochs"], 1, "a positive int, -1 or null (unlimited)", extra=(-1, None))
    devices = trainer.get("devices", 1)
    if not _devices_ok(devices):
        raise ConfigError("trainer.devices", "must be a positive int (processes per node, one per GPU), 'auto', -1 "
                          f"(every GPU) or a list of GPU indices; got {devices!r}.")
    check_int("trainer.num_nodes", trainer.get("num_nodes", 1), 1, "a positive int (machines, each running this command)")
    strategy = cfg.get("strategy") or {}
    nodes = trainer.get("num_nodes", 1)
    world = (len(devices) if isinstance(devices, (list, tuple)) else devices if isinstance(devices, int) else 1) * nodes
    if world > 1 and strategy.get("offload_params") == "nvme" and (nodes != 1 or strategy.get("offload_optimizer") != "nvme"):
        raise ConfigError("strategy", f"masters on NVMe (offload_params=nvme) with several processes run on one node "
                          f"with strategy.offload_optimizer=nvme for now, and trainer.devices={devices} x "
                          f"trainer.num_nodes={nodes} start {world} with offload_optimizer="
                          f"{strategy.get('offload_optimizer')}: add strategy.offload_params=cpu (the masters once per "
                          "node in shared memory, the optimizer state still on NVMe), use strategy=megatrain (state in "
                          "host RAM), or trainer.num_nodes=1.")
    try:
        check_precision(trainer.get("precision", "32-true"))
    except UnsupportedPrecisionError as e:
        raise ConfigError("trainer.precision", str(e)) from None
    check_int("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), 1,
         "a positive int (micro-batches per optimizer step)")
    check_int("trainer.log_every_n_steps", trainer.get("log_every_n_steps", 50), 1, "a positive int (optimizer steps)")
    check_booleans(cfg, FINETUNE_BOOLEANS)
    for k in ("batch_size", "seq_len"):
        if k in data:
            check_int(f"data.{k}", data[k], 1, "a positive int")
    check_model(cfg.get("model") or {}, data, command_line_overrides())
    vf = data.get("val_fraction", 0.0)
    if not isinstance(vf, (int, float)) or isinstance(vf, bool) or not 0.0 <= vf < 1.0:
        raise ConfigError("data.val_fraction", f"must be a number in [0, 1) (the share of records held out for "
                                               f"validation; 0: none), got {vf!r}.")
    check_optim(cfg.get("optim") or {})
    check_int("checkpoint.every_n_steps", (cfg.get("checkpoint") or {}).get("every_n_steps"), 1,
         "a positive int (optimizer steps) or null (no periodic checkpoint)", extra=(None,))
    check_int("eval.max_batches", (cfg.get("eval") or {}).get("max_batches"), 1, "a positive int (validation batches "
         "per evaluation) or null (trainer.limit_val_batches); to skip an evaluation set eval.before=false", extra=(None,))
    check_int("sample.max_new_tokens", (cfg.get("sample") or {}).get("max_new_tokens", 0), 0,
         "an int >= 0 (tokens; 0: no sample)")
    if strategy.get("_target_"):
        kwargs = {k: v for k, v in strategy.items() if k not in HYDRA_SPECIAL}
        try:
            locate(strategy["_target_"])(**kwargs)
        except (ValueError, TypeError) as e:
            raise ConfigError("strategy", str(e).removeprefix("megatrain: ")) from None


def check_all(cfg: Mapping[str, Any]) -> list[dict]:
    """:func:`check_keys`, :func:`check_environment`, :func:`check_values`, then :func:`check_data`; returns the
    peeked documents."""
    check_keys(cfg)
    check_environment(cfg)
    check_values(cfg)
    return check_data(cfg.get("data") or {})
