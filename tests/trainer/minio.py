"""A private MinIO server for the trainer's object-storage tests.

It is the local cluster's MinIO binary (built from Go modules by hack/), run on its own
loopback port so a test may stop and restart it without disturbing anything else.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MinioServer:
    def __init__(self, data_dir: Path):
        from hack.localcluster.cluster import ensure_binaries
        from hack.localcluster.config import bin_dir

        ensure_binaries(("minio",))  # a cold cache builds it; a failed build fails the test
        self.binary = str(bin_dir("minio") / "minio")
        self.data_dir = data_dir
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "sftjob-test",
                    "AWS_SECRET_ACCESS_KEY": "sftjob-test-secret", "AWS_REGION": "us-east-1"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, MINIO_ROOT_USER=self.env["AWS_ACCESS_KEY_ID"],
                   MINIO_ROOT_PASSWORD=self.env["AWS_SECRET_ACCESS_KEY"], MINIO_BROWSER="off", MINIO_UPDATE="off")
        self.proc = subprocess.Popen([self.binary, "server", str(self.data_dir), "--quiet",
                                      f"--address=127.0.0.1:{self.port}",
                                      f"--console-address=127.0.0.1:{_free_port()}"],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.endpoint}/minio/health/live", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("MinIO did not become healthy within 60 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))
