"""rope: reference semantics (incl. Llama-3 scaling; Llama 4's pairs) and autograd on the CPU, the TileLang kernel's
index arithmetic in both layouts; the TileLang kernel itself on the GPU."""

import pytest
import torch
from transformers import Llama4TextConfig, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.llama4.modeling_llama4 import (
    Llama4TextRotaryEmbedding,
    apply_rotary_emb,
)

from tiletune.kernels import rope as op

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def cos_sin(batch, seq, heads, head_dim, device="cpu", dtype=torch.float32):
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    rotary = LlamaRotaryEmbedding(config).to(device)
    x = torch.empty(batch, seq, heads * head_dim, device=device, dtype=dtype)
    positions = torch.arange(seq, device=device).expand(batch, seq) + 100
    return rotary(x, positions)


def freqs_cis(batch, seq, heads, head_dim, device="cpu"):
    """Llama 4's complex rotation per (batch, position, pair), with its llama3 rope scaling."""
    config = Llama4TextConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                              max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    rotary = Llama4TextRotaryEmbedding(config).to(device)
    x = torch.empty(batch, seq, heads * head_dim, device=device)
    return rotary(x, torch.arange(seq, device=device).expand(batch, seq) + 100)


def test_reference_matches_transformers_with_llama3_scaling():
    cos, sin = cos_sin(2, 9, 4, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 9, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 9, 16, dtype=torch.bfloat16)
    for ours, theirs in zip(op.rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert ours.shape == theirs.shape


def test_gradcheck_float64():
    cos, sin = cos_sin(2, 5, 2, 8, dtype=torch.float64)
    q = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k: op.rope(q, k, cos.double(), sin.double()), (q, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pairs_reference_is_llama4s_apply_rotary_emb(dtype):
    """Llama 4 multiplies adjacent pairs as complex numbers in float32 and rounds once: so does the pairs form."""
    freqs = freqs_cis(2, 9, 4, 16)
    q, k = torch.randn(2, 9, 4, 16, dtype=dtype), torch.randn(2, 9, 2, 16, dtype=dtype)
    for ours, theirs in zip(op.rope_pairs(q, k, freqs), apply_rotary_emb(q, k, freqs)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert ours.shape == theirs.shape and ours.dtype == dtype


def test_pairs_gradcheck_float64():
    freqs = freqs_cis(2, 5, 2, 8).to(torch.complex128)
    q = torch.randn(2, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k: op.rope_pairs(q, k, freqs), (q, k))


@pytest.mark.parametrize("layout", [op.HALVES, op.PAIRS], ids=lambda layout: layout.name)
def test_kernel_index_arithmetic_is_the_reference(layout):
    """The kernel's per-element formula, with the layout's partner, sign and angle columns evaluated here on
    integer indices, equals the reference forward and backward (float64)."""
    d = 16
    j = torch.arange(d)
    p, a = layout.partner(j, d), layout.angle(j, d)
    sign = torch.where(layout.leads(j, d), -1.0, 1.0).double()
    x = torch.randn(3, 5, 2, d, dtype=torch.float64)
    cos, sin = torch.randn(2, 3, 5, layout.angles(d), dtype=torch.float64)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    forward = x * c[..., a] + sign * x[..., p] * s[..., a]
    backward = x * c[..., a] - sign * x[..., p] * s[..., layout.angle(p, d)]
    interleaved = layout is op.PAIRS
    torch.testing.assert_close(forward, op.reference_forward(x, x, cos, sin, interleaved)[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(backward, op.reference_backward(x, x, cos, sin, interleaved)[0], rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 77), (4, 2048)])
def test_tilelang_pairs_matches_float64(dtype, batch, seq):
    """Llama-4-Scout's 40 q / 8 kv heads of 128; cos and sin are the real and imaginary parts of freqs_cis."""
    from _gpu_check import check

    freqs = freqs_cis(batch, seq, 40, 128, device="cuda")
    q = torch.randn(batch, seq, 40, 128, device="cuda", dtype=dtype).requires_grad_()
    k = torch.randn(batch, seq, 8, 128, device="cuda", dtype=dtype).requires_grad_()
    check("rope", f"pairs tokens={batch * seq}", dtype, [q, k, freqs.real.contiguous(), freqs.imag.contiguous()],
          lambda q, k, c, s: apply_rotary_emb(q, k, torch.complex(c.float(), s.float())),
          lambda q, k, c, s: torch.ops.tiletune.rope(q, k, c, s, True, "tilelang", True),
          ["q", "k", "dq", "dk"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 77), (1, 5000), (4, 2048)])
@pytest.mark.parametrize("heads_q,heads_k,d", [(32, 8, 128), (24, 8, 96)])  # Llama-3; Phi-4-mini's rotated 3/4
def test_tilelang_matches_float64(dtype, batch, seq, heads_q, heads_k, d):
    from _gpu_check import check

    cos, sin = cos_sin(batch, seq, heads_q, d, device="cuda", dtype=dtype)
    # Projections come out as (batch, seq, heads, head_dim); attention sees the (1, 2) transpose.
    q = torch.randn(batch, seq, heads_q, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, heads_k, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    check("rope", f"tokens={batch * seq} heads={heads_q}/{heads_k} d={d}", dtype, [q, k, cos, sin],
          apply_rotary_pos_emb,
          lambda q, k, c, s: op.rope(q, k, c, s, impl="tilelang", strict=True),
          ["q", "k", "dq", "dk"])


def test_phi3s_fused_qkv_and_phi4_minis_partial_rotation_take_the_kernel(monkeypatch):
    """Phi-3 rotates whole heads; Phi-4-mini 3/4 of each (48 of 64 features here): the op turns those, the rest
    pass; outputs and gradients as stock, and the warm-up key names the rotated width."""
    import transformers

    from tiletune.patch import apply_kernels

    widths, rope = [], op.rope  # the rotated width of every call that reached the op
    monkeypatch.setattr(op, "rope", lambda q, *rest: widths.append(q.shape[-1]) or rope(q, *rest))

    shape = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 96, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0}
    for factor, rotated in ((1.0, 64), (0.75, 48)):
        torch.manual_seed(0)
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**shape, partial_rotary_factor=factor)).double()
        ids = torch.randint(0, 64, (2, 9))
        stock_loss = model(input_ids=ids, labels=ids).loss
        stock_grads = torch.autograd.grad(stock_loss, list(model.parameters()))
        report = apply_kernels(model, {"rope": "reference", "strict": True})
        entry, binding, site = next(b for b in report.bindings if b[0].op == "rope")
        assert entry.installed and binding.compile_key(site) == (4, 2, rotated)
        loss = model(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, stock_loss)
        assert widths.pop() == rotated and not widths
        for got, want in zip(torch.autograd.grad(loss, list(model.parameters())), stock_grads, strict=True):
            torch.testing.assert_close(got, want)
        report.revert()
