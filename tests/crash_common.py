"""Model, data and schedule shared by test_crash.py and its subprocess (kill_worker.py)."""

import torch
from torch.utils.data import TensorDataset

from megatrain_lightning.data import ResumableDataLoader
from megatrain_lightning.testing import LM, SEQ, VOCAB, make_model

TOTAL = 6


def loader():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (20, SEQ), generator=g)
    return ResumableDataLoader(TensorDataset(ids), batch_size=2, shuffle=True, seed=3)


def lm():
    return LM(make_model("llama"), sched="cosine", total_steps=TOTAL)
