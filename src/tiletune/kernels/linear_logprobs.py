"""Fused lm_head projection, log-softmax and gather: each token's log-probability of its label.

Semantics (the reference): ``logp_i = log_softmax(cap(hidden_i @ weightᵀ))[label_i]`` in float32 (float64 for
float64 inputs), 0 where the label is -100; ``cap`` as in linear_cross_entropy (the identity, or Gemma 2's
``c·tanh(z / c)``). The backward takes each token's upstream gradient ``dlogp_i`` (a preference loss weighs
every answer differently) and returns d hidden, and d weight when the weight trains.

Besides the log-probabilities the op returns each token's log-normaliser (``logsumexp``, what the backward
keeps) and, without gradient, the statistics TRL's preference trainers log from their fused LM head: the
entropy of the next-token distribution, the mean logit and whether the label is the most likely token (the
first of equal maxima, as torch.argmax; 0 where the label is -100).

The ``chunked`` implementation walks the tokens in chunks of `linear_cross_entropy.CHUNK_BYTES` of float32
logits, so the ``[tokens, vocab]`` logits never exist: the forward keeps the log-normalisers, the backward
recomputes each chunk's logits from them. The ``tilelang`` implementation never forms them either: its forward
kernel walks the vocabulary tile by tile for each block of tokens (each logits tile a float32 GEMM, then an
online log-sum-exp with the statistics alongside); its backward kernel recomputes one logits tile per program
and writes the logits' gradient of a chunk of tokens in the input dtype, which the vendor GEMMs take to d hidden
and d weight. Fusing those two GEMMs too would need a [block, hidden] float32 accumulator per program (1 MiB at
hidden 4096, past an SM's registers and shared memory) or the logits recomputed once per hidden tile.

The op has no binding: the preference stages (train/preference.py) call it in place of TRL's fused LM head
when `kernels:` selects it, so its kernels compile at their first call rather than in `tiletune kernels warmup`.
"""

# No `from __future__ import annotations`: TileLang reads the kernel signatures' shapes from the closure.

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from tiletune.kernels import _tilelang
from tiletune.kernels._tilelang import accumulate_dtype
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.linear_cross_entropy import (
    IGNORE_INDEX,
    backpropagate,
    capped_logits,
    chunk_tokens,
    logit_gradient,
)
from tiletune.kernels.registry import Impl, Op, add, define

STATISTICS = ("entropy", "mean_logits", "is_top1")  # the columns of the op's third output


def _forward(hidden: Tensor, weight: Tensor, labels: Tensor, softcap: float, chunk: int):
    acc = accumulate_dtype(hidden)
    logp = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)
    log_norm = torch.zeros_like(logp)
    stats = torch.zeros(hidden.shape[0], len(STATISTICS), dtype=acc, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        y = labels[rows]
        logits, _ = capped_logits(hidden[rows], weight, softcap)
        valid = (y != IGNORE_INDEX).to(acc)
        log_norm[rows] = torch.logsumexp(logits, dim=-1)
        target = logits.gather(1, y.clamp(min=0)[:, None])[:, 0]
        logp[rows] = (target - log_norm[rows]) * valid
        probs = torch.exp(logits - log_norm[rows, None])
        entropy = log_norm[rows] - (probs * logits).sum(-1)
        is_top1 = (logits.argmax(-1) == y).to(acc)
        stats[rows] = torch.stack((entropy, logits.mean(-1), is_top1), dim=-1) * valid[:, None]
    return logp, log_norm, stats


def _backward(dlogp: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, log_norm: Tensor, softcap: float,
              weight_grad: bool, chunk: int):  # fmt: skip
    def logit_grad(start: int, h: Tensor) -> Tensor:
        y = labels[start : start + len(h)]
        logits, slope = capped_logits(h, weight, softcap)
        scale = -dlogp[start : start + len(h)].to(logits.dtype) * (y != IGNORE_INDEX)  # d logp = -d(log_norm - target)
        return logit_gradient(logits, log_norm[start : start + len(h)], y, scale, slope)

    return backpropagate(hidden, weight, weight_grad, chunk, logit_grad)


def reference_forward(hidden: Tensor, weight: Tensor, labels: Tensor, softcap: float = 0.0):
    """(log-probabilities, log-normalisers, [tokens, 3] statistics), all tokens at once."""
    return _forward(hidden, weight, labels, softcap, chunk=max(hidden.shape[0], 1))


def reference_backward(dlogp: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, log_norm: Tensor,
                       softcap: float, weight_grad: bool):  # fmt: skip
    """(d hidden, d weight or an empty tensor) for the upstream gradient `dlogp`, all tokens at once."""
    return _backward(dlogp, hidden, weight, labels, log_norm, softcap, weight_grad, max(hidden.shape[0], 1))


def chunked_forward(hidden: Tensor, weight: Tensor, labels: Tensor, softcap: float = 0.0):
    """The same, `CHUNK_BYTES` of float32 logits at a time."""
    return _forward(hidden, weight, labels, softcap, chunk_tokens(weight))


def chunked_backward(dlogp: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, log_norm: Tensor, softcap: float,
                     weight_grad: bool):  # fmt: skip
    """The same, each chunk's logits recomputed from the saved log-normalisers."""
    return _backward(dlogp, hidden, weight, labels, log_norm, softcap, weight_grad, chunk_tokens(weight))


# ---- TileLang kernels ----------------------------------------------------------------------------

# (block_m tokens, block_n vocabulary entries, block_k hidden units per GEMM step, stages, threads). One program
# owns block_m tokens: the forward walks every vocabulary tile, the backward's one tile. Shared memory per stage:
# (block_m + block_n) x block_k operands (sm_90: 24 KB x 3; sm_80 and gfx9: 12 KB x 2; gfx1100: 6 KB).
# block_m 64: one wgmma warpgroup on sm_90, and 8192 tokens give 128 programs for the H200's 132 SMs.
CONFIGS = {"sm_90": (64, 128, 64, 3, 128), "sm_80": (64, 128, 32, 2, 128), "gfx9": (64, 128, 32, 2, 256),
           "gfx1100": (64, 64, 32, 1, 128)}
MASKED = -1e30  # the logit of a vocabulary column past the end: finite, so exp(MASKED - max)·MASKED is 0, not NaN


def config_for(arch: str) -> tuple[int, int, int, int, int]:
    """The tile configuration on `arch` ('sm_90', 'gfx942', ...)."""
    return CONFIGS[arch if arch in ("sm_90", "gfx1100") else "gfx9" if arch.startswith("gfx") else "sm_80"]


def _logits_macro(hidden: int, softcap: float, config):
    """T.macro: z (block_m, block_n) float32 = cap(H[row0:, :] · W[col0:, :]ᵀ), the GEMM stepping block_k hidden
    units at a time (TileLang zero-fills the loads past the last token, vocabulary entry and hidden unit)."""
    import tilelang.language as T

    bm, bn, bk, stages, _ = config

    @T.macro
    def logits(H, W, row0, col0, h, w, z):
        T.clear(z)
        for ko in T.Pipelined(T.ceildiv(hidden, bk), num_stages=stages):
            T.copy(H[row0, ko * bk], h)
            T.copy(W[col0, ko * bk], w)
            T.gemm(h, w, z, transpose_B=True)
        if softcap > 0:
            for i, j in T.Parallel(bm, bn):
                z[i, j] = softcap * T.tanh(z[i, j] / softcap)

    return logits


def forward_kernel(vocab: int, hidden: int, softcap: float, dtype: str, config):
    """PrimFunc: Logp, LogNorm (m,) and Stats (len(STATISTICS), m) float32 from H (m, hidden), W (vocab, hidden) and
    Labels (m,) int32; m dynamic.

    One program per block_m tokens walks the vocabulary block_n entries at a time, keeping per token the
    running maximum, the sum of exp(z - max) and of exp(z - max)·z (both rescaled by exp(old max - new max)
    when the maximum grows), the sum of z, the label's logit, and the first column holding the maximum (a
    tile's maximum replaces it only when strictly greater: torch.argmax's first index on ties). Then
    log_norm = max + log(sum), entropy = log_norm - sum(p·z), is_top1 = (first maximum == label).
    """
    import tilelang.language as T

    bm, bn, bk, _, threads = config
    m = T.dynamic("m")
    acc = "float32"
    logits = _logits_macro(hidden, softcap, config)

    @T.prim_func
    def linear_logprobs_fwd(H: T.Tensor((m, hidden), dtype), W: T.Tensor((vocab, hidden), dtype),
                            Labels: T.Tensor((m,), "int32"), Logp: T.Tensor((m,), acc), LogNorm: T.Tensor((m,), acc),
                            Stats: T.Tensor((len(STATISTICS), m), acc)):
        with T.Kernel(T.ceildiv(m, bm), threads=threads) as bx:
            h = T.alloc_shared((bm, bk), dtype)
            w = T.alloc_shared((bn, bk), dtype)
            labels = T.alloc_shared((bm,), "int32")
            z = T.alloc_fragment((bm, bn), acc)
            term = T.alloc_fragment((bm, bn), acc)
            tile_max = T.alloc_fragment((bm,), acc)
            tile_first = T.alloc_fragment((bm,), acc)
            part = T.alloc_fragment((bm,), acc)
            rescale = T.alloc_fragment((bm,), acc)
            row_max = T.alloc_fragment((bm,), acc)
            first = T.alloc_fragment((bm,), acc)  # the column of the first maximum (exact in float32 below 2^24)
            sum_exp = T.alloc_fragment((bm,), acc)
            sum_exp_z = T.alloc_fragment((bm,), acc)
            sum_z = T.alloc_fragment((bm,), acc)
            target = T.alloc_fragment((bm,), acc)
            logp = T.alloc_fragment((bm,), acc)
            log_norm = T.alloc_fragment((bm,), acc)
            stats = [T.alloc_fragment((bm,), acc) for _ in STATISTICS]

            T.copy(Labels[bx * bm:(bx + 1) * bm], labels, disable_tma=True)
            for vt in T.serial(T.ceildiv(vocab, bn)):
                # set at the first tile, not before the loop: TileLang 0.1.15's warp specialisation on sm_90 moves
                # statements before this loop into its body, which reset the running values at every tile
                if vt == 0:
                    T.fill(row_max, MASKED)
                    T.fill(first, 0)
                    for fragment in (sum_exp, sum_exp_z, sum_z, target):
                        T.clear(fragment)
                logits(H, W, bx * bm, vt * bn, h, w, z)
                for i, j in T.Parallel(bm, bn):
                    z[i, j] = T.if_then_else(vt * bn + j < vocab, z[i, j], MASKED)
                T.reduce_max(z, tile_max, dim=1)
                for i, j in T.Parallel(bm, bn):
                    term[i, j] = T.if_then_else(z[i, j] == tile_max[i], T.cast(vt * bn + j, acc), vocab)
                T.reduce_min(term, tile_first, dim=1)
                for i in T.Parallel(bm):
                    first[i] = T.if_then_else(tile_max[i] > row_max[i], tile_first[i], first[i])
                    rescale[i] = T.exp(row_max[i] - T.max(row_max[i], tile_max[i]))
                    row_max[i] = T.max(row_max[i], tile_max[i])
                for i, j in T.Parallel(bm, bn):
                    term[i, j] = T.exp(z[i, j] - row_max[i])
                T.reduce_sum(term, part, dim=1)
                for i in T.Parallel(bm):
                    sum_exp[i] = sum_exp[i] * rescale[i] + part[i]
                for i, j in T.Parallel(bm, bn):
                    term[i, j] *= z[i, j]
                T.reduce_sum(term, part, dim=1)
                for i in T.Parallel(bm):
                    sum_exp_z[i] = sum_exp_z[i] * rescale[i] + part[i]
                for i, j in T.Parallel(bm, bn):
                    term[i, j] = T.if_then_else(vt * bn + j < vocab, z[i, j], 0)
                T.reduce_sum(term, part, dim=1)
                for i in T.Parallel(bm):
                    sum_z[i] += part[i]
                for i, j in T.Parallel(bm, bn):
                    term[i, j] = T.if_then_else(vt * bn + j == labels[i], z[i, j], 0)
                T.reduce_sum(term, part, dim=1)
                for i in T.Parallel(bm):
                    target[i] += part[i]
            entropy, mean, is_top1 = stats
            for i in T.Parallel(bm):
                valid = labels[i] != IGNORE_INDEX
                log_norm[i] = row_max[i] + T.log(sum_exp[i])
                logp[i] = T.if_then_else(valid, target[i] - log_norm[i], 0)
                entropy[i] = T.if_then_else(valid, log_norm[i] - sum_exp_z[i] / sum_exp[i], 0)
                mean[i] = T.if_then_else(valid, sum_z[i] / vocab, 0)
                is_top1[i] = T.if_then_else(T.And(valid, first[i] == T.cast(labels[i], acc)), 1, 0)
            T.copy(logp, Logp[bx * bm:(bx + 1) * bm])
            T.copy(log_norm, LogNorm[bx * bm:(bx + 1) * bm])
            for row, fragment in enumerate(stats):
                T.copy(fragment, Stats[row, bx * bm:(bx + 1) * bm])

    return linear_logprobs_fwd


def backward_kernel(vocab: int, hidden: int, softcap: float, dtype: str, config):
    """PrimFunc: G (m, padded vocab) in `dtype`, the gradient of the raw logits, from H, W, Labels (m,) int32 and
    the saved LogNorm and upstream DLogp (m,) float32; m dynamic.

    One program per (block_n vocabulary entries, block_m tokens) recomputes its logits tile and stores
    dlogp·(onehot(label) - exp(z - log_norm)) (times the cap's slope 1 - (z/c)²), 0 for an ignored label and
    past the vocabulary: G's rows are padded to a multiple of 8 entries, 16-byte aligned for TMA.
    """
    import tilelang.language as T

    bm, bn, bk, _, threads = config
    m = T.dynamic("m")
    acc = "float32"
    logits = _logits_macro(hidden, softcap, config)

    @T.prim_func
    def linear_logprobs_bwd(H: T.Tensor((m, hidden), dtype), W: T.Tensor((vocab, hidden), dtype),
                            Labels: T.Tensor((m,), "int32"), LogNorm: T.Tensor((m,), acc), DLogp: T.Tensor((m,), acc),
                            G: T.Tensor((m, padded_vocab(vocab)), dtype)):
        with T.Kernel(T.ceildiv(vocab, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            h = T.alloc_shared((bm, bk), dtype)
            w = T.alloc_shared((bn, bk), dtype)
            labels = T.alloc_shared((bm,), "int32")
            log_norm = T.alloc_shared((bm,), acc)
            dlogp = T.alloc_shared((bm,), acc)
            z = T.alloc_fragment((bm, bn), acc)
            g = T.alloc_shared((bm, bn), dtype)

            T.copy(Labels[by * bm:(by + 1) * bm], labels, disable_tma=True)
            T.copy(LogNorm[by * bm:(by + 1) * bm], log_norm, disable_tma=True)
            T.copy(DLogp[by * bm:(by + 1) * bm], dlogp, disable_tma=True)
            logits(H, W, by * bm, bx * bn, h, w, z)
            for i, j in T.Parallel(bm, bn):
                col = bx * bn + j
                grad = dlogp[i] * (T.if_then_else(col == labels[i], 1.0, 0.0) - T.exp(z[i, j] - log_norm[i]))
                if softcap > 0:
                    grad *= 1.0 - (z[i, j] / softcap) * (z[i, j] / softcap)
                z[i, j] = T.if_then_else(T.And(col < vocab, labels[i] != IGNORE_INDEX), grad, 0)
            T.copy(z, g)
            T.copy(g, G[by * bm, bx * bn])

    return linear_logprobs_bwd


def padded_vocab(vocab: int) -> int:
    """The backward's logit-gradient row length: `vocab` rounded up to 8 (16-byte rows in half precision)."""
    return -(-vocab // 8) * 8


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Llama-3-8B's lm_head (128256 x 4096, bf16), for `tiletune kernels lower`."""
    return {f"linear_logprobs_{kind}": functools.partial(build, 128256, 4096, 0.0, "bfloat16", config_for(arch))
            for kind, build in (("fwd", forward_kernel), ("bwd", backward_kernel))}


def tilelang_unsupported(hidden: Tensor, weight: Tensor, labels: Tensor, softcap: float) -> str | None:
    """Why the TileLang kernels cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(hidden, weight)
    if reason is None and hidden.shape[1] % 8:
        reason = f"hidden size {hidden.shape[1]} is not a multiple of 8 (16-byte rows for TMA)"
    if reason is None and weight.shape[0] >= 2**24:
        reason = f"vocabulary {weight.shape[0]} has column indices float32 cannot hold exactly"
    return reason


def _kernel(kind: str, hidden: Tensor, weight: Tensor, softcap: float):
    """The compiled `kind` ('fwd' or 'bwd') kernel for this weight's shape, `softcap` and dtype."""
    vocab, width = weight.shape
    dtype, config = _tilelang.DTYPES[hidden.dtype], config_for(_tilelang.device_arch(hidden.device))
    build = forward_kernel if kind == "fwd" else backward_kernel
    return _tilelang.compiled(("linear_logprobs", kind, vocab, width, softcap, dtype, config),
                              lambda: build(vocab, width, softcap, dtype, config))


def tilelang_forward(hidden: Tensor, weight: Tensor, labels: Tensor, softcap: float = 0.0):
    """(log-probabilities, log-normalisers, statistics) by the TileLang forward kernel, no logits in memory."""
    logp, log_norm = (hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(2))
    stats = hidden.new_empty(len(STATISTICS), hidden.shape[0], dtype=torch.float32)
    if hidden.shape[0]:
        _kernel("fwd", hidden, weight, softcap)(hidden.contiguous(), weight.contiguous(), labels.int(), logp, log_norm,
                                                stats)  # fmt: skip
    return logp, log_norm, stats.t()


def tilelang_backward(dlogp: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, log_norm: Tensor,
                      softcap: float, weight_grad: bool):  # fmt: skip
    """(d hidden, d weight or an empty tensor): per chunk of tokens the TileLang kernel writes the logits' gradient
    in the input dtype, and the vendor GEMMs take it to d hidden (rounded once, as the reference) and d weight
    (accumulated over the chunks in float32)."""
    kernel = _kernel("bwd", hidden, weight, softcap)
    hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.int()
    dlogp, log_norm = dlogp.float().contiguous(), log_norm.contiguous()
    chunk = chunk_tokens(weight)
    grad = hidden.new_empty(min(chunk, hidden.shape[0]), padded_vocab(weight.shape[0]))
    dhidden = torch.empty_like(hidden)
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        h, g = hidden[rows], grad[: len(hidden[rows])]
        kernel(h, weight, labels[rows], log_norm[rows], dlogp[rows], g)
        g = g[:, : weight.shape[0]]
        torch.mm(g, weight, out=dhidden[rows])
        if dweight is not None:
            torch.addmm(dweight, g.t(), h, out_dtype=torch.float32, out=dweight)
    return dhidden, dweight.to(weight.dtype) if dweight is not None else weight.new_empty(0)


# ---- custom ops ------------------------------------------------------------------------------------

linear_logprobs_op = make_custom_op(Signature(
    "linear_logprobs", "Tensor hidden, Tensor weight, Tensor labels, float softcap", "(Tensor, Tensor, Tensor)",
    backward_inputs="Tensor hidden, Tensor weight, Tensor labels, Tensor log_norm, float softcap, bool weight_grad",
    backward_outputs="(Tensor, Tensor)",
    fake=lambda hidden, weight, labels, softcap: (
        *(hidden.new_empty(hidden.shape[0], dtype=accumulate_dtype(hidden)) for _ in range(2)),
        hidden.new_empty((hidden.shape[0], len(STATISTICS)), dtype=accumulate_dtype(hidden))),
    backward_fake=lambda dlogp, hidden, weight, labels, log_norm, softcap, weight_grad: (
        torch.empty_like(hidden), weight.new_empty(weight.shape if weight_grad else (0,))),
    save=lambda inputs, outputs, needs: (*inputs[:3], outputs[1], inputs[3], needs[1]),
    judged_on=lambda grads, saved: (*saved[:3], saved[4]),
    grad_of=(0, 1, None, None),
))  # fmt: skip


def linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, impl: str = "reference", strict: bool = False,
                    softcap: float = 0.0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Each token's log-probability of its label under `hidden @ weightᵀ` (soft-capped at `softcap` when
    non-zero; 0 where the label is -100), and its [tokens, 3] `STATISTICS` without gradient."""
    logp, _, stats = torch.ops.tiletune.linear_logprobs(hidden, weight, labels, float(softcap), impl, strict)
    return logp, stats


# No binding (the preference stages call it): its kernels compile at their first call, not in `kernels warmup`.
# `kernels: all` keeps the chunked PyTorch form until an H200 run has checked and timed the TileLang kernels
# (benchmarks/h200_verify_bench.sh); `kernels: {linear_logprobs: tilelang}` selects them.
define(Op("linear_logprobs", profile_pattern=r"linear_logprobs_(fwd|bwd)", lowering=lowering_kernels, default="chunked"))
add(Impl("linear_logprobs", "reference", reference_forward, reference_backward,
         description="PyTorch, whole [tokens, vocab] logits", accumulation="float32"))  # fmt: skip
add(Impl("linear_logprobs", "chunked", chunked_forward, chunked_backward, accumulation="float32",
         description="PyTorch, 256 MiB of float32 logits at a time, logits recomputed in the backward"))  # fmt: skip
add(Impl("linear_logprobs", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang: forward fused over the vocabulary (online log-sum-exp and statistics); "
         "backward writes the logits' gradient per chunk for the vendor GEMMs", accumulation="float32"))  # fmt: skip
