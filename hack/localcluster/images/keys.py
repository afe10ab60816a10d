"""Input keys: the hash of everything that goes into an image (recipe, build arguments,
Dockerfile, ignore file, the build context's files, the base image's ID). An image whose key
has a stamp in the cache is not rebuilt."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping

from .context import context_files
from .spec import (BASE_CONFIG, BUDS, MMDEBSTRAP_OPTS, NAMES, PAUSE_CFLAGS, PAUSE_CONFIG, PAUSE_SOURCE, RECIPE, ROOT,
                   SUITE, image_refs)
from .tools import need


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
