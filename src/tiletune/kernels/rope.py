"""Rotary position embedding of q and k together, in the two layouts transformers' models use.

- halves (transformers' ``apply_rotary_pos_emb``: Llama, Qwen, Mistral, Gemma, Phi-3): dimension j rotates with
  j + d/2, ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` and cos, sin of
  width d; computed in the input dtype, as transformers does.
- pairs (Llama 4's ``apply_rotary_emb``): adjacent dimensions (2i, 2i+1) are one complex number, multiplied by
  ``cos_i + i sin_i`` (cos, sin of width d/2: the real and imaginary parts of its ``freqs_cis``); computed in
  float32 and rounded once, as Llama 4 does.

cos and sin come from the model's own rotary embedding, so every rope scaling it implements (Llama-3's
included) is honoured; they are treated as constants (transformers computes them without gradient).

The op works on the (batch, seq, heads, head_dim) layout that q_proj/k_proj produce, so the
transformers layout (batch, heads, seq, head_dim) is a transpose away, without copies. Reference
(PyTorch) forward and backward, one TileLang kernel for both directions and both layouts (q and k in one
launch), and the custom ops ``tiletune::rope`` / ``tiletune::rope_backward`` (``interleaved`` picks the
layout). Tokens (batch x seq) are dynamic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import (
    Binding,
    Site,
    calls_global,
    replacing_global,
    warm_tensor,
)
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

# ---- reference -----------------------------------------------------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_transposed(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def _halves_forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _halves_backward(d: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    acc = _tilelang.accumulate_dtype(d)
    cos, sin = cos.unsqueeze(2).to(acc), sin.unsqueeze(2).to(acc)
    g = d.to(acc)
    return (g * cos + _rotate_half_transposed(g * sin)).to(d.dtype)


def _pairs_rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: int) -> Tensor:
    """x's pairs (x0, x1) times cos + sign·i·sin, in float32 (float64 for float64), rounded once."""
    acc = _tilelang.accumulate_dtype(x)
    x0, x1 = x.to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos.unsqueeze(2).to(acc), sign * sin.unsqueeze(2).to(acc)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


def _pairs_forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _pairs_rotate(x, cos, sin, 1)


def _pairs_backward(d: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _pairs_rotate(d, cos, sin, -1)  # the transpose of a rotation is the rotation back


@dataclass(frozen=True)
class Layout:
    """Which head dimensions rotate together and which column of cos/sin each reads; j and d are ints or TIR
    expressions (the kernel indexes with them), forward/backward the reference on one tensor."""

    name: str
    kernel: str  # the TileLang kernels' name (compile keys, `tiletune kernels lower`)
    partner: Callable  # (j, d) -> the dimension j rotates with
    leads: Callable  # (j, d) -> whether j is its pair's first (it takes minus its partner times sin)
    angle: Callable  # (j, d) -> j's column of cos and sin
    angles: Callable  # d -> the columns of cos and sin
    angle_dtype: str | None  # the dtype cos and sin are read in (None: q's)
    forward: Callable
    backward: Callable


HALVES = Layout("halves", "rope", partner=lambda j, d: (j + d // 2) % d, leads=lambda j, d: j < d // 2,
                angle=lambda j, d: j, angles=lambda d: d, angle_dtype=None,
                forward=_halves_forward, backward=_halves_backward)
PAIRS = Layout("pairs", "rope_pairs", partner=lambda j, d: j + 1 - 2 * (j % 2), leads=lambda j, d: j % 2 == 0,
               angle=lambda j, d: j // 2, angles=lambda d: d // 2, angle_dtype="float32",
               forward=_pairs_forward, backward=_pairs_backward)
LAYOUTS = {False: HALVES, True: PAIRS}  # by the op's `interleaved` argument


def reference_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool):
    """(q, k) rotated; q, k are (batch, seq, heads, head_dim), cos and sin (batch or 1, seq, the layout's angles)."""
    layout = LAYOUTS[interleaved]
    return layout.forward(q, cos, sin), layout.forward(k, cos, sin)


def reference_backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool):
    """(dq, dk) before the rotation, computed in fp32 (or float64)."""
    layout = LAYOUTS[interleaved]
    return layout.backward(dq, cos, sin), layout.backward(dk, cos, sin)


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


def kernel(heads_q: int, heads_k: int, d: int, dtype: str, backward: bool, tiling: tuple[int, int] | None = None,
           layout: Layout = HALVES):
    """PrimFunc rotating Q (t, heads_q * d) and K (t, heads_k * d) by C, S (t, layout.angles(d)), t dynamic.

    Forward: out[j] = x[j] c[a(j)] + sign(j) x[p] s[a(j)]; backward: dx[j] = g[j] c[a(j)] - sign(j) g[p] s[a(p)],
    where p = layout.partner(j), a = layout.angle and sign(j) = -1 for a pair's leading dimension, +1 for the other.
    """
    import tilelang.language as T

    tokens, threads = tiling or _tiling(heads_q, heads_k, d)
    angles, angle_dtype = layout.angles(d), layout.angle_dtype or dtype
    t = T.dynamic("t")

    @T.macro
    def rotate(x, out, c, s, heads):
        for i, col in T.Parallel(tokens, heads * d):
            j = col % d
            p = col - j + layout.partner(j, d)
            sign = T.if_then_else(layout.leads(j, d), -1.0, 1.0)
            xj = T.cast(x[i, col], "float32")
            xp = T.cast(x[i, p], "float32")
            cj = T.cast(c[i, layout.angle(j, d)], "float32")
            if backward:
                sp = T.cast(s[i, layout.angle(layout.partner(j, d), d)], "float32")
                out[i, col] = T.cast(xj * cj - sign * xp * sp, dtype)
            else:
                out[i, col] = T.cast(xj * cj + sign * xp * T.cast(s[i, layout.angle(j, d)], "float32"), dtype)

    @T.prim_func
    def rope(
        Q: T.Tensor((t, heads_q * d), dtype),
        K: T.Tensor((t, heads_k * d), dtype),
        C: T.Tensor((t, angles), angle_dtype),
        S: T.Tensor((t, angles), angle_dtype),
        QO: T.Tensor((t, heads_q * d), dtype),
        KO: T.Tensor((t, heads_k * d), dtype),
    ):
        with T.Kernel(T.ceildiv(t, tokens), threads=threads) as bx:
            c = T.alloc_shared((tokens, angles), angle_dtype)
            s = T.alloc_shared((tokens, angles), angle_dtype)
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
    """Kernel name -> PrimFunc builder for `tiletune kernels lower`: halves at Llama-3-8B's 32 q / 8 kv heads of
    128, pairs at Llama-4-Scout's 40 / 8 heads of 128."""
    shapes = {HALVES: (32, 8, 128), PAIRS: (40, 8, 128)}
    return {f"{layout.kernel}_{kind}": functools.partial(kernel, *heads, "bfloat16", kind == "bwd", layout=layout)
            for layout, heads in shapes.items() for kind in ("fwd", "bwd")}


def tilelang_unsupported(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> str | None:
    """Why the TileLang kernel cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(q, k)
    d, layout = q.shape[-1], LAYOUTS[interleaved]
    if reason is None and (d % 16 or k.shape[-1] != d or cos.shape[-1] != layout.angles(d)):
        reason = f"head_dim {d} is not a multiple of 16 or differs between q, k and cos ({layout.name} layout)"
    if reason is None and _tiling(q.shape[2], k.shape[2], d) is None:
        reason = f"{q.shape[2]} q heads and {k.shape[2]} kv heads of {d} do not split over 128 threads"
    if reason is None and q.shape[:2] != k.shape[:2]:
        reason = "q and k differ in batch or sequence length"
    if reason is None and (q.shape[2] + k.shape[2]) * d * q.element_size() * 2 > 96 * 1024:
        reason = f"{q.shape[2]}+{k.shape[2]} heads of {d} do not fit one block's shared memory"
    return reason


def _tilelang_apply(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool):
    (b, s, hq, d), hk, layout = q.shape, k.shape[2], LAYOUTS[interleaved]
    dtype, width = _tilelang.DTYPES[q.dtype], layout.angles(d)
    angle_dtype = q.dtype if layout.angle_dtype is None else getattr(torch, layout.angle_dtype)
    compiled = _tilelang.compiled((layout.kernel, hq, hk, d, dtype, backward),
                                  lambda: kernel(hq, hk, d, dtype, backward, layout=layout))
    q2, k2 = q.reshape(b * s, hq * d).contiguous(), k.reshape(b * s, hk * d).contiguous()
    c2, s2 = (x.to(angle_dtype).expand(b, s, width).reshape(b * s, width).contiguous() for x in (cos, sin))
    qo, ko = torch.empty_like(q2), torch.empty_like(k2)
    if b * s:
        compiled(q2, k2, c2, s2, qo, ko)
    return qo.view(q.shape), ko.view(k.shape)


def tilelang_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool):
    """(q, k) rotated by the TileLang kernel."""
    return _tilelang_apply(q, k, cos, sin, interleaved, backward=False)


def tilelang_backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool):
    """(dq, dk) before the rotation, by the TileLang kernel in its backward form."""
    return _tilelang_apply(dq, dk, cos, sin, interleaved, backward=True)


# ---- custom ops and bindings -----------------------------------------------------------------------

rope_op = make_custom_op(Signature(
    "rope", "Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved", "(Tensor, Tensor)",
    backward_inputs="Tensor cos, Tensor sin, bool interleaved", backward_outputs="(Tensor, Tensor)",
    fake=lambda q, k, cos, sin, interleaved: (q.new_empty(q.shape), k.new_empty(k.shape)),
    backward_fake=lambda dq, dk, cos, sin, interleaved: (dq.new_empty(dq.shape), dk.new_empty(dk.shape)),
    save=lambda inputs, outputs, needs: inputs[2:],
    judged_on=lambda grads, saved: (*grads, *saved),
    grad_of=(0, 1, None, None, None),
    differentiable=2,
))


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, impl: str = "reference", strict: bool = False):
    """Rotate q, k in transformers' layout (batch, heads, seq, head_dim) with cos, sin (batch, seq, head_dim).

    Returns (q, k) in the same layout, as views of (batch, seq, heads, head_dim) tensors.
    """
    qo, ko = torch.ops.tiletune.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, False, impl, strict)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def rope_pairs(q: Tensor, k: Tensor, freqs_cis: Tensor, impl: str = "reference", strict: bool = False):
    """Rotate q, k (batch, seq, heads, head_dim) by Llama 4's complex freqs_cis (batch, seq, head_dim / 2)."""
    return torch.ops.tiletune.rope(q, k, freqs_cis.real, freqs_cis.imag, True, impl, strict)


def _attention_fit(site: Site, stock: str) -> str | None:
    """Why an attention module's rotation cannot be the op's, whichever layout (None: it can)."""
    if not calls_global(type(site.module).forward, stock):
        return f"{type(site.module).__name__}.forward does not call {stock}: stock forward kept"
    config = getattr(site.module, "config", None)
    if not hasattr(site.module, "head_dim") or not all(hasattr(config, n) for n in ("num_attention_heads", "num_key_value_heads")):
        return f"{type(site.module).__name__} has no head_dim and head counts in its config: stock forward kept"
    return None


_GLOBAL = "apply_rotary_pos_emb"  # what transformers' attention forwards call to rotate q and k (halves)
_PAIRS_GLOBAL = "apply_rotary_emb"  # what Llama 4's attention calls (pairs)


# rotary kinds of a family record that no binding takes, and why
_NO_KERNEL = {
    "latent": "MLA rotary (the qk_rope_head_dim slice of each q head and one shared k head; adjacent pairs returned "
              "in halves order under rope_interleave)",
}


def _fit(site: Site) -> str | None:
    if site.part.rotary not in ("full", "half_angles"):
        return f"{_NO_KERNEL.get(site.part.rotary, site.part.rotary + ' rotary embedding')}: no kernel yet: stock forward kept"
    return _attention_fit(site, _GLOBAL)


def _pairs_fit(site: Site) -> str | None:
    if not getattr(site.module, "use_rope", True):  # Llama 4's NoPE layers (every 4th): no rotation at all
        return "no rotary embedding in this layer (NoPE): stock forward kept"
    return _attention_fit(site, _PAIRS_GLOBAL)


def _rope_function(original: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for transformers' apply_rotary_pos_emb that runs tiletune's rope op."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        rotary = cos.shape[-1]
        if args or kwargs or unsqueeze_dim != 1 or rotary > q.shape[-1]:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        if rotary == q.shape[-1]:
            return rope(q, k, cos, sin, impl, strict)
        # partial rotation (Phi-4-mini: 3/4 of each head): the op turns the leading features, the rest pass
        q_turned, k_turned = rope(_leading(q, rotary), _leading(k, rotary), cos, sin, impl, strict)
        return torch.cat((q_turned, q[..., rotary:]), -1), torch.cat((k_turned, k[..., rotary:]), -1)
    return apply_rotary_pos_emb


def _half_angles_function(original: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for GPT-OSS's apply_rotary_pos_emb: the halves layout with cos, sin of width head_dim / 2, each angle
    once (``[x1·cos - x2·sin, x2·cos + x1·sin]``); the op's halves form with cos, sin doubled computes the same products
    and sums (x1·cos + (-x2)·sin), rounded alike."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if args or kwargs or unsqueeze_dim != 1 or 2 * cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), impl, strict)
    return apply_rotary_pos_emb


def _leading(x: Tensor, features: int) -> Tensor:
    """The first `features` of each head of x (batch, heads, seq, head_dim), in the op's (batch, seq, heads)
    memory order."""
    return x.transpose(1, 2)[..., :features].contiguous().transpose(1, 2)


def _pairs_function(original: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for Llama 4's apply_rotary_emb(xq, xk, freqs_cis) that runs tiletune's rope op on pairs."""

    @functools.wraps(original)
    def apply_rotary_emb(xq, xk, freqs_cis):
        if not freqs_cis.is_complex() or freqs_cis.dim() != 3 or 2 * freqs_cis.shape[-1] != xq.shape[-1]:
            return original(xq, xk, freqs_cis)
        return rope_pairs(xq, xk, freqs_cis, impl, strict)
    return apply_rotary_emb


def _compile_key(site: Site) -> tuple:
    """(q heads, kv heads, rotated features per head): from the config, as fused projections (Phi-3's qkv_proj) have
    no q_proj; a partial rotation turns int(head_dim x partial_rotary_factor) of them, as transformers computes."""
    attention = site.module
    rotated = int(attention.head_dim * (getattr(attention.config, "partial_rotary_factor", None) or 1.0))
    return (attention.config.num_attention_heads, attention.config.num_key_value_heads, rotated)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    heads_q, heads_k, d = key
    cos, sin = torch.randn(2, 1, 1, d, device="cuda", dtype=dtype)
    q, k = rope(warm_tensor(1, heads_q, 1, d, dtype=dtype), warm_tensor(1, heads_k, 1, d, dtype=dtype), cos, sin, impl, True)
    return q.sum() + k.sum()


def _warm_pairs(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    heads_q, heads_k, d = key
    freqs_cis = torch.polar(torch.ones(1, 1, d // 2, device="cuda"), torch.randn(1, 1, d // 2, device="cuda"))
    q, k = rope_pairs(warm_tensor(1, 1, heads_q, d, dtype=dtype), warm_tensor(1, 1, heads_k, d, dtype=dtype), freqs_cis,
                      impl, True)
    return q.sum() + k.sum()


def _interleaved(site: Site) -> bool:
    return site.part.rotary == "interleaved"


def _half_angles(site: Site) -> bool:
    return site.part.rotary == "half_angles"


define(Op("rope", (
    Binding("rope", "rotary", replacing_global(_GLOBAL, _rope_function), _fit, compile_key=_compile_key, warm=_warm,
            applies=lambda site: not _interleaved(site) and not _half_angles(site)),
    Binding("rope", "rotary", replacing_global(_GLOBAL, _half_angles_function), _fit, compile_key=_compile_key,
            warm=_warm, applies=_half_angles),
    Binding("rope", "rotary", replacing_global(_PAIRS_GLOBAL, _pairs_function), _pairs_fit, compile_key=_compile_key,
            warm=_warm_pairs, applies=_interleaved),
), lowering=lowering_kernels))
add(Impl("rope", "reference", reference_forward, reference_backward,
         description="PyTorch, as transformers' apply_rotary_pos_emb (Llama 4's apply_rotary_emb for pairs)",
         accumulation="input dtype (pairs: float32)"))
add(Impl("rope", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang, q and k in one launch, fp32 inside", accumulation="float32"))
