"""The precision policy: PyTorch itself passes, a deliberately wrong kernel fails, NaN never passes, and the
ulp floor passes a rounding step or two of a result the stock run reproduces exactly, whatever its magnitude."""

import pytest
import torch

from tiletune.kernels import registry, rms_norm
from tiletune.numerics import SCALAR_FLOOR_ULPS, compare_runs, errors, gate, judge, ulp

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture
def scaled_plugin():
    @registry.register("rms_norm", "scaled_1_01")
    def scaled(x, weight, eps, offset):
        """The reference scaled by 1.01: wrong by 1%."""
        return rms_norm.reference_forward(x, weight, eps, offset) * 1.01

    yield "scaled_1_01"
    registry._impls["rms_norm"].pop("scaled_1_01")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wrong_kernel_fails_and_reference_passes(scaled_plugin, dtype):
    x = torch.randn(77, 256, dtype=dtype)
    w = (1 + 0.1 * torch.randn(256)).to(dtype)
    ref = rms_norm.reference_forward(x.double(), w.double(), 1e-5)
    torch_out = rms_norm.reference_forward(x, w, 1e-5)
    assert gate(rms_norm.rms_norm(x, w, 1e-5, "reference"), torch_out, ref).passed
    verdict = gate(rms_norm.rms_norm(x, w, 1e-5, scaled_plugin), torch_out, ref)
    assert not verdict.passed and verdict.ratio > 2


def test_nan_never_passes():
    ref = torch.randn(100, dtype=torch.float64)
    bad = ref.clone()
    bad[3] = float("nan")
    assert not gate(bad, ref.float(), ref).passed
    assert not errors(bad, ref).finite


def test_gate_rules():
    ref = torch.randn(1000, dtype=torch.float64)
    stock = errors(ref.float().double() + 1e-7 * torch.randn(1000, dtype=torch.float64), ref)
    assert judge("x", stock, errors(ref * 1.01, ref), k=2, floor_ulps=2).passed is False
    assert judge("x", stock, stock, k=2, floor_ulps=2).passed is True
    nan = ref.clone()
    nan[3] = float("nan")
    assert judge("x", stock, errors(nan, ref), k=2, floor_ulps=float("inf")).passed is False


def test_a_scalar_is_judged_by_its_own_floor():
    """A float32 loss a few rounding steps off passes against a bar that hit it exactly (one draw of rounding noise);
    beyond SCALAR_FLOOR_ULPS it fails, and a tensor of many values keeps the elementwise floor."""
    loss = torch.tensor(6.5, dtype=torch.float64)
    step = float(ulp(loss, torch.float32))
    values = torch.full((8,), 6.5, dtype=torch.float64)

    def verdict(name, ref, ulps):
        return compare_runs({name: ref.float()}, {name: (ref + ulps * step).float()}, {name: ref}, torch.float32)[0]

    assert verdict("loss", loss, 3).passed and verdict("loss", loss, SCALAR_FLOOR_ULPS).passed
    assert not verdict("loss", loss, SCALAR_FLOOR_ULPS + 1).passed
    assert not verdict("values", values, 3).passed


@pytest.mark.parametrize("dtype", DTYPES)
def test_ulp_is_the_spacing_of_the_dtype_zero_and_subnormals_included(dtype):
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, info.tiny * info.eps, 3 * info.tiny * info.eps, info.tiny / 3, info.tiny, 0.75, 1.0,
                            1.5, 1000.0], dtype=torch.float64)  # fmt: skip
    values = torch.cat([special, torch.randn(1000, dtype=torch.float64).abs() * 100]).to(dtype)
    spacing = torch.nextafter(values, torch.tensor(float("inf"), dtype=dtype)).double() - values.double()
    assert torch.equal(ulp(values.double(), dtype), spacing)
    assert torch.equal(ulp(-values.double(), dtype), spacing)
    assert ulp(torch.zeros(1, dtype=torch.float64), dtype).item() == info.tiny * info.eps


def ulps_up(values: torch.Tensor, n: int) -> torch.Tensor:
    """`values` moved `n` representable numbers up, in their own dtype."""
    for _ in range(n):
        values = torch.nextafter(values, torch.full_like(values, float("inf")))
    return values


@pytest.mark.parametrize("n, passed", [(2, True), (3, False)])
def test_float32_ulps_off_a_result_the_stock_run_reproduces_exactly(n, passed):
    """A float32 loss summed in another order: stock error exactly zero, so only the ulp floor can pass it."""
    ref = torch.tensor([6.6, 1e-3, 1e3]).double()  # float32 values
    stock = errors(ref.float(), ref)
    verdict = judge("loss", stock, errors(ulps_up(ref.float(), n), ref))
    assert stock.rel_l2 == 0 and verdict.ratio == float("inf")
    assert verdict.patched.max_ulps == n and verdict.passed is passed


def test_ulps_scale_with_magnitude():
    """The same relative error at about 1e-3 and 1e3 (2**-10 and 2**10: the same mantissas) is as many ulps."""
    base = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    small, large = (errors((base * scale * (1 + 3e-7)).float(), base * scale) for scale in (2.0**-10, 2.0**10))
    assert small.rel_l2 == pytest.approx(large.rel_l2)
    assert small.max_ulps == large.max_ulps and 2 < small.max_ulps < 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wrong_result_fails_even_when_the_stock_error_is_zero(dtype):
    ref = torch.randn(1000, dtype=torch.float64).to(dtype).double()
    verdict = judge("x", errors(ref.to(dtype), ref), errors((ref * 1.05).to(dtype), ref))
    assert verdict.stock.rel_l2 == 0 and verdict.patched.max_ulps > 2 and not verdict.passed
