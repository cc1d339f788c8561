#!/usr/bin/env bash
# Create .venv and install Kiln from the hash-locked requirements. Idempotent: a second run is a no-op check.
# Usage: bash scripts/setup.sh [--test]   (--test adds the test-only lock: pytest, dlib-bin)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Kiln needs Python 3.11, found " + sys.version' \
  || { echo "kiln setup: error: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's notes about this machine's empty extra index folders are noise; real errors still show and still fail.
pipi() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }
# The lock pins the torch 2.13.0+cpu wheel by sha256: it comes from the machine's local wheel folder (/opt/wheels)
# and no other build of torch can be installed in its place.
FL=(); [ -d /opt/wheels ] && FL=(--find-links /opt/wheels)
pipi "${FL[@]}" --require-hashes --no-deps -r lockfiles/main.txt
if [ "${1:-}" = "--test" ]; then pipi --require-hashes --no-deps -r lockfiles/test.txt; fi
pipi --no-deps --no-build-isolation -e .
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check; exit 1; }
