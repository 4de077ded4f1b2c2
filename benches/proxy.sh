#!/usr/bin/env bash
# Side-by-side proxy benchmark on loopback, one run, one table: the same
# upstream reached directly, through nginx and HAProxy (the references) and
# through herdguard (--threads 1 and its default runtime).
#
#   Closed loop (wrk, 64 connections): maximum req/s, p50, p99.
#   Open loop (oha at a fixed rate, latency corrected for coordinated
#   omission): p50, p99, p99.9 at a load every target can carry.
#   Peak RSS of each proxy, and retries configured vs off (GET and 1 KiB POST).
#   Each proxy's CPU time a request in the closed loop, user and kernel
#   (/proc/PID/stat over the measured run): the proxy's core is saturated
#   there, so this is what its req/s is made of, and it moves less than req/s.
#   Each round's herdguard against the same round's HAProxy (median and range
#   of the ratios): on a machine whose speed drifts, steadier than the medians.
#
#   benches/proxy.sh        # 3 closed-loop rounds of 10 s, 7 open-loop rounds of 6 s
#   DURATION=20 ROUNDS=5 OPEN_ROUNDS=9 RATE=15000 benches/proxy.sh
#
# Open-loop tail latency on a shared 2-core VM moves a lot from one run to
# the next, for every target alike: hence more open-loop rounds, and the
# table gives the spread of p99 over them next to the median.
#
# Installs wrk, nginx and HAProxy from Debian when missing (needs root, as on
# CI) and oha with cargo (into target/bench-tools, once). On a machine with
# two cores or more every proxy is pinned to CPU 1, the upstream and the load
# generators to CPU 0, so each proxy gets the same single core.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
OPEN_DURATION=${OPEN_DURATION:-6}
CONNECTIONS=${CONNECTIONS:-64}
RATE=${RATE:-20000}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
OPEN_ROUNDS=${OPEN_ROUNDS:-7}
OUT=${OUT:-bench-results}
UP_PORT=18181 NGINX_PORT=18182 HAPROXY_PORT=18187
HG_PORT=18183 HG_ADMIN=18184 HG_PORT_NORETRY=18185 HG_ADMIN_NORETRY=18186 HG_PORT_MT=18188 HG_ADMIN_MT=18189
PORTS="$UP_PORT $NGINX_PORT $HAPROXY_PORT $HG_PORT $HG_ADMIN $HG_PORT_NORETRY $HG_ADMIN_NORETRY $HG_PORT_MT $HG_ADMIN_MT"

. benches/common.sh
install_tools wrk:wrk nginx:nginx-light haproxy:haproxy
need python3 || { echo "python3 is needed to read oha's JSON" >&2; exit 1; }
# HERDGUARD=path measures that binary (the shipped one: deploy/release-build.sh).
HG=${HERDGUARD:-./target/release/herdguard}
[ -n "${HERDGUARD:-}" ] || cargo build --release --quiet

ports_free $PORTS

mkdir -p "$OUT"
scratch_and_pinning

# The upstream: nginx answering 200 with a small body, one worker, CPU 0.
nginx_conf upstream $UP_PORT on "" "$NGINX_UPSTREAM_SERVER"
spawn 0 nginx -c "$WORK/upstream.conf"; PIDS+=($!)

# Reference 1: nginx, one worker, keep-alive to the upstream, CPU 1.
nginx_proxy_to $UP_PORT
nginx_conf reference $NGINX_PORT on "$NGINX_HTTP_EXTRA" "$NGINX_SERVER"
spawn 1 nginx -c "$WORK/reference.conf"; NGINX_PID=$!; PIDS+=($NGINX_PID)

# Reference 2: HAProxy, one thread, connection reuse to the upstream, CPU 1.
haproxy_conf $HAPROXY_PORT $UP_PORT
spawn 1 haproxy -db -f "$WORK/haproxy.cfg"; HAPROXY_PID=$!; PIDS+=($HAPROXY_PID)

# herdguard with its default policies (retries configured, none triggered), CPU 1.
herdguard_conf herdguard $HG_PORT $HG_ADMIN $UP_PORT 3
herdguard_conf herdguard-noretry $HG_PORT_NORETRY $HG_ADMIN_NORETRY $UP_PORT 1
herdguard_conf herdguard-default $HG_PORT_MT $HG_ADMIN_MT $UP_PORT 3
export RUST_LOG=warn
spawn 1 "$HG" --config "$WORK/herdguard.toml" --threads 1; HG_PID=$!; PIDS+=($HG_PID)
spawn 1 "$HG" --config "$WORK/herdguard-noretry.toml" --threads 1; HG2_PID=$!; PIDS+=($HG2_PID)
# The default runtime: a thread per core it may use; pinned to one core, that is
# the single-threaded scheduler, as with --threads 1 (two rows of one setup:
# their difference is the run-to-run noise).
spawn 1 "$HG" --config "$WORK/herdguard-default.toml"; HG3_PID=$!; PIDS+=($HG3_PID)

for p in $UP_PORT $NGINX_PORT $HAPROXY_PORT $HG_PORT $HG_PORT_NORETRY $HG_PORT_MT; do wait_port "$p"; done

pid_on_port() { # the process serving a port (nginx: its worker)
  case $1 in
    $NGINX_PORT) pgrep -P "$NGINX_PID" | head -1 ;;
    $HAPROXY_PORT) echo "$HAPROXY_PID" ;;
    $HG_PORT) echo "$HG_PID" ;;
    $HG_PORT_NORETRY) echo "$HG2_PID" ;;
    $HG_PORT_MT) echo "$HG3_PID" ;;
    *) echo "" ;;
  esac
}
port_of() {
  case $1 in
    direct) echo $UP_PORT ;; nginx*) echo $NGINX_PORT ;; haproxy*) echo $HAPROXY_PORT ;;
    herdguard-noretry*) echo $HG_PORT_NORETRY ;; herdguard-default*) echo $HG_PORT_MT ;; herdguard*) echo $HG_PORT ;;
  esac
}

# cpu_ticks PID -> "user system" clock ticks of the whole process, all its threads
cpu_ticks() { if [ -n "$1" ]; then awk '{ print $14, $15 }' "/proc/$1/stat"; else echo "- -"; fi; }

# closed NAME [wrk args...] -> "NAME rps p50_ms p99_ms non2xx user_us sys_us"
# (the proxy's CPU time a request, user and kernel, over the measured run;
# "-" for the upstream reached directly)
closed() {
  local name=$1; shift
  local url="http://127.0.0.1:$(port_of "$name")/bench" pid before after
  pid=$(pid_on_port "$(port_of "$name")")
  run_pinned 0 wrk -t1 -c"$CONNECTIONS" -d"${WARMUP}s" "$@" "$url" >/dev/null
  before=$(cpu_ticks "$pid")
  run_pinned 0 wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$@" "$url" > "$OUT/$name.wrk"
  after=$(cpu_ticks "$pid")
  awk -v name="$name" -v before="$before" -v after="$after" -v hz="$(getconf CLK_TCK)" '
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    /Requests\/sec/ { rps=$2 }
    /requests in/ { n=$1 }
    /^ +50%/ { p50=ms($2) }
    /^ +99%/ { p99=ms($2) }
    /Non-2xx/ { bad=$NF }
    END {
      split(before, b, " "); split(after, a, " ")
      if (b[1] == "-" || n == 0) { u = "-"; s = "-" }
      else { u = sprintf("%.2f", (a[1] - b[1]) * 1e6 / hz / n); s = sprintf("%.2f", (a[2] - b[2]) * 1e6 / hz / n) }
      printf "%s %s %s %s %s %s %s\n", name, rps, p50, p99, (bad==""?0:bad), u, s
    }
  ' "$OUT/$name.wrk"
}

# open NAME -> "NAME@open rps p50_ms p99_ms p999_ms failed"
open_loop() {
  local name=$1
  local url="http://127.0.0.1:$(port_of "$name")/bench"
  run_pinned 0 oha --no-tui --output-format json -c "$CONNECTIONS" -q "$RATE" --latency-correction \
    -z "${OPEN_DURATION}s" "$url" > "$OUT/$name.oha.json"
  python3 - "$name" "$OUT/$name.oha.json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
p = r["latencyPercentiles"]
ok = sum(v for k, v in r["statusCodeDistribution"].items() if k.startswith("2"))
# Requests still in flight when the run's time is up are not failures.
errors = {k: v for k, v in r.get("errorDistribution", {}).items() if "deadline" not in k}
total = sum(r["statusCodeDistribution"].values()) + sum(errors.values())
print(f'{name}@open {r["summary"]["requestsPerSec"]:.0f} {p["p50"]*1e3:.3f} {p["p99"]*1e3:.3f} {p["p99.9"]*1e3:.3f} {total - ok}')
PY
}

# A 1 KiB POST body, for the retry-configured-but-not-triggered comparison.
head -c 1024 /dev/zero | tr '\0' 'x' > "$WORK/body"
cat > "$WORK/post.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "application/octet-stream"
LUA

GET_TARGETS="direct nginx haproxy herdguard herdguard-default herdguard-noretry"
POST_TARGETS="nginx-post haproxy-post herdguard-post herdguard-noretry-post"
OPEN_TARGETS="direct nginx haproxy herdguard herdguard-default"

# Rounds interleave the targets so that drift in the machine hits them alike;
# each figure below is the median over rounds.
ALL_ROUNDS=$(( ROUNDS > OPEN_ROUNDS ? ROUNDS : OPEN_ROUNDS ))
for round in $(seq 1 "$ALL_ROUNDS"); do
  echo "round $round/$ALL_ROUNDS..." >&2
  if [ "$round" -le "$ROUNDS" ]; then
    for t in $GET_TARGETS; do closed "$t"; done
    for t in $POST_TARGETS; do closed "$t" -s "$WORK/post.lua"; done
  fi
  if [ "$round" -le "$OPEN_ROUNDS" ]; then
    for t in $OPEN_TARGETS; do open_loop "$t"; done
  fi
done > "$OUT/rounds.txt"

# Peak RSS over the whole run.
for t in nginx haproxy herdguard herdguard-default herdguard-noretry; do
  pid=$(pid_on_port "$(port_of "$t")")
  echo "$t $(awk '/VmHWM/ {print $2}' "/proc/$pid/status")"
done > "$OUT/rss.txt"

# Median of each column per target, in first-seen order.
awk '
  !($1 in seen) { seen[$1]=1; order[++n]=$1 }
  { k[$1]++; cols[$1]=NF; for (c=2; c<=NF; c++) v[$1, c, k[$1]] = $c }
  function median(name, c,   m, i, j, t, a) {
    m = k[name]; for (i=1; i<=m; i++) a[i] = v[name, c, i]
    for (i=1; i<=m; i++) for (j=i+1; j<=m; j++) if (a[j]+0 < a[i]+0) { t=a[i]; a[i]=a[j]; a[j]=t }
    return a[int((m+1)/2)]
  }
  END { for (i=1; i<=n; i++) { x=order[i]; line=x; for (c=2; c<=cols[x]; c++) line=line " " median(x,c); print line } }
' "$OUT/rounds.txt" > "$OUT/summary.txt"

{
echo "$(nproc) cores; proxies pinned to one core (nginx: 1 worker; HAProxy: nbthread 1; herdguard: --threads 1,"
echo "and its default runtime, which on one core picks the same single-threaded scheduler);"
echo "medians of $ROUNDS closed-loop and $OPEN_ROUNDS open-loop rounds."
echo
echo "Closed loop: wrk -t1 -c$CONNECTIONS -d${DURATION}s"
awk -v rssfile="$OUT/rss.txt" '
  BEGIN { while ((getline l < rssfile) > 0) { split(l, f, " "); rss[f[1]] = f[2] } }
  $1 !~ /@open$/ { n++; name[n]=$1; rps[n]=$2; p50[n]=$3; p99[n]=$4; bad[n]=$5; usr[n]=$6; sys[n]=$7; idx[$1]=n }
  END {
    printf "%-24s %10s %8s %8s %8s %9s %9s %10s %9s %8s %8s %9s\n", "target", "req/s", "p50 ms", "p99 ms", "non-2xx", "RSS MiB", "rps/nginx", "rps/haproxy", "p99/haproxy", "user us", "sys us", "cpu/haproxy"
    for (i = 1; i <= n; i++) {
      post = (name[i] ~ /post$/)
      ng = post ? idx["nginx-post"] : idx["nginx"]; hp = post ? idx["haproxy-post"] : idx["haproxy"]
      base = name[i]; sub(/-post$/, "", base)
      r = (base in rss) ? sprintf("%.1f", rss[base]/1024) : "-"
      c = (usr[i] == "-" || usr[hp] + sys[hp] == 0) ? "-" : sprintf("%.2f", (usr[i] + sys[i]) / (usr[hp] + sys[hp]))
      printf "%-24s %10.0f %8.2f %8.2f %8s %9s %9.2f %10.2f %9.2f %8s %8s %9s\n", name[i], rps[i], p50[i], p99[i], bad[i], r, rps[i]/rps[ng], rps[i]/rps[hp], p99[i]/p99[hp], usr[i], sys[i], c
    }
    printf "\nretries configured vs off, req/s: GET %.3f x, POST %.3f x\n", rps[idx["herdguard"]]/rps[idx["herdguard-noretry"]], rps[idx["herdguard-post"]]/rps[idx["herdguard-noretry-post"]]
  }
' "$OUT/summary.txt"
echo
echo "Open loop: oha -c$CONNECTIONS -q $RATE --latency-correction -z ${OPEN_DURATION}s"
awk '
  # First file: every round, for the spread of p99; second: the medians.
  FNR == NR {
    if ($1 ~ /@open$/) {
      if (!($1 in lo) || $4 + 0 < lo[$1]) lo[$1] = $4 + 0
      if (!($1 in hi) || $4 + 0 > hi[$1]) hi[$1] = $4 + 0
    }
    next
  }
  $1 ~ /@open$/ { n++; key[n]=$1; name[n]=$1; sub(/@open$/, "", name[n]); rps[n]=$2; p50[n]=$3; p99[n]=$4; p999[n]=$5; bad[n]=$6; idx[name[n]]=n }
  END {
    printf "%-24s %10s %8s %8s %15s %9s %8s %9s %9s %11s\n", "target", "req/s", "p50 ms", "p99 ms", "p99 range", "p99.9 ms", "failed", "p99/nginx", "p99/haproxy", "p99.9/haproxy"
    ng = idx["nginx"]; hp = idx["haproxy"]
    for (i = 1; i <= n; i++)
      printf "%-24s %10.0f %8.3f %8.3f %15s %9.3f %8s %9.2f %9.2f %11.2f\n", name[i], rps[i], p50[i], p99[i], sprintf("%.2f-%.2f", lo[key[i]], hi[key[i]]), p999[i], bad[i], p99[i]/p99[ng], p99[i]/p99[hp], p999[i]/p999[hp]
  }
' "$OUT/rounds.txt" "$OUT/summary.txt"
echo
# Each round's herdguard beside the HAProxy run of the same round, seconds
# before it: on a machine whose speed drifts (a shared VM), the medians
# above move with the drift, these ratios much less.
echo "Paired by round (herdguard / HAProxy in the same round), median and range over rounds"
awk '
  { split($1, t, "@"); kind = ($1 ~ /@open$/) ? "open" : "closed"; base = t[1]
    post = (base ~ /-post$/); ref = post ? "haproxy-post" : "haproxy"
    k = kind SUBSEP base
    if (base == ref) { ref_rps[kind, post] = $2; ref_p99[kind, post] = $4; ref_cpu[kind, post] = $6 + $7; next }
    if (base !~ /^herdguard/ || !((kind, post) in ref_rps)) next
    if (!(k in order)) { order[k] = ++n; keys[n] = k }
    m = ++cnt[k]; rr[k, m] = $2 / ref_rps[kind, post]; pr[k, m] = $4 / ref_p99[kind, post]
    cr[k, m] = (kind == "closed" && ref_cpu[kind, post] > 0) ? ($6 + $7) / ref_cpu[kind, post] : 0
  }
  function stat(arr, k, m,   i, j, t, a) {
    for (i = 1; i <= m; i++) a[i] = arr[k, i]
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return sprintf("%.2f (%.2f-%.2f)", a[int((m + 1) / 2)], a[1], a[m])
  }
  END {
    printf "%-24s %-8s %7s %20s %20s %20s\n", "target", "loop", "rounds", "req/s ratio", "p99 ratio", "CPU a request ratio"
    for (i = 1; i <= n; i++) {
      split(keys[i], p, SUBSEP); m = cnt[keys[i]]
      printf "%-24s %-8s %7d %20s %20s %20s\n", p[2], p[1], m, (p[1] == "open") ? "-" : stat(rr, keys[i], m), stat(pr, keys[i], m), (p[1] == "open") ? "-" : stat(cr, keys[i], m)
    }
  }
' "$OUT/rounds.txt"
echo
# Healthy traffic is never shed: what each herdguard's adaptive limit turned
# away over every round, 64 busy connections from a cold start included.
printf "shed by the adaptive limit over the run (herdguard_shed_total):"
for admin in herdguard:$HG_ADMIN herdguard-default:$HG_ADMIN_MT herdguard-noretry:$HG_ADMIN_NORETRY; do
  shed=$(curl -s "http://127.0.0.1:${admin#*:}/metrics" | awk '/^herdguard_shed_total/ { s += $NF } END { print s + 0 }')
  printf " %s %s" "${admin%%:*}" "$shed"
done
echo
} | tee "$OUT/table.txt"
