"""A checkpoint save on a full disk: the error and what is left, at every amount of free space.

Mounts a small tmpfs (needs root: ``mount -t tmpfs``), trains a tiny Llama for 2 steps with
``strategy="megatrain"`` (or ``megatrain_nvme``, its store on the same tmpfs), saves ``last.ckpt`` there, then for
free space from 0 to one checkpoint's size (``--step`` bytes apart) fills the disk to leave that much and saves
``last.ckpt`` again. Per row: the exception (or "saved"), whether the previous checkpoint still verifies
(``verified_info``: every file against its checksum), and what else is in the directory. The promise checked
(docs/guide/checkpoints.md, "How a save is written"): a failed save raises ``OSError`` ENOSPC naming the checkpoint, leaves
nothing beside it and the previous checkpoint loadable. Run as root::

    PYTHONPATH=. python bench/full_disk.py [--tier ram|nvme] [--size-mib 20] [--step 98304]

Prints a table and writes bench/results/full_disk_<tier>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", choices=("ram", "nvme"), default="ram")
    ap.add_argument("--size-mib", type=int, default=20, help="tmpfs size (MiB)")
    ap.add_argument("--step", type=int, default=96 * 1024, help="free-space step between rows (bytes)")
    args = ap.parse_args()

    import lightning.pytorch as pl
    import torch

    import megatrain_lightning  # noqa: F401
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.checkpoint.directory import verified_info
    from megatrain_lightning.testing import LM, make_data, make_model

    torch.set_num_threads(1)
    mnt = Path(tempfile.mkdtemp(prefix="megatrain_full_disk_"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.size_mib}m", "tmpfs", str(mnt)], check=True)
    rows = []
    try:
        strategy = (MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(mnt / "store"))
                    if args.tier == "nvme" else "megatrain")
        if args.tier == "nvme":
            (mnt / "store").mkdir()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LM(make_model("llama")), make_data(n=8))
        last = mnt / "last.ckpt"
        trainer.save_checkpoint(last)
        size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
        for leave in range(0, size + args.step, args.step):
            free = shutil.disk_usage(mnt).free
            with open(mnt / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - leave))
            try:
                trainer.save_checkpoint(last)
                result = "saved"
            except Exception as e:  # noqa: BLE001 - the row reports what was raised
                result = f"{type(e).__name__} errno={getattr(e, 'errno', None)}: {str(e)[:90]}"
            os.remove(mnt / "filler")
            try:
                verified_info(last)
                previous = "verifies"
            except Exception as e:  # noqa: BLE001
                previous = f"BROKEN ({type(e).__name__})"
            beside = sorted(p.name for p in mnt.iterdir() if p.name not in ("last.ckpt", "store"))
            rows.append({"free_bytes_left": leave, "result": result, "last.ckpt": previous, "beside": beside})
        del trainer
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=False)  # the NVMe store's files may still be open
        shutil.rmtree(mnt, ignore_errors=True)
    print(f"checkpoint {size:,} bytes, tier {args.tier}, tmpfs {args.size_mib} MiB")
    print(f"{'free left':>10}  {'last.ckpt':<10}  {'beside':<8}  result")
    for r in rows:
        print(f"{r['free_bytes_left']:>10,}  {r['last.ckpt']:<10}  {len(r['beside']):<8}  {r['result']}")
    out = Path(__file__).with_name("results") / f"full_disk_{args.tier}.json"
    out.write_text(json.dumps({"bench": "full_disk", "args": vars(args), "checkpoint_bytes": size, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
