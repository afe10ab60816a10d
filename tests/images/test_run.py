"""The images as a node runs them: built (or reused from the cache) by
hack/localcluster/images, imported with load() into a throwaway containerd of this test's
own, and run with ctr and runc as the kubelet's containerd would run them.

Needs root, buildah, mmdebstrap, gcc, containerd, ctr, runc and nsenter; a cold build of the
trainer image takes a while (torch), a warm one seconds."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from hack.localcluster import images
from hack.localcluster.images import containerd as image_load

pytestmark = [pytest.mark.slow, pytest.mark.built]
TOOLS = ("buildah", "mmdebstrap", "gcc", "containerd", "ctr", "runc", "containerd-shim-runc-v2", "nsenter")
CONFIG = """version = 2
root = "{d}/root"
state = "{d}/state"
# Only what `ctr images import` and `ctr run` need: content, overlayfs, runc's shim.
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{d}/c.sock"
# Garbage collection after every change, not after a hundred: a load that leaves what it reuses
# unreferenced for a moment loses it here every time, not once in a few runs.
[plugins."io.containerd.gc.v1.scheduler"]
  mutation_threshold = 1
  deletion_threshold = 1
  schedule_delay = "0s"
  startup_delay = "0s"
"""


def _missing() -> list[str]:
    return [t for t in TOOLS if not shutil.which(t)]


@pytest.fixture(scope="module")
def built() -> dict[str, images.ImageRef]:
    missing = _missing()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: buildah mmdebstrap gcc libc6-dev containerd runc util-linux)")
    if os.geteuid() != 0:
        pytest.skip("needs root (buildah's storage, containerd)")
    return images.build()


@pytest.fixture(scope="module")
def containerd(built):
    """A containerd of this module's own (a short path: its socket's name must fit in 108 bytes).
    Those an interrupted run left behind (GBs of snapshots each) go first."""
    _remove_abandoned_roots()
    d = Path(tempfile.mkdtemp(prefix="sftjob-ctrd-"))
    (d / "config.toml").write_text(CONFIG.format(d=d))
    log = (d / "containerd.log").open("w")
    proc = subprocess.Popen(["containerd", "--config", str(d / "config.toml")], stdout=log, stderr=subprocess.STDOUT)
    address = str(d / "c.sock")
    deadline = time.monotonic() + 30
    while subprocess.run(["ctr", "--address", address, "version"], capture_output=True).returncode != 0:
        assert proc.poll() is None, (d / "containerd.log").read_text()
        assert time.monotonic() < deadline, (d / "containerd.log").read_text()
        time.sleep(0.2)
    try:
        yield address
    finally:
        for task in ctr(address, "task", "ls", "-q").split():
            subprocess.run(["ctr", "--address", address, "-n", "k8s.io", "task", "kill", "-s", "SIGKILL", task],
                           capture_output=True)
        for c in ctr(address, "containers", "ls", "-q").split():
            subprocess.run(["ctr", "--address", address, "-n", "k8s.io", "task", "rm", "-f", c], capture_output=True)
            subprocess.run(["ctr", "--address", address, "-n", "k8s.io", "containers", "rm", c], capture_output=True)
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        _remove_root(d)


def _remove_root(d: Path) -> None:
    """A stopped containerd's root: its leftover mounts (deepest first) detached, then its files."""
    mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
    for m in sorted((m for m in mounts if m.startswith(str(d))), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def _remove_abandoned_roots() -> None:
    """The roots of this module's containerds that no running containerd uses any more."""
    def cmdline(p: Path) -> str:
        try:
            return p.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            return ""
    running = " ".join(cmdline(p) for p in Path("/proc").glob("[0-9]*/cmdline"))
    for d in Path(tempfile.gettempdir()).glob("sftjob-ctrd-*"):
        if str(d) not in running:
            _remove_root(d)


def ctr(address: str, *args: str, timeout: float = 120) -> str:
    res = subprocess.run(["ctr", "--address", address, "-n", "k8s.io", *args], capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"ctr {' '.join(args)}: {res.stdout}{res.stderr}"
    return res.stdout


# The trainer image (5.5 GB, minutes to import) is left out: every cluster test runs it in a
# pod, and the demo checks its image ID and its uid from inside one (tests/demo).
LOADED = ("operator", "pause")


@pytest.fixture(scope="module")
def loaded(containerd, built):
    first = images.load(containerd, names=LOADED)
    return containerd, first


def run(address: str, ref: str, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run cmd in a new container of ref as its image configures it (user, env, workdir)."""
    return subprocess.run(["ctr", "--address", address, "-n", "k8s.io", "run", "--rm", ref,
                           f"t-{uuid.uuid4().hex[:10]}", *cmd], capture_output=True, text=True, timeout=timeout)


PROBE = ("import json, os, importlib.util as u; print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), "
         "'home': os.environ.get('HOME'), 'cwd': os.getcwd(), "
         "'found': {m: u.find_spec(m) is not None "
         "for m in ('torch', 'sftjob_contract', 'sftjob_operator', 'sftjob_trainer')}}))")


def probe(address: str, ref: str, extra: str = "") -> dict:
    res = run(address, ref, "python3", "-c", extra + PROBE)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_load_imports_once_then_skips(loaded, built):
    address, first = loaded
    assert first == dict.fromkeys(LOADED, "imported")
    assert {built[n].ref for n in LOADED} <= set(image_load._ready_images(address, "k8s.io"))
    # unpacked, their layer blobs left the content store: a node holds each layer once
    layers = {d for n in LOADED for d, _ in image_load._archive_layers(built[n].archive)[1]}
    assert not layers & set(ctr(address, "content", "ls", "-q").split())
    started = time.monotonic()
    again = images.load(address, names=LOADED)
    assert again == dict.fromkeys(LOADED, "present")
    assert time.monotonic() - started < 30


def test_operator_image_runs_the_operator_without_torch_as_65532(loaded, built):
    address, _ = loaded
    out = probe(address, built["operator"].ref, "import sftjob_operator.cli, sftjob_contract.config; ")
    assert (out["uid"], out["gid"]) == (65532, 65532)
    assert out["found"] == {"torch": False, "sftjob_contract": True, "sftjob_operator": True, "sftjob_trainer": False}
    # The entrypoint the chart's Deployment runs (its args: --all-namespaces --log-format=json).
    res = run(address, built["operator"].ref, "sftjob-operator", "--help")
    assert res.returncode == 0 and "--leader-elect" in res.stdout, res.stdout + res.stderr


def _task_pid(address: str, cid: str) -> int | None:
    for line in ctr(address, "task", "ls").splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == cid and fields[2] == "RUNNING":
            return int(fields[1])
    return None


def _start_pause(address: str, ref: str) -> tuple[str, subprocess.Popen, int]:
    cid = f"pause-{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen(["ctr", "--address", address, "-n", "k8s.io", "run", "--rm", ref, cid],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while (pid := _task_pid(address, cid)) is None:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return cid, proc, pid


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_pause_image_sleeps_until_a_stop_signal(loaded, built, sig):
    address, _ = loaded
    cid, proc, pid = _start_pause(address, built["pause"].ref)
    try:
        time.sleep(1)
        assert proc.poll() is None, "pause exited on its own"
        assert Path(f"/proc/{pid}/status").read_text().count("Uid:\t65535") == 1
        ctr(address, "task", "kill", "-s", sig, cid)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            ctr(address, "task", "kill", "-s", "SIGKILL", cid)
            proc.wait(timeout=10)


def _children(pid: int) -> dict[int, str]:
    """pid -> state of the processes whose parent is pid."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, ppid = text.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid:
            out[int(stat.parent.name)] = state
    return out


def test_pause_image_reaps_orphans(loaded, built):
    """An orphan of the pod's PID namespace is re-parented to the pause process, PID 1 there;
    when it exits, pause must reap it instead of leaving a zombie."""
    address, _ = loaded
    cid, proc, pid = _start_pause(address, built["pause"].ref)
    try:
        # sh, in the container's PID namespace, leaves a sleep behind and exits.
        subprocess.run(["nsenter", "--target", str(pid), "--pid", "--", "sh", "-c", "sleep 1 & exit 0"], check=True,
                       timeout=10)
        deadline = time.monotonic() + 5
        while not _children(pid):
            assert time.monotonic() < deadline, "the orphan was not re-parented to pause"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while (kids := _children(pid)):
            assert time.monotonic() < deadline, f"not reaped: {kids}"
            time.sleep(0.1)
        ctr(address, "task", "kill", "-s", "SIGTERM", cid)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            ctr(address, "task", "kill", "-s", "SIGKILL", cid)
            proc.wait(timeout=10)


def derived_archive(src: Path, dst: Path, ref: str, files: dict[str, bytes]) -> tuple[str, int]:
    """A docker-archive of src's image plus one layer holding `files`, named ref, as buildah
    would write it; returns its image ID and the new layer's size."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    layer_hex = hashlib.sha256(layer_bytes).hexdigest()
    with tarfile.open(src) as old, tarfile.open(dst, "w") as new:
        entry = json.load(old.extractfile("manifest.json"))[0]
        config = json.load(old.extractfile(entry["Config"]))
        config["rootfs"]["diff_ids"].append("sha256:" + layer_hex)
        config.setdefault("history", []).append({"created_by": "tests/images: one more layer"})
        config_bytes = json.dumps(config).encode()
        config_hex = hashlib.sha256(config_bytes).hexdigest()
        for name in entry["Layers"]:
            member = old.getmember(name)
            new.addfile(member, old.extractfile(member))

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            new.addfile(info, io.BytesIO(data))

        add(f"{layer_hex}.tar", layer_bytes)
        add(f"{config_hex}.json", config_bytes)
        add("manifest.json", json.dumps([{"Config": f"{config_hex}.json", "RepoTags": [ref],
                                          "Layers": [*entry["Layers"], f"{layer_hex}.tar"]}]).encode())
    return "sha256:" + config_hex, len(layer_bytes)


def test_load_sends_only_the_layers_a_node_lacks(loaded, built, tmp_path):
    """A source edit changes an image's last, small layer; importing it must not stream the GBs
    below it again (the node holds them)."""
    address, _ = loaded
    assert image_load._import(address, "k8s.io", built["operator"], None) == 0
    ref = f"localhost/sftjob/derived:{uuid.uuid4().hex[:8]}"
    archive = tmp_path / "derived.tar"
    image_id, layer_size = derived_archive(built["operator"].archive, archive, ref, {"derived.txt": b"top layer\n"})
    img = dataclasses.replace(built["operator"], name="derived", ref=ref, archive=archive, image_id=image_id,
                              size=archive.stat().st_size)
    try:
        assert image_load._import(address, "k8s.io", img, None) == layer_size
        ready = image_load._ready_images(address, "k8s.io")
        assert image_load._config_digest(address, "k8s.io", ready[ref]) == image_id
        res = run(address, ref, "python3", "-c", "import os; print(os.getuid(), open('/derived.txt').read(), end='')")
        assert res.returncode == 0 and res.stdout == "65532 top layer\n", res.stdout + res.stderr
    finally:
        subprocess.run(["ctr", "--address", address, "-n", "k8s.io", "images", "rm", ref], capture_output=True)


def test_a_cluster_load_removes_earlier_builds_and_their_tags(loaded, built, tmp_path):
    """An earlier build of a node image (same ref, other content) and another tag of it are
    removed by a pruning load, with their layers: otherwise every change of the trainer's
    requirements leaves another 5 GB on each node's disk. A plain load removes nothing."""
    address, _ = loaded
    op = built["operator"]
    archive = tmp_path / "earlier.tar"
    old_id, _ = derived_archive(op.archive, archive, op.ref, {"earlier.txt": b"an earlier build\n"})
    earlier = dataclasses.replace(op, archive=archive, image_id=old_id, size=archive.stat().st_size)
    image_load._import(address, "k8s.io", earlier, None)
    old_manifest = image_load._ready_images(address, "k8s.io")[op.ref]
    tag = f"registry.example/sftjob/operator:{uuid.uuid4().hex[:8]}"
    ctr(address, "images", "tag", op.ref, tag)
    blobs_before = set(ctr(address, "content", "ls", "-q").split())
    assert old_manifest in blobs_before

    assert images.load(address, names=["operator"]) == {"operator": "imported"}
    assert tag in ctr(address, "images", "ls", "-q").split()  # no prune: the tag stays

    ctr(address, "images", "tag", "--force", tag, op.ref)  # back to the earlier build under its ref
    assert images.load(address, names=LOADED, prune=True)["operator"] == "imported"
    refs = ctr(address, "images", "ls", "-q").split()
    assert tag not in refs and op.ref in refs
    ready = image_load._ready_images(address, "k8s.io")
    assert image_load._config_digest(address, "k8s.io", ready[op.ref]) == op.image_id
    assert old_manifest not in set(ctr(address, "content", "ls", "-q").split())  # freed, not just untagged
    # the other image loaded here was not touched
    assert {built[n].ref for n in LOADED} <= set(refs)
