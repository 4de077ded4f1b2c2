#!/usr/bin/env python3
"""Soak: the release binary at a fixed request rate for minutes, through
trouble, on loopback. Run by benches/soak.sh.

Phases of the run (fractions of --duration):
  0.00-0.20 healthy upstream
  0.20-0.40 failing upstream: 30% of requests answered 503
  0.40-0.55 frozen upstream: accepts, reads, never answers
  0.55-1.00 healthy again: how long until callers see 90% success

Throughout: --rate GETs a second from independent callers (each with a 3 s
timeout, sent on schedule whether or not earlier ones were answered);
every 10 s a batch of 50 silent connections that never send a byte; 10
slow readers that ask for 1 MiB and read 4 KiB a second; a config reload
every 15 s, alternating 2 and 500 routes. Every 10 s: requests, successes,
errors by kind (status and x-herdguard-error, or the client's own
timeout), the proxy's RSS and open file descriptors.
"""

import argparse
import asyncio
import os
import random
import sys
import time

BIG = 1 << 20


def config(port, admin, up, routes):
    text = [
        f'[listen]\naddress = "127.0.0.1:{port}"\nheader_read_timeout = "2s"\n',
        f'[admin]\naddress = "127.0.0.1:{admin}"\n',
        f'[upstreams.up]\nendpoints = ["http://127.0.0.1:{up}"]\n',
        '[[routes]]\nname = "all"\nupstream = "up"\nmatch = { path_prefix = "/" }\n',
    ]
    # Routes that never match first: the reload grows and shrinks the config.
    for i in range(routes - 1):
        text.insert(
            3, f'[[routes]]\nname = "r{i}"\nupstream = "up"\nmatch = {{ path_prefix = "/never/{i}/" }}\n'
        )
    return "".join(text)


class Upstream:
    def __init__(self):
        self.mode = "healthy"

    async def handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.mode == "frozen":
                    await asyncio.sleep(3600)
                if head.startswith(b"GET /big"):
                    body = b"x" * BIG
                    status = b"200 OK"
                elif self.mode == "failing" and random.random() < 0.3:
                    body, status = b"busy", b"503 Service Unavailable"
                else:
                    body, status = b"ok", b"200 OK"
                writer.write(
                    b"HTTP/1.1 " + status + b"\r\ncontent-length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError,
                asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def get(port, path, timeout=3.0):
    """One GET on its own connection: ('ok'|kind, seconds)."""
    start = time.monotonic()
    writer = None
    try:
        async def go():
            nonlocal writer
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1].decode()
            kind = status
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"x-herdguard-error:"):
                    kind = f"{status} {line.split(b':', 1)[1].strip().decode()}"
            await reader.read()
            return "ok" if status == "200" else kind

        kind = await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        kind = "caller timeout"
    except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
        kind = f"connection {type(e).__name__}"
    finally:
        if writer is not None:
            writer.close()
    return kind, time.monotonic() - start


def proc_stat(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


async def main():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--duration", type=float, default=180)
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--port", type=int, default=18381)
    args = ap.parse_args()
    port, admin, up_port = args.port, args.port + 1, args.port + 2
    work = f"/tmp/herdguard-soak-{os.getpid()}"
    os.makedirs(work, exist_ok=True)
    conf = os.path.join(work, "soak.toml")
    with open(conf, "w") as f:
        f.write(config(port, admin, up_port, 2))

    upstream = Upstream()
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", up_port)
    proxy = await asyncio.create_subprocess_exec(
        args.bin, "--config", conf, "--threads", "2",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            break
        except OSError:
            await asyncio.sleep(0.1)

    start = time.monotonic()
    end = start + args.duration
    phases = [(0.20, "healthy"), (0.40, "failing"), (0.55, "frozen"), (1.01, "healthy")]
    resume_at = start + 0.55 * args.duration
    windows = {}  # window index -> {kind: count}
    seconds = {}  # second index -> [sent, ok]
    tasks = set()

    def record(sent_at, kind):
        w = int((sent_at - start) // 10)
        windows.setdefault(w, {}).setdefault(kind, 0)
        windows[w][kind] += 1
        s = int(sent_at - start)
        seconds.setdefault(s, [0, 0])
        seconds[s][0] += 1
        seconds[s][1] += kind == "ok"

    async def one(i):
        sent_at = time.monotonic()
        kind, _ = await get(port, f"/soak/{i}")
        record(sent_at, kind)

    async def batches(n, send=b""):
        """Every 10 s, `n` new connections that send `send` (or nothing)
        and then hold still; the last batch is let go on this side too."""
        held = []
        while time.monotonic() < end:
            for _, w in held:
                w.close()
            held = []
            for _ in range(n):
                try:
                    r, w = await asyncio.open_connection("127.0.0.1", port)
                    w.write(send)
                    held.append((r, w))
                except OSError:
                    pass
            await asyncio.sleep(10)
        for _, w in held:
            w.close()

    async def slow_reader():
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /big HTTP/1.1\r\nHost: soak\r\n\r\n")
                await writer.drain()
                while time.monotonic() < end:
                    chunk = await asyncio.wait_for(reader.read(4096), 60)
                    if not chunk:
                        break
                    await asyncio.sleep(1)
                writer.close()
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
                await asyncio.sleep(1)

    async def reloads():
        big = False
        while time.monotonic() < end:
            await asyncio.sleep(15)
            big = not big
            with open(conf, "w") as f:
                f.write(config(port, admin, up_port, 500 if big else 2))
            proxy.send_signal(1)

    # The hostile mix: uploads that stall one byte short (bodies held for a
    # retry; `batches`), heads sent a byte a second, and long paths.
    stalled = b"PUT /upload HTTP/1.1\r\nHost: soak\r\nContent-Length: 65536\r\n\r\n"
    stalled += b"x" * (64 * 1024 - 1)
    async def slow_head():
        head = b"GET /soak/slow HTTP/1.1\r\nHost: soak\r\nX-Slow: " + b"a" * 4096
        while time.monotonic() < end:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                for byte in head:
                    if time.monotonic() >= end:
                        break
                    w.write(bytes([byte]))
                    await w.drain()
                    await asyncio.sleep(1)
                w.close()
            except OSError:
                await asyncio.sleep(1)

    async def long_paths():
        while time.monotonic() < end:
            await get(port, "/soak/" + "p" * 20000)
            await asyncio.sleep(0.2)

    stats = []

    async def sample():
        while time.monotonic() < end + 5:
            stats.append((time.monotonic() - start, *proc_stat(proxy.pid)))
            await asyncio.sleep(10)

    side = [asyncio.create_task(c) for c in (batches(50), reloads(), sample())]
    side += [asyncio.create_task(slow_reader()) for _ in range(10)]
    side += [asyncio.create_task(c) for c in (batches(200, stalled), long_paths())]
    side += [asyncio.create_task(slow_head()) for _ in range(100)]
    i = 0
    interval = 1.0 / args.rate
    next_at = start
    while True:
        now = time.monotonic()
        if now >= end:
            break
        upstream.mode = next(m for f, m in phases if now < start + f * args.duration)
        if now < next_at:
            await asyncio.sleep(next_at - now)
            continue
        t = asyncio.create_task(one(i))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        i += 1
        next_at += interval
    upstream.mode = "healthy"
    await asyncio.gather(*list(tasks), return_exceptions=True)
    await asyncio.sleep(5)
    for t in side:
        t.cancel()
    await asyncio.gather(*side, return_exceptions=True)
    rss_end, fds_end = proc_stat(proxy.pid)
    rss_peak = peak_rss(proxy.pid)
    proxy.terminate()
    code = await proxy.wait()
    server.close()

    # Report.
    print(f"soak: {args.duration:.0f} s at {args.rate} req/s; phases: healthy, failing (30% 503) "
          f"from {0.2*args.duration:.0f} s, frozen from {0.4*args.duration:.0f} s, healthy again "
          f"from {0.55*args.duration:.0f} s; 50 silent connections every 10 s, 10 slow readers, "
          f"a reload every 15 s (2 <-> 500 routes); hostile: 200 uploads stalled one byte short of "
          f"64 KiB every 10 s, 100 heads sent a byte a second, a 20 KB path 5 times a second\n")
    print(f"{'window':>9} {'phase':>8} {'sent':>6} {'ok':>7}  errors by kind")
    for w in sorted(windows):
        kinds = windows[w]
        sent = sum(kinds.values())
        ok = kinds.get("ok", 0)
        t = w * 10
        phase = next(m for f, m in phases if start + t < start + f * args.duration)
        errs = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()) if k != "ok") or "-"
        print(f"{t:>4}-{t+10:<4} {phase:>8} {sent:>6} {100*ok/max(sent,1):>6.1f}%  {errs}")
    print(f"\n{'at s':>6} {'RSS KiB':>9} {'fds':>5}")
    for t, rss, fds in stats:
        print(f"{t:>6.0f} {rss:>9} {fds:>5}")
    print(f"{'end':>6} {rss_end:>9} {fds_end:>5}")
    print(f"peak RSS: {rss_peak} KiB ({rss_peak / 1024:.1f} MiB)")
    resume = int(resume_at - start)
    back = next((s for s in sorted(seconds) if s >= resume and seconds[s][0]
                 and seconds[s][1] / seconds[s][0] >= 0.9), None)
    print(f"\nrecovery: callers back to 90% success {back - resume if back is not None else 'never'} s "
          f"after the upstream resumed")
    total = sum(sum(k.values()) for k in windows.values())
    ok = sum(k.get("ok", 0) for k in windows.values())
    print(f"total: {total} requests, {100*ok/max(total,1):.1f}% ok; proxy exit code {code} "
          f"(0: it drained and stopped cleanly)")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
