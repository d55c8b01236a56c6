"""One data-parallel training run, launched by tests/test_data_parallel.py as ``python tests/dp_worker.py OUT
--devices 2 ...``: Lightning's subprocess script launcher re-runs this script for local rank 1, exactly as it
would a user's ``python train.py``. Each rank writes its losses (``losses_<rank>.pt``); rank 0 writes the final
weights (``weights.pt``) and the strategy's per-step statistics."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch.utils.data import DataLoader, DistributedSampler

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import testing as T
from megatrain_lightning.data.resumable import ResumableDataLoader
from megatrain_lightning.strategy import MegaTrainStrategy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--sched", default=None)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--offload-activations", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--n", type=int, default=64, help="samples in the dataset")
    ap.add_argument("--resumable", action="store_true", help="megatrain_lightning.data.ResumableDataLoader (shuffled)")
    ap.add_argument("--total-steps", type=int, default=None, help="the cosine schedule's T_max (default --steps)")
    ap.add_argument("--save", default=None, help="trainer.save_checkpoint(SAVE) after fit")
    ap.add_argument("--resume", default=None, help="fit(ckpt_path=RESUME)")
    ap.add_argument("--optimizer-in-backward", action="store_true")
    ap.add_argument("--nvme", default=None, help="offload_params/offload_optimizer='nvme' under this path")
    ap.add_argument("--model-checkpoint", default=None,
                    help="ModelCheckpoint(dirpath=..., every_n_train_steps=1, save_last=True, save_top_k=2)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    over = {"resid_pdrop": args.dropout} if args.arch == "gpt2" else {}
    model = T.make_model(args.arch, **over)
    T.freeze_key_biases(model)
    lm = T.LM(model, lr=1e-3, sched=args.sched, total_steps=args.total_steps or args.steps)
    strategy = MegaTrainStrategy(offload_activations=args.offload_activations, timeout=60,
                                 optimizer_in_backward=True if args.optimizer_in_backward else None,
                                 **({"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": args.nvme}
                                    if args.nvme else {}))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                         precision=args.precision, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=args.clip, logger=False,
                         enable_checkpointing=args.model_checkpoint is not None,
                         callbacks=[ModelCheckpoint(dirpath=args.model_checkpoint, every_n_train_steps=1, save_last=True,
                                                    save_top_k=2, monitor="step", mode="max")]
                         if args.model_checkpoint else None,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = T.make_data(n=args.n, batch_size=args.batch)
    if args.resumable:
        loader = ResumableDataLoader(loader.dataset, batch_size=args.batch, shuffle=True, seed=0)
    elif args.devices * args.num_nodes == 1:  # the order Lightning's injected DistributedSampler gives W ranks
        ds = loader.dataset
        loader = DataLoader(ds, batch_size=args.batch,
                            sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
    trainer.fit(lm, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    rank = trainer.global_rank
    torch.save(lm.losses, out / f"losses_{rank}.pt")
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / "weights.pt")
        (out / "stats.json").write_text(json.dumps(trainer.strategy.engine.history))
        eng = trainer.strategy.engine
        (out / "updates_in_backward.json").write_text(json.dumps(eng.optimizer.updates_in_backward))
        (out / "env.json").write_text(json.dumps({"world_size": trainer.world_size,
                                                  "sampler": type(trainer.train_dataloader.sampler).__name__,
                                                  "shared_store": eng.store.shared is not None,
                                                  "shared_wire_images": eng.fetcher.images is not None}))


if __name__ == "__main__":
    main()
