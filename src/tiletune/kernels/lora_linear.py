"""LoRA Linear: ``y = x Wᵀ (+ b) + s·(x Aᵀ) Bᵀ``, peft's LoRA Linear forward (dropout 0), in one GEMM.

W is the frozen base weight (out, in), A = lora_A.weight (r, in), B = lora_B.weight (out, r), s the
scaling. Backward: dX = dY W + g A with g = s·dY B, dA = gᵀ X, dB = s·dYᵀ (X Aᵀ); no dW, no db.
Reference (PyTorch) forward and backward, the TileLang path (linear.py's GEMM factory with a rank-r
epilogue in the same fp32 accumulator, for the forward and for dX), and the custom ops
``tiletune::lora_linear`` / ``tiletune::lora_linear_backward``. Adapter weights may be float32 while x
and W are half precision (trainable weights upcast, autocast): everything computes in x's dtype and
dA, dB come back in the adapters' dtypes. The token dimension is dynamic; features, the padded rank,
dtype and tile configuration are static.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tiletune.kernels import _tilelang, linear
from tiletune.kernels.registry import Impl, add, backward_of, select

MAX_RANK = 64  # padded rank the epilogue's shared-memory tiles are sized for

# ---- reference -----------------------------------------------------------------------------------


def reference_forward(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                      scaling: float) -> tuple[Tensor, Tensor]:
    """(y, xa = x Aᵀ) as peft computes them under autocast: each product in x's dtype, then added."""
    xa = F.linear(x, lora_a.to(x.dtype))
    return F.linear(x, weight, bias) + F.linear(xa, lora_b.to(x.dtype)) * scaling, xa


def reference_backward(dy: Tensor, x: Tensor, xa: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                       scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dA, dB) as autograd computes them through reference_forward."""
    dy2, x2, xa2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), xa.reshape(-1, xa.shape[-1])
    dys = dy2 * scaling
    g = dys @ lora_b.to(dy.dtype)
    dx = dy2 @ weight.to(dy.dtype) + g @ lora_a.to(dy.dtype)
    return dx.view(x.shape), (g.t() @ x2).to(lora_a.dtype), (dys.t() @ xa2).to(lora_b.dtype)


# ---- TileLang ------------------------------------------------------------------------------------


def _padded(lora_a: Tensor, lora_b: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A (rank, in) and s·B (out, rank) in `dtype`, the rank zero-padded to a multiple of 16 (the MMA's K)."""
    pad = -lora_a.shape[0] % 16
    return F.pad(lora_a.to(dtype), (0, 0, 0, pad)), F.pad((lora_b * scaling).to(dtype), (0, pad))


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder of the forward and dX GEMMs at Llama-3-8B's q_proj shape, rank 8 (padded to 16)."""
    return {f"lora_linear_{kind}": functools.partial(linear.gemm_kernel, kind, 4096, 4096, "bfloat16",
                                                     linear.config_for(arch, kind, 4096, 4096, "bfloat16"), 16)
            for kind in ("fwd", "dgrad")}


def tilelang_unsupported(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                         scaling: float) -> str | None:
    """Why the TileLang path cannot run these inputs, or None."""
    reason = linear.tilelang_unsupported(x, weight, bias)
    if reason is None and (lora_a.device != x.device or lora_b.device != x.device):
        reason = "adapter weights on another device than the input"
    if reason is None and lora_a.shape[0] > MAX_RANK:
        reason = f"rank {lora_a.shape[0]} is above {MAX_RANK}"
    return reason


def tilelang_forward(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                     scaling: float) -> tuple[Tensor, Tensor]:
    """(y, xa): x Wᵀ + xa (s·B)ᵀ in one TileLang GEMM, xa = x Aᵀ by a torch matmul (bias added by PyTorch)."""
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    x2 = x.reshape(-1, in_features).contiguous()
    a, bs = _padded(lora_a, lora_b, scaling, x.dtype)
    xa = x2 @ a.t()  # (m, padded rank), zero beyond rank
    y = linear.run_gemm("fwd", x2, weight.contiguous(), x2.new_empty(x2.shape[0], out_features), out_features,
                        in_features, (xa, bs))
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out_features), xa[:, :rank].view(*x.shape[:-1], rank)


def tilelang_backward(dy: Tensor, x: Tensor, xa: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                      scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dA, dB): dY W + g A in one TileLang GEMM with g = dY (s·B); dA = gᵀ x, dB = s·dYᵀ xa by torch matmuls."""
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    dy2 = dy.reshape(-1, out_features).contiguous()
    a, bs = _padded(lora_a, lora_b, scaling, dy.dtype)
    g = dy2 @ bs  # (m, padded rank), zero beyond rank
    dx = linear.run_gemm("dgrad", dy2, weight.contiguous(), dy2.new_empty(dy2.shape[0], in_features), out_features,
                         in_features, (g, a))
    da = (g[:, :rank].t() @ x.reshape(-1, in_features)).to(lora_a.dtype)
    db = (dy2.t() @ xa.reshape(-1, rank)).to(lora_b.dtype) * scaling
    return dx.view(x.shape), da, db


add(Impl("lora_linear", "reference", reference_forward, reference_backward,
         description="PyTorch: base F.linear + peft's lora_B(lora_A(x)) * scaling", accumulation="float32"))
add(Impl("lora_linear", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang GEMM with a rank-r epilogue (fwd, dX); dA, dB by torch matmuls",
         accumulation="float32"))

# ---- custom ops ----------------------------------------------------------------------------------


@torch.library.custom_op("tiletune::lora_linear", mutates_args=())
def lora_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                   impl: str, strict: bool) -> tuple[Tensor, Tensor]:
    inputs = (x, weight, bias, lora_a, lora_b, scaling)
    y, xa = select("lora_linear", impl, strict, *inputs).forward(*inputs)
    return y.contiguous(), xa.contiguous()


@lora_linear_op.register_fake
def _(x, weight, bias, lora_a, lora_b, scaling, impl, strict):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(*x.shape[:-1], lora_a.shape[0])


@torch.library.custom_op("tiletune::lora_linear_backward", mutates_args=())
def lora_linear_backward_op(dy: Tensor, x: Tensor, xa: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                            scaling: float, impl: str, strict: bool) -> tuple[Tensor, Tensor, Tensor]:
    chosen = select("lora_linear", impl, strict, x, weight, None, lora_a, lora_b, scaling)
    dx, da, db = backward_of(chosen)(dy, x, xa, weight, lora_a, lora_b, scaling)
    return dx.contiguous(), da, db


@lora_linear_backward_op.register_fake
def _(dy, x, xa, weight, lora_a, lora_b, scaling, impl, strict):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(lora_a), torch.empty_like(lora_b)


def _setup_context(ctx, inputs, output):
    x, weight, _, lora_a, lora_b, ctx.scaling, ctx.impl, ctx.strict = inputs
    xa = output[1]
    ctx.mark_non_differentiable(xa)
    ctx.save_for_backward(x, xa, weight, lora_a, lora_b)


def _backward(ctx, dy, _):
    dx, da, db = torch.ops.tiletune.lora_linear_backward(dy, *ctx.saved_tensors, ctx.scaling, ctx.impl, ctx.strict)
    need_x, need_a, need_b = (ctx.needs_input_grad[i] for i in (0, 3, 4))
    return dx if need_x else None, None, None, da if need_a else None, db if need_b else None, None, None, None


lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                impl: str = "reference", strict: bool = False) -> Tensor:
    """x Wᵀ (+ b) + scaling·(x Aᵀ) Bᵀ through the custom op with implementation `impl` (falls back to the reference).

    W and b are frozen (no gradient); x, A and B get theirs.
    """
    return torch.ops.tiletune.lora_linear(x, weight, bias, lora_a, lora_b, scaling, impl, strict)[0]
