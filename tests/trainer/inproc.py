"""A Trainer built in this process, as `cli.run` builds it, for tests that look inside a
run (the optimizer, the model, the live Prometheus endpoint) while it is still open."""
from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from sftjob_contract.config import load_config


@contextmanager
def trainer(args: list[str]) -> Iterator:
    from sftjob_trainer import dist as dist_utils
    from sftjob_trainer.train import StopFlag, Trainer

    world = dist_utils.init_world()
    built = None
    try:
        built = Trainer(load_config(None, args), world, StopFlag())
        yield built
    finally:
        if built is not None:
            built.close()
        dist_utils.close_world()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("sftjob_")}
