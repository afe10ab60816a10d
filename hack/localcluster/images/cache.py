"""The cache of built images: one docker-archive and one stamp per image, named by its input
key. build() builds what is missing or stale, in dependency order, under a lock; status()
says what is there."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping

from .buildah import (archive_image_id, build_base, build_bud, build_pause, buildah_env, drop_previous_build,
                      ensure_in_storage)
from .keys import input_key
from .spec import BUDS, NAMES, ImageRef, ImagesError, cache_dir, image_refs
from .tools import human, log, need, run


@contextlib.contextmanager
def _lock(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
        run([buildah, "push", "--quiet", image_id.removeprefix("sha256:"), f"docker-archive:{tmp}:{ref}"],
             logfile=logfile, verbose=verbose, env=buildah_env(cache))
        archived = archive_image_id(tmp)
        if archived != image_id:
            raise ImagesError(f"{ref}: the archive holds {archived}, the build made {image_id}")
        os.replace(tmp, final)
    except ImagesError as e:
        tmp.unlink(missing_ok=True)
        if "no space left on device" in str(e):
            free = shutil.disk_usage(cache).free
            raise ImagesError(f"{e}\nthe disk of {cache} is full ({human(free)} free now): "
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
                log(f"{name}: {img.ref} up to date ({human(img.size)}, key {key})")
                out[name] = img
                continue
            logfile.write_text("")
            if name in BUDS:
                ensure_in_storage(out["base"], logfile, verbose)
                drop_previous_build(refs[name], logfile)
            log(f"{name}: building {refs[name]} (key {key}; log {logfile})")
            started = time.monotonic()
            with tempfile.TemporaryDirectory(dir=cache, prefix=f".work-{name}-") as work:
                if name == "base":
                    image_id = build_base(refs[name], Path(work), logfile, verbose)
                elif name == "pause":
                    image_id = build_pause(refs[name], Path(work), logfile, verbose)
                else:
                    image_id = build_bud(name, refs[name], Path(work), cache, logfile, verbose)
            built = time.monotonic() - started
            img = _write_archive(name, refs[name], image_id, key, cache, started, logfile, verbose)
            log(f"{name}: built {img.ref} in {built:.1f} s, archived in {img.build_seconds - built:.1f} s "
                 f"({human(img.size)}: {img.archive})")
            out[name] = img
    return {n: out[n] for n in names}


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
