"""Hardware presets and Hydra composition of ``conf/plan.yaml`` (+ ``conf/model``, ``conf/hardware``).

Units used everywhere in the planner: bytes (``*_bytes``), GiB = 2**30 bytes (``*_gib``),
link and disk bandwidths in GB/s = 1e9 bytes/s (``*_gbps``), HBM in TB/s = 1e12 bytes/s,
compute in TFLOP/s = 1e12 FLOP/s, optimizer throughput in G params/s = 1e9 params/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

GIB = 2**30
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the server around it (a ``conf/hardware/*.yaml`` file).

    ``hbm_gib=None`` means there is no accelerator: the engine's "device" is the CPU and its
    device buffers come out of host RAM. Sources of the numbers are in each YAML file.
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

    @property
    def is_gpu(self) -> bool:
        return self.hbm_gib is not None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | "Hardware") -> "Hardware":
        if isinstance(d, Hardware):
            return d
        d = _plain(d)
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"hardware preset {d.get('name', '?')!r} lacks fields {missing}")
        extra = sorted(set(d) - set(names))
        if extra:
            raise ValueError(f"hardware preset {d.get('name', '?')!r} has unknown fields {extra}; known: {names}")
        return cls(**{n: d[n] for n in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _plain(d: Any) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(d, DictConfig):
            return OmegaConf.to_container(d, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - hydra-core is a dependency
        pass
    return dict(d)


def presets(group: str) -> list[str]:
    """Names of the YAML files in ``conf/<group>/`` (``"model"`` or ``"hardware"``), sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose(overrides: Sequence[str] = ()) -> Any:
    """Compose ``conf/plan.yaml`` with Hydra's compose API and return the ``DictConfig``.

    Args:
        overrides: Hydra override strings (``model=llama70b``, ``hardware.h2d_gbps=50``).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="megatrain_plan"):
        return hydra_compose(config_name="plan", overrides=list(overrides))


def load_model(name: str) -> dict[str, Any]:
    """The ``conf/model/<name>.yaml`` mapping (name, config, weights, gguf, tokenizer, max_seq_len)."""
    return _plain(compose([f"model={name}"]).model)


def load_hardware(name: str) -> Hardware:
    """The ``conf/hardware/<name>.yaml`` preset."""
    return Hardware.from_mapping(compose([f"hardware={name}"]).hardware)
