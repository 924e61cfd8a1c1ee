"""Fused lm_head projection, log-softmax and gather: each token's log-probability of its label.

Semantics (the reference): ``logp_i = log_softmax(cap(hidden_i @ weightᵀ))[label_i]`` in float32 (float64 for
float64 inputs), 0 where the label is -100; ``cap`` as in linear_cross_entropy (the identity, or Gemma 2's
``c·tanh(z / c)``). The backward takes each token's upstream gradient ``dlogp_i`` (a preference loss weighs
every answer differently) and returns d hidden, and d weight when the weight trains.

Besides the log-probabilities the op returns each token's log-normaliser (``logsumexp``, what the backward
keeps) and, without gradient, the statistics TRL's preference trainers log from their fused LM head: the
entropy of the next-token distribution, the mean logit and whether the label is the most likely token (0
where the label is -100).

The ``chunked`` implementation walks the tokens in chunks of `linear_cross_entropy.CHUNK_BYTES` of float32
logits, so the ``[tokens, vocab]`` logits never exist: the forward keeps the log-normalisers, the backward
recomputes each chunk's logits from them. It has no binding: the preference stages (train/preference.py) call
it in place of TRL's fused LM head when `kernels:` selects it.
"""

from __future__ import annotations

import torch
from torch import Tensor

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


# Runs on the vendor GEMMs: no compile key, nothing to warm up or lower; no binding (the preference stages call it).
define(Op("linear_logprobs"))
add(Impl("linear_logprobs", "reference", reference_forward, reference_backward,
         description="PyTorch, whole [tokens, vocab] logits", accumulation="float32"))  # fmt: skip
add(Impl("linear_logprobs", "chunked", chunked_forward, chunked_backward, accumulation="float32",
         description="PyTorch, 256 MiB of float32 logits at a time, logits recomputed in the backward"))  # fmt: skip
