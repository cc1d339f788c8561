#!/usr/bin/env bash
# Set up (idempotent) and run the full default DAG: `bash scripts/run.sh` (extra args go to `dvc repro`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
dvc repro "$@"
