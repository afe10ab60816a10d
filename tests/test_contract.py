"""The trainer-operator contract (sftjob_contract) is a leaf both sides share.

`make test` installs every extra into one venv, so an accidental torch or trainer import in
the operator would pass every other test and only break the operator image; these tests
import in a fresh interpreter and look at what got loaded.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from sftjob_contract import metrics as contract_metrics

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent

# Imports every module of a package in a fresh interpreter; prints the modules it imported,
# all modules loaded, and the file of each top-level module that was not loaded before (None
# for those without one: built-in modules and the runtime modules of compiled extensions).
_IMPORT_ALL = """
import importlib, json, pkgutil, sys
before = {m.split(".")[0] for m in sys.modules}
package = importlib.import_module(sys.argv[1])
names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules),
                  "new_top_level": {m: getattr(sys.modules.get(m), "__file__", None)
                                    for m in {m.split(".")[0] for m in sys.modules} - before}}))
"""


def import_all(package: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, package], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _is(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_operator_loads_neither_torch_nor_the_trainer():
    got = import_all("sftjob_operator")
    assert {"sftjob_operator.handlers", "sftjob_operator.api", "sftjob_operator.builders"} <= set(got["imported"])
    assert "sftjob_contract.config" in got["loaded"]
    offending = [m for m in got["loaded"] if _is(m, "torch") or _is(m, "sftjob_trainer")]
    assert offending == [], f"the operator imports trainer-side modules: {offending[:10]}"


def _distribution_modules(requirement: str) -> str:
    """'typing-extensions>=4.6' -> 'typing_extensions' (the import name of these packages)."""
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].replace("-", "_").lower()


def _in_stdlib(file: str) -> bool:
    """A file of the standard library (in a venv, site-packages lies below its platstdlib)."""
    path = Path(file).resolve()
    sites = {Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib")}
    return path.is_relative_to(Path(sysconfig.get_path("stdlib")).resolve()) and not any(
        path.is_relative_to(site) for site in sites)


def test_the_contract_needs_only_the_stdlib_pydantic_and_pyyaml():
    from importlib.metadata import requires

    got = import_all("sftjob_contract")
    assert {"sftjob_contract.command", "sftjob_contract.config", "sftjob_contract.env", "sftjob_contract.exits",
            "sftjob_contract.layout", "sftjob_contract.metrics"} <= set(got["imported"])
    pydantic_deps = {_distribution_modules(r) for r in requires("pydantic") or [] if "extra ==" not in r}
    allowed = {"sftjob_contract", "pydantic", "yaml", "_yaml"} | pydantic_deps
    foreign = sorted(m for m, file in got["new_top_level"].items()
                     if file and m not in allowed and not _in_stdlib(file))
    assert foreign == [], f"sftjob_contract imports beyond the stdlib, pydantic and PyYAML: {foreign}"


def _contract_metric_names() -> set[str]:
    return {v for k, v in vars(contract_metrics).items() if k.isupper() and isinstance(v, str)
            and v.startswith("sftjob_trainer_")}


def test_the_trainer_serves_every_contract_metric():
    """A name the contract lists but the trainer does not serve would leave the operator's
    status.progress empty without any error."""
    from sftjob_trainer import metrics

    served = {name for name, _ in (*metrics._GAUGES.values(), *metrics._COUNTERS.values())}
    assert served == _contract_metric_names()


def test_the_operator_scrapes_contract_names_and_the_docs_list_them():
    from sftjob_operator import progress

    # Counters are scraped under the exposed name (the contract's plus COUNTER_SUFFIX).
    assert {n.removesuffix(contract_metrics.COUNTER_SUFFIX) for n in progress.METRICS} <= _contract_metric_names()
    doc = (ROOT / "docs" / "trainer-contract.md").read_text()
    missing = sorted(n for n in _contract_metric_names() if f"`{n}`" not in doc and f"`{n}_total`" not in doc)
    assert missing == [], f"docs/trainer-contract.md does not name {missing}"


def test_the_batch_rule_reads_the_same_in_python_and_in_the_crds_cel():
    """The global-batch rule is written once (sections._BATCH_RULE): its CEL rendering, evaluated
    on integers (CEL's % and * on ints are Python's on non-negative ints), agrees with the Python
    predicate everywhere on a grid, and the CRD carries exactly that rendering."""
    from sftjob_contract.sections import batch_splits, batch_splits_cel

    expr = batch_splits_cel("t", "m", "d")
    for t in range(1, 49):
        for m in range(1, 9):
            for d in range(1, 9):
                assert eval(expr, {}, {"t": t, "m": m, "d": d}) == batch_splits(t, m, d), (t, m, d)
    import yaml

    crd = json.dumps(yaml.safe_load((ROOT / "crds" / "sftjob.io_sftjobs.yaml").read_text()))
    rendered = batch_splits_cel("self.data.trainBatchSize", "self.data.microBatchSizePerGpu",
                                "(self.resources.nodes * self.resources.processesPerNode) / "
                                "self.training.sequenceParallelSize")
    assert json.dumps(rendered)[1:-1] in crd, f"the CRD does not check {rendered}"
