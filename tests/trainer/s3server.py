"""A tiny S3-speaking HTTP server on a loopback port, for answers MinIO will not give.

MinIO refuses keys holding ".." or starting with "/", and never throttles; a real object
store may do both. This server answers over a real socket in S3's wire format: either
every request with one error (``503 SlowDown``, ``403 AccessDenied``), or ListObjectsV2,
HeadObject and GetObject from a dict of objects whose keys are taken as given.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse
from xml.sax.saxutils import escape

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "tiny-s3", "AWS_SECRET_ACCESS_KEY": "tiny-s3-secret", "AWS_REGION": "us-east-1"}


class TinyS3:
    def __init__(self, objects: dict[str, bytes] | None = None, error: tuple[int, str] | None = None):
        self.objects = objects or {}  # "bucket/key" -> body
        self.error = error
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" at once

            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                server.requests.append(f"{self.command} {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if server.error:
                    status, code = server.error
                    body = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                            f"<Message>{code} from the tiny S3 server</Message></Error>").encode()
                    return self._answer(status, body, {"Content-Type": "application/xml"})
                url = urlparse(self.path)
                path = unquote(url.path).lstrip("/")
                query = parse_qs(url.query)
                if "list-type" in query:
                    return self._answer(200, server.listing(path, query.get("prefix", [""])[0]),
                                        {"Content-Type": "application/xml"})
                body = server.objects.get(path)
                if body is None:
                    return self._answer(404, b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>")
                return self._answer(200, body, {"ETag": '"0"', "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
                                                "Content-Type": "application/octet-stream"})

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def listing(self, bucket: str, prefix: str) -> bytes:
        keys = sorted(k[len(bucket) + 1:] for k in self.objects if k.startswith(f"{bucket}/"))
        rows = "".join(f"<Contents><Key>{escape(k)}</Key><Size>{len(self.objects[f'{bucket}/{k}'])}</Size>"
                       "<LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>\"0\"</ETag></Contents>"
                       for k in keys if k.startswith(prefix))
        return ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult "
                "xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
                f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><MaxKeys>1000</MaxKeys>"
                f"<IsTruncated>false</IsTruncated>{rows}</ListBucketResult>").encode()

    def __enter__(self) -> TinyS3:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def closed_port_endpoint() -> str:
    """An endpoint where nothing listens: every connection is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
