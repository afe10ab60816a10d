"""What the images are: their names and references, the base and pause recipes, the
Dockerfiles built on the base, the cache's location, and the record of one built image."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from collections.abc import Mapping

ROOT = Path(__file__).resolve().parents[3]
NAMES = ("base", "pause", "operator", "trainer")
# What a node's containerd needs (the base is only built upon).
NODE_IMAGES = ("pause", "operator", "trainer")
# Bump when this package builds an image differently from the same inputs.
RECIPE = "1"

BASE_REF = "localhost/sftjob/base:bookworm"
PAUSE_REF = "localhost/sftjob/pause:3.10"
SUITE = "bookworm"
# libtcmalloc-minimal4: the trainer's allocator (sftjob_trainer.launch preloads it; issue 30).
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libtcmalloc-minimal4")
# minbase: Essential and Priority: required, plus apt. The merged-usr hook lays out /usr
# itself instead of installing usrmerge (which would pull in perl). Documentation, manual
# pages, locales and apt's lists stay out; /dev is the runtime's business.
MMDEBSTRAP_OPTS = (
    "--variant=minbase",
    "--include=" + ",".join(BASE_PACKAGES),
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    "--skip=output/dev",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/* \"$1\"/var/log/*",
)
BASE_CONFIG = (
    "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "--env", "LANG=C.UTF-8",
    "--cmd", "/bin/bash",
    "--label", "org.opencontainers.image.title=sftjob-base",
    "--label", f"org.opencontainers.image.description=Debian {SUITE} minbase with " + " ".join(BASE_PACKAGES),
)
PAUSE_SOURCE = "images/pause/pause.c"
PAUSE_CFLAGS = ("-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror")
PAUSE_CONFIG = (
    "--entrypoint", '["/pause"]',
    "--cmd", "",
    "--user", "65535:65535",
    "--label", "org.opencontainers.image.title=sftjob-pause",
    "--label", "org.opencontainers.image.description=Pod sandbox: sleeps until SIGTERM/SIGINT, reaps zombies",
)


@dataclasses.dataclass(frozen=True)
class Bud:
    """A Dockerfile built with `buildah bud` from the repository root, on the base image."""

    dockerfile: str
    build_args: Mapping[str, str]

    @property
    def ignorefile(self) -> str:
        return self.dockerfile + ".dockerignore"


_BASE_IMAGE, _BASE_TAG = BASE_REF.rsplit(":", 1)
BUDS = {
    "operator": Bud("images/operator/Dockerfile", {"BASE_IMAGE": _BASE_IMAGE, "BASE_TAG": _BASE_TAG}),
    # The CPU/local variant: both stages on the base, no flash-attn (so no nvcc), and the stage
    # that installed the requirements as the runtime's parent (RUNTIME_FLAVOR: no venv copy).
    # RUNTIME_FLAVOR is always passed: buildah 1.28 does not resolve an ARG's default that names
    # a stage ("runtime-gpu: image not known").
    "trainer": Bud("images/trainer/Dockerfile",
                   {"BUILD_IMAGE": _BASE_IMAGE, "BUILD_TAG": _BASE_TAG, "RUNTIME_IMAGE": _BASE_IMAGE,
                    "RUNTIME_TAG": _BASE_TAG, "FLASH_ATTN_VERSION": "", "LIGER_KERNEL_VERSION": "",
                    "RUNTIME_FLAVOR": "runtime-cpu"}),
}

HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class ImagesError(RuntimeError):
    """A build or load that cannot proceed; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One built image: its name in the cluster, the archive that holds it and its ID."""

    name: str            # base, pause, operator, trainer
    ref: str             # e.g. ghcr.io/sftjob/operator:0.1.0
    key: str             # hash of the inputs
    archive: Path        # docker-archive (uncompressed)
    image_id: str        # sha256:<config digest>, the same in buildah and containerd
    size: int            # bytes of the archive
    built_at: float      # epoch seconds
    build_seconds: float

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "archive": str(self.archive)}

    @classmethod
    def from_json(cls, data: dict) -> ImageRef:
        return cls(**{**data, "archive": Path(data["archive"])})



def cache_root() -> Path:
    """${SFTJOB_CACHE:-~/.cache/sftjob}: the binaries, images and node stores of the local cluster."""
    return Path(os.environ.get("SFTJOB_CACHE") or Path.home() / ".cache" / "sftjob")


def cache_dir() -> Path:
    """cache_root()/images: archives, stamps, logs, pip's cache."""
    return cache_root() / "images"


def app_version(root: Path = ROOT) -> str:
    """The chart's appVersion (the tag the chart and the SFTJob defaults use)."""
    chart = root / "charts" / "sftjob-operator" / "Chart.yaml"
    m = re.search(r'^appVersion:\s*"?([^"\s]+)"?\s*$', chart.read_text(), re.M)
    if not m:
        raise ImagesError(f"no appVersion in {chart}")
    return m.group(1)


def image_refs(root: Path = ROOT, operator: str | None = None, trainer: str | None = None) -> dict[str, str]:
    """Name -> image reference; operator and trainer default to ghcr.io/sftjob/<name>:<appVersion>
    (what charts/chart.mk calls OPERATOR_IMAGE and TRAINER_IMAGE)."""
    tag = app_version(root)
    return {"base": BASE_REF, "pause": PAUSE_REF,
            "operator": operator or f"ghcr.io/sftjob/operator:{tag}",
            "trainer": trainer or f"ghcr.io/sftjob/trainer:{tag}"}

