"""What an image build leaves in buildah's storage: the stage named as the build cache stays
(the next build reuses it instead of reinstalling the requirements), the layers the image has
beyond it go once the image is archived (the trainer's runtime copy of its requirements is
5.5 GB that nothing reads again). A two-stage Dockerfile on the base stands in for the
trainer's: its cached stage writes random bytes, so a re-run of that stage would show."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from hack.localcluster import images
from hack.localcluster.images import buildah, spec

pytestmark = pytest.mark.slow

DOCKERFILE = """\
FROM {base} AS deps
RUN head -c 262144 /dev/urandom > /requirements
FROM {base}
COPY --from=deps /requirements /requirements
RUN echo {tag} > /project
"""


def storage_diff_ids() -> dict[str, set[str]]:
    out = {}
    for iid in subprocess.run(["buildah", "images", "-a", "-q", "--no-trunc"], capture_output=True, text=True,
                              check=True).stdout.split():
        res = subprocess.run(["buildah", "inspect", "--type", "image", iid.removeprefix("sha256:")],
                             capture_output=True, text=True)
        if res.returncode == 0:
            out[iid] = set(json.loads(res.stdout)["OCIv1"]["rootfs"]["diff_ids"])
    return out


@pytest.fixture
def two_stage(tmp_path, monkeypatch):
    if not shutil.which("buildah") or os.geteuid() != 0:
        pytest.skip("needs root and buildah")
    base = images.build(["base"])["base"]
    tag = uuid.uuid4().hex[:10]
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(DOCKERFILE.format(base=base.ref, tag=tag))
    (tmp_path / "Dockerfile.dockerignore").write_text("*\n")
    name = f"cachetest{tag}"
    monkeypatch.setitem(spec.BUDS, name, spec.Bud(str(dockerfile), {}, cache_stage="deps"))
    yield name, f"localhost/sftjob/{name}:1"
    refs = [f"localhost/sftjob/{name}:1", buildah.cache_stage_ref(name)]
    subprocess.run(["buildah", "rmi", "--force", *refs], capture_output=True)
    subprocess.run(["buildah", "rmi", "--prune"], capture_output=True)


def test_a_build_keeps_its_cache_stage_and_drops_the_layers_above_it(two_stage, tmp_path):
    name, ref = two_stage
    cache = spec.cache_dir()
    log = tmp_path / "build.log"
    (tmp_path / "w1").mkdir()
    first = buildah.build_bud(name, ref, tmp_path / "w1", cache, log, False)
    stage = buildah._diff_ids(buildah.cache_stage_ref(name))
    above = set(buildah._diff_ids(first.removeprefix("sha256:"))) - set(stage)
    assert above, "the image has layers of its own beyond the cached stage"

    assert buildah.drop_layers_above(name, first, log) >= 1
    held = storage_diff_ids()
    assert first not in held
    assert not any(ids & above for ids in held.values()), "a layer above the cached stage is still stored"
    assert buildah._diff_ids(buildah.cache_stage_ref(name)) == stage

    # the next build reuses the stage: its random layer is the same one, not a re-run
    (tmp_path / "w2").mkdir()
    second = buildah.build_bud(name, ref, tmp_path / "w2", cache, log, False)
    assert buildah._diff_ids(buildah.cache_stage_ref(name)) == stage
    assert buildah._diff_ids(second.removeprefix("sha256:"))
