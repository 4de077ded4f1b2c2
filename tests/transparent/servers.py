"""Two HTTP services on loopback addresses for the transparent-capture test,
run inside the test's own network namespace: 127.0.0.2:8080 answers 503 to
the first request for each path and 200 after, its body telling whether the
request came with Via (so through herdguard); 127.0.0.3:8080 answers 200
"other". Each prints "ready" once listening. Stops after 60 s at most."""
import http.server
import socketserver
import sys
import threading

seen = {}


class Flaky(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n = seen.get(self.path, 0) + 1
        seen[self.path] = n
        status = 503 if n == 1 else 200
        body = f"attempt={n} via={self.headers.get('Via', '-')}".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Other(Flaky):
    def do_GET(self):
        body = f"other via={self.headers.get('Via', '-')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


for addr, handler in ((("127.0.0.2", 8080), Flaky), (("127.0.0.3", 8080), Other)):
    server = Server(addr, handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait(60)
sys.exit(0)
