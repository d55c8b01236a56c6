"""Usual Lightning features: strategy="megatrain" against strategy="auto" (plain Lightning) on the same tiny model.

python probe/features.py [case ...]   (no case: all). Prints per case: max loss rel diff, worst weight rel err.
"""
import sys, traceback, warnings
import torch
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T

warnings.filterwarnings("ignore")


class Base(pl.LightningModule):
    def __init__(self, model, lr=1e-2, opt="adamw", groups=False, sched=None, manual=False, compiled=False,
                 opt_kw=None):
        super().__init__()
        self.opt_kw = opt_kw or {}
        self.model = torch.compile(model) if compiled else model
        self.lr, self.opt, self.groups, self.sched = lr, opt, groups, sched
        self.automatic_optimization = not manual
        self.losses = []

    def forward(self, **kw):
        return self.model(**kw)

    def training_step(self, batch, i):
        loss = self.model(**T.batch_inputs(batch)).loss
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            s = self.lr_schedulers()
            if s is not None:
                s.step()
            return None
        return loss

    def validation_step(self, batch, i):
        self.log("val_loss", self.model(**T.batch_inputs(batch)).loss)

    def test_step(self, batch, i):
        self.log("test_loss", self.model(**T.batch_inputs(batch)).loss)

    def predict_step(self, batch, i):
        return self.model(input_ids=batch[0]).logits

    def configure_optimizers(self):
        if self.groups:
            decay = [p for n, p in self.named_parameters() if p.ndim >= 2 and p.requires_grad]
            nodecay = [p for n, p in self.named_parameters() if p.ndim < 2 and p.requires_grad]
            params = [{"params": decay, "weight_decay": 0.1, "lr": self.lr},
                      {"params": nodecay, "weight_decay": 0.0, "lr": self.lr * 3}]
        else:
            params = [p for p in self.parameters() if p.requires_grad]
        if self.opt_kw.get("only") == "layers":  # trainable params left out of the optimizer
            params = [p for n, p in self.named_parameters() if "layers" in n]
        cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[self.opt]
        opt = cls(params, **{"lr": self.lr, **{k: v for k, v in self.opt_kw.items() if k != "only"}})
        if self.sched == "lambda_tuple":
            s = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))
            return [opt], [s]
        if self.sched == "onecycle":
            s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr,
                                                    total_steps=self.trainer.estimated_stepping_batches)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        if self.sched == "step_freq2":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step", "frequency": 2}}
        if self.sched == "step":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        if self.sched == "epoch":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "epoch"}}
        if self.sched == "plateau":
            s = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "monitor": "train_loss", "interval": "step"}}
        return opt


class SetLR(pl.Callback):
    """Sets the learning rate by hand at step 2 (as a user's callback might)."""
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if trainer.global_step == 2:
            for g in trainer.optimizers[0].param_groups:
                g["lr"] = 1e-4


class Unfreeze(pl.Callback):
    """BackboneFinetuning-like: layer 0 frozen at the start, unfrozen with a new param group at epoch 1."""
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            ps = [p for n, p in pl_module.named_parameters() if "layers.0." in n and not p.requires_grad]
            for p in ps:
                p.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": ps, "lr": 5e-3})


class Refreeze(pl.Callback):
    """Freeze layer 0 by hand at epoch 1 (requires_grad_(False) mid-fit)."""
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            for n, p in pl_module.named_parameters():
                if "layers.0." in n:
                    p.requires_grad_(False)


class ScaleGradsInPlace(pl.Callback):
    """on_before_optimizer_step: p.grad.mul_(0.5) (clipping-like custom gradient surgery, in place)."""
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class ReplaceGrads(pl.Callback):
    """on_before_optimizer_step: p.grad = p.grad * 0.5 + noise (a new tensor assigned, not in place)."""
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad = p.grad * 0.5 + 1e-3


class ZeroEmbeddingGrad(pl.Callback):
    """on_after_backward: zero the embedding's gradient (p.grad.zero_()), as gradient masking does."""
    def on_after_backward(self, trainer, pl_module):
        for n, p in pl_module.named_parameters():
            if "embed_tokens" in n and p.grad is not None:
                p.grad.zero_()


def run(strategy, lm_kw=None, tr_kw=None, freeze=None, data_kw=None, fit_twice=False):
    model = T.make_model("llama")
    T.freeze_key_biases(model)
    if freeze:
        for n, p in model.named_parameters():
            if freeze in n:
                p.requires_grad_(False)
    lm = Base(model, **(lm_kw or {}))
    kw = dict(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    kw.update(tr_kw or {})
    tr = pl.Trainer(strategy=strategy, **kw)
    loader = T.learnable_data(**(data_kw or {"n": 16, "batch_size": 4}))
    tr.fit(lm, loader, loader)
    if fit_twice:
        if kw.get("max_steps", -1) > 0:
            tr.fit_loop.epoch_loop.max_steps = tr.global_step + 4
        if kw.get("max_epochs"):
            tr.fit_loop.max_epochs = kw["max_epochs"] + 1
        tr.fit(lm, loader, loader)
    w = {k: v.detach().clone() for k, v in lm.model.named_parameters()}
    lrs = [g["lr"] for g in tr.optimizers[0].param_groups] if tr.optimizers else None
    return lm.losses, w, tr.global_step, lrs, tr.current_epoch


STRATEGY = "megatrain"


def compare(name, **kw):
    try:
        a = run("auto", **kw)
    except Exception as e:
        print(f"{name}: plain Lightning raised {type(e).__name__}: {e}")
        a = None
    try:
        import gc; gc.collect() if "--gc" in sys.argv else None
        b = run(STRATEGY, **kw)
    except Exception as e:
        print(f"{name}: MEGATRAIN raised {type(e).__name__}: {str(e)[:800]}")
        if "-v" in sys.argv:
            traceback.print_exc()
        return
    if a is None:
        print(f"{name}: megatrain ran, plain raised")
        return
    la, wa, sa, lra, ea = a
    lb, wb, sb, lrb, eb = b
    dl = max((abs(x - y) / abs(x) for x, y in zip(la, lb)), default=0.0)
    dw = max(T.rel(wb[k], wa[k]) for k in wa)
    moved = max(T.rel(wa[k], T.make_model("llama").state_dict()[k]) for k in wa)
    ok = len(la) == len(lb) and sa == sb and dl < 1e-5 and dw < 1e-5 and lra == lrb and ea == eb
    print(f"{name}: {'OK ' if ok else 'DIFF'} losses {len(la)}/{len(lb)} steps {sa}/{sb} epoch {ea}/{eb} "
          f"loss rel {dl:.1e} weight rel {dw:.1e} (moved {moved:.1e}) lr {lra}/{lrb}")


CASES = {
    "clip_value": dict(tr_kw=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
    "clip_norm": dict(tr_kw=dict(gradient_clip_val=0.1)),
    "accumulate3": dict(tr_kw=dict(accumulate_grad_batches=3)),
    "accumulate_dict": dict(tr_kw=dict(accumulate_grad_batches=2, max_steps=5)),
    "sched_step": dict(lm_kw=dict(sched="step")),
    "sched_epoch": dict(lm_kw=dict(sched="epoch"), tr_kw=dict(max_steps=-1, max_epochs=3)),
    "sched_plateau": dict(lm_kw=dict(sched="plateau")),
    "manual": dict(lm_kw=dict(manual=True)),
    "manual_sched": dict(lm_kw=dict(manual=True, sched="step")),
    "groups": dict(lm_kw=dict(groups=True)),
    "frozen_layer0": dict(freeze="layers.0."),
    "frozen_embed": dict(freeze="embed_tokens"),
    "frozen_groups": dict(freeze="layers.1.", lm_kw=dict(groups=True)),
    "max_epochs": dict(tr_kw=dict(max_steps=-1, max_epochs=2)),
    "max_epochs_accum_partial": dict(tr_kw=dict(max_steps=-1, max_epochs=2, accumulate_grad_batches=3)),
    "fit_twice": dict(fit_twice=True),
    "fit_twice_epochs": dict(fit_twice=True, tr_kw=dict(max_steps=-1, max_epochs=1)),
    "adam": dict(lm_kw=dict(opt="adam")),
    "sgd": dict(lm_kw=dict(opt="sgd")),
    "compile": dict(lm_kw=dict(compiled=True)),
    "adam_wd": dict(lm_kw=dict(opt="adam", opt_kw=dict(weight_decay=0.1))),
    "adamw_amsgrad": dict(lm_kw=dict(opt_kw=dict(amsgrad=True))),
    "adamw_maximize": dict(lm_kw=dict(opt_kw=dict(maximize=True))),
    "adamw_tensor_lr": dict(lm_kw=dict(opt_kw=dict(lr=torch.tensor(1e-2)))),
    "adamw_betas_eps_wd": dict(lm_kw=dict(opt_kw=dict(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3))),
    "adamw_foreach": dict(lm_kw=dict(opt_kw=dict(foreach=True))),
    "onecycle_epochs": dict(lm_kw=dict(sched="onecycle"), tr_kw=dict(max_steps=-1, max_epochs=2, accumulate_grad_batches=3)),
    "sched_freq2": dict(lm_kw=dict(sched="step_freq2")),
    "val_interval_half": dict(tr_kw=dict(val_check_interval=0.5, max_steps=-1, max_epochs=1)),
    "limit_train3": dict(tr_kw=dict(limit_train_batches=3, max_steps=-1, max_epochs=2)),
    "overfit2": dict(tr_kw=dict(overfit_batches=2, max_steps=4)),
    "fused": dict(lm_kw=dict(opt_kw=dict(fused=True))),
    "grad_scale_inplace": dict(tr_kw=dict(callbacks=[ScaleGradsInPlace()])),
    "grad_replace": dict(tr_kw=dict(callbacks=[ReplaceGrads()])),
    "grad_zero_after_backward": dict(tr_kw=dict(callbacks=[ZeroEmbeddingGrad()])),
    "grad_zero_after_backward_acc2": dict(tr_kw=dict(callbacks=[ZeroEmbeddingGrad()], accumulate_grad_batches=2)),
    "partial_opt": dict(lm_kw=dict(opt_kw=dict(only="layers"))),
    "lambda_tuple": dict(lm_kw=dict(sched="lambda_tuple")),
    "set_lr_callback": dict(tr_kw=dict(callbacks=[SetLR()])),
    "unfreeze_epoch1": dict(freeze="layers.0.", tr_kw=dict(callbacks=[Unfreeze()], max_steps=8)),
    "refreeze_epoch1": dict(tr_kw=dict(callbacks=[Refreeze()], max_steps=8)),
}

if __name__ == "__main__":
    if "--nvme" in sys.argv:  # the NVMe tier, one process
        import os, tempfile
        os.environ.setdefault("MEGATRAIN_NVME_PATH", tempfile.mkdtemp())
        STRATEGY = "megatrain_nvme"
    names = [a for a in sys.argv[1:] if not a.startswith("-")] or list(CASES)
    for n in names:
        compare(n, **CASES[n])
