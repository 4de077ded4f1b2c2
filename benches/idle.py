#!/usr/bin/env python3
"""Opens N keep-alive connections to 127.0.0.1:PORT, sends one GET on each
and reads its answer, then holds them idle: prints "open" once all answered,
closes them all when a line (or EOF) comes on stdin, then prints "closed".
Bounded: every socket operation times out after 10 s."""
import socket
import sys

port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /idle HTTP/1.1\r\nHost: bench\r\n\r\n")
    socks.append(s)
for s in socks:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        if not chunk:
            sys.exit("a connection closed before its answer")
        got += chunk
print("open", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print("closed", flush=True)
