#!/usr/bin/env bash
# Soak: herdguard (release) at a fixed rate for minutes through a failing
# and then frozen upstream, silent connections, slow readers and reloads;
# errors by kind, RSS and open descriptors over time, peak RSS, recovery
# time; beside it the hostile mix (stalled uploads, slow heads, long paths).
#
#   benches/soak.sh                      # 3 minutes at 200 req/s
#   DURATION=600 RATE=300 benches/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
exec python3 benches/soak.py --bin target/release/herdguard \
  --duration "${DURATION:-180}" --rate "${RATE:-200}" --port "${PORT:-18381}"
