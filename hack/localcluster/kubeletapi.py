"""The one kubelet endpoint worth having here: container logs, so that `kubectl logs` (which the
API server proxies to https://<node InternalIP>:10250/containerLogs/...) works.

Served by the node agent for all its nodes, from the files under .cluster/pods/.
"""
from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable


def _tail(data: bytes, lines: int) -> bytes:
    if lines < 0:
        return data
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:]) if lines else b""


def serve(bind_ip: str, port: int, pods_dir: Path, cert: Path, key: Path,
          running: Callable[[str, str], bool]) -> ThreadingHTTPServer:
    """Start the server in a daemon thread. running(ns, pod) tells `follow` when to stop."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the agent's log for pod lifecycle events
            pass

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) != 4 or parts[0] != "containerLogs":
                self.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> is served")
                return
            _, ns, pod, container = parts
            q = urllib.parse.parse_qs(url.query)
            path = pods_dir / f"{ns}_{pod}" / f"{container}.log"
            if not path.exists():
                self.send_error(404, f"no log for container {container} of {ns}/{pod}")
                return
            data = path.read_bytes()
            data = _tail(data, int(q.get("tailLines", ["-1"])[0]))
            if "limitBytes" in q:
                data = data[: int(q["limitBytes"][0])]
            follow = q.get("follow", ["false"])[0] == "true"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            if not follow:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if not follow:
                return
            offset = path.stat().st_size
            try:
                while True:
                    size = path.stat().st_size
                    if size > offset:
                        with open(path, "rb") as f:
                            f.seek(offset)
                            self.wfile.write(f.read(size - offset))
                        self.wfile.flush()
                        offset = size
                    elif not running(ns, pod):
                        return
                    time.sleep(0.3)
            except (BrokenPipeError, ConnectionResetError, OSError):
                return

    server = ThreadingHTTPServer((bind_ip, port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="kubelet-api").start()
    return server
