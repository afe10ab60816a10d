"""A real MLflow tracking server from the `mlflow` package, for the tracking tests.

`mlflow server` would start the app twice (the CLI, then a uvicorn worker importing it all
again), which costs tens of seconds on a busy machine; this runs the same server app
(`mlflow.server.app`, the same handlers and SQLAlchemy store) in one process with
werkzeug, on a sqlite backend store and a free port.
"""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .runner import free_port


def main(port: int, root: Path) -> None:
    from mlflow.server import app
    from mlflow.server.handlers import initialize_backend_stores
    from werkzeug.serving import make_server

    store = f"sqlite:///{root / 'mlflow.db'}"
    initialize_backend_stores(store, None, str(root / "artifacts"))
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


@contextmanager
def serve(root: Path, timeout: float = 120.0) -> Iterator[str]:
    """The server's URL while the context lasts."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer.mlflow_server", str(port), str(root)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError as err:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (root / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"MLflow server did not start: {tail}") from err
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
