#!/usr/bin/env bash
# Build and run choices, measured side by side in one run: the shipped
# build (panic = "abort", glibc's malloc trimmed) against panic = "unwind"
# and the shipped build with the access log on (written to a file). For each: binary size, closed-loop
# req/s and p99 through the proxy (wrk, 64 connections, CPU-pinned as in
# proxy.sh), peak RSS under that load, and RSS after a reload from 10,000
# routes back to 2. Reported as ratios to the shipped build.
#
#   benches/choices.sh                 # 3 rounds of 10 s per build
#   DURATION=20 ROUNDS=5 benches/choices.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
UP_PORT=18281 HG_PORT=18283 HG_ADMIN=18284

. benches/common.sh
install_tools wrk:wrk nginx:nginx-light
ports_free $UP_PORT $HG_PORT $HG_ADMIN

VARIANTS=${VARIANTS:-shipped unwind access-log}
echo "building the variants (release, fat LTO: a few minutes each)..." >&2
[ "${SKIP_BUILD:-}" ] || cargo build --release --quiet
case " $VARIANTS " in *" unwind "*)
  CARGO_PROFILE_RELEASE_PANIC=unwind cargo build --release --quiet --target-dir target/choice-unwind ;; esac
declare -A BIN=(
  [shipped]=target/release/herdguard
  [unwind]=target/choice-unwind/release/herdguard
  [access-log]=target/release/herdguard
)
declare -A ENVS=()
# access-log: the shipped binary with [access_log] on (text), its lines
# written to a file, to measure what the log costs per request.
declare -A EXTRA=([access-log]=$'[access_log]\nenabled = true\n')

scratch_and_pinning

nginx_conf upstream $UP_PORT on "" "$NGINX_UPSTREAM_SERVER"
( pin 0 nginx -c "$WORK/upstream.conf" ) & PIDS+=($!)
wait_port $UP_PORT

routes() { # routes N: a config with N routes to the upstream
  herdguard_conf hg $HG_PORT $HG_ADMIN $UP_PORT 3
  for i in $(seq 2 "$1"); do
    printf '[[routes]]\nname = "r%s"\nupstream = "up"\nmatch = { path_prefix = "/r%s/" }\n' "$i" "$i"
  done >> "$WORK/hg.toml"
}
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
hwm() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }

declare -A RPS P99 PEAK RELOAD
for v in $VARIANTS; do RPS[$v]=""; P99[$v]=""; done
for round in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    routes 1
    printf '%s' "${EXTRA[$v]:-}" >> "$WORK/hg.toml"
    ( pin 1 env ${ENVS[$v]:-} "${BIN[$v]}" --config "$WORK/hg.toml" --threads 1 2>/dev/null >"$WORK/access-$v.log" ) & pid=$!
    wait_port $HG_PORT
    out=$(pin 0 wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "http://127.0.0.1:$HG_PORT/" 2>/dev/null)
    RPS[$v]+="$(echo "$out" | awk '/Requests\/sec/ {print $2}') "
    P99[$v]+="$(echo "$out" | awk '$1=="99%" {print $2}') "
    PEAK[$v]=$(hwm $pid)
    if [ "$round" = 1 ]; then
      routes 10000; printf '%s' "${EXTRA[$v]:-}" >> "$WORK/hg.toml"; kill -HUP $pid; sleep 6
      routes 1; printf '%s' "${EXTRA[$v]:-}" >> "$WORK/hg.toml"; kill -HUP $pid; sleep 6
      curl -s "http://127.0.0.1:$HG_ADMIN/metrics" >/dev/null; sleep 2
      RELOAD[$v]=$(rss $pid)
    fi
    kill $pid; wait $pid 2>/dev/null || true
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ms() { sed 's/ms$//; s/us$/e-3/; s/s$/e3/' | awk '{printf "%g ", $1}'; }
base=$(echo "${RPS[shipped]}" | median)
printf '\n%-13s %10s %10s %8s %9s %9s %13s\n' build "size KiB" "req/s" ratio "p99 ms" "peak KiB" "after reload"
for v in $VARIANTS; do
  r=$(echo "${RPS[$v]}" | median)
  p=$(echo "${P99[$v]}" | ms | median)
  size=$(( $(stat -c %s "${BIN[$v]}") / 1024 ))
  printf '%-13s %10s %10.0f %8.2f %9.2f %9s %10s KiB\n' "$v" "$size" "$r" "$(echo "$r $base" | awk '{print $1/$2}')" "$p" "${PEAK[$v]}" "${RELOAD[$v]}"
done
echo "(req/s and p99: median of $ROUNDS rounds of ${DURATION}s, $CONNECTIONS connections, one proxy thread; after reload: RSS after 1 -> 10,000 -> 1 routes)"
case " $VARIANTS " in *" access-log "*)
  echo "(access-log: $(wc -l < "$WORK/access-access-log.log") lines written in its last round, to a file on $(df --output=fstype "$WORK" | tail -1))" ;; esac
