"""One rank of a data-parallel DPO run (started by tests/test_preference.py, every rank at once as torchrun does).

usage: python tests/dpo_worker.py OUT [--devices 2]

Trains ``testing.make_model("llama")`` (key biases frozen) with ``DPOModule`` (sigmoid, precomputed reference
cached under OUT/cache) through ``Trainer(strategy="megatrain", devices=N)``: micro-batch 1 pair per rank,
accumulation 2, clipping 1.0, 4 steps, over the 8 pairs of ``test_preference.Pairs`` in order (rank r takes pairs
r, r + N, ...; a ``DistributedSampler`` without shuffling, which Lightning keeps). Rank 0 writes OUT/weights.pt (the trained state dict).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
from test_preference import ACC, BETA, CLIP, LR, Pairs  # noqa: E402

import megatrain_lightning  # noqa: E402,F401
from megatrain_lightning import MegaTrainStrategy  # noqa: E402
from megatrain_lightning.preference import DPOModule, collate_pairs  # noqa: E402
from megatrain_lightning.testing import freeze_key_biases, make_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reference", default="precompute", help="DPOModule(reference=...)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model("llama")
    freeze_key_biases(model)
    module = DPOModule(model, loss_type="sigmoid", beta=BETA, reference=args.reference, lr=LR, cache_dir=out / "cache")
    trainer = pl.Trainer(strategy=MegaTrainStrategy(timeout=120), accelerator="cpu", devices=args.devices,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=ACC, gradient_clip_val=CLIP)
    pairs = Pairs()  # in order: Lightning's own sampler for training shuffles (seed 0), this one does not
    sampler = DistributedSampler(pairs, num_replicas=args.devices, rank=int(os.environ.get("RANK", 0)), shuffle=False)
    trainer.fit(module, DataLoader(pairs, batch_size=1, sampler=sampler, collate_fn=collate_pairs))
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
