"""What a 2-node resume reads from S3 and writes to each node's disk (issue 23, item 5).

    python -m bench.node_reads [--hidden 768 --layers 6] [--work DIR]

Makes a Llama-style model of the given size (tools.assets), puts it and the data
in a private MinIO (tests/trainer/minio.py), trains 2 steps of full fine-tuning on two
simulated nodes (one process each, with scratch and model cache of their own, as
tests/trainer/runner.run_nodes starts them), then resumes on two new nodes for one more
step, and prints per node: bytes read from S3 and bytes the model cache and the
checkpoint's restore copy took on disk. Counted by bench/node_reads_site (botocore's
response bodies; allocated blocks), so the trainer code on PYTHONPATH before and after a
change is measured alike: PYTHONPATH=<old tree>/trainer:<old tree>/contract runs the old one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench"


def disk(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.node_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tools.assets import make_model, make_rows, make_tokenizer, write_parquet
    from tests.trainer import runner
    from tests.trainer.minio import MinioServer

    work = args.work or Path(tempfile.mkdtemp(prefix="node-reads-"))
    model = work / "model"
    make_model(model, make_tokenizer(model), seed=0, hidden=args.hidden, layers=args.layers)
    write_parquet(make_rows(256, 1), work / "data" / "train.parquet")
    server = MinioServer(work / "minio")
    server.start()
    try:
        s3 = server.client()
        s3.create_bucket(Bucket=BUCKET)
        for f in sorted(model.iterdir()):
            s3.upload_file(str(f), BUCKET, f"model/{f.name}")
        s3.upload_file(str(work / "data" / "train.parquet"), BUCKET, "data/train.parquet")
        site = str(ROOT / "bench" / "node_reads_site")
        path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)

        def attempt(name: str, steps: int) -> list[dict]:
            envs = [server.env | {"SFTJOB_LOCAL_DIR": str(work / name / f"node{n}" / "local"),
                                  "SFTJOB_MODEL_CACHE": str(work / name / f"node{n}" / "models"),
                                  "PYTHONPATH": path, "NODE_READS_OUT": str(work / name / f"node{n}" / "counts")}
                    for n in (0, 1)]
            trainer_args = [f"{k}={v}" for k, v in {
                "model.path": f"s3://{BUCKET}/model", "data.train_files": f"s3://{BUCKET}/data/train.parquet",
                "data.max_length": 64, "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 2,
                "optim.lr_scheduler": "constant", "trainer.output_dir": f"s3://{BUCKET}/out",
                "trainer.total_training_steps": steps, "trainer.log_freq": 1}.items()]
            results = runner.run_nodes(trainer_args, work, envs, timeout=1800)
            for r in results:
                if r.code != 0:
                    raise SystemExit(r.output[-4000:])
            rows = []
            for n in (0, 1):
                counts = [json.loads(p.read_text()) for p in (work / name / f"node{n}" / "counts").glob("*.json")]
                rows.append({"node": n, "s3_read": sum(c["s3_read"] for c in counts),
                             "model_disk": disk(work / name / f"node{n}" / "models"),
                             "restore_disk": sum(c["restore_disk"] for c in counts)})
            return rows

        attempt("first", 2)
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="out/checkpoints/step-2/")
        checkpoint_bytes = sum(o["Size"] for page in pages for o in page.get("Contents", []))
        resumed = attempt("resume", 3)
    finally:
        server.stop()
    model_bytes = sum(f.stat().st_size for f in model.iterdir())
    print(json.dumps({"model_bytes": model_bytes, "checkpoint_bytes": checkpoint_bytes, "resume": resumed}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
