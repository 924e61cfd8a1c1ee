"""SwiGLU as in the Llama/Qwen MLP: ``silu(gate) * up``.

Reference (PyTorch) forward and backward, the TileLang forward and backward kernels (fp32 inside,
one rounding per output), and the custom ops ``tiletune::swiglu`` / ``tiletune::swiglu_backward``.
The token dimension is dynamic; the intermediate size and dtype are static per compiled kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

# ---- reference -----------------------------------------------------------------------------------


def reference_forward(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, as the transformers MLP computes it."""
    return F.silu(gate) * up


def reference_backward(dy: Tensor, gate: Tensor, up: Tensor):
    """(dgate, dup), computed in fp32 (or float64)."""
    acc = _tilelang.accumulate_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    sig = torch.sigmoid(g)
    silu = g * sig
    dgate = d * u * sig * (1 + g * (1 - sig))
    return dgate.to(gate.dtype), (d * silu).to(up.dtype)


# ---- TileLang kernels ----------------------------------------------------------------------------

_BLOCK = (8, 512)  # rows x columns per block: 16 elements for each of 256 threads
_THREADS = 256


def forward_kernel(n: int, dtype: str, block: tuple[int, int] = _BLOCK, threads: int = _THREADS):
    """PrimFunc Y = silu(G) * U over (m, n), m dynamic; block = (rows, columns) per thread block."""
    import tilelang.language as T

    bm, bn = block
    m = T.dynamic("m")

    @T.prim_func
    def swiglu_fwd(G: T.Tensor((m, n), dtype), U: T.Tensor((m, n), dtype), Y: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            g = T.alloc_fragment((bm, bn), dtype)
            u = T.alloc_fragment((bm, bn), dtype)
            y = T.alloc_fragment((bm, bn), dtype)
            T.copy(G[by * bm, bx * bn], g)
            T.copy(U[by * bm, bx * bn], u)
            for i, j in T.Parallel(bm, bn):
                gf = T.cast(g[i, j], "float32")
                y[i, j] = T.cast(gf / (1.0 + T.exp(-gf)) * T.cast(u[i, j], "float32"), dtype)
            T.copy(y, Y[by * bm, bx * bn])

    return swiglu_fwd


def backward_kernel(n: int, dtype: str, block: tuple[int, int] = _BLOCK, threads: int = _THREADS):
    """PrimFunc (dG, dU) from (dY, G, U) over (m, n), m dynamic."""
    import tilelang.language as T

    bm, bn = block
    m = T.dynamic("m")

    @T.prim_func
    def swiglu_bwd(
        DY: T.Tensor((m, n), dtype),
        G: T.Tensor((m, n), dtype),
        U: T.Tensor((m, n), dtype),
        DG: T.Tensor((m, n), dtype),
        DU: T.Tensor((m, n), dtype),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            dy = T.alloc_fragment((bm, bn), dtype)
            g = T.alloc_fragment((bm, bn), dtype)
            u = T.alloc_fragment((bm, bn), dtype)
            dg = T.alloc_fragment((bm, bn), dtype)
            du = T.alloc_fragment((bm, bn), dtype)
            T.copy(DY[by * bm, bx * bn], dy)
            T.copy(G[by * bm, bx * bn], g)
            T.copy(U[by * bm, bx * bn], u)
            for i, j in T.Parallel(bm, bn):
                gf = T.cast(g[i, j], "float32")
                df = T.cast(dy[i, j], "float32")
                sig = 1.0 / (1.0 + T.exp(-gf))
                dg[i, j] = T.cast(df * T.cast(u[i, j], "float32") * sig * (1.0 + gf * (1.0 - sig)), dtype)
                du[i, j] = T.cast(df * gf * sig, dtype)
            T.copy(dg, DG[by * bm, bx * bn])
            T.copy(du, DU[by * bm, bx * bn])

    return swiglu_bwd


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at the Llama-3-8B intermediate size, for `tiletune kernels lower`."""
    return {"swiglu_fwd": lambda: forward_kernel(14336, "bfloat16"), "swiglu_bwd": lambda: backward_kernel(14336, "bfloat16")}


def tilelang_unsupported(gate: Tensor, up: Tensor) -> str | None:
    """Why the TileLang kernels cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(gate, up)
    if reason is None and gate.shape != up.shape:
        reason = "gate and up shapes differ"
    if reason is None and gate.shape[-1] % 8:
        reason = f"intermediate size {gate.shape[-1]} is not a multiple of 8"
    return reason


def _rows(*tensors: Tensor) -> list[Tensor]:
    n = tensors[0].shape[-1]
    return [t.reshape(-1, n).contiguous() for t in tensors]


def tilelang_forward(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up through the TileLang forward kernel."""
    n, dtype = gate.shape[-1], _tilelang.DTYPES[gate.dtype]
    kernel = _tilelang.compiled(("swiglu_fwd", n, dtype), lambda: forward_kernel(n, dtype))
    g, u = _rows(gate, up)
    y = torch.empty_like(g)
    if g.shape[0]:
        kernel(g, u, y)
    return y.view(gate.shape)


def tilelang_backward(dy: Tensor, gate: Tensor, up: Tensor):
    """(dgate, dup) through the TileLang backward kernel."""
    n, dtype = gate.shape[-1], _tilelang.DTYPES[gate.dtype]
    kernel = _tilelang.compiled(("swiglu_bwd", n, dtype), lambda: backward_kernel(n, dtype))
    d, g, u = _rows(dy, gate, up)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    if g.shape[0]:
        kernel(d, g, u, dg, du)
    return dg.view(gate.shape), du.view(up.shape)


# ---- custom ops and binding ------------------------------------------------------------------------

swiglu_op = make_custom_op(Signature(
    "swiglu", "Tensor gate, Tensor up", "Tensor",
    backward_inputs="Tensor gate, Tensor up", backward_outputs="(Tensor, Tensor)",
    fake=lambda gate, up: torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype),
                                           memory_format=torch.contiguous_format),
    backward_fake=lambda dy, gate, up: (torch.empty_like(gate, memory_format=torch.contiguous_format),
                                        torch.empty_like(up, memory_format=torch.contiguous_format)),
    save=lambda inputs, outputs, needs: inputs,
    judged_on=lambda grads, saved: saved,
    grad_of=(0, 1),
))


def swiglu(gate: Tensor, up: Tensor, impl: str = "reference", strict: bool = False) -> Tensor:
    """silu(gate) * up through the custom op with implementation `impl` (falls back to the reference)."""
    return torch.ops.tiletune.swiglu(gate, up, impl, strict)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _fit(site: Site) -> str | None:
    mlp = site.part
    if mlp.activation != "silu":
        return f"{mlp.activation} MLP (GeGLU): no kernel yet: stock forward kept"
    if mlp.fused_gate_up:
        return "fused gate_up projection: no kernel yet: stock forward kept"
    if not all(hasattr(site.module, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return f"{type(site.module).__name__} has no gate_proj, up_proj and down_proj: stock forward kept"
    if not _is_silu(getattr(site.module, "act_fn", None)):
        return f"activation {type(getattr(site.module, 'act_fn', None)).__name__} is not SiLU: stock forward kept"
    return None


def _forward(site: Site, impl: str, strict: bool, current):
    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), impl, strict))
    return forward


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    (intermediate,) = key
    return swiglu(warm_tensor(1, intermediate, dtype=dtype), warm_tensor(1, intermediate, dtype=dtype), impl, True)


define(Op("swiglu", (Binding("swiglu", "mlp", _forward, _fit, compile_key=lambda mlp: (mlp.gate_proj.out_features,),
                             warm=_warm),),
          lowering=lowering_kernels))
add(Impl("swiglu", "reference", reference_forward, reference_backward, description="PyTorch: F.silu(gate) * up", accumulation="input dtype"))
add(Impl("swiglu", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang fused elementwise forward and backward, fp32 inside", accumulation="float32"))
