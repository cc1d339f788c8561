#!/usr/bin/env bash
# A shared DVC remote over SSH: Debian's OpenSSH server, key-only, on loopback (a team runs it on a storage host).
#
#   bash scripts/remote-server.sh start DIR    # prints the `dvc remote` lines and the known_hosts line for clients
#   bash scripts/remote-server.sh stop DIR
#
# Why SSH: it is the protocol every build host already has, DVC speaks it natively (dvc-ssh, in lockfiles/main.txt),
# it needs no extra service or credentials store, and OpenSSH is one apt package. The store is DIR/store (a plain
# directory of content-addressed files: the DVC cache layout, run cache included). DIR/client_key is the key the
# build hosts log in with (authorized for the server's user); DIR/known_hosts is the server's host key line, which
# clients put in ~/.ssh/known_hosts (dvc-ssh checks host keys). Runs as root (sshd's privilege separation).
set -euo pipefail
ACTION=${1:-}; DIR=${2:-}
[[ "$ACTION" =~ ^(start|stop)$ && -n "$DIR" ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
if [ "$ACTION" = stop ]; then
  [ -f "$DIR/sshd.pid" ] && { kill "$(cat "$DIR/sshd.pid")" 2>/dev/null || true; rm -f "$DIR/sshd.pid"; }
  echo "kiln remote: stopped ($DIR)"; exit 0
fi
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
[ -x "$SSHD" ] || { echo "kiln remote: error: OpenSSH server not installed (apt-get install openssh-server)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "kiln remote: error: run as root (sshd privilege separation), or use your own sshd" >&2; exit 2; }
mkdir -p /run/sshd "$DIR/store"
[ -f "$DIR/host_key" ] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/host_key"
[ -f "$DIR/client_key" ] || ssh-keygen -q -t ed25519 -N "" -C kiln-build-host -f "$DIR/client_key"
cp "$DIR/client_key.pub" "$DIR/authorized_keys"; chmod 600 "$DIR/authorized_keys"
PORT=$(cat "$DIR/port" 2>/dev/null || python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "$PORT" >"$DIR/port"
cat >"$DIR/sshd_config" <<EOF
Port $PORT
ListenAddress 127.0.0.1
HostKey $DIR/host_key
AuthorizedKeysFile $DIR/authorized_keys
PidFile $DIR/sshd.pid
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
EOF
if ! { [ -f "$DIR/sshd.pid" ] && kill -0 "$(cat "$DIR/sshd.pid")" 2>/dev/null; }; then
  "$SSHD" -f "$DIR/sshd_config" -E "$DIR/sshd.log"
  for _ in $(seq 1 50); do [ -f "$DIR/sshd.pid" ] && break; sleep 0.1; done
fi
echo "[127.0.0.1]:$PORT $(cut -d' ' -f1,2 "$DIR/host_key.pub")" >"$DIR/known_hosts"
USER_NAME=$(id -un)
cat <<EOF
# on each build host (after adding $DIR/known_hosts to ~/.ssh/known_hosts):
dvc remote add -d shared ssh://$USER_NAME@127.0.0.1:$PORT$DIR/store
dvc remote modify --local shared keyfile $DIR/client_key
EOF
