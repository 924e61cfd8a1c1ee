"""SwiGLU as in the Llama/Qwen/Phi-3 MLP: ``silu(gate) * up``, and the machinery every gated MLP op shares.

A gated MLP op is one `Activation` record (its PyTorch forward and derivative, and the same two as TileLang
expressions) given to `define_gated`, which writes the rest once: reference forward and backward, the
TileLang forward and backward kernels (fp32 inside, one rounding per output), the custom ops
``tiletune::<name>`` / ``tiletune::<name>_backward``, a packed form ``tiletune::<name>_packed`` on one
[..., 2n] input holding [gate | up] (the halves read in place, the gradient returned packed) and the binding on
the `mlp` role (separate gate_proj and up_proj, or Phi-3's fused gate_up_proj through the packed form). This
module defines ``swiglu``; geglu.py defines Gemma's
GeGLU. The token dimension is dynamic; the intermediate size and dtype are static per compiled kernel.
"""

# No `from __future__ import annotations`: TileLang reads the kernel signatures' shapes from the closure.

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define, define_form
from tiletune.kernels.unread_output import LastProjection


@dataclass(frozen=True)
class Activation:
    """A gated MLP's activation: y = act(gate) * up."""

    name: str  # the family record's Mlp.activation
    forward: Callable[[Tensor], Tensor]  # PyTorch, as the model computes it
    grad: Callable[[Tensor], Tensor]  # d act / d gate, PyTorch, in the accumulation dtype
    tl_forward: Callable  # the same two as TileLang expressions of a float32 gate
    tl_grad: Callable
    modules: tuple[str, ...]  # class names of the model's activation module this op stands in for


def _silu_grad(g: Tensor) -> Tensor:
    sig = torch.sigmoid(g)
    return sig * (1 + g * (1 - sig))


def _tl_silu(g):
    import tilelang.language as T

    return g / (1.0 + T.exp(-g))


def _tl_silu_grad(g):
    import tilelang.language as T

    sig = 1.0 / (1.0 + T.exp(-g))
    return sig * (1.0 + g * (1.0 - sig))


SILU = Activation("silu", F.silu, _silu_grad, _tl_silu, _tl_silu_grad, ("SiLU", "SiLUActivation"))

# ---- reference -----------------------------------------------------------------------------------


def reference_forward(act: Activation, gate: Tensor, up: Tensor) -> Tensor:
    """act(gate) * up, as the transformers MLP computes it."""
    return act.forward(gate) * up


def reference_backward(act: Activation, dy: Tensor, gate: Tensor, up: Tensor):
    """(dgate, dup), computed in fp32 (or float64)."""
    acc = _tilelang.accumulate_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    return (d * u * act.grad(g)).to(gate.dtype), (d * act.forward(g)).to(up.dtype)


# ---- TileLang kernels ----------------------------------------------------------------------------

_BLOCK = (8, 512)  # rows x columns per block: 16 elements for each of 256 threads
_THREADS = 256


def forward_kernel(act: Activation, n: int, dtype: str, block: tuple[int, int] = _BLOCK, threads: int = _THREADS,
                   packed: bool = False):  # fmt: skip
    """PrimFunc Y = act(G) * U over (m, n), m dynamic; block = (rows, columns) per thread block. packed: one input
    GU (m, 2n), the gate's columns then the up projection's (a fused gate_up projection's output), read in place
    (block's columns must divide n)."""
    import tilelang.language as T

    bm, bn = block
    m = T.dynamic("m")
    up_column = n if packed else 0

    @T.macro
    def compute(G, U, Y):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            g = T.alloc_fragment((bm, bn), dtype)
            u = T.alloc_fragment((bm, bn), dtype)
            y = T.alloc_fragment((bm, bn), dtype)
            T.copy(G[by * bm, bx * bn], g)
            T.copy(U[by * bm, up_column + bx * bn], u)
            for i, j in T.Parallel(bm, bn):
                y[i, j] = T.cast(act.tl_forward(T.cast(g[i, j], "float32")) * T.cast(u[i, j], "float32"), dtype)
            T.copy(y, Y[by * bm, bx * bn])

    if packed:
        @T.prim_func
        def gated_fwd(GU: T.Tensor((m, 2 * n), dtype), Y: T.Tensor((m, n), dtype)):
            compute(GU, GU, Y)
    else:
        @T.prim_func
        def gated_fwd(G: T.Tensor((m, n), dtype), U: T.Tensor((m, n), dtype), Y: T.Tensor((m, n), dtype)):
            compute(G, U, Y)

    return gated_fwd.with_attr("global_symbol", f"{act_op_name(act)}_fwd{'_packed' if packed else ''}")


def backward_kernel(act: Activation, n: int, dtype: str, block: tuple[int, int] = _BLOCK, threads: int = _THREADS,
                    packed: bool = False, row_dots: bool = False):  # fmt: skip
    """PrimFunc (dG, dU) from (dY, G, U) over (m, n), m dynamic. packed: GU and dGU are (m, 2n) as in
    forward_kernel, and dY's rows are scaled by S (m,) float32 first (the MoE experts' routing weights). row_dots
    (packed only): also DOT (m, column blocks) float32, each block's sum over its columns of dY·act(G)·U with dY
    unscaled; a row's partial sums add up to the dot of dY's row with the forward's output row (the routing weight's
    gradient, without keeping the expert outputs)."""
    import tilelang.language as T

    bm, bn = block
    m = T.dynamic("m")
    up_column = n if packed else 0

    @T.macro
    def compute(DY, G, U, S, DG, DU, DOT):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            dy = T.alloc_fragment((bm, bn), dtype)
            g = T.alloc_fragment((bm, bn), dtype)
            u = T.alloc_fragment((bm, bn), dtype)
            dg = T.alloc_fragment((bm, bn), dtype)
            du = T.alloc_fragment((bm, bn), dtype)
            products = T.alloc_fragment((bm, bn), "float32")
            dots = T.alloc_fragment((bm,), "float32")
            T.copy(DY[by * bm, bx * bn], dy)
            T.copy(G[by * bm, bx * bn], g)
            T.copy(U[by * bm, up_column + bx * bn], u)
            for i, j in T.Parallel(bm, bn):
                gf = T.cast(g[i, j], "float32")
                uf = T.cast(u[i, j], "float32")
                dyf = T.cast(dy[i, j], "float32")
                df = dyf * (S[by * bm + i] if packed else 1.0)
                dg[i, j] = T.cast(df * uf * act.tl_grad(gf), dtype)
                du[i, j] = T.cast(df * act.tl_forward(gf), dtype)
                if row_dots:
                    products[i, j] = dyf * act.tl_forward(gf) * uf
            T.copy(dg, DG[by * bm, bx * bn])
            T.copy(du, DU[by * bm, up_column + bx * bn])
            if row_dots:
                T.reduce_sum(products, dots, dim=1)
                for i in T.Parallel(bm):
                    if by * bm + i < m:
                        DOT[by * bm + i, bx] = dots[i]

    if row_dots:
        assert packed, "row dots are the packed kernel's (the MoE experts')"

        @T.prim_func
        def gated_bwd(DY: T.Tensor((m, n), dtype), GU: T.Tensor((m, 2 * n), dtype), S: T.Tensor((m,), "float32"),
                      DGU: T.Tensor((m, 2 * n), dtype), DOT: T.Tensor((m, -(-n // bn)), "float32")):  # fmt: skip
            compute(DY, GU, GU, S, DGU, DGU, DOT)
    elif packed:
        @T.prim_func
        def gated_bwd(DY: T.Tensor((m, n), dtype), GU: T.Tensor((m, 2 * n), dtype), S: T.Tensor((m,), "float32"),
                      DGU: T.Tensor((m, 2 * n), dtype)):  # fmt: skip
            compute(DY, GU, GU, S, DGU, DGU, None)
    else:
        @T.prim_func
        def gated_bwd(
            DY: T.Tensor((m, n), dtype),
            G: T.Tensor((m, n), dtype),
            U: T.Tensor((m, n), dtype),
            DG: T.Tensor((m, n), dtype),
            DU: T.Tensor((m, n), dtype),
        ):
            compute(DY, G, U, None, DG, DU, None)

    suffix = "_packed_dots" if row_dots else "_packed" if packed else ""
    return gated_bwd.with_attr("global_symbol", f"{act_op_name(act)}_bwd{suffix}")


def act_op_name(act: Activation) -> str:
    """The op's name for an activation: swiglu for silu, geglu for the GELUs."""
    return "swiglu" if act.name == "silu" else "geglu"


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


def tilelang_forward(act: Activation, gate: Tensor, up: Tensor) -> Tensor:
    """act(gate) * up through the TileLang forward kernel."""
    n, dtype = gate.shape[-1], _tilelang.DTYPES[gate.dtype]
    kernel = _tilelang.compiled((act.name, "fwd", n, dtype), lambda: forward_kernel(act, n, dtype))
    g, u = _rows(gate, up)
    y = torch.empty_like(g)
    if g.shape[0]:
        kernel(g, u, y)
    return y.view(gate.shape)


def tilelang_backward(act: Activation, dy: Tensor, gate: Tensor, up: Tensor):
    """(dgate, dup) through the TileLang backward kernel."""
    n, dtype = gate.shape[-1], _tilelang.DTYPES[gate.dtype]
    kernel = _tilelang.compiled((act.name, "bwd", n, dtype), lambda: backward_kernel(act, n, dtype))
    d, g, u = _rows(dy, gate, up)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    if g.shape[0]:
        kernel(d, g, u, dg, du)
    return dg.view(gate.shape), du.view(up.shape)


def _packed_block(n: int) -> tuple[int, int] | None:
    """The widest block of _BLOCK's shape whose columns divide n (a packed kernel's gate columns must not run into
    the up projection's), or None when n is not a multiple of 64."""
    columns = next((c for c in (512, 256, 128, 64) if n % c == 0), None)
    return None if columns is None else (_THREADS * 16 // columns, columns)


def packed_unsupported(n: int) -> str | None:
    """Why the packed kernels cannot run [gate | up] rows of n columns each, or None."""
    return None if _packed_block(n) is not None else f"packed activation: intermediate size {n} is not a multiple of 64"


def packed_inputs_unsupported(gate_up: Tensor) -> str | None:
    """Why the packed kernels cannot run this [..., 2n] input, or None."""
    return _tilelang.unsupported_inputs(gate_up) or packed_unsupported(gate_up.shape[-1] // 2)


def reference_packed_forward(act: Activation, gate_up: Tensor) -> Tensor:
    """act(gate) * up of a [..., 2n] input holding [gate | up] (reference_forward on its halves)."""
    return reference_forward(act, *gate_up.chunk(2, dim=-1))


def reference_packed_backward(act: Activation, dy: Tensor, gate_up: Tensor) -> Tensor:
    """d[gate | up] of reference_packed_forward, packed as its input."""
    return torch.cat(reference_backward(act, dy, *gate_up.chunk(2, dim=-1)), dim=-1)


def tilelang_packed_forward(act: Activation, gate_up: Tensor) -> Tensor:
    """act(gate) * up of a [..., 2n] input holding [gate | up], read in place by the packed TileLang kernel."""
    n, dtype = gate_up.shape[-1] // 2, _tilelang.DTYPES[gate_up.dtype]
    block = _packed_block(n)
    kernel = _tilelang.compiled((act.name, "fwd_packed", n, dtype),
                                lambda: forward_kernel(act, n, dtype, block, packed=True))
    gu = gate_up.reshape(-1, 2 * n).contiguous()
    y = gu.new_empty(gu.shape[0], n)
    if gu.shape[0]:
        kernel(gu, y)
    return y.view(*gate_up.shape[:-1], n)


def tilelang_packed_backward(act: Activation, dy: Tensor, gate_up: Tensor, row_scale: Tensor | None = None) -> Tensor:
    """d[gate | up] [rows, 2n] of tilelang_packed_forward for dy [rows, n] (each row times `row_scale` [rows], if
    given), float32 inside, one rounding."""
    return _packed_backward(act, dy, gate_up, row_scale, row_dots=False)[0]


def tilelang_packed_backward_dots(act: Activation, dy: Tensor, gate_up: Tensor,
                                  row_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(tilelang_packed_backward's d[gate | up], [rows] float32: each row's dot of dy (unscaled) with the forward's
    output act(gate)·up), from one pass over the rows."""
    dgu, partial = _packed_backward(act, dy, gate_up, row_scale, row_dots=True)
    return dgu, partial.sum(-1)


def _packed_backward(act: Activation, dy: Tensor, gate_up: Tensor, row_scale: Tensor | None,
                     row_dots: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    n, dtype = gate_up.shape[-1] // 2, _tilelang.DTYPES[gate_up.dtype]
    block = _packed_block(n)
    kernel = _tilelang.compiled((act.name, "bwd_packed_dots" if row_dots else "bwd_packed", n, dtype),
                                lambda: backward_kernel(act, n, dtype, block, packed=True, row_dots=row_dots))
    gu = gate_up.reshape(-1, 2 * n).contiguous()
    rows = gu.shape[0]
    scale = (torch.ones(rows, dtype=torch.float32, device=gu.device) if row_scale is None
             else row_scale.reshape(rows).to(torch.float32).contiguous())
    dgu = torch.empty_like(gu)
    partial = gu.new_zeros(rows, -(-n // block[1]), dtype=torch.float32) if row_dots else None
    if rows:
        kernel(dy.reshape(rows, n).to(gu.dtype).contiguous(), gu, scale, dgu, *([partial] if row_dots else []))
    return dgu.view_as(gate_up), partial


# ---- custom ops and binding ------------------------------------------------------------------------


def _projections(mlp: nn.Module) -> str | None:
    """Why this MLP module lacks the projections a gated MLP forward needs, or None."""
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
        return None
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    return f"{type(mlp).__name__} has neither gate_proj, up_proj nor a fused gate_up_proj with a down_proj"


def _activation_module(mlp: nn.Module) -> nn.Module | None:
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def define_gated(act: Activation, opt_in: bool = False) -> Callable:
    """Define the gated MLP op for `act` (custom ops, binding on the mlp role, reference and TileLang
    implementations); returns its public function op(gate, up, impl="reference", strict=False). `opt_in`: left
    out of `kernels: all` until named."""
    name = act_op_name(act)
    make_custom_op(Signature(
        name, "Tensor gate, Tensor up", "Tensor",
        backward_inputs="Tensor gate, Tensor up", backward_outputs="(Tensor, Tensor)",
        fake=lambda gate, up: torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype),
                                               memory_format=torch.contiguous_format),
        backward_fake=lambda dy, gate, up: (torch.empty_like(gate, memory_format=torch.contiguous_format),
                                            torch.empty_like(up, memory_format=torch.contiguous_format)),
        save=lambda inputs, outputs, needs: inputs,
        judged_on=lambda grads, saved: saved,
        grad_of=(0, 1),
    ))
    custom_op = getattr(torch.ops.tiletune, name)

    def gated(gate: Tensor, up: Tensor, impl: str = "reference", strict: bool = False) -> Tensor:
        return custom_op(gate, up, impl, strict)

    gated.__name__ = name
    gated.__doc__ = f"{act.name}(gate) * up through the custom op with implementation `impl` (falls back to the reference)."

    def fit(site: Site) -> str | None:
        reason = _projections(site.module)
        module = _activation_module(site.module)
        if reason is None and type(module).__name__ not in act.modules:
            reason = f"activation {type(module).__name__} is not {act.name}"
        return f"{reason}: stock forward kept" if reason else None

    # the packed form: Phi-3's fused gate_up_proj output [..., 2n] read in place, its gradient returned packed (no
    # copies of the two halves either way)
    packed_name = f"{name}_packed"
    define_form(packed_name)
    make_custom_op(Signature(
        packed_name, "Tensor gate_up", "Tensor",
        backward_inputs="Tensor gate_up", backward_outputs="Tensor",
        fake=lambda gate_up: gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2),
        backward_fake=lambda dy, gate_up: torch.empty_like(gate_up, memory_format=torch.contiguous_format),
        save=lambda inputs, outputs, needs: inputs,
        judged_on=lambda grads, saved: saved,
        grad_of=(0,),
    ))
    packed_op = getattr(torch.ops.tiletune, packed_name)

    def forward(site: Site, impl: str, strict: bool, current):
        down = LastProjection(site.part.output_kept)  # spared in a re-entrant recomputation (unread_output)
        if site.part.fused_gate_up:
            def fused(self, x):
                return down(self.down_proj, packed_op(self.gate_up_proj(x), impl, strict))
            return fused

        def separate(self, x):
            return down(self.down_proj, gated(self.gate_proj(x), self.up_proj(x), impl, strict))
        return separate

    def compile_key(site: Site) -> tuple:
        return (site.module.down_proj.in_features,)

    def warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
        (intermediate,) = key
        return gated(warm_tensor(1, intermediate, dtype=dtype), warm_tensor(1, intermediate, dtype=dtype), impl, True)

    def lowering(arch: str) -> dict[str, Callable]:
        return {f"{name}_fwd": lambda: forward_kernel(act, 14336, "bfloat16"),
                f"{name}_bwd": lambda: backward_kernel(act, 14336, "bfloat16"),
                # the packed form, at the Qwen3-30B-A3B experts' width (768: 256-column blocks)
                f"{name}_fwd_packed": lambda: forward_kernel(act, 768, "bfloat16", _packed_block(768), packed=True),
                f"{name}_bwd_packed": lambda: backward_kernel(act, 768, "bfloat16", _packed_block(768), packed=True),
                # with the rows' dots (the MoE experts' routing-weight gradient)
                f"{name}_bwd_packed_dots": lambda: backward_kernel(act, 768, "bfloat16", _packed_block(768), packed=True,
                                                                   row_dots=True)}

    def bound(function: Callable) -> Callable:
        def with_act(*args):
            return function(act, *args)
        return with_act

    define(Op(name, (Binding(name, "mlp", forward, fit, compile_key=compile_key, warm=warm,
                             applies=lambda site: site.part.activation == act.name),), opt_in=opt_in,
              lowering=lowering))
    add(Impl(name, "reference", bound(reference_forward), bound(reference_backward),
             description=f"PyTorch: {act.name}(gate) * up, as the model's MLP", accumulation="input dtype"))
    add(Impl(name, "tilelang", bound(tilelang_forward), bound(tilelang_backward), _tilelang.machine_unavailable_reason,
             tilelang_unsupported, "TileLang fused elementwise forward and backward, fp32 inside", accumulation="float32"))
    add(Impl(packed_name, "reference", bound(reference_packed_forward), bound(reference_packed_backward),
             description=f"PyTorch: {act.name}(gate) * up of the [gate | up] halves", accumulation="input dtype"))
    add(Impl(packed_name, "tilelang", bound(tilelang_packed_forward), bound(tilelang_packed_backward),
             _tilelang.machine_unavailable_reason, packed_inputs_unsupported,
             "TileLang packed kernels: the halves read in place, fp32 inside", accumulation="float32"))
    return gated


swiglu = define_gated(SILU)
