"""Rank 0's HTTP endpoint: the Prometheus metrics, and the operator's "checkpoint now" request.

`GET /metrics` serves the registry. `POST /checkpoint?holdSeconds=S` asks the trainer to
checkpoint at the next step boundary, wait for the commit, and then hold (train no further
step) for up to S seconds: the operator sends it before a planned stop (a suspend, a
resize), waits for `progress.lastCheckpointStep` to reach the step it saw, and only then
deletes the pods. The SIGTERM that follows finds the step already committed, so the stop
loses no step and spends none of its grace period writing a checkpoint. When no SIGTERM
comes within S seconds (the operator changed its mind, or died), training goes on.

Why an HTTP request and not a file the operator writes through the API (a ConfigMap or an
annotation seen through a downward-API volume): the operator already reaches this port to
read progress, so the request needs no new RBAC for anyone and arrives at once, where a
projected volume is refreshed only at the kubelet's sync period (a minute or more).

The endpoint is as reachable as the metrics (the job's NetworkPolicy, when the chart
installs one, limits both to the operator and the scrapers). The most a stranger's request
can do is a checkpoint and a pause of at most MAX_HOLD_S: requests coalesce while one is
pending, and the trainer never holds longer than that.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

CHECKPOINT_PATH = "/checkpoint"
MAX_HOLD_S = 600.0
DEFAULT_HOLD_S = 60.0


class Requests:
    """The pending checkpoint request, shared by the HTTP thread and the training loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hold_s: float | None = None
        self.step = 0   # the loop's current step, for the answer

    def ask(self, hold_s: float) -> float:
        """Record a request (coalesced with a pending one: the longer hold wins); returns the
        hold granted."""
        hold_s = min(max(hold_s, 0.0), MAX_HOLD_S)
        with self._lock:
            self._hold_s = hold_s if self._hold_s is None else max(self._hold_s, hold_s)
            return self._hold_s

    def take(self) -> float | None:
        """The pending request's hold (seconds), clearing it; None when nothing was asked."""
        with self._lock:
            hold, self._hold_s = self._hold_s, None
            return hold


def _handler(registry, requests: Requests) -> type[BaseHTTPRequestHandler]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # http.server's name
            if urlsplit(self.path).path in ("/metrics", "/"):
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b'{"error":"not found"}')

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            if url.path != CHECKPOINT_PATH:
                self._send(404, b'{"error":"not found"}')
                return
            raw = parse_qs(url.query).get("holdSeconds", [str(DEFAULT_HOLD_S)])[0]
            try:
                hold = float(raw)
                if hold != hold:  # NaN
                    raise ValueError(raw)
            except ValueError:
                self._send(400, json.dumps({"error": f"holdSeconds must be a number of seconds, not {raw!r}"}).encode())
                return
            granted = requests.ask(hold)
            log.info("checkpoint requested over HTTP by %s (hold up to %.0fs after it commits)",
                     self.client_address[0], granted)
            self._send(202, json.dumps({"step": requests.step, "holdSeconds": granted}).encode())

        def log_message(self, format, *args) -> None:  # quiet: scrapes come every few seconds
            pass

    return Handler


def serve(port: int, registry, requests: Requests) -> ThreadingHTTPServer:
    """Serve on all addresses at `port` from a daemon thread; `.shutdown()` stops it."""
    server = ThreadingHTTPServer(("", port), _handler(registry, requests))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="sftjob-http", daemon=True).start()
    return server
