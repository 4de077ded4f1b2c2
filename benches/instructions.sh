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
# Three workloads, each proxy configured alike for them (WORKLOADS):
#   get    a plain GET of a small answer
#   post   a POST with a 1 KiB body (not retried: POST is not idempotent)
#   retry  GET /retry to an upstream of two endpoints in turn, one answering
#          503 and one 200: every other request is retried once, on the
#          other endpoint (nginx: proxy_next_upstream http_503; HAProxy:
#          retry-on 503 with redispatch; herdguard: its defaults, with the
#          retry budget and backoff opened up and outlier ejection off, so
#          that the same half is retried all run long). The table's
#          "per retry" line is (retry - get) x 2: what one retry costs.
# The herdguard variants below run the get workload only.
#
#   benches/instructions.sh            # N1=2000 N2=22000, every workload
#   WORKLOADS=get benches/instructions.sh
#   N2=42000 benches/instructions.sh
#   PROXIES=herdguard benches/instructions.sh   # only herdguard, while iterating
#   PROXIES="herdguard herdguard-access-log" benches/instructions.sh   # the access log's cost
#   PROXIES="herdguard herdguard-hedge" benches/instructions.sh   # hedging on, never triggered
#   PROXIES="herdguard herdguard-no-retry" benches/instructions.sh   # retries configured, not triggered
#   PROXIES="herdguard herdguard-no-id herdguard-tracing" benches/instructions.sh
#       # the request id's cost (on by default), and tracing on at 100% sampling
#
# Installs valgrind, nginx and HAProxy from Debian, and oha with cargo, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

N1=${N1:-2000}
N2=${N2:-22000}
PROXIES=${PROXIES:-nginx haproxy herdguard}
WORKLOADS=${WORKLOADS:-get post retry}
OUT=${OUT:-bench-results}
UP_PORT=18301 NGINX_PORT=18302 HAPROXY_PORT=18303 HG_PORT=18304 HG_ADMIN=18305 UP2_PORT=18306

. benches/common.sh
install_tools valgrind:valgrind nginx:nginx-light haproxy:haproxy
# HERDGUARD=path measures that binary (the shipped one: deploy/release-build.sh).
[ -n "${HERDGUARD:-}" ] || cargo build --release --quiet

ports_free $UP_PORT $NGINX_PORT $HAPROXY_PORT $HG_PORT $HG_ADMIN $UP2_PORT

mkdir -p "$OUT"
WORK=$(mktemp -d)
UP_PID=""
cleanup() {
  [ -n "$UP_PID" ] && kill "$UP_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# The upstream: 200 everywhere, but /retry on the first port answers 503.
nginx_conf upstream $UP_PORT on \
  "server { listen 127.0.0.1:$UP2_PORT; $NGINX_UPSTREAM_SERVER }" \
  "location /retry { return 503 \"busy\n\"; } $NGINX_UPSTREAM_SERVER"
nginx -c "$WORK/upstream.conf" & UP_PID=$!

nginx_proxy_to $UP_PORT
# /retry: both upstream ports in turn, a 503 tried once more on the other
# (max_fails=0: a 503 does not take a server out of the rotation).
NGINX_HTTP_EXTRA="$NGINX_HTTP_EXTRA upstream flaky { server 127.0.0.1:$UP_PORT max_fails=0; server 127.0.0.1:$UP2_PORT max_fails=0; keepalive 128; }"
NGINX_SERVER="location /retry { proxy_pass http://flaky; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_next_upstream error timeout http_503; } $NGINX_SERVER"
nginx_conf nginx $NGINX_PORT off "$NGINX_HTTP_EXTRA" "$NGINX_SERVER"
haproxy_conf $HAPROXY_PORT $UP_PORT "  acl flaky path_beg /retry
  use_backend flaky if flaky" "backend flaky
  balance roundrobin
  retry-on 503
  retries 1
  option redispatch 1
  server a 127.0.0.1:$UP_PORT
  server b 127.0.0.1:$UP2_PORT"
# /retry, herdguard: retries as configured by default, with the budget and
# the backoff opened up so that every 503 is retried at once, and the
# failing endpoint never ejected: what is measured is the retry, not its
# limits. Its route comes first: routes are matched in order.
cat > "$WORK/herdguard.toml" <<CONF
[listen]
address = "127.0.0.1:$HG_PORT"
[admin]
address = "127.0.0.1:$HG_ADMIN"
[upstreams.up]
endpoints = ["http://127.0.0.1:$UP_PORT"]
[upstreams.flaky]
endpoints = ["http://127.0.0.1:$UP_PORT", "http://127.0.0.1:$UP2_PORT"]
outlier = { enabled = false }
[[routes]]
name = "retry"
upstream = "flaky"
match = { path_prefix = "/retry" }
retry = { attempts = 3, budget = { ratio = 1.0 }, backoff = { base = "1ms", cap = "1ms" } }
[[routes]]
name = "all"
upstream = "up"
retry = { attempts = 3 }
CONF
# The same with the access log on (its lines go to the run's log file).
{ cat "$WORK/herdguard.toml"; printf '[access_log]\nenabled = true\n'; } > "$WORK/herdguard-access-log.toml"
# The same with hedging on: the upstream answers in well under hedge_after,
# so no hedge is sent; what is measured is the timer each attempt arms.
sed 's/^retry = { attempts = 3 }$/retry = { attempts = 3, hedge_after = "50ms" }/' "$WORK/herdguard.toml" > "$WORK/herdguard-hedge.toml"
grep -q hedge_after "$WORK/herdguard-hedge.toml"
# Retries off (attempts = 1): what retries configured but not triggered cost.
sed 's/^retry = { attempts = 3 }$/retry = { attempts = 1 }/' "$WORK/herdguard.toml" > "$WORK/herdguard-no-retry.toml"
grep -q 'attempts = 1 }' "$WORK/herdguard-no-retry.toml"
# Without the request id (on by default).
{ cat "$WORK/herdguard.toml"; printf '[request_id]\nenabled = false\n'; } > "$WORK/herdguard-no-id.toml"
# Tracing on, every request sampled, spans exported to the upstream nginx
# (which answers the export 404 or 405: the export's whole work is done).
{ cat "$WORK/herdguard.toml"; printf '[tracing]\notlp_endpoint = "http://127.0.0.1:%s"\nsample_ratio = 1.0\n' $UP_PORT; } > "$WORK/herdguard-tracing.toml"

wait_port $UP_PORT

head -c 1024 /dev/zero | tr '\0' 'x' > "$WORK/body"

# load WORKLOAD PORT N: the workload's N requests over 16 connections.
load() {
  local url="http://127.0.0.1:$2"
  case $1 in
    get) oha --no-tui --output-format quiet -n "$3" -c 16 "$url/bench" ;;
    post) oha --no-tui --output-format quiet -n "$3" -c 16 -m POST -D "$WORK/body" "$url/bench" ;;
    retry) oha --no-tui --output-format quiet -n "$3" -c 16 "$url/retry" ;;
  esac
}

# count NAME WORKLOAD PORT STOP-SIGNAL N cmd... -> total instructions
count() {
  local name=$1 workload=$2 port=$3 sig=$4 n=$5; shift 5
  local out="$OUT/callgrind.$name.$workload.$n"
  valgrind --tool=callgrind --callgrind-out-file="$out" "$@" >"$WORK/$name.log" 2>&1 &
  local pid=$!
  wait_port "$port"
  load "$workload" "$port" "$n"
  kill -"$sig" "$pid"; wait "$pid" 2>/dev/null || true
  awk '/^(summary|totals):/ {print $2; exit}' "$out"
}

# Each answer of a workload checked once, outside callgrind: every proxy
# must answer it 200 (the retried half included), or the counts compare
# different work.
check() { # NAME WORKLOAD PORT cmd...
  local name=$1 workload=$2 port=$3; shift 3
  "$@" >"$WORK/$name.check.log" 2>&1 &
  local pid=$!
  wait_port "$port"
  local codes
  codes=$(for _ in 1 2 3 4; do
    case $workload in
      post) curl -s -o /dev/null -w '%{http_code} ' -X POST --data-binary @"$WORK/body" "http://127.0.0.1:$port/bench" ;;
      retry) curl -s -o /dev/null -w '%{http_code} ' "http://127.0.0.1:$port/retry" ;;
      *) curl -s -o /dev/null -w '%{http_code} ' "http://127.0.0.1:$port/bench" ;;
    esac
  done)
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
  if [ "$codes" != "200 200 200 200 " ]; then
    echo "$name answered $workload with $codes (expected 200 each time): see $WORK/$name.check.log" >&2
    exit 1
  fi
}

HG=${HERDGUARD:-./target/release/herdguard}
# run NAME WORKLOAD N: counts one proxy's instructions for N requests.
run() {
  local name=$1 workload=$2 n=$3
  case $name in
    nginx) set -- nginx $NGINX_PORT QUIT nginx -c "$WORK/nginx.conf" ;;
    haproxy) set -- haproxy $HAPROXY_PORT TERM haproxy -db -f "$WORK/haproxy.cfg" ;;
    herdguard) set -- herdguard $HG_PORT INT "$HG" --config "$WORK/herdguard.toml" --threads 1 ;;
    herdguard-*) set -- "$name" $HG_PORT INT "$HG" --config "$WORK/$name.toml" --threads 1 ;;
  esac
  local proxy=$1 port=$2 sig=$3; shift 3
  [ "$n" = "$N1" ] && check "$proxy" "$workload" "$port" "$@"
  echo "$proxy/$workload $n $(count "$proxy" "$workload" "$port" "$sig" "$n" "$@")"
}

for proxy in $PROXIES; do
  case $proxy in
    nginx|haproxy|herdguard|herdguard-access-log|herdguard-hedge|herdguard-no-retry|herdguard-no-id|herdguard-tracing) ;;
    *) echo "unknown proxy $proxy (nginx, haproxy, herdguard, herdguard-access-log, herdguard-hedge, herdguard-no-retry, herdguard-no-id, herdguard-tracing)" >&2; exit 2 ;;
  esac
done
for workload in $WORKLOADS; do
  case $workload in get|post|retry) ;; *) echo "unknown workload $workload (get, post, retry)" >&2; exit 2 ;; esac
done
need curl || install_tools curl:curl

export RUST_LOG=warn
{
  for n in $N1 $N2; do
    for workload in $WORKLOADS; do
      for proxy in $PROXIES; do
        # The herdguard variants differ from herdguard on a plain GET only.
        case $proxy/$workload in herdguard-*/post|herdguard-*/retry) continue ;; esac
        run "$proxy" "$workload" "$n"
      done
    done
  done
} > "$OUT/instructions.txt"

awk -v n1="$N1" -v n2="$N2" '
  function ratio(a, b) { return b ? sprintf("%.2f", a / b) : "-" }
  { v[$1, $2] = $3; if (!($1 in seen)) { seen[$1]=1; order[++k]=$1 } }
  END {
    printf "user-space instructions per request (callgrind), (I(%d) - I(%d)) / %d\n", n2, n1, n2 - n1
    printf "%-28s %14s %10s %12s %14s\n", "proxy/workload", "instr/request", "vs nginx", "vs haproxy", "vs herdguard"
    for (i = 1; i <= k; i++) per[order[i]] = (v[order[i], n2] - v[order[i], n1]) / (n2 - n1)
    for (i = 1; i <= k; i++) {
      p = order[i]; split(p, pw, "/"); w = pw[2]
      printf "%-28s %14.0f %10s %12s %14s\n", p, per[p], ratio(per[p], per["nginx/" w]), ratio(per[p], per["haproxy/" w]), ratio(per[p], per["herdguard/" w])
    }
    # One retry: the retry workload retries every other request.
    split("nginx haproxy herdguard", names, " ")
    for (i = 1; i <= 3; i++) {
      q = names[i]
      if (((q "/retry") in per) && ((q "/get") in per))
        printf "%-28s %14.0f\n", q " per retry", (per[q "/retry"] - per[q "/get"]) * 2
    }
  }
' "$OUT/instructions.txt" | tee "$OUT/instructions-table.txt"
