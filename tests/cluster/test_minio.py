"""MinIO is reachable with nothing but .cluster/env: boto3 and pyarrow's S3 filesystem."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hack import localcluster

from tests.fixtures.cluster import load_env_file

pytestmark = pytest.mark.cluster

CLIENT = """
import json, os, sys
import boto3
import pyarrow as pa, pyarrow.fs as pafs, pyarrow.parquet as pq
bucket = sys.argv[1]
s3 = boto3.client("s3")  # endpoint, credentials and region come from the environment only
s3.put_object(Bucket=bucket, Key="raw/hello.txt", Body=b"hello minio")
got = s3.get_object(Bucket=bucket, Key="raw/hello.txt")["Body"].read().decode()
# pyarrow reads the credentials and region from the environment but not the endpoint
# (apache/arrow#49643), so the endpoint comes from the same variable boto3 uses.
fs = pafs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"])
pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["x", "y"]}), f"{bucket}/data/train.parquet", filesystem=fs)
table = pq.read_table(f"{bucket}/data/train.parquet", filesystem=fs)
listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
infos = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(bucket, recursive=True))
               if i.type == pafs.FileType.File)
print(json.dumps({"got": got, "rows": table.num_rows, "listed": listed, "infos": infos}))
"""


def test_boto3_and_pyarrow_with_only_cluster_env(cluster, s3_bucket):
    env = {"HOME": "/root", **load_env_file(cluster.cfg.env_file)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CLIENT), s3_bucket], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["got"] == "hello minio"
    assert res["rows"] == 2
    assert res["listed"] == ["data/train.parquet", "raw/hello.txt"]
    assert res["infos"] == [f"{s3_bucket}/data/train.parquet", f"{s3_bucket}/raw/hello.txt"]


def test_pod_writes_to_minio(cluster, namespace, s3_bucket):
    """Pods reach MinIO at the same endpoint as the host, with credentials from a Secret."""
    e = cluster.env
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3"},
        "stringData": {"AWS_ACCESS_KEY_ID": e["AWS_ACCESS_KEY_ID"],
                       "AWS_SECRET_ACCESS_KEY": e["AWS_SECRET_ACCESS_KEY"]}})
    script = ("import boto3; "
              f"boto3.client('s3').put_object(Bucket='{s3_bucket}', Key='from-pod.txt', Body=b'hi from pod')")
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "uploader"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "main", "image": localcluster.images.image_refs()["trainer"], "imagePullPolicy": "Never",
            "command": ["python", "-c", script],
            "env": [{"name": "AWS_ENDPOINT_URL", "value": e["AWS_ENDPOINT_URL"]},
                    {"name": "AWS_REGION", "value": "us-east-1"}],
            "envFrom": [{"secretRef": {"name": "s3"}}]}]}})
    p = cluster.wait_pod_phase(namespace, "uploader", ("Succeeded", "Failed"), timeout=120)
    assert p["status"]["phase"] == "Succeeded", cluster.pod_log(namespace, "uploader")
    body = cluster.s3().get_object(Bucket=s3_bucket, Key="from-pod.txt")["Body"].read()
    assert body == b"hi from pod"
