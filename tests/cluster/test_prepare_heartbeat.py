"""The heartbeat of a waiting `up`/`prepare` (hack/localcluster/heartbeat.py): the line for each
state of the preparation, and the line appearing while another process really holds the Go
builds' lock (no cluster, no build: a scratch cache, `flock` and a shell stand in)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hack.localcluster import cluster, heartbeat
from hack.localcluster import config as C
from hack.localcluster.heartbeat import ARCHIVING, BUILDING, DONE, MISSING, PrepareState

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

ALL_IMAGES_DONE = {"base": DONE, "pause": DONE, "operator": DONE, "trainer": DONE}
BINS = ("k8s", "etcd", "helm", "minio", "kwok", "coredns")


def bins(**states: str) -> dict[str, str]:
    return {n: states.get(n, DONE) for n in BINS}


@pytest.mark.parametrize("state, want", [
    # the cold run of issue 29, twelve minutes in: both builds hold their locks
    (PrepareState(750, bins(k8s=BUILDING, kwok=MISSING, coredns=MISSING), True,
                  {**ALL_IMAGES_DONE, "trainer": BUILDING}, True, "/r/.cache/prepare.log",
                  "go: downloading k8s.io/api v0.36.3"),
     "preparing the cluster: building trainer image, Go binaries k8s (12m30s so far; left: kwok, coredns; "
     "log: /r/.cache/prepare.log; last: go: downloading k8s.io/api v0.36.3)"),
    # the trainer image being written out as an archive, the Go builds done
    (PrepareState(1900, bins(), False, {**ALL_IMAGES_DONE, "trainer": ARCHIVING}, True),
     "preparing the cluster: archiving trainer image (31m40s so far; left: nothing)"),
    (PrepareState(65, bins(minio=BUILDING), True, {**ALL_IMAGES_DONE, "trainer": ARCHIVING}, True),
     "preparing the cluster: archiving trainer image, building Go binaries minio (1m05s so far; left: nothing)"),
    # locks held between two steps (no work directory yet): what holds them, nothing invented
    (PrepareState(5, bins(etcd=MISSING), True, {**ALL_IMAGES_DONE, "base": MISSING}, True),
     "preparing the cluster: building images, Go binaries (5s so far; left: etcd, base image)"),
    # a work directory nobody's lock covers is an interrupted build: still to do
    (PrepareState(40, bins(k8s=BUILDING), False, {**ALL_IMAGES_DONE, "operator": BUILDING}, False,
                  phase="installing the nodes' Debian packages (hack/host-packages.sh)"),
     "preparing the cluster: installing the nodes' Debian packages (hack/host-packages.sh) "
     "(40s so far; left: k8s, operator image)"),
    (PrepareState(40, bins(k8s=MISSING), False, ALL_IMAGES_DONE, False),
     "preparing the cluster: waiting for the builds to start (40s so far; left: k8s)"),
    (PrepareState(7300, bins(), False, ALL_IMAGES_DONE, False, "/r/p.log", "  [images]   done\tin 1 s  "),
     "preparing the cluster: finishing (2h01m so far; left: nothing; log: /r/p.log; last: [images] done in 1 s)"),
    # a long last line is cut, so the heartbeat stays one line
    (PrepareState(0, {}, False, {}, False, "/l", "x" * 300),
     "preparing the cluster: finishing (0s so far; left: nothing; log: /l; last: " + "x" * 97 + "...)"),
])
def test_line_says_what_builds_how_long_and_what_is_left(state, want):
    assert heartbeat.line(state) == want


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A scratch ${SFTJOB_CACHE}: the machine's own may be in the middle of a real build."""
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("SFTJOB_CACHE", str(root))
    return root


def test_a_wait_on_another_process_lock_beats_with_what_is_left_and_stops_with_the_wait(cache):
    """`prepare` waits in build-binaries.sh for the Go builds' lock, which another process
    (a `make test` prepare in the background) holds while it builds etcd, then helm. The
    heartbeat reports each as it builds, and what is still missing, and ends with the wait."""
    etcd, helm = (C.bin_dir(n).parent for n in ("etcd", "helm"))
    holder_script = textwrap.dedent(f"""
        set -e
        touch {cache}/holding
        for d in {etcd} {helm}; do
          mkdir -p $d/bin.tmp; sleep 1.2
          mv $d/bin.tmp $d/bin; echo built > $d/.built
        done
    """)
    holder = subprocess.Popen(["flock", str(cache / ".build.lock"), "bash", "-c", holder_script])
    try:
        deadline = time.time() + 10
        while not (cache / "holding").exists() and time.time() < deadline:
            time.sleep(0.02)
        lines: list[str] = []
        t0 = time.time()

        def text() -> str:
            return heartbeat.line(heartbeat.probe(["etcd", "helm"], ["pause"], t0))

        with heartbeat.beating(text, say=lines.append, every=0.3):
            cluster.ensure_binaries(["etcd", "helm"])  # blocks on the holder's flock
        waited = time.time() - t0
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert waited > 2, "the wait should have lasted while the holder built"
    assert len(lines) >= 3, lines
    # each line is the real state: the image cache is empty, so base and pause are left
    assert any(ln.startswith("preparing the cluster: building Go binaries etcd (")
               and "left: helm, base image, pause image)" in ln for ln in lines), lines
    assert any(ln.startswith("preparing the cluster: building Go binaries helm (")
               and "left: base image, pause image)" in ln for ln in lines), lines
    assert not any("operator" in ln or "trainer" in ln for ln in lines), "only the images asked for"
    n = len(lines)
    time.sleep(0.8)
    assert len(lines) == n, "the heartbeat went on after the wait ended"


def test_a_short_wait_prints_nothing_and_errors_pass_through():
    lines: list[str] = []
    with heartbeat.beating(lambda: "never", say=lines.append, every=5):
        pass
    assert lines == []
    with pytest.raises(KeyError):
        with heartbeat.beating(lambda: "beat", say=lines.append, every=0.05):
            time.sleep(0.2)
            raise KeyError("the wait's own error")
    n = len(lines)
    assert n >= 1
    time.sleep(0.2)
    assert len(lines) == n


def test_an_unreadable_state_or_a_broken_output_never_fails_the_wait():
    lines: list[str] = []

    def broken() -> str:
        raise OSError("cache vanished")

    with heartbeat.beating(broken, say=lines.append, every=0.05):
        time.sleep(0.3)
    assert lines and "state unreadable: cache vanished" in lines[0] and "so far" in lines[0]

    def full(_text: str) -> None:
        raise OSError("no space left on device")

    with heartbeat.beating(lambda: "x", say=full, every=0.05):
        time.sleep(0.2)


def test_the_background_prepare_names_its_log_and_its_start_while_it_runs(cache, tmp_path):
    log = tmp_path / "prepare.log"
    log.write_text("[images] base: building localhost/sftjob/base:bookworm\n"
                   "[build-binaries 20:16:02] kueue: building into /c/kueue-v0.17.1\n\n")
    # stands in for `python -m hack.localcluster prepare` (its command line names both)
    bg = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hack.localcluster", "prepare"])
    try:
        heartbeat.record_background(bg.pid, log, ["k8s", "kueue"])
        st = heartbeat.probe(["k8s"], ["pause"], started=time.time())
        assert st.log == str(log)
        assert st.last_line == "[build-binaries 20:16:02] kueue: building into /c/kueue-v0.17.1"
        assert st.elapsed < 5
        # what the background builds is waited for too (it holds the lock until done)
        assert st.binaries == {"k8s": MISSING, "kueue": MISSING}
        assert st.images == {"base": MISSING, "pause": MISSING}
    finally:
        bg.kill()
        bg.wait()
    st = heartbeat.probe(["k8s"], ["pause"], started=time.time() - 90)
    assert st.log is None and st.binaries == {"k8s": MISSING}
    assert 90 <= st.elapsed < 95


def test_inside_a_pytest_fixture_the_line_reaches_the_console(tmp_path):
    """pytest captures the fds while a fixture runs; the cluster fixture's heartbeat must show
    during the wait, not in a captured report after it (and only for failing tests)."""
    (tmp_path / "test_beat.py").write_text(textwrap.dedent("""
        import pytest
        from tests.fixtures.cluster import console

        @pytest.fixture
        def waited(request):
            console(request.config)("preparing the cluster: building Go binaries k8s (1m00s so far)")

        def test_it(waited):
            pass
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "] preparing the cluster: building Go binaries k8s (1m00s so far)" in run.stderr, run.stdout + run.stderr


def test_a_quiet_install_beats_with_the_packages_it_has_put_there_so_far(cache, tmp_path):
    """`make install`'s pip is quiet, and cold it downloads GBs of torch for minutes (the cold
    `make demo` of this issue showed nothing for that long): `beat` runs it and says every
    interval what it is, how long so far and how many packages the venv holds, and returns
    its exit status. A real child stands in for pip: it adds dist-info directories as it runs."""
    venv = tmp_path / "venv"
    sp = venv / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        sp = pathlib.Path({str(sp)!r})
        for name in ("torch-2.13.0", "numpy-2.3.0", "pyarrow-21.0.0"):
            (sp / f"{{name}}.dist-info").mkdir()
            time.sleep(0.5)
        sys.exit(3)
    """)
    lines: list[str] = []
    t0 = time.time()
    # the interval comes from SFTJOB_HEARTBEAT_SECONDS in a real run; here from `every`
    real = heartbeat.beating
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(heartbeat, "beating", lambda text, say=None: real(text, say, every=0.2))
        rc = heartbeat.run_beating([sys.executable, "-c", script], "installing .venv", venv, say=lines.append)
    assert rc == 3, "the command's exit status passes through (make must stop on a failed pip)"
    assert time.time() - t0 >= 1.5
    assert len(lines) >= 4, lines
    assert all(ln.startswith("installing .venv (") and f"packages in {venv} so far)" in ln for ln in lines), lines
    counts = [int(ln.split("; ")[1].split()[0]) for ln in lines]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 3, counts
    assert not any("meanwhile" in ln for ln in lines), "no background prepare runs in this scratch cache"


def test_make_install_runs_every_pip_under_the_heartbeat():
    """Each pip command of the install recipe goes through `beat`: one left bare is minutes of
    silence on a cold machine."""
    make = subprocess.run(["make", "-n", "-B", "-C", str(REPO), ".venv/.installed", "PYTHON=python3"],
                          capture_output=True, text=True, timeout=60)
    assert make.returncode == 0, make.stderr
    recipe = make.stdout.replace("\\\n", " ")  # a continued line is one command
    pips = [ln for ln in recipe.splitlines() if "pip install" in ln]
    assert len(pips) == 2, make.stdout
    assert all(ln.startswith("python3 -m hack.localcluster beat --venv .venv --what ") for ln in pips), pips


def test_the_heartbeat_runs_on_an_interpreter_without_the_project_dependencies(tmp_path):
    """`make install` runs `beat` with the new, empty .venv's python (make puts .venv/bin first
    on PATH) and `make cluster-down` runs before any venv exists: hack.localcluster must import
    with the standard library alone. A fresh clone's `make demo` failed this way once (PyYAML
    imported at the top of kueue.py)."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "hack.localcluster", "beat", "--venv", str(venv),
                          "--what", "nothing", "--", sys.executable, "-c", "print('ran')"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ran"


def test_every_component_is_found_where_build_binaries_puts_it():
    """The heartbeat and netpol.py find a cache by C.bin_dir; build-binaries.sh writes it. The
    own tools (health, netpol) are keyed by a hash of their sources, computed on both sides:
    a mismatch would mean `make test`'s prepare built the enforcer where the test never looks,
    and built it again on the critical path."""
    out = subprocess.run([str(C.HACK / "build-binaries.sh"), "--print-dirs"], capture_output=True, text=True,
                         check=True).stdout
    dirs = dict(line.split("=", 1) for line in out.split())
    assert set(dirs) >= {"k8s", "etcd", "helm", "minio", "kwok", "coredns", "kueue", *C.OWN_TOOLS}
    for name, path in dirs.items():
        assert C.bin_dir(name).parent == Path(path), name
