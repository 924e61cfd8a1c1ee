"""Fused lm_head projection and cross-entropy loss, with the gradients computed on the way.

Semantics (the reference): ``loss = sum_i CE(cap(hidden_i @ weightᵀ), label_i) / divisor`` over the tokens
whose label is not -100, in float32, as transformers' causal-LM loss computes it; ``divisor`` is the
number of such tokens, or the Trainer's ``num_items_in_batch`` under gradient accumulation. ``cap`` is
the identity, or with a final logit soft-cap c (Gemma 2's ``final_logit_softcapping``) ``c·tanh(z / c)``,
whose derivative ``1 - tanh²(z / c)`` joins the chunk's gradient.

The ``chunked`` implementation walks the tokens in chunks, so only a ``[chunk, vocab]`` block of float32
logits exists at a time instead of ``[tokens, vocab]`` (4.2 GB for 8192 tokens of Llama-3's 128256-word
vocabulary, and as much again for its gradient). Each chunk's gradient with respect to the hidden states
(and the weight, when it trains) is computed right away, so the backward only scales what the forward
kept. The ``tilelang`` implementation runs the same loop with the vendor GEMMs and replaces the elementwise
work between them (the float32 copy of the logits, log-sum-exp, exp, the label's one-hot, the scale and the cast
back: ten passes over the chunk) by one TileLang kernel that reads the chunk's logits in the input dtype twice
(the running maximum and sum of exponentials per column lane, then the gradient) and writes the gradient over
them in place: the logits are rounded to the input dtype by the GEMM in both, as in transformers' own loss.

A frozen weight on another device than the hidden states (an lm_head waiting in pinned host memory,
`tiletune.train.host_tables`) is never whole on the GPU: ``chunked`` then reads it a vocabulary slice at a
time, the next slice's copy in flight on a side stream while this one computes, in one pass per block of
tokens. Each token's log-normaliser and its softmax-weighted sum of the weight's rows build up online,
rescaled whenever the running maximum grows, as flash attention builds its output; so the head crosses the
host link once per block of tokens and the loss holds two slices of it, not the whole (1 GiB at Llama-3-8B,
2 GiB at 70B).
"""

# No `from __future__ import annotations`: TileLang reads the kernel signature's shapes from the closure.

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels._tilelang import accumulate_dtype
from tiletune.kernels.binding import Binding, SideCopy, Site, head_read_in_slices, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

IGNORE_INDEX = -100
CHUNK_BYTES = 2**28  # float32 logits per chunk: 256 MiB


def chunk_tokens(weight: Tensor) -> int:
    """How many tokens' float32 logits fit in `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * weight.shape[0]))


def capped_logits(hidden: Tensor, weight: Tensor, softcap: float) -> tuple[Tensor, Tensor | None]:
    """(logits of a block of tokens in float32 (or 64), soft-capped when `softcap`; the cap's slope or None)."""
    return cap(hidden @ weight.t(), softcap)


def cap(raw: Tensor, softcap: float) -> tuple[Tensor, Tensor | None]:
    """(raw logits in float32 (or 64), soft-capped when `softcap`; the cap's slope or None)."""
    logits = raw.to(accumulate_dtype(raw))
    if not softcap:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, 1 - capped.square()


def logit_gradient(logits: Tensor, log_norm: Tensor, labels: Tensor, scale: Tensor, slope: Tensor | None) -> Tensor:
    """d/d(raw logits) of `sum_i scale_i·(log_norm_i - logit_i[label_i])`: (softmax - one-hot) x scale (x the cap's
    slope). `scale` is 0 where the label is -100."""
    grad = torch.exp(logits - log_norm[:, None])
    grad.scatter_add_(1, labels.clamp(min=0)[:, None], -(labels >= 0).to(grad.dtype)[:, None])
    grad *= scale[:, None]
    if slope is not None:
        grad *= slope
    return grad


def backpropagate(hidden: Tensor, weight: Tensor, weight_grad: bool, chunk: int, logit_grad: Callable):
    """(d hidden, d weight or an empty tensor) from `logit_grad(start, hidden block)`, the gradient of the raw logits
    of `chunk` tokens at a time."""
    dhidden = torch.empty_like(hidden)
    acc = accumulate_dtype(hidden)
    dweight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight_grad else None
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        grad = logit_grad(start, h)
        dhidden[start : start + chunk] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
        if dweight is not None:
            dweight += grad.t().to(acc) @ h.to(acc)
    return dhidden, dweight.to(weight.dtype) if dweight is not None else weight.new_empty(0)


def torch_chunk_gradient(raw: Tensor, labels: Tensor, divisor: float, softcap: float) -> tuple[Tensor, Tensor]:
    """(the chunk's summed loss, the gradient of its raw logits `raw` [tokens, vocab]) in float32 (or 64), PyTorch."""
    logits, slope = cap(raw, softcap)
    valid = (labels != IGNORE_INDEX).to(logits.dtype)
    log_norm = torch.logsumexp(logits, dim=-1)
    loss = ((log_norm - logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]) * valid).sum()
    return loss, logit_gradient(logits, log_norm, labels, valid / divisor, slope)


def _forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool, softcap: float,
             chunk: int, chunk_gradient: Callable = torch_chunk_gradient):  # fmt: skip
    losses = [torch.zeros((), dtype=accumulate_dtype(hidden), device=hidden.device)]

    def logit_grad(start: int, h: Tensor) -> Tensor:
        loss, grad = chunk_gradient(h @ weight.t(), labels[start : start + len(h)], divisor, softcap)
        losses.append(loss)
        return grad

    dhidden, dweight = backpropagate(hidden, weight, weight_grad, chunk, logit_grad)
    return sum(losses) / divisor, dhidden, dweight


def reference_forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool,
                      softcap: float = 0.0):  # fmt: skip
    """(loss, dloss/dhidden, dloss/dweight or an empty tensor), all tokens at once; a weight elsewhere (a head in host
    memory) is copied whole to the hidden states' device."""
    weight = weight.to(hidden.device)
    return _forward(hidden, weight, labels, divisor, weight_grad, softcap, chunk=max(hidden.shape[0], 1))


def chunked_forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool,
                    softcap: float = 0.0, chunk_gradient: Callable = torch_chunk_gradient):  # fmt: skip
    """The same, `CHUNK_BYTES` of float32 logits at a time, each chunk's loss and logit gradient by
    `chunk_gradient`; a frozen weight on another device (the host) is read in vocabulary slices
    (`streamed_forward`, PyTorch)."""
    if weight.device != hidden.device:
        if not weight_grad:
            return streamed_forward(hidden, weight, labels, divisor, softcap)
        weight = weight.to(hidden.device)
    return _forward(hidden, weight, labels, divisor, weight_grad, softcap, chunk_tokens(weight), chunk_gradient)


def streamed_forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, softcap: float = 0.0,
                     token_block: int | None = None, vocab_slice: int | None = None):  # fmt: skip
    """(loss, d hidden, an empty tensor) for a frozen `weight` anywhere, read `vocab_slice` rows at a time (default:
    `CHUNK_BYTES` of float32 logits) once per `token_block` tokens (default: a `CHUNK_BYTES` float32 accumulator of
    d hidden), the two accumulating online over the slices."""
    acc = accumulate_dtype(hidden)
    token_block = token_block or max(1, CHUNK_BYTES // (4 * hidden.shape[1]))
    dhidden = torch.empty_like(hidden)
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    for start in range(0, hidden.shape[0], token_block):
        h, y = hidden[start : start + token_block], labels[start : start + token_block]
        run_max = torch.full((len(h),), -torch.inf, dtype=acc, device=h.device)
        run_sum = torch.zeros_like(run_max)
        label_logit = torch.zeros_like(run_max)
        label_row = torch.zeros(h.shape, dtype=weight.dtype, device=h.device)  # each token's label's weight row
        weighted = torch.zeros(h.shape, dtype=acc, device=h.device)  # sum over the vocabulary of exp(z - max)·slope·row
        for first, rows in _device_slices(weight, h.device, vocab_slice or max(1, CHUNK_BYTES // (4 * len(h)))):
            logits, slope = capped_logits(h, rows, softcap)
            local = y - first
            hit = (local >= 0) & (local < len(rows))
            local = local.clamp(0, len(rows) - 1)
            label_logit = torch.where(hit, logits.gather(1, local[:, None])[:, 0], label_logit)
            label_row = torch.where(hit[:, None], rows[local], label_row)
            new_max = torch.maximum(run_max, logits.amax(dim=1))
            rescale = torch.exp(run_max - new_max)
            probs = logits.sub_(new_max[:, None]).exp_()
            run_sum = run_sum * rescale + probs.sum(dim=1)
            if slope is not None:
                probs *= slope
            weighted.mul_(rescale[:, None]).add_(probs.to(rows.dtype) @ rows)
            run_max = new_max
        valid = (y != IGNORE_INDEX).to(acc)
        loss += ((run_max + run_sum.log() - label_logit) * valid).sum()
        label_term = label_row.to(acc)
        if softcap:
            label_term *= (1 - (label_logit / softcap).square())[:, None]  # the cap's slope at the label
        dhidden[start : start + token_block] = ((weighted / run_sum[:, None] - label_term)
                                                * (valid / divisor)[:, None]).to(hidden.dtype)  # fmt: skip
    return loss / divisor, dhidden, hidden.new_empty(0, dtype=weight.dtype)


def _device_slices(weight: Tensor, device: torch.device, rows: int):
    """(first row, the next `rows` rows of `weight` on `device`) in order. From another device (pinned host memory)
    the next slice's copy runs on a side stream while the caller computes with this one."""
    starts = range(0, weight.shape[0], rows)
    if weight.device == device:
        yield from ((first, weight[first : first + rows]) for first in starts)
        return
    copier = torch.cuda.Stream(device)
    pending = SideCopy(weight[:rows], device, copier)
    for first in starts:
        arrived = pending
        if first + rows < weight.shape[0]:
            pending = SideCopy(weight[first + rows : first + 2 * rows], device, copier)
        yield first, arrived.take()


# ---- TileLang: the chunk's logit gradient in place -------------------------------------------------------

GRAD_VECTOR, GRAD_THREADS = 8, 256  # logits per thread per step (16 bytes in half precision), threads per row
MASKED = -1e30  # the logit of a lane past the vocabulary: finite, so exp(MASKED - max) is 0, never NaN


def gradient_kernel(vocab: int, softcap: float, dtype: str, vector: int = GRAD_VECTOR, threads: int = GRAD_THREADS):
    """PrimFunc over Z (m, vocab), a chunk's raw logits in `dtype` (m dynamic), Labels (m,) int32 and Scale (m,)
    float32: Loss (m,) float32 = log_norm - cap(z)[label] (0 for label -100), and Z overwritten by the gradient of
    Scale·Loss with respect to the raw logits, (softmax(cap(z)) - onehot(label))·Scale (times the cap's slope).

    One program per token row, `threads` x `vector` lanes across it. Pass 1 walks the row keeping per lane the
    running maximum and sum of exp(z - max) (rescaled when the maximum grows: two exponentials per logit, no
    block reduction until the row's end); the lanes then reduce to log_norm = max + log(sum). Pass 2 reads the row
    again and stores the gradient in place. The label's logit is read before pass 1, so no store can overtake it.
    """
    import tilelang.language as T

    m = T.dynamic("m")
    acc = "float32"
    lanes = vector * threads
    steps = -(-vocab // lanes)

    def capped(raw):
        z = T.cast(raw, acc)
        return softcap * T.tanh(z / softcap) if softcap > 0 else z

    @T.prim_func
    def cross_entropy_grad(Z: T.Tensor((m, vocab), dtype), Labels: T.Tensor((m,), "int32"),
                           Scale: T.Tensor((m,), acc), Loss: T.Tensor((m,), acc)):
        with T.Kernel(m, threads=threads) as row:
            lane_max = T.alloc_fragment((1, lanes), acc)
            lane_sum = T.alloc_fragment((1, lanes), acc)
            row_max = T.alloc_fragment((1,), acc)
            row_sum = T.alloc_fragment((1,), acc)
            log_norm = T.alloc_fragment((1,), acc)
            label_logit = T.alloc_fragment((1,), acc)
            label = Labels[row]
            for i in T.Parallel(1):
                label_logit[i] = T.if_then_else(label != IGNORE_INDEX, capped(Z[row, T.max(label, 0)]), 0)
            T.fill(lane_max, MASKED)
            T.clear(lane_sum)
            for step in T.serial(steps):
                for i, j in T.Parallel(1, lanes):
                    col = step * lanes + j
                    z = T.if_then_else(col < vocab, capped(Z[row, T.min(col, vocab - 1)]), MASKED)
                    grown = T.max(lane_max[i, j], z)
                    lane_sum[i, j] = lane_sum[i, j] * T.exp(lane_max[i, j] - grown) + T.exp(z - grown)
                    lane_max[i, j] = grown
            T.reduce_max(lane_max, row_max, dim=1)
            for i, j in T.Parallel(1, lanes):
                lane_sum[i, j] *= T.exp(lane_max[i, j] - row_max[i])
            T.reduce_sum(lane_sum, row_sum, dim=1)
            for i in T.Parallel(1):
                log_norm[i] = row_max[i] + T.log(row_sum[i])
                Loss[row] = T.if_then_else(label != IGNORE_INDEX, log_norm[i] - label_logit[i], 0)
            for step in T.serial(steps):
                for i, j in T.Parallel(1, lanes):
                    col = step * lanes + j
                    if col < vocab:
                        z = capped(Z[row, col])
                        grad = (T.exp(z - log_norm[i]) - T.if_then_else(col == label, 1.0, 0.0)) * Scale[row]
                        if softcap > 0:
                            grad *= 1.0 - (z / softcap) * (z / softcap)
                        Z[row, col] = T.cast(grad, dtype)

    return cross_entropy_grad


def tilelang_chunk_gradient(raw: Tensor, labels: Tensor, divisor: float, softcap: float) -> tuple[Tensor, Tensor]:
    """torch_chunk_gradient by the TileLang kernel: the gradient (in raw's dtype) written over `raw`."""
    vocab, dtype = raw.shape[1], _tilelang.DTYPES[raw.dtype]
    kernel = _tilelang.compiled(("cross_entropy_grad", vocab, softcap, dtype),
                                lambda: gradient_kernel(vocab, softcap, dtype))
    valid = labels != IGNORE_INDEX
    loss = raw.new_empty(raw.shape[0], dtype=torch.float32)
    if raw.shape[0]:
        kernel(raw, labels.int(), valid.float() / divisor, loss)
    return loss.sum(), raw


def tilelang_forward(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float, weight_grad: bool,
                     softcap: float = 0.0):  # fmt: skip
    """chunked_forward with each chunk's logit gradient by the TileLang kernel (the vendor GEMMs around it); a
    frozen head in host memory is streamed as `chunked` streams it."""
    return chunked_forward(hidden, weight, labels, divisor, weight_grad, softcap, tilelang_chunk_gradient)


def tilelang_unsupported(hidden: Tensor, weight: Tensor, *rest) -> str | None:
    """Why the TileLang path cannot run these inputs (the forward's, or the backward's two gradients), or None."""
    return _tilelang.unsupported_inputs(hidden) or (None if weight.dtype == hidden.dtype else
                                                   f"the hidden states are {hidden.dtype}, the lm_head {weight.dtype}")


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Llama-3's vocabulary (128256, bf16), for `tiletune kernels lower`."""
    return {"cross_entropy_grad": lambda: gradient_kernel(128256, 0.0, "bfloat16")}


def reference_backward(dloss: Tensor, dhidden: Tensor, dweight: Tensor):
    """The gradients the forward computed, scaled by the loss's incoming gradient."""
    return (dhidden * dloss).to(dhidden.dtype), (dweight * dloss).to(dweight.dtype)


# ---- custom ops and binding ------------------------------------------------------------------------

linear_cross_entropy_op = make_custom_op(Signature(
    "linear_cross_entropy", "Tensor hidden, Tensor weight, Tensor labels, float divisor, bool weight_grad, float softcap",
    "(Tensor, Tensor, Tensor)",
    backward_inputs="Tensor dhidden, Tensor dweight", backward_outputs="(Tensor, Tensor)",
    fake=lambda hidden, weight, labels, divisor, weight_grad, softcap: (
        hidden.new_empty((), dtype=accumulate_dtype(hidden)), torch.empty_like(hidden),
        weight.new_empty(weight.shape) if weight_grad else hidden.new_empty(0, dtype=weight.dtype)),
    backward_fake=lambda dloss, dhidden, dweight: (torch.empty_like(dhidden), torch.empty_like(dweight)),
    save=lambda inputs, outputs, needs: outputs[1:],  # the gradients, computed in the forward
    judged_on=lambda grads, saved: saved,  # its implementations take any inputs
    grad_of=(0, 1, None, None, None, None),
))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, divisor: float,
                         impl: str = "reference", strict: bool = False, softcap: float = 0.0) -> Tensor:  # fmt: skip
    """Mean cross-entropy of `hidden @ weightᵀ` (soft-capped at `softcap` when non-zero) against `labels`
    (-100 ignored) over `divisor` tokens."""
    loss, _, _ = torch.ops.tiletune.linear_cross_entropy(
        hidden, weight, labels, float(divisor), weight.requires_grad, float(softcap), impl, strict
    )
    return loss


def _fit(site: Site) -> str | None:
    head = getattr(site.module, site.part.path)
    if not isinstance(head, nn.Linear) or not isinstance(getattr(site.module, site.part.body, None), nn.Module):
        return f"{type(site.module).__name__} has no plain {site.part.path} Linear after its {site.part.body}: stock forward kept"
    return None


def _softcap(site: Site) -> float:
    """The model's final logit soft-cap (Gemma 2's `final_logit_softcapping`), 0.0 without one."""
    return float(getattr(site.module.config, site.part.softcap_key, None) or 0.0) if site.part.softcap_key else 0.0


def _compile_key(site: Site) -> tuple:
    """The gradient kernel's static parameters: the vocabulary and the soft-cap."""
    return getattr(site.module, site.part.path).weight.shape[0], _softcap(site)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    """The loss on two tokens over the vocabulary `key` names (a head 8 units wide: the kernel does not depend on it)."""
    vocab, softcap = key
    labels = torch.tensor([0, vocab - 1], device="cuda")
    return linear_cross_entropy(warm_tensor(2, 8, dtype=dtype), warm_tensor(vocab, 8, dtype=dtype, grad=False), labels,
                                2.0, impl, True, softcap)  # fmt: skip


def _lm_head_forward(site: Site, impl: str, strict: bool, current: Callable) -> Callable:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head, body = site.part.path, site.part.body
    softcap = _softcap(site)

    def forward(self, input_ids=None, labels=None, **kwargs):
        if labels is None or not torch.is_grad_enabled():  # generation and evaluation want the logits
            return current(self, input_ids=input_ids, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        head_module = getattr(self, head)
        with head_read_in_slices(head_module):  # a head in host memory stays there: `chunked` streams it
            outputs = getattr(self, body)(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(hidden.device)
        divisor = num_items if num_items is not None else (shifted != IGNORE_INDEX).sum()
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head_module.weight, shifted.reshape(-1),
                                    float(divisor), impl, strict, softcap)  # fmt: skip
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)  # fmt: skip

    return forward


# `kernels: all` takes the TileLang kernel (checked against float64 and timed on an H100:
# benchmarks/results/h100-2026-12-06); where it cannot run (no GPU, no TileLang, a kernel library without it) the
# chunked PyTorch loop does, never the whole logits.
define(Op("linear_cross_entropy", (Binding("linear_cross_entropy", "lm_head", _lm_head_forward, _fit,
                                           compile_key=_compile_key, warm=_warm),),
          profile_pattern=r"cross_entropy_grad", lowering=lowering_kernels, fallback="chunked"))
add(Impl("linear_cross_entropy", "reference", reference_forward, reference_backward,
         description="PyTorch, whole [tokens, vocab] logits", accumulation="float32"))
add(Impl("linear_cross_entropy", "chunked", chunked_forward, accumulation="float32",
         description="PyTorch, 256 MiB of float32 logits at a time, gradients computed in the forward"))
add(Impl("linear_cross_entropy", "tilelang", tilelang_forward, reference_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "the chunked loop's vendor GEMMs around one TileLang kernel per chunk: log-sum-exp and "
         "the logits' gradient in place, float32 inside", accumulation="float32"))
