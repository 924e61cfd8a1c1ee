"""quant_linear: reference semantics and autograd on the CPU (what is saved, what gets gradients), the
TileLang glue with PyTorch stand-ins, a wrong plugin failing the gate; on the GPU the dequantizing kernel
bit for bit against tiletune.quant.dequantize and the op against float64 at Llama-3-8B shapes."""

import pytest
import torch
import torch.nn.functional as F

from tiletune.kernels import registry
from tiletune.kernels import quant_linear as op
from tiletune.numerics import gate
from tiletune.quant import dequantize, quantize

FORMATS = [("nf4", True), ("nf4", False), ("fp4", True), ("int8", False)]


def weight(out_f: int, in_f: int, kind: str, nested: bool, dtype=torch.float32, device="cpu", seed: int = 0):
    """A weight drawn at Llama's init scale, and its quantized form dequantizing to `dtype`."""
    g = torch.Generator(device).manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g, device=device) * in_f**-0.5
    return w, quantize(w, kind, double=nested, dtype=dtype)


@pytest.mark.parametrize("kind,nested", FORMATS)
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_reference_is_a_linear_of_the_dequantized_weight(kind, nested, lead):
    _, q = weight(24, 128, kind, nested, torch.float64)
    x, b = torch.randn(*lead, 128, dtype=torch.float64, requires_grad=True), torch.randn(24, dtype=torch.float64)
    y = op.quant_linear(x, q, b)
    torch.testing.assert_close(y, F.linear(x, dequantize(q), b), rtol=0, atol=0)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(dx, dy @ dequantize(q), rtol=0, atol=0)


def test_only_the_packed_weight_is_saved_and_nothing_of_it_trains():
    _, q = weight(16, 64, "nf4", True)
    x = torch.randn(7, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op.quant_linear(x, q, torch.randn(16)).sum().backward()
    assert not any(t.shape == x.shape or t.is_floating_point() and t.numel() == 16 * 64 for t in saved)
    assert x.grad is not None and not q.data.requires_grad


def _torch_kernel(kind, out_features, in_features, blocksize, nested, dtype):
    """A PyTorch stand-in for the compiled dequantizing kernel with its argument layout (flat data, scales and
    output; the nested scale's product rounded before the offset is added, as the kernel does)."""
    per_scale = in_features if kind == "int8" else blocksize

    def run(data, scale, nested_code, nested_absmax, offset, table, out):
        groups = out.numel() // per_scale
        if nested:
            scale = (nested_code[scale.long()] * nested_absmax[torch.arange(groups) // 256]) + offset
        if kind == "int8":
            values = data.float().view(groups, per_scale)
        else:
            values = table[torch.stack([data >> 4, data & 15], dim=-1).long()].view(groups, per_scale)
        out.copy_((values * scale[:, None]).view(-1).to(out.dtype))
    return run


@pytest.mark.parametrize("kind,nested", FORMATS)
def test_tilelang_glue_with_torch_stand_ins_matches_the_reference(monkeypatch, kind, nested):
    """Argument layout of the dequantizing kernel (views, int8 scales, nested arguments) and the GEMMs around it."""
    monkeypatch.setattr(op._tilelang, "compiled", lambda key, build: _torch_kernel(*key[1:6], key[6]))
    _, q = weight(40, 256, kind, nested)
    args = op.weight_args(q)
    assert torch.equal(op.tilelang_weight(*args, dtype=torch.float32), dequantize(q))
    x, b = torch.randn(3, 256), torch.randn(40)
    torch.testing.assert_close(op.tilelang_forward(x, *args, b), op.reference_forward(x, *args, b))
    dy = torch.randn(3, 40)
    torch.testing.assert_close(op.tilelang_backward(dy, *args), op.reference_backward(dy, *args))


def test_tilelang_says_why_it_cannot_take_blocks_that_cross_rows():
    _, q = weight(8, 96, "nf4", False)  # 96 is not a multiple of the 64-element blocks
    x = torch.randn(2, 96)
    reason = op.tilelang_unsupported(x, *op.weight_args(q), None)
    assert reason  # off the GPU: the device; on it: the blocks
    assert registry.get("quant_linear", "tilelang").unavailable() or "does not divide in_features 96" in reason


@pytest.fixture
def scaled_plugin():
    @registry.register("quant_linear", "scale_1_01")
    def scaled(x, *weight_and_bias):
        """The reference with every weight 1% too large."""
        return op.reference_forward(x, *weight_and_bias) * 1.01

    yield "scale_1_01"
    registry._impls["quant_linear"].pop("scale_1_01")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_wrong_kernel_fails_the_gate_and_the_reference_passes(scaled_plugin, dtype):
    _, q = weight(72, 192, "nf4", True, dtype)
    x = torch.randn(77, 192).to(dtype)
    ref = F.linear(x.double(), dequantize(q).double())
    torch_out = F.linear(x, dequantize(q))
    assert gate(op.quant_linear(x, q, None, "reference"), torch_out, ref).passed
    verdict = gate(op.quant_linear(x, q, None, scaled_plugin), torch_out, ref)
    assert not verdict.passed and verdict.ratio > 2


# ---- on the GPU -----------------------------------------------------------------------------------

LLAMA3_8B = {"q_proj": (4096, 4096), "v_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("kind,nested", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(14336, 4096), (72, 192), (136, 64)])
def test_dequantize_kernel_is_bit_exact(kind, nested, dtype, shape):
    """Every element equal to tiletune.quant.dequantize (itself equal to bitsandbytes' dequantize_4bit)."""
    _, q = weight(*shape, kind, nested, dtype, "cuda", seed=1)
    got = op.tilelang_weight(*op.weight_args(q), dtype=dtype)
    assert torch.equal(got.view(torch.int16), dequantize(q).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [8192, 77])
@pytest.mark.parametrize("module", ["q_proj", "gate_proj", "down_proj"])
@pytest.mark.parametrize("kind,nested", [("nf4", True), ("int8", False)])
def test_tilelang_matches_float64(kind, nested, dtype, tokens, module):
    from _gpu_check import check

    out_f, in_f = LLAMA3_8B[module]
    _, q = weight(out_f, in_f, kind, nested, dtype, "cuda")
    x = torch.randn(tokens, in_f, device="cuda", dtype=dtype, requires_grad=True)
    w = dequantize(q)  # the reference's weight in every precision: the same quantized values
    check("quant_linear", f"{module} {kind} tokens={tokens}", dtype, [x, w],
          lambda x, w: F.linear(x, w),
          lambda x, w: op.quant_linear(x, q, None, impl="tilelang", strict=True),
          ["y", "dx"])
