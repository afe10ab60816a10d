import pytest

from sftjob_contract.config import OptimConfig
from sftjob_trainer.optim import lr_factor

pytestmark = pytest.mark.unit


def test_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.1, lr_scheduler="cosine", min_lr_ratio=0.1)
    f = [lr_factor(cfg, s, 100) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)


def test_wsd_holds_then_decays():
    cfg = OptimConfig(lr=1.0, lr_scheduler="wsd", wsd_decay_ratio=0.2)
    f = [lr_factor(cfg, s, 50) for s in range(50)]
    assert f[:40] == [1.0] * 40
    assert f[-1] == pytest.approx(0.0) and f[40] < 1.0


def test_constant():
    cfg = OptimConfig(lr=1.0, lr_scheduler="constant")
    assert {lr_factor(cfg, s, 10) for s in range(10)} == {1.0}
