"""quant_lora_linear: the reference is peft's LoRA Linear over a QuantLinear (values and gradients), no
dequantized weight is saved for the backward, the TileLang glue with PyTorch stand-ins, a wrong plugin fails
the gate; on the GPU against float64 at Llama-3-8B shapes."""

import pytest
import torch
import torch.nn.functional as F

from tiletune.kernels import linear, registry
from tiletune.kernels import quant_linear
from tiletune.kernels import quant_lora_linear as op
from tiletune.numerics import gate
from tiletune.quant import dequantize, quantize


def inputs(lead, out_f, in_f, rank, kind="nf4", nested=True, dtype=torch.float32, device="cpu", seed=0):
    """x, the quantized W, A, B at the scales LoRA training sees (B of order one, so the term shows)."""
    g = torch.Generator(device).manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    q = quantize(draw(out_f, in_f, scale=in_f**-0.5).float(), kind, double=nested, dtype=dtype)
    return draw(*lead, in_f), q, draw(rank, in_f, scale=in_f**-0.5), draw(out_f, rank, scale=rank**-0.5)


def peft_math(x, w, b, a, bb, s):
    """peft's LoRA Linear forward (dropout 0) over a weight w."""
    return F.linear(x, w, b) + F.linear(F.linear(x, a), bb) * s


@pytest.mark.parametrize("kind,nested", [("nf4", True), ("fp4", False), ("int8", False)])
@pytest.mark.parametrize("lead,rank", [((5,), 8), ((2, 3), 3)])
def test_reference_is_peft_over_the_dequantized_weight_values_and_gradients(kind, nested, lead, rank):
    x, q, a, bb = inputs(lead, 24, 128, rank, kind, nested, torch.float64)
    b = torch.randn(24, dtype=torch.float64)
    dy = torch.randn(*lead, 24, dtype=torch.float64)
    results = []
    for fn in (lambda x, a, bb: op.quant_lora_linear(x, q, b, a, bb, 2.0),
               lambda x, a, bb: peft_math(x, dequantize(q), b, a, bb, 2.0)):
        leaves = [t.detach().requires_grad_() for t in (x, a, bb)]
        y = fn(*leaves)
        results.append((y, *torch.autograd.grad(y, leaves, dy)))
    for name, got, want in zip(("y", "dx", "dA", "dB"), *results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_no_dequantized_weight_is_saved_and_the_base_gets_no_gradient():
    x, q, a, bb = inputs((7,), 16, 64, 4)
    leaves = [t.requires_grad_() for t in (x, a, bb)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op.quant_lora_linear(x, q, None, a, bb, 2.0).sum().backward()
    assert not any(t.is_floating_point() and t.shape == (16, 64) for t in saved)
    assert all(t.grad is not None for t in leaves) and q.data.grad is None


@pytest.mark.parametrize("kind,nested", [("nf4", True), ("int8", False)])
def test_tilelang_glue_with_torch_stand_ins_matches_the_reference(monkeypatch, kind, nested):
    from test_quant_linear import _torch_kernel

    monkeypatch.setattr(quant_linear._tilelang, "compiled", lambda key, build: _torch_kernel(*key[1:6], key[6]))
    monkeypatch.setattr(linear, "run_gemm", linear.torch_gemm)
    x, q, a, bb = inputs((77,), 40, 192, 8, kind, nested)
    args = (*quant_linear.weight_args(q), torch.randn(40), a, bb, 2.0)
    y, xa = op.tilelang_forward(x, *args)
    y_ref, xa_ref = op.reference_forward(x, *args)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(xa, xa_ref)
    dy = torch.randn_like(y)
    backward_args = (*quant_linear.weight_args(q), a, bb, 2.0)
    for name, got, want in zip(("dx", "dA", "dB"), op.tilelang_backward(dy, x, xa, *backward_args),
                               op.reference_backward(dy, x, xa_ref, *backward_args)):
        # float32 sums over the 77 tokens in another order: relative to the largest element
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=name)


@pytest.fixture
def scaled_plugin():
    @registry.register("quant_lora_linear", "scaling_1_01")
    def scaled(x, *rest):
        """The reference with the LoRA scaling 1% too large."""
        return op.reference_forward(x, *rest[:-1], rest[-1] * 1.01)

    yield "scaling_1_01"
    registry._impls["quant_lora_linear"].pop("scaling_1_01")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_wrong_kernel_fails_the_gate_and_the_reference_passes(scaled_plugin, dtype):
    x, q, a, bb = inputs((77,), 72, 192, 8, dtype=dtype)
    ref = peft_math(*(t.double() for t in (x, dequantize(q))), None, a.double(), bb.double(), 2.0)
    torch_out = peft_math(x, dequantize(q), None, a, bb, 2.0)
    assert gate(op.quant_lora_linear(x, q, None, a, bb, 2.0, "reference"), torch_out, ref).passed
    verdict = gate(op.quant_lora_linear(x, q, None, a, bb, 2.0, scaled_plugin), torch_out, ref)
    assert not verdict.passed and verdict.ratio > 2


# ---- on the GPU -----------------------------------------------------------------------------------

LLAMA3_8B = {"q_proj": (4096, 4096), "v_proj": (1024, 4096), "down_proj": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [8192, 77])
@pytest.mark.parametrize("module", list(LLAMA3_8B))
def test_tilelang_matches_float64(dtype, tokens, module):
    from _gpu_check import check

    out_f, in_f = LLAMA3_8B[module]
    x, q, a, bb = inputs((tokens,), out_f, in_f, 8, dtype=dtype, device="cuda")
    w = dequantize(q)
    check("quant_lora_linear", f"{module} nf4 tokens={tokens} r=8", dtype,
          [x.requires_grad_(), w, a.requires_grad_(), bb.requires_grad_()],
          lambda x, w, a, bb: peft_math(x, w, None, a, bb, 2.0),
          lambda x, w, a, bb: op.quant_lora_linear(x, q, None, a, bb, 2.0, impl="tilelang", strict=True),
          ["y", "dx", "dA", "dB"])
