"""bf16 autocast with widened GEMMs: the arithmetic of a bf16 GEMM, at fp32 GEMM speed on CPUs without bf16."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sftjob_trainer import precision
from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig
from sftjob_trainer.data import SampleBuilder, SFTDataset
from sftjob_trainer.batching import collate

BF16 = torch.bfloat16
CPU = torch.device("cpu")


class _ProductDtypes(TorchDispatchMode):
    """Records the dtypes that matrix products and attention kernels run in."""

    KERNELS = ("mm", "addmm", "bmm", "linear", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward")

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.KERNELS:
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            self.seen.setdefault(name, set()).update(dtypes)
        return func(*args, **(kwargs or {}))


def _check_bf16_gemm(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None):
    """``got`` is what a bf16 GEMM returns for ``a @ b (+ bias)``: bf16 operands, a sum accumulated
    in fp32, one rounding to bf16. Compared with the exact (fp64) sum of the bf16 operands."""
    a, b = a.detach().to(BF16).double(), b.detach().to(BF16).double()
    exact = a @ b + (0 if bias is None else bias.detach().to(BF16).double())
    got = got.detach().reshape(exact.shape)
    assert got.dtype == BF16
    # bf16 neighbours of the correctly rounded result: distance in bit patterns
    steps = (got.view(torch.int16).int() - exact.to(BF16).view(torch.int16).int()).abs()
    assert (steps == 0).float().mean() > 0.97, "mostly the correctly rounded value"
    # the rest: off by no more than fp32 accumulation error of the products (near-cancellations)
    scale = a.abs() @ b.abs() + (0 if bias is None else bias.detach().to(BF16).double().abs())
    off = (got.double() - exact).abs()
    half_ulp = exact.abs() * torch.finfo(BF16).eps / 2
    assert (off <= half_ulp + 1e-5 * scale).all()


@pytest.mark.unit
def test_widened_linear_does_bf16_gemm_arithmetic_and_saves_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 96, generator=g, requires_grad=True)  # fp32 activations, as under autocast
    w = torch.randn(64, 96, generator=g, requires_grad=True)  # fp32 master weight
    b = torch.randn(64, generator=g, requires_grad=True)
    saved, products = [], _ProductDtypes()
    with torch.autocast("cpu", dtype=BF16), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.dtype) or t, lambda t: t), products:
        y = precision.widened_linear(x, w, b)
    assert y.dtype == BF16 and saved and set(saved) == {BF16}, "activations for backward stay bf16"
    _check_bf16_gemm(y, x.reshape(-1, 96), w.t(), b)

    grad_y = torch.randn(y.shape, generator=g).to(BF16)
    with products:
        y.backward(grad_y)
    assert products.seen and all(d == {torch.float32} for d in products.seen.values()), products.seen
    gy = grad_y.reshape(-1, 64)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32  # master dtypes
    _check_bf16_gemm(x.grad.to(BF16), gy, w)  # x.grad is the bf16 product widened back to fp32: exact
    _check_bf16_gemm(w.grad.to(BF16), gy.t(), x.reshape(-1, 96))
    assert torch.allclose(b.grad, gy.float().sum(0), rtol=1e-2)


@pytest.mark.unit
def test_widened_linear_is_plain_linear_outside_bf16_autocast():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 8, generator=g), torch.randn(4, 8, generator=g)
    assert torch.equal(precision.widened_linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.unit
@pytest.mark.parametrize(("device", "prec", "mode", "native", "want"), [
    ("cpu", "fp32", "widened", False, False),  # fp32 has no bf16 products
    ("cuda", "bf16", "auto", False, False),  # GPUs do bf16 natively
    ("cpu", "bf16", "native", False, False),
    ("cpu", "bf16", "widened", True, True),
    ("cpu", "bf16", "auto", False, True),
    ("cpu", "bf16", "auto", True, False),
])
def test_when_bf16_gemms_are_widened(monkeypatch, device, prec, mode, native, want):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert precision.use_widened_bf16(torch.device(device), prec, mode) is want


@pytest.mark.unit
@pytest.mark.parametrize(("cpuinfo", "want"), [
    ("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma avx512f\n", False),
    ("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n", True),
    ("vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n", True),
    ("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n", False),  # read, no x86 flags
    (None, True),   # no /proc/cpuinfo (not Linux): unknown, oneDNN's native path kept
])
def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, tmp_path, cpuinfo, want):
    import builtins

    from sftjob_trainer import cpu_blas

    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path != "/proc/cpuinfo":
            return real_open(path, *args, **kwargs)
        if cpuinfo is None:
            raise FileNotFoundError(path)
        (tmp_path / "cpuinfo").write_text(cpuinfo)
        return real_open(tmp_path / "cpuinfo", *args, **kwargs)

    monkeypatch.setattr(cpu_blas, "open", fake_open, raising=False)
    assert precision.cpu_has_native_bf16.__wrapped__() is want


def _model(assets, widen: bool, lora: bool = False, ckpt: bool = False):
    from sftjob_trainer.dist import World
    from sftjob_trainer.model import build_model

    path = str(assets / "model")
    lora_cfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]) if lora else LoraConfig()
    return build_model(ModelConfig(path=path, gradient_checkpointing=ckpt), lora_cfg, path,
                       World(0, 0, 1, CPU), widen_bf16=widen)


@pytest.fixture(scope="module")
def packed(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "model")
    f = str(assets / "data" / "chat_train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, DataConfig(train_files=[f], messages_key="messages", max_length=128)), "t")
    ids = [0, 1, 2, 3]
    return collate([ds.sample(i) for i in ids], ids, packing=True, pad_id=tok.pad_token_id)


def _loss_and_grads(model, mb, prec: str, products: _ProductDtypes | None = None):
    from sftjob_trainer.loss import ce_sum

    model.zero_grad()
    with products or contextlib.nullcontext():
        ce = ce_sum(model, mb, CPU, prec)
        ce.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return ce.item() / mb.n_targets, grads


@pytest.mark.unit
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "activation-checkpointing"])
def test_widened_model_matches_native_bf16_and_fp32(assets, packed, ckpt):
    """Same loss and gradients as native bf16 autocast, up to bf16 noise; the model's layout is unchanged."""
    from sftjob_trainer.loss import LossHead

    ref = _model(assets, widen=False)
    fp32_loss, fp32_grads = _loss_and_grads(ref, packed, "fp32")
    native = _ProductDtypes()
    native_loss, native_grads = _loss_and_grads(ref, packed, "bf16", native)
    assert BF16 in native.seen["mm"] and BF16 in native.seen["_scaled_dot_product_flash_attention_for_cpu"]
    model = _model(assets, widen=True, ckpt=ckpt)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is precision.WidenedBf16Linear for m in linears if not isinstance(m, LossHead))
    assert model.lm_head.widen_bf16 and set(model.state_dict()) == set(ref.state_dict())
    widened = _ProductDtypes()
    loss, grads = _loss_and_grads(model, packed, "bf16", widened)
    # every product of the forward and backward ran in fp32: linears, the loss head, attention
    assert set(widened.seen) >= {"mm", "_scaled_dot_product_flash_attention_for_cpu",
                                 "_scaled_dot_product_flash_attention_for_cpu_backward"}, widened.seen
    assert all(d == {torch.float32} for d in widened.seen.values()), widened.seen
    assert abs(loss - fp32_loss) < 2e-3 * fp32_loss and abs(loss - native_loss) < 2e-3 * fp32_loss
    for name, want in fp32_grads.items():
        err = (grads[name] - want).norm() / want.norm()
        native_err = (native_grads[name] - want).norm() / want.norm()
        # bf16 noise, and no worse than oneDNN's own bf16 path by more than that noise
        assert err < 0.05 and err < native_err + 0.02, (name, err.item(), native_err.item())
    # fp32 runs of the same model never see a bf16 product
    assert _loss_and_grads(model, packed, "fp32")[0] == pytest.approx(fp32_loss, abs=1e-6)


@pytest.mark.unit
def test_widened_lora_adapters(assets, packed):
    model = _model(assets, widen=True, lora=True)
    lora_layers = [m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert lora_layers and all(type(m) is precision.WidenedBf16Linear for m in lora_layers)
    loss, grads = _loss_and_grads(model, packed, "bf16")
    assert grads and all("lora_" in n for n in grads)
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    assert loss == pytest.approx(_loss_and_grads(model, packed, "fp32")[0], rel=2e-3)


@pytest.mark.distributed
def test_bf16_training_on_two_ranks_tracks_fp32(assets, tmp_path):
    """A real 2-rank FSDP2 run with widened bf16 products follows the fp32 run and exports."""
    from . import runner

    over = {"trainer.total_training_steps": 6, "data.shuffle": "false", "trainer.log_freq": 1}
    losses = {}
    for name, extra in {"fp32": {}, "bf16": {"trainer.precision": "bf16", "trainer.cpu_bf16_gemm": "widened"}}.items():
        out = tmp_path / name
        res = runner.run(runner.base_args(assets, out, **over, **extra), out, nproc=2)
        assert res.code == 0, res.why()
        losses[name] = [r["loss"] for r in res.steps()]
    assert len(losses["fp32"]) == len(losses["bf16"]) == 6
    assert losses["fp32"][-1] < losses["fp32"][0]
    assert max(abs(a - b) / a for a, b in zip(losses["fp32"], losses["bf16"])) < 0.02, losses
    assert (tmp_path / "bf16" / "hf" / "final" / "model.safetensors").exists()


@pytest.mark.unit
def test_widened_loss_head_over_several_chunks(monkeypatch):
    import torch.nn.functional as F

    import sftjob_trainer.loss as loss

    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 64 * 500)  # several chunks and a ragged last one
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 48, generator=g, requires_grad=True)
    weight = (0.2 * torch.randn(500, 48, generator=g)).requires_grad_()
    targets = torch.randint(0, 500, (300,), generator=g)
    products = _ProductDtypes()
    with torch.autocast("cpu", dtype=BF16), products:
        got = loss.linear_ce_sum(hidden, weight, targets, widen=True)
        got.backward()
    assert products.seen["mm"] == {torch.float32}
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    # reference: the same bf16 roundings (operands, logits), everything else exact
    h16, w16 = hidden.to(BF16).double(), weight.to(BF16).double()
    want = F.cross_entropy((h16 @ w16.t()).to(BF16).double(), targets, reduction="sum")
    assert got.item() == pytest.approx(want.item(), rel=1e-4)
    want_fp32 = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    want_fp32.backward()
    assert (gh - hidden.grad).norm() / hidden.grad.norm() < 0.02
    assert (gw - weight.grad).norm() / weight.grad.norm() < 0.02
