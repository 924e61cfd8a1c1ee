"""Causal grouped-query attention: ``out = softmax(q kᵀ · scale + causal mask) v``, backward dq, dk, dv.

q is (batch, heads_q, seq, head_dim) and k, v are (batch, heads_kv, seq, head_dim), the layout
transformers passes to its attention functions; query head h reads kv head h // (heads_q / heads_kv).
Query i sees keys 0..i (the same sequence: no KV-cache prefix). The forward also returns the
log-sum-exp of each row's scaled scores (natural log, float32; float64 for float64 inputs), which the
backward uses to recompute the probabilities without storing them.

Reference (PyTorch, fp32 inside) forward and backward, TileLang kernels (flash-attention forward with
online softmax and causal block skipping; backward = a delta = rowsum(dO·O) preprocess, then one
kernel per block of keys for dK, dV and dQ), and the custom ops ``tiletune::attention`` /
``tiletune::attention_backward``. Batch and sequence length are dynamic (``T.dynamic``): one compiled
kernel per (heads_q, heads_kv, head_dim, scale, dtype, tiles) serves every batch and length, including
lengths that are not a multiple of a tile (TileLang zero-fills the loads past the end and guards the
stores). The kernels work on the (batch, seq, heads, head_dim) layout q_proj produces, so transformers'
tensors, which are (1, 2) transposes of it, reach them without copies.
"""

# No `from __future__ import annotations`: TileLang reads the kernel signatures' shapes from the closure.

import math
from collections.abc import Callable

import torch
from torch import Tensor

from tiletune.kernels import _tilelang
from tiletune.kernels.registry import Impl, add, backward_of, select

HEAD_DIMS = (64, 128)  # head_dim values the TileLang kernels are configured for
LOG2E, LN2 = math.log2(math.e), math.log(2.0)

# ---- reference -----------------------------------------------------------------------------------


def _grouped(x: Tensor, heads_kv: int, dtype: torch.dtype) -> Tensor:
    """(batch, heads_q, seq, d) -> (batch, heads_kv, group, seq, d) in `dtype`: GQA by broadcasting, no repeat."""
    b, h, s, d = x.shape
    return x.to(dtype).reshape(b, heads_kv, h // heads_kv, s, d)


def _causal_scores(q5: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled scores (batch, heads_kv, group, seq, seq) with -inf above the diagonal."""
    s = q5.shape[-2]
    scores = q5 @ k.unsqueeze(2).transpose(-1, -2) * scale
    future = torch.ones(s, s, dtype=torch.bool, device=q5.device).triu(1)
    return scores.masked_fill(future, float("-inf"))


def reference_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out like q, lse (batch, heads_q, seq)): causal GQA attention in fp32 (float64 for float64 inputs)."""
    acc = _tilelang.accumulate_dtype(q)
    b, hq, s, _ = q.shape
    hk = k.shape[1]
    if hq % hk:
        raise ValueError(f"{hq} query heads are not a multiple of {hk} kv heads")
    scores = _causal_scores(_grouped(q, hk, acc), k.to(acc), scale)
    lse = scores.logsumexp(-1, keepdim=True)
    out = (scores - lse).exp() @ v.to(acc).unsqueeze(2)
    return out.reshape(q.shape).to(q.dtype), lse.reshape(b, hq, s)


def reference_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float):
    """(dq, dk, dv) from the saved output and log-sum-exp, the way the kernel computes them, in fp32 (or float64)."""
    acc = _tilelang.accumulate_dtype(q)
    hk = k.shape[1]
    q5, do5, o5 = (_grouped(t, hk, acc) for t in (q, dout, out))
    k4, v4 = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    p = (_causal_scores(q5, k.to(acc), scale) - lse.to(acc).reshape(*q5.shape[:-1], 1)).exp()
    dv = (p.transpose(-1, -2) @ do5).sum(2)  # the group's query heads all read this kv head
    delta = (do5 * o5).sum(-1, keepdim=True)
    ds = p * (do5 @ v4.transpose(-1, -2) - delta) * scale
    dq = ds @ k4
    dk = (ds.transpose(-1, -2) @ q5).sum(2)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- TileLang kernels ----------------------------------------------------------------------------

# (block_m, block_n, stages, threads, staged). Forward: block_m query rows per program, block_n keys per
# step. Backward: block_n keys per program, block_m query rows per step. staged: the probabilities go
# through shared memory before they are a GEMM operand; gfx1100's WMMA accumulator layout differs from
# its operand layout, so a register-to-register cast does not lower there. Shared memory at head_dim
# 128: sm_90 227 KB (fwd 96 KB, bwd ~150 KB); sm_80 also serves sm_86/89 (99 KB: fwd 48 KB, bwd 88 KB;
# two stages with the dynamic trip count do not lower for sm_80 in TileLang 0.1.15); gfx90a/gfx942
# have 64 KB of LDS and 64-wide wavefronts (256 threads = 4 waves; fwd 48 KB, bwd 52 KB); gfx1100 has
# 64 KB per WGP and fewer registers per SIMD: smaller tiles (fwd 36 KB, bwd 26 KB).
CONFIGS = {
    "fwd": {"sm_90": (128, 128, 2, 256, False), "sm_80": (64, 64, 1, 128, False), "gfx9": (64, 64, 1, 256, False),
            "gfx1100": (64, 32, 1, 128, True)},
    "bwd": {"sm_90": (64, 128, 2, 256, False), "sm_80": (64, 64, 1, 128, False), "gfx9": (32, 64, 1, 256, False),
            "gfx1100": (32, 32, 1, 128, True)},
}
DELTA_ROWS = 32  # rows of O and dO per program of the preprocess


def config_for(arch: str, kind: str) -> tuple[int, int, int, int, bool]:
    """The tile configuration of the `kind` ('fwd' or 'bwd') kernel on `arch` ('sm_90', 'gfx942', ...)."""
    family = arch if arch in ("sm_90", "gfx1100") else "gfx9" if arch.startswith("gfx") else "sm_80"
    return CONFIGS[kind][family]


def forward_kernel(heads_q: int, heads_kv: int, head_dim: int, scale: float, dtype: str, config):
    """PrimFunc: O, LSE from Q (b, s, heads_q, d), K, V (b, s, heads_kv, d); LSE is (b, heads_q, s) float32.

    One program per (block of query rows, query head, batch). Online softmax in the log2 domain: per
    block of keys, rescale the running output and denominator by exp2(old max - new max). Key blocks
    entirely above the diagonal are never loaded (causal block skipping); the diagonal block is masked.
    """
    import tilelang.language as T

    bm, bn, stages, threads, staged = config
    groups = heads_q // heads_kv
    batch, seq = T.dynamic("batch"), T.dynamic("seq")
    acc = "float32"
    log2_scale = scale * LOG2E

    @T.prim_func
    def attention_fwd(
        Q: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        K: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        V: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        O: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        LSE: T.Tensor((batch, heads_q, seq), acc),
    ):
        with T.Kernel(T.ceildiv(seq, bm), heads_q, batch, threads=threads) as (bx, head, bz):
            q = T.alloc_shared((bm, head_dim), dtype)
            k = T.alloc_shared((bn, head_dim), dtype)
            v = T.alloc_shared((bn, head_dim), dtype)
            scores = T.alloc_fragment((bm, bn), acc)
            probs = (T.alloc_shared if staged else T.alloc_fragment)((bm, bn), dtype)
            out = T.alloc_fragment((bm, head_dim), acc)
            row_max = T.alloc_fragment((bm,), acc)
            prev_max = T.alloc_fragment((bm,), acc)
            rescale = T.alloc_fragment((bm,), acc)
            row_sum = T.alloc_fragment((bm,), acc)
            denom = T.alloc_fragment((bm,), acc)

            T.copy(Q[bz, bx * bm:(bx + 1) * bm, head, :], q)
            T.fill(out, 0)
            T.fill(denom, 0)
            T.fill(row_max, -T.infinity(acc))
            # keys past the block's last query row are never visited; block 0 holds key 0, which every
            # row sees, so no row's maximum stays -inf
            for kb in T.Pipelined(T.ceildiv((bx + 1) * bm, bn), num_stages=stages):
                T.copy(K[bz, kb * bn:(kb + 1) * bn, head // groups, :], k)
                for i, j in T.Parallel(bm, bn):
                    scores[i, j] = T.if_then_else(bx * bm + i >= kb * bn + j, 0, -T.infinity(acc))
                T.gemm(q, k, scores, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(V[bz, kb * bn:(kb + 1) * bn, head // groups, :], v)
                T.copy(row_max, prev_max)
                T.reduce_max(scores, row_max, dim=1, clear=False)
                for i in T.Parallel(bm):
                    rescale[i] = T.exp2((prev_max[i] - row_max[i]) * log2_scale)
                for i, j in T.Parallel(bm, head_dim):
                    out[i, j] *= rescale[i]
                for i, j in T.Parallel(bm, bn):
                    scores[i, j] = T.exp2(scores[i, j] * log2_scale - row_max[i] * log2_scale)
                T.reduce_sum(scores, row_sum, dim=1)
                for i in T.Parallel(bm):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(scores, probs)
                T.gemm(probs, v, out, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bm, head_dim):
                out[i, j] /= denom[i]
            T.copy(out, O[bz, bx * bm:(bx + 1) * bm, head, :])
            for i in T.Parallel(bm):
                denom[i] = (T.log2(denom[i]) + row_max[i] * log2_scale) * LN2  # natural-log LSE
            T.copy(denom, LSE[bz, head, bx * bm:(bx + 1) * bm])

    return attention_fwd


def preprocess_kernel(heads_q: int, head_dim: int, dtype: str):
    """PrimFunc: Delta (b, heads_q, s) float32 = rowsum(dO · O), the backward's softmax correction term."""
    import tilelang.language as T

    batch, seq = T.dynamic("batch"), T.dynamic("seq")
    rows = DELTA_ROWS

    @T.prim_func
    def attention_bwd_preprocess(
        O: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        dO: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        Delta: T.Tensor((batch, heads_q, seq), "float32"),
    ):
        with T.Kernel(T.ceildiv(seq, rows), heads_q, batch, threads=128) as (bx, head, bz):
            o = T.alloc_fragment((rows, head_dim), dtype)
            do = T.alloc_fragment((rows, head_dim), dtype)
            prod = T.alloc_fragment((rows, head_dim), "float32")
            delta = T.alloc_fragment((rows,), "float32")
            T.copy(O[bz, bx * rows:(bx + 1) * rows, head, :], o)
            T.copy(dO[bz, bx * rows:(bx + 1) * rows, head, :], do)
            for i, j in T.Parallel(rows, head_dim):
                prod[i, j] = T.cast(o[i, j], "float32") * T.cast(do[i, j], "float32")
            T.reduce_sum(prod, delta, dim=1)
            T.copy(delta, Delta[bz, head, bx * rows:(bx + 1) * rows])

    return attention_bwd_preprocess


def backward_kernel(heads_q: int, heads_kv: int, head_dim: int, scale: float, dtype: str, config):
    """PrimFunc: dK, dV (b, s, heads_kv, d) and dQ accumulated into float32 (b, padded s, heads_q, d).

    One program per (block of keys, kv head, batch). It walks every query head of the kv head's group
    and every query block at or below the diagonal, recomputing Pᵀ = exp(K Qᵀ · scale - LSE) with the
    keys as rows, and accumulates dV += Pᵀ dO and dK += dSᵀ Q (dSᵀ = Pᵀ ∘ (V dOᵀ - Delta) · scale) in
    registers. GQA: summing dK, dV over the group inside the program (instead of per-query-head
    buffers summed afterwards, or atomics on dK/dV) needs no extra memory, no second pass, and is
    deterministic. dQ gets contributions from every key block, so it is added with float32 atomics
    into a buffer padded to whole query blocks (no atomic can land outside it); the caller casts it.
    Rows past the sequence end load as zeros (Q, dO, LSE, Delta), which makes their dK, dV, dQ terms zero.
    LSE and Delta rows load without TMA: a TMA descriptor needs 16-byte row strides, and a float32 row
    of `seq` values has one only when seq % 4 == 0 (seen failing on the H200 for seq 77, 130, 513).
    """
    import tilelang.language as T

    bm, bn, stages, threads, staged = config
    groups = heads_q // heads_kv
    batch, seq, padded = T.dynamic("batch"), T.dynamic("seq"), T.dynamic("padded")
    acc = "float32"
    log2_scale = scale * LOG2E

    @T.prim_func
    def attention_bwd(
        Q: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        K: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        V: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        dO: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        LSE: T.Tensor((batch, heads_q, seq), acc),
        Delta: T.Tensor((batch, heads_q, seq), acc),
        dQ: T.Tensor((batch, padded, heads_q, head_dim), acc),
        dK: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        dV: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
    ):
        with T.Kernel(T.ceildiv(seq, bn), heads_kv, batch, threads=threads) as (bx, kv_head, bz):
            k = T.alloc_shared((bn, head_dim), dtype)
            v = T.alloc_shared((bn, head_dim), dtype)
            q = T.alloc_shared((bm, head_dim), dtype)
            do = T.alloc_shared((bm, head_dim), dtype)
            lse = T.alloc_shared((bm,), acc)
            delta = T.alloc_shared((bm,), acc)
            probs_t = T.alloc_fragment((bn, bm), acc)
            probs_t_cast = (T.alloc_shared if staged else T.alloc_fragment)((bn, bm), dtype)
            dprobs_t = T.alloc_fragment((bn, bm), acc)
            dscores_t_shared = T.alloc_shared((bn, bm), dtype)
            dk = T.alloc_fragment((bn, head_dim), acc)
            dv = T.alloc_fragment((bn, head_dim), acc)
            dq = T.alloc_fragment((bm, head_dim), acc)

            T.copy(K[bz, bx * bn:(bx + 1) * bn, kv_head, :], k)
            T.copy(V[bz, bx * bn:(bx + 1) * bn, kv_head, :], v)
            T.clear(dk)
            T.clear(dv)
            first = bx * bn // bm  # the first query block that sees any of these keys
            steps = T.ceildiv(seq, bm) - first
            for it in T.Pipelined(groups * steps, num_stages=stages):
                head = kv_head * groups + it // steps
                qb = first + it % steps
                T.copy(Q[bz, qb * bm:(qb + 1) * bm, head, :], q)
                T.clear(probs_t)
                T.gemm(k, q, probs_t, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(LSE[bz, head, qb * bm:(qb + 1) * bm], lse, disable_tma=True)
                for i, j in T.Parallel(bn, bm):
                    probs_t[i, j] = T.if_then_else(bx * bn + i <= qb * bm + j,
                                                   T.exp2(probs_t[i, j] * log2_scale - lse[j] * LOG2E), 0)
                T.copy(dO[bz, qb * bm:(qb + 1) * bm, head, :], do)
                T.clear(dprobs_t)
                T.gemm(v, do, dprobs_t, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(probs_t, probs_t_cast)
                T.gemm(probs_t_cast, do, dv, policy=T.GemmWarpPolicy.FullRow)
                T.copy(Delta[bz, head, qb * bm:(qb + 1) * bm], delta, disable_tma=True)
                for i, j in T.Parallel(bn, bm):
                    dprobs_t[i, j] = probs_t[i, j] * (dprobs_t[i, j] - delta[j]) * scale  # now dSᵀ
                T.copy(dprobs_t, dscores_t_shared)
                T.gemm(dscores_t_shared, q, dk, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dq)
                T.gemm(dscores_t_shared, k, dq, transpose_A=True)
                for i, j in T.Parallel(bm, head_dim):
                    T.atomic_add(dQ[bz, qb * bm + i, head, j], dq[i, j])
            T.copy(dk, dK[bz, bx * bn:(bx + 1) * bn, kv_head, :])
            T.copy(dv, dV[bz, bx * bn:(bx + 1) * bn, kv_head, :])

    return attention_bwd


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Llama-3-8B's 32 q / 8 kv heads of 128, bf16, for `tiletune kernels lower`."""
    scale = 128**-0.5
    return {"attention_fwd": lambda: forward_kernel(32, 8, 128, scale, "bfloat16", config_for(arch, "fwd")),
            "attention_bwd_preprocess": lambda: preprocess_kernel(32, 128, "bfloat16"),
            "attention_bwd": lambda: backward_kernel(32, 8, 128, scale, "bfloat16", config_for(arch, "bwd"))}


def tilelang_unsupported(q: Tensor, k: Tensor, v: Tensor, scale: float) -> str | None:
    """Why the TileLang kernels cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(q, k, v)
    if reason is None and not (q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] in HEAD_DIMS):
        reason = (f"head_dim q {q.shape[-1]} / k {k.shape[-1]} / v {v.shape[-1]} is not supported "
                  f"(supported: {' or '.join(map(str, HEAD_DIMS))}, equal for q, k and v)")
    if reason is None and (q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or k.shape != v.shape):
        reason = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} differ in batch or sequence length"
    if reason is None and q.shape[1] % k.shape[1]:
        reason = f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    return reason


def _kernel(kind: str, q: Tensor, heads_kv: int, scale: float):
    """The compiled `kind` kernel ('fwd', 'bwd' or 'preprocess') for q's heads, head_dim and dtype."""
    heads_q, d, dtype = q.shape[1], q.shape[-1], _tilelang.DTYPES[q.dtype]
    if kind == "preprocess":
        return _tilelang.compiled(("attention", kind, heads_q, d, dtype), lambda: preprocess_kernel(heads_q, d, dtype))
    config = config_for(_tilelang.device_arch(q.device), kind)
    build = forward_kernel if kind == "fwd" else backward_kernel
    return _tilelang.compiled(("attention", kind, heads_q, heads_kv, d, scale, dtype, config),
                              lambda: build(heads_q, heads_kv, d, scale, dtype, config))


def _bshd(x: Tensor) -> Tensor:
    """(batch, heads, seq, d) -> contiguous (batch, seq, heads, d): free for transformers' transposed projections."""
    return x.transpose(1, 2).contiguous()


def tilelang_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) by the TileLang forward kernel; out is a (1, 2) transpose of a (batch, seq, heads, d) tensor."""
    b, hq, s, _ = q.shape
    qs, ks, vs = _bshd(q), _bshd(k), _bshd(v)
    out, lse = torch.empty_like(qs), q.new_empty(b, hq, s, dtype=torch.float32)
    if b and s:
        _kernel("fwd", q, k.shape[1], scale)(qs, ks, vs, out, lse)
    return out.transpose(1, 2), lse


def tilelang_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float):
    """(dq, dk, dv) by the TileLang preprocess and backward kernels (dq cast from its float32 accumulator)."""
    b, hq, s, d = q.shape
    qs, ks, vs, dos = _bshd(q), _bshd(k), _bshd(v), _bshd(dout)
    block_m = config_for(_tilelang.device_arch(q.device), "bwd")[0]
    dq = q.new_zeros(b, -(-s // block_m) * block_m, hq, d, dtype=torch.float32)
    dk, dv = torch.empty_like(ks), torch.empty_like(vs)
    if b and s:
        delta = q.new_empty(b, hq, s, dtype=torch.float32)
        _kernel("preprocess", q, k.shape[1], scale)(_bshd(out), dos, delta)
        _kernel("bwd", q, k.shape[1], scale)(qs, ks, vs, dos, lse.contiguous(), delta, dq, dk, dv)
    return dq[:, :s].to(q.dtype).transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


add(Impl("attention", "reference", reference_forward, reference_backward,
         description="PyTorch: causal GQA attention from explicit scores, fp32 inside", accumulation="float32"))
add(Impl("attention", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang flash attention: online softmax, causal block skipping, GQA dK/dV summed "
         "in registers", accumulation="float32"))

# ---- custom ops ----------------------------------------------------------------------------------


def _like_kernel(x: Tensor) -> Tensor:
    """x with the kernels' strides: a (1, 2) transpose of a contiguous (batch, seq, heads, d) tensor."""
    return _bshd(x).transpose(1, 2)


def _empty_like_kernel(x: Tensor) -> Tensor:
    b, h, s, d = x.shape
    return x.new_empty(b, s, h, d).transpose(1, 2)


@torch.library.custom_op("tiletune::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, impl: str, strict: bool) -> tuple[Tensor, Tensor]:
    out, lse = select("attention", impl, strict, q, k, v, scale).forward(q, k, v, scale)
    return _like_kernel(out), lse.contiguous()


@attention_op.register_fake
def _(q, k, v, scale, impl, strict):
    b, hq, s, _ = q.shape
    return _empty_like_kernel(q), q.new_empty(b, hq, s, dtype=_tilelang.accumulate_dtype(q))


@torch.library.custom_op("tiletune::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                          impl: str, strict: bool) -> tuple[Tensor, Tensor, Tensor]:
    grads = backward_of(select("attention", impl, strict, q, k, v, scale))(dout, q, k, v, out, lse, scale)
    return tuple(_like_kernel(g) for g in grads)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, scale, impl, strict):
    return _empty_like_kernel(q), _empty_like_kernel(k), _empty_like_kernel(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.scale, ctx.impl, ctx.strict = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.tiletune.attention_backward(dout, q, k, v, out, lse, ctx.scale, ctx.impl, ctx.strict)
    return dq, dk, dv, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, impl: str = "reference", strict: bool = False) -> Tensor:
    """Causal GQA attention: q (batch, heads_q, seq, d), k, v (batch, heads_kv, seq, d) -> (batch, heads_q, seq, d).

    The result is a (1, 2) transpose of a contiguous (batch, seq, heads_q, d) tensor, the layout
    transformers' attention functions return after their own transpose.
    """
    return torch.ops.tiletune.attention(q, k, v, scale, impl, strict)[0]
