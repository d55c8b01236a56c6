"""One two-process Fabric run, launched by tests/test_fabric.py as ``python tests/fabric_worker.py OUT STRATEGY``:
``fabric.launch()`` re-runs this script for local rank 1 (Lightning's subprocess script launcher), as for a user's
``python train.py``. Each rank trains on its own micro-batches (rank r takes batch ``world * i + r``) with the
LitGPT loop shape (accumulation 2 with ``no_backward_sync``, norm clipping, cosine schedule); rank 0 writes
``OUT/<STRATEGY>.pt``: every rank's losses and the final weights; with ``megatrain`` the ranks also write
``OUT/megatrain_ckpt`` together (``fabric.save``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

import megatrain_lightning  # noqa: F401  (registers the strategies)
from megatrain_lightning.testing import batch_inputs, make_data, make_model

STEPS, ACC = 6, 2


def main(out: Path, strategy: str) -> None:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    fabric.seed_everything(0)
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    model, opt = fabric.setup(model, opt)
    batches = list(make_data(n=2 * STEPS * ACC * fabric.world_size))
    losses = []
    for i in range(STEPS * ACC):
        accumulating = (i + 1) % ACC != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(**batch_inputs(batches[fabric.world_size * i + fabric.global_rank])).loss
            fabric.backward(loss / ACC)
        losses.append(loss.detach())
        if not accumulating:
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
            sched.step()
    if hasattr(fabric.strategy, "flush"):
        fabric.strategy.flush()
    if strategy == "megatrain":  # every rank writes its own slabs of the one directory checkpoint
        fabric.save(out / "megatrain_ckpt", {"model": model, "optimizer": opt, "scheduler": sched, "step": STEPS})
    every = fabric.all_gather(torch.stack(losses))
    if fabric.global_rank == 0:
        torch.save({"losses": every, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   out / f"{strategy}.pt")
    fabric.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
