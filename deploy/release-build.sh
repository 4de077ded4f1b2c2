#!/usr/bin/env bash
# The release build that ships: target/release/herdguard linked with
# deploy/hot-text.ld, which puts the functions a running proxy executes next
# to each other ahead of the rest of the code. The kernel maps a binary's
# code in by the 64 KiB around each page that runs, so hot code spread over
# the whole binary keeps most of it resident; packed, the peak at 64 busy
# connections is about 2 MiB lower (docs/memory.md has the figures and how
# to measure them again).
#
# It is also profile-guided: a first build instrumented for it runs a fixed
# mix of requests (`herdguard-lab train`, lab/src/train.rs) and LLVM lays out
# and inlines the final build by where that run spent its time: about a
# fifth fewer instructions per plain GET (docs/request-path.md). The
# profiler's llvm-profdata comes with rustup's llvm-tools component, added
# when missing; without it the build is not profile-guided.
#
#   deploy/release-build.sh            # what deploy/Dockerfile runs
#   PGO=0 deploy/release-build.sh      # not profile-guided
#   HOT_TEXT=0 PGO=0 deploy/release-build.sh # a plain release build
#
# A `cargo build --release` run after it builds target/release/herdguard
# again, plain: run this script again for the shipped build.
#
# The script is passed only when the linker is LLD (Rust's default on
# x86_64 Linux since 1.90 when the toolchain ships rust-lld): GNU ld takes
# it too but needs minutes to match its patterns, and mold ignores it.
# After the build, the layout is checked: the request head parser lies in
# `.text.hot`, and most of the script's hash-free names still exist (when
# they do not, run benches/hot-text.sh again and commit its output).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=deploy/hot-text.ld
BIN=target/release/herdguard

ships_lld() {
    local sysroot host
    sysroot=$(rustc --print sysroot) || return 1
    host=$(rustc -vV | sed -n 's/^host: //p')
    [ "$host" = x86_64-unknown-linux-gnu ] && [ -x "$sysroot/lib/rustlib/$host/bin/gcc-ld/ld.lld" ]
}

# llvm-profdata of the toolchain's own LLVM (a profile is read only by the
# LLVM version that wrote it), from rustup's llvm-tools.
profdata() {
    local tool
    tool="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/llvm-profdata"
    if [ ! -x "$tool" ] && command -v rustup >/dev/null; then
        rustup component add llvm-tools >&2 || true
    fi
    [ -x "$tool" ] && echo "$tool"
}

# The caller's rustc flags (CARGO_ENCODED_RUSTFLAGS, or else RUSTFLAGS), with
# ARGS after them, as CARGO_ENCODED_RUSTFLAGS: cargo reads that before
# RUSTFLAGS, and takes each flag whole (a path with a space stays one).
with_flags() {
    local sep=$'\x1f' out
    if [ -n "${CARGO_ENCODED_RUSTFLAGS+x}" ]; then
        out=$CARGO_ENCODED_RUSTFLAGS
    else
        read -r -a given <<<"${RUSTFLAGS:-}"
        out=$(IFS=$sep; echo "${given[*]}")
    fi
    for flag in "$@"; do out=${out:+$out$sep}$flag; done
    printf '%s' "$out"
}

# The profile: an instrumented build (a target directory of its own) run by
# `herdguard-lab train` (built in another, with the caller's flags alone, so
# that target/release is built with one set of flags only), its counts
# merged. LLVM_PROFILE_FILE would send them elsewhere: unset for the run.
guided=0
if [ "${PGO:-1}" != 0 ]; then
    if tool=$(profdata); then
        data="$PWD/target/pgo/data"
        rm -rf "$data"
        CARGO_ENCODED_RUSTFLAGS=$(with_flags "-Cprofile-generate=$data") \
            cargo build --release --locked --bin herdguard --target-dir target/pgo/instrumented
        cargo build --release --locked -p herdguard-lab --bin herdguard-lab --target-dir target/pgo/lab
        env -u LLVM_PROFILE_FILE target/pgo/lab/release/herdguard-lab train \
            target/pgo/instrumented/release/herdguard
        "$tool" merge -o target/pgo/herdguard.profdata "$data"
        CARGO_ENCODED_RUSTFLAGS=$(with_flags "-Cprofile-use=$PWD/target/pgo/herdguard.profdata")
        export CARGO_ENCODED_RUSTFLAGS
        guided=1
        echo "release-build: profile-guided, from target/pgo/herdguard.profdata" >&2
    else
        echo "release-build: not profile-guided (no llvm-profdata: rustup component add llvm-tools)" >&2
    fi
fi

if [ "${HOT_TEXT:-1}" = 0 ] || ! ships_lld; then
    echo "release-build: linking without $SCRIPT (HOT_TEXT=0, or the toolchain has no rust-lld)" >&2
    cargo build --release --locked --bin herdguard
    exit 0
fi

# Cargo does not see the script as an input of the link: the binary is
# removed so that it is linked again, with the script as it is now.
find target/release/deps -maxdepth 1 -type f -name 'herdguard-*' -perm -u+x -delete 2>/dev/null || true
# `cargo rustc` hands the link arguments to the herdguard binary alone; two
# arguments, so that no character of the path is read as a separator.
cargo rustc --release --locked --bin herdguard -- \
    -C link-arg=-T -C "link-arg=$PWD/$SCRIPT"

# The layout, checked on what was built.
hot=$(readelf -SW "$BIN" | awk '$2 == ".text.hot" { print $4, $6 }')
[ -n "$hot" ] || { echo "release-build: $BIN has no .text.hot section" >&2; exit 1; }
read -r hot_addr hot_size <<<"$hot"
symbols=$(mktemp)
trap 'rm -f "$symbols"' EXIT
nm --defined-only "$BIN" >"$symbols"
python3 - "$SCRIPT" "$hot_addr" "$hot_size" "$symbols" "$guided" <<'PY'
import fnmatch, sys
script, start, size = sys.argv[1], int(sys.argv[2], 16), int(sys.argv[3], 16)
guided = sys.argv[5] == "1"
functions = {}
for line in open(sys.argv[4]):
    parts = line.split()
    if len(parts) == 3 and parts[1] in "tT":
        functions[parts[2]] = int(parts[0], 16)
hot = lambda addr: start <= addr < start + size
# A profile-guided build inlines these where they run, and the copies left
# standing are the rarely run ones: the names are checked below alone.
parser = [a for n, a in functions.items() if n.startswith("_ZN8httparse25parse_headers_iter_uninit17h")]
if not guided and (not parser or not all(hot(a) for a in parser)):
    sys.exit("release-build: httparse's head parser is not in .text.hot")
# herdguard's own code that every plain GET runs: a script made before the
# request path moved into new functions leaves them cold (it did once, and
# the names it lists were still mostly present).
own = {
    "upstream::plain::exchange": "_ZN9herdguard8upstream5plain8exchange",
    "upstream::plain::Raw::poll_fill": "_ZN9herdguard8upstream5plain3Raw9poll_fill",
    "proxy::finish_headers": "_ZN9herdguard5proxy14finish_headers",
}
found = {what: [a for n, a in functions.items() if n.startswith(prefix)] for what, prefix in own.items()}
if not guided and not any(found.values()):
    sys.exit("release-build: none of the request path's functions it checks is in the binary "
             "(renamed or inlined): name others in deploy/release-build.sh")
cold = [what for what, addrs in found.items() if addrs and not all(hot(a) for a in addrs)]
if cold and not guided:
    sys.exit(f"release-build: {', '.join(cold)} not in .text.hot: {script} predates them "
             "(run benches/hot-text.sh again and commit its output)")
names = [l.strip()[len(".text.*"):] for l in open(script).read().rsplit("    *(\n", 1)[1].splitlines()
         if l.strip().startswith(".text.*")]
missing = [p for p in names if not any(fnmatch.fnmatchcase(n, p) for n in functions)]
# The script is made from a plain and a profile-guided build, which inline
# differently: about a quarter of its names are the other build's alone.
# Over two in five missing, it predates the code.
if len(missing) * 5 > len(names) * 2:
    sys.exit(f"release-build: {script} names {len(missing)} of {len(names)} functions this binary "
             f"lacks (run benches/hot-text.sh again), e.g. {missing[:5]}")
print(f"release-build: herdguard linked with {script}: "
      f".text.hot {size // 1024} KiB, {len(names) - len(missing)} of {len(names)} names present",
      file=sys.stderr)
PY
