"""Container images built on this machine, without docker: base, pause, operator, trainer.

The local cluster's nodes run real kubelets on containerd; their pods need the operator and
trainer images under the names the chart and the SFTJob CRD default to
(ghcr.io/sftjob/{operator,trainer}:<appVersion>, pullPolicy IfNotPresent) and a pod sandbox
image. Nothing can be pulled here, so every image is made from local inputs:

- base (localhost/sftjob/base:bookworm): mmdebstrap of Debian bookworm from the machine's apt
  sources with python3, python3-venv, ca-certificates and libtcmalloc-minimal4 (the trainer's
  allocator), committed into buildah's storage;
- pause (localhost/sftjob/pause:3.10): images/pause/pause.c built with `gcc -static`, alone in
  an image FROM scratch (containerd's CRI `sandbox_image`);
- operator, trainer: `buildah bud --isolation chroot --layers` of images/<name>/Dockerfile on
  the base (the trainer without flash-attn). The requirements' wheels stay in a cache mount
  under the cache directory, so torch is downloaded once.

Each image is keyed by a hash of its inputs (recipe, Dockerfile, its ignore file, build
arguments, the build context's files that the ignore file lets in, the base image's ID) and
written as an uncompressed docker-archive to
${SFTJOB_CACHE:-~/.cache/sftjob}/images/<name>-<key>.tar, then a stamp <name>-<key>.json;
an image whose stamp exists is not rebuilt. `load(address)` imports the node images into one
containerd (namespace k8s.io), skipping those it already holds with the same config digest
and sending only the layers it lacks (a source edit: one small layer).

    from hack.localcluster import images
    images.build()                                  # {"base": ImageRef, ...}
    images.load("/run/sftjob/node-0/containerd.sock")

CLI: python -m hack.localcluster.images {build [NAME ...] [--rebuild],load --address SOCK,list}

Needs root and these Debian packages: buildah, mmdebstrap, gcc and libc6-dev (pause);
containerd (ctr) for load(). See images/README.md.

Modules: spec (names, refs, recipes, ImageRef), context (.dockerignore rules), keys (input
keys), buildah (the builders), cache (archives, stamps, build(), status()), containerd
(load()), tools (running the tools), cli.
"""
from .cache import build, cached, status
from .containerd import load
from .context import context_files
from .keys import input_key
from .spec import (BASE_REF, BUDS, NAMES, NODE_IMAGES, PAUSE_REF, ROOT, ImageRef, ImagesError,
                   app_version, cache_dir, cache_root, image_refs)
from .tools import need

__all__ = ["BASE_REF", "BUDS", "NAMES", "NODE_IMAGES", "PAUSE_REF", "ROOT", "ImageRef", "ImagesError", "app_version",
           "build", "cache_dir", "cache_root", "cached", "context_files", "image_refs", "input_key", "load", "need",
           "status"]
