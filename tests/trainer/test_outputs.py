"""Outputs = a Store + the layout: the same calls for a local directory and a staged (S3-like) one."""
import pytest

from sftjob_contract.layout import METRICS_FILE
from sftjob_trainer.outputs import Outputs
from sftjob_trainer.storage import LocalDir

pytestmark = pytest.mark.unit


@pytest.fixture(params=["in-place", "staged"])
def node(request, tmp_path):
    """Outputs as seen from a node (its own scratch directory when staged)."""
    def on(name: str) -> Outputs:
        store = LocalDir(tmp_path / "out", None if request.param == "in-place" else tmp_path / name)
        return Outputs(store, rank=0, world=1, keep=1, upload_deadline_s=10.0)
    return on


@pytest.fixture
def outputs(node):
    return node("scratch")


def test_write_dir_replaces_the_published_directory(outputs, tmp_path):
    def export(files):
        def write(d):
            for name in files:
                (d / name).parent.mkdir(parents=True, exist_ok=True)
                (d / name).write_text(name)
        return write

    assert outputs.write_dir("hf", export(["final/model.safetensors", "adapter/a.json"])) == f"{tmp_path}/out/hf"
    outputs.write_dir("hf", export(["final/model.safetensors"]))  # a later export without an adapter
    assert outputs.store.list("hf") == {"final/model.safetensors": len("final/model.safetensors")}


def test_metrics_continue_after_a_restart_on_another_node(node):
    first = node("scratch-a")
    first.restore_metrics()
    first.metrics_path.write_text('{"step": 1}\n')
    first.publish_metrics()
    assert first.store.get_bytes(METRICS_FILE) == b'{"step": 1}\n'
    again = node("scratch-b")
    again.restore_metrics()
    assert again.metrics_path.read_text() == '{"step": 1}\n'


def test_scan_cache_round_trip_and_unreadable_entry(outputs):
    assert outputs.get("scan-train-x.npz") is None
    outputs.put("scan-train-x.npz", b"\x00\x01")
    assert outputs.get("scan-train-x.npz") == b"\x00\x01"
    assert outputs.store.list("cache") == {"scan-train-x.npz": 2}
