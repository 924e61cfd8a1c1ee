"""Causal grouped-query attention: ``out = softmax(q kᵀ · scale + causal mask) v``, backward dq, dk, dv.

q is (batch, heads_q, seq, head_dim) and k, v are (batch, heads_kv, seq, head_dim), the layout
transformers passes to its attention functions; query head h reads kv head h // (heads_q / heads_kv).
Query i sees keys 0..i (the same sequence: no KV-cache prefix); with `cu_seqlens` (packed sequences in
one row, batch 1, flash-attention's varlen boundaries) it sees only those of its own sequence: the
block-diagonal causal mask `neat_packing` needs. The forward also returns the
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

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, autocast, calls_global, replacing_global, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define, note_fallback

HEAD_DIMS = (64, 128)  # head_dim values the TileLang kernels are configured for
LOG2E, LN2 = math.log2(math.e), math.log(2.0)
MASKED = -1e30  # the varlen kernels' masked score: finite, so a row with no key seen yet is no NaN

# ---- reference -----------------------------------------------------------------------------------


def _grouped(x: Tensor, heads_kv: int, dtype: torch.dtype) -> Tensor:
    """(batch, heads_q, seq, d) -> (batch, heads_kv, group, seq, d) in `dtype`: GQA by broadcasting, no repeat."""
    b, h, s, d = x.shape
    return x.to(dtype).reshape(b, heads_kv, h // heads_kv, s, d)


def segments(cu_seqlens: Tensor, seq: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per token of a packed row, (start, end) int32: its segment's first token and one past its last.

    cu_seqlens: int32 cumulative lengths [0, len0, len0 + len1, ..., seq], flash-attention's varlen
    boundaries; tokens before its first or past its last entry form one more segment each. No host
    synchronisation.
    """
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    bounds = torch.cat([cu.new_zeros(1), cu, cu.new_tensor([seq])])
    index = torch.searchsorted(bounds, torch.arange(seq, device=device), right=True)
    return bounds[index - 1].int(), bounds[index].int()


def _causal_scores(q5: Tensor, k: Tensor, scale: float, cu_seqlens: Tensor | None = None) -> Tensor:
    """Scaled scores (batch, heads_kv, group, seq, seq) with -inf above the diagonal (and, packed, outside
    each query's segment: block-diagonal causal)."""
    s = q5.shape[-2]
    scores = q5 @ k.unsqueeze(2).transpose(-1, -2) * scale
    future = torch.ones(s, s, dtype=torch.bool, device=q5.device).triu(1)
    if cu_seqlens is not None:
        starts, _ = segments(cu_seqlens, s, q5.device)
        future |= torch.arange(s, device=q5.device) < starts[:, None]  # keys before the query's segment
    return scores.masked_fill(future, float("-inf"))


def _check_packed(q: Tensor, cu_seqlens: Tensor | None) -> None:
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) are one row of all tokens: batch is {q.shape[0]}, not 1")


def reference_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                      cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out like q, lse (batch, heads_q, seq)): causal GQA attention in fp32 (float64 for float64 inputs);
    with cu_seqlens (batch 1), each packed sequence attends to itself only."""
    acc = _tilelang.accumulate_dtype(q)
    b, hq, s, _ = q.shape
    hk = k.shape[1]
    if hq % hk:
        raise ValueError(f"{hq} query heads are not a multiple of {hk} kv heads")
    _check_packed(q, cu_seqlens)
    scores = _causal_scores(_grouped(q, hk, acc), k.to(acc), scale, cu_seqlens)
    lse = scores.logsumexp(-1, keepdim=True)
    out = (scores - lse).exp() @ v.to(acc).unsqueeze(2)
    return out.reshape(q.shape).to(q.dtype), lse.reshape(b, hq, s)


def reference_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                       cu_seqlens: Tensor | None = None):
    """(dq, dk, dv) from the saved output and log-sum-exp, the way the kernel computes them, in fp32 (or float64)."""
    acc = _tilelang.accumulate_dtype(q)
    hk = k.shape[1]
    q5, do5, o5 = (_grouped(t, hk, acc) for t in (q, dout, out))
    k4, v4 = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    _check_packed(q, cu_seqlens)
    p = (_causal_scores(q5, k.to(acc), scale, cu_seqlens) - lse.to(acc).reshape(*q5.shape[:-1], 1)).exp()
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


def forward_kernel(heads_q: int, heads_kv: int, head_dim: int, scale: float, dtype: str, config, varlen: bool = False):
    """PrimFunc: O, LSE from Q (b, s, heads_q, d), K, V (b, s, heads_kv, d); LSE is (b, heads_q, s) float32.

    One program per (block of query rows, query head, batch). Online softmax in the log2 domain: per
    block of keys, rescale the running output and denominator by exp2(old max - new max). Key blocks
    entirely above the diagonal are never loaded (causal block skipping); the diagonal block is masked.

    varlen (packed sequences, batch 1): one more input, Starts (s,) int32, each token's segment start;
    query i sees keys Starts[i]..i, and the walk over key blocks begins at the block of the query block's
    first row's segment start (Starts is non-decreasing). Masked scores are a large finite negative
    instead of -inf: a row may see no key of the first blocks (its segment starts later), and its
    maximum of -1e30 then gives finite garbage that the first real key's rescale exp2(-1e30 - max)
    multiplies by exactly 0. The flag is static: the plain kernel's code is unchanged.
    """
    import tilelang.language as T

    bm, bn, stages, threads, staged = config
    groups = heads_q // heads_kv
    batch, seq = T.dynamic("batch"), T.dynamic("seq")
    acc = "float32"
    log2_scale = scale * LOG2E

    @T.macro
    def body(Q, K, V, O, LSE, Starts):
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
            starts = T.alloc_shared((bm,), "int32") if varlen else None

            T.copy(Q[bz, bx * bm:(bx + 1) * bm, head, :], q)
            if varlen:
                T.copy(Starts[bx * bm:(bx + 1) * bm], starts, disable_tma=True)
            T.fill(out, 0)
            T.fill(denom, 0)
            T.fill(row_max, -T.infinity(acc))
            # keys past the block's last query row are never visited; block 0 holds key 0, which every
            # row sees, so no row's maximum stays -inf (varlen: see the docstring)
            first = Starts[bx * bm] // bn if varlen else 0  # the first key block a row of the block sees
            for it in T.Pipelined(T.ceildiv((bx + 1) * bm, bn) - first, num_stages=stages):
                kb = first + it
                T.copy(K[bz, kb * bn:(kb + 1) * bn, head // groups, :], k)
                for i, j in T.Parallel(bm, bn):
                    scores[i, j] = (T.if_then_else(T.And(bx * bm + i >= kb * bn + j, kb * bn + j >= starts[i]), 0, MASKED)
                                    if varlen else T.if_then_else(bx * bm + i >= kb * bn + j, 0, -T.infinity(acc)))
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

    # Two thin headers over one body: a TileLang prim_func's parameters are fixed, and only the varlen one takes
    # the sequence boundaries (the plain kernel's source stays byte for byte what it was).
    if varlen:
        @T.prim_func
        def attention_fwd_varlen(
            Q: T.Tensor((batch, seq, heads_q, head_dim), dtype),
            K: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
            V: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
            O: T.Tensor((batch, seq, heads_q, head_dim), dtype),
            LSE: T.Tensor((batch, heads_q, seq), acc),
            Starts: T.Tensor((seq,), "int32"),
        ):
            body(Q, K, V, O, LSE, Starts)

        return attention_fwd_varlen

    @T.prim_func
    def attention_fwd(
        Q: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        K: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        V: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
        O: T.Tensor((batch, seq, heads_q, head_dim), dtype),
        LSE: T.Tensor((batch, heads_q, seq), acc),
    ):
        body(Q, K, V, O, LSE, None)

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


def backward_kernel(heads_q: int, heads_kv: int, head_dim: int, scale: float, dtype: str, config, varlen: bool = False):
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

    varlen (packed sequences, batch 1): one more input, Ends (s,) int32, each token's segment end (one
    past its last token); key j is seen by queries j..Ends[j]-1, and the walk over query blocks stops at
    the block holding the block's last key's segment end (Ends is non-decreasing). Static, as forward's.
    """
    import tilelang.language as T

    bm, bn, stages, threads, staged = config
    groups = heads_q // heads_kv
    batch, seq, padded = T.dynamic("batch"), T.dynamic("seq"), T.dynamic("padded")
    acc = "float32"
    log2_scale = scale * LOG2E

    @T.macro
    def body(Q, K, V, dO, LSE, Delta, dQ, dK, dV, Ends):
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
            ends = T.alloc_shared((bn,), "int32") if varlen else None

            T.copy(K[bz, bx * bn:(bx + 1) * bn, kv_head, :], k)
            T.copy(V[bz, bx * bn:(bx + 1) * bn, kv_head, :], v)
            if varlen:
                T.copy(Ends[bx * bn:(bx + 1) * bn], ends, disable_tma=True)
            T.clear(dk)
            T.clear(dv)
            first = bx * bn // bm  # the first query block that sees any of these keys
            # one past the last query block that sees a key of this block
            steps = T.ceildiv(Ends[T.min((bx + 1) * bn, seq) - 1] if varlen else seq, bm) - first
            for it in T.Pipelined(groups * steps, num_stages=stages):
                head = kv_head * groups + it // steps
                qb = first + it % steps
                T.copy(Q[bz, qb * bm:(qb + 1) * bm, head, :], q)
                T.clear(probs_t)
                T.gemm(k, q, probs_t, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(LSE[bz, head, qb * bm:(qb + 1) * bm], lse, disable_tma=True)
                for i, j in T.Parallel(bn, bm):
                    probs_t[i, j] = T.if_then_else(
                        T.And(bx * bn + i <= qb * bm + j, qb * bm + j < ends[i]) if varlen else bx * bn + i <= qb * bm + j,
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

    if varlen:  # two headers over one body, as for the forward
        @T.prim_func
        def attention_bwd_varlen(
            Q: T.Tensor((batch, seq, heads_q, head_dim), dtype),
            K: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
            V: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
            dO: T.Tensor((batch, seq, heads_q, head_dim), dtype),
            LSE: T.Tensor((batch, heads_q, seq), acc),
            Delta: T.Tensor((batch, heads_q, seq), acc),
            dQ: T.Tensor((batch, padded, heads_q, head_dim), acc),
            dK: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
            dV: T.Tensor((batch, seq, heads_kv, head_dim), dtype),
            Ends: T.Tensor((seq,), "int32"),
        ):
            body(Q, K, V, dO, LSE, Delta, dQ, dK, dV, Ends)

        return attention_bwd_varlen

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
        body(Q, K, V, dO, LSE, Delta, dQ, dK, dV, None)

    return attention_bwd


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Llama-3-8B's 32 q / 8 kv heads of 128, bf16, for `tiletune kernels lower`."""
    scale = 128**-0.5
    return {"attention_fwd": lambda: forward_kernel(32, 8, 128, scale, "bfloat16", config_for(arch, "fwd")),
            "attention_bwd_preprocess": lambda: preprocess_kernel(32, 128, "bfloat16"),
            "attention_bwd": lambda: backward_kernel(32, 8, 128, scale, "bfloat16", config_for(arch, "bwd")),
            "attention_fwd_varlen": lambda: forward_kernel(32, 8, 128, scale, "bfloat16", config_for(arch, "fwd"), True),
            "attention_bwd_varlen": lambda: backward_kernel(32, 8, 128, scale, "bfloat16", config_for(arch, "bwd"), True)}


def tilelang_unsupported(q: Tensor, k: Tensor, v: Tensor, scale: float, cu_seqlens: Tensor | None = None) -> str | None:
    """Why the TileLang kernels cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(q, k, v)
    if reason is None and not (q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] in HEAD_DIMS):
        reason = (f"head_dim q {q.shape[-1]} / k {k.shape[-1]} / v {v.shape[-1]} is not supported "
                  f"(supported: {' or '.join(map(str, HEAD_DIMS))}, equal for q, k and v)")
    if reason is None and (q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or k.shape != v.shape):
        reason = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} differ in batch or sequence length"
    if reason is None and q.shape[1] % k.shape[1]:
        reason = f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    if reason is None and cu_seqlens is not None and q.shape[0] != 1:
        reason = f"packed sequences (cu_seqlens) with batch {q.shape[0]}: they are one row of all tokens"
    return reason


def _kernel(kind: str, q: Tensor, heads_kv: int, scale: float, varlen: bool = False):
    """The compiled `kind` kernel ('fwd', 'bwd' or 'preprocess') for q's heads, head_dim and dtype
    (varlen: the packed-sequences variant of 'fwd' or 'bwd')."""
    heads_q, d, dtype = q.shape[1], q.shape[-1], _tilelang.DTYPES[q.dtype]
    if kind == "preprocess":
        return _tilelang.compiled(("attention", kind, heads_q, d, dtype), lambda: preprocess_kernel(heads_q, d, dtype))
    config = config_for(_tilelang.device_arch(q.device), kind)
    build = forward_kernel if kind == "fwd" else backward_kernel
    key = ("attention", kind + "_varlen" if varlen else kind, heads_q, heads_kv, d, scale, dtype, config)
    return _tilelang.compiled(key, lambda: build(heads_q, heads_kv, d, scale, dtype, config, varlen))


def _bshd(x: Tensor) -> Tensor:
    """(batch, heads, seq, d) -> contiguous (batch, seq, heads, d): free for transformers' transposed projections."""
    return x.transpose(1, 2).contiguous()


def tilelang_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                     cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) by the TileLang forward kernel; out is a (1, 2) transpose of a (batch, seq, heads, d) tensor."""
    b, hq, s, _ = q.shape
    qs, ks, vs = _bshd(q), _bshd(k), _bshd(v)
    out, lse = torch.empty_like(qs), q.new_empty(b, hq, s, dtype=torch.float32)
    if b and s and cu_seqlens is not None:
        _kernel("fwd", q, k.shape[1], scale, True)(qs, ks, vs, out, lse, segments(cu_seqlens, s, q.device)[0])
    elif b and s:
        _kernel("fwd", q, k.shape[1], scale)(qs, ks, vs, out, lse)
    return out.transpose(1, 2), lse


def tilelang_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                      cu_seqlens: Tensor | None = None):
    """(dq, dk, dv) by the TileLang preprocess and backward kernels (dq cast from its float32 accumulator)."""
    b, hq, s, d = q.shape
    qs, ks, vs, dos = _bshd(q), _bshd(k), _bshd(v), _bshd(dout)
    block_m = config_for(_tilelang.device_arch(q.device), "bwd")[0]
    dq = q.new_zeros(b, -(-s // block_m) * block_m, hq, d, dtype=torch.float32)
    dk, dv = torch.empty_like(ks), torch.empty_like(vs)
    if b and s:
        delta = q.new_empty(b, hq, s, dtype=torch.float32)
        _kernel("preprocess", q, k.shape[1], scale)(_bshd(out), dos, delta)
        args = (qs, ks, vs, dos, lse.contiguous(), delta, dq, dk, dv)
        if cu_seqlens is None:
            _kernel("bwd", q, k.shape[1], scale)(*args)
        else:
            _kernel("bwd", q, k.shape[1], scale, True)(*args, segments(cu_seqlens, s, q.device)[1])
    return dq[:, :s].to(q.dtype).transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---- custom ops ------------------------------------------------------------------------------------


def _kernel_layout(x: Tensor) -> Tensor:
    """4-D tensors with the kernels' strides (a (1, 2) transpose of a contiguous (batch, seq, heads, d) tensor);
    the log-sum-exp rows contiguous."""
    return _bshd(x).transpose(1, 2) if x.dim() == 4 else x.contiguous()


def _empty_like_kernel(x: Tensor) -> Tensor:
    b, h, s, d = x.shape
    return x.new_empty(b, s, h, d).transpose(1, 2)


attention_op = make_custom_op(Signature(
    "attention", "Tensor q, Tensor k, Tensor v, float scale, Tensor? cu_seqlens", "(Tensor, Tensor)",
    backward_inputs="Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, Tensor? cu_seqlens",
    backward_outputs="(Tensor, Tensor, Tensor)",
    fake=lambda q, k, v, scale, cu_seqlens: (_empty_like_kernel(q),
                                             q.new_empty(*q.shape[:3], dtype=_tilelang.accumulate_dtype(q))),
    backward_fake=lambda dout, q, k, v, out, lse, scale, cu_seqlens: (_empty_like_kernel(q), _empty_like_kernel(k),
                                                                      _empty_like_kernel(v)),
    save=lambda inputs, outputs, needs: (*inputs[:3], *outputs, *inputs[3:]),
    judged_on=lambda grads, saved: (*saved[:3], *saved[5:]),
    grad_of=(0, 1, 2, None, None),
    layout=_kernel_layout,
))


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, impl: str = "reference", strict: bool = False,
              cu_seqlens: Tensor | None = None) -> Tensor:
    """Causal GQA attention: q (batch, heads_q, seq, d), k, v (batch, heads_kv, seq, d) -> (batch, heads_q, seq, d).

    The result is a (1, 2) transpose of a contiguous (batch, seq, heads_q, d) tensor, the layout
    transformers' attention functions return after their own transpose. cu_seqlens (int32, flash-attention's
    varlen boundaries [0, ..., seq]): packed sequences in one row (batch 1), each attending to itself only.
    """
    return torch.ops.tiletune.attention(q, k, v, scale, cu_seqlens, impl, strict)[0]


# ---- binding: transformers' attention call, per module ----------------------------------------------

_GLOBAL = "ALL_ATTENTION_FUNCTIONS"  # where transformers' attention forwards look up SDPA, flash, ...
# Keyword arguments of transformers' attention functions that change what is computed; the others
# (position_ids, output_attentions, ...) do not, and SDPA ignores them as well. cu_seq_lens_q (packed
# sequences) is read by `_packed_boundaries`.
_VARIANTS = {"sliding_window": "sliding window", "softcap": "logit softcapping", "s_aux": "attention sinks",
             "sinks": "attention sinks", "position_bias": "a position bias"}


def _fit(site: Site) -> str | None:
    if site.part.softcap or site.part.sinks:
        return f"{'logit soft-capping' if site.part.softcap else 'attention sinks'}: no kernel yet: stock attention kept"
    if getattr(site.part, "latent", False):
        qk, v = (getattr(site.module, name, "?") for name in ("qk_head_dim", "v_head_dim"))
        return (f"multi-head latent attention (q/k head_dim {qk}, v head_dim {v}; the op takes one head_dim): "
                "no kernel yet: stock attention kept")
    if not calls_global(type(site.module).forward, _GLOBAL):
        return f"{type(site.module).__name__}.forward does not look up {_GLOBAL}: stock attention kept"
    if not all(hasattr(site.module, name) for name in ("q_proj", "k_proj", "head_dim", "scaling")):
        return f"{type(site.module).__name__} has no q_proj, k_proj, head_dim and scaling: stock attention kept"
    return None


def _unfit_now(module: nn.Module) -> str | None:
    """Why tiletune's attention cannot stand in for this module's attention (known when patching), or None."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if implementation == "eager":
        reason = "attn_implementation eager builds an explicit mask for every call (use sdpa, the default)"
    elif getattr(module, "sliding_window", None):
        reason = f"sliding window {module.sliding_window}"
    elif getattr(module, "attn_logit_softcapping", None):
        reason = "logit softcapping"
    elif not getattr(module, "is_causal", True):
        reason = "not causal"
    else:
        return None
    return f"{reason}: stock attention kept"


def _cached(tensor: Tensor, name: str, of: Tensor | None, compute: Callable):
    """compute(), kept on `tensor` (transformers passes every layer the same mask, position ids and
    boundaries tensors, so a forward computes it once) for the same `of` tensor."""
    kept = getattr(tensor, name, None)
    if kept is None or kept[0] is not of:
        kept = (of, compute())
        setattr(tensor, name, kept)
    return kept[1]


def _boundaries_of_positions(position_ids: Tensor) -> Tensor:
    """cu_seqlens of a row from its position ids: a sequence starts where a position is not its predecessor
    + 1 (transformers' `find_packed_sequence_indices`); one host synchronisation."""
    row = position_ids[0]
    starts = torch.nonzero(torch.diff(row) != 1).flatten() + 1
    return torch.cat([starts.new_zeros(1), starts, starts.new_tensor([row.numel()])]).to(torch.int32)


def _block_diagonal(cu_seqlens: Tensor, seq: int, device: torch.device) -> Tensor:
    """(seq, seq) bool: True where a query sees a key of packed sequences `cu_seqlens` (block-diagonal causal)."""
    starts, _ = segments(cu_seqlens, seq, device)
    keys = torch.arange(seq, device=device)
    return (keys <= keys[:, None]) & (keys >= starts[:, None])


def _mask_is(mask: Tensor, cu_seqlens: Tensor, seq: int) -> bool:
    """Whether SDPA's mask (bool, or additive float) is exactly the block-diagonal causal mask of cu_seqlens."""
    if mask.dim() != 4 or tuple(mask.shape[:2]) != (1, 1) or tuple(mask.shape[2:]) != (seq, seq):
        return False
    seen = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
    return bool(torch.equal(seen, _block_diagonal(cu_seqlens, seq, mask.device)))


def _packed_boundaries(query, key, mask, kwargs: dict) -> tuple[bool, Tensor | None]:
    """(packed, cu_seqlens): whether this call is packed sequences in one row (batch 1) tiletune's op can run,
    and their int32 boundaries (None for a single sequence: plain causal).

    Flash-attention's path gives the boundaries (cu_seq_lens_q/k, no mask); SDPA's gets transformers'
    block-diagonal mask, built from the position ids (or given with the boundaries too): the mask must be
    exactly the boundaries' block-diagonal causal mask, checked once per forward and kept on the mask.
    Anything else (padding, a plain packing's causal mask, different q and k boundaries) is not packed.
    """
    cu_q, cu_k, positions = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids")
    seq = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != seq or (cu_q is None and (mask is None or positions is None)):
        return False, None
    if cu_q is not None:
        if cu_k is None or cu_q.dim() != 1 or cu_q.numel() < 2:
            return False, None
        fits = _cached(cu_q, "_tiletune_packed", cu_k, lambda: bool(
            cu_k.shape == cu_q.shape and torch.equal(cu_q, cu_k.to(cu_q.device)) and cu_q[0] == 0 and cu_q[-1] == seq))
        cu = cu_q.to(device=query.device, dtype=torch.int32)
    elif positions.dim() == 2 and tuple(positions.shape) == (1, seq):
        fits, cu = True, _cached(positions, "_tiletune_boundaries", None, lambda: _boundaries_of_positions(positions))
        cu = cu.to(query.device)
    else:
        return False, None
    if fits and mask is not None:
        fits = _cached(mask, "_tiletune_packed", cu_q if cu_q is not None else positions, lambda: _mask_is(mask, cu, seq))
    return fits, (cu if fits and cu.numel() > 2 else None)


def _call_unfit(module: nn.Module, query, key, value, mask, args: tuple, kwargs: dict,
                packed: bool = False) -> str | None:
    """Why this call is not (packed, when `packed`) causal self-attention tiletune's op computes, or None."""
    variant = next((text for name, text in _VARIANTS.items() if kwargs.get(name) is not None), None)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal  # None: the module decides, as in SDPA
    if args:
        reason = "positional arguments after the mask"
    elif mask is not None and not packed:
        reason = "an attention mask (padding, packed sequences, or the eager implementation's explicit causal mask)"
    elif kwargs.get("cu_seq_lens_q") is not None and not packed:
        reason = "packed sequences other than one row of whole sequences with the same query and key boundaries"
    elif variant:
        reason = variant
    elif kwargs.get("dropout", 0.0):
        reason = f"attention dropout {kwargs['dropout']} in training"
    elif not causal:
        reason = "not causal"
    elif query.shape[2] != key.shape[2]:
        reason = f"{query.shape[2]} queries against {key.shape[2]} keys (KV cache)"
    elif query.shape[-1] != value.shape[-1] or query.shape[1] % key.shape[1]:
        reason = f"heads {query.shape[1]}/{key.shape[1]} or head_dim q {query.shape[-1]}, v {value.shape[-1]} do not fit GQA"
    else:
        return None
    return f"{reason}: stock attention"


class _AttentionFunctions:
    """Stands in for transformers' ALL_ATTENTION_FUNCTIONS inside a patched attention forward.

    Each lookup returns the function transformers would use (SDPA, flash, ...), wrapped so that plain
    causal self-attention, and packed sequences in one row (`_packed_boundaries`), run tiletune's attention
    op and every other call the stock function.
    """

    def __init__(self, stock, impl: str, strict: bool):
        self._stock, self._impl, self._strict = stock, impl, strict
        self._wrapped: dict[Callable, Callable] = {}

    def get_interface(self, name: str, default: Callable) -> Callable:
        return self._wrap(self._stock.get_interface(name, default))

    def __getitem__(self, name: str) -> Callable:
        return self._wrap(self._stock[name])

    def __getattr__(self, name: str):
        return getattr(self._stock, name)

    def _wrap(self, stock: Callable) -> Callable:
        if stock not in self._wrapped:
            self._wrapped[stock] = _attention_function(stock, self._impl, self._strict)
        return self._wrapped[stock]


def _attention_function(stock: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for one of transformers' attention functions that runs tiletune's attention op when it can."""

    @functools.wraps(stock)
    def attention_function(module, query, key, value, attention_mask, *args, **kwargs):
        packed, cu_seqlens = _packed_boundaries(query, key, attention_mask, kwargs)
        reason = _call_unfit(module, query, key, value, attention_mask, args, kwargs, packed)
        if reason:
            note_fallback("attention", impl, reason)
            return stock(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        query, key, value = autocast(query, key, value)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = attention(query, key, value, scale, impl, strict, cu_seqlens)
        return out.transpose(1, 2), None  # (batch, seq, heads, head_dim), no attention weights, as SDPA
    return attention_function


def _compile_key(site: Site) -> tuple:
    module = site.module
    d = module.head_dim
    return (module.q_proj.out_features // d, module.k_proj.out_features // d, d, module.scaling)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    heads_q, heads_kv, d, scale = key
    return attention(warm_tensor(1, heads_q, 1, d, dtype=dtype), warm_tensor(1, heads_kv, 1, d, dtype=dtype),
                     warm_tensor(1, heads_kv, 1, d, dtype=dtype), scale, impl, True)


# Opt-in: slower than SDPA's cuDNN backend on the H200 (docs/kernels.md).
define(Op("attention", (Binding("attention", "attention", replacing_global(_GLOBAL, _AttentionFunctions), _fit,
                                unfit_now=_unfit_now, compile_key=_compile_key, warm=_warm),),
          opt_in=True, lowering=lowering_kernels))
add(Impl("attention", "reference", reference_forward, reference_backward,
         description="PyTorch: causal GQA attention from explicit scores, fp32 inside", accumulation="float32"))
add(Impl("attention", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang flash attention: online softmax, causal block skipping, GQA dK/dV summed "
         "in registers", accumulation="float32"))
