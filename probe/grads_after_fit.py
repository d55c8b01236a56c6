"""After trainer.fit: what p.grad holds, and the gradients of a plain backward, against strategy="auto".
python probe/grads_after_fit.py [accumulate]"""
import sys, warnings
import torch
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
warnings.filterwarnings("ignore")
acc = int(sys.argv[1]) if len(sys.argv) > 1 else 1
KW = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False, max_steps=4, accumulate_grad_batches=acc)


def trained(s):
    lm = T.LM(T.make_model("llama"), lr=1e-2)
    pl.Trainer(strategy=s, **KW).fit(lm, T.learnable_data(n=16, batch_size=4))
    return lm


lm, ref = trained("megatrain"), trained("auto")
wa, wb = dict(lm.model.named_parameters()), dict(ref.model.named_parameters())
print("weights equal after fit:", all(torch.equal(wa[k], wb[k]) for k in wb))
k0 = "model.layers.1.mlp.up_proj.weight"
print("p.grad after fit: megatrain", None if wa[k0].grad is None else float(wa[k0].grad.norm()),
      "plain", None if wb[k0].grad is None else float(wb[k0].grad.norm()))
ids = next(iter(T.learnable_data(n=4, batch_size=4, seed=9)))[0]
for m in (lm.model, ref.model):
    m.zero_grad(set_to_none=True)
    m(input_ids=ids, labels=ids).loss.backward()
bad = {k: T.rel(wa[k].grad, wb[k].grad) for k in wb if wa[k].grad is None or T.rel(wa[k].grad, wb[k].grad) > 1e-6}
print("fresh backward after fit: params whose grad differs:", len(bad), "of", len(wb), list(bad.items())[:4])
with torch.no_grad():
    for m in (lm.model, ref.model):
        for p in m.parameters():
            p -= 0.1 * p.grad
print("after a manual SGD update: worst rel", max(T.rel(wa[k].detach(), wb[k].detach()) for k in wb))
