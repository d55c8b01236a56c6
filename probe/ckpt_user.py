"""Checkpoints as a user uses them: fit (max_epochs), save_checkpoint, from_pretrained of model/, validate/test/predict
after fit against plain Lightning on the same weights, save again after a second fit, frozen layers.

python probe/ckpt_user.py ARCH [--freeze]
"""
import sys, tempfile, warnings
from pathlib import Path
import torch
import transformers
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
sys.path.insert(0, str(Path(__file__).parent))
from features import Base  # noqa: E402
warnings.filterwarnings("ignore")

arch = sys.argv[1]
freeze = "--freeze" in sys.argv
tmp = Path(tempfile.mkdtemp())
KW = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False)


def trained(strategy):
    model = T.make_model(arch)
    if freeze:
        for n, p in model.named_parameters():
            if "layers.0." in n or ".h.0." in n:
                p.requires_grad_(False)
    lm = Base(model, lr=1e-2)
    tr = pl.Trainer(strategy=strategy, max_epochs=2, **KW)
    tr.fit(lm, T.learnable_data(n=12, batch_size=4), T.learnable_data(n=8, batch_size=4, seed=3))
    return lm, tr


lm, tr = trained("megatrain")
ref, rtr = trained("auto")
sd = {k: v.detach().clone() for k, v in lm.model.state_dict().items()}
print("megatrain vs plain after fit: worst weight rel", max(T.rel(sd[k], v) for k, v in ref.model.state_dict().items()))
tr.save_checkpoint(tmp / "final")
hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "final" / "model", attn_implementation="eager")
hsd = hf.state_dict()
bad = [k for k in sd if k not in hsd or not torch.equal(hsd[k], sd[k])]
print("from_pretrained(model/) == in-memory state_dict:", not bad, bad[:5], "missing", set(sd) - set(hsd), "extra", set(hsd) - set(sd))

val = T.learnable_data(n=8, batch_size=4, seed=3)
outs = {}
for name, (l, t) in {"megatrain": (lm, tr), "plain": (ref, rtr)}.items():
    v = t.validate(l, val, verbose=False)[0]["val_loss"]
    te = t.test(l, val, verbose=False)[0]["test_loss"]
    pr = torch.cat(t.predict(l, val))
    outs[name] = (v, te, pr)
m, p = outs["megatrain"], outs["plain"]
print(f"validate {m[0]:.6f} vs plain {p[0]:.6f}; test {m[1]:.6f} vs {p[1]:.6f}; predict rel {T.rel(m[2], p[2]):.1e}")
hf.eval()
with torch.no_grad():
    logits = torch.cat([hf(input_ids=b[0]).logits for b in val])
print(f"predict vs from_pretrained model rel {T.rel(m[2], logits):.1e}")

# a second fit on the same Trainer, then save again to the same path
for l, t in ((lm, tr), (ref, rtr)):
    t.fit_loop.max_epochs = 3
    t.fit(l, T.learnable_data(n=12, batch_size=4))
print("after 2nd fit: steps", tr.global_step, rtr.global_step, "worst weight rel",
      max(T.rel(lm.model.state_dict()[k], v) for k, v in ref.model.state_dict().items()))
tr.save_checkpoint(tmp / "final")
hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp / "final" / "model")
print("re-save to same path: equal to in-memory:",
      all(torch.equal(hf2.state_dict()[k], v) for k, v in lm.model.state_dict().items()))
