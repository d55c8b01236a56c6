"""The common user pattern `if trainer.is_global_zero: trainer.save_checkpoint(path)` after a 2-process fit.
python probe/dp_save_rank0.py OUT ddp|megatrain"""
import sys, time, warnings
from pathlib import Path
import lightning.pytorch as pl
from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning import testing as T
warnings.filterwarnings("ignore")
out, s = Path(sys.argv[1]), sys.argv[2]
strategy = MegaTrainStrategy(timeout=30) if s == "megatrain" else s
lm = T.LM(T.make_model("llama"))
tr = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
tr.fit(lm, T.make_data(n=16))
t = time.time()
if tr.is_global_zero:
    tr.save_checkpoint(out / "final")
    print(f"rank 0 saved in {time.time() - t:.1f}s:", sorted(p.name for p in (out / "final").iterdir())
          if (out / "final").is_dir() else (out / "final").exists())
