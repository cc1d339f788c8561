# Environment shared by scripts/run.sh, scripts/test.sh and DVC stages: the venv first on PATH, quiet telemetry.
KILN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$KILN_ROOT/.venv/bin:$PATH"
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true DVC_NO_ANALYTICS=1
