#!/usr/bin/env bash
# Stop what deploy/up.sh started: the ranking store, the daemon replicas (SIGTERM: each drains
# its in-flight work and exits 0), then the three NATS nodes. Only processes named in the pid
# files of the run directory are signalled, and only while they still run the expected program.
# The run directory is up.sh's: $IMPROVED_RUN_DIR, else
# ${XDG_STATE_HOME:-~/.local/state}/improved-cluster.
#   deploy/down.sh           stop, keep the JetStream stores and logs
#   deploy/down.sh --purge   stop and delete the run directory
set -euo pipefail

HERE=$(cd -- "$(dirname -- "$0")" && pwd)
RUN_DIR=${IMPROVED_RUN_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/improved-cluster}
PURGE=0

for arg in "$@"; do
  case $arg in
    --purge) PURGE=1 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "down.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

if [ ! -d "$RUN_DIR" ]; then
  echo "down.sh: nothing to stop ($RUN_DIR does not exist)"
  exit 0
fi

# stop <name> <expected word in its command line> <seconds before SIGKILL>
stop() {
  local name=$1 expect=$2 grace=$3
  local pidfile="$RUN_DIR/$name.pid" pid args
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  args=$(ps -p "$pid" -o args= 2>/dev/null || true)
  case $args in
    *"$expect"*) ;;
    *) rm -f "$pidfile"; return 0 ;;  # gone, or the pid now belongs to something else
  esac
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + grace))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "down.sh: $name (pid $pid) still running after ${grace}s; SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
  echo "down.sh: stopped $name (pid $pid)"
}

stop ranking ranking_store 10
stop improved-2 improved 45   # the daemons drain first, while the bus is still up
stop improved-1 improved 45
for n in 3 2 1; do
  stop "n$n" nats-server 15
done

if [ "$PURGE" = 1 ]; then
  rm -rf -- "$RUN_DIR"
  echo "down.sh: removed $RUN_DIR"
else
  echo "down.sh: stores and logs kept in $RUN_DIR (--purge removes them)"
fi
