# Shared by the bench scripts (sourced, not run): tools, configs, ports.
# Expects WORK (a scratch directory) to be set before nginx_conf is called.

need() { command -v "$1" >/dev/null 2>&1; }

# install_tools CMD:PACKAGE...: installs from Debian the packages whose
# command is missing (needs root, as on CI), and oha with cargo, once, into
# target/bench-tools.
install_tools() {
  local missing=() pair
  for pair in "$@"; do need "${pair%%:*}" || missing+=("${pair#*:}"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} from Debian..." >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; }
  fi
  export PATH="$PWD/target/bench-tools/bin:$PATH"
  if ! need oha; then
    echo "installing oha with cargo (once, a few minutes)..." >&2
    cargo install oha --version 1.16.0 --locked --quiet --root "$PWD/target/bench-tools"
  fi
}

# ports_free PORT...: exits when something already listens on one of them.
ports_free() {
  local p
  for p in "$@"; do
    if (exec 3<>/dev/tcp/127.0.0.1/"$p") 2>/dev/null; then
      echo "port $p is already in use (a previous run still going?); stop it first" >&2; exit 1
    fi
  done
}

# wait_port PORT: waits up to 30 s for something to listen on it.
wait_port() {
  for _ in $(seq 1 300); do
    if (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "nothing listens on port $1" >&2; exit 1
}

# nginx_conf NAME PORT MASTER(on|off) HTTP-EXTRA SERVER-BLOCK: writes $WORK/NAME.conf,
# one worker, in the foreground, no access log.
nginx_conf() {
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

# haproxy_conf PORT UPSTREAM-PORT [FRONTEND-LINES [MORE-BACKENDS]]: writes
# $WORK/haproxy.cfg, one thread, connections to the upstream reused; lines
# for the frontend (before its default backend) and further backends, as
# they go in the file.
haproxy_conf() {
  cat > "$WORK/haproxy.cfg" <<CONF
global
  nbthread 1
  maxconn 8192
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  http-reuse always
frontend bench
  bind 127.0.0.1:$1
${3:-}
  default_backend upstream
backend upstream
  server up 127.0.0.1:$2
${4:-}
CONF
}

# The reference proxy's nginx settings: keep-alive to the upstream.
nginx_proxy_to() { # UPSTREAM-PORT -> the http-extra and server-block arguments of nginx_conf
  NGINX_HTTP_EXTRA="upstream backend { server 127.0.0.1:$1; keepalive 128; }"
  NGINX_SERVER='location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }'
}
NGINX_UPSTREAM_SERVER='location / { return 200 "hello from upstream\n"; }'

# herdguard_conf NAME PORT ADMIN UPSTREAM-PORT ATTEMPTS: writes $WORK/NAME.toml.
herdguard_conf() {
  cat > "$WORK/$1.toml" <<CONF
[listen]
address = "127.0.0.1:$2"
[admin]
address = "127.0.0.1:$3"
[upstreams.up]
endpoints = ["http://127.0.0.1:$4"]
[[routes]]
name = "all"
upstream = "up"
retry = { attempts = $5 }
CONF
}

# scratch_and_pinning: a scratch directory ($WORK), the pids to stop on exit
# ($PIDS), and pin/spawn/run_pinned: on two cores or more, commands run
# pinned to the CPU named first (exec: keeps the pid).
scratch_and_pinning() {
  WORK=$(mktemp -d)
  PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
  CPUS=$(nproc)
}
pin() { # pin CPU cmd...
  local cpu=$1; shift
  if [ "$CPUS" -ge 2 ] && need taskset; then exec taskset -c "$cpu" "$@"; else exec "$@"; fi
}
spawn() { # spawn CPU cmd...: start pinned in the background; $! is the command's own pid
  ( pin "$@" ) &
}
run_pinned() { ( pin "$@" ); }
