"""Fused lm_head projection and cross-entropy loss, with the gradients computed on the way.

Semantics (the reference): ``loss = sum_i CE(hidden_i @ weightᵀ, label_i) / divisor`` over the tokens
whose label is not -100, in float32, as transformers' causal-LM loss computes it; ``divisor`` is the
number of such tokens, or the Trainer's ``num_items_in_batch`` under gradient accumulation.

The ``chunked`` implementation walks the tokens in chunks, so only a ``[chunk, vocab]`` block of float32
logits exists at a time instead of ``[tokens, vocab]`` (4.2 GB for 8192 tokens of Llama-3's 128256-word
vocabulary, and as much again for its gradient). Each chunk's gradient with respect to the hidden states
(and the weight, when it trains) is computed right away, so the backward only scales what the forward
kept. A TileLang version of the same loop is future work; this one uses the vendor GEMMs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tiletune.kernels._tilelang import accumulate_dtype
from tiletune.kernels.registry import Impl, add, select

IGNORE_INDEX = -100
CHUNK_BYTES = 2**28  # float32 logits per chunk: 256 MiB


def _chunk_gradients(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float):
    """(summed loss, d loss/d logits already divided by divisor) of one block of tokens, in float32 (or 64)."""
    logits = (hidden @ weight.t()).to(accumulate_dtype(hidden))
    valid = labels != IGNORE_INDEX
    safe = labels.clamp(min=0)
    log_norm = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, safe[:, None])[:, 0]
    loss = ((log_norm - target) * valid).sum()
    grad = torch.softmax(logits, dim=-1)
    grad[torch.arange(len(labels), device=labels.device), safe] -= 1.0
    grad *= (valid.to(grad.dtype) / divisor)[:, None]
    return loss, grad


def _forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool, chunk: int):
    dhidden = torch.empty_like(hidden)
    acc = accumulate_dtype(hidden)
    dweight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight_grad else None
    total = torch.zeros((), dtype=acc, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start : start + chunk], labels[start : start + chunk]
        loss, grad = _chunk_gradients(h, weight, y, divisor)
        total += loss
        dhidden[start : start + chunk] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
        if dweight is not None:
            dweight += grad.t() @ h.to(acc)
    return total / divisor, dhidden, dweight.to(weight.dtype) if dweight is not None else weight.new_empty(0)


def reference_forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool):
    """(loss, dloss/dhidden, dloss/dweight or an empty tensor), all tokens at once."""
    return _forward(hidden, weight, labels, divisor, weight_grad, chunk=max(hidden.shape[0], 1))


def chunked_forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool):
    """The same, `CHUNK_BYTES` of float32 logits at a time."""
    chunk = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    return _forward(hidden, weight, labels, divisor, weight_grad, chunk)


add(Impl("linear_cross_entropy", "reference", reference_forward, description="PyTorch, whole [tokens, vocab] logits",
         accumulation="float32"))  # fmt: skip
add(Impl("linear_cross_entropy", "chunked", chunked_forward, accumulation="float32",
         description="PyTorch, 256 MiB of float32 logits at a time, gradients computed in the forward"))  # fmt: skip

def lowering_kernels(arch: str) -> dict:
    """No TileLang kernels for this op yet: nothing to lower."""
    return {}


# ---- custom op -----------------------------------------------------------------------------------


@torch.library.custom_op("tiletune::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool,
                            impl: str, strict: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    chosen = select("linear_cross_entropy", impl, strict, hidden, weight, labels)
    loss, dhidden, dweight = chosen.forward(hidden, weight, labels, divisor, weight_grad)
    return loss, dhidden.contiguous(), dweight.contiguous()


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, divisor, weight_grad, impl, strict):
    dweight = weight.new_empty(weight.shape if weight_grad else (0,))
    return hidden.new_empty((), dtype=accumulate_dtype(hidden)), torch.empty_like(hidden), dweight


def _setup_context(ctx, inputs, output):
    _, dhidden, dweight = output
    ctx.weight_grad = inputs[4]
    ctx.save_for_backward(dhidden, dweight)


def _backward(ctx, dloss, _dhidden, _dweight):
    dhidden, dweight = ctx.saved_tensors
    scale = dloss
    grad_hidden = (dhidden * scale).to(dhidden.dtype)
    grad_weight = (dweight * scale).to(dweight.dtype) if ctx.weight_grad else None
    return grad_hidden, grad_weight, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float,
                         impl: str = "reference", strict: bool = False) -> Tensor:  # fmt: skip
    """Mean cross-entropy of `hidden @ weightᵀ` against `labels` (-100 ignored) over `divisor` tokens."""
    loss, _, _ = torch.ops.tiletune.linear_cross_entropy(
        hidden, weight, labels, float(divisor), weight.requires_grad, impl, strict
    )
    return loss
