#!/usr/bin/env bash
# An OCI registry for releases: Debian's docker-registry (CNCF Distribution, an OCI distribution-spec registry), on
# loopback, with TLS and basic auth — what `kiln push` and `kiln-run pull` meet at a team's own registry.
#
#   bash scripts/oci-registry.sh start DIR     # prints the registry address and what a client sets
#   bash scripts/oci-registry.sh stop DIR
#
# DIR holds everything: a private CA (DIR/ca.crt) and the server's certificate for 127.0.0.1 and localhost, the
# htpasswd file (bcrypt) for user `kiln` with a random password (DIR/password, mode 0600), the registry's config and
# its storage (DIR/store: blobs by digest). Clients trust DIR/ca.crt (SSL_CERT_FILE) and log in through the
# environment (KILN_OCI_USERNAME, KILN_OCI_PASSWORD) or the docker config file (~/.docker/config.json,
# $DOCKER_CONFIG/config.json). Any other OCI registry (Harbor, Zot, a cloud one) works the same way.
# Needs Debian's docker-registry (apt-get install docker-registry), openssl and the Kiln venv (bcrypt).
set -euo pipefail
cd "$(dirname "$0")/.."
ACTION=${1:-}; DIR=${2:-}
[[ "$ACTION" =~ ^(start|stop)$ && -n "$DIR" ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
if [ "$ACTION" = stop ]; then
  [ -f "$DIR/registry.pid" ] && { kill "$(cat "$DIR/registry.pid")" 2>/dev/null || true; rm -f "$DIR/registry.pid"; }
  echo "kiln oci-registry: stopped ($DIR)"; exit 0
fi
REGISTRY=$(command -v docker-registry || echo /usr/bin/docker-registry)
[ -x "$REGISTRY" ] || { echo "kiln oci-registry: error: Debian's docker-registry is not installed (apt-get install docker-registry)" >&2; exit 2; }
umask 077
if [ ! -f "$DIR/server.crt" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 -subj "/CN=kiln test CA" \
    -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$DIR/server.key" -out "$DIR/server.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$DIR/server.ext"
  openssl x509 -req -in "$DIR/server.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial -days 3650 \
    -extfile "$DIR/server.ext" -out "$DIR/server.crt" 2>/dev/null
  chmod 644 "$DIR/ca.crt"
fi
if [ ! -f "$DIR/htpasswd" ]; then
  .venv/bin/python - "$DIR" <<'EOF'
import secrets, sys
from pathlib import Path

import bcrypt

d = Path(sys.argv[1])
password = secrets.token_urlsafe(24)
(d / "password").write_text(password + "\n", encoding="utf-8")
(d / "htpasswd").write_text("kiln:" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(10)).decode() + "\n",
                            encoding="utf-8")
EOF
fi
PORT=$(cat "$DIR/port" 2>/dev/null || .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "$PORT" >"$DIR/port"
cat >"$DIR/config.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $DIR/store
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$PORT
  secret: $(cat "$DIR/password")
  tls:
    certificate: $DIR/server.crt
    key: $DIR/server.key
auth:
  htpasswd:
    realm: kiln
    path: $DIR/htpasswd
EOF
if ! { [ -f "$DIR/registry.pid" ] && kill -0 "$(cat "$DIR/registry.pid")" 2>/dev/null; }; then
  setsid "$REGISTRY" serve "$DIR/config.yml" >"$DIR/registry.log" 2>&1 &
  echo $! >"$DIR/registry.pid"
  up() { .venv/bin/python - "$DIR/ca.crt" "https://127.0.0.1:$PORT/v2/" 2>/dev/null <<'EOF'
import ssl, sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[2], context=ssl.create_default_context(cafile=sys.argv[1]), timeout=2)
except urllib.error.HTTPError:          # 401: up, and asking for credentials
    pass
EOF
  }
  for _ in $(seq 1 100); do
    up && break
    kill -0 "$(cat "$DIR/registry.pid")" 2>/dev/null || { tail -20 "$DIR/registry.log" >&2; exit 1; }
    sleep 0.1
  done
  up || { echo "kiln oci-registry: error: no answer on 127.0.0.1:$PORT after 10 s (see $DIR/registry.log)" >&2; exit 1; }
fi
cat <<EOF
registry: 127.0.0.1:$PORT (TLS, CA $DIR/ca.crt; basic auth, user kiln, password in $DIR/password)
# on each host that pushes or pulls:
export SSL_CERT_FILE=$DIR/ca.crt KILN_OCI_USERNAME=kiln KILN_OCI_PASSWORD="\$(cat $DIR/password)"
EOF
