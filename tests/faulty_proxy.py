"""A small HTTP proxy that sits between the job and the moto S3 server and injects S3 faults.

The fault is the stand-in here, never S3 itself: every request that is not faulted reaches the real moto server
unchanged. Modes:
- `fail_every`: on average one matching request in N gets `503 SlowDown` (transient throttling, as S3 does under
  load);
- `fail_always`: every matching request gets `503 SlowDown` (a persistent outage);
- `reset_every`: on average one matching request in N has its connection closed without an answer.
Transient faults are drawn from a seeded RNG, not every Nth request: a strict period can line up with the
fixed number of requests one read makes, so the same request of every retry fails and a transient fault
becomes a permanent one (seen with a ranged read: 3 requests per attempt, a 503 on every 3rd).
`match` restricts faults to requests whose method+path contains a substring (e.g. "PUT /bucket/run/completions");
`spare` exempts the requests whose method+path contains one.
"""

from __future__ import annotations

import http.client
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultyProxy:
    def __init__(self, upstream_port: int, *, match: str = "", spare: str = "", fail_every: int = 0,
                 fail_always: bool = False, reset_every: int = 0):
        self.upstream_port = upstream_port
        self.match = match
        self.spare = spare
        self.fail_every = fail_every
        self.fail_always = fail_always
        self.reset_every = reset_every
        self.lock = threading.Lock()
        self.rng = random.Random(0)
        self.num_matching = 0
        self.num_faults = 0
        self.num_forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self._read_body()
                fault = proxy._fault_for(f"{self.command} {self.path}")
                if fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if fault == "reset":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "transfer-encoding", "content-length")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # HEAD answers carry the object's length but no body: pass the upstream length through.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()
                with proxy.lock:
                    proxy.num_forwarded += 1

            def _read_body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    # The AWS SDK streams uploads with chunked transfer encoding: undo the HTTP framing only
                    # and forward the payload with a Content-Length.
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _fault_for(self, request_line: str) -> str | None:
        if (self.match and self.match not in request_line) or (self.spare and self.spare in request_line):
            return None
        with self.lock:
            self.num_matching += 1
            fault = None
            draw = self.rng.random()
            if self.fail_always or (self.fail_every and draw < 1 / self.fail_every):
                fault = "503"
            elif self.reset_every and draw < 1 / self.fail_every + 1 / self.reset_every:
                fault = "reset"
            if fault:
                self.num_faults += 1
            return fault

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
