"""hack/chaos/s3proxy.py: the S3 throttling `make chaos` injects. Against a recording upstream
(no MinIO): what passes is what the client sent, byte for byte; what is refused is an S3
`503 SlowDown` that botocore reads as throttling and retries."""
from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from hack.chaos.s3proxy import ThrottlingProxy

pytestmark = pytest.mark.unit


@pytest.fixture
def upstream():
    """An S3 stand-in that stores PUT bodies by path and serves them back, recording requests."""
    seen: list[dict] = []
    objects: dict[str, bytes] = {}

    class Store(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_PUT(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append({"method": "PUT", "path": self.path, "headers": dict(self.headers), "body": body})
            objects[self.path.split("?")[0]] = body
            self.send_response(200)
            self.send_header("ETag", f'"{hashlib.md5(body).hexdigest()}"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            seen.append({"method": "GET", "path": self.path, "headers": dict(self.headers), "body": b""})
            data = objects.get(self.path.split("?")[0], b"")
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


@pytest.fixture
def proxy(upstream):
    p = ThrottlingProxy(upstream[0], ("127.0.0.1", 0), seed=7)
    p.start()
    yield p
    p.stop()


def client(endpoint: str, attempts: int):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                        region_name="us-east-1",
                        config=Config(retries={"total_max_attempts": attempts, "mode": "standard"},
                                      s3={"addressing_style": "path"}))


def test_requests_pass_through_unchanged(proxy, upstream):
    _, seen = upstream
    s3 = client(proxy.endpoint, 1)
    body = bytes(range(256)) * 1000
    s3.put_object(Bucket="b", Key="k/obj", Body=body)
    assert s3.get_object(Bucket="b", Key="k/obj")["Body"].read() == body
    put = seen[0]
    assert put["body"] == body
    # The signed headers reach the server as the client signed them, Host included.
    assert put["headers"]["Host"] == proxy.endpoint.removeprefix("http://")
    assert {"Authorization", "X-Amz-Date"} <= set(put["headers"]), sorted(put["headers"])
    assert proxy.counts == {"passed": 2, "throttled": 0}


def test_a_throttled_request_is_an_s3_slow_down(proxy, upstream):
    s3 = client(proxy.endpoint, 1)
    with proxy.throttled(1.0):
        with pytest.raises(ClientError) as err:
            s3.put_object(Bucket="b", Key="x", Body=b"data")
    assert err.value.response["Error"]["Code"] == "SlowDown"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert upstream[1] == [], "a refused request must not reach the server"
    s3.put_object(Bucket="b", Key="x", Body=b"data")   # the block is over: passes again
    assert len(upstream[1]) == 1


def test_a_fraction_of_one_method_is_refused_and_retries_get_through(proxy, upstream):
    s3 = client(proxy.endpoint, 10)
    with proxy.throttled(0.4, methods={"PUT"}):
        for i in range(20):
            s3.put_object(Bucket="b", Key=f"o{i}", Body=b"x" * i)
        s3.get_object(Bucket="b", Key="o3")
    puts = [r for r in upstream[1] if r["method"] == "PUT"]
    assert len(puts) == 20, "every upload got through on a retry"
    refused, passed = proxy.counts["throttled"], proxy.counts["passed"]
    expected = 20 * 0.4 / (1 - 0.4)   # each PUT is refused p/(1-p) times on average before it passes
    assert 0.5 * expected < refused < 2 * expected, proxy.counts
    assert passed == 21   # 20 PUTs that got through and the GET, never refused


def test_the_fraction_is_checked():
    p = ThrottlingProxy("http://127.0.0.1:1", ("127.0.0.1", 0))
    with pytest.raises(ValueError, match="within"):
        with p.throttled(1.5):
            pass
    p.stop()

