"""The numerical gate: PyTorch itself passes, a deliberately wrong kernel fails."""

import pytest
import torch

from tiletune.kernels import registry, rms_norm
from tiletune.kernels.gate import errors, gate


@pytest.fixture
def scaled_plugin():
    @registry.register("rms_norm", "scaled_1_01")
    def scaled(x, weight, eps):
        """The reference scaled by 1.01: wrong by 1%."""
        return rms_norm.reference_forward(x, weight, eps) * 1.01

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
