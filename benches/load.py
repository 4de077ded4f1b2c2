#!/usr/bin/env python3
"""Sends N HTTP/1.1 requests over C keep-alive connections, each connection
one request at a time, and checks every answer is whole (Content-Length or
chunked) and 2xx: a load driver that needs nothing built or installed, for
instruction counts (callgrind), where the driver's own speed does not count.

    benches/load.py HOST:PORT N [--connections C] [--path P] [--method M] [--body BYTES]

Exits 1 if an answer was not 2xx or a connection broke; bounded: gives up
after --timeout seconds (default 300).
"""
import argparse
import selectors
import socket
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("n", type=int)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--path", default="/bench")
    ap.add_argument("--method", default="GET")
    ap.add_argument("--body", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    host, port = args.address.rsplit(":", 1)
    body = b"x" * args.body
    head = f"{args.method} {args.path} HTTP/1.1\r\nHost: {host}\r\n"
    if args.body or args.method in ("POST", "PUT"):
        head += f"Content-Length: {len(body)}\r\n"
    request = (head + "\r\n").encode() + body

    sel = selectors.DefaultSelector()
    sent = answered = 0
    conns = []
    for _ in range(min(args.connections, args.n)):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        state = {"sock": s, "buf": b""}
        conns.append(state)
        sel.register(s, selectors.EVENT_READ, state)
        s.sendall(request)
        sent += 1

    deadline = time.monotonic() + args.timeout
    while answered < args.n:
        if time.monotonic() > deadline:
            sys.exit(f"load.py: {answered} of {args.n} answered within {args.timeout}s")
        for key, _ in sel.select(timeout=1.0):
            st = key.data
            chunk = st["sock"].recv(65536)
            if not chunk:
                sys.exit(f"load.py: a connection closed after {answered} answers")
            st["buf"] += chunk
            while True:
                done = whole(st["buf"])
                if done is None:
                    break
                status, used = done
                if not 200 <= status < 300:
                    sys.exit(f"load.py: answered {status}")
                st["buf"] = st["buf"][used:]
                answered += 1
                if sent < args.n:
                    st["sock"].setblocking(True)
                    st["sock"].sendall(request)
                    st["sock"].setblocking(False)
                    sent += 1
    for st in conns:
        st["sock"].close()
    print(f"{answered} answered")


def whole(buf):
    """(status, bytes used) of the first whole response in buf, or None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    at = end + 4
    if b"content-length" in headers:
        length = int(headers[b"content-length"])
        return (status, at + length) if len(buf) >= at + length else None
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            line_end = buf.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(buf[at:line_end].split(b";")[0], 16)
            at = line_end + 2 + size + 2
            if len(buf) < at:
                return None
            if size == 0:
                return status, at
    return status, at


if __name__ == "__main__":
    main()
