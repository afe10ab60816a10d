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


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_resume_slots_match_torch_and_take_no_optimizer_step(fused):
    """init_state gives AdamW the state torch's state-dict helper would make, without its
    whole optimizer step on zero gradients (seconds per 100M parameters on a CPU, at every
    resume): a load into either fills the same keys, shapes, dtypes and devices."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from sftjob_trainer.optim import build_optimizer, init_state

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        return model, build_optimizer(model.parameters(), OptimConfig(lr=1e-3, weight_decay=0.1), fused=fused)

    model, ours = model_and_optimizer()
    init_state(ours)
    ours.step = lambda *a, **k: pytest.fail("a resume must not run an optimizer step")
    _, ours_sd = get_state_dict(model, ours)
    model2, theirs = model_and_optimizer()
    _, theirs_sd = get_state_dict(model2, theirs)   # torch's way: one step with lr 0
    assert ours_sd["state"].keys() == theirs_sd["state"].keys()
    for key, slots in theirs_sd["state"].items():
        assert slots.keys() == ours_sd["state"][key].keys()
        for name, t in slots.items():
            o = ours_sd["state"][key][name]
            assert (o.shape, o.dtype, o.device) == (t.shape, t.dtype, t.device), (key, name)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
