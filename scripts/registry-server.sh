#!/usr/bin/env bash
# A shared Kiln registry: an MLflow tracking server backed by PostgreSQL, the server proxying artifact storage.
#
#   bash scripts/registry-server.sh start DIR [MLFLOW_PORT]   # prints `export MLFLOW_TRACKING_URI=http://HOST:PORT`
#   bash scripts/registry-server.sh stop DIR
#
# DIR holds everything: the PostgreSQL cluster (DIR/pg, its own port, its socket in DIR/pg), the artifact store
# (DIR/artifacts) and the logs. The database listens on 127.0.0.1 only, with trust authentication for the local
# cluster user: a team puts it behind their own network policy, or points --backend-store-uri at a managed
# PostgreSQL instead (the mlflow line below is all that changes). Every build host and release engineer then sets
# MLFLOW_TRACKING_URI to the printed URL; `kiln register/promote/rollback/history/release` work as on SQLite.
# Needs Debian's postgresql (apt-get install postgresql) and the Kiln venv (scripts/setup.sh: mlflow, psycopg2).
set -euo pipefail
cd "$(dirname "$0")/.."
ACTION=${1:-}; DIR=${2:-}
[[ "$ACTION" =~ ^(start|stop)$ && -n "$DIR" ]] || { echo "usage: $0 start|stop DIR [MLFLOW_PORT]" >&2; exit 2; }
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$PGBIN/initdb" ] || { echo "kiln registry: error: PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 2; }
# PostgreSQL refuses to run as root: run its tools as the `postgres` system user then.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
free_port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

if [ "$ACTION" = stop ]; then
  [ -f "$DIR/mlflow.pid" ] && { kill -- "-$(cat "$DIR/mlflow.pid")" 2>/dev/null || true; rm -f "$DIR/mlflow.pid"; }
  [ -f "$DIR/pg/postmaster.pid" ] && as_pg "$PGBIN/pg_ctl" -D "$DIR/pg" -m fast -w stop >/dev/null
  echo "kiln registry: stopped ($DIR)"; exit 0
fi

if [ ! -f "$DIR/pg/PG_VERSION" ]; then
  mkdir -p "$DIR/pg"; [ "$(id -u)" = 0 ] && chown postgres "$DIR/pg"
  as_pg "$PGBIN/initdb" -D "$DIR/pg" -U kiln --auth=trust -E UTF8 >"$DIR/initdb.log"
fi
PGPORT=$(cat "$DIR/pg.port" 2>/dev/null || free_port); echo "$PGPORT" >"$DIR/pg.port"
if [ ! -f "$DIR/pg/postmaster.pid" ]; then
  as_pg "$PGBIN/pg_ctl" -D "$DIR/pg" -w -l "$DIR/pg/server.log" \
    -o "-p $PGPORT -k $DIR/pg -c listen_addresses=127.0.0.1" start >/dev/null
fi
as_pg "$PGBIN/psql" -h 127.0.0.1 -p "$PGPORT" -U kiln -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='mlflow'" \
  | grep -q 1 || as_pg "$PGBIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U kiln mlflow
DB="postgresql+psycopg2://kiln@127.0.0.1:$PGPORT/mlflow"
.venv/bin/python -m mlflow db upgrade "$DB" >"$DIR/migrate.log" 2>&1 \
  || { tail -20 "$DIR/migrate.log" >&2; echo "kiln registry: error: migrating $DB failed" >&2; exit 1; }

PORT=${3:-$(free_port)}
if [ -f "$DIR/mlflow.pid" ] && kill -0 "$(cat "$DIR/mlflow.pid")" 2>/dev/null; then
  PORT=$(cat "$DIR/mlflow.port")
else
  MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid .venv/bin/python -m mlflow server \
    --backend-store-uri "$DB" --artifacts-destination "$DIR/artifacts" --host 127.0.0.1 --port "$PORT" \
    --workers 2 >"$DIR/mlflow.log" 2>&1 &
  echo $! >"$DIR/mlflow.pid"; echo "$PORT" >"$DIR/mlflow.port"
  healthy() { .venv/bin/python -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
                "http://127.0.0.1:$PORT/health" 2>/dev/null; }
  for _ in $(seq 1 120); do
    healthy && break
    kill -0 "$(cat "$DIR/mlflow.pid")" 2>/dev/null || { tail -20 "$DIR/mlflow.log" >&2; exit 1; }
    sleep 0.5
  done
  healthy || { echo "kiln registry: error: the server is not healthy after 60 s (see $DIR/mlflow.log)" >&2; exit 1; }
fi
echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$PORT   # PostgreSQL $DB, artifacts $DIR/artifacts"
