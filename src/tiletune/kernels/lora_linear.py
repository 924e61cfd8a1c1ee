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
from torch import Tensor, nn

from tiletune.kernels import _tilelang, linear
from tiletune.kernels.binding import Binding, Site, autocast, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

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
    return linear.tilelang_unsupported(x, weight, bias) or adapter_unsupported(x, lora_a, lora_b)


def adapter_unsupported(x: Tensor, lora_a: Tensor, lora_b: Tensor) -> str | None:
    """Why the rank-r epilogue cannot take these adapters, or None."""
    if lora_a.device != x.device or lora_b.device != x.device:
        return "adapter weights on another device than the input"
    if lora_a.shape[0] > MAX_RANK:
        return f"rank {lora_a.shape[0]} is above {MAX_RANK}"
    return None


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


# ---- custom ops and binding ------------------------------------------------------------------------

lora_linear_op = make_custom_op(Signature(
    "lora_linear", "Tensor x, Tensor weight, Tensor? bias, Tensor lora_a, Tensor lora_b, float scaling", "(Tensor, Tensor)",
    backward_inputs="Tensor x, Tensor xa, Tensor weight, Tensor lora_a, Tensor lora_b, float scaling",
    backward_outputs="(Tensor, Tensor, Tensor)",
    fake=lambda x, weight, bias, lora_a, lora_b, scaling: (x.new_empty(*x.shape[:-1], weight.shape[0]),
                                                          x.new_empty(*x.shape[:-1], lora_a.shape[0])),
    backward_fake=lambda dy, x, xa, weight, lora_a, lora_b, scaling: (
        torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(lora_a), torch.empty_like(lora_b)),
    save=lambda inputs, outputs, needs: (inputs[0], outputs[1], *inputs[1:2], *inputs[3:]),
    judged_on=lambda grads, saved: (saved[0], saved[2], None, *saved[3:]),
    grad_of=(0, None, None, 1, 2, None),
))


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                impl: str = "reference", strict: bool = False) -> Tensor:
    """x Wᵀ (+ b) + scaling·(x Aᵀ) Bᵀ through the custom op with implementation `impl` (falls back to the reference).

    W and b are frozen (no gradient); x, A and B get theirs.
    """
    return torch.ops.tiletune.lora_linear(x, weight, bias, lora_a, lora_b, scaling, impl, strict)[0]


def active_adapter(module: nn.Module) -> str:
    """The name of the one active adapter of a peft LoRA Linear."""
    return next(a for a in module.active_adapters if a in module.lora_A)


def unfit_now(module: nn.Module) -> str | None:
    """Why a fused LoRA forward cannot stand in for this peft LoRA Linear's forward right now, or None."""
    adapters = [name for name in module.active_adapters if name in module.lora_A]
    base = module.base_layer
    if len(adapters) != 1:
        reason = f"{len(adapters)} active adapters"
    elif module.disable_adapters:
        reason = "adapters disabled"
    elif module.merged:
        reason = "adapter merged into the base weight"
    elif getattr(module, "fan_in_fan_out", False):
        reason = "fan_in_fan_out"
    elif module.use_dora.get(adapters[0]) or adapters[0] in getattr(module, "lora_variant", {}):
        reason = "DoRA or another LoRA variant"
    elif not isinstance(module.lora_dropout[adapters[0]], nn.Identity):
        reason = f"lora_dropout={module.lora_dropout[adapters[0]].p}"
    elif base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        reason = "the base layer trains"
    else:
        return None
    return f"{reason}: stock peft forward kept"


def lora_forward(run: Callable) -> Callable:
    """A Binding.forward for peft LoRA Linears: `run(module, x, adapter, impl, strict)` while the fused forward
    fits (unfit_now), peft's own forward otherwise."""
    def build(site: Site, impl: str, strict: bool, current: Callable) -> Callable:
        def forward(self, x, *args, **kwargs):
            if args or kwargs or unfit_now(self):
                return current(self, x, *args, **kwargs)
            return run(self, x, active_adapter(self), impl, strict)
        return forward
    return build


def _run(module: nn.Module, x: Tensor, adapter: str, impl: str, strict: bool) -> Tensor:
    x, weight, bias = autocast(x, module.base_layer.weight, module.base_layer.bias)
    return lora_linear(x, weight, bias, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                       module.scaling[adapter], impl, strict)


def _compile_key(site: Site) -> tuple:
    module = site.module
    return (module.base_layer.out_features, module.base_layer.in_features, module.lora_A[active_adapter(module)].out_features)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    out_features, in_features, rank = key
    return lora_linear(warm_tensor(1, in_features, dtype=dtype), warm_tensor(out_features, in_features, dtype=dtype, grad=False),
                       None, warm_tensor(rank, in_features, dtype=dtype), warm_tensor(out_features, rank, dtype=dtype), 2.0,
                       impl, True)


define(Op("lora_linear", (Binding("lora_linear", "lora_linear", lora_forward(_run), lambda site: linear.plain_linear_reason(site.module.base_layer),
                                  unfit_now=unfit_now, compile_key=_compile_key, warm=_warm, supersedes=("linear",)),),
          keeps_output=True, profile_pattern=r"lora_linear", lowering=lowering_kernels))
add(Impl("lora_linear", "reference", reference_forward, reference_backward,
         description="PyTorch: base F.linear + peft's lora_B(lora_A(x)) * scaling", accumulation="float32"))
add(Impl("lora_linear", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang GEMM with a rank-r epilogue (fwd, dX); dA, dB by torch matmuls",
         accumulation="float32"))
