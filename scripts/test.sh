#!/usr/bin/env bash
# Set up (idempotent, with the test-only lock) and run the test suite: `bash scripts/test.sh` (args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
source scripts/env.sh
# Two workers, one test file each at a time (`--dist loadfile`), in the order tests/conftest.py gives: the DVC
# pipeline module (the whole default DAG in a copy, then DVC's behaviour on it) starts first on one core while the
# other files run on the other, which ends with the build-hosts test on a copy of that build. KILN_TEST_WORKERS=0
# runs everything in this process.
python -m pytest -n "${KILN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
