#!/usr/bin/env bash
# Side-by-side proxy benchmark on loopback: the same upstream, reached
# directly, through nginx (one worker, the reference) and through herdguard.
# Each target gets the same wrk load; the table reports req/s, p50, p99 and
# peak RSS, with ratios against nginx from this same run.
#
#   benches/proxy.sh                 # default: 3 rounds of 10 s per target, 64 connections
#   DURATION=20 ROUNDS=5 CONNECTIONS=128 benches/proxy.sh
#
# Installs wrk and nginx from Debian when missing (needs root, as on CI).
# On a 2-core machine the proxy under test is pinned to CPU 1 and the
# upstream and wrk to CPU 0, so every proxy gets the same single core.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-64}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-bench-results}
UP_PORT=18181 NGINX_PORT=18182 HG_PORT=18183 HG_ADMIN=18184 HG_PORT_NORETRY=18185 HG_ADMIN_NORETRY=18186

need() { command -v "$1" >/dev/null 2>&1; }
if ! need wrk || ! need nginx; then
  echo "installing wrk and nginx from Debian..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq wrk nginx-light >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq wrk nginx-light >/dev/null; }
fi
cargo build --release --quiet

for p in $UP_PORT $NGINX_PORT $HG_PORT $HG_ADMIN $HG_PORT_NORETRY $HG_ADMIN_NORETRY; do
  if (exec 3<>/dev/tcp/127.0.0.1/"$p") 2>/dev/null; then
    echo "port $p is already in use (a previous run still going?); stop it first" >&2; exit 1
  fi
done

mkdir -p "$OUT"
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

CPUS=$(nproc)
pin() { # pin CPU cmd...: run pinned when there are two cores or more (exec: keeps the pid)
  local cpu=$1; shift
  if [ "$CPUS" -ge 2 ] && need taskset; then exec taskset -c "$cpu" "$@"; else exec "$@"; fi
}
spawn() { # spawn CPU cmd...: start pinned in the background; $! is the command's own pid
  ( pin "$@" ) &
}
run_pinned() { ( pin "$@" ); }

nginx_conf() { # name port body
  cat > "$WORK/$1.conf" <<CONF
worker_processes 1;
daemon off;
pid $WORK/$1.pid;
error_log $WORK/$1.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/$1-body;
  proxy_temp_path $WORK/$1-proxy;
  fastcgi_temp_path $WORK/$1-fcgi;
  uwsgi_temp_path $WORK/$1-uwsgi;
  scgi_temp_path $WORK/$1-scgi;
  keepalive_requests 1000000;
  $3
  server { listen 127.0.0.1:$2; $4 }
}
CONF
}

# The upstream: nginx answering 200 with a small body, one worker, CPU 0.
nginx_conf upstream $UP_PORT "" 'location / { return 200 "hello from upstream\n"; }'
spawn 0 nginx -c "$WORK/upstream.conf"; PIDS+=($!)

# The reference proxy: nginx, one worker, keep-alive to the upstream, CPU 1.
nginx_conf reference $NGINX_PORT \
  "upstream backend { server 127.0.0.1:$UP_PORT; keepalive 128; }" \
  'location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }'
spawn 1 nginx -c "$WORK/reference.conf"; NGINX_PID=$!; PIDS+=($NGINX_PID)

# herdguard with its default policies (retries configured, none triggered), CPU 1.
hg_conf() { # name port admin attempts
  cat > "$WORK/$1.toml" <<CONF
[listen]
address = "127.0.0.1:$2"
[admin]
address = "127.0.0.1:$3"
[upstreams.up]
endpoints = ["http://127.0.0.1:$UP_PORT"]
[[routes]]
name = "all"
upstream = "up"
retry = { attempts = $4 }
CONF
}
hg_conf herdguard $HG_PORT $HG_ADMIN 3
hg_conf herdguard-noretry $HG_PORT_NORETRY $HG_ADMIN_NORETRY 1
export RUST_LOG=warn
spawn 1 ./target/release/herdguard --config "$WORK/herdguard.toml" --threads 1; HG_PID=$!; PIDS+=($HG_PID)
spawn 1 ./target/release/herdguard --config "$WORK/herdguard-noretry.toml" --threads 1; HG2_PID=$!; PIDS+=($HG2_PID)

wait_port() {
  for _ in $(seq 1 100); do
    if (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "nothing listens on port $1" >&2; exit 1
}
for p in $UP_PORT $NGINX_PORT $HG_PORT $HG_PORT_NORETRY; do wait_port "$p"; done

pid_on_port() { # the nginx worker (child) or herdguard process serving a port
  case $1 in
    $NGINX_PORT) pgrep -P "$NGINX_PID" | head -1 ;;
    $HG_PORT) echo "$HG_PID" ;;
    $HG_PORT_NORETRY) echo "$HG2_PID" ;;
    *) echo "" ;;
  esac
}

# run NAME PORT [wrk args...] -> "name rps p50_ms p99_ms rss_kib"
run() {
  local name=$1 port=$2; shift 2
  local url="http://127.0.0.1:$port/bench"
  run_pinned 0 wrk -t1 -c"$CONNECTIONS" -d"${WARMUP}s" "$@" "$url" >/dev/null
  run_pinned 0 wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$@" "$url" > "$OUT/$name.wrk"
  local pid rss="-"
  pid=$(pid_on_port "$port")
  if [ -n "$pid" ] && [ -r "/proc/$pid/status" ]; then
    rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
  fi
  awk -v name="$name" -v rss="$rss" '
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    /Requests\/sec/ { rps=$2 }
    /^ +50%/ { p50=ms($2) }
    /^ +99%/ { p99=ms($2) }
    /Non-2xx/ { bad=$NF }
    END { printf "%s %s %s %s %s %s\n", name, rps, p50, p99, rss, (bad==""?0:bad) }
  ' "$OUT/$name.wrk"
}

# A 1 KiB POST body, for the retry-configured-but-not-triggered comparison.
head -c 1024 /dev/zero | tr '\0' 'x' > "$WORK/body"
cat > "$WORK/post.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "application/octet-stream"
LUA

# Rounds interleave the targets so that drift in the machine hits them alike;
# each figure below is the median over rounds.
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round/$ROUNDS..." >&2
  run direct $UP_PORT
  run nginx $NGINX_PORT
  run herdguard $HG_PORT
  run herdguard-noretry $HG_PORT_NORETRY
  run nginx-post $NGINX_PORT -s "$WORK/post.lua"
  run herdguard-post $HG_PORT -s "$WORK/post.lua"
  run herdguard-noretry-post $HG_PORT_NORETRY -s "$WORK/post.lua"
done > "$OUT/rounds.txt"
# Median of each column per target, in first-seen order.
awk '
  !($1 in seen) { seen[$1]=1; order[++n]=$1 }
  { k[$1]++; for (c=2; c<=6; c++) v[$1, c, k[$1]] = $c }
  function median(name, c,   m, i, j, t, a) {
    m = k[name]; for (i=1; i<=m; i++) a[i] = v[name, c, i]
    for (i=1; i<=m; i++) for (j=i+1; j<=m; j++) if (a[j]+0 < a[i]+0) { t=a[i]; a[i]=a[j]; a[j]=t }
    return a[int((m+1)/2)]
  }
  END { for (i=1; i<=n; i++) { x=order[i]; printf "%s %s %s %s %s %s\n", x, median(x,2), median(x,3), median(x,4), median(x,5), median(x,6) } }
' "$OUT/rounds.txt" > "$OUT/summary.txt"

echo
echo "wrk -t1 -c$CONNECTIONS -d${DURATION}s, median of $ROUNDS rounds, on $(nproc) cores; proxies pinned to one core (nginx: 1 worker; herdguard: --threads 1)"
awk '
  { name[NR]=$1; rps[NR]=$2; p50[NR]=$3; p99[NR]=$4; rss[NR]=$5; bad[NR]=$6; idx[$1]=NR }
  END {
    printf "%-24s %12s %9s %9s %10s %8s %10s %10s\n", "target", "req/s", "p50 ms", "p99 ms", "RSS MiB", "non-2xx", "rps/nginx", "p99/nginx"
    for (i = 1; i <= NR; i++) {
      ref = (name[i] ~ /post$/) ? idx["nginx-post"] : idx["nginx"]
      r = (rss[i] == "-") ? "-" : sprintf("%.1f", rss[i]/1024)
      printf "%-24s %12.0f %9.2f %9.2f %10s %8s %10.2f %10.2f\n", name[i], rps[i], p50[i], p99[i], r, bad[i], rps[i]/rps[ref], p99[i]/p99[ref]
    }
    printf "\nretries configured vs off (GET):  %.3f x req/s\n", rps[idx["herdguard"]]/rps[idx["herdguard-noretry"]]
    printf "retries configured vs off (POST): %.3f x req/s\n", rps[idx["herdguard-post"]]/rps[idx["herdguard-noretry-post"]]
  }
' "$OUT/summary.txt" | tee "$OUT/table.txt"
