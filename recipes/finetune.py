"""Main job (stand-in until the domain recipes land): byte-level fine-tune of a small Llama on the
Python standard library through strategy="megatrain". Hydra config: conf/finetune.yaml.

    python recipes/finetune.py                       # the embedded default
    python recipes/finetune.py trainer.max_steps=10  # any key overridable
"""

from __future__ import annotations

import math
import resource
import sysconfig
import time
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
import transformers
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")


def stdlib_bytes(max_files: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of the interpreter's stdlib sources, split by file (every k-th file is validation)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:max_files]
    if not files:
        raise FileNotFoundError(f"No .py files under {root}; point data at a directory of text files.")
    k = max(2, round(1 / val_fraction))
    train, val = bytearray(), bytearray()
    for i, f in enumerate(files):
        (val if i % k == 0 else train).extend(f.read_bytes() + b"\n")
    return torch.tensor(list(train), dtype=torch.long), torch.tensor(list(val), dtype=torch.long)


def chunks(tokens: torch.Tensor, seq_len: int) -> TensorDataset:
    n = tokens.numel() // seq_len
    return TensorDataset(tokens[: n * seq_len].view(n, seq_len))


class CausalLM(pl.LightningModule):
    def __init__(self, config: transformers.PretrainedConfig, lr: float, weight_decay: float, warmup: int, total: int):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr, self.weight_decay, self.warmup, self.total = lr, weight_decay, warmup, total

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.lr)

        def schedule(step: int) -> float:
            if step < self.warmup:
                return (step + 1) / self.warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train, val = stdlib_bytes(cfg.data.max_files, cfg.data.val_fraction)
    train_dl = DataLoader(chunks(train, cfg.data.seq_len), batch_size=cfg.data.batch_size, shuffle=True)
    val_dl = DataLoader(chunks(val, cfg.data.seq_len), batch_size=cfg.data.batch_size)
    lm = CausalLM(instantiate(cfg.model), cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_steps,
                  cfg.trainer.max_steps)
    trainer = pl.Trainer(strategy=instantiate(cfg.strategy), logger=CSVLogger(cfg.output_dir, name="logs"),
                         **cfg.trainer)
    before = trainer.validate(lm, val_dl, verbose=False)[0]["val_loss"]
    t0 = time.perf_counter()
    trainer.fit(lm, train_dl, val_dl)
    seconds = time.perf_counter() - t0
    after = trainer.validate(lm, val_dl, verbose=False)[0]["val_loss"]
    hist = trainer.strategy.engine.history
    lm.model.save_pretrained(Path(cfg.output_dir) / "model")
    tokens = trainer.global_step * cfg.data.batch_size * cfg.data.seq_len
    rows = [
        ("parameters", f"{sum(p.numel() for p in lm.parameters()) / 1e6:.2f} M"),
        ("val loss before -> after", f"{before:.4f} -> {after:.4f}"),
        ("val perplexity before -> after", f"{math.exp(before):.2f} -> {math.exp(after):.2f}"),
        ("optimizer steps", str(trainer.global_step)),
        ("train tokens/s", f"{tokens / seconds:.0f}"),
        ("H2D / D2H per step", f"{hist[-1]['megatrain/h2d_bytes'] / 2**20:.1f} MiB / {hist[-1]['megatrain/d2h_bytes'] / 2**20:.1f} MiB"),
        ("peak RSS", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"),
        ("HF checkpoint", str(Path(cfg.output_dir) / "model")),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if after >= before:
        raise SystemExit(f"validation loss did not improve ({before:.4f} -> {after:.4f})")


if __name__ == "__main__":
    main()
