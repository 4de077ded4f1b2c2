#!/usr/bin/env bash
# Two or more herdguard builds side by side under callgrind, interleaved,
# per plain GET through the same nginx upstream: for a change to the
# request path, measured against the build before it.
#
#   benches/ab.sh OLD-BINARY NEW-BINARY [...]
#   ROUNDS=3 CLIENT=oha benches/ab.sh ...
#
# Two figures per build and round, each (I(N2) - I(N1)) / (N2 - N1):
# - "whole": the whole program, as benches/instructions.sh and
#   .ci/instructions count it;
# - "connections": the inclusive cost of the caller connections' tasks
#   (`listen::connection_task`, the task spawned for each, found by its
#   closure's name, which stays whatever is inlined into it, or by the
#   clock's wrapper around it, `units::clock::Clocked`), which leaves
#   out the work the runtime's timers do on their own (metrics upkeep,
#   pool sweeps, the timer wheel turning while nothing is ready). Under
#   valgrind that work's share of a request follows the wall time, and
#   moves the whole count by several hundred between runs of one build;
#   this one moves by about 100.
#
# CLIENT=load (default: benches/load.py, `host` only) or oha (oha's GETs,
# with `accept` and `user-agent`, as benches/instructions.sh sends them).
# KEEP=1 keeps the scratch directory: the callgrind files and each run's
# inclusive profile (annotate.BINARY.N), to compare function by function.
# Installs valgrind and nginx from Debian when missing, oha with cargo.
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -ge 2 ] || { echo "usage: $0 BINARY BINARY [...]" >&2; exit 2; }
N1=${N1:-2000}
N2=${N2:-12000}
ROUNDS=${ROUNDS:-2}
CLIENT=${CLIENT:-load}
UP_PORT=18611 HG_PORT=18614 HG_ADMIN=18615

. benches/common.sh
install_tools valgrind:valgrind nginx:nginx-light
need callgrind_annotate || { echo "callgrind_annotate (valgrind) is missing" >&2; exit 1; }
ports_free $UP_PORT $HG_PORT $HG_ADMIN

WORK=$(mktemp -d)
UP_PID=""
cleanup() {
  [ -n "$UP_PID" ] && kill "$UP_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  [ -n "${KEEP:-}" ] && echo "kept $WORK" >&2 || rm -rf "$WORK"
}
trap cleanup EXIT

nginx_conf upstream $UP_PORT off "" "$NGINX_UPSTREAM_SERVER"
nginx -c "$WORK/upstream.conf" & UP_PID=$!
herdguard_conf herdguard $HG_PORT $HG_ADMIN $UP_PORT 3
wait_port $UP_PORT

load() { # N
  case $CLIENT in
    oha) oha --no-tui --output-format quiet -n "$1" -c 16 "http://127.0.0.1:$HG_PORT/bench" ;;
    *) python3 benches/load.py "127.0.0.1:$HG_PORT" "$1" --connections 16 ;;
  esac >/dev/null
}

count() { # BINARY N -> "whole connections"
  local out="$WORK/callgrind.$RANDOM"
  RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$out" \
    "$1" --config "$WORK/herdguard.toml" --threads 1 >"$WORK/herdguard.log" 2>&1 &
  local pid=$!
  wait_port $HG_PORT
  load "$2"
  kill -INT "$pid"
  wait "$pid" 2>/dev/null || true
  local whole tasks
  whole=$(awk '/^(summary|totals):/ {print $2; exit}' "$out")
  # awk reads to the end: one that exits early fails the pipe (SIGPIPE).
  tasks=$(callgrind_annotate --inclusive=yes --auto=no --threshold=100 "$out" |
    tee "$WORK/annotate.$(basename "$1").$2" |
    awk -v f='herdguard::listen::connection_task::{{closure}}' \
      -v g='<herdguard::units::clock::Clocked<F> as core::future::future::Future>::poll' \
      '!done && (index($0, f) || index($0, g)) {gsub(",", "", $1); print $1; done = 1}')
  echo "$whole ${tasks:-0}"
}

for round in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    read -r w1 t1 < <(count "$bin" "$N1")
    read -r w2 t2 < <(count "$bin" "$N2")
    printf '%s round %d: whole %d  connections %d\n' "$bin" "$round" \
      $(((w2 - w1) / (N2 - N1))) $(((t2 - t1) / (N2 - N1)))
  done
done
