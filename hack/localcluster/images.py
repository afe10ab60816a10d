"""Container images built on this machine, without docker: base, pause, operator, trainer.

The local cluster's nodes run real kubelets on containerd; their pods need the operator and
trainer images under the names the chart and the SFTJob CRD default to
(ghcr.io/sftjob/{operator,trainer}:<appVersion>, pullPolicy IfNotPresent) and a pod sandbox
image. Nothing can be pulled here, so every image is made from local inputs:

- base (localhost/sftjob/base:bookworm): mmdebstrap of Debian bookworm from the machine's apt
  sources with python3, python3-venv and ca-certificates, committed into buildah's storage;
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
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("base", "pause", "operator", "trainer")
# What a node's containerd needs (the base is only built upon).
NODE_IMAGES = ("pause", "operator", "trainer")
# Bump when this module builds an image differently from the same inputs.
RECIPE = "1"

BASE_REF = "localhost/sftjob/base:bookworm"
PAUSE_REF = "localhost/sftjob/pause:3.10"
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
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
    # The CPU/local variant: both stages on the base, no flash-attn (so no nvcc).
    "trainer": Bud("images/trainer/Dockerfile",
                   {"BUILD_IMAGE": _BASE_IMAGE, "BUILD_TAG": _BASE_TAG, "RUNTIME_IMAGE": _BASE_IMAGE,
                    "RUNTIME_TAG": _BASE_TAG, "FLASH_ATTN_VERSION": ""}),
}

HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

# The Debian package that provides each tool this module runs.
PACKAGES = {"buildah": "buildah", "mmdebstrap": "mmdebstrap", "gcc": "gcc libc6-dev", "ctr": "containerd"}


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
    def from_json(cls, data: dict) -> "ImageRef":
        return cls(**{**data, "archive": Path(data["archive"])})


# ---------------------------------------------------------------------------------------
# Paths, names, logging


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


def _log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def need(tool: str) -> str:
    """The tool's path, or an error naming the Debian package that provides it."""
    path = shutil.which(tool)
    if not path:
        raise ImagesError(f"{tool} not found on PATH: install it with `apt-get install {PACKAGES[tool]}`")
    return path


# ---------------------------------------------------------------------------------------
# The build context as the ignore file lets it in (docker's .dockerignore rules)


def _pattern_regex(pattern: str) -> str:
    """A .dockerignore pattern as a regular expression over '/'-separated relative paths:
    `*` and `?` stay within one path segment, `**` spans any number of them, [...] is a class,
    a backslash escapes the next character."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 2
                if pattern.startswith("/", i):
                    out.append("(?:.*/)?")
                    i += 1
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                out.append("[" + pattern[i + 1:end].replace("\\", "\\\\") + "]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


class IgnoreRules:
    """The rules of one .dockerignore file: the last pattern that matches a path, or one of its
    parent directories, decides; `!` patterns let a path back in."""

    def __init__(self, text: str):
        self.rules: list[tuple[bool, re.Pattern, list[str]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pat = os.path.normpath(line[1:].strip() if include else line).lstrip("/")
            self.rules.append((include, re.compile(_pattern_regex(pat)), pat.split("/")))

    def excluded(self, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        out = False
        for include, rx, _ in self.rules:
            if any(rx.fullmatch(p) for p in prefixes):
                out = not include
        return out

    def may_include_below(self, rel_dir: str) -> bool:
        """Whether some `!` pattern could match a path inside rel_dir (an excluded directory
        is only walked when one could)."""
        dparts = rel_dir.split("/")
        for include, _, pparts in self.rules:
            if not include:
                continue
            for i, d in enumerate(dparts):
                if i >= len(pparts):
                    break
                if pparts[i] == "**":
                    return True
                if not re.fullmatch(_pattern_regex(pparts[i]), d):
                    break
            else:
                if len(pparts) > len(dparts):
                    return True
        return False


def context_files(root: Path, ignorefile: Path) -> list[str]:
    """The relative paths of the files (and symlinks) in the build context that the ignore file
    lets in, sorted: what the Dockerfile's COPY instructions can see."""
    rules = IgnoreRules(ignorefile.read_text())
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if os.path.islink(os.path.join(dirpath, d)):
                if not rules.excluded(rel):
                    found.append(rel)
            elif not rules.excluded(rel) or rules.may_include_below(rel):
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not rules.excluded(rel):
                found.append(rel)
    return sorted(found)


# ---------------------------------------------------------------------------------------
# Input keys


def _key(parts: Iterable[tuple[str, bytes | str]]) -> str:
    h = hashlib.sha256()
    for label, data in parts:
        raw = data.encode() if isinstance(data, str) else data
        h.update(label.encode() + b"\0" + len(raw).to_bytes(8, "big") + raw)
    return h.hexdigest()[:16]


def apt_sources() -> str:
    """What mmdebstrap gets as its mirror: $SFTJOB_APT_SOURCES, else the machine's Debian
    sources (deb822 or one-line), else deb.debian.org."""
    for cand in (os.environ.get("SFTJOB_APT_SOURCES"), "/etc/apt/sources.list.d/debian.sources",
                 "/etc/apt/sources.list"):
        if cand and Path(cand).is_file() and Path(cand).read_text().strip():
            return cand
    return "http://deb.debian.org/debian"


def _file_parts(root: Path, rels: Iterable[str]) -> Iterator[tuple[str, bytes]]:
    for rel in rels:
        p = root / rel
        if p.is_symlink():
            yield f"link:{rel}", os.readlink(p).encode()
        else:
            mode = "x" if os.access(p, os.X_OK) else "-"
            yield f"file:{rel}:{mode}", p.read_bytes()


def _gcc_identity() -> str:
    gcc = need("gcc")
    out = subprocess.run([gcc, "-dumpfullversion", "-dumpmachine"], capture_output=True, text=True, check=True)
    return " ".join(out.stdout.split())


def input_key(name: str, *, root: Path = ROOT, refs: Mapping[str, str] | None = None,
              base_id: str | None = None) -> str:
    """The hash of everything that goes into image `name`. The operator's and the trainer's
    include the base image's ID (base_id): a remade base makes them stale."""
    refs = refs or image_refs(root)
    parts: list[tuple[str, bytes | str]] = [("recipe", RECIPE), ("name", name), ("ref", refs[name])]
    if name == "base":
        src = apt_sources()
        parts += [("suite", SUITE), ("opts", "\0".join(MMDEBSTRAP_OPTS)), ("config", "\0".join(BASE_CONFIG)),
                  ("sources", Path(src).read_bytes() if Path(src).is_file() else src)]
    elif name == "pause":
        parts += [("cflags", "\0".join(PAUSE_CFLAGS)), ("config", "\0".join(PAUSE_CONFIG)),
                  ("gcc", _gcc_identity()), *_file_parts(root, [PAUSE_SOURCE])]
    elif name in BUDS:
        if not base_id:
            raise ValueError(f"the {name} image's key needs the base image's ID")
        bud = BUDS[name]
        parts += [("base", base_id), ("args", json.dumps(dict(bud.build_args), sort_keys=True)),
                  *_file_parts(root, [bud.dockerfile, bud.ignorefile]),
                  *_file_parts(root, context_files(root, root / bud.ignorefile))]
    else:
        raise ValueError(f"unknown image {name!r}; known: {', '.join(NAMES)}")
    return _key(parts)


# ---------------------------------------------------------------------------------------
# Running the tools


def _run(cmd: Sequence[str], *, logfile: Path | None = None, verbose: bool = False,
         env: Mapping[str, str] | None = None) -> str:
    """Run cmd; return its stdout. Its stderr (and, with a logfile, its stdout too) goes to
    the logfile; verbose also echoes it. A failure raises with the output's tail."""
    if logfile is None:
        res = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise ImagesError(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stderr.strip()[-4000:]}")
        return res.stdout
    with logfile.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, bufsize=1)
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            if verbose:
                sys.stderr.write(line)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(lines[-40:])
        raise ImagesError(f"{' '.join(cmd[:3])} ... failed (exit {rc}); full log: {logfile}\n{tail}")
    return "".join(lines)


@contextlib.contextmanager
def _lock(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _buildah_env(cache: Path) -> dict[str, str]:
    # buildah keeps RUN --mount=type=cache directories under $TMPDIR/buildah-cache/<target>:
    # under the cache directory, pip's cache outlives reboots and goes with `rm -rf` of it.
    tmp = cache / "buildah-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def _storage_image_id(ref: str) -> str | None:
    res = subprocess.run([need("buildah"), "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref],
                         capture_output=True, text=True)
    return "sha256:" + res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


def _image_id(iidfile: Path) -> str:
    iid = iidfile.read_text().strip()
    return iid if iid.startswith("sha256:") else "sha256:" + iid


def _archive_image_id(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None
        manifest = json.load(member)
    return "sha256:" + manifest[0]["Config"].removesuffix(".json")


# ---------------------------------------------------------------------------------------
# Builders: each leaves the image under its ref in buildah's storage


def _build_base(ref: str, work: Path, logfile: Path, verbose: bool) -> str:
    need("mmdebstrap")
    buildah = need("buildah")
    rootfs = work / "rootfs.tar"
    _run(["mmdebstrap", *MMDEBSTRAP_OPTS, SUITE, str(rootfs), apt_sources()], logfile=logfile, verbose=verbose)
    return _from_scratch(buildah, "base", ref, work, logfile, verbose, lambda ctr: [
        [buildah, "add", "--quiet", ctr, str(rootfs), "/"],
        [buildah, "config", *BASE_CONFIG, ctr]])


def _from_scratch(buildah: str, name: str, ref: str, work: Path, logfile: Path, verbose: bool,
                  steps: Callable[[str], list[list[str]]]) -> str:
    """An image from an empty container: run the buildah `steps` on it, commit it as `ref`;
    returns the image ID. The working container goes whatever happens."""
    ctr = _run([buildah, "from", "--name", f"sftjob-{name}-{os.getpid()}", "scratch"]).strip()
    try:
        for argv in steps(ctr):
            _run(argv, logfile=logfile, verbose=verbose)
        _run([buildah, "commit", "--quiet", "--rm", "--iidfile", str(work / "iid"), ctr, ref],
             logfile=logfile, verbose=verbose)
    except BaseException:
        subprocess.run([buildah, "rm", ctr], capture_output=True)
        raise
    return _image_id(work / "iid")


def _build_pause(ref: str, work: Path, logfile: Path, verbose: bool) -> str:
    gcc = need("gcc")
    buildah = need("buildah")
    binary = work / "pause"
    _run([gcc, *PAUSE_CFLAGS, "-o", str(binary), str(ROOT / PAUSE_SOURCE)], logfile=logfile, verbose=verbose)
    return _from_scratch(buildah, "pause", ref, work, logfile, verbose, lambda ctr: [
        [buildah, "copy", "--quiet", "--chown", "0:0", "--chmod", "0755", ctr, str(binary), "/pause"],
        [buildah, "config", *PAUSE_CONFIG, ctr]])


def _build_bud(name: str, ref: str, work: Path, cache: Path, logfile: Path, verbose: bool) -> str:
    buildah = need("buildah")
    bud = BUDS[name]
    args = [a for k, v in sorted(bud.build_args.items()) for a in ("--build-arg", f"{k}={v}")]
    # The RUN steps trust what this machine trusts (pip's downloads may pass a proxy that
    # re-signs TLS); Debian's pip reads the system bundle. The images do not keep it.
    if Path(HOST_CA_BUNDLE).is_file():
        args += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    _run([buildah, "bud", "--isolation", "chroot", "--layers", "--pull=never",
          "-f", str(ROOT / bud.dockerfile), "--ignorefile", str(ROOT / bud.ignorefile), "--iidfile", str(work / "iid"),
          *args, "-t", ref, str(ROOT)], logfile=logfile, verbose=verbose, env=_buildah_env(cache))
    return _image_id(work / "iid")


# ---------------------------------------------------------------------------------------
# The cache


def _stamp(cache: Path, name: str, key: str) -> Path:
    return cache / f"{name}-{key}.json"


def cached(name: str, key: str, cache: Path | None = None) -> ImageRef | None:
    """The image built from inputs `key`, if its archive and stamp are there."""
    stamp = _stamp(cache or cache_dir(), name, key)
    try:
        img = ImageRef.from_json(json.loads(stamp.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    try:
        if img.archive.stat().st_size != img.size:
            return None
    except OSError:
        return None
    return img


def _write_archive(name: str, ref: str, image_id: str, key: str, cache: Path, started: float, logfile: Path,
                   verbose: bool) -> ImageRef:
    """Write the image `image_id` (what this build committed, whatever `ref` points at by now)
    as the archive of `key`, named `ref`, then its stamp."""
    buildah = need("buildah")
    final = cache / f"{name}-{key}.tar"
    tmp = cache / f".{name}-{key}.tar.tmp"
    # Only the current archive of each image is kept (the trainer's is GBs); the stale one
    # goes first, so the disk never holds both.
    for old in cache.glob(f"{name}-*"):
        if re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}\.(tar|json)", old.name) and old.name != final.name:
            old.unlink(missing_ok=True)
    tmp.unlink(missing_ok=True)
    try:
        _run([buildah, "push", "--quiet", image_id.removeprefix("sha256:"), f"docker-archive:{tmp}:{ref}"],
             logfile=logfile, verbose=verbose, env=_buildah_env(cache))
        archived = _archive_image_id(tmp)
        if archived != image_id:
            raise ImagesError(f"{ref}: the archive holds {archived}, the build made {image_id}")
        os.replace(tmp, final)
    except ImagesError as e:
        tmp.unlink(missing_ok=True)
        if "no space left on device" in str(e):
            free = shutil.disk_usage(cache).free
            raise ImagesError(f"{e}\nthe disk of {cache} is full ({_human(free)} free now): "
                              "the trainer's archive needs about 6 GB") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    img = ImageRef(name=name, ref=ref, key=key, archive=final, image_id=image_id, size=final.stat().st_size,
                   built_at=time.time(), build_seconds=round(time.monotonic() - started, 1))
    stamp = _stamp(cache, name, key)
    stamp_tmp = stamp.with_suffix(".json.tmp")
    stamp_tmp.write_text(json.dumps(img.to_json(), indent=1) + "\n")
    os.replace(stamp_tmp, stamp)
    return img


def _ensure_in_storage(img: ImageRef, logfile: Path, verbose: bool) -> None:
    """Put a cached image back into buildah's storage under its ref (the base, when building
    upon it after buildah's storage was reset or retagged)."""
    if _storage_image_id(img.ref) == img.image_id:
        return
    buildah = need("buildah")
    _log(f"{img.name}: restoring {img.ref} into buildah's storage from {img.archive}")
    _run([buildah, "pull", "--quiet", f"docker-archive:{img.archive}"], logfile=logfile, verbose=verbose)
    _run([buildah, "tag", img.image_id.removeprefix("sha256:"), img.ref], logfile=logfile, verbose=verbose)


def _with_dependencies(names: Iterable[str]) -> list[str]:
    wanted = set()
    for n in names:
        if n not in NAMES:
            raise ImagesError(f"unknown image {n!r}; known: {', '.join(NAMES)}")
        wanted.add(n)
        if n in BUDS:
            wanted.add("base")
    return [n for n in NAMES if n in wanted]


def build(names: Iterable[str] = NAMES, *, refs: Mapping[str, str] | None = None, rebuild: bool = False,
          verbose: bool = False) -> dict[str, ImageRef]:
    """Build the images whose inputs changed (and the base they need); return the requested
    ones. rebuild: build the requested ones even when cached (e.g. for Debian's updates).
    verbose: echo the tools' output (it always goes to <cache>/logs/<name>.log)."""
    names = list(names)
    refs = dict(refs or image_refs())
    cache = cache_dir()
    if os.geteuid() != 0:
        raise ImagesError("building images needs root (mmdebstrap, buildah's storage, --isolation chroot)")
    out: dict[str, ImageRef] = {}
    with _lock(cache):
        for name in _with_dependencies(names):
            key = input_key(name, refs=refs, base_id=out["base"].image_id if name in BUDS else None)
            img = None if rebuild and name in names else cached(name, key, cache)
            logfile = cache / "logs" / f"{name}.log"
            logfile.parent.mkdir(exist_ok=True)
            if img:
                _log(f"{name}: {img.ref} up to date ({_human(img.size)}, key {key})")
                out[name] = img
                continue
            if name in BUDS:
                _ensure_in_storage(out["base"], logfile, verbose)
            logfile.write_text("")
            _log(f"{name}: building {refs[name]} (key {key}; log {logfile})")
            started = time.monotonic()
            with tempfile.TemporaryDirectory(dir=cache, prefix=f".work-{name}-") as work:
                if name == "base":
                    image_id = _build_base(refs[name], Path(work), logfile, verbose)
                elif name == "pause":
                    image_id = _build_pause(refs[name], Path(work), logfile, verbose)
                else:
                    image_id = _build_bud(name, refs[name], Path(work), cache, logfile, verbose)
            built = time.monotonic() - started
            img = _write_archive(name, refs[name], image_id, key, cache, started, logfile, verbose)
            _log(f"{name}: built {img.ref} in {built:.1f} s, archived in {img.build_seconds - built:.1f} s "
                 f"({_human(img.size)}: {img.archive})")
            out[name] = img
    return {n: out[n] for n in names}


# ---------------------------------------------------------------------------------------
# Loading into a node's containerd


def _ctr(address: str, namespace: str, *args: str) -> str:
    return _run([need("ctr"), "--address", address, "-n", namespace, *args])


def _ready_images(address: str, namespace: str, snapshotter: str | None = None) -> dict[str, str]:
    """ref -> manifest digest of the images that are complete and unpacked (for the default
    snapshotter, or `snapshotter`)."""
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    ready = set(_ctr(address, namespace, "images", "check", "-q", *extra).split())
    out = {}
    for line in _ctr(address, namespace, "images", "ls").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[0] in ready:
            out[fields[0]] = fields[2]
    return out


def _config_digest(address: str, namespace: str, manifest_digest: str) -> str | None:
    try:
        manifest = json.loads(_ctr(address, namespace, "content", "get", manifest_digest))
    except (ImagesError, ValueError):
        return None
    return manifest.get("config", {}).get("digest")


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _oci_layout(archive: Path, ref: str, have: set[str], out) -> int:
    """Write to the binary stream `out` an OCI image layout (tar) of the image in the
    docker-archive `archive`, named `ref` for containerd, leaving out the layer blobs whose
    digests are in `have` (the containerd holds them; its unpacker reuses them). The config is
    copied byte for byte, so the image ID stays. Returns the bytes of layers written."""
    with tarfile.open(archive) as src:
        entry = json.load(src.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        config = src.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        layers = []
        for name in entry["Layers"]:
            # c/image names a docker-archive's layers by their digest (uncompressed: the diff ID)
            member = src.getmember(name)
            layers.append(("sha256:" + name.removesuffix(".tar"), member))
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": "sha256:" + hashlib.sha256(config).hexdigest(), "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": m.size}
                       for d, m in layers],
        }, separators=(",", ":")).encode()
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
            "size": len(manifest),
            "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref}}]},
            separators=(",", ":")).encode()
        sent = 0
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst:
            def add(name: str, size: int, data) -> None:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = size, 0o644, 0
                dst.addfile(info, data)

            add("oci-layout", 30, io.BytesIO(b'{"imageLayoutVersion":"1.0.0"}'))
            add("index.json", len(index), io.BytesIO(index))
            for blob in (manifest, config):
                add(f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", len(blob), io.BytesIO(blob))
            for digest, member in layers:
                if digest in have:
                    continue
                add(f"blobs/sha256/{digest.removeprefix('sha256:')}", member.size, src.extractfile(member))
                sent += member.size
    return sent


def _import(address: str, namespace: str, img: ImageRef, snapshotter: str | None) -> int:
    """ctr images import of img, sending only the layers this containerd lacks (an edited
    source changes the trainer's last, small layer, not its GBs of requirements). Returns
    the bytes of layers sent."""
    have = set(_ctr(address, namespace, "content", "ls", "-q").split())
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    cmd = [need("ctr"), "--address", address, "-n", namespace, "images", "import", *extra, "-"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        assert proc.stdin is not None
        try:
            sent = _oci_layout(img.archive, img.ref, have, proc.stdin)
        except BrokenPipeError:  # ctr quit early; its stderr says why
            sent = -1
        finally:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            rc = proc.wait()
        err.seek(0)
        if rc != 0 or sent < 0:
            why = err.read().decode(errors="replace")[-4000:]
            raise ImagesError(f"{' '.join(cmd)} < {img.archive} failed (exit {rc}): {why}")
    return sent


def load(address: str, namespace: str = "k8s.io", names: Iterable[str] = NODE_IMAGES, *,
         refs: Mapping[str, str] | None = None, snapshotter: str | None = None) -> dict[str, str]:
    """Import the images (building what is missing or stale first) into the containerd that
    listens on `address`, in `namespace` (the CRI's is k8s.io), unpacked for its default
    snapshotter (or `snapshotter`). An image it already holds, unpacked, under the same ref
    with the same config digest is skipped. Returns name -> "imported" or "present"."""
    need("ctr")
    built = build(names, refs=refs)
    started = time.monotonic()
    ready = _ready_images(address, namespace, snapshotter)
    result = {}
    for name, img in built.items():
        digest = ready.get(img.ref)
        if digest and _config_digest(address, namespace, digest) == img.image_id:
            result[name] = "present"
            continue
        t0 = time.monotonic()
        sent = _import(address, namespace, img, snapshotter)
        now = _ready_images(address, namespace, snapshotter)
        if img.ref not in now or _config_digest(address, namespace, now[img.ref]) != img.image_id:
            raise ImagesError(f"{address}: {img.ref} is not there, unpacked with ID {img.image_id}, "
                              f"after importing {img.archive}")
        _log(f"{name}: imported {img.ref} into {address} ({namespace}) in {time.monotonic() - t0:.1f} s "
             f"({_human(sent)} of layers sent, of {_human(img.size)})")
        result[name] = "imported"
    present = [n for n, s in result.items() if s == "present"]
    if present:
        _log(f"already in {address} ({namespace}): {', '.join(present)}")
    _log(f"load into {address} took {time.monotonic() - started:.1f} s")
    return result


# ---------------------------------------------------------------------------------------
# CLI


def status(refs: Mapping[str, str] | None = None) -> list[dict]:
    """For each image: its ref, the key of the current inputs and whether it is built."""
    refs = dict(refs or image_refs())
    cache = cache_dir()
    rows, base_id = [], None
    for name in NAMES:
        row = {"name": name, "ref": refs[name]}
        if name in BUDS and base_id is None:
            row.update(key="?", state="needs the base")
            rows.append(row)
            continue
        key = input_key(name, refs=refs, base_id=base_id)
        img = cached(name, key, cache)
        row.update(key=key, state="built" if img else "stale" if list(cache.glob(f"{name}-*.json")) else "missing")
        if img:
            row.update(size=img.size, archive=str(img.archive), image_id=img.image_id)
            if name == "base":
                base_id = img.image_id
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.localcluster.images",
                                 description="Build the project's images here without docker, cache them, "
                                             "load them into a containerd.")
    ap.add_argument("--operator-image", help="operator ref (default ghcr.io/sftjob/operator:<appVersion>)")
    ap.add_argument("--trainer-image", help="trainer ref (default ghcr.io/sftjob/trainer:<appVersion>)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", help="build what is missing or stale (default: all four)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(NAMES)}")
    p.add_argument("--rebuild", action="store_true", help="build the named images even when cached")
    p.add_argument("--quiet", action="store_true", help="do not echo the tools' output")
    p = sub.add_parser("load", help="import the node images into a containerd (k8s.io namespace)")
    p.add_argument("--address", required=True, help="containerd's socket")
    p.add_argument("--namespace", default="k8s.io")
    p.add_argument("--snapshotter", help="unpack for this snapshotter (default: containerd's default)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(NODE_IMAGES)} (default: all)")
    sub.add_parser("list", help="the images, their input keys and whether they are built")
    a = ap.parse_args(argv)
    refs = image_refs(operator=a.operator_image, trainer=a.trainer_image)
    try:
        if a.cmd == "build":
            started = time.monotonic()
            for img in build(a.names or NAMES, refs=refs, rebuild=a.rebuild, verbose=not a.quiet).values():
                print(f"{img.ref}\t{img.image_id}\t{img.archive}")
            _log(f"done in {time.monotonic() - started:.1f} s")
        elif a.cmd == "load":
            states = load(a.address, a.namespace, a.names or NODE_IMAGES, refs=refs, snapshotter=a.snapshotter)
            for name, state in states.items():
                print(f"{refs[name]}\t{state}")
        else:
            for row in status(refs):
                size = _human(row["size"]) if "size" in row else "-"
                print(f"{row['name']:<9} {row['state']:<15} {size:>9}  {row['key']:<16}  {row['ref']}")
    except ImagesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
