#!/bin/bash
# The README's recipe on 2 CPU processes, smallest options: python recipes/finetune.py trainer.devices=2 data=legal
# Usage: bash probe/recipe_dp.sh OUTDIR [extra overrides]
out=$1; shift
cd "$(dirname "$0")/.." && PYTHONPATH=$PWD /usr/bin/time -v /work/main/.venv/bin/python recipes/finetune.py \
  trainer.devices=2 trainer.accelerator=cpu data=legal trainer.max_steps=2 eval.before=false eval.max_batches=1 \
  data.probe.max_items=4 data.seq_len=64 data.batch_size=1 data.max_documents=20 sample.max_new_tokens=4 \
  plot=false output_dir=$out "$@"
