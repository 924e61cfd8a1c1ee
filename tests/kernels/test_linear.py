"""linear: reference semantics and autograd on the CPU; the TileLang GEMMs on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from tiletune.kernels import linear as op


def test_gradcheck_float64():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: op.linear(x, w, b), (x, w, b))


def test_frozen_weight_skips_dweight():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8)
    op.linear(x, w).sum().backward()
    assert x.grad is not None and w.grad is None
    torch.testing.assert_close(x.grad, torch.ones(4, 5) @ w)


@pytest.mark.parametrize("weight_trains", [False, True])
def test_input_is_saved_only_when_the_weight_trains(weight_trains):
    x = torch.randn(3, 7, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=weight_trains)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = op.linear(x, w)
    assert (x.numel() in saved) == weight_trains
    y.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, (2 * F.linear(x, w)) @ w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,out_f,in_f", [(1, 1024, 4096), (77, 1024, 4096), (5000, 1024, 4096),
                                               (8192, 1024, 4096), (77, 1032, 520)])
def test_tilelang_matches_float64(dtype, tokens, out_f, in_f):
    from _gpu_check import check

    x = torch.randn(tokens, in_f, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(out_f, in_f, device="cuda") / in_f**0.5).to(dtype).requires_grad_()
    check("linear", f"tokens={tokens} {out_f}x{in_f}", dtype, [x, w],
          F.linear,
          lambda x, w: op.linear(x, w, impl="tilelang", strict=True),
          ["y", "dx", "dweight"])


@pytest.mark.gpu
def test_tilelang_frozen_weight_runs_dgrad_only():
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    op.linear(x, w, impl="tilelang", strict=True).float().square().sum().backward()
    assert w.grad is None and torch.isfinite(x.grad).all()
