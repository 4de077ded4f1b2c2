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
#
# Installs valgrind, nginx and HAProxy from Debian, and oha with cargo, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

N1=${N1:-2000}
N2=${N2:-22000}
OUT=${OUT:-bench-results}
UP_PORT=18301 NGINX_PORT=18302 HAPROXY_PORT=18303 HG_PORT=18304 HG_ADMIN=18305

need() { command -v "$1" >/dev/null 2>&1; }
if ! need valgrind || ! need nginx || ! need haproxy; then
  echo "installing valgrind, nginx and haproxy from Debian..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq valgrind nginx-light haproxy >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null && apt-get install -y -qq valgrind nginx-light haproxy >/dev/null; }
fi
TOOLS=$PWD/target/bench-tools
export PATH="$TOOLS/bin:$PATH"
if ! need oha; then
  echo "installing oha with cargo (once, a few minutes)..." >&2
  cargo install oha --version 1.16.0 --locked --quiet --root "$TOOLS"
fi
cargo build --release --quiet

for p in $UP_PORT $NGINX_PORT $HAPROXY_PORT $HG_PORT $HG_ADMIN; do
  if (exec 3<>/dev/tcp/127.0.0.1/"$p") 2>/dev/null; then
    echo "port $p is already in use; stop what listens there first" >&2; exit 1
  fi
done

mkdir -p "$OUT"
WORK=$(mktemp -d)
UP_PID=""
cleanup() {
  [ -n "$UP_PID" ] && kill "$UP_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

nginx_conf() { # name port master(on|off) http-extra server-block
  cat > "$WORK/$1.conf" <<CONF
worker_processes 1;
master_process $3;
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
  $4
  server { listen 127.0.0.1:$2; $5 }
}
CONF
}
nginx_conf upstream $UP_PORT on "" 'location / { return 200 "hello from upstream\n"; }'
nginx -c "$WORK/upstream.conf" & UP_PID=$!

nginx_conf nginx $NGINX_PORT off \
  "upstream backend { server 127.0.0.1:$UP_PORT; keepalive 128; }" \
  'location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }'
cat > "$WORK/haproxy.cfg" <<CONF
global
  nbthread 1
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  http-reuse always
frontend bench
  bind 127.0.0.1:$HAPROXY_PORT
  default_backend upstream
backend upstream
  server up 127.0.0.1:$UP_PORT
CONF
cat > "$WORK/herdguard.toml" <<CONF
[listen]
address = "127.0.0.1:$HG_PORT"
[admin]
address = "127.0.0.1:$HG_ADMIN"
[upstreams.up]
endpoints = ["http://127.0.0.1:$UP_PORT"]
[[routes]]
name = "all"
upstream = "up"
CONF

wait_port() {
  for _ in $(seq 1 300); do
    if (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "nothing listens on port $1" >&2; exit 1
}
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
    echo "nginx $n $(count nginx $NGINX_PORT QUIT "$n" nginx -c "$WORK/nginx.conf")"
    echo "haproxy $n $(count haproxy $HAPROXY_PORT TERM "$n" haproxy -db -f "$WORK/haproxy.cfg")"
    echo "herdguard $n $(count herdguard $HG_PORT INT "$n" ./target/release/herdguard --config "$WORK/herdguard.toml" --threads 1)"
  done
} > "$OUT/instructions.txt"

awk -v n1="$N1" -v n2="$N2" '
  { v[$1, $2] = $3; if (!($1 in seen)) { seen[$1]=1; order[++k]=$1 } }
  END {
    printf "user-space instructions per request (callgrind), (I(%d) - I(%d)) / %d\n", n2, n1, n2 - n1
    printf "%-12s %14s %10s %12s\n", "proxy", "instr/request", "vs nginx", "vs haproxy"
    for (i = 1; i <= k; i++) per[order[i]] = (v[order[i], n2] - v[order[i], n1]) / (n2 - n1)
    for (i = 1; i <= k; i++) { p = order[i]; printf "%-12s %14.0f %10.2f %12.2f\n", p, per[p], per[p]/per["nginx"], per[p]/per["haproxy"] }
  }
' "$OUT/instructions.txt" | tee "$OUT/instructions-table.txt"
