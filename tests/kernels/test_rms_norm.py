"""rms_norm: reference semantics and autograd on the CPU; the TileLang kernels on the GPU."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tiletune.kernels import rms_norm as op


def test_reference_matches_transformers():
    norm = LlamaRMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    norm = norm.to(torch.bfloat16)
    torch.testing.assert_close(op.rms_norm(x, norm.weight, 1e-6), norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offset_reference_matches_gemma(dtype):
    """Gemma's x·(1 + w) norm, computed in fp32 and rounded once, bit for bit; its gradients as autograd's."""
    norm = Gemma3RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight, std=0.1)
    norm = norm.to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    torch.testing.assert_close(op.rms_norm(x, norm.weight, 1e-6, offset=1.0), norm(x), rtol=0, atol=0)
    x64 = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 16, dtype=torch.float64)
    got = torch.autograd.grad(op.rms_norm(x64, w64, 1e-6, offset=1.0), (x64, w64), dy)
    want = torch.autograd.grad(Gemma3RMSNorm(16, eps=1e-6).double()._norm(x64) * (1 + w64), (x64, w64), dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gradcheck_float64(offset):
    x = torch.randn(4, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: op.rms_norm(x, w, 1e-5, offset=offset), (x, w))


def test_frozen_weight_gets_no_grad():
    x = torch.randn(5, 16, requires_grad=True)
    w = torch.randn(16)
    op.rms_norm(x, w, 1e-5).sum().backward()
    assert x.grad is not None and w.grad is None


def test_fallback_on_cpu_is_the_reference():
    x, w = torch.randn(5, 16), torch.randn(16)
    torch.testing.assert_close(op.rms_norm(x, w, 1e-5, impl="tilelang"), op.reference_forward(x, w, 1e-5), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (77, 4096), (5000, 4096), (8192, 4096), (77, 128), (5000, 128)])
def test_tilelang_matches_float64(dtype, tokens, hidden):
    from _gpu_check import check

    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()
    check("rms_norm", f"tokens={tokens} hidden={hidden}", dtype, [x, w],
          lambda x, w: op.reference_forward(x, w, 1e-5),
          lambda x, w: op.rms_norm(x, w, 1e-5, impl="tilelang", strict=True),
          ["y", "dx", "dweight"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(77, 3840), (8192, 3840), (5000, 256)])  # Gemma-3-12B's hidden, a head_dim
def test_tilelang_offset_matches_float64(dtype, tokens, hidden):
    from _gpu_check import check

    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = (0.1 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()  # Gemma's weights sit around 0
    check("rms_norm", f"offset tokens={tokens} hidden={hidden}", dtype, [x, w],
          lambda x, w: op.reference_forward(x, w, 1e-6, 1.0),
          lambda x, w: op.rms_norm(x, w, 1e-6, impl="tilelang", strict=True, offset=1.0),
          ["y", "dx", "dweight"])
