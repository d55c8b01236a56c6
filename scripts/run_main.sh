#!/usr/bin/env bash
# Set up the environment (idempotent) and run the main job on its embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python recipes/finetune.py "$@"
