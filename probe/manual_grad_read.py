"""Manual optimization: what param.grad holds between manual_backward and opt.step(), megatrain vs plain."""
import warnings
import torch
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
warnings.filterwarnings("ignore")


class M(T.LM):
    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False
        self.seen = []

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.model(**T.batch_inputs(batch)).loss
        self.manual_backward(loss)
        g = self.model.model.layers[0].mlp.up_proj.weight.grad
        self.seen.append(None if g is None else float(g.norm()))
        opt.step()


for s in ("auto", "megatrain"):
    m = M(T.make_model("llama"))
    pl.Trainer(strategy=s, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(m, T.make_data(n=8))
    print(s, "grad norm after manual_backward:", m.seen)
