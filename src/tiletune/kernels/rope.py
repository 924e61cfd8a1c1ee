"""Rotary position embedding of q and k together, as transformers' ``apply_rotary_pos_emb``.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. cos and sin come
from the model's own rotary embedding, so every rope scaling it implements (Llama-3's included) is
honoured; they are treated as constants (transformers computes them without gradient).

The op works on the (batch, seq, heads, head_dim) layout that q_proj/k_proj produce, so the
transformers layout (batch, heads, seq, head_dim) is a transpose away, without copies. Reference
(PyTorch) forward and backward, one TileLang kernel for both directions (q and k in one launch), and
the custom ops ``tiletune::rope`` / ``tiletune::rope_backward``. Tokens (batch x seq) are dynamic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, calls_global, replacing_global, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

# ---- reference -----------------------------------------------------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_transposed(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def reference_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
    """(q, k) rotated; q, k are (batch, seq, heads, head_dim), cos and sin (batch or 1, seq, head_dim)."""
    cos, sin = cos.unsqueeze(2).to(q.dtype), sin.unsqueeze(2).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def reference_backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor):
    """(dq, dk) before the rotation, computed in fp32 (or float64)."""
    acc = _tilelang.accumulate_dtype(dq)
    cos, sin = cos.unsqueeze(2).to(acc), sin.unsqueeze(2).to(acc)

    def back(d: Tensor) -> Tensor:
        d = d.to(acc)
        return d * cos + _rotate_half_transposed(d * sin)

    return back(dq).to(dq.dtype), back(dk).to(dk.dtype)


# ---- TileLang kernels ----------------------------------------------------------------------------


def _tiling(heads_q: int, heads_k: int, d: int) -> tuple[int, int] | None:
    """(tokens per block, threads), or None when 128 threads cannot split q's and k's rows evenly."""
    tokens = 1
    while tokens * 2 * (heads_q + heads_k) * d <= 4096:
        tokens *= 2
    threads = 128
    if (tokens * heads_q * d) % threads or (tokens * heads_k * d) % threads:
        return None
    return tokens, threads


def kernel(heads_q: int, heads_k: int, d: int, dtype: str, backward: bool, tiling: tuple[int, int] | None = None):
    """PrimFunc rotating Q (t, heads_q * d) and K (t, heads_k * d) by C, S (t, d), t dynamic.

    Forward: out[j] = x[j] c[j] + sign(j) x[p] s[j]; backward: dx[j] = g[j] c[j] - sign(j) g[p] s[p],
    where p = (j + d/2) mod d and sign(j) = -1 for the first half, +1 for the second.
    """
    import tilelang.language as T

    half = d // 2
    tokens, threads = tiling or _tiling(heads_q, heads_k, d)
    t = T.dynamic("t")

    @T.macro
    def rotate(x, out, c, s, heads):
        for i, col in T.Parallel(tokens, heads * d):
            j = col % d
            p = col - j + (j + half) % d
            sign = T.if_then_else(j < half, -1.0, 1.0)
            xj = T.cast(x[i, col], "float32")
            xp = T.cast(x[i, p], "float32")
            if backward:
                out[i, col] = T.cast(xj * T.cast(c[i, j], "float32") - sign * xp * T.cast(s[i, (j + half) % d], "float32"), dtype)
            else:
                out[i, col] = T.cast(xj * T.cast(c[i, j], "float32") + sign * xp * T.cast(s[i, j], "float32"), dtype)

    @T.prim_func
    def rope(
        Q: T.Tensor((t, heads_q * d), dtype),
        K: T.Tensor((t, heads_k * d), dtype),
        C: T.Tensor((t, d), dtype),
        S: T.Tensor((t, d), dtype),
        QO: T.Tensor((t, heads_q * d), dtype),
        KO: T.Tensor((t, heads_k * d), dtype),
    ):
        with T.Kernel(T.ceildiv(t, tokens), threads=threads) as bx:
            c = T.alloc_shared((tokens, d), dtype)
            s = T.alloc_shared((tokens, d), dtype)
            q = T.alloc_shared((tokens, heads_q * d), dtype)
            k = T.alloc_shared((tokens, heads_k * d), dtype)
            qo = T.alloc_fragment((tokens, heads_q * d), dtype)
            ko = T.alloc_fragment((tokens, heads_k * d), dtype)
            T.copy(C[bx * tokens, 0], c)
            T.copy(S[bx * tokens, 0], s)
            T.copy(Q[bx * tokens, 0], q)
            T.copy(K[bx * tokens, 0], k)
            rotate(q, qo, c, s, heads_q)
            rotate(k, ko, c, s, heads_k)
            T.copy(qo, QO[bx * tokens, 0])
            T.copy(ko, KO[bx * tokens, 0])

    return rope


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Llama-3-8B's 32 q / 8 kv heads of 128, for `tiletune kernels lower`."""
    return {"rope_fwd": lambda: kernel(32, 8, 128, "bfloat16", False), "rope_bwd": lambda: kernel(32, 8, 128, "bfloat16", True)}


def tilelang_unsupported(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> str | None:
    """Why the TileLang kernel cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(q, k)
    d = q.shape[-1]
    if reason is None and (d % 16 or k.shape[-1] != d or cos.shape[-1] != d):
        reason = f"head_dim {d} is not a multiple of 16 or differs between q, k and cos"
    if reason is None and _tiling(q.shape[2], k.shape[2], d) is None:
        reason = f"{q.shape[2]} q heads and {k.shape[2]} kv heads of {d} do not split over 128 threads"
    if reason is None and q.shape[:2] != k.shape[:2]:
        reason = "q and k differ in batch or sequence length"
    if reason is None and (q.shape[2] + k.shape[2]) * d * q.element_size() * 2 > 96 * 1024:
        reason = f"{q.shape[2]}+{k.shape[2]} heads of {d} do not fit one block's shared memory"
    return reason


def _tilelang_apply(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool):
    (b, s, hq, d), hk = q.shape, k.shape[2]
    dtype = _tilelang.DTYPES[q.dtype]
    compiled = _tilelang.compiled(("rope", hq, hk, d, dtype, backward), lambda: kernel(hq, hk, d, dtype, backward))
    q2, k2 = q.reshape(b * s, hq * d).contiguous(), k.reshape(b * s, hk * d).contiguous()
    c2, s2 = (x.to(q.dtype).expand(b, s, d).reshape(b * s, d).contiguous() for x in (cos, sin))
    qo, ko = torch.empty_like(q2), torch.empty_like(k2)
    if b * s:
        compiled(q2, k2, c2, s2, qo, ko)
    return qo.view(q.shape), ko.view(k.shape)


def tilelang_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
    """(q, k) rotated by the TileLang kernel."""
    return _tilelang_apply(q, k, cos, sin, backward=False)


def tilelang_backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor):
    """(dq, dk) before the rotation, by the TileLang kernel in its backward form."""
    return _tilelang_apply(dq, dk, cos, sin, backward=True)


# ---- custom ops and binding ------------------------------------------------------------------------

rope_op = make_custom_op(Signature(
    "rope", "Tensor q, Tensor k, Tensor cos, Tensor sin", "(Tensor, Tensor)",
    backward_inputs="Tensor cos, Tensor sin", backward_outputs="(Tensor, Tensor)",
    fake=lambda q, k, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)),
    backward_fake=lambda dq, dk, cos, sin: (dq.new_empty(dq.shape), dk.new_empty(dk.shape)),
    save=lambda inputs, outputs, needs: inputs[2:],
    judged_on=lambda grads, saved: (*grads, *saved),
    grad_of=(0, 1, None, None),
    differentiable=2,
))


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, impl: str = "reference", strict: bool = False):
    """Rotate q, k in transformers' layout (batch, heads, seq, head_dim) with cos, sin (batch, seq, head_dim).

    Returns (q, k) in the same layout, as views of (batch, seq, heads, head_dim) tensors.
    """
    qo, ko = torch.ops.tiletune.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, impl, strict)
    return qo.transpose(1, 2), ko.transpose(1, 2)


_GLOBAL = "apply_rotary_pos_emb"  # what transformers' attention forwards call to rotate q and k


def _fit(site: Site) -> str | None:
    if site.part.rotary != "full":
        return f"{site.part.rotary} rotary embedding: no kernel yet: stock forward kept"
    if not calls_global(type(site.module).forward, _GLOBAL):
        return f"{type(site.module).__name__}.forward does not call {_GLOBAL}: stock forward kept"
    config = getattr(site.module, "config", None)
    if not hasattr(site.module, "head_dim") or not all(hasattr(config, n) for n in ("num_attention_heads", "num_key_value_heads")):
        return f"{type(site.module).__name__} has no head_dim and head counts in its config: stock forward kept"
    partial = getattr(config, "partial_rotary_factor", None) or 1.0
    if partial < 1.0:  # Phi-4-mini (model_type phi3) rotates 3/4 of each head
        return f"partial rotary embedding (partial_rotary_factor {partial}): no kernel yet: stock forward kept"
    return None


def _rope_function(original: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for transformers' apply_rotary_pos_emb that runs tiletune's rope op."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if args or kwargs or unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return rope(q, k, cos, sin, impl, strict)
    return apply_rotary_pos_emb


def _compile_key(site: Site) -> tuple:
    """(q heads, kv heads, head_dim): from the config, as fused projections (Phi-3's qkv_proj) have no q_proj."""
    attention = site.module
    return (attention.config.num_attention_heads, attention.config.num_key_value_heads, attention.head_dim)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    heads_q, heads_k, d = key
    cos, sin = torch.randn(2, 1, 1, d, device="cuda", dtype=dtype)
    q, k = rope(warm_tensor(1, heads_q, 1, d, dtype=dtype), warm_tensor(1, heads_k, 1, d, dtype=dtype), cos, sin, impl, True)
    return q.sum() + k.sum()


define(Op("rope", (Binding("rope", "rotary", replacing_global(_GLOBAL, _rope_function), _fit, compile_key=_compile_key,
                           warm=_warm),),
          lowering=lowering_kernels))
add(Impl("rope", "reference", reference_forward, reference_backward, description="PyTorch, as transformers' apply_rotary_pos_emb", accumulation="input dtype"))
add(Impl("rope", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang, q and k in one launch, fp32 inside", accumulation="float32"))
