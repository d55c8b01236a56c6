"""One data-parallel training run, launched by tests/test_data_parallel.py as ``python tests/dp_worker.py OUT
--devices 2 ...``: Lightning's subprocess script launcher re-runs this script for local rank 1, exactly as it
would a user's ``python train.py``. Each rank writes its losses (``losses_<rank>.pt``); rank 0 writes the final
weights (``weights.pt``) and the strategy's per-step statistics."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
import torch
from torch.utils.data import DataLoader, DistributedSampler

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import testing as T
from megatrain_lightning.data.resumable import ResumableDataLoader
from megatrain_lightning.strategy import MegaTrainStrategy


class KillInBackward(pl.Callback):
    """``--kill-rank R --kill-at-step S``: global rank R SIGKILLs itself in the middle of optimizer step S (in
    ``on_after_backward`` of the step's first micro-batch: the others wait for it in the node's collectives, the
    commit of the hooks' gradient edits or the next micro-batch's gradient reduce); it writes ``OUT/killed_<R>``
    (its pid) first. ``hang``: it sleeps 10 minutes instead (a rank that hangs). ``before_forward``: in
    ``on_train_batch_start`` of the step's first micro-batch instead (the others wait for its slab updates in shared
    memory)."""

    def __init__(self, rank: int, step: int, out: Path, hang: bool = False, before_forward: bool = False):
        self.rank, self.step, self.out, self.hang, self.before_forward = rank, step, out, hang, before_forward

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if self.before_forward:
            self._kill(trainer)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.before_forward:
            self._kill(trainer)

    def _kill(self, trainer: pl.Trainer) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            (self.out / f"killed_{self.rank}").write_text(str(os.getpid()))
            if self.hang:
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)


class SummonEdit(pl.Callback):
    """``--summon-edit``: in ``on_fit_start`` every rank halves the LM head's weights and adds 0.01 (a read-modify-write)
    inside ``trainer.strategy.summon_full_params`` (:func:`summon_edit`)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with trainer.strategy.summon_full_params(pl_module.model.lm_head):
            summon_edit(pl_module.model)


def summon_edit(model: torch.nn.Module) -> None:
    """The edit of :class:`SummonEdit` (the reference applies it to its model too)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5).add_(0.01)


class EditGrads(pl.Callback):
    """``--grad-edit MODE``: every gradient times 0.5 in a hook. ``inplace``: in ``on_before_optimizer_step``, with
    ``p.grad.mul_`` (every other parameter through ``p.grad.data``, which autograd's version counter does not see);
    ``replace``: there, ``p.grad = p.grad * 0.5`` (out of place); ``after_backward``: as ``inplace``, in
    ``on_after_backward`` of every micro-batch."""

    def __init__(self, mode: str):
        self.mode = mode

    def _edit(self, pl_module) -> None:
        for i, p in enumerate(pl_module.parameters()):
            if p.grad is None:
                continue
            if self.mode == "replace":
                p.grad = p.grad * 0.5
            else:
                (p.grad if i % 2 == 0 else p.grad.data).mul_(0.5)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.mode != "after_backward":
            self._edit(pl_module)

    def on_after_backward(self, trainer, pl_module):
        if self.mode == "after_backward":
            self._edit(pl_module)


class CountingLM(T.LM):
    """``--counter-buffer``: a persistent buffer outside the HF model counting micro-batches (the same on every
    rank) that scales the loss, so the weights after a resume differ unless the checkpoint restored it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.register_buffer("seen", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.seen.add_(1.0)
        return loss * (1.0 + 0.05 * self.seen)


def fake_shm_free(nbytes: int) -> None:
    """``os.statvfs("/dev/shm")`` reports ``nbytes`` free (a small tmpfs, as in a default Docker container)."""
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_blocks, self.f_bavail = st.f_frsize, nbytes // st.f_frsize, nbytes // st.f_frsize

    os.statvfs = lambda path: Small(real(path)) if str(path).startswith("/dev/shm") else real(path)


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
    ap.add_argument("--recompute", default="block", help="the strategy's recompute= policy")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--n", type=int, default=64, help="samples in the dataset")
    ap.add_argument("--resumable", action="store_true", help="megatrain_lightning.data.ResumableDataLoader (shuffled)")
    ap.add_argument("--total-steps", type=int, default=None, help="the cosine schedule's T_max (default --steps)")
    ap.add_argument("--save", default=None, help="trainer.save_checkpoint(SAVE) after fit")
    ap.add_argument("--save-on-rank0-only", action="store_true",
                    help="--save under `if trainer.is_global_zero` (a common mistake: the save is collective)")
    ap.add_argument("--grad-edit", default=None, choices=["inplace", "replace", "after_backward"],
                    help="a callback scales every gradient by 0.5 (see EditGrads)")
    ap.add_argument("--resume", default=None, help="fit(ckpt_path=RESUME)")
    ap.add_argument("--optimizer-in-backward", action="store_true")
    ap.add_argument("--optimizer", default="AdamW", help="the torch.optim class configure_optimizers builds")
    ap.add_argument("--summon-edit", action="store_true", help="SummonEdit: an edit inside summon_full_params")
    ap.add_argument("--nvme", default=None, help="offload_params/offload_optimizer='nvme' under this path")
    ap.add_argument("--nvme-optimizer", default=None, help="offload_optimizer='nvme' only, under this path")
    ap.add_argument("--nvme-params", default=None, help="offload_params='nvme' only, under this path")
    ap.add_argument("--host-memory-limit", default=None, help="the strategy's host_memory_limit (the node's)")
    ap.add_argument("--model-checkpoint", default=None,
                    help="ModelCheckpoint(dirpath=..., every_n_train_steps=1, save_last=True, save_top_k=2)")
    ap.add_argument("--kill-rank", type=int, default=None, help="this global rank SIGKILLs itself ...")
    ap.add_argument("--kill-at-step", type=int, default=3, help="... in the backward of this optimizer step")
    ap.add_argument("--hang", action="store_true", help="--kill-rank sleeps (10 min) instead of dying")
    ap.add_argument("--kill-before-forward", action="store_true", help="--kill-rank dies before the step's forward")
    ap.add_argument("--timeout", type=float, default=60.0, help="the strategy's timeout= (seconds)")
    ap.add_argument("--mismatch", default="", help="comma-separated, on local rank 1 only: model (one more layer), "
                    "accumulate (one more micro-batch), lookahead (2), lr (twice)")
    ap.add_argument("--backbone-finetuning", action="store_true",
                    help="testing.BackboneLM (lr 1e-2) with BackboneFinetuning: the backbone unfrozen at epoch 1")
    ap.add_argument("--unequal-batches", action="store_true",
                    help="use_distributed_sampler=False, one epoch: local rank 1 gets twice the batches of rank 0")
    ap.add_argument("--counter-buffer", action="store_true", help="CountingLM (a persistent buffer); buffer_<rank>.pt")
    ap.add_argument("--shm-free", type=int, default=None, help="local rank 1 sees this many bytes free in /dev/shm")
    args = ap.parse_args()
    second = os.environ.get("LOCAL_RANK", "0") == "1"  # the launcher sets it for the rank it starts
    mismatch = set(args.mismatch.split(",")) if second and args.mismatch else set()
    if second and args.shm_free is not None:
        fake_shm_free(args.shm_free)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    over = {"resid_pdrop": args.dropout} if args.arch == "gpt2" else {}
    if "model" in mismatch:
        over["num_hidden_layers"] = T.make_model(args.arch).config.num_hidden_layers + 1
    model = T.make_model(args.arch, **over)
    T.freeze_key_biases(model)
    lm = (T.BackboneLM(model) if args.backbone_finetuning
          else (CountingLM if args.counter_buffer else T.LM)(model, lr=1e-3, sched=args.sched, total_steps=args.total_steps or args.steps,
                                                           optimizer=getattr(torch.optim, args.optimizer)))
    if "lr" in mismatch:
        lm.lr *= 2
    strategy = MegaTrainStrategy(offload_activations=args.offload_activations, timeout=args.timeout, recompute=args.recompute,
                                 lookahead=2 if "lookahead" in mismatch else 1,
                                 optimizer_in_backward=True if args.optimizer_in_backward else None,
                                 **({"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": args.nvme,
                                     "host_memory_limit": args.host_memory_limit} if args.nvme else {}),
                                 **({"offload_optimizer": "nvme", "nvme_path": args.nvme_optimizer,
                                     "host_memory_limit": args.host_memory_limit} if args.nvme_optimizer else {}),
                                 **({"offload_params": "nvme", "nvme_path": args.nvme_params} if args.nvme_params else {}))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                         precision=args.precision, max_steps=args.steps,
                         accumulate_grad_batches=args.accumulate + ("accumulate" in mismatch),
                         gradient_clip_val=args.clip, logger=False,
                         enable_checkpointing=args.model_checkpoint is not None,
                         callbacks=([ModelCheckpoint(dirpath=args.model_checkpoint, every_n_train_steps=1, save_last=True,
                                                     save_top_k=2, monitor="step", mode="max")]
                                    if args.model_checkpoint else [])
                         + ([KillInBackward(args.kill_rank, args.kill_at_step, out, args.hang, args.kill_before_forward)]
                            if args.kill_rank is not None else [])
                         + ([EditGrads(args.grad_edit)] if args.grad_edit else [])
                         + ([SummonEdit()] if args.summon_edit else [])
                         + ([BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 2.0)]
                            if args.backbone_finetuning else []),
                         enable_progress_bar=False, enable_model_summary=False,
                         **(dict(use_distributed_sampler=False, max_epochs=1) if args.unequal_batches else {}))
    loader = T.make_data(n=args.n * (1 + second) if args.unequal_batches else args.n, batch_size=args.batch)
    if args.resumable:
        loader = ResumableDataLoader(loader.dataset, batch_size=args.batch, shuffle=True, seed=0)
    elif args.devices * args.num_nodes == 1:  # the order Lightning's injected DistributedSampler gives W ranks
        ds = loader.dataset
        loader = DataLoader(ds, batch_size=args.batch,
                            sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
    trainer.fit(lm, loader, ckpt_path=args.resume)
    if args.save and (trainer.is_global_zero or not args.save_on_rank0_only):
        trainer.save_checkpoint(args.save)
    rank = trainer.global_rank
    torch.save(lm.losses, out / f"losses_{rank}.pt")
    if args.counter_buffer:
        torch.save(lm.seen.detach().cpu().clone(), out / f"buffer_{rank}.pt")
    eng = trainer.strategy.engine
    if eng.store.nvme is not None:  # this rank's NVMe store: which slabs have regions on its disk, its budget
        st = eng.store.nvme
        try:  # each rank holds only its blocks' AdamW state on its disk: refused with what to do instead
            trainer.optimizers[0].state_dict()
            state_dict_error = None
        except RuntimeError as e:
            state_dict_error = str(e)
        (out / f"nvme_{rank}.json").write_text(json.dumps({
            "state_dict_error": state_dict_error,
            "dir": str(st.dir), "slabs": [i for i, (n, t) in enumerate(st.layout) if n or t],
            "owned": [i for i in range(len(st.layout)) if eng.ownership is None or eng.ownership.owns(i)],
            "host_memory_limit": eng.host_memory_limit, "peak_host_bytes": st.budget.peak,
            "written_bytes": st.meter.snapshot()["nvme_write_bytes"]}))
    if trainer.local_rank == 0:  # each node's copy of the weights (its shared store)
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"node_weights_{rank}.pt")
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / "weights.pt")
        (out / "stats.json").write_text(json.dumps(trainer.strategy.engine.history))
        eng = trainer.strategy.engine
        (out / "updates_in_backward.json").write_text(json.dumps(eng.optimizer.updates_in_backward))
        (out / "env.json").write_text(json.dumps({"world_size": trainer.world_size,
                                                  "sampler": type(trainer.train_dataloader.sampler).__name__,
                                                  "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
                                                  "shared_store": eng.store.shared is not None,
                                                  "shared_wire_images": eng.fetcher.images is not None}))


if __name__ == "__main__":
    main()
