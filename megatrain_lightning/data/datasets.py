"""Map-style datasets over tokenized tensors and the padding collate; every item/batch is
``{"input_ids", "labels", "attention_mask"}`` of int64 (LongTensor)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


class PackedDataset(Dataset):
    """Rows of packed text: item ``i`` has ``input_ids = labels = rows[i]`` and ``attention_mask`` all ones, each ``[seq_len]``.

    Args:
        rows: integer tensor ``[N, seq_len]`` (int32 in the cache; returned as int64).
    """

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i].long()
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


class InstructionDataset(Dataset):
    """Variable-length examples stored flat: item ``i`` spans ``ids[offsets[i]:offsets[i+1]]``.

    Args:
        ids: int32 ``[total]`` token ids of all examples back to back.
        trained: uint8/bool ``[total]``, 1 where the token is in the loss (answer and end-of-turn/EOS).
        offsets: int64 ``[N + 1]`` example boundaries.

    Items: ``input_ids`` ``[L]``, ``labels`` ``[L]`` (``-100`` where not trained), ``attention_mask`` ones ``[L]``.
    """

    def __init__(self, ids: torch.Tensor, trained: torch.Tensor, offsets: torch.Tensor):
        self.ids, self.trained, self.offsets = ids, trained.bool(), offsets

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = self.ids[a:b].long()
        labels = ids.masked_fill(~self.trained[a:b], IGNORE_INDEX)
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


class PadCollate:
    """Right-pad a list of items to the longest in the batch (``[B, T]``, ``T <= seq_len``): ``input_ids`` with
    ``pad_id``, ``labels`` with ``-100``, ``attention_mask`` with 0. A class (not a closure) so DataLoader workers can
    pickle it."""

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        t = max(x["input_ids"].numel() for x in items)
        fill = {"input_ids": self.pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        out = {k: torch.full((len(items), t), v, dtype=torch.long) for k, v in fill.items()}
        for r, x in enumerate(items):
            n = x["input_ids"].numel()
            for k in fill:
                out[k][r, :n] = x[k]
        return out
