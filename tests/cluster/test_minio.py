"""MinIO is reachable with nothing but .cluster/env: boto3 and pyarrow's S3 filesystem."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.fixtures.cluster import load_env_file

pytestmark = pytest.mark.cluster

CLIENT = """
import json, sys
import boto3
import pyarrow as pa, pyarrow.fs as pafs, pyarrow.parquet as pq
bucket = sys.argv[1]
s3 = boto3.client("s3")  # endpoint, credentials and region come from the environment only
s3.put_object(Bucket=bucket, Key="raw/hello.txt", Body=b"hello minio")
got = s3.get_object(Bucket=bucket, Key="raw/hello.txt")["Body"].read().decode()
fs = pafs.S3FileSystem()  # likewise
pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["x", "y"]}), f"{bucket}/data/train.parquet", filesystem=fs)
table = pq.read_table(f"{bucket}/data/train.parquet", filesystem=fs)
listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
infos = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(bucket, recursive=True)) if i.type == pafs.FileType.File)
print(json.dumps({"got": got, "rows": table.num_rows, "listed": listed, "infos": infos}))
"""


def test_boto3_and_pyarrow_with_only_cluster_env(cluster, s3_bucket):
    env = {"HOME": "/root", **load_env_file(cluster.cfg.env_file)}
    env["PATH"] = env["PATH"]  # the cached kubectl/helm first, then the inherited PATH
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CLIENT), s3_bucket], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["got"] == "hello minio"
    assert res["rows"] == 2
    assert res["listed"] == ["data/train.parquet", "raw/hello.txt"]
    assert res["infos"] == [f"{s3_bucket}/data/train.parquet", f"{s3_bucket}/raw/hello.txt"]
