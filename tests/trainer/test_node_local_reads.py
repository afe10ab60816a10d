"""What a node downloads: the model's weights only where rank 0 runs, and of a checkpoint
only the chunks its ranks load (issue 23, item 5), on a real MinIO and real trainer runs."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from . import runner
from .test_object_storage import BUCKET, minio, remote_metrics, s3_args  # noqa: F401 - minio: the fixture

pytestmark = pytest.mark.cluster  # needs the MinIO binary that hack/ builds

DOWNLOADED = re.compile(r"downloaded (\d+) bytes in (\d+) (?:files|ranges) from (\S+) to")


def downloads(output: str) -> dict[str, int]:
    """{s3 URI (a file, or a prefix for whole-file downloads): bytes} from the trainer's log lines."""
    out: dict[str, int] = {}
    for size, _, where in DOWNLOADED.findall(output):
        out[where] = out.get(where, 0) + int(size)
    return out


def shard_files(minio, prefix: str) -> tuple[dict[str, int], dict[str, int]]:
    """{shard file: size} of a checkpoint, and {shard file: bytes of the chunks in it that are
    not sharded} (a tensor saved whole, or bytes), which every rank loads."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    s3 = minio.client()
    meta = pickle.load(io.BytesIO(s3.get_object(Bucket=BUCKET, Key=f"{prefix}/.metadata")["Body"].read()))
    files = {k.rsplit("/", 1)[1]: s3.head_object(Bucket=BUCKET, Key=k)["ContentLength"]
             for k in minio.keys(BUCKET, prefix + "/") if k.endswith(".distcp")}
    shared = dict.fromkeys(files, 0)
    for index, info in meta.storage_data.items():
        md = meta.state_dict_metadata[index.fqn]
        if isinstance(md, BytesStorageMetadata) or len(md.chunks) == 1:
            shared[info.relative_path] += info.length
    return files, shared


def node_env(minio, root: Path, node: int) -> dict:
    return minio.env | {"SFTJOB_LOCAL_DIR": str(root / f"node{node}" / "local"),
                        "SFTJOB_MODEL_CACHE": str(root / f"node{node}" / "models")}


def test_model_cache_without_weights_then_completed(minio, monkeypatch, tmp_path, caplog):
    from sftjob_trainer.modelcache import local_model_path, with_weights

    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SFTJOB_MODEL_CACHE", str(tmp_path / "models"))
    uri = f"s3://{BUCKET}/models/tiny"
    remote = {k.rsplit("/", 1)[1] for k in minio.keys(BUCKET, "models/tiny/")}
    assert "model.safetensors" in remote and "tokenizer.json" in remote and "config.json" in remote

    with caplog.at_level(logging.INFO):
        partial = Path(local_model_path(uri, weights=False))
    got = {p.name for p in partial.iterdir() if not p.name.startswith(".")}
    assert got == {n for n in remote if not n.endswith(".safetensors")}, "no weight file, every other file"
    # A second rank of the node finds the copy made.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert local_model_path(uri, weights=False) == str(partial)
    assert "downloaded" not in caplog.text

    with caplog.at_level(logging.INFO):
        assert with_weights(str(partial)) == str(partial)
    assert {p.name for p in partial.iterdir() if not p.name.startswith(".")} == remote
    # Only the missing weights were fetched, not the files already there.
    size = (partial / "model.safetensors").stat().st_size
    assert f"downloaded {size} bytes in 1 files from {uri} to" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert local_model_path(uri) == str(partial)  # rank 0 of the node: complete already
    assert "downloaded" not in caplog.text


def test_two_node_resume_reads_each_nodes_own_shards_and_is_exact(minio, tmp_path):
    """Two simulated nodes (one rank each, disks of their own): the node without rank 0
    downloads no weights, and a resume downloads on each node its rank's shard file and not
    the other's, whole and started before the model is built (the prefetch: the download
    overlaps the build). The resumed run's losses equal an uninterrupted run's."""
    uri, ref_uri = f"s3://{BUCKET}/runs/nodes", f"s3://{BUCKET}/runs/nodes-ref"
    over = {"optim.lr_scheduler": "constant", "trainer.log_freq": 1}
    ref = runner.run(s3_args(ref_uri, **over, **{"trainer.total_training_steps": 6}), tmp_path, nproc=2,
                     extra_env=node_env(minio, tmp_path / "ref", 0))
    assert ref.code == 0, ref.output
    first = runner.run_nodes(s3_args(uri, **over, **{"trainer.total_training_steps": 4}), tmp_path,
                             [node_env(minio, tmp_path / "a", n) for n in (0, 1)])
    assert [r.code for r in first] == [0, 0], "\n".join(r.output for r in first)
    assert list((tmp_path / "a/node0/models").rglob("*.safetensors"))
    assert not list((tmp_path / "a/node1/models").rglob("*.safetensors")), "only rank 0's node reads weights"
    assert list((tmp_path / "a/node1/models").rglob("tokenizer.json"))

    # The next attempt: new pods, new scratch disks.
    nodes = runner.run_nodes(s3_args(uri, **over, **{"trainer.total_training_steps": 6}), tmp_path,
                             [node_env(minio, tmp_path / "b", n) for n in (0, 1)])
    assert [r.code for r in nodes] == [0, 0], "\n".join(r.output for r in nodes)
    assert f"resumed from {uri}/checkpoints/step-4" in nodes[0].output
    step = f"{uri}/checkpoints/step-4"
    files, shared = shard_files(minio, "runs/nodes/checkpoints/step-4")
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"]
    for node, result in enumerate(nodes):
        got = downloads(result.output)
        mine, theirs = f"__{node}_0.distcp", f"__{1 - node}_0.distcp"
        assert got.get(f"{step}/{mine}", 0) == files[mine], (node, got)
        out = result.output
        assert f"prefetching {files[mine]} bytes of checkpoint step-4" in out, out
        assert out.index("prefetching") < out.index(f"from s3://{BUCKET}/models/tiny to"), out  # before the model
        # Of the other rank's file, only the chunks every rank loads (optimizer step counts and
        # settings, which DCP saves once): never that rank's shards.
        assert got.get(f"{step}/{theirs}", 0) <= shared[theirs] < files[theirs] / 2, (node, got, shared)
        assert got.get(step, 0) > 0  # .metadata and trainer_state.json, whole
        assert sum(v for k, v in got.items() if k.startswith(step)) < sum(files.values()) * 0.8, (node, got)
    want = remote_metrics(minio, "runs/nodes-ref")
    got = remote_metrics(minio, "runs/nodes")
    assert [got[s]["loss"] for s in range(1, 7)] == [want[s]["loss"] for s in range(1, 7)]
