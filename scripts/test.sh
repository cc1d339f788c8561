#!/usr/bin/env bash
# Set up (idempotent, with the test-only lock) and run the test suite: `bash scripts/test.sh` (args go to pytest).
# `bash scripts/test.sh --fast`: the fast tier for the edit-test loop — unit and contract tests and the small
# session build, every test not marked `slow` (tests/conftest.py marks the tests whose fixtures build the default
# DAG, the reliability project, a registry server or an opt-in target's engines). The plain command is the full
# suite, what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    tier=(-m "not slow")
fi
bash scripts/setup.sh --test
source scripts/env.sh
# Two workers, one test file each at a time (`--dist loadfile`), in the order tests/conftest.py gives: the DVC
# pipeline module (the whole default DAG in a copy, then DVC's behaviour on it) starts first on one core while the
# other core runs the files that take minutes, longest first (the build-hosts test among them, once that build is
# done), then both share the short ones. KILN_TEST_WORKERS=0 runs everything in this process.
python -m pytest -n "${KILN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "${tier[@]}" "$@"
