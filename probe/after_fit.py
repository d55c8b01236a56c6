"""After trainer.fit: use the model directly (forward, generate, backward in plain PyTorch, a plain Trainer) and
compare with the same training under strategy="auto".   python probe/after_fit.py [megatrain|megatrain_nvme]"""
import os, sys, tempfile, warnings
import torch
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
warnings.filterwarnings("ignore")
strategy = sys.argv[1] if len(sys.argv) > 1 else "megatrain"
os.environ.setdefault("MEGATRAIN_NVME_PATH", tempfile.mkdtemp())
KW = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False, max_steps=4)


def trained(s):
    lm = T.LM(T.make_model("llama"), lr=1e-2)
    tr = pl.Trainer(strategy=s, **KW)
    tr.fit(lm, T.learnable_data(n=16, batch_size=4))
    return lm, tr


lm, tr = trained(strategy)
ref, _ = trained("auto")
ids = next(iter(T.learnable_data(n=4, batch_size=4, seed=9)))[0]
with torch.no_grad():
    a, b = lm.model(input_ids=ids).logits, ref.model(input_ids=ids).logits
print("direct forward after fit rel", T.rel(a, b))
ga = lm.model.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
gb = ref.model.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
print("generate equal:", torch.equal(ga, gb))
# plain PyTorch fine-tuning step on the returned model
for m in (lm.model, ref.model):
    m.train()
    m.zero_grad(set_to_none=True)  # plain Lightning leaves the last step's grads on p.grad, megatrain None
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
wa, wb = dict(lm.model.named_parameters()), dict(ref.model.named_parameters())
print("plain SGD step after fit: worst rel", max(T.rel(wa[k].detach(), wb[k].detach()) for k in wb),
      "grads None:", sum(p.grad is None for p in wa.values()), "/", len(wa))
# a plain Trainer on the same module
v1 = pl.Trainer(strategy="auto", **KW).validate(lm, T.learnable_data(n=8, batch_size=4, seed=3), verbose=False)
v2 = pl.Trainer(strategy="auto", **KW).validate(ref, T.learnable_data(n=8, batch_size=4, seed=3), verbose=False)
print("plain Trainer.validate on the module after megatrain fit:", v1, v2)
# and fit it again with plain Lightning
l1, l2 = len(lm.losses), len(ref.losses)
pl.Trainer(strategy="auto", **KW).fit(lm, T.learnable_data(n=16, batch_size=4))
pl.Trainer(strategy="auto", **KW).fit(ref, T.learnable_data(n=16, batch_size=4))
print("plain fit after megatrain fit: losses", lm.losses[l1:], ref.losses[l2:])
print("worst weight rel", max(T.rel(dict(lm.model.named_parameters())[k].detach(), v.detach())
                              for k, v in ref.model.named_parameters()))
