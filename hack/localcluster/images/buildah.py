"""The builders: each leaves its image under its ref in buildah's storage and returns the
image ID. The base is mmdebstrap's root file system added to an empty image, the pause image
one static binary; the operator and trainer are `buildah bud` of their Dockerfiles."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from collections.abc import Callable

from .keys import apt_sources
from .spec import (BASE_CONFIG, BUDS, HOST_CA_BUNDLE, MMDEBSTRAP_OPTS, PAUSE_CFLAGS, PAUSE_CONFIG, PAUSE_SOURCE, ROOT,
                   SUITE, ImageRef)
from .tools import log, need, run


def buildah_env(cache: Path) -> dict[str, str]:
    # buildah keeps RUN --mount=type=cache directories under $TMPDIR/buildah-cache/<target>:
    # under the cache directory, pip's cache outlives reboots and goes with `rm -rf` of it.
    tmp = cache / "buildah-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def _storage_image_id(ref: str) -> str | None:
    res = subprocess.run([need("buildah"), "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref],
                         capture_output=True, text=True)
    return "sha256:" + res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


def drop_previous_build(ref: str, logfile: Path) -> None:
    """Remove the image `ref` names in buildah's storage before it is built again. Only its own
    top layers go (for the trainer, the 5 GB copy of the virtual environment when the
    requirements changed); the intermediate images that are the build cache stay. Without this
    every rebuild left the previous final image behind, untagged, for good."""
    old = _storage_image_id(ref)
    if old:
        res = subprocess.run([need("buildah"), "rmi", "--force", old.removeprefix("sha256:")],
                             capture_output=True, text=True)
        with logfile.open("a") as f:
            f.write(f"$ buildah rmi --force {old} (the previous build of {ref}): exit {res.returncode}\n"
                    f"{res.stdout}{res.stderr}")


def _image_id(iidfile: Path) -> str:
    iid = iidfile.read_text().strip()
    return iid if iid.startswith("sha256:") else "sha256:" + iid


def archive_image_id(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None
        manifest = json.load(member)
    return "sha256:" + manifest[0]["Config"].removesuffix(".json")


def build_base(ref: str, work: Path, logfile: Path, verbose: bool) -> str:
    need("mmdebstrap")
    buildah = need("buildah")
    rootfs = work / "rootfs.tar"
    run(["mmdebstrap", *MMDEBSTRAP_OPTS, SUITE, str(rootfs), apt_sources()], logfile=logfile, verbose=verbose)
    return _from_scratch(buildah, "base", ref, work, logfile, verbose, lambda ctr: [
        [buildah, "add", "--quiet", ctr, str(rootfs), "/"],
        [buildah, "config", *BASE_CONFIG, ctr]])


def _from_scratch(buildah: str, name: str, ref: str, work: Path, logfile: Path, verbose: bool,
                  steps: Callable[[str], list[list[str]]]) -> str:
    """An image from an empty container: run the buildah `steps` on it, commit it as `ref`;
    returns the image ID. The working container goes whatever happens."""
    ctr = run([buildah, "from", "--name", f"sftjob-{name}-{os.getpid()}", "scratch"]).strip()
    try:
        for argv in steps(ctr):
            run(argv, logfile=logfile, verbose=verbose)
        run([buildah, "commit", "--quiet", "--rm", "--iidfile", str(work / "iid"), ctr, ref],
             logfile=logfile, verbose=verbose)
    except BaseException:
        subprocess.run([buildah, "rm", ctr], capture_output=True)
        raise
    return _image_id(work / "iid")


def build_pause(ref: str, work: Path, logfile: Path, verbose: bool) -> str:
    gcc = need("gcc")
    buildah = need("buildah")
    binary = work / "pause"
    run([gcc, *PAUSE_CFLAGS, "-o", str(binary), str(ROOT / PAUSE_SOURCE)], logfile=logfile, verbose=verbose)
    return _from_scratch(buildah, "pause", ref, work, logfile, verbose, lambda ctr: [
        [buildah, "copy", "--quiet", "--chown", "0:0", "--chmod", "0755", ctr, str(binary), "/pause"],
        [buildah, "config", *PAUSE_CONFIG, ctr]])


def build_bud(name: str, ref: str, work: Path, cache: Path, logfile: Path, verbose: bool) -> str:
    buildah = need("buildah")
    bud = BUDS[name]
    prune_when_low(logfile)
    args = [a for k, v in sorted(bud.build_args.items()) for a in ("--build-arg", f"{k}={v}")]
    # The RUN steps trust what this machine trusts (pip's downloads may pass a proxy that
    # re-signs TLS); Debian's pip reads the system bundle. The images do not keep it.
    if Path(HOST_CA_BUNDLE).is_file():
        args += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    # --force-rm: a failed step's working container goes too; each one left behind held a
    # half-installed 5 GB virtual environment, and a few failed builds filled the disk.
    run([buildah, "bud", "--isolation", "chroot", "--layers", "--force-rm", "--pull=never",
          "-f", str(ROOT / bud.dockerfile), "--ignorefile", str(ROOT / bud.ignorefile), "--iidfile", str(work / "iid"),
          *args, "-t", ref, str(ROOT)], logfile=logfile, verbose=verbose, env=buildah_env(cache))
    return _image_id(work / "iid")


STORAGE = Path("/var/lib/containers/storage")
LOW_DISK = 25 << 30  # the trainer's build needs about 15 GB while it runs


def prune_when_low(logfile: Path, storage: Path = STORAGE, low: int = LOW_DISK) -> bool:
    """Before a build: when the disk under buildah's storage has less than `low` bytes free,
    remove the images that nothing tags and no tagged image builds upon, the layer cache of
    earlier builds (each requirements change leaves a whole virtual environment behind).
    Kept otherwise: that cache is what lets an edited source rebuild in seconds. Returns
    whether it pruned."""
    probe = storage if storage.exists() else storage.parent
    if not probe.exists() or shutil.disk_usage(probe).free >= low:
        return False
    log(f"less than {low >> 30} GiB free under {storage}: pruning buildah's unused layer cache")
    res = subprocess.run([need("buildah"), "rmi", "--prune"], capture_output=True, text=True)
    with logfile.open("a") as f:
        f.write(f"$ buildah rmi --prune: exit {res.returncode}\n{res.stdout}{res.stderr}")
    return True


def ensure_in_storage(img: ImageRef, logfile: Path, verbose: bool) -> None:
    """Put a cached image back into buildah's storage under its ref (the base, when building
    upon it after buildah's storage was reset or retagged)."""
    if _storage_image_id(img.ref) == img.image_id:
        return
    buildah = need("buildah")
    log(f"{img.name}: restoring {img.ref} into buildah's storage from {img.archive}")
    run([buildah, "pull", "--quiet", f"docker-archive:{img.archive}"], logfile=logfile, verbose=verbose)
    run([buildah, "tag", img.image_id.removeprefix("sha256:"), img.ref], logfile=logfile, verbose=verbose)
