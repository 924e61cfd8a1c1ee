"""Linear: ``y = x Wᵀ (+ b)``; backward dX = dY W always, dW = dYᵀ X only when W requires grad.

Reference (PyTorch) forward and backward, TileLang GEMM kernels (one factory, three uses: forward,
grad-input, grad-weight; `lora_linear` adds a low-rank epilogue to the first two), and the custom ops ``tiletune::linear`` / ``tiletune::linear_backward``.
The token dimension is dynamic (it is the reduction dimension of dW); in/out features, dtype and tile
configuration are static. Tile configurations come from `TUNED` (per-shape autotuning on the GPU,
see benchmarks/kernel_bench.py --tune), else a per-architecture default.
"""

# No `from __future__ import annotations` here: TileLang reads the kernel signature's shapes
# (a_shape, b_shape, c_shape) from the closure, which string annotations would hide.

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, autocast, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

# ---- reference -----------------------------------------------------------------------------------


def reference_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear."""
    return F.linear(x, weight, bias)


def reference_backward(dy: Tensor, x: Tensor, weight: Tensor, weight_grad: bool, bias_grad: bool):
    """(dx, dweight or None, dbias or None); x may be empty when the weight needs no gradient."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = (dy2 @ weight.to(dy.dtype)).view(*dy.shape[:-1], weight.shape[1]).to(x.dtype)
    dw = (dy2.t() @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype) if weight_grad else None
    db = dy2.sum(0).to(weight.dtype) if bias_grad else None
    return dx, dw, db


# ---- TileLang kernels ----------------------------------------------------------------------------

# (block_m, block_n, block_k, stages, threads)
DEFAULT_CONFIG = {"sm_90": (128, 256, 64, 3, 256), "sm_80": (128, 128, 32, 2, 128), "hip": (128, 128, 32, 2, 256)}
# Candidates for per-shape autotuning on sm_90 (each fits 227 KB of shared memory).
CANDIDATES = [(128, 256, 64, 3, 256), (128, 128, 64, 4, 256), (256, 128, 64, 3, 256), (128, 128, 64, 3, 128),
              (64, 256, 64, 4, 128), (128, 256, 32, 4, 256)]
# (arch, kind, out_features, in_features, dtype) -> config; kind is fwd, dgrad or wgrad. Autotuning
# on the H200 (benchmarks/results/kernels_h200_full_run.log) found DEFAULT_CONFIG fastest for 10 of the
# 12 Llama-3-8B GEMMs; the two wgrad configs 1-5% faster stay out until a GPU test has checked them.
TUNED: dict[tuple[str, str, int, int, str], tuple[int, int, int, int, int]] = {}


def gemm_kernel(kind: str, out_features: int, in_features: int, dtype: str, config, rank: int = 0):
    """PrimFunc for one of the three GEMMs of a linear layer, m (tokens) dynamic.

    fwd:   Y (m, out) = X (m, in) · W (out, in)ᵀ
    dgrad: dX (m, in) = dY (m, out) · W (out, in)
    wgrad: dW (out, in) = dY (m, out)ᵀ · X (m, in)   (reduction over the tokens)

    rank > 0 (a multiple of 16) adds a low-rank epilogue to the same fp32 accumulator, C += L · R,
    L (rows of C, rank) and R laid out as B is: (cols, rank) where B is transposed, else (rank, cols).
    """
    import tilelang.language as T

    bm, bn, bk, stages, threads = config
    m = T.dynamic("m")
    a_shape, b_shape, c_shape, reduction, trans_a, trans_b = {
        "fwd": ((m, in_features), (out_features, in_features), (m, out_features), in_features, False, True),
        "dgrad": ((m, out_features), (out_features, in_features), (m, in_features), out_features, False, False),
        "wgrad": ((m, out_features), (m, in_features), (out_features, in_features), m, True, False),
    }[kind]
    rows, cols = c_shape
    l_shape, r_shape = (rows, rank), (cols, rank) if trans_b else (rank, cols)

    @T.macro
    def tile(A, B, C, L, R):
        with T.Kernel(T.ceildiv(cols, bn), T.ceildiv(rows, bm), threads=threads) as (bx, by):
            a = T.alloc_shared((bk, bm) if trans_a else (bm, bk), dtype)
            b = T.alloc_shared((bn, bk) if trans_b else (bk, bn), dtype)
            acc = T.alloc_fragment((bm, bn), "float32")
            c = T.alloc_shared((bm, bn), dtype)
            T.use_swizzle(panel_size=10)
            T.clear(acc)
            for ko in T.Pipelined(T.ceildiv(reduction, bk), num_stages=stages):
                if trans_a:
                    T.copy(A[ko * bk, by * bm], a)
                else:
                    T.copy(A[by * bm, ko * bk], a)
                if trans_b:
                    T.copy(B[bx * bn, ko * bk], b)
                else:
                    T.copy(B[ko * bk, bx * bn], b)
                T.gemm(a, b, acc, transpose_A=trans_a, transpose_B=trans_b)
            if rank:
                low = T.alloc_shared((bm, rank), dtype)
                high = T.alloc_shared((bn, rank) if trans_b else (rank, bn), dtype)
                T.copy(L[by * bm, 0], low)
                if trans_b:
                    T.copy(R[bx * bn, 0], high)
                else:
                    T.copy(R[0, bx * bn], high)
                T.gemm(low, high, acc, transpose_B=trans_b)
            T.copy(acc, c)
            T.copy(c, C[by * bm, bx * bn])

    if rank:
        @T.prim_func
        def gemm(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), L: T.Tensor(l_shape, dtype),
                 R: T.Tensor(r_shape, dtype), C: T.Tensor(c_shape, dtype)):
            tile(A, B, C, L, R)

        return gemm.with_attr("global_symbol", f"lora_linear_{kind}")

    @T.prim_func
    def gemm(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor(c_shape, dtype)):
        tile(A, B, C, None, None)

    return gemm.with_attr("global_symbol", f"linear_{kind}")


def config_for(arch: str, kind: str, out_features: int, in_features: int, dtype: str):
    """The tile configuration for this GEMM: tuned if known, else the architecture default."""
    default = DEFAULT_CONFIG.get(arch, DEFAULT_CONFIG["hip" if arch.startswith("gfx") else "sm_80"])
    return TUNED.get((arch, kind, out_features, in_features, dtype), default)


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder of the three GEMMs at Llama-3-8B's q_proj shape, for `tiletune kernels lower`."""
    return {f"linear_{kind}": functools.partial(gemm_kernel, kind, 4096, 4096, "bfloat16",
                                                config_for(arch, kind, 4096, 4096, "bfloat16"))
            for kind in ("fwd", "dgrad", "wgrad")}


def tilelang_unsupported(x: Tensor, weight: Tensor, bias: Tensor | None) -> str | None:
    """Why the TileLang GEMMs cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(x, weight)
    if reason is None and (weight.shape[0] % 8 or weight.shape[1] % 8):
        reason = f"features {tuple(weight.shape)} are not multiples of 8"
    return reason


def run_gemm(kind: str, a: Tensor, b: Tensor, out: Tensor, out_features: int, in_features: int,
             low_rank: tuple[Tensor, Tensor] | tuple[()] = ()) -> Tensor:
    """Run the `kind` GEMM of a and b into `out` (plus low_rank = (L, R) as gemm_kernel's epilogue)."""
    dtype, arch = _tilelang.DTYPES[a.dtype], _tilelang.device_arch(a.device)
    config = config_for(arch, kind, out_features, in_features, dtype)
    rank = low_rank[0].shape[1] if low_rank else 0
    kernel = _tilelang.compiled(("linear", kind, out_features, in_features, dtype, config, rank),
                                lambda: gemm_kernel(kind, out_features, in_features, dtype, config, rank))
    if a.shape[0]:
        kernel(a, b, *low_rank, out)
    else:
        out.zero_()
    return out


def torch_gemm(kind: str, a: Tensor, b: Tensor, out: Tensor, out_features: int, in_features: int,
               low_rank: tuple[Tensor, Tensor] | tuple[()] = ()) -> Tensor:
    """run_gemm's arithmetic in PyTorch, for machines without the kernel: products and sums in float32
    (float64 for float64 inputs) whatever autocast says, the low-rank epilogue in the same accumulator,
    one rounding into `out`."""
    acc = torch.promote_types(a.dtype, torch.float32)
    a, b = a.to(acc), b.to(acc)
    with torch.autocast(a.device.type, enabled=False):
        product = {"fwd": lambda: a @ b.t(), "dgrad": lambda: a @ b, "wgrad": lambda: a.t() @ b}[kind]()
        if low_rank:
            low, high = (t.to(acc) for t in low_rank)
            product += low @ (high.t() if kind == "fwd" else high)
    return out.copy_(product)


def tilelang_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x Wᵀ (+ b) through the TileLang GEMM (bias added by PyTorch)."""
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features).contiguous()
    y = run_gemm("fwd", x2, weight.contiguous(), x2.new_empty(x2.shape[0], out_features), out_features, in_features)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out_features)


def tilelang_backward(dy: Tensor, x: Tensor, weight: Tensor, weight_grad: bool, bias_grad: bool):
    """(dx, dweight or None, dbias or None) through the TileLang GEMMs; x may be empty when dW is not needed."""
    out_features, in_features = weight.shape
    dy2, w = dy.reshape(-1, out_features).contiguous(), weight.contiguous()
    dx = run_gemm("dgrad", dy2, w, dy2.new_empty(dy2.shape[0], in_features), out_features, in_features)
    dw = None
    if weight_grad:
        x2 = x.reshape(-1, in_features).contiguous()
        dw = run_gemm("wgrad", dy2, x2, weight.new_empty(weight.shape), out_features, in_features)
    return dx.view(*dy.shape[:-1], in_features), dw, dy2.sum(0).to(weight.dtype) if bias_grad else None


# ---- custom ops and binding ------------------------------------------------------------------------

linear_op = make_custom_op(Signature(
    "linear", "Tensor x, Tensor weight, Tensor? bias", "Tensor",
    backward_inputs="Tensor x, Tensor weight, bool weight_grad, bool bias_grad", backward_outputs="(Tensor, Tensor, Tensor)",
    fake=lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]),
    backward_fake=lambda dy, x, weight, weight_grad, bias_grad: (
        x.new_empty(*dy.shape[:-1], weight.shape[1]), weight.new_empty(weight.shape) if weight_grad else dy.new_empty(0),
        weight.new_empty(weight.shape[0]) if bias_grad else dy.new_empty(0)),
    # x is needed only for dW: a frozen weight (LoRA's base layer) keeps no activation alive
    save=lambda inputs, outputs, needs: (inputs[0] if needs[1] else inputs[0].new_empty(0), inputs[1], needs[1], needs[2]),
    judged_on=lambda grads, saved: (saved[0], saved[1], None),
    grad_of=(0, 1, 2),
))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, impl: str = "reference", strict: bool = False) -> Tensor:
    """x Wᵀ (+ b) through the custom op with implementation `impl` (falls back to the reference)."""
    return torch.ops.tiletune.linear(x, weight, bias, impl, strict)


def plain_linear_reason(module: nn.Module) -> str | None:
    """Why `module` is not an nn.Linear computing F.linear (a subclass with its own forward: a router, a
    quantized layer), or None."""
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has its own forward, not F.linear: stock forward kept"
    return None


def _forward(site: Site, impl: str, strict: bool, current):
    def forward(self, x):
        return linear(*autocast(x, self.weight, self.bias), impl, strict)
    return forward


def _compile_key(site: Site) -> tuple:
    """(out, in, "trained" or "frozen"): a frozen weight (a LoRA base layer) needs no weight-gradient GEMM."""
    return site.module.out_features, site.module.in_features, "trained" if site.module.weight.requires_grad else "frozen"


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    out_features, in_features, weight_grad = key
    weight = warm_tensor(out_features, in_features, dtype=dtype, grad=weight_grad == "trained")
    return linear(warm_tensor(1, in_features, dtype=dtype), weight, None, impl, True)


define(Op("linear", (Binding("linear", "linear", _forward, lambda site: plain_linear_reason(site.module),
                             compile_key=_compile_key, warm=_warm),),
          keeps_output=True, profile_pattern=r"(?<!lora_)linear_(fwd|dgrad|wgrad)", lowering=lowering_kernels))
add(Impl("linear", "reference", reference_forward, reference_backward, description="PyTorch: F.linear (cuBLAS on GPU)", accumulation="float32"))
add(Impl("linear", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang GEMMs (wgmma on sm_90, MFMA on gfx9); dW only when W requires grad", accumulation="float32"))
