#!/usr/bin/env bash
# Set up (idempotent, with the test-only lock) and run the test suite: `bash scripts/test.sh` (args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
source scripts/env.sh
python -m pytest "$@"
