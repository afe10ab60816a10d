"""S3 throttling for `make chaos`: an HTTP pass-through in front of MinIO that, while told to,
answers a seeded fraction of requests `503 SlowDown`, the error S3 returns when a prefix is
requested faster than it scales.

The chaos job's `spec.storage.endpoint` and its model path's endpoint point here (on the
cluster bridge's host address, which the pods reach) from the start, so nothing about the job
changes when throttling begins: only the answers do. Everything else passes through
unchanged, request line, headers (the `Host` header included: SigV4 signs it, and MinIO checks
the signature against the header it receives) and body byte for byte, so MinIO sees what the
trainer sent.

    proxy = ThrottlingProxy("http://10.244.0.1:9000", ("10.244.0.1", 0), seed=1)
    proxy.start()                        # proxy.endpoint: http://10.244.0.1:<port>
    with proxy.throttled(0.3, methods={"PUT", "POST"}):
        ...                              # 30 % of uploads are refused with 503 SlowDown
    proxy.counts                         # {"passed": n, "throttled": m}
"""
from __future__ import annotations

import contextlib
import http.client
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Headers about one hop's connection, not the request (RFC 9110 7.6.1): not forwarded.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "expect"}
SLOW_DOWN = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             "<Message>Please reduce your request rate.</Message><Resource>{resource}</Resource>"
             "<RequestId>sftjob-chaos</RequestId></Error>")


class ThrottlingProxy:
    def __init__(self, upstream: str, bind: tuple[str, int], seed: int = 0):
        url = urlsplit(upstream)
        self.upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fraction = 0.0
        self._methods: set[str] | None = None
        self.counts = {"passed": 0, "throttled": 0}
        self._server = ThreadingHTTPServer(bind, _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():   # shutdown() waits for a serve_forever that never ran
            self._server.shutdown()
        self._server.server_close()

    @contextlib.contextmanager
    def throttled(self, fraction: float, methods: set[str] | None = None) -> Iterator[None]:
        """Refuse `fraction` of the requests (of `methods`, or all) with 503 SlowDown inside the block."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {fraction}")
        with self._lock:
            self._fraction, self._methods = fraction, methods
        try:
            yield
        finally:
            with self._lock:
                self._fraction, self._methods = 0.0, None

    def _refuse(self, method: str) -> bool:
        """Whether this request is one of the refused fraction; counted either way."""
        with self._lock:
            refuse = (self._fraction > 0 and (self._methods is None or method in self._methods)
                      and self._rng.random() < self._fraction)
            self.counts["throttled" if refuse else "passed"] += 1
            return refuse


def _handler(proxy: ThrottlingProxy) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, and `Expect: 100-continue` answered here

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass   # trailers
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _relay(self) -> None:
            body = self._body()
            if proxy._refuse(self.command):
                payload = SLOW_DOWN.format(resource=self.path.split("?", 1)[0]).encode()
                self.send_response(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=300)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except OSError:
                # MinIO down (the minio-outage fault): close the client's connection without an
                # answer, which the client retries as it would a refused connection (the server
                # would close it after an unhandled error too, but print a traceback per request).
                self.close_connection = True
                return
            finally:
                conn.close()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():   # send_response wrote its own Date and Server
                if k.lower() not in HOP_BY_HOP and k.lower() not in ("content-length", "date", "server"):
                    self.send_header(k, v)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

    return Relay
