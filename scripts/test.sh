#!/usr/bin/env bash
# Set up the environment (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python -m pytest tests "$@"
