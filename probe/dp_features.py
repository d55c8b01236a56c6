"""Lightning features in 2 processes: strategy="megatrain" against strategy="ddp" (plain Lightning) on CPU.

python probe/dp_features.py OUT STRATEGY CASE     (rank 0 writes OUT/result.pt)
python probe/dp_features.py compare CASE         (runs both and compares)
"""
import os, socket, subprocess, sys, warnings
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
sys.path.insert(0, str(Path(__file__).parent))
from features import Base, CASES  # noqa: E402
warnings.filterwarnings("ignore")


class DPBase(Base):
    def validation_step(self, batch, i):
        loss = self.model(**T.batch_inputs(batch)).loss
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_max", loss, sync_dist=True, reduce_fx="max")
        g = self.all_gather(loss)
        self.gathered = getattr(self, "gathered", []) + [g.detach().clone()]


DP_CASES = dict(CASES)
DP_CASES.update({
    "plain": {},
    "early_stop": dict(tr_kw=dict(max_steps=-1, max_epochs=6, check_val_every_n_epoch=1), early=True),
    "eval_after_fit": dict(eval_after=True),
    "unfreeze_dp": dict(freeze="layers.0.", tr_kw=dict(callbacks=[__import__("features").Unfreeze()], max_steps=10)),
    "eval_only": dict(eval_after=True, no_fit=True),
    "ckpt_monitor": dict(tr_kw=dict(max_steps=-1, max_epochs=3), monitor=True),
})


def main(out, strategy, case):
    kw = dict(DP_CASES[case])
    early, monitor = kw.pop("early", False), kw.pop("monitor", False)
    eval_after = kw.pop("eval_after", False)
    fit_twice = kw.pop("fit_twice", False)
    no_fit = kw.pop("no_fit", False)
    model = T.make_model("llama")
    T.freeze_key_biases(model)
    if kw.get("freeze"):
        for n, p in model.named_parameters():
            if kw["freeze"] in n:
                p.requires_grad_(False)
    lm = DPBase(model, **kw.get("lm_kw", {}))
    cbs = []
    if early:
        cbs.append(EarlyStopping("val_loss", patience=0, min_delta=10.0))  # stops after 2 validations
    if monitor:
        cbs.append(ModelCheckpoint(dirpath=Path(out) / "ck", monitor="val_loss", save_top_k=1, mode="min"))
    tk = dict(max_steps=6, accelerator="cpu", devices=2, logger=False, enable_checkpointing=monitor,
              enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
    tk.update(kw.get("tr_kw", {}))
    tr = pl.Trainer(strategy=strategy, **tk)
    if not no_fit:
        tr.fit(lm, T.learnable_data(n=32, batch_size=2), T.learnable_data(n=7, batch_size=2, seed=3))
    if fit_twice:
        if tk.get("max_steps", -1) > 0:
            tr.fit_loop.epoch_loop.max_steps = tr.global_step + 4
        if tk.get("max_epochs"):
            tr.fit_loop.max_epochs = tk["max_epochs"] + 1
        tr.fit(lm, T.learnable_data(n=32, batch_size=2), T.learnable_data(n=7, batch_size=2, seed=3))
    res = dict(losses=lm.losses, step=tr.global_step, epoch=tr.current_epoch,
               metrics={k: float(v) for k, v in tr.callback_metrics.items() if not k.startswith("megatrain/")},
               gathered=[g.tolist() for g in getattr(lm, "gathered", [])])
    if eval_after:
        val = T.learnable_data(n=7, batch_size=2, seed=3)
        res["metrics"]["after/validate"] = tr.validate(lm, val, verbose=False)[0]["val_loss"]
        res["metrics"]["after/test"] = tr.test(lm, val, verbose=False)[0]["test_loss"]
        res["metrics"]["after/predict_sum"] = float(sum(x.double().sum() for x in tr.predict(lm, val)))
    if monitor:
        res["best"] = Path(tr.checkpoint_callback.best_model_path).name
    if tr.global_rank == 0:
        res["weights"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.save(res, Path(out) / f"result_{tr.global_rank}.pt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(case):
    res = {}
    for strategy in ("ddp", "megatrain"):
        out = Path(f"/tmp/p11/dpf/{case}/{strategy}")
        out.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        p = subprocess.run([sys.executable, __file__, str(out), strategy, case], env=env, capture_output=True,
                           text=True, timeout=300)
        if p.returncode:
            print(f"{case}: {strategy} FAILED rc={p.returncode}\n{p.stderr[-1500:]}")
            return
        res[strategy] = [torch.load(out / f"result_{r}.pt") for r in (0, 1)]
    a, b = res["ddp"], res["megatrain"]
    dw = max(T.rel(b[0]["weights"][k], v) for k, v in a[0]["weights"].items())
    dl = max((abs(x - y) / abs(x) for r in (0, 1) for x, y in zip(a[r]["losses"], b[r]["losses"])), default=0)
    same = all(a[r][k] == b[r][k] for r in (0, 1) for k in ("step", "epoch"))
    dm = {k: (a[0]["metrics"][k], b[0]["metrics"].get(k)) for k in a[0]["metrics"]
          if b[0]["metrics"].get(k) is None or abs(a[0]["metrics"][k] - b[0]["metrics"][k]) > 1e-5 * abs(a[0]["metrics"][k])}
    gath = a[0]["gathered"] == b[0]["gathered"] or max(
        (abs(x - y) for ga, gb in zip(a[0]["gathered"], b[0]["gathered"]) for x, y in zip(ga, gb)), default=0) < 1e-5
    ok = dw < 1e-5 and dl < 1e-5 and same and not dm and gath and a[0].get("best") == b[0].get("best")
    print(f"{case}: {'OK ' if ok else 'DIFF'} weight rel {dw:.1e} loss rel {dl:.1e} step/epoch "
          f"{a[0]['step']}/{a[0]['epoch']} vs {b[0]['step']}/{b[0]['epoch']} metric diffs {dm} all_gather same {gath} "
          f"best {a[0].get('best')} vs {b[0].get('best')}")


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        for c in sys.argv[2:]:
            compare(c)
    else:
        main(*sys.argv[1:4])
