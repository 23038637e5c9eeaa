"""An S3 endpoint that fails on purpose, for the fault tests: a proxy in front of moto that answers a
share of requests with a 500 InternalError or a 503 SlowDown (S3's own error bodies), or drops the
connection without an answer, and passes the rest through unchanged. Seeded, so a run's faults repeat.

    python tests/faulty_s3.py <port> <upstream host:port> <share> <seed>

GET /_faults answers how many requests it passed and failed, by kind, as JSON.
"""

from __future__ import annotations

import http.client
import http.server
import json
import random
import socket
import sys
import threading
from collections import Counter

ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<RequestId>faulty-s3</RequestId></Error>"
)
FAULTS = [
    (500, "InternalError", "We encountered an internal error. Please try again."),
    (503, "SlowDown", "Please reduce your request rate."),
    (None, "dropped", ""),
]


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: str
    share: float
    draw: random.Random
    lock = threading.Lock()
    failed: Counter = Counter()
    passed = 0

    def log_message(self, *args) -> None:  # quiet: the tests read the counts
        pass

    def body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def handle_one(self) -> None:
        body = self.body()
        if self.path == "/_faults":
            with self.lock:
                counts = {"passed": Proxy.passed, **Proxy.failed}
            self.answer(200, {"Content-Type": "application/json"}, json.dumps(counts).encode())
            return
        with self.lock:
            fault = FAULTS[self.draw.randrange(len(FAULTS))] if self.draw.random() < self.share else None
            if fault:
                Proxy.failed[fault[1]] += 1
            else:
                Proxy.passed += 1
        if fault and fault[0] is None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault:
            self.answer(
                fault[0],
                {"Content-Type": "application/xml"},
                ERROR_BODY.format(code=fault[1], message=fault[2]).encode(),
            )
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length")}
        upstream = http.client.HTTPConnection(self.upstream, timeout=120)
        upstream.request(
            self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None, headers=headers
        )
        response = upstream.getresponse()
        payload = response.read()
        answered = {k: v for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
        if self.command != "HEAD":
            answered["Content-Length"] = str(len(payload))
        self.answer(response.status, answered, payload)
        upstream.close()

    def answer(self, status: int, headers: dict, payload: bytes) -> None:
        self.send_response_only(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers and "content-length" not in {k.lower() for k in headers}:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_one


def main(port: str, upstream: str, share: str, seed: str) -> None:
    Proxy.upstream, Proxy.share, Proxy.draw = upstream, float(share), random.Random(int(seed))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Proxy)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:])
