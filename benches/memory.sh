#!/usr/bin/env bash
# Memory, side by side with nginx in one run (issue 16): each proxy in front
# of the same nginx upstream, on loopback; for each:
#   idle      RSS after one request
#   busy 64   peak RSS (VmHWM) under 64 busy connections (oha, N requests)
#   per idle connection, with 1,000 and with 10,000 keep-alive connections
#             that each made one request and then sat idle for 5 s: (RSS - start) / N,
#             start measured after a warm-up round of 50 such connections, so that
#             the code they run, paged in the first time (0.25 KiB a connection
#             of 1,000), is not counted as what each holds
#   after     RSS 5 s after those connections closed, against the same start
# nginx: one worker, no master; herdguard: --threads 1 (both one thread of work).
#
#   benches/memory.sh
#   COUNTS="1000" PROXIES=herdguard benches/memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."

COUNTS=${COUNTS:-1000 10000}
PROXIES=${PROXIES:-nginx herdguard}
BUSY=${BUSY:-200000}
OUT=${OUT:-bench-results}
UP_PORT=18501 NGINX_PORT=18502 HG_PORT=18503 HG_ADMIN=18504

. benches/common.sh
install_tools nginx:nginx-light python3:python3
cargo build --release --quiet
ports_free $UP_PORT $NGINX_PORT $HG_PORT $HG_ADMIN
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

mkdir -p "$OUT"
scratch_and_pinning
nginx_conf upstream $UP_PORT on "" "$NGINX_UPSTREAM_SERVER"
nginx -c "$WORK/upstream.conf" & PIDS+=($!)
nginx_proxy_to $UP_PORT
nginx_conf nginx $NGINX_PORT off "$NGINX_HTTP_EXTRA" "$NGINX_SERVER"
# Room for 10,000 callers and their upstream connections.
sed -i 's/worker_connections 4096;/worker_connections 30000;/; 1i worker_rlimit_nofile 65536;' "$WORK/nginx.conf"
herdguard_conf herdguard $HG_PORT $HG_ADMIN $UP_PORT 3
sed -i 's/^\[listen\]$/[listen]\nmax_connections = 20000/' "$WORK/herdguard.toml"
wait_port $UP_PORT

rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
hwm() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }
start() { # start NAME -> sets PID, PORT
  case $1 in
    nginx) nginx -c "$WORK/nginx.conf" 2>"$WORK/nginx.log" & PID=$! PORT=$NGINX_PORT ;;
    herdguard) RUST_LOG=warn "${HERDGUARD:-./target/release/herdguard}" --config "$WORK/herdguard.toml" --threads 1 >"$WORK/hg.log" 2>&1 & PID=$! PORT=$HG_PORT ;;
  esac
  wait_port "$PORT"
  curl -s -o /dev/null "http://127.0.0.1:$PORT/warm"
  sleep 1
}
stop() { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }

{
for proxy in $PROXIES; do
  # Peak under load, from a fresh process.
  start "$proxy"
  idle=$(rss "$PID")
  oha --no-tui --output-format quiet -n "$BUSY" -c 64 "http://127.0.0.1:$PORT/busy"
  echo "$proxy idle $idle"
  echo "$proxy busy64 $(hwm "$PID")"
  stop
  for n in $COUNTS; do
    start "$proxy"
    # Warm-up: 50 connections, one request each, idle for 2 s, closed.
    (sleep 2; echo) | timeout 60 python3 benches/idle.py "$PORT" 50 >/dev/null
    sleep 2
    before=$(rss "$PID")
    coproc IDLE { timeout 120 python3 benches/idle.py "$PORT" "$n"; }
    read -r -t 120 line <&"${IDLE[0]}"; [ "$line" = open ] || { echo "idle connections failed" >&2; exit 1; }
    sleep 5
    held=$(rss "$PID")
    echo >&"${IDLE[1]}"
    read -r -t 60 line <&"${IDLE[0]}" || true
    sleep 5
    after=$(rss "$PID")
    echo "$proxy start$n $before"
    echo "$proxy held$n $held"
    echo "$proxy after$n $after"
    stop
  done
done
} > "$OUT/memory.txt"

awk -v counts="$COUNTS" '
  { v[$1, $2] = $3; if (!($1 in seen)) { seen[$1] = 1; order[++k] = $1 } }
  END {
    n = split(counts, c, " ")
    printf "%-10s %9s %11s", "proxy", "idle MiB", "busy64 MiB"
    for (i = 1; i <= n; i++) printf " %14s %16s", "KiB/idle@" c[i], "after@" c[i] " MiB"
    printf "\n"
    for (j = 1; j <= k; j++) {
      p = order[j]
      printf "%-10s %9.1f %11.1f", p, v[p, "idle"] / 1024, v[p, "busy64"] / 1024
      for (i = 1; i <= n; i++) {
        per = (v[p, "held" c[i]] - v[p, "start" c[i]]) / c[i]
        printf " %14.1f %11.1f (%+.0f%%)", per, v[p, "after" c[i]] / 1024, 100 * (v[p, "after" c[i]] - v[p, "start" c[i]]) / v[p, "start" c[i]]
      }
      printf "\n"
    }
  }
' "$OUT/memory.txt" | tee "$OUT/memory-table.txt"
