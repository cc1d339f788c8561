#!/usr/bin/env bash
# Set up (idempotent) and run the full default DAG: `bash scripts/run.sh` (extra args go to `dvc repro`).
# dvc.yaml is derived from the stage declarations and params.yaml: `kiln dag --write` brings it in step first
# (and validates every target's options), so editing params.yaml is all it takes to add a model or an engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
kiln dag --write
dvc repro "$@"
