"""Host RSS of a CPU training process apart from its training state (the planner's "process overhead").

Imports torch + lightning + transformers, builds a tiny Llama (:func:`megatrain_lightning.testing.make_model`),
trains it for 2 steps with ``Trainer(strategy="megatrain", accelerator="cpu")`` and prints the peak RSS
(``ru_maxrss``) and the current RSS at three points, minus the training state (16 B/param: fp32 master,
gradient, AdamW moments; kilobytes for this model). Run::

    PYTHONPATH=. python bench/process_overhead.py                           # 32-true
    PYTHONPATH=. python bench/process_overhead.py --precision bf16-mixed    # writes process_overhead_bf16-mixed.json

Writes bench/results/process_overhead.json. The planner's CPU figure (``planning/terms.py`` ``PROCESS_OVERHEAD_CPU``) comes from this script.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path


def rss() -> int:
    """Current resident set size in bytes (``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    """Peak RSS of this process in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="32-true", help="Trainer(precision=...): 32-true or bf16-mixed")
    args = ap.parse_args()
    mib = 2**20
    import lightning.pytorch as pl
    import torch
    import transformers  # noqa: F401

    print(f"after imports:       rss {rss() / mib:7.1f} MiB  peak {peak() / mib:7.1f} MiB")
    from megatrain_lightning.testing import LM, make_data, make_model

    model = make_model("llama")
    n = sum(p.numel() for p in model.parameters())
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=2, logger=False,
                         precision=args.precision,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    print(f"after Trainer():     rss {rss() / mib:7.1f} MiB  peak {peak() / mib:7.1f} MiB")
    trainer.fit(LM(model), make_data())
    state = 16 * n
    print(f"after fit (2 steps): rss {rss() / mib:7.1f} MiB  peak {peak() / mib:7.1f} MiB")
    print(f"params {n:,}; state 16 B/param = {state / mib:.2f} MiB; torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    print(f"process overhead (peak - state): {(peak() - state) / mib:.1f} MiB = {(peak() - state) / 2**30:.3f} GiB")
    suffix = "" if args.precision == "32-true" else f"_{args.precision}"
    out = Path(__file__).with_name("results") / f"process_overhead{suffix}.json"
    out.write_text(json.dumps({"bench": "process_overhead", "precision": args.precision, "params": n, "state_bytes": state, "peak_rss_bytes": peak(),
                               "overhead_bytes": peak() - state, "torch": torch.__version__,
                               "threads": torch.get_num_threads()}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
