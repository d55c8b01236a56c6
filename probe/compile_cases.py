"""torch.compile with strategy="megatrain": (1) the whole LightningModule, (2) layer.compile() in place on each
decoder layer, compared with plain Lightning.  python probe/compile_cases.py whole|layers|inner|inplace"""
import sys, warnings
import torch
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
warnings.filterwarnings("ignore")


def run(strategy, how):
    model = T.make_model("llama")
    if how == "layers":
        for layer in model.model.layers:
            layer.compile()
    if how == "inplace":
        model.compile()
    lm = T.LM(model, lr=1e-2)
    if how == "inner":
        lm.model = torch.compile(model)
    tr = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tr.fit(torch.compile(lm) if how == "whole" else lm, T.learnable_data(n=16, batch_size=4))
    return lm.losses, {k: v.detach().clone() for k, v in model.named_parameters()}


how = sys.argv[1]
la, wa = run("auto", how)
try:
    lb, wb = run("megatrain", how)
except Exception as e:
    print(f"{how}: MEGATRAIN raised {type(e).__name__}: {str(e)[:600]}")
    raise SystemExit(1)
print(how, "losses", la, lb, "worst weight rel", max(T.rel(wb[k], wa[k]) for k in wa))
