"""A new user's train.py: DP on CPU, sync_dist logging, validation, ModelCheckpoint, resume.

python probe/dp_user.py OUT --devices 2 --steps 4 [--resume last] [--strategy megatrain_nvme]
"""
import argparse, json, os, sys
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T


class LM(pl.LightningModule):
    def __init__(self, model, lr=1e-3):
        super().__init__()
        self.model, self.lr = model, lr
        self.losses = []

    def training_step(self, batch, i):
        loss = self.model(**T.batch_inputs(batch)).loss
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, i):
        loss = self.model(**T.batch_inputs(batch)).loss
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--strategy", default="megatrain")
    args = ap.parse_args()
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    model = T.make_model("llama")
    lm = LM(model)
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                         max_steps=args.steps, val_check_interval=2, limit_val_batches=2,
                         logger=CSVLogger(out / "logs"), enable_progress_bar=False,
                         callbacks=[ModelCheckpoint(dirpath=out / "ckpts", save_last=True, every_n_train_steps=2)])
    train = T.make_data(n=32, batch_size=2)
    val = T.make_data(n=8, batch_size=2, seed=5)
    trainer.fit(lm, train, val, ckpt_path=args.resume)
    r = trainer.global_rank
    torch.save(lm.losses, out / f"losses_{r}.pt")
    if r == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / "weights.pt")
        cm = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (out / "metrics.json").write_text(json.dumps(cm))
        print("RANK0 callback_metrics", cm, "global_step", trainer.global_step)


if __name__ == "__main__":
    main()
