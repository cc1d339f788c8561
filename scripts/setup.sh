#!/usr/bin/env bash
# Create .venv and install Kiln from the hash-locked requirements. Idempotent: a second run is a no-op check.
# Usage: bash scripts/setup.sh [--test] [--profile rtx|edge|xla|tvm]
#   --test          adds the test-only lock (pytest, dlib-bin), every profile lock the tests build with (rtx, edge, xla, tvm) and,
#                   if missing, Debian's chromium, postgresql, openssh-server, docker-registry (report, shared
#                   registry, remote and OCI registry tests; root or sudo)
#   --profile rtx   adds lockfiles/rtx.txt: the TensorRT-RTX wheels the tensorrt-rtx target builds with (profiles/rtx.yaml)
#   --profile edge  adds lockfiles/edge.txt: ExecuTorch (XNNPACK) for the executorch-xnnpack target and the LiteRT
#                   runtime for the litert target (profiles/edge.yaml), and creates .venv-litert, the LiteRT
#                   converter's own venv (lockfiles/litert-convert.txt: pins the main venv cannot hold)
#   --profile xla   adds lockfiles/xla.txt: jax[cpu] and torchax for the xla target (profiles/xla.yaml)
#   --profile tvm   adds lockfiles/tvm.txt: Apache TVM (and what MetaSchedule tuning imports) for the tvm target (profiles/tvm.yaml)
#        bash scripts/setup.sh --torch-source   (print where the pinned torch wheel would come from, then exit)
set -euo pipefail
cd "$(dirname "$0")/.."
# The lock pins the torch 2.13.0+cpu wheel by sha256. It is not on PyPI: on our machines it sits in a local wheel
# folder ($KILN_WHEELS, default /opt/wheels); elsewhere the same wheel (same sha256, pip checks it) comes from
# PyTorch's own CPU index.
WHEELS=${KILN_WHEELS:-/opt/wheels}
TORCH_INDEX=https://download.pytorch.org/whl/cpu
torch_source() {
  if compgen -G "$WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then echo "--find-links $WHEELS"
  else echo "--extra-index-url $TORCH_INDEX"; fi
}
if [ "${1:-}" = "--torch-source" ]; then torch_source; exit 0; fi
TEST=0; PROFILES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --test) TEST=1; PROFILES+=(rtx edge xla tvm) ;;
    --profile) [[ "${2:-}" =~ ^[a-z0-9-]+$ && -f "lockfiles/${2:-}.txt" ]] || { echo "kiln setup: error: no lockfile lockfiles/${2:-}.txt for --profile ${2:-}" >&2; exit 2; }
               PROFILES+=("$2"); shift ;;
    *) echo "kiln setup: error: unknown argument $1 (use --test, --profile NAME, --torch-source)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Kiln needs Python 3.11, found " + sys.version' \
  || { echo "kiln setup: error: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's notes about this machine's empty extra index folders are noise; real errors still show and still fail.
pipi() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }
# The locks go in with uv (itself pinned by sha256 in lockfiles/uv.txt, installed by pip): the same hash-checked
# wheels, no resolution (--no-deps), unpacked and byte-compiled in parallel — `--test` ≈ 70 s from an empty uv cache
# on a 2-core EPYC where pip took ≈ 3 min. --compile-bytecode as pip does: under PYTHONDONTWRITEBYTECODE (CI's
# machines set it) a venv without .pyc files compiles every import from source, and the suite took 49 min, not 41.
# Every index is searched for every package, as pip does (`unsafe-best-match`; the hashes pin the files).
pipi --require-hashes --no-deps -r lockfiles/uv.txt
uvi() { .venv/bin/uv pip install -q --compile-bytecode --index-strategy unsafe-best-match --require-hashes --no-deps "$@"; }
# shellcheck disable=SC2046  # torch_source prints two words on purpose
uvi --python .venv/bin/python $(torch_source) -r lockfiles/main.txt
if [ "$TEST" = 1 ]; then uvi --python .venv/bin/python -r lockfiles/test.txt; fi
for p in $(printf '%s\n' "${PROFILES[@]}" | sort -u); do uvi --python .venv/bin/python -r "lockfiles/$p.txt"; done
if printf '%s\n' "${PROFILES[@]}" | grep -qx edge; then
  [ -x .venv-litert/bin/python ] || "$PY" -m venv .venv-litert
  # shellcheck disable=SC2046
  uvi --python .venv-litert/bin/python $(torch_source) -r lockfiles/litert-convert.txt
  .venv-litert/bin/python -m pip check >/dev/null || { .venv-litert/bin/python -m pip check; exit 1; }
fi
pipi --no-deps --no-build-isolation -e .
# The deployment runtime (runtime/: kiln_runtime, `kiln-run`), editable: the build's stages import it, so what the
# gates judge is the code a deployment host runs. Its dependencies are in the main lock (runtime/lockfile.in is
# resolved against it); a deployment host installs runtime/lockfile.txt instead (docs/layout.md: Lockfiles).
pipi --no-deps --no-build-isolation -e runtime
# Debian packages the tests use, installed here if missing: chromium (the HTML report is rendered in it),
# postgresql (the shared-registry test runs scripts/registry-server.sh), openssh-server (scripts/remote-server.sh),
# docker-registry (CNCF Distribution: the OCI registry tests push to and pull from, scripts/oci-registry.sh),
# qemu-user (`kiln rebuild-check --cpu`: the portable stages rebuilt on an emulated CPU of another ISA class).
if [ "$TEST" = 1 ]; then
  DEBS=()
  command -v chromium >/dev/null || DEBS+=(chromium)
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || DEBS+=(postgresql)
  [ -x /usr/sbin/sshd ] || DEBS+=(openssh-server)
  command -v docker-registry >/dev/null || DEBS+=(docker-registry)
  command -v qemu-x86_64 >/dev/null || DEBS+=(qemu-user)
  if [ ${#DEBS[@]} -gt 0 ]; then
    SUDO=(); [ "$(id -u)" = 0 ] || SUDO=(sudo -n)
    { "${SUDO[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq \
        --no-install-recommends "${DEBS[@]}" >/dev/null; } \
      || { echo "kiln setup: error: the tests need ${DEBS[*]}; install with: apt-get install ${DEBS[*]}" >&2; exit 2; }
  fi
fi
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check; exit 1; }
