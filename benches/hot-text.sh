#!/usr/bin/env bash
# Writes deploy/hot-text.ld, the linker script that puts the functions a
# running proxy executes next to each other at the start of the code
# (docs/memory.md: the code's pages are most of the resident set, and
# spread over the whole binary they were all paged in).
#
# Runs the release binary under callgrind, with one thread and with two,
# through what a sidecar does: start from a config, proxy GETs and POSTs
# over 64 keep-alive connections, h2c under load, a route whose upstream
# fails (retries, backoff, breaker) and one where nothing listens, 4 MB
# bodies both ways (chunked too), malformed and hostile requests, a thousand
# idle connections, the admin endpoints, a reload (SIGHUP), and a graceful
# stop; then lists every function of the binary that ran.
#
# Each function is written twice: by its exact symbol, so that with this
# toolchain and Cargo.lock what ran lies packed together; and by its name
# without the hash at the end of a Rust symbol (and with the crate hash of a
# v0 symbol wildcarded), so that after a dependency or toolchain update,
# when the exact symbols no longer match, every instance of a function that
# ran still lands in the hot part, with its siblings after what ran.
#
#   benches/hot-text.sh            # rewrites deploy/hot-text.ld; deploy/release-build.sh uses it
#   HERDGUARD="PLAIN SHIPPED" benches/hot-text.sh  # from both builds (what the committed
#                                  # script is made from: a copy of a plain `cargo build
#                                  # --release`, and of deploy/release-build.sh's binary)
#
# Installs valgrind and nginx from Debian, and oha with cargo, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-deploy/hot-text.ld}
UP_PORT=18701 HG_PORT=18702 HG_ADMIN=18703 DEAD_PORT=18704

. benches/common.sh
install_tools valgrind:valgrind nginx:nginx-light curl:curl python3:python3
# HERDGUARD="path ..." lists what ran in those binaries instead, all of
# them in one script: the plain build and the profile-guided one that
# deploy/release-build.sh makes (which inlines, and so names, differently),
# so that the script packs either.
read -r -a BINS <<<"${HERDGUARD:-./target/release/herdguard}"
[ -n "${HERDGUARD:-}" ] || cargo build --release --quiet
ports_free $UP_PORT $HG_PORT $HG_ADMIN $DEAD_PORT
scratch_and_pinning

head -c 4000000 /dev/urandom > "$WORK/big.bin"
nginx_conf upstream $UP_PORT on "" \
  "location / { return 200 \"hello from upstream\n\"; } location /flaky { return 503 \"down\n\"; }
   location /file { alias $WORK/big.bin; } location /upload { return 200 \"taken\n\"; }"
nginx -c "$WORK/upstream.conf" & PIDS+=($!)
# Two routes: /dead to a port where nothing listens (connections refused,
# retried), the rest to nginx.
cat > "$WORK/herdguard.toml" <<CONF
[listen]
address = "127.0.0.1:$HG_PORT"
[admin]
address = "127.0.0.1:$HG_ADMIN"
[upstreams.up]
endpoints = ["http://127.0.0.1:$UP_PORT"]
[upstreams.dead]
endpoints = ["http://127.0.0.1:$DEAD_PORT"]
[[routes]]
name = "dead"
upstream = "dead"
match = { path_prefix = "/dead" }
[[routes]]
name = "all"
upstream = "up"
retry = { attempts = 3 }
CONF
wait_port $UP_PORT

# odd PORT: requests a careless or hostile caller sends, one connection each.
odd() {
  python3 - "$1" <<'PY'
import socket, sys
port = int(sys.argv[1])
for raw in [
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 200000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(500)) + b"Host: x\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"A" * 100,
    b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
]:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(raw)
        s.recv(4096)
    except OSError:
        pass
    s.close()
PY
}

# profile THREADS N: the run of $BIN (the Nth binary), with the runtime of
# one thread (current-thread scheduler, as in the benches) or of more (the
# multi-thread one, as in the manifests); its profile in
# $WORK/callgrind.N.THREADS.
profile() {
  : > "$WORK/hg.log"
  RUST_LOG=info valgrind --tool=callgrind --demangle=no --dump-instr=no \
    --callgrind-out-file="$WORK/callgrind.$2.$1" \
    "$BIN" --config "$WORK/herdguard.toml" --threads "$1" >"$WORK/hg.log" 2>&1 &
  local hg=$! url="http://127.0.0.1:$HG_PORT"
  wait_port $HG_PORT
  oha --no-tui --output-format quiet -n 20000 -c 64 "$url/busy"
  oha --no-tui --output-format quiet -n 2000 -c 16 -m POST -d "$(head -c 2000 /dev/zero | tr '\0' x)" "$url/post"
  for _ in $(seq 1 20); do curl -s -o /dev/null --max-time 10 --http2-prior-knowledge "$url/h2c"; done
  oha --no-tui --output-format quiet --http2 -n 5000 -c 16 -p 1 "$url/h2"
  for _ in $(seq 1 20); do curl -s -o /dev/null --max-time 10 "$url/flaky"; done
  for _ in 1 2 3; do curl -s -o /dev/null --max-time 10 "$url/dead"; done
  curl -s -o /dev/null --max-time 30 --data-binary @"$WORK/big.bin" "$url/upload"
  curl -s -o /dev/null --max-time 30 -T "$WORK/big.bin" -H "Transfer-Encoding: chunked" "$url/upload"
  curl -s -o /dev/null --max-time 30 "$url/file"
  odd $HG_PORT
  echo | python3 benches/idle.py $HG_PORT 1000 >/dev/null
  for p in metrics healthz readyz config breakers nope; do
    curl -s -o /dev/null --max-time 10 "http://127.0.0.1:$HG_ADMIN/$p"
  done
  kill -HUP $hg
  for _ in $(seq 1 50); do grep -q "config reloaded" "$WORK/hg.log" && break; sleep 0.2; done
  grep -q "config reloaded" "$WORK/hg.log" || echo "warning: the reload was not seen in 10 s" >&2
  oha --no-tui --output-format quiet -n 2000 -c 16 "$url/after-reload"
  kill -TERM $hg; wait $hg || true
}
: > "$WORK/symbols"
for i in "${!BINS[@]}"; do
  BIN=${BINS[$i]}
  profile 1 "$i"
  profile 2 "$i"
  nm --defined-only "$BIN" | awk 'NF == 3 && $2 ~ /^[tT]$/ { print $3 }' >> "$WORK/symbols"
done
python3 - "$WORK/symbols" "$OUT" "$WORK"/callgrind.* <<'PY'
import re, sys

symbols, out, *profiles = sys.argv[1:]
defined = set(open(symbols).read().split())
# Every function named in a profile ran: callgrind names a function (`fn=`)
# or a callee (`cfn=`) the first time it is met, and only what was executed.
ran_in = {}  # function -> the runs (1 thread, 2) it ran in
for run, profile in enumerate(sorted(profiles)):
    for line in open(profile, errors="replace"):
        m = re.match(r"^c?fn=\(\d+\) (.*)$", line.rstrip("\n"))
        if m and m.group(1) in defined:
            ran_in.setdefault(m.group(1), set()).add(run)
ran = sorted(ran_in)
# What ran in every run first, then what ran only with one thread, then
# only with two: each process touches one stretch, not two interleaved.
groups = {}
for name in ran:
    groups.setdefault(tuple(sorted(ran_in[name])), []).append(name)
blocks = [groups[k] for k in sorted(groups, key=lambda k: (-len(k), k))]

def without_hashes(name):
    legacy = re.match(r"^(_ZN.*17h)[0-9a-f]{16}E", name)
    if legacy:
        return legacy.group(1) + "*"
    return re.sub(r"Cs[0-9A-Za-z]+_", "Cs*_", name)

loose = [p for p in dict.fromkeys(without_hashes(n) for n in ran) if p not in ran_in]
with open(out, "w") as f:
    f.write(
        "/* Generated by benches/hot-text.sh: the functions that ran while the release\n"
        "   binary proxied (what ran with one thread and with two, then what ran\n"
        "   with one only, then with two only), then the same names without their\n"
        "   hashes. `.text.*` takes a function's section whether LLVM named it\n"
        "   `.text.` or, for a cold one, `.text.unlikely.`. One list per block: the\n"
        "   linker matches a block's patterns in one pass over the sections (a block\n"
        "   per function took 8 s more to link a debug build). Last, what a\n"
        "   profile-guided build marked hot itself. deploy/release-build.sh\n"
        "   passes this file to the linker (docs/memory.md). Do not edit. */\n"
        "SECTIONS\n{\n  .text.hot :\n  {\n"
    )
    for block in blocks + [loose]:
        f.write("    *(\n")
        for n in block:
            f.write(f"      .text.*{n}\n")
        f.write("    )\n")
    # What the profile-guided build's own profile marked hot (LLVM names
    # such a function's section `.text.hot.`): a build trained again
    # inlines a little differently, and a function that ran inlined in the
    # build this list was made from may stand alone in the next.
    f.write("    *(.text.hot.*)\n")
    f.write("  }\n}\nINSERT BEFORE .text;\n")
print(f"{out}: {len(ran)} functions ran, {len(loose)} names", file=sys.stderr)
PY
