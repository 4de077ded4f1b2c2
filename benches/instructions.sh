#!/usr/bin/env bash
# User-space instructions per proxied request, counted by callgrind: the
# same for the same binaries and load whatever else the machine does, so
# small changes to the hot path show where wall-clock runs drown in noise.
#
# Each proxy (nginx with one worker and no master, HAProxy with one thread,
# herdguard --threads 1) runs under valgrind in front of the same nginx
# upstream; oha sends N1 and then, in a second run, N2 GET requests over 16
# connections. (instructions(N2) - instructions(N1)) / (N2 - N1) is the cost
# of one request, start-up and shutdown cancelled out. Kernel time is not
# counted: see benches/proxy.sh for req/s and latency.
#
#   benches/instructions.sh            # N1=2000 N2=22000
#   N2=42000 benches/instructions.sh
#   PROXIES=herdguard benches/instructions.sh   # only herdguard, while iterating
#   PROXIES="herdguard herdguard-access-log" benches/instructions.sh   # the access log's cost
#   PROXIES="herdguard herdguard-hedge" benches/instructions.sh   # hedging on, never triggered
#   PROXIES="herdguard herdguard-no-id herdguard-tracing" benches/instructions.sh
#       # the request id's cost (on by default), and tracing on at 100% sampling
#
# Installs valgrind, nginx and HAProxy from Debian, and oha with cargo, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

N1=${N1:-2000}
N2=${N2:-22000}
PROXIES=${PROXIES:-nginx haproxy herdguard}
OUT=${OUT:-bench-results}
UP_PORT=18301 NGINX_PORT=18302 HAPROXY_PORT=18303 HG_PORT=18304 HG_ADMIN=18305

. benches/common.sh
install_tools valgrind:valgrind nginx:nginx-light haproxy:haproxy
cargo build --release --quiet

ports_free $UP_PORT $NGINX_PORT $HAPROXY_PORT $HG_PORT $HG_ADMIN

mkdir -p "$OUT"
WORK=$(mktemp -d)
UP_PID=""
cleanup() {
  [ -n "$UP_PID" ] && kill "$UP_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

nginx_conf upstream $UP_PORT on "" "$NGINX_UPSTREAM_SERVER"
nginx -c "$WORK/upstream.conf" & UP_PID=$!

nginx_proxy_to $UP_PORT
nginx_conf nginx $NGINX_PORT off "$NGINX_HTTP_EXTRA" "$NGINX_SERVER"
haproxy_conf $HAPROXY_PORT $UP_PORT
herdguard_conf herdguard $HG_PORT $HG_ADMIN $UP_PORT 3
# The same with the access log on (its lines go to the run's log file).
{ cat "$WORK/herdguard.toml"; printf '[access_log]\nenabled = true\n'; } > "$WORK/herdguard-access-log.toml"
# The same with hedging on: the upstream answers in well under hedge_after,
# so no hedge is sent; what is measured is the timer each attempt arms.
sed 's/^retry = { attempts = 3 }$/retry = { attempts = 3, hedge_after = "50ms" }/' "$WORK/herdguard.toml" > "$WORK/herdguard-hedge.toml"
grep -q hedge_after "$WORK/herdguard-hedge.toml"
# Without the request id (on by default).
{ cat "$WORK/herdguard.toml"; printf '[request_id]\nenabled = false\n'; } > "$WORK/herdguard-no-id.toml"
# Tracing on, every request sampled, spans exported to the upstream nginx
# (which answers the export 404 or 405: the export's whole work is done).
{ cat "$WORK/herdguard.toml"; printf '[tracing]\notlp_endpoint = "http://127.0.0.1:%s"\nsample_ratio = 1.0\n' $UP_PORT; } > "$WORK/herdguard-tracing.toml"

wait_port $UP_PORT

# count NAME PORT STOP-SIGNAL N cmd... -> total instructions
count() {
  local name=$1 port=$2 sig=$3 n=$4; shift 4
  local out="$OUT/callgrind.$name.$n"
  valgrind --tool=callgrind --callgrind-out-file="$out" "$@" >"$WORK/$name.log" 2>&1 &
  local pid=$!
  wait_port "$port"
  oha --no-tui --output-format quiet -n "$n" -c 16 "http://127.0.0.1:$port/bench"
  kill -"$sig" "$pid"; wait "$pid" 2>/dev/null || true
  awk '/^(summary|totals):/ {print $2; exit}' "$out"
}

export RUST_LOG=warn
{
  for n in $N1 $N2; do
    for proxy in $PROXIES; do
      case $proxy in
        nginx) echo "nginx $n $(count nginx $NGINX_PORT QUIT "$n" nginx -c "$WORK/nginx.conf")" ;;
        haproxy) echo "haproxy $n $(count haproxy $HAPROXY_PORT TERM "$n" haproxy -db -f "$WORK/haproxy.cfg")" ;;
        herdguard) echo "herdguard $n $(count herdguard $HG_PORT INT "$n" "${HERDGUARD:-./target/release/herdguard}" --config "$WORK/herdguard.toml" --threads 1)" ;;
        herdguard-access-log) echo "herdguard-access-log $n $(count herdguard-access-log $HG_PORT INT "$n" "${HERDGUARD:-./target/release/herdguard}" --config "$WORK/herdguard-access-log.toml" --threads 1)" ;;
        herdguard-hedge|herdguard-no-id|herdguard-tracing) echo "$proxy $n $(count "$proxy" $HG_PORT INT "$n" "${HERDGUARD:-./target/release/herdguard}" --config "$WORK/$proxy.toml" --threads 1)" ;;
        *) echo "unknown proxy $proxy (nginx, haproxy, herdguard, herdguard-access-log, herdguard-hedge, herdguard-no-id, herdguard-tracing)" >&2; exit 2 ;;
      esac
    done
  done
} > "$OUT/instructions.txt"

awk -v n1="$N1" -v n2="$N2" '
  function ratio(a, b) { return b ? sprintf("%.2f", a / b) : "-" }
  { v[$1, $2] = $3; if (!($1 in seen)) { seen[$1]=1; order[++k]=$1 } }
  END {
    printf "user-space instructions per request (callgrind), (I(%d) - I(%d)) / %d\n", n2, n1, n2 - n1
    printf "%-20s %14s %10s %12s %14s\n", "proxy", "instr/request", "vs nginx", "vs haproxy", "vs herdguard"
    for (i = 1; i <= k; i++) per[order[i]] = (v[order[i], n2] - v[order[i], n1]) / (n2 - n1)
    for (i = 1; i <= k; i++) {
      p = order[i]
      printf "%-20s %14.0f %10s %12s %14s\n", p, per[p], ratio(per[p], per["nginx"]), ratio(per[p], per["haproxy"]), ratio(per[p], per["herdguard"])
    }
  }
' "$OUT/instructions.txt" | tee "$OUT/instructions-table.txt"
