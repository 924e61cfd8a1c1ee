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


@pytest.mark.parametrize("name", OPS)
def test_packed_form_gradcheck_and_the_models_values(name):
    """The packed custom op (Phi-3's fused gate_up_proj output read whole): autograd in float64, and bit for bit the
    model's own activation of the chunked halves in bf16, its gradient arriving packed."""
    packed = getattr(torch.ops.tiletune, f"{name}_packed")
    gu = torch.randn(3, 5, 48, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda gu: packed(gu, "reference", False), (gu,))
    _, act = OPS[name]
    gu = (3 * torch.randn(7, 64)).bfloat16().requires_grad_()
    y = packed(gu, "tilelang", False)  # off the GPU: the reference
    gate_, up = gu.detach().chunk(2, dim=-1)
    torch.testing.assert_close(y, act(gate_) * up, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y, gu, torch.ones_like(y))
    assert grad.shape == gu.shape and grad.is_contiguous()


def test_phi3s_fused_mlp_runs_the_packed_form():
    """The swiglu binding on Phi-3's fused gate_up_proj runs the packed op, not the halves' (no chunk copies), with
    the stock model's loss and gradients."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from tiletune.patch import apply_kernels

    config = Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config)
    tokens = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = step()
    report = apply_kernels(model, {"swiglu": "reference"})
    with torch.profiler.profile() as profile:
        got, got_grads = step()
    report.revert()
    ran = {event.key for event in profile.key_averages()}
    assert "tiletune::swiglu_packed" in ran and "tiletune::swiglu" not in ran
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("rows, inter", [(77, 8192), (4096, 8192), (5, 64)])  # 8192: Phi-3-mini's intermediate
def test_packed_custom_op_matches_float64(name, rows, inter):
    """The packed custom op as the Phi-3 binding calls it (strict: the TileLang kernels, no silent fallback) against
    float64 through the shared GPU check."""
    from _gpu_check import check

    _, act = OPS[name]
    packed = getattr(torch.ops.tiletune, f"{name}_packed")

    def torch_way(gu):
        gate_, up = gu.chunk(2, dim=-1)
        return act(gate_) * up

    gu = (2 * torch.randn(rows, 2 * inter, device="cuda")).bfloat16().requires_grad_()
    check(f"{name}_packed", f"{rows}x{inter}", torch.bfloat16, [gu], torch_way, lambda gu: packed(gu, "tilelang", True),
          ["y", "d gate_up"])


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


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("rows,inter", [(1, 768), (77, 768), (65536, 768), (300, 14336), (5, 64), (1000, 1344)])
@pytest.mark.parametrize("scaled", [False, True])
def test_packed_kernels_match_float64(name, rows, inter, scaled):
    """The packed [gate | up] kernels (the MoE experts' activation) against float64, with and without the row scale
    of the backward, and the rows' dots of dy with the output; the gate of each output against torch's own bf16
    computation of the same."""
    from _gpu_check import poison_allocator

    act = {"swiglu": swiglu.SILU, "geglu": geglu.GELU_TANH}[name]
    fn = OPS[name][1]
    gu = (2 * torch.randn(rows, 2 * inter, device="cuda")).to(torch.bfloat16)
    dy = torch.randn(rows, inter, device="cuda").to(torch.bfloat16)
    scale = torch.rand(rows, device="cuda") if scaled else None

    def torch_way(gu, dy, scale):
        gu = gu.detach().requires_grad_()
        gate_, up = gu.chunk(2, dim=-1)
        y = fn(gate_) * up
        upstream = dy if scale is None else dy * scale[:, None].to(dy.dtype)
        (grad,) = torch.autograd.grad(y, gu, upstream)
        return y.detach(), grad

    ref_y, ref_d = torch_way(gu.double(), dy.double(), None if scale is None else scale.double())
    bar_y, bar_d = torch_way(gu, dy, scale)
    # each row's dot of dy with the output (the MoE routing weights' gradient): torch's way is a bf16 batched GEMM of
    # the rounded output, as the experts computed it before the kernel summed it
    ref_dots = (dy.double() * ref_y).sum(-1)
    bar_dots = torch.bmm(bar_y.view(rows, 1, inter), dy.view(rows, inter, 1)).view(rows)
    poison_allocator()
    y = swiglu.tilelang_packed_forward(act, gu)
    d = swiglu.tilelang_packed_backward(act, dy, gu, scale)
    d_too, dots = swiglu.tilelang_packed_backward_dots(act, dy, gu, scale)
    assert torch.equal(d, d_too), "the kernel with the rows' dots computes another d gate_up"
    for what, k, t, r in (("y", y, bar_y, ref_y), ("d gate_up", d, bar_d, ref_d), ("row dots", dots, bar_dots, ref_dots)):
        verdict = gate(k, t, r)
        assert verdict.passed, f"{name} rows={rows} inter={inter} scaled={scaled} {what}: {verdict}"
