#!/usr/bin/env bash
# Run by tests/it/transparent.rs inside a network namespace of its own
# (`unshare --net`): services on 127.0.0.2 and 127.0.0.3, herdguard as uid
# 1337 on 127.0.0.1:15001 with `transparent = true`, the shipped capture
# rules, then an app that knows nothing of herdguard. Needs: BIN, CONFIG,
# CAPTURE (deploy/kubernetes/capture.sh), HERE (this folder), LOG.
set -euo pipefail
ip link set lo up
cleanup() { kill $(jobs -p) 2>/dev/null || true; }
trap cleanup EXIT

# Waits (at most 10 s) until each address given accepts connections.
await() {
    python3 - "$@" <<'PY'
import socket, sys, time
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"{target} never listened")
            time.sleep(0.05)
PY
}

python3 "$HERE/servers.py" >/dev/null &
await 127.0.0.2:8080 127.0.0.3:8080
setpriv --reuid=1337 --regid=1337 --clear-groups "$BIN" --config "$CONFIG" --log-format json 2>"$LOG" &
await 127.0.0.1:15001
HERDGUARD_PORT=15001 HERDGUARD_UID=1337 CAPTURE_PORTS=8080 CAPTURE_EXCLUDE=127.0.0.1/32 sh "$CAPTURE"
timeout 30 python3 "$HERE/app.py"
