"""lora_linear: reference semantics and autograd on the CPU, the TileLang glue with a PyTorch stand-in for
the GEMM, a wrong plugin failing the gate, and the TileLang kernels against float64 on the GPU."""

import pytest
import torch

from tiletune.kernels import linear, registry
from tiletune.kernels import lora_linear as op
from tiletune.numerics import errors, gate


def inputs(lead: tuple[int, ...], out_f: int, in_f: int, rank: int, dtype=torch.float32, adapter_dtype=torch.float32,
           bias: bool = True, seed: int = 0):
    """x, W, b, A, B drawn so that the base and the low-rank term are both of order one."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, to=dtype):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(to)

    return (draw(*lead, in_f), draw(out_f, in_f, scale=in_f**-0.5), draw(out_f) if bias else None,
            draw(rank, in_f, scale=in_f**-0.5, to=adapter_dtype), draw(out_f, rank, scale=rank**-0.5, to=adapter_dtype))


def float64_math(x, w, b, a, bb, s):
    """The LoRA Linear forward written out in float64."""
    x, w, a, bb = (t.double() for t in (x, w, a, bb))
    y = x @ w.t() + s * (x @ a.t()) @ bb.t()
    return y + b.double() if b is not None else y


def grads(fn, x, a, bb, dy):
    leaves = [t.detach().requires_grad_() for t in (x, a, bb)]
    y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype)))


@pytest.mark.parametrize("lead,out_f,in_f,rank", [((1,), 40, 24, 8), ((77,), 72, 200, 3), ((2, 5), 48, 136, 16),
                                                  ((3, 7, 11), 24, 16, 8)])
def test_reference_matches_float64_math_forward_and_grads(lead, out_f, in_f, rank):
    x, w, b, a, bb = inputs(lead, out_f, in_f, rank, dtype=torch.float64, adapter_dtype=torch.float64)
    dy = torch.randn(*lead, out_f, dtype=torch.float64)
    got = grads(lambda x, a, bb: op.lora_linear(x, w, b, a, bb, 2.0), x, a, bb, dy)
    want = grads(lambda x, a, bb: float64_math(x, w, b, a, bb, 2.0), x, a, bb, dy)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)


def test_gradcheck_float64():
    x, w, b, a, bb = inputs((2, 3), 5, 8, 3, dtype=torch.float64, adapter_dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, a, bb)]
    assert torch.autograd.gradcheck(lambda x, a, bb: op.lora_linear(x, w, b, a, bb, 0.5), leaves)


@pytest.mark.parametrize("rank", [8, 3, 16])
def test_float32_adapters_with_bf16_activations(rank):
    """Under autocast the adapters stay float32: the op computes in bf16 and returns dA, dB in float32."""
    x, w, b, a, bb = inputs((77,), 72, 200, rank, dtype=torch.bfloat16)
    dy = torch.randn(77, 72, dtype=torch.float64)
    got = grads(lambda x, a, bb: op.lora_linear(x, w, b, a, bb, 2.0), x, a, bb, dy)
    want = grads(lambda x, a, bb: float64_math(x, w, b, a, bb, 2.0), x, a, bb, dy)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, want):
        assert errors(g, r).rel_l2 < 1e-2, name  # bf16's guide value (design.md)


def test_frozen_base_gets_no_gradient_and_xa_is_not_an_output():
    x, w, b, a, bb = inputs((6,), 10, 8, 2)
    for leaf in (x, w, a, bb):
        leaf.requires_grad_()
    op.lora_linear(x, w, b, a, bb, 1.0).sum().backward()
    assert w.grad is None and all(t.grad is not None for t in (x, a, bb))


def _checked_torch_gemm(kind, a, b, out, out_features, in_features, low_rank=()):
    """linear.torch_gemm, after checking the low-rank operands are laid out as the kernel needs them."""
    if low_rank:
        low, high = low_rank
        assert low.shape[1] % 16 == 0 and low.is_contiguous() and high.is_contiguous()
    return linear.torch_gemm(kind, a, b, out, out_features, in_features, low_rank)


@pytest.mark.parametrize("lead,rank", [((77,), 8), ((2, 5), 3), ((1,), 16)])
def test_tilelang_glue_with_a_torch_gemm_matches_the_reference(monkeypatch, lead, rank):
    """Padding, transposes and the torch matmuls around the GEMM, checked without a GPU."""
    monkeypatch.setattr(linear, "run_gemm", _checked_torch_gemm)
    x, w, b, a, bb = inputs(lead, 48, 40, rank, dtype=torch.float64, adapter_dtype=torch.float32)
    y, xa = op.tilelang_forward(x, w, b, a, bb, 2.0)
    y_ref, xa_ref = op.reference_forward(x, w, b, a, bb, 2.0)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(xa, xa_ref)
    dy = torch.randn_like(y)
    for name, got, want in zip(("dx", "dA", "dB"), op.tilelang_backward(dy, x, xa, w, a, bb, 2.0),
                               op.reference_backward(dy, x, xa_ref, w, a, bb, 2.0)):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, msg=name)


def lora_update_share(forward, tokens: int, out_f: int, in_f: int, device: str = "cpu", rank: int = 8) -> float:
    """How much of a first-step-sized LoRA update reaches the bf16 output: the regression coefficient of
    y(B) - y(B = 0) on the exact low-rank term (1: all of it, on average; 0: lost to rounding).

    B = ±1e-4 is AdamW's first step (lr 1e-4) from peft's B = 0; the term is then ~1e-3 of the output,
    below half a bf16 step of most outputs, so a second rounding after the base product drops it.
    """
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, in_f, generator=g, device=device).bfloat16()
    w = (torch.randn(out_f, in_f, generator=g, device=device) * 0.02).bfloat16()
    a = torch.randn(rank, in_f, generator=g, device=device) / in_f**0.5
    b = 1e-4 * torch.randn(out_f, rank, generator=g, device=device).sign()
    moved, start = (forward(x, w, None, a, bb, 2.0).double() for bb in (b, torch.zeros_like(b)))
    exact = (x @ a.bfloat16().t()).double() @ (2.0 * b).bfloat16().double().t()
    return (((moved - start) * exact).sum() / (exact * exact).sum()).item()


def test_one_rounding_keeps_a_small_lora_update_that_peft_rounding_drops(monkeypatch):
    """Why lora_linear trains faster than stock peft from B = 0 in bf16 (the kernel adds the LoRA term in its
    float32 accumulator and rounds once); peft's rounding, the reference, keeps a fraction."""
    monkeypatch.setattr(linear, "run_gemm", _checked_torch_gemm)
    kernel = lora_update_share(lambda *inputs: op.tilelang_forward(*inputs)[0], 1024, 1024, 4096)
    peft = lora_update_share(lambda *inputs: op.reference_forward(*inputs)[0], 1024, 1024, 4096)
    assert abs(kernel - 1) < 0.02 and peft < 0.5, (kernel, peft)


@pytest.fixture
def scaled_plugin():
    @registry.register("lora_linear", "scaling_1_01")
    def scaled(x, weight, bias, lora_a, lora_b, scaling):
        """The reference with the scaling 1% too large."""
        return op.reference_forward(x, weight, bias, lora_a, lora_b, scaling * 1.01)

    yield "scaling_1_01"
    registry._impls["lora_linear"].pop("scaling_1_01")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wrong_scaling_fails_the_gate_and_the_reference_passes(scaled_plugin, dtype):
    x, w, b, a, bb = inputs((77,), 72, 200, 8, dtype=dtype, adapter_dtype=dtype)
    ref = float64_math(x, w, b, a, bb, 2.0)
    torch_out = op.reference_forward(x, w, b, a, bb, 2.0)[0]
    assert gate(op.lora_linear(x, w, b, a, bb, 2.0, "reference"), torch_out, ref).passed
    verdict = gate(op.lora_linear(x, w, b, a, bb, 2.0, scaled_plugin), torch_out, ref)
    assert not verdict.passed and verdict.ratio > 2


def test_tilelang_falls_back_to_the_reference_off_gpu():
    x, w, b, a, bb = inputs((5,), 16, 8, 2)
    torch.testing.assert_close(op.lora_linear(x, w, b, a, bb, 2.0, "tilelang"), op.lora_linear(x, w, b, a, bb, 2.0))
    assert registry.get("lora_linear", "tilelang").unavailable() or op.tilelang_unsupported(x, w, b, a, bb, 2.0)


# ---- on the GPU -----------------------------------------------------------------------------------

LLAMA3_8B = {"q_proj": (4096, 4096), "v_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("tokens", [8192, 77, 1000])
@pytest.mark.parametrize("module", list(LLAMA3_8B))
def test_tilelang_matches_float64(dtype, rank, tokens, module):
    from _gpu_check import check

    out_f, in_f = LLAMA3_8B[module]
    x = torch.randn(tokens, in_f, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(out_f, in_f, device="cuda") / in_f**0.5).to(dtype)
    a = (torch.randn(rank, in_f, device="cuda") / in_f**0.5).to(dtype).requires_grad_()
    bb = (torch.randn(out_f, rank, device="cuda") / rank**0.5).to(dtype).requires_grad_()
    check("lora_linear", f"{module} tokens={tokens} r={rank}", dtype, [x, w, a, bb],
          lambda x, w, a, bb: op.reference_forward(x, w, None, a, bb, 2.0)[0],
          lambda x, w, a, bb: op.lora_linear(x, w, None, a, bb, 2.0, impl="tilelang", strict=True),
          ["y", "dx", "dA", "dB"])


@pytest.mark.gpu
def test_tilelang_float32_adapters_bias_and_3d_input():
    """Mixed dtypes as under autocast (float32 adapters, bf16 x and W), a bias and a batch dimension."""
    x, w, b, a, bb = (t.cuda() for t in inputs((3, 333), 1032, 520, 3, dtype=torch.bfloat16))
    dy = torch.randn(3, 333, 1032, device="cuda", dtype=torch.float64)
    got = grads(lambda x, a, bb: op.lora_linear(x, w, b, a, bb, 2.0, "tilelang", True), x, a, bb, dy)
    want = grads(lambda x, a, bb: float64_math(x, w, b, a, bb, 2.0), x, a, bb, dy)
    bar = grads(lambda x, a, bb: op.lora_linear(x, w, b, a, bb, 2.0), x, a, bb, dy)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    for name, g, r, t in zip(("y", "dx", "dA", "dB"), got, want, bar):
        assert gate(g, t, r).passed, name


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["q_proj", "v_proj"])
def test_tilelang_keeps_a_small_lora_update(module):
    """The kernel's epilogue carries a first-step-sized LoRA update into the bf16 output unbiased (8192 tokens)."""
    out_f, in_f = LLAMA3_8B[module]
    share = lora_update_share(lambda *inputs: op.lora_linear(*inputs, impl="tilelang", strict=True), 8192, out_f, in_f,
                              device="cuda")
    assert abs(share - 1) < 0.02, share
