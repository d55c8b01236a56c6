"""Two NVMe-tier trainings one after another in one process (a notebook), the first Trainer dropped.
python probe/nvme_two_runs.py [gc]"""
import gc, os, sys, tempfile, warnings
import lightning.pytorch as pl
import megatrain_lightning  # noqa
from megatrain_lightning import testing as T
warnings.filterwarnings("ignore")
os.environ["MEGATRAIN_NVME_PATH"] = tempfile.mkdtemp()


def run():
    lm = T.LM(T.make_model("llama"))
    tr = pl.Trainer(strategy="megatrain_nvme", accelerator="cpu", devices=1, max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tr.fit(lm, T.make_data(n=8))
    return lm.losses


print("first", run())
if "gc" in sys.argv:
    gc.collect()
try:
    print("second", run())
except Exception as e:
    print("second raised", type(e).__name__, str(e)[:300])
