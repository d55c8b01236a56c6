"""Compare probe/dp_user.py's 2-process run (OUT) with plain PyTorch on the global batch 4 and a plain val loss.

python probe/dp_check.py OUT STEPS
"""
import sys, json
from pathlib import Path
import torch
from megatrain_lightning import testing as T

out, steps = Path(sys.argv[1]), int(sys.argv[2])
ids = next(iter(T.make_data(n=32, batch_size=32)))[0]


def batches(shuffle):
    e = 0
    while True:
        perm = torch.randperm(32, generator=torch.Generator().manual_seed(e)) if shuffle else torch.arange(32)
        e += 1
        for i in range(0, 32, 4):
            yield (ids[perm[i:i + 4]],)


for shuffle in (False, True):
    class L:
        def __iter__(self):
            return batches(shuffle)
    m = T.make_model("llama")
    T.reference_train(m, L(), steps)
    w = torch.load(out / "weights.pt")
    worst = max(T.rel(w[k], p.detach()) for k, p in m.named_parameters())
    print(f"shuffle={shuffle}: worst weight rel err {worst:.2e}")
    if shuffle or True:
        val = next(iter(T.make_data(n=8, batch_size=8, seed=5)))[0]
        with torch.no_grad():
            ref_val = sum(m(input_ids=val[i:i + 2], labels=val[i:i + 2]).loss.item() for i in range(0, 8, 2)) / 4
        print("  val_loss logged", json.loads((out / "metrics.json").read_text())["val_loss"], "plain", ref_val)
