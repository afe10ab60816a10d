"""Put what examples/sftjob.yaml needs into the local cluster (`make example-assets NAMESPACE=ns`).

- the tiny model and parquet data (`python -m tools.assets`, made once under
  .assets/tiny) uploaded to s3://sftjob-examples/{models/tiny,data/} in the cluster's MinIO,
  with the trainer's own S3 client (sftjob_trainer.storage);
- the Secret `sftjob-s3` (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) in the namespace,
  which the example references through spec.storage.credentialsSecretRef.

It reads the cluster from the environment, as kubectl and every S3 client do
(`source .cluster/env`, which `make cluster-up` writes; make does that); nothing is printed.

    python -m examples.assets --namespace NS      # from the checkout's root
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
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# Where each local directory goes in the bucket (examples/sftjob.yaml reads these).
PREFIXES = (("model", "models/tiny"), ("data", "data"))


def have_local_assets(root: Path) -> bool:
    """Complete assets under ``root``: chat_val.parquet is the last file tools.assets writes."""
    return (root / "model" / "config.json").is_file() and (root / "data" / "chat_val.parquet").is_file()


def make_local_assets(root: Path) -> Path:
    """The tiny model and data under ``root``, made once (quietly: their progress bars are noise here)."""
    if not have_local_assets(root):
        subprocess.run([sys.executable, "-m", "tools.assets", str(root)], check=True, capture_output=True, cwd=REPO)
    return root


def upload(root: Path, bucket: str = BUCKET) -> None:
    """``root``/model and ``root``/data into the bucket (created if missing), through the
    trainer's S3 client, which reads AWS_ENDPOINT_URL and the credentials from the environment."""
    from sftjob_trainer.storage import S3Prefix

    store = S3Prefix(f"s3://{bucket}")
    if bucket not in {b["Name"] for b in store.client.list_buckets().get("Buckets", [])}:
        store.client.create_bucket(Bucket=bucket)
    for local, prefix in PREFIXES:
        store.upload_dir(root / local, prefix)


def secret_manifest(namespace: str, env: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": SECRET, "namespace": namespace},
        "stringData": {k: env[k] for k in CREDENTIALS},
    }


def apply_secret(namespace: str, env: dict[str, str]) -> None:
    """kubectl apply, with ``env`` (KUBECONFIG, PATH to kubectl, the credentials) as its environment."""
    subprocess.run(["kubectl", "apply", "-f", "-"], input=json.dumps(secret_manifest(namespace, env)),
                   text=True, check=True, env=env, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", required=True)
    p.add_argument("--assets", default=str(REPO / ".assets" / "tiny"))
    args = p.parse_args(argv)
    missing = [k for k in ("AWS_ENDPOINT_URL", "KUBECONFIG", *CREDENTIALS) if not os.environ.get(k)]
    if missing:
        sys.exit(f"{', '.join(missing)} not set: `source .cluster/env` (written by `make cluster-up`) first")
    root = make_local_assets(Path(args.assets))
    upload(root)
    apply_secret(args.namespace, dict(os.environ))
    print(f"s3://{BUCKET}/models/tiny and s3://{BUCKET}/data ready; Secret {args.namespace}/{SECRET} applied")
    return 0


if __name__ == "__main__":
    sys.exit(main())
