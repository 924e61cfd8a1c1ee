"""The gated MLP ops (swiglu.define_gated): swiglu and geglu against the models' own activations, autograd,
a wrong activation failing the gate; the TileLang kernels against float64 on the GPU."""

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from tiletune.kernels import geglu, registry, swiglu
from tiletune.numerics import gate

# op name -> (public function, the activation as transformers' MLPs compute it)
OPS = {"swiglu": (swiglu.swiglu, ACT2FN["silu"]), "geglu": (geglu.geglu, ACT2FN["gelu_pytorch_tanh"])}


@pytest.mark.parametrize("name", OPS)
def test_gradcheck_float64(name):
    fn, _ = OPS[name]
    g = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: fn(g, u), (g, u))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_matches_the_models_activation_bit_for_bit(name, dtype):
    fn, act = OPS[name]
    g, u = (3 * torch.randn(4, 32)).to(dtype), torch.randn(4, 32).to(dtype)
    torch.testing.assert_close(fn(g, u, impl="tilelang"), act(g) * u, rtol=0, atol=0)  # off the GPU: the reference


def test_geglu_derivative_is_autograds():
    g = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(F.gelu(g, approximate="tanh").sum(), g)
    torch.testing.assert_close(geglu.GELU_TANH.grad(g.detach()), want, rtol=1e-12, atol=1e-12)


def test_silu_passed_as_gelu_fails_the_gate():
    """A geglu implementation computing silu instead: the gate must catch it."""
    registry.add(registry.Impl("geglu", "silu_by_mistake", lambda g, u: F.silu(g) * u))
    try:
        g, u = torch.randn(77, 64, dtype=torch.bfloat16), torch.randn(77, 64, dtype=torch.bfloat16)
        ref = F.gelu(g.double(), approximate="tanh") * u.double()
        verdict = gate(geglu.geglu(g, u, "silu_by_mistake"), F.gelu(g, approximate="tanh") * u, ref)
        assert not verdict.passed and gate(geglu.geglu(g, u), F.gelu(g, approximate="tanh") * u, ref).passed
    finally:
        registry._impls["geglu"].pop("silu_by_mistake")


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(1, 14336), (77, 14336), (5000, 14336), (8192, 14336), (77, 1000), (8192, 15360)])
def test_tilelang_matches_float64(name, dtype, tokens, inter):
    from _gpu_check import check

    fn, act = OPS[name]
    g = (2 * torch.randn(tokens, inter, device="cuda")).to(dtype).requires_grad_()
    u = torch.randn(tokens, inter, device="cuda", dtype=dtype, requires_grad=True)
    check(name, f"tokens={tokens} inter={inter}", dtype, [g, u],
          lambda g, u: act(g) * u,
          lambda g, u: fn(g, u, impl="tilelang", strict=True),
          ["y", "dgate", "dup"])
