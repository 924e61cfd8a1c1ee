"""RMSNorm as in Llama/Qwen, ``weight * (x * rsqrt(mean(x², -1) + eps)).to(x.dtype)``, and as in Gemma
(offset 1), ``(x * rsqrt(mean(x², -1) + eps) * (1 + weight)).to(x.dtype)`` all in fp32; fp32 statistics.

Reference (PyTorch) forward and backward, the TileLang forward and backward kernels, and the custom
ops ``tiletune::rms_norm`` / ``tiletune::rms_norm_backward``. The token dimension is dynamic; the
hidden size, eps, offset and dtype are static per compiled kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

# ---- reference -----------------------------------------------------------------------------------


def reference_forward(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """RMSNorm exactly as transformers computes it: Llama/Qwen's (offset 0: the normalised x rounded to x's
    dtype, then times the weight) or Gemma's (offset 1: times 1 + weight in fp32, rounded once)."""
    xf = x.to(_tilelang.accumulate_dtype(x))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.to(normed.dtype))).to(x.dtype)
    return weight * normed.to(x.dtype)


def reference_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float, weight_grad: bool):
    """(dx, dweight or None), computed in fp32 (or float64) from the recomputed statistics."""
    acc = _tilelang.accumulate_dtype(x)
    xf, dyf = x.to(acc), dy.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    dn = dyf * (offset + weight.to(acc))
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    seen = n if offset else n.to(x.dtype).to(acc)  # what the forward multiplied the weight by
    dw = (dyf * seen).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if weight_grad else None
    return dx.to(x.dtype), dw


# ---- TileLang kernels ----------------------------------------------------------------------------


def _tiling(n: int) -> tuple[int, int]:
    """(rows per block, threads): about 16 elements per thread, at least one row per block; the threads a power
    of two (64..512, the row reduction's butterfly needs one) that divides the block's elements (Gemma-3's
    3840 and Qwen3-4B's 2560 hidden sizes included)."""
    rows = max(1, 4096 // n)
    threads = 64
    while threads < min(512, rows * n // 16) and rows * n % (threads * 2) == 0:
        threads *= 2
    return rows, threads


def _rstd_macro(rows: int, n: int, eps: float):
    """T.macro: rstd[i] = rsqrt(mean(x[i, :]²) + eps) in fp32, using `sq` as scratch."""
    import tilelang.language as T

    @T.macro
    def rstd_of(x, sq, rstd):
        for i, j in T.Parallel(rows, n):
            sq[i, j] = T.cast(x[i, j], "float32") * T.cast(x[i, j], "float32")
        T.reduce_sum(sq, rstd, dim=1)
        for i in T.Parallel(rows):
            rstd[i] = T.rsqrt(rstd[i] / n + eps)

    return rstd_of


def forward_kernel(n: int, eps: float, dtype: str, tiling: tuple[int, int] | None = None, offset: float = 0.0):
    """PrimFunc Y = RMSNorm(X) * (offset + W) for X of shape (m, n), m dynamic; tiling = (rows per block,
    threads). Offset 0 rounds the normalised x to `dtype` before the product, as Llama does; otherwise one
    rounding at the end, as Gemma does."""
    import tilelang.language as T

    rows, threads = tiling or _tiling(n)
    rstd_of = _rstd_macro(rows, n, eps)
    round_normed = not offset  # Llama's rounding of the normalised x before the product
    m = T.dynamic("m")

    @T.prim_func
    def rms_norm_fwd(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), Y: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(m, rows), threads=threads) as bx:
            w = T.alloc_shared((n,), dtype)
            x = T.alloc_fragment((rows, n), dtype)
            sq = T.alloc_fragment((rows, n), "float32")
            rstd = T.alloc_fragment((rows,), "float32")
            y = T.alloc_fragment((rows, n), dtype)
            T.copy(W, w)
            T.copy(X[bx * rows, 0], x)
            rstd_of(x, sq, rstd)
            for i, j in T.Parallel(rows, n):
                normed = T.cast(x[i, j], "float32") * rstd[i]
                if round_normed:
                    normed = T.cast(T.cast(normed, dtype), "float32")
                y[i, j] = T.cast(normed * (T.cast(w[j], "float32") + offset), dtype)
            T.copy(y, Y[bx * rows, 0])

    return rms_norm_fwd


def backward_kernel(n: int, eps: float, dtype: str, programs: int, tiling: tuple[int, int] | None = None,
                    offset: float = 0.0):
    """PrimFunc for dX and per-program partial dW (fp32, summed by the caller), m dynamic.

    A persistent grid of `programs` blocks strides over the rows, so the partial-dW buffer has a
    static size whatever the token count.
    """
    import tilelang.language as T

    rows, threads = tiling or _tiling(n)
    rstd_of = _rstd_macro(rows, n, eps)
    round_normed = not offset
    m = T.dynamic("m")

    @T.prim_func
    def rms_norm_bwd(
        DY: T.Tensor((m, n), dtype),
        X: T.Tensor((m, n), dtype),
        W: T.Tensor((n,), dtype),
        DX: T.Tensor((m, n), dtype),
        DWP: T.Tensor((programs * rows, n), "float32"),
    ):
        with T.Kernel(programs, threads=threads) as bx:
            w = T.alloc_shared((n,), dtype)
            x = T.alloc_fragment((rows, n), dtype)
            dy = T.alloc_fragment((rows, n), dtype)
            tmp = T.alloc_fragment((rows, n), "float32")
            rstd = T.alloc_fragment((rows,), "float32")
            dot = T.alloc_fragment((rows,), "float32")
            dx = T.alloc_fragment((rows, n), dtype)
            dw = T.alloc_fragment((rows, n), "float32")
            T.copy(W, w)
            T.clear(dw)
            for it in T.serial(T.ceildiv(m, programs * rows)):
                row0 = (it * programs + bx) * rows
                T.copy(X[row0, 0], x)
                T.copy(DY[row0, 0], dy)
                rstd_of(x, tmp, rstd)
                for i, j in T.Parallel(rows, n):
                    tmp[i, j] = (T.cast(dy[i, j], "float32") * (T.cast(w[j], "float32") + offset)
                                 * T.cast(x[i, j], "float32") * rstd[i])
                T.reduce_sum(tmp, dot, dim=1)
                for i, j in T.Parallel(rows, n):
                    normed = T.cast(x[i, j], "float32") * rstd[i]
                    dnormed = T.cast(dy[i, j], "float32") * (T.cast(w[j], "float32") + offset)
                    dx[i, j] = T.cast(rstd[i] * (dnormed - normed * dot[i] / n), dtype)
                    if round_normed:
                        dw[i, j] += T.cast(dy[i, j], "float32") * T.cast(T.cast(normed, dtype), "float32")
                    else:
                        dw[i, j] += T.cast(dy[i, j], "float32") * normed
                T.copy(dx, DX[row0, 0])
            T.copy(dw, DWP[bx * rows, 0])

    return rms_norm_bwd


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at the Llama-3-8B hidden size, for `tiletune kernels lower`."""
    return {"rms_norm_fwd": lambda: forward_kernel(4096, 1e-5, "bfloat16"),
            "rms_norm_bwd": lambda: backward_kernel(4096, 1e-5, "bfloat16", 264)}


def tilelang_unsupported(x: Tensor, weight: Tensor, eps: float, offset: float) -> str | None:
    """Why the TileLang kernels cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(x, weight)
    n = x.shape[-1]
    if reason is None and (n % 8 or n > 16384):
        reason = f"hidden size {n} is not a multiple of 8 up to 16384"
    return reason


def _programs(device: torch.device) -> int:
    return 2 * _tilelang.sm_count(device.index or 0)


def tilelang_forward(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """RMSNorm through the TileLang forward kernel."""
    n, dtype = x.shape[-1], _tilelang.DTYPES[x.dtype]
    kernel = _tilelang.compiled(("rms_norm_fwd", n, eps, dtype, offset), lambda: forward_kernel(n, eps, dtype, offset=offset))
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        kernel(x2, weight.contiguous(), y)
    return y.view(x.shape)


def tilelang_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float, weight_grad: bool):
    """(dx, dweight or None) through the TileLang backward kernel."""
    n, dtype, programs = x.shape[-1], _tilelang.DTYPES[x.dtype], _programs(x.device)
    kernel = _tilelang.compiled(("rms_norm_bwd", n, eps, dtype, programs, offset),
                                lambda: backward_kernel(n, eps, dtype, programs, offset=offset))
    x2, dy2 = x.reshape(-1, n).contiguous(), dy.reshape(-1, n).contiguous()
    dx = torch.empty_like(x2)
    partial = torch.empty(programs * _tiling(n)[0], n, device=x.device, dtype=torch.float32)
    if x2.shape[0]:
        kernel(dy2, x2, weight.contiguous(), dx, partial)
    else:
        partial.zero_()
    return dx.view(x.shape), partial.sum(0).to(weight.dtype) if weight_grad else None



# ---- custom ops and binding ------------------------------------------------------------------------

rms_norm_op = make_custom_op(Signature(
    "rms_norm", "Tensor x, Tensor weight, float eps, float offset", "Tensor",
    backward_inputs="Tensor x, Tensor weight, float eps, float offset, bool weight_grad", backward_outputs="(Tensor, Tensor)",
    fake=lambda x, weight, eps, offset: x.new_empty(x.shape, dtype=x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)),
    backward_fake=lambda dy, x, weight, eps, offset, weight_grad: (
        torch.empty_like(x), weight.new_empty(weight.shape) if weight_grad else dy.new_empty(0)),
    save=lambda inputs, outputs, needs: (*inputs, needs[1]),
    judged_on=lambda grads, saved: saved[:4],
    grad_of=(0, 1, None, None),
))


def rms_norm(x: Tensor, weight: Tensor, eps: float, impl: str = "reference", strict: bool = False,
             offset: float = 0.0) -> Tensor:
    """RMSNorm (Gemma's with offset 1) through the custom op with implementation `impl` (falls back to the reference)."""
    return torch.ops.tiletune.rms_norm(x, weight, eps, offset, impl, strict)


def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _fit(site: Site) -> str | None:
    if not isinstance(getattr(site.module, "weight", None), Tensor) or _eps(site.module) is None:
        return f"{type(site.module).__name__} has no weight and eps to read: stock forward kept"
    return None


def _forward(site: Site, impl: str, strict: bool, current):
    offset = 1.0 if site.part.offset else 0.0
    if getattr(site.part, "round_once", False) and not offset:
        # GPT-OSS's (w · x_normed in float32).to(x.dtype): the op's x·w form on x in float32 is that product
        def rounded_once(self, hidden_states):
            out = rms_norm(hidden_states.float(), self.weight, _eps(self), impl, strict, 0.0)
            return out.to(hidden_states.dtype)
        return rounded_once

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, _eps(self), impl, strict, offset)
    return forward


def _compile_key(site: Site) -> tuple:
    return (site.module.weight.shape[-1], _eps(site.module), 1.0 if site.part.offset else 0.0)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    hidden, eps, offset = key
    return rms_norm(warm_tensor(1, hidden, dtype=dtype), warm_tensor(hidden, dtype=dtype), eps, impl, True, offset)


define(Op("rms_norm", (Binding("rms_norm", "norm", _forward, _fit, compile_key=_compile_key, warm=_warm),),
          lowering=lowering_kernels))
add(Impl("rms_norm", "reference", reference_forward, reference_backward, description="PyTorch, as transformers computes it", accumulation="float32"))
add(Impl("rms_norm", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang fused forward; fused backward with a persistent grid for dweight", accumulation="float32"))
