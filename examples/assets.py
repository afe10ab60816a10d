"""Put what examples/sftjob.yaml needs into the local cluster (`make example-assets NAMESPACE=ns`).

- the tiny model and parquet data (`python -m sftjob_trainer.assets`, made once under
  .assets/tiny) uploaded to s3://sftjob-examples/{models/tiny,data/} in the cluster's MinIO;
- the Secret `sftjob-s3` (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) in the namespace,
  which the example references through spec.storage.credentialsSecretRef.

Credentials come from .cluster/env (written by `make cluster-up`); nothing is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKET = "sftjob-examples"
SECRET = "sftjob-s3"


def cluster_env(path: Path = REPO / ".cluster" / "env") -> dict[str, str]:
    if not path.is_file():
        sys.exit(f"{path} not found: start the local cluster first (make cluster-up)")
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = value.strip("'\"").replace("$PATH", os.environ.get("PATH", ""))
    return env


def make_local_assets(out: Path) -> Path:
    if not (out / "model" / "config.json").is_file() or not (out / "data" / "train.parquet").is_file():
        subprocess.run([sys.executable, "-m", "sftjob_trainer.assets", str(out)], check=True)
    return out


def upload(env: dict[str, str], root: Path, bucket: str = BUCKET) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env.get("AWS_REGION"))
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3.create_bucket(Bucket=bucket)
    for local, prefix in ((root / "model", "models/tiny"), (root / "data", "data")):
        for f in sorted(p for p in local.rglob("*") if p.is_file()):
            s3.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(local).as_posix()}")


def secret_manifest(namespace: str, env: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": SECRET, "namespace": namespace},
        "stringData": {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
    }


def apply_secret(namespace: str, env: dict[str, str]) -> None:
    kenv = {**os.environ, **env}
    subprocess.run(["kubectl", "apply", "-f", "-"], input=json.dumps(secret_manifest(namespace, env)),
                   text=True, check=True, env=kenv, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", required=True)
    p.add_argument("--assets", default=str(REPO / ".assets" / "tiny"))
    args = p.parse_args(argv)
    env = cluster_env()
    root = make_local_assets(Path(args.assets))
    upload(env, root)
    apply_secret(args.namespace, env)
    print(f"s3://{BUCKET}/models/tiny and s3://{BUCKET}/data ready; Secret {args.namespace}/{SECRET} applied")
    return 0


if __name__ == "__main__":
    sys.exit(main())
