#!/usr/bin/env bash
# Bring up, on this machine, for a try:
#   - the 3-node NATS cluster of deploy/nats-cluster (JetStream, users and permissions from
#     deploy/accounts.conf), its configs rendered into the run directory with the ports below;
#   - the loop's streams, buckets and inbound consumer (R3), made by `improved provision` as
#     the provisioning user improved-admin: the daemon's user may not create or change them;
#   - two improved daemon replicas sharing the inbound durable consumer, one seeded on n1 and
#     one on n2 (each learns the other nodes from the cluster);
#   - the reference ranking store serving `ranking.improve.apply` as user svc-ranking.
# Everything runs in the background; state and logs go to the run directory. deploy/down.sh
# stops it all. Every port is checked free before anything starts; a start that fails stops
# what this script started and says why on its first line (deploy/README.md, Try it).
#
# Environment:
#   IMPROVED_CLUSTER_PORT          first client port; n1, n2, n3 take it and the next two (4222)
#   IMPROVED_CLUSTER_ROUTE_PORT    first route port, likewise (6222)
#   IMPROVED_CLUSTER_MONITOR_PORT  first monitoring (HTTP) port, likewise (8222)
#   IMPROVED_RUN_DIR               (default ${XDG_STATE_HOME:-~/.local/state}/improved-cluster)
#   IMPROVED_VENV (default <repo>/.venv), NATS_SERVER (default the venv's nats-server),
#   WITH_RANKING=0 to skip the ranking store.
# Exit: 0 up; 1 a start failed (everything it started is stopped again) or it already runs;
# 2 it could not start as given (a port in use or not a port, a program missing).
set -euo pipefail
set -E  # the ERR trap also fires inside functions

HERE=$(cd -- "$(dirname -- "$0")" && pwd)
ROOT=$(dirname -- "$HERE")
VENV=${IMPROVED_VENV:-$ROOT/.venv}
NATS_SERVER=${NATS_SERVER:-$VENV/bin/nats-server}
IMPROVED=$VENV/bin/improved
PYTHON=$VENV/bin/python
RUN_DIR=${IMPROVED_RUN_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/improved-cluster}
WITH_RANKING=${WITH_RANKING:-1}

# Reference passwords from deploy/accounts.conf (change both places together). Each goes into
# a file of its own under $RUN_DIR/secrets (mode 0600) and every process reads it from there:
# no password on a command line, in a URL, in a config file or in a log.
declare -A PASSWORDS=(
  [improved-admin]=dev-admin-pw
  [improved]=dev-improved-pw
  [operator]=dev-operator-pw
  [svc-ranking]=dev-ranking-pw
)

# Before anything is started or written: one line, and the exit code of a refusal.
refuse() {
  local code=$1
  shift
  echo "up.sh: $*" >&2
  exit "$code"
}

for arg in "$@"; do
  case $arg in
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) refuse 2 "unknown argument $arg (the ports are set by IMPROVED_CLUSTER_PORT," \
      "IMPROVED_CLUSTER_ROUTE_PORT and IMPROVED_CLUSTER_MONITOR_PORT; see --help)" ;;
  esac
done

for exe in "$NATS_SERVER" "$IMPROVED" "$PYTHON"; do
  [ -x "$exe" ] || refuse 2 "$exe not found (set IMPROVED_VENV or NATS_SERVER); nothing started"
done

# -- the ports --------------------------------------------------------------------------------
# port_base <variable> <default>: the first of the three ports the variable sets.
port_base() {
  local var=$1 value=${!1:-$2}
  if ! [[ $value =~ ^[0-9]{1,5}$ ]] || [ "$value" -lt 1 ] || [ "$value" -gt 65533 ]; then
    refuse 2 "$var=$value is not a port number (1-65533: nodes n1, n2, n3 take it and the" \
      "next two); nothing started"
  fi
  echo $((10#$value))
}
CLIENT_PORT=$(port_base IMPROVED_CLUSTER_PORT 4222)
ROUTE_PORT=$(port_base IMPROVED_CLUSTER_ROUTE_PORT 6222)
MONITOR_PORT=$(port_base IMPROVED_CLUSTER_MONITOR_PORT 8222)
client_port() { echo $((CLIENT_PORT + $1 - 1)); }
route_port() { echo $((ROUTE_PORT + $1 - 1)); }
monitor_port() { echo $((MONITOR_PORT + $1 - 1)); }

# Every port the cluster will listen on, as "port variable role", in the order checked.
declare -a PORTS=()
for n in 1 2 3; do
  PORTS+=("$(client_port "$n") IMPROVED_CLUSTER_PORT client-port-of-node-n$n")
  PORTS+=("$(route_port "$n") IMPROVED_CLUSTER_ROUTE_PORT route-port-of-node-n$n")
  PORTS+=("$(monitor_port "$n") IMPROVED_CLUSTER_MONITOR_PORT monitoring-port-of-node-n$n")
done
declare -A OWNER=()
for entry in "${PORTS[@]}"; do
  read -r port var role <<<"$entry"
  if [ -n "${OWNER[$port]:-}" ] && [ "${OWNER[$port]}" != "$var" ]; then
    refuse 2 "port $port would be taken twice ($var and ${OWNER[$port]} overlap: each sets" \
      "three ports in a row); nothing started"
  fi
  OWNER[$port]=$var
done

# A pid file whose process is still alive means it is already up.
running() {
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}
if [ -d "$RUN_DIR" ]; then
  for pidfile in "$RUN_DIR"/*.pid; do
    if [ -e "$pidfile" ] && running "$pidfile"; then
      refuse 1 "already running ($pidfile); stop it first with $HERE/down.sh"
    fi
  done
fi

# The first port something already listens on (or that cannot be bound), else nothing: bound
# as nats-server binds it, so a port in TIME_WAIT counts as free and any listener as busy.
busy_port() {
  "$PYTHON" - "$@" <<'PY'
import socket
import sys

for port in sys.argv[1:]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(port)))
        except OSError:
            print(port)
            break
PY
}
declare -a ALL_PORTS=()
for entry in "${PORTS[@]}"; do
  ALL_PORTS+=("${entry%% *}")
done
busy=$(busy_port "${ALL_PORTS[@]}")
if [ -n "$busy" ]; then
  for entry in "${PORTS[@]}"; do
    read -r port var role <<<"$entry"
    [ "$port" = "$busy" ] || continue
    refuse 2 "port $port (${role//-/ }) is in use; choose three free ports in a row with" \
      "$var=N; nothing started"
  done
fi

# -- from here on, a failure stops everything this script started ---------------------------
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/data" "$RUN_DIR/nats-cluster"
RUN_DIR=$(cd -- "$RUN_DIR" && pwd)
cd "$RUN_DIR"
(umask 077 && mkdir -p secrets)
for user in "${!PASSWORDS[@]}"; do
  (umask 077 && printf '%s\n' "${PASSWORDS[$user]}" >"secrets/$user.pw")
done
rm -f -- "$RUN_DIR"/*.pid  # left by a run that is gone (checked above)

declare -a STARTED=()
UP=0

# fail <what failed> [log file]: the cause first, on one line, then the last lines of the log.
fail() {
  local what=$1 log=${2:-}
  if [ -n "$log" ]; then
    echo "up.sh: $what; its log: $log" >&2
    [ -f "$log" ] && tail -n 5 "$log" | sed 's/^/  | /' >&2
  else
    echo "up.sh: $what" >&2
  fi
  exit 1
}
on_error() {
  fail "failed: \`$2\` (status $3, line $1 of $0)"
}
trap 'on_error "$LINENO" "$BASH_COMMAND" "$?"' ERR
trap 'echo "up.sh: interrupted" >&2; exit 130' INT
trap 'echo "up.sh: terminated" >&2; exit 143' TERM

# alive <pid>: still running (a child that exited and was not reaped yet is not).
alive() {
  local state
  state=$(ps -p "$1" -o stat= 2>/dev/null) || return 1
  [[ $state != Z* ]]
}

# Stop, newest first, every process this script started, and remove its pid file.
stop_started() {
  local i name pid deadline stopped=()
  for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
    name=${STARTED[i]}
    [ -f "$RUN_DIR/$name.pid" ] || continue
    pid=$(cat "$RUN_DIR/$name.pid")
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 20))
    while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 0.2
    done
    if alive "$pid"; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    rm -f -- "$RUN_DIR/$name.pid"
    stopped+=("$name")
  done
  if [ "${#stopped[@]}" -gt 0 ]; then
    echo "up.sh: stopped what it had started (${stopped[*]}); logs kept in $RUN_DIR/logs" >&2
  fi
}
on_exit() {
  local status=$?
  trap - ERR INT TERM
  if [ "$UP" != 1 ]; then
    stop_started
  fi
  exit "$status"
}
trap on_exit EXIT

# Start a command in the background, in its own session (a Ctrl-C in this terminal later
# does not reach it), with its output in a log file and its pid in <name>.pid.
start() {
  local name=$1
  shift
  if command -v setsid >/dev/null 2>&1; then
    nohup setsid "$@" >"$RUN_DIR/logs/$name.log" 2>&1 </dev/null &
  else
    nohup "$@" >"$RUN_DIR/logs/$name.log" 2>&1 </dev/null &
  fi
  echo $! >"$RUN_DIR/$name.pid"
  STARTED+=("$name")
}

# Wait until a command succeeds, or fail after $1 seconds, naming the log to read; at once
# when something this script started exits meanwhile (check_started, below).
wait_for() {
  local seconds=$1 what=$2 log=$3
  shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    check_started
    [ "$SECONDS" -lt "$deadline" ] || fail "$what not ready within ${seconds}s" "$log"
    sleep 0.2
  done
}

# Wait until a process this script started (by its name) is ready, as wait_for does, but
# stop at once when it, or anything else this script started, exits meanwhile: with that
# process's exit status and the last lines of its log.
declare -A WHAT=(  # what each process is, in a message
  [n1]="nats node n1" [n2]="nats node n2" [n3]="nats node n3" [improved-1]="daemon replica 1"
  [improved-2]="daemon replica 2" [ranking]="ranking store")
declare -A READY=()
wait_started() {
  local name=$1 seconds=$2 what=$3
  shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    check_started
    [ "$SECONDS" -lt "$deadline" ] || fail "$what not ready within ${seconds}s" \
      "$RUN_DIR/logs/$name.log"
    sleep 0.2
  done
  READY[$name]=1
}
check_started() {
  local name pid rc
  for name in "${STARTED[@]}"; do
    pid=$(cat "$RUN_DIR/$name.pid")
    alive "$pid" && continue
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    rm -f "$RUN_DIR/$name.pid"
    local when=before
    [ -z "${READY[$name]:-}" ] || when=after
    fail "${WHAT[$name]:-$name} exited (status $rc) $when it was ready" "$RUN_DIR/logs/$name.log"
  done
}

# -- the cluster ------------------------------------------------------------------------------
# Each node's config is deploy/nats-cluster/n<n>.conf with the default ports (4222-4224,
# 6222-6224, 8222-8224) moved to the chosen ones, written to $RUN_DIR/nats-cluster next to a
# copy of accounts.conf (so its `include ../accounts.conf` holds) and checked with -t.
render() {
  local n=$1 i to_mark=() to_port=()
  for i in 1 2 3; do  # through a mark, so a moved port is never moved again
    to_mark+=(-e "s/127\.0\.0\.1:$((4221 + i))\b/127.0.0.1:@client$i@/g"
      -e "s/127\.0\.0\.1:$((6221 + i))\b/127.0.0.1:@route$i@/g"
      -e "s/127\.0\.0\.1:$((8221 + i))\b/127.0.0.1:@monitor$i@/g")
    to_port+=(-e "s/@client$i@/$(client_port "$i")/g" -e "s/@route$i@/$(route_port "$i")/g"
      -e "s/@monitor$i@/$(monitor_port "$i")/g")
  done
  sed "${to_mark[@]}" "$HERE/nats-cluster/n$n.conf" | sed "${to_port[@]}" \
    >"$RUN_DIR/nats-cluster/n$n.conf"
}
cp -- "$HERE/accounts.conf" "$RUN_DIR/accounts.conf"
for n in 1 2 3; do
  for line in "^listen: 127\.0\.0\.1:$((4221 + n))$" "^http: 127\.0\.0\.1:$((8221 + n))$" \
    "^  listen: 127\.0\.0\.1:$((6221 + n))$"; do
    grep -q "$line" "$HERE/nats-cluster/n$n.conf" ||
      fail "$HERE/nats-cluster/n$n.conf has no line ${line//\\/} (the default ports up.sh moves)"
  done
  render "$n"
  "$NATS_SERVER" -c "$RUN_DIR/nats-cluster/n$n.conf" -t >"$RUN_DIR/logs/n$n.log" 2>&1 ||
    fail "the config of node n$n does not pass nats-server -t" "$RUN_DIR/logs/n$n.log"
done
for n in 1 2 3; do
  start "n$n" "$NATS_SERVER" -c "$RUN_DIR/nats-cluster/n$n.conf"
done

# healthz answers 200 once the node is up and its JetStream is current with the meta leader.
healthy() {
  "$PYTHON" - "$1" <<'PY'
import sys
import urllib.request

with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=1) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
}
for n in 1 2 3; do
  wait_started "n$n" 30 "nats node n$n (its /healthz on :$(monitor_port "$n"))" \
    healthy "$(monitor_port "$n")"
done
URL1=nats://127.0.0.1:$(client_port 1)
URL2=nats://127.0.0.1:$(client_port 2)
URL3=nats://127.0.0.1:$(client_port 3)
echo "up.sh: cluster up: $URL1, :$(client_port 2), :$(client_port 3) (routes" \
  ":$(route_port 1)-:$(route_port 3), monitoring :$(monitor_port 1)-:$(monitor_port 3))"

# -- the daemons' configuration ---------------------------------------------------------------
# One config per replica, each seeded on a different node. No embedded server: nats_url is set.
for i in 1 2; do
  cat >"$RUN_DIR/improved-$i.toml" <<EOF
# written by deploy/up.sh: daemon replica $i of the try-it cluster
nats_url = "nats://127.0.0.1:$(client_port "$i")"
data_dir = "$RUN_DIR/daemon-$i"
replicas = 3          # R3: every stream and bucket on all three nodes
checkpoint_key = "$RUN_DIR/checkpoint.pem"   # one key: each replica trusts the other's checkpoints

[nats]                # as user improved, its password read from the file at start
user = "improved"
password_file = "$RUN_DIR/secrets/improved.pw"
EOF
done

# -- provisioning -----------------------------------------------------------------------------
# The streams, buckets and inbound consumer, as the daemons' config asks (R3), made with the
# provisioning credential. Retried: on a fresh cluster a stream whose leader is still being
# elected can time out.
# The daemons' settings, connecting as the provisioning user improved-admin instead.
cat >"$RUN_DIR/provision.toml" <<EOF
# written by deploy/up.sh: what the daemons need, made as the provisioning user
nats_url = "$URL1"
replicas = 3

[nats]
user = "improved-admin"
password_file = "$RUN_DIR/secrets/improved-admin.pw"
EOF
provision() {
  "$IMPROVED" provision --config "$RUN_DIR/provision.toml" >>"$RUN_DIR/logs/provision.log" 2>&1
}
wait_for 60 "provisioning" "$RUN_DIR/logs/provision.log" provision
echo "up.sh: $(tail -n 1 "$RUN_DIR/logs/provision.log") (as improved-admin)"

# -- the daemons ------------------------------------------------------------------------------
# They find everything provisioned and change nothing (as user improved they could not).
for i in 1 2; do
  start "improved-$i" "$IMPROVED" run --config "$RUN_DIR/improved-$i.toml"
done
for i in 1 2; do
  wait_started "improved-$i" 60 "daemon replica $i" \
    grep -q "improved: ready" "$RUN_DIR/logs/improved-$i.log"
done
echo "up.sh: two daemon replicas ready (logs: $RUN_DIR/logs/improved-1.log, improved-2.log)"

# -- the reference ranking service ------------------------------------------------------------
if [ "$WITH_RANKING" = 1 ]; then
  IMPROVED_NATS_USER=svc-ranking IMPROVED_NATS_PASSWORD_FILE="$RUN_DIR/secrets/svc-ranking.pw" \
    start ranking "$PYTHON" -m improved_reference.ranking_store --service ranking \
    --nats "$URL3"
  wait_started ranking 30 "ranking store" grep -q "serving ranking.improve.apply" \
    "$RUN_DIR/logs/ranking.log"
  echo "up.sh: ranking store serving ranking.improve.apply as svc-ranking"
fi
UP=1

# -- what the streams look like ---------------------------------------------------------------
"$PYTHON" - "$URL1" "$RUN_DIR/secrets/operator.pw" <<'PY' || true
import asyncio
import sys
from pathlib import Path

import nats


async def main() -> None:
    # the operator hears its replies on its own inboxes only (deploy/accounts.conf)
    nc = await nats.connect(sys.argv[1], user="operator",
                            password=Path(sys.argv[2]).read_text().strip(), connect_timeout=2,
                            max_reconnect_attempts=1, inbox_prefix="_INBOX_operator")
    js = nc.jetstream()
    for name in ("IMPROVE_IN", "IMPROVE_RECORDS", "IMPROVE_AUDIT"):
        info = await js.stream_info(name)
        cluster = info.cluster
        print(f"up.sh: stream {name}: R{info.config.num_replicas}, leader "
              f"{cluster.leader if cluster else '?'}, followers "
              f"{', '.join(r.name for r in (cluster.replicas or [])) if cluster else '?'}")
    await nc.close()


asyncio.run(main())
PY

# The hints run as printed (paths quoted for the shell). The operator's commands read the
# daemons' config: its checkpoint_key is the daemons' key, which the verifier then trusts, and
# its data_dir holds replica 1's last checkpoint; the operator's credentials in the
# environment win over the config's [nats] (user improved).
q() { printf '%q' "$1"; }
cfg=$(q "$RUN_DIR/improved-1.toml")
imp=$(q "$IMPROVED")
cat <<EOF

Try it as the operator (the proposal targets service ranking):
  export IMPROVED_NATS_USER=operator IMPROVED_NATS_PASSWORD_FILE=$(q "$RUN_DIR/secrets/operator.pw")
  sed 's/"demo"/"ranking"/g' $(q "$ROOT/examples/rank-l0.json") | $imp propose - --nats $URL2
  $imp show <proposal_id> --config $cfg --nats $URL1
  $imp audit verify --config $cfg --data-dir $(q "$RUN_DIR/daemon-1") --nats $URL3

Stop everything:      $(q "$HERE/down.sh")
Stop and wipe state:  $(q "$HERE/down.sh") --purge
EOF
