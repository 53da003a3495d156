#!/usr/bin/env bash
# Bring up, on this machine, for a try:
#   - the 3-node NATS cluster of deploy/nats-cluster (client ports 4222-4224, JetStream,
#     users and permissions from deploy/accounts.conf);
#   - the loop's streams, buckets and inbound consumer (R3), made by `improved provision` as
#     the provisioning user improved-admin: the daemon's user may not create or change them;
#   - two improved daemon replicas sharing the inbound durable consumer, one seeded on n1 and
#     one on n2 (each learns the other nodes from the cluster);
#   - the reference ranking store serving `ranking.improve.apply` as user svc-ranking.
# Everything runs in the background; state and logs go to $IMPROVED_RUN_DIR
# (default: <repo>/.improved/cluster). deploy/down.sh stops it all.
#
# Environment: IMPROVED_VENV (default <repo>/.venv), NATS_SERVER (default the venv's
# nats-server), IMPROVED_RUN_DIR, WITH_RANKING=0 to skip the ranking store.
set -euo pipefail

HERE=$(cd -- "$(dirname -- "$0")" && pwd)
ROOT=$(dirname -- "$HERE")
VENV=${IMPROVED_VENV:-$ROOT/.venv}
NATS_SERVER=${NATS_SERVER:-$VENV/bin/nats-server}
IMPROVED=$VENV/bin/improved
PYTHON=$VENV/bin/python
RUN_DIR=${IMPROVED_RUN_DIR:-$ROOT/.improved/cluster}
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

die() { echo "up.sh: $*" >&2; exit 1; }

for exe in "$NATS_SERVER" "$IMPROVED" "$PYTHON"; do
  [ -x "$exe" ] || die "$exe not found (set IMPROVED_VENV or NATS_SERVER)"
done

mkdir -p "$RUN_DIR/logs" "$RUN_DIR/data"
cd "$RUN_DIR"
(umask 077 && mkdir -p secrets)
for user in "${!PASSWORDS[@]}"; do
  (umask 077 && printf '%s\n' "${PASSWORDS[$user]}" >"secrets/$user.pw")
done

# A pid file whose process is still alive means it is already up.
running() {
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}
for pidfile in "$RUN_DIR"/*.pid; do
  [ -e "$pidfile" ] || continue
  if running "$pidfile"; then
    die "already running ($pidfile); stop it first with $HERE/down.sh"
  fi
  rm -f "$pidfile"
done

on_error() {
  echo "up.sh: failed; logs are in $RUN_DIR/logs; clean up with $HERE/down.sh" >&2
}
trap on_error ERR

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
}

# Wait until a command succeeds, or fail after $1 seconds.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "$what not ready within ${seconds}s"
    sleep 0.2
  done
}

# Wait until a process this script started (by its name) is ready, as wait_for does, but
# stop at once when it exits meanwhile, with its exit status and the last lines of its log.
wait_started() {
  local name=$1 seconds=$2 what=$3
  shift 3
  local pid
  pid=$(cat "$RUN_DIR/$name.pid")
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      local rc=0
      wait "$pid" 2>/dev/null || rc=$?
      rm -f "$RUN_DIR/$name.pid"
      {
        echo "up.sh: $what exited (status $rc) before it was ready; the last lines of" \
          "$RUN_DIR/logs/$name.log:"
        tail -n 20 "$RUN_DIR/logs/$name.log" | sed 's/^/  | /'
      } >&2
      die "$what died; fix the cause, then $HERE/down.sh and up.sh again"
    fi
    [ "$SECONDS" -lt "$deadline" ] || die "$what not ready within ${seconds}s"
    sleep 0.2
  done
}

# -- the cluster ------------------------------------------------------------------------------
for n in 1 2 3; do
  start "n$n" "$NATS_SERVER" -c "$HERE/nats-cluster/n$n.conf"
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
  wait_started "n$n" 30 "nats node n$n (monitor port $((8221 + n)))" healthy "$((8221 + n))"
done
echo "up.sh: cluster up: nats://127.0.0.1:4222, :4223, :4224 (monitoring :8222-:8224)"

# -- the daemons' configuration ---------------------------------------------------------------
# One config per replica, each seeded on a different node. No embedded server: nats_url is set.
for i in 1 2; do
  cat >"$RUN_DIR/improved-$i.toml" <<EOF
# written by deploy/up.sh: daemon replica $i of the try-it cluster
nats_url = "nats://127.0.0.1:$((4221 + i))"
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
nats_url = "nats://127.0.0.1:4222"
replicas = 3

[nats]
user = "improved-admin"
password_file = "$RUN_DIR/secrets/improved-admin.pw"
EOF
provision() {
  "$IMPROVED" provision --config "$RUN_DIR/provision.toml" >>"$RUN_DIR/logs/provision.log" 2>&1
}
wait_for 60 "provisioning (see $RUN_DIR/logs/provision.log)" provision
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
    --nats "nats://127.0.0.1:4224"
  wait_started ranking 30 "ranking store" grep -q "serving ranking.improve.apply" \
    "$RUN_DIR/logs/ranking.log"
  echo "up.sh: ranking store serving ranking.improve.apply as svc-ranking"
fi

# -- what the streams look like ---------------------------------------------------------------
"$PYTHON" - "nats://127.0.0.1:4222" "$RUN_DIR/secrets/operator.pw" <<'PY' || true
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

ex="$ROOT/examples/rank-l0.json"
cat <<EOF

Try it as the operator (the proposal targets service ranking):
  export IMPROVED_NATS_USER=operator IMPROVED_NATS_PASSWORD_FILE=$RUN_DIR/secrets/operator.pw
  sed 's/"demo"/"ranking"/g' $ex | $IMPROVED propose - --nats nats://127.0.0.1:4223
  $IMPROVED show <proposal_id> --nats nats://127.0.0.1:4222
  $IMPROVED audit verify --nats nats://127.0.0.1:4224

Stop everything:      $HERE/down.sh
Stop and wipe state:  $HERE/down.sh --purge
EOF
