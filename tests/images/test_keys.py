"""hack/localcluster/images without building anything: which inputs an image's cache key
covers, the .dockerignore rules that decide what is in a build context, the cache's stamps,
the errors for missing tools, and the OCI layout load() streams to ctr."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from hack.localcluster import images
from hack.localcluster.images import cache, containerd, spec
from hack.localcluster.images import keys as input_keys

pytestmark = pytest.mark.unit
REPO = images.ROOT
BASE_ID = "sha256:" + "b" * 64


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A copy of what the images are built from (sources, Dockerfiles, chart), plus a few
    files no image contains."""
    root = tmp_path / "repo"
    for rel in ("pyproject.toml", "README.md", "charts/sftjob-operator/Chart.yaml", "images",
                "contract/sftjob_contract", "operator/sftjob_operator", "trainer/sftjob_trainer"):
        src, dst = REPO / rel, root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("def test(): pass\n")
    (root / "trainer" / "notes.md").write_text("not in the distribution\n")
    # The pause image's key includes the compiler's identity; it is not what is tested here.
    monkeypatch.setattr(input_keys, "_gcc_identity", lambda: "12.2.0 x86_64-linux-gnu")
    return root


def keys(root: Path, base_id: str = BASE_ID) -> dict[str, str]:
    return {n: images.input_key(n, root=root, base_id=base_id if n in images.BUDS else None) for n in images.NAMES}


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {n for n in before if before[n] != after[n]}


def test_keys_are_stable_and_distinct(repo):
    first = keys(repo)
    assert keys(repo) == first
    assert len(set(first.values())) == len(first)
    assert all(len(k) == 16 and int(k, 16) >= 0 for k in first.values())


def test_a_package_source_changes_the_images_that_hold_it(repo):
    """Both images hold the contract, each its own package besides: a contract edit remakes
    both, an operator or trainer edit only its image."""
    before = keys(repo)
    config = repo / "contract" / "sftjob_contract" / "config.py"
    config.write_text(config.read_text() + "\n# edited\n")
    assert changed(before, keys(repo)) == {"operator", "trainer"}
    before = keys(repo)
    cli = repo / "operator" / "sftjob_operator" / "cli.py"
    cli.write_text(cli.read_text() + "\n# edited\n")
    assert changed(before, keys(repo)) == {"operator"}
    before = keys(repo)
    (repo / "trainer" / "sftjob_trainer" / "new_module.py").write_text("X = 1\n")
    assert changed(before, keys(repo)) == {"trainer"}


def test_the_executable_bit_is_an_input(repo):
    before = keys(repo)
    os.chmod(repo / "trainer" / "sftjob_trainer" / "launch.py", 0o755)
    assert changed(before, keys(repo)) == {"trainer"}


def test_files_outside_the_context_change_nothing(repo):
    before = keys(repo)
    (repo / "tests" / "test_x.py").write_text("def test(): assert 0\n")
    (repo / "trainer" / "notes.md").write_text("edited\n")
    cache = repo / "trainer" / "sftjob_trainer" / "__pycache__"
    cache.mkdir()
    (cache / "launch.cpython-311.pyc").write_bytes(b"\0" * 16)
    (repo / "images" / "README.md").write_text("docs\n")
    assert changed(before, keys(repo)) == set()


def test_trainer_only_inputs_leave_the_operator_key(repo):
    before = keys(repo)
    dockerfile = repo / "images" / "trainer" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "\n# edited\n")
    assert changed(before, keys(repo)) == {"trainer"}
    before = keys(repo)
    ignore = repo / "images" / "trainer" / "Dockerfile.dockerignore"
    ignore.write_text(ignore.read_text() + "trainer/notes.md\n")
    assert changed(before, keys(repo)) == {"trainer"}


def test_operator_only_inputs_leave_the_trainer_key(repo):
    before = keys(repo)
    dockerfile = repo / "images" / "operator" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "\n# edited\n")
    assert changed(before, keys(repo)) == {"operator"}


def test_pyproject_is_an_input_the_readme_is_not(repo):
    """The images get a stub README (pyproject.toml's `readme`), so a docs edit remakes nothing."""
    before = keys(repo)
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n")
    assert changed(before, keys(repo)) == {"operator", "trainer"}
    before = keys(repo)
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nedited\n")
    assert changed(before, keys(repo)) == set()


def test_pause_source_changes_only_pause(repo):
    before = keys(repo)
    src = repo / spec.PAUSE_SOURCE
    src.write_text(src.read_text() + "\n/* edited */\n")
    assert changed(before, keys(repo)) == {"pause"}


def test_a_new_base_remakes_the_python_images(repo):
    assert changed(keys(repo), keys(repo, base_id="sha256:" + "c" * 64)) == {"operator", "trainer"}
    with pytest.raises(ValueError, match="base image's ID"):
        images.input_key("operator", root=repo)


def test_the_tag_is_an_input(repo):
    """The archive carries the image's name, so a new appVersion is a new image."""
    before = keys(repo)
    chart = repo / "charts" / "sftjob-operator" / "Chart.yaml"
    chart.write_text(chart.read_text().replace('appVersion: "0.1.0"', 'appVersion: "0.2.0"'))
    assert images.image_refs(repo)["operator"] == "ghcr.io/sftjob/operator:0.2.0"
    assert changed(before, keys(repo)) == {"operator", "trainer"}


def test_the_base_recipe_and_apt_sources_are_inputs(repo, tmp_path, monkeypatch):
    sources = tmp_path / "debian.sources"
    sources.write_text("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n")
    monkeypatch.setenv("SFTJOB_APT_SOURCES", str(sources))
    before = keys(repo)
    sources.write_text(sources.read_text().replace("main", "main contrib"))
    assert changed(before, keys(repo)) == {"base"}
    monkeypatch.setattr(input_keys, "MMDEBSTRAP_OPTS", (*spec.MMDEBSTRAP_OPTS, "--include=tini"))
    assert changed(before, keys(repo)) == {"base"}


# ------------------------------------------------------------------------ the build context

def tree(root: Path, files: list[str]) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    return root


def test_ignore_rules_follow_dockerignore(tmp_path):
    root = tree(tmp_path / "ctx", ["a.txt", "pyproject.toml", "pkg/mod.py", "pkg/sub/x.py",
                                   "pkg/__pycache__/mod.pyc", "pkg/sub/__pycache__/x.pyc", "other/pkg/y.py",
                                   "docs/a.md", "docs/keep.md", "logs/1.log", "logs/sub/2.log", "data.csv"])
    ignore = tmp_path / "ignore"
    ignore.write_text("# comment\n*\n!pyproject.toml\n!pkg/**\n**/__pycache__\n!docs/keep.md\n\n")
    assert images.context_files(root, ignore) == ["docs/keep.md", "pkg/mod.py", "pkg/sub/x.py", "pyproject.toml"]
    # Without a leading `*`: only the named things go; a directory pattern takes its contents.
    ignore.write_text("logs\n*.csv\n/a.txt\n**/__pycache__\nother/*/y.py\n")
    assert images.context_files(root, ignore) == ["docs/a.md", "docs/keep.md", "pkg/mod.py", "pkg/sub/x.py",
                                                   "pyproject.toml"]
    # ? and classes stay within one segment.
    ignore.write_text("*\n!docs/[a-k]*.md\n")
    assert images.context_files(root, ignore) == ["docs/a.md", "docs/keep.md"]
    ignore.write_text("*\n!docs/?.md\n!?/mod.py\n")
    assert images.context_files(root, ignore) == ["docs/a.md"]
    ignore.write_text("*\n!docs/[^k]*.md\n")
    assert images.context_files(root, ignore) == ["docs/a.md"]


def test_the_real_contexts_hold_the_distribution_only():
    """What the Dockerfiles' COPY lines can see: pyproject.toml, the contract and the image's own
    package (the operator's context has no trainer), without bytecode (compared with git's
    list of those packages)."""
    for name, bud in images.BUDS.items():
        packages = ["contract/sftjob_contract", f"{name}/sftjob_{name}"]
        tracked = subprocess.run(["git", "ls-files", *packages], cwd=REPO,
                                 capture_output=True, text=True, check=True).stdout.split()
        files = images.context_files(REPO, REPO / bud.ignorefile)
        assert "pyproject.toml" in files and "README.md" not in files, name
        rest = [f for f in files if f != "pyproject.toml"]
        assert all(f.startswith(tuple(p + "/" for p in packages)) for f in rest), rest
        assert not any("__pycache__" in f for f in rest)
        assert set(tracked) <= set(rest), set(tracked) - set(rest)


# -------------------------------------------------------------------------------- the cache

def fake_image(cache: Path, name: str, key: str, payload: bytes = b"archive") -> images.ImageRef:
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"{name}-{key}.tar"
    archive.write_bytes(payload)
    img = images.ImageRef(name=name, ref=f"localhost/x/{name}:1", key=key, archive=archive,
                          image_id="sha256:" + "d" * 64, size=len(payload), built_at=0.0, build_seconds=1.0)
    (cache / f"{name}-{key}.json").write_text(json.dumps(img.to_json()))
    return img


def test_a_cached_image_needs_its_stamp_and_its_whole_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("SFTJOB_CACHE", str(tmp_path))
    cache = images.cache_dir()
    assert cache == tmp_path / "images"
    img = fake_image(cache, "pause", "0123456789abcdef")
    assert images.cached("pause", "0123456789abcdef") == img
    assert images.cached("pause", "fedcba9876543210") is None
    img.archive.write_bytes(b"arch")  # cut short
    assert images.cached("pause", "0123456789abcdef") is None
    img.archive.write_bytes(b"archive")
    (cache / "pause-0123456789abcdef.json").unlink()  # the stamp is written last
    assert images.cached("pause", "0123456789abcdef") is None


def test_missing_tools_name_their_debian_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    for tool, package in (("buildah", "buildah"), ("mmdebstrap", "mmdebstrap"), ("ctr", "containerd"),
                          ("gcc", "gcc libc6-dev")):
        with pytest.raises(images.ImagesError, match=f"apt-get install {package}"):
            images.need(tool)


def test_unknown_image_names_are_refused():
    with pytest.raises(images.ImagesError, match="unknown image 'nope'"):
        cache._with_dependencies(["nope"])
    assert cache._with_dependencies(["trainer"]) == ["base", "trainer"]
    assert cache._with_dependencies(["pause", "operator"]) == ["base", "pause", "operator"]


def test_refs_default_to_the_chart_and_crd_defaults():
    refs = images.image_refs()
    values = (REPO / "charts" / "sftjob-operator" / "values.yaml").read_text()
    assert refs["trainer"] in values and refs["trainer"] in (REPO / "crds" / "sftjob.io_sftjobs.yaml").read_text()
    assert refs["operator"].rsplit(":", 1)[0] in values
    assert refs["operator"].endswith(":" + images.app_version())


# ------------------------------------------------------------------ the layout load() sends

def docker_archive(path: Path, ref: str, layers: list[bytes]) -> tuple[bytes, list[str]]:
    """A docker-archive as buildah writes one (layers named by their digest); returns the
    config and the layer digests."""
    digests = ["sha256:" + hashlib.sha256(data).hexdigest() for data in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/x"]},
                         "rootfs": {"type": "layers", "diff_ids": digests}}).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for d, data in zip(digests, layers):
            add(d.removeprefix("sha256:") + ".tar", data)
        add(config_name, config)
        add("manifest.json", json.dumps([{"Config": config_name, "RepoTags": [ref],
                                          "Layers": [d.removeprefix("sha256:") + ".tar" for d in digests]}]).encode())
    return config, digests


def test_the_oci_layout_names_the_image_and_leaves_out_the_layers_the_node_has(tmp_path):
    archive = tmp_path / "img.tar"
    layers = [b"base layer" * 100, b"requirements" * 1000, b"sources"]
    config, digests = docker_archive(archive, "ghcr.io/sftjob/x:1", layers)
    out = io.BytesIO()
    sent = containerd._oci_layout(archive, "ghcr.io/sftjob/x:1", {digests[0], digests[1], "sha256:" + "e" * 64}, out)
    assert sent == len(layers[2])
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    (entry,) = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "ghcr.io/sftjob/x:1"
    manifest_blob = files["blobs/sha256/" + entry["digest"].removeprefix("sha256:")]
    assert hashlib.sha256(manifest_blob).hexdigest() == entry["digest"].removeprefix("sha256:")
    manifest = json.loads(manifest_blob)
    # The config travels byte for byte: the image ID is the one buildah built.
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(config).hexdigest()
    assert files["blobs/sha256/" + hashlib.sha256(config).hexdigest()] == config
    assert [(x["digest"], x["size"]) for x in manifest["layers"]] == list(zip(digests, map(len, layers)))
    # Only the layer the node lacks is in the stream.
    blobs = {n for n in files if n.startswith("blobs/")}
    assert blobs == {"blobs/sha256/" + h for h in (entry["digest"][7:], hashlib.sha256(config).hexdigest(),
                                                   digests[2][7:])}
    assert files["blobs/sha256/" + digests[2][7:]] == layers[2]
