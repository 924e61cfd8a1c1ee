"""attention: the reference against float64 math, autograd and the custom op on the CPU, packed sequences
(cu_seqlens) against SDPA's block-diagonal mask, wrong kernels failing the gate, the TileLang kernels'
lowering for every head_dim and dtype (and the packed variants), and the kernels against float64 on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from tiletune.kernels import _tilelang, registry
from tiletune.kernels import attention as op
from tiletune.numerics import gate

# (batch, heads_q, heads_kv, seq, head_dim): GQA ratios 1, 4 and 8, lengths off every tile
SHAPES = [(1, 4, 4, 1, 64), (2, 8, 2, 77, 64), (1, 8, 1, 130, 128), (2, 4, 1, 33, 128)]


def qkv(batch, heads_q, heads_kv, seq, head_dim, dtype=torch.float64, device="cpu", seed=0):
    """q, k, v in transformers' layout, as (1, 2) transposes of projection-shaped tensors."""
    g = torch.Generator(device).manual_seed(seed)

    def draw(heads):
        x = torch.randn(batch, seq, heads, head_dim, generator=g, device=device, dtype=torch.float32)
        return x.to(dtype).transpose(1, 2).requires_grad_()

    return draw(heads_q), draw(heads_kv), draw(heads_kv)


def naive(q, k, v, scale):
    """Causal GQA attention written out in float64: explicit mask, kv heads repeated."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def forward_and_grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_float64_math_forward_and_grads(shape):
    q, k, v = qkv(*shape)
    scale = shape[-1] ** -0.5
    dout = torch.randn(q.shape, dtype=torch.float64)
    got = forward_and_grads(lambda q, k, v: op.attention(q, k, v, scale), q, k, v, dout)
    want = forward_and_grads(lambda q, k, v: naive(q, k, v, scale), q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_lse_is_the_log_sum_exp_of_the_causal_scores_and_in_float32_for_bf16():
    q, k, v = qkv(2, 4, 2, 9, 64, dtype=torch.bfloat16)
    out, lse = torch.ops.tiletune.attention(q, k, v, 0.125, None, "reference", False)
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.125
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 4, 9)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


def test_output_strides_are_the_kernels_layout():
    """Every implementation returns (batch, seq, heads, d)-contiguous tensors viewed as (batch, heads, seq, d)."""
    q, k, v = (t.detach().contiguous() for t in qkv(2, 4, 2, 5, 64))  # even from bhsd-contiguous inputs
    out = op.attention(q, k, v, 0.125)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()


def test_gradcheck_float64():
    q, k, v = qkv(1, 4, 2, 5, 8)
    assert torch.autograd.gradcheck(lambda q, k, v: op.attention(q, k, v, 0.3), (q, k, v))


def test_opcheck_custom_op():
    q, k, v = qkv(2, 4, 2, 7, 16, dtype=torch.float32)
    torch.library.opcheck(torch.ops.tiletune.attention.default, (q, k, v, 0.25, None, "reference", False))


def test_tilelang_falls_back_to_the_reference_off_gpu():
    q, k, v = qkv(1, 4, 2, 6, 64, dtype=torch.float32)
    torch.testing.assert_close(op.attention(q, k, v, 0.125, "tilelang"), op.attention(q, k, v, 0.125))
    assert registry.get("attention", "tilelang").unavailable() or op.tilelang_unsupported(q, k, v, 0.125)


@pytest.mark.parametrize("arch,fwd,bwd", [("sm_90", 128, 64), ("sm_89", 64, 64), ("gfx942", 64, 32), ("gfx90a", 64, 32),
                                          ("gfx1100", 64, 32)])
def test_configs_per_architecture(arch, fwd, bwd):
    assert op.config_for(arch, "fwd")[0] == fwd and op.config_for(arch, "bwd")[0] == bwd
    assert op.config_for(arch, "fwd")[-1] == (arch == "gfx1100")  # probabilities staged in LDS on RDNA3 only


# ---- packed sequences (cu_seqlens) ----------------------------------------------------------------

# (heads_q, heads_kv, head_dim, cu_seqlens): length-1 segments, one segment over the whole row, only length-1
# segments, awkward lengths
PACKED = [(4, 2, 16, [0, 1, 2, 9, 10, 37]), (4, 4, 8, [0, 23]), (8, 1, 16, [0, 1, 2, 3, 4, 5]),
          (4, 2, 64, [0, 13, 14, 30, 31, 77])]


def block_diagonal(cu, device="cpu"):
    """The block-diagonal causal mask (seq, seq) of boundaries cu (a list): True where a query sees a key."""
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu))).to(device)
    return (segment[:, None] == segment[None]) & torch.ones(cu[-1], cu[-1], dtype=torch.bool, device=device).tril()


def naive_packed(q, k, v, scale, cu):
    """SDPA with the block-diagonal causal mask, in q's dtype (float64: the math backend)."""
    return F.scaled_dot_product_attention(q, k, v, block_diagonal(cu, q.device), scale=scale, enable_gqa=True)


def packed_qkv(heads_q, heads_kv, head_dim, cu, **kwargs):
    return qkv(1, heads_q, heads_kv, cu[-1], head_dim, **kwargs), torch.tensor(cu, dtype=torch.int32,
                                                                                 device=kwargs.get("device", "cpu"))


@pytest.mark.parametrize("case", PACKED, ids=lambda c: "-".join(map(str, c[3])))
def test_packed_reference_matches_sdpa_with_the_block_diagonal_mask(case):
    (q, k, v), cu = packed_qkv(*case)
    scale = case[2] ** -0.5
    dout = torch.randn(q.shape, dtype=torch.float64)
    got = forward_and_grads(lambda q, k, v: op.attention(q, k, v, scale, cu_seqlens=cu), q, k, v, dout)
    want = forward_and_grads(lambda q, k, v: naive_packed(q, k, v, scale, case[3]), q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_packed_gradcheck_and_lse():
    (q, k, v), cu = packed_qkv(4, 2, 8, [0, 1, 4, 5, 7])
    assert torch.autograd.gradcheck(lambda q, k, v: op.attention(q, k, v, 0.3, cu_seqlens=cu), (q, k, v))
    _, lse = op.reference_forward(q, k, v, 0.3, cu)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    want = scores.masked_fill(~block_diagonal([0, 1, 4, 5, 7]), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, want.detach(), rtol=1e-12, atol=1e-12)


def test_one_packed_sequence_is_plain_causal_attention_and_batches_are_refused():
    (q, k, v), cu = packed_qkv(4, 2, 16, [0, 19])
    torch.testing.assert_close(op.attention(q, k, v, 0.25, cu_seqlens=cu), op.attention(q, k, v, 0.25), rtol=0, atol=0)
    q2, k2, v2 = qkv(2, 4, 2, 19, 16)
    with pytest.raises(ValueError, match="batch is 2"):
        op.attention(q2, k2, v2, 0.25, cu_seqlens=cu)


def test_segments_per_token():
    starts, ends = op.segments(torch.tensor([0, 1, 4, 4, 6], dtype=torch.int32), 8, "cpu")  # an empty one, a tail
    assert starts.tolist() == [0, 1, 1, 1, 4, 4, 6, 6] and ends.tolist() == [1, 4, 4, 4, 6, 6, 8, 8]
    assert starts.dtype == ends.dtype == torch.int32


# ---- wrong kernels fail the gate ------------------------------------------------------------------


def _no_causal_mask(q, k, v, scale, cu_seqlens=None):
    """Attention over every key, future ones included."""
    groups = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(groups, 1).transpose(-1, -2) * scale
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ v.float().repeat_interleave(groups, 1)).to(q.dtype), lse


def _scale_off(q, k, v, scale, cu_seqlens=None):
    """The reference with the scale 5% too large."""
    return op.reference_forward(q, k, v, scale * 1.05, cu_seqlens)


@pytest.fixture(params=[_no_causal_mask, _scale_off])
def wrong_plugin(request):
    name = request.param.__name__.strip("_")
    registry.register("attention", name)(request.param)
    yield name
    registry._impls["attention"].pop(name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wrong_kernel_fails_the_gate_and_the_reference_passes(wrong_plugin, dtype):
    """The GPU test's comparison: error against float64 <= 2x that of PyTorch's SDPA in the same dtype."""
    q, k, v = (t.detach() for t in qkv(2, 8, 2, 77, 64, dtype=dtype))
    ref = naive(q, k, v, 0.125)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert gate(op.attention(q, k, v, 0.125, "reference"), sdpa, ref).passed
    verdict = gate(op.attention(q, k, v, 0.125, wrong_plugin), sdpa, ref)
    assert not verdict.passed and verdict.ratio > 2


def _boundaries_shifted(q, k, v, scale, cu_seqlens=None):
    """The reference with every inner sequence boundary one token late."""
    shifted = cu_seqlens.clone()
    shifted[1:-1] += 1
    return op.reference_forward(q, k, v, scale, shifted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shifted_boundaries_fail_the_gate_and_the_packed_reference_passes(dtype):
    registry.register("attention", "boundaries_shifted")(_boundaries_shifted)
    try:
        (q, k, v), cu = packed_qkv(8, 2, 64, [0, 1, 2, 9, 40, 41, 77], dtype=dtype)
        q, k, v = (t.detach() for t in (q, k, v))
        ref = naive_packed(q.double(), k.double(), v.double(), 0.125, cu.tolist())
        sdpa = naive_packed(q, k, v, 0.125, cu.tolist())
        assert gate(op.attention(q, k, v, 0.125, "reference", cu_seqlens=cu), sdpa, ref).passed
        verdict = gate(op.attention(q, k, v, 0.125, "boundaries_shifted", cu_seqlens=cu), sdpa, ref)
        assert not verdict.passed and verdict.ratio > 2
    finally:
        registry._impls["attention"].pop("boundaries_shifted")


# ---- lowering (no GPU needed) ---------------------------------------------------------------------


@pytest.mark.parametrize("target,head_dim,dtype", [("cuda:sm_90", 64, "bfloat16"), ("hip:gfx942", 64, "float16"),
                                                   ("cuda:sm_90", 128, "float16")])
def test_kernels_lower_for_every_head_dim_and_dtype(target, head_dim, dtype):
    """Forward and backward lower for the head dims and dtypes the op accepts, each on one target (Llama's 128/bf16 on
    every target, and the packed kernels: test_lowering)."""
    pytest.importorskip("tilelang", reason="TileLang is not installed: pip install -e '.[test]'")
    arch = target.partition(":")[2]
    scale = head_dim**-0.5
    fwd = _tilelang.lower_source(op.forward_kernel(8, 2, head_dim, scale, dtype, op.config_for(arch, "fwd")), target)
    bwd = _tilelang.lower_source(op.backward_kernel(8, 2, head_dim, scale, dtype, op.config_for(arch, "bwd")), target)
    ctype = {"bfloat16": "bfloat16_t", "float16": "half_t"}[dtype]
    for source, name, output in ((fwd, "attention_fwd_kernel", "O"), (bwd, "attention_bwd_kernel", "dK")):
        assert name in source and f"{ctype}* __restrict__ {output}" in source and "int seq" in source
    assert "float* __restrict__ LSE" in fwd and "exp2" in fwd
    assert "atomic" in bwd.lower() and "float* __restrict__ dQ" in bwd and "int padded" in bwd
    # float32 rows of any length: no TMA descriptor for LSE or Delta (it needs seq % 4 == 0)
    assert "LSE_desc" not in bwd and "Delta_desc" not in bwd


# ---- on the GPU -----------------------------------------------------------------------------------

GPU_SHAPES = [(1, 4, 4, 1, 64), (1, 32, 8, 77, 128), (2, 32, 8, 1000, 128), (1, 8, 1, 130, 64), (2, 16, 2, 513, 64),
              (4, 32, 8, 2048, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_tilelang_matches_float64(dtype, shape):
    """Bar: SDPA in the same dtype (flash or cuDNN), both against SDPA's float64 math backend."""
    from _gpu_check import check

    scale = shape[-1] ** -0.5
    q, k, v = qkv(*shape, dtype=dtype, device="cuda")
    check("attention", "b={} h={}/{} s={} d={}".format(*shape), dtype, [q, k, v],
          lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
          lambda q, k, v: op.attention(q, k, v, scale, impl="tilelang", strict=True),
          ["out", "dq", "dk", "dv"])


@pytest.mark.gpu
def test_tilelang_lse_matches_the_reference():
    q, k, v = (t.detach() for t in qkv(2, 8, 2, 333, 128, dtype=torch.bfloat16, device="cuda"))
    _, lse = op.tilelang_forward(q, k, v, 128**-0.5)
    _, want = op.reference_forward(q, k, v, 128**-0.5)
    torch.testing.assert_close(lse, want, rtol=1e-3, atol=1e-3)


# packed rows: boundaries on and off the tiles (64, 128), length-1 sequences, one sequence over the row, many
GPU_PACKED = [(32, 8, 128, [0, 1, 77, 78, 300, 1000]), (8, 1, 64, [0, 128, 129, 256, 513]),
              (16, 2, 64, [0, 1000]), (32, 8, 128, [0, *range(1, 40), 300, 2048, 2049, 4096]),
              (8, 2, 128, list(range(0, 2049, 64)))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_PACKED, ids=lambda c: f"h{c[0]}-{c[1]}-d{c[2]}-n{len(c[3]) - 1}-s{c[3][-1]}")
def test_tilelang_packed_matches_float64(dtype, case):
    """Bar: SDPA with the block-diagonal causal mask in the same dtype, both against its float64 math."""
    from _gpu_check import check

    heads_q, heads_kv, head_dim, cu = case
    scale = head_dim**-0.5
    (q, k, v), cu_seqlens = packed_qkv(*case, dtype=dtype, device="cuda")
    check("attention", f"packed h={heads_q}/{heads_kv} d={head_dim} n={len(cu) - 1} s={cu[-1]}", dtype, [q, k, v],
          lambda q, k, v: naive_packed(q, k, v, scale, cu),
          lambda q, k, v: op.attention(q, k, v, scale, impl="tilelang", strict=True, cu_seqlens=cu_seqlens),
          ["out", "dq", "dk", "dv"])


@pytest.mark.gpu
def test_tilelang_packed_lse_matches_the_reference():
    (q, k, v), cu = packed_qkv(8, 2, 128, [0, 1, 70, 200, 333], dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.detach() for t in (q, k, v))
    _, lse = op.tilelang_forward(q, k, v, 128**-0.5, cu)
    _, want = op.reference_forward(q, k, v, 128**-0.5, cu)
    torch.testing.assert_close(lse, want, rtol=1e-3, atol=1e-3)
