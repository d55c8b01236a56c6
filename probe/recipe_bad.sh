#!/bin/bash
# Bad distributed options to the recipe: each should be one "error: <key>: ..." line, exit 2, before the model loads.
cd "$(dirname "$0")/.."
for o in "trainer.devices=0" "trainer.num_nodes=0" "trainer.devices=-3" "trainer.devices=abc" \
         "trainer.devices=2 strategy=megatrain_nvme strategy.nvme_path=/tmp/p11/nvme" "trainer.num_nodes=2"; do
  echo "=== $o"
  s=$(date +%s)
  PYTHONPATH=$PWD timeout 300 /work/main/.venv/bin/python recipes/finetune.py trainer.accelerator=cpu trainer.max_steps=1 \
    eval.before=false output_dir=/tmp/p11/recbad $o > /tmp/p11/recbad.log 2>&1
  echo "rc=$? $(( $(date +%s) - s ))s"; grep -E "^error|Error|GGUF|rank" /tmp/p11/recbad.log | cut -c1-400 | tail -3
done
