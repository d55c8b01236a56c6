"""Hardware presets and Hydra composition of ``conf/plan.yaml`` (+ ``conf/model``, ``conf/hardware``).

Units used everywhere in the planner: bytes (``*_bytes``), GiB = 2**30 bytes (``*_gib``),
link and disk bandwidths in GB/s = 1e9 bytes/s (``*_gbps``), HBM in TB/s = 1e12 bytes/s,
compute in TFLOP/s = 1e12 FLOP/s, optimizer throughput in G params/s = 1e9 params/s.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

GIB = 2**30


def find_conf_dir() -> Path:
    """The ``conf/`` directory: ``$MEGATRAIN_CONF_DIR``, else the repository's ``conf/`` next to the package (a
    source checkout or an editable install), else ``megatrain_lightning/conf`` in an installed wheel (package data).

    Raises:
        FileNotFoundError: none of these holds a ``plan.yaml`` (names the places looked at).
    """
    pkg = Path(__file__).resolve().parents[1]
    tried = []
    env = os.environ.get("MEGATRAIN_CONF_DIR")
    for cand in ([Path(env)] if env else []) + [pkg.parent / "conf", pkg / "conf"]:
        tried.append(str(cand))
        if (cand / "plan.yaml").is_file():
            return cand
    raise FileNotFoundError(f"no conf/ directory with plan.yaml found (looked at {tried}); set MEGATRAIN_CONF_DIR "
                            "to the repository's conf/ directory")


CONF_DIR = find_conf_dir()

#: chunk sizes (tokens) the planner suggests, and assumes for ``mlp_chunk_size="auto"``: loss 1024 tokens
#: keeps one chunk's fp32 logits at 1024 x 128,256 x 4 B = 501 MiB for Llama 3's vocabulary (2 x with their
#: gradient); MLP 4096 tokens keeps Llama-3.1-70B's intermediate (4 x 28,672 x 2 B per token) at 0.9 GiB.
SUGGESTED_CHUNK = {"loss_chunk_size": 1024, "mlp_chunk_size": 4096}


def strategy_default(name: str) -> Any:
    """``MegaTrainStrategy``'s default for option ``name`` (:class:`~megatrain_lightning.config.MegaTrainConfig`);
    ``None`` when it has no such option (the behaviour the option would turn on is then off)."""
    from ..config import MegaTrainConfig

    return MegaTrainConfig.defaults().get(name)


def loss_chunk_tokens(value: int | str | None, vocab_size: int) -> int | None:
    """Tokens per LM-head chunk for a resolved ``loss_chunk_size`` (:func:`resolve_chunk`): ``"auto"``
    is the engine's rule (``engine/chunked_loss.py``: 256 MiB of fp32 logits, e.g. 523 tokens at a
    128,256-token vocabulary)."""
    if value != "auto":
        return value  # type: ignore[return-value]
    from ..engine.chunked_loss import DEFAULT_LOSS_CHUNK_BYTES, auto_loss_chunk

    return auto_loss_chunk(vocab_size, DEFAULT_LOSS_CHUNK_BYTES)


def resolve_chunk(value: Any, name: str) -> int | None:
    """A chunk-size setting as tokens or ``None`` (off).

    Args:
        value: a positive int, ``None``/``"null"``/``"none"``/``"off"`` (off), ``"default"``
            (:func:`strategy_default`), ``"auto"`` (``loss_chunk_size``: kept, for :func:`loss_chunk_tokens`;
            ``mlp_chunk_size``: ``SUGGESTED_CHUNK``).
        name: the option (``loss_chunk_size`` / ``mlp_chunk_size``).

    Raises:
        ValueError: anything else, naming the option.
    """
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("none", "null", "off", ""):
            return None
        if low == "default":  # MegaTrainConfig checks its defaults: a positive int, "auto" (loss only) or None
            return resolve_chunk(strategy_default(name), name)
        if low == "auto":
            return "auto" if name == "loss_chunk_size" else SUGGESTED_CHUNK[name]  # type: ignore[return-value]
        if low.isdigit():
            value = int(low)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive number of tokens, null (off) or 'default', got {value!r}")
    return value


def is_model_path(value: Any) -> bool:
    """Whether ``value`` names a Hugging Face model directory or a ``*.json`` config file (an existing
    path, or one written as a path: contains a separator, starts with ``.``/``~``, ends in ``.json``)."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    v = os.fspath(value)
    return Path(v).expanduser().exists() or os.sep in v or v.startswith((".", "~")) or v.endswith(".json")


def load_hf_config(path: str | os.PathLike) -> Any:
    """``transformers.AutoConfig`` of a local model directory (its ``config.json``) or a config file; nothing is
    downloaded.

    Raises:
        FileNotFoundError: no such directory/file, or a directory without ``config.json``.
        ValueError: transformers cannot read it (names the file and why).
    """
    import transformers

    p = Path(os.fspath(path)).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        raise FileNotFoundError(f"model={path}: the directory has no config.json (a Hugging Face model directory "
                                "holds one; or pass the path of a config file)")
    if not p.exists():
        raise FileNotFoundError(f"model={path}: no such directory or file (give a conf/model preset name, e.g. "
                                f"model=llama8b, or a local Hugging Face model directory / config.json)")
    try:
        return transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model={path}: transformers.AutoConfig could not read {p}: {e}") from e


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the server around it (a ``conf/hardware/*.yaml`` file).

    ``hbm_gib=None`` means there is no accelerator: the engine's "device" is the CPU and its device buffers come
    out of host RAM. Sources of the numbers are in each YAML file. Optional fields (``None``: not known):

    * ``host_bf16_tflops``: sustained bf16 matmul rate of the host CPUs, TFLOP/s, for Muon's Newton-Schulz
      iterations (:func:`.optimizers.newton_schulz_flops`); ``None``: left out of the step time, and the plan says so.
    * ``block_call_ms``, ``step_overhead_ms``: the engine's fixed CPU time per block call (acquire, bind, run,
      record, release and the workers' hand-offs, outside the block's kernels) and per step (Lightning's loop,
      the optimizer step's bookkeeping), ms, measured by ``bench/block_overhead.py``; counted on a CPU device only,
      where it runs on the cores that compute (on a GPU it overlaps the kernels).
    * ``page_fill_gbps``: GB/s at which a CPU device faults the activations in again each step, after
      ``StreamingEngine.end_step`` gave them back to the kernel (:func:`.measure.page_fill_gbps`).
    * ``host_mem_gbps`` (data parallel, :mod:`.parallel`): sustained host DRAM bandwidth of the whole server, GB/s
      (reads + writes); ``None``: ``host_adam_gparams_per_s`` x 30 B/param (the presets derive the AdamW rate from
      it).
    * ``nvlink_gbps``: GPU-to-GPU bandwidth inside a node, per GPU and direction, GB/s; ``None``: no
      NVLink/Infinity Fabric, the intra-node reduce runs over PCIe at ``d2h_gbps``.
    * ``network_gbps``: inter-node bandwidth of one node (all its NICs together), per direction, GB/s (400 Gb/s =
      50 GB/s); ``None``: a plan with ``num_nodes`` > 1 raises.
    * ``sources`` (not compared): where the figures come from, printed at the top of every plan (keys: ``scope``
      and those of :data:`SOURCE_FIELDS`; each "datasheet", "measured" or "assumed" with a note).
    """

    name: str
    hbm_gib: float | None
    hbm_tbps: float | None
    bf16_tflops: float
    fp32_tflops: float
    h2d_gbps: float
    d2h_gbps: float
    pcie_gen: int | None
    host_ram_gib: float
    nvme_drives: int
    nvme_capacity_gib: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    host_adam_gparams_per_s: float
    host_bf16_tflops: float | None = None
    host_mem_gbps: float | None = None
    nvlink_gbps: float | None = None
    network_gbps: float | None = None
    block_call_ms: float | None = None
    step_overhead_ms: float | None = None
    page_fill_gbps: float | None = None
    sources: Mapping[str, str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Refuse sizes and rates no machine has: every number > 0 (``pcie_gen`` aside), ``nvme_drives`` an integer
        >= 1; the optional fields may be ``None``.

        Raises:
            ValueError: names the field as a Hydra key (``hardware.host_ram_gib``), the value and what to set.
        """
        nullable = {"hbm_gib", "hbm_tbps"} | {f.name for f in fields(self) if f.default is None}
        for f in fields(self):
            if f.name in ("name", "pcie_gen", "sources"):
                continue
            v = getattr(self, f.name)
            if v is None and f.name in nullable:
                continue
            if f.name == "nvme_drives":
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
                want = "an integer >= 1 (NVMe drives the store and the checkpoints are striped over)"
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                want = "a number > 0" + (" or null" if f.name in nullable else "")
            if not ok:
                raise ValueError(f"hardware.{f.name} must be {want}, got {v!r} (preset {self.name!r}): set "
                                 f"hardware.{f.name}=<value> or pick a preset with hardware=<name> "
                                 f"(conf/hardware/*.yaml)")

    @property
    def is_gpu(self) -> bool:
        return self.hbm_gib is not None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | "Hardware") -> "Hardware":
        if isinstance(d, Hardware):
            return d
        d = as_plain_dict(d)
        names = [f.name for f in fields(cls)]
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = [n for n in names if n not in d and n not in optional]
        if missing:
            raise ValueError(f"hardware preset {d.get('name', '?')!r} lacks fields {missing}")
        extra = sorted(set(d) - set(names))
        if extra:
            raise ValueError(f"hardware preset {d.get('name', '?')!r} has unknown fields {extra}; known: {names}")
        return cls(**{n: d[n] for n in names if n in d})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: ``Hardware.sources`` key of each field (what a ``hardware.<field>=`` override makes "set on the command line")
SOURCE_FIELDS = {"hbm_gib": "device", "hbm_tbps": "device", "bf16_tflops": "compute", "fp32_tflops": "compute",
                 "h2d_gbps": "link", "d2h_gbps": "link", "host_ram_gib": "host_ram", "nvme_drives": "nvme",
                 "nvme_capacity_gib": "nvme", "nvme_read_gbps": "nvme", "nvme_write_gbps": "nvme",
                 "host_adam_gparams_per_s": "host_adam"}


def mark_overridden_sources(cfg: Any, overrides: Sequence[str]) -> None:
    """Mark each ``hardware.<field>=`` override of :data:`SOURCE_FIELDS` as "set on the command line" in
    ``cfg.hardware.sources`` (a composed ``DictConfig``, changed in place)."""
    from omegaconf import OmegaConf, open_dict

    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        name = key.removeprefix("hardware.")
        if key.startswith("hardware.") and name in SOURCE_FIELDS and cfg.get("hardware") is not None:
            with open_dict(cfg):
                if cfg.hardware.get("sources") is None:
                    cfg.hardware.sources = OmegaConf.create({})
                src = cfg.hardware.sources.get(SOURCE_FIELDS[name])
                cfg.hardware.sources[SOURCE_FIELDS[name]] = (f"set on the command line ({key}={value})"
                                                            + (f"; preset: {src}" if src else ""))


def as_plain_dict(d: Any) -> dict[str, Any]:
    """A config section as a plain dict: a Hydra ``DictConfig`` (resolved), a :class:`Hardware`, or a mapping."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(d, DictConfig):
        return OmegaConf.to_container(d, resolve=True)  # type: ignore[return-value]
    if isinstance(d, Hardware):
        return d.to_dict()
    return dict(d)


def presets(group: str) -> list[str]:
    """Names of the YAML files in ``conf/<group>/`` (``"model"`` or ``"hardware"``), sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose(overrides: Sequence[str] = ()) -> Any:
    """Compose ``conf/plan.yaml`` with Hydra's compose API and ``overrides`` (``model=llama70b``...)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="megatrain_plan"):
        return hydra_compose(config_name="plan", overrides=list(overrides))


def load_model(name: str) -> dict[str, Any]:
    """The ``conf/model/<name>.yaml`` mapping, or for a path (:func:`is_model_path`) ``{"name": path, "config":
    path}``."""
    if is_model_path(name):
        load_hf_config(name)  # fail here with the message about the path
        return {"name": str(name), "config": str(name)}
    return as_plain_dict(compose([f"model={name}"]).model)


def load_hardware(name: str) -> Hardware:
    """The ``conf/hardware/<name>.yaml`` preset (read without Hydra: the engine's estimate needs only PyYAML).

    Raises:
        ValueError: no such preset (the message lists the presets).
    """
    import yaml

    path = CONF_DIR / "hardware" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"megatrain: no hardware preset {name!r}; use one of {', '.join(presets('hardware'))} "
                         f"(files in {CONF_DIR / 'hardware'}).")
    return Hardware.from_mapping(yaml.safe_load(path.read_text()))
