"""swiglu: reference semantics and autograd on the CPU; the TileLang kernels on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from tiletune.kernels import swiglu as op


def test_gradcheck_float64():
    g = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: op.swiglu(g, u), (g, u))


def test_reference_matches_silu_times_up():
    g, u = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(op.swiglu(g, u, impl="tilelang"), F.silu(g) * u, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(1, 14336), (77, 14336), (5000, 14336), (8192, 14336), (77, 1000)])
def test_tilelang_matches_float64(dtype, tokens, inter):
    from _gpu_check import check

    g = (2 * torch.randn(tokens, inter, device="cuda")).to(dtype).requires_grad_()
    u = torch.randn(tokens, inter, device="cuda", dtype=dtype, requires_grad=True)
    check("swiglu", f"tokens={tokens} inter={inter}", dtype, [g, u],
          lambda g, u: F.silu(g) * u,
          lambda g, u: op.swiglu(g, u, impl="tilelang", strict=True),
          ["y", "dgate", "dup"])
