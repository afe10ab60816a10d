"""The line a waiting `up`/`prepare` prints every 30 s while the cluster's binaries and images
build, so a first run on a new machine (half an hour on 2 cores) is never silent:

    preparing the cluster: building trainer image, Go binaries k8s (12m30s so far;
    left: kwok, coredns; log: /repo/.cache/prepare.log; last: go: downloading ...)

Every part of it is read from the machine, not predicted: what is done is what the
version-keyed cache holds (a binary's `.built` stamp, an image's stamp for its current input
key), what is building is what holds a build lock and has its work directory there
(`<name>-<version>/bin.tmp`, `images/.work-<name>-*`), and the log and the start time are those
of the background `prepare` (`prepare.json` in the cache) while it runs. `line()` turns that
state into the text (pure, table-tested); `probe()` reads it; `beating()` prints it from a
thread until the wait ends.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping, Sequence

from . import config as C
from . import images
from . import proc

# At most this long between two lines (the console must never be silent for a minute).
INTERVAL = float(os.environ.get("SFTJOB_HEARTBEAT_SECONDS") or 30)
RECORD = "prepare.json"  # the running background prepare: pid, log, start, components

DONE, BUILDING, ARCHIVING, MISSING = "done", "building", "archiving", "missing"


@dataclasses.dataclass(frozen=True)
class PrepareState:
    """What the preparation stands at. binaries/images: name -> DONE, BUILDING, ARCHIVING
    (images only) or MISSING, in build order; a work directory without its lock held is
    the remnant of an interrupted build, so it counts as MISSING."""

    elapsed: float
    binaries: Mapping[str, str]
    binaries_locked: bool
    images: Mapping[str, str]
    images_locked: bool
    log: str | None = None
    last_line: str | None = None
    # what the waiter itself is doing when no build runs (e.g. installing Debian packages)
    phase: str | None = None


def duration(seconds: float) -> str:
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def line(st: PrepareState, width: int = 100) -> str:
    """The heartbeat's text for one state (pure: the table test drives it)."""
    acts: list[tuple[str, str]] = []  # (verb, what), grouped by verb in the text
    if st.images_locked:
        acts += [("archiving" if s == ARCHIVING else "building", f"{n} image")
                 for n, s in st.images.items() if s in (BUILDING, ARCHIVING)] or [("building", "images")]
    if st.binaries_locked:
        busy = " ".join(n for n, s in st.binaries.items() if s == BUILDING)
        acts.append(("building", f"Go binaries {busy}" if busy else "Go binaries"))
    verbs = list(dict.fromkeys(v for v, _ in acts))
    doing = ", ".join(f"{v} " + ", ".join(w for vv, w in acts if vv == v) for v in verbs)
    left = [n for n, s in st.binaries.items() if s == MISSING or (s == BUILDING and not st.binaries_locked)]
    left += [f"{n} image" for n, s in st.images.items()
             if s == MISSING or (s in (BUILDING, ARCHIVING) and not st.images_locked)]
    doing = doing or st.phase or ("waiting for the builds to start" if left else "finishing")
    parts = [f"{duration(st.elapsed)} so far", f"left: {', '.join(left) if left else 'nothing'}"]
    if st.log:
        parts.append(f"log: {st.log}")
    last = " ".join((st.last_line or "").split())
    if last:
        parts.append("last: " + (last if len(last) <= width else last[:width - 3] + "..."))
    return f"preparing the cluster: {doing} ({'; '.join(parts)})"


def locked(path: Path) -> bool:
    """True while some process (this one included) holds the flock on path. Probed with a
    non-blocking lock taken and dropped at once; a missing file is not held."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's lock when it got it
    return False


def record_background(pid: int, log: Path, components: Sequence[str]) -> None:
    """Note the background prepare, so that an `up` waiting on its locks (in any checkout
    sharing the cache) can name its log and its start."""
    root = images.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps({"pid": pid, "log": str(log), "started": time.time(),
                               "components": list(components)}))
    os.replace(tmp, root / RECORD)


def background() -> dict | None:
    """The record of the background prepare while it runs (None once it exited)."""
    try:
        rec = json.loads((images.cache_root() / RECORD).read_text())
        cmd = Path(f"/proc/{int(rec['pid'])}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, TypeError, KeyError):
        return None
    # an empty command line: a zombie, or a child still in its exec (just started)
    ours = ("hack.localcluster" in cmd and "prepare" in cmd) or (not cmd and proc.running(int(rec["pid"])))
    return rec if ours else None


def last_line(path: Path, tail: int = 4096) -> str | None:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _binaries(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for n in names:
        d = C.bin_dir(n).parent
        # the same test as build-binaries.sh's `cached`, less its per-binary check
        out[n] = DONE if (d / ".built").is_file() else BUILDING if (d / "bin.tmp").is_dir() else MISSING
    return out


def _images(names: Sequence[str]) -> dict[str, str]:
    cache = images.cache_dir()
    out = {}
    for row in images.status():
        n = row["name"]
        if n not in names:
            continue
        if row["state"] == "built":
            out[n] = DONE
        elif any(cache.glob(f".{n}-*.tar.tmp")):
            out[n] = ARCHIVING
        elif any(cache.glob(f".work-{n}-*")):
            out[n] = BUILDING
        else:
            out[n] = MISSING
    return out


def probe(components: Sequence[str], node_images: Sequence[str], started: float,
          phase: str | None = None) -> PrepareState:
    """The state of the preparation that a waiter for `components` and `node_images` needs
    (plus what a running background prepare builds: the locks are held until it is done)."""
    bg = background()
    names = list(components) + [c for c in (bg or {}).get("components", []) if c not in components]
    wanted = images.NAMES if not node_images else [n for n in images.NAMES if n in node_images or n == "base"]
    log = Path(bg["log"]) if bg else None
    imgs = _images(wanted)
    if log is None:
        # no background prepare: the build in progress writes its own log
        busy = [n for n, s in imgs.items() if s in (BUILDING, ARCHIVING)]
        log = images.cache_dir() / "logs" / f"{busy[0]}.log" if busy else None
    return PrepareState(
        elapsed=time.time() - (min(started, float(bg["started"])) if bg else started),
        binaries=_binaries(names), binaries_locked=locked(images.cache_root() / ".build.lock"),
        images=imgs, images_locked=locked(images.cache_dir() / ".lock"),
        log=str(log) if log else None, last_line=last_line(log) if log else None, phase=phase)


@contextlib.contextmanager
def beating(text: Callable[[], str], say: Callable[[str], None] | None = None,
            every: float | None = None) -> Iterator[None]:
    """Print text() every `every` seconds until the block ends (a wait shorter than that
    prints nothing). The thread never fails the block: a state it cannot read is reported as
    such, a broken output is dropped."""
    say = say or proc.log
    every = INTERVAL if every is None else every
    stop = threading.Event()
    t0 = time.time()

    def run() -> None:
        while not stop.wait(every):
            try:
                msg = text()
            except Exception as e:  # noqa: BLE001 - the state is read while it changes under us
                msg = f"preparing the cluster ({duration(time.time() - t0)} so far; state unreadable: {e})"
            if stop.is_set():
                return
            try:
                say(msg)
            except Exception:  # noqa: BLE001 - a broken console must not fail the wait it reports on
                pass

    thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def installed_packages(venv: Path) -> int:
    """How many distributions `venv` holds (its *.dist-info directories): what a pip install
    has put there so far."""
    return sum(len(list(sp.glob("*.dist-info"))) for sp in venv.glob("lib/python*/site-packages"))


def run_beating(argv: Sequence[str], what: str, venv: Path | None = None,
                say: Callable[[str], None] | None = None) -> int:
    """Run argv in the foreground (its output passes through) and, every 30 s while it runs, say
    what it is, how long so far, how many packages `venv` holds, and where the background
    prepare stands when one runs: `make install`'s quiet pip is minutes of silence otherwise
    (a cold torch is GBs of wheels). Returns argv's exit status."""
    import subprocess
    t0 = time.time()

    def text() -> str:
        parts = [f"{duration(time.time() - t0)} so far"]
        if venv is not None:
            parts.append(f"{installed_packages(venv)} packages in {venv} so far")
        msg = f"{what} ({'; '.join(parts)})"
        bg = background()
        if bg:
            msg += "; meanwhile " + line(probe(bg.get("components", []), (), t0))
        return msg

    with beating(text, say):
        return subprocess.run(list(argv)).returncode
