"""A decoder layer's last projection where nothing reads its output: its backward without its forward GEMM.

Under re-entrant checkpointing (transformers' default; tiletune's `use_reentrant_gc: true`) a checkpointed layer runs
its forward twice: once without autograd, then again in the backward, which builds the graph the layer's backward
walks. Of a dense MLP's down projection, the layer's last op where the MLP's output only joins the residual sum
(`Mlp.output_kept` False: every family but Gemma's, whose post-feedforward norm keeps it), that graph reads the input
(for the adapters' and a trained weight's gradients) and the weight (for the input's gradient), never the output.
The gated MLP bindings (swiglu, geglu) call the projection through a `LastProjection`: in that recomputation a
Linear or a QuantLinear (QLoRA's 4-bit / int8 base), or a peft LoRA Linear over one, returns NaN of its output's
shape (read by nothing; a read by mistake would show in the gradients) and records the backward of its base GEMM
without running the GEMM (nor, for a quantized base, its dequantization: the backward dequantizes again anyway).
That spares a third of the MLP's forward GEMM work in each recomputed layer; the adapters' rank-r products still
run, and their dropout draws the numbers the first forward drew.

Only there: a non-re-entrant checkpoint matches its recomputation's saved tensors with its first forward's one for
one, and its first forward runs with autograd on, which is how a `LastProjection` tells the two apart. A chunked MLP
(`tiletune.train.tiled_mlp`) runs each chunk again in its own backward, whose output likewise only meets its
gradient: the projection is spared there too. A projection of another kind (bitsandbytes' 4-bit layers, DoRA,
adapters merged or disabled, hooks around it such as DeepSpeed ZeRO-3's, a weight not all on this device) computes
as usual; `unread_unfit` says why.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from tiletune.kernels.quant_linear import QuantLinear, weight_args
from tiletune.kernels.registry import in_backward


class _UnreadLinear(torch.autograd.Function):
    """``x·Wᵀ + b`` as autograd sees it, not computed: the output is NaN, the backward exact (F.linear's, autocast
    included: the products in the forward's compute dtype, the input's gradient back in the input's dtype)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return x.new_full((*x.shape[:-1], weight.shape[0]), float("nan"), dtype=dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (rows @ weight.to(ctx.dtype)).to(ctx.x_dtype).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = (rows.t() @ x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias


class _UnreadQuantLinear(torch.autograd.Function):
    """A QuantLinear's ``x·dequant(Wq)ᵀ + b`` as autograd sees it, not computed: the output is NaN (the compute dtype:
    autocast's, else x's), the input's gradient quant_linear's backward op with implementation `impl` (the weight and
    its bias are frozen)."""

    @staticmethod
    def forward(ctx, x: Tensor, module: QuantLinear, impl: str, strict: bool) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.weight, ctx.impl, ctx.strict, ctx.x_dtype = weight_args(module.quantized), impl, strict, x.dtype
        return x.new_full((*x.shape[:-1], module.out_features), float("nan"), dtype=dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_x = torch.ops.tiletune.quant_linear_backward(grad, *ctx.weight, ctx.impl, ctx.strict).to(ctx.x_dtype)
        return grad_x, None, None, None


def _quantized_impl_of(module: nn.Module) -> tuple[str, bool]:
    """The (impl, strict) the module's bound forward runs its quantized base with (`quant_linear.tag_impl`); the
    reference, QuantLinear's own default, where no binding set one."""
    bound = module.__dict__.get("forward")
    return getattr(getattr(bound, "__func__", None), "quantized_impl", ("reference", False))


def _unread_base(base: nn.Module, x: Tensor, bound: nn.Module) -> Tensor:
    """The stand-in of a base layer (`_base_unfit(base)` None); `bound`: the module whose forward a binding replaced."""
    if isinstance(base, QuantLinear):
        return _UnreadQuantLinear.apply(x, base, *_quantized_impl_of(bound))
    return _UnreadLinear.apply(x, base.weight, base.bias)


@functools.cache
def _lora_linear_class() -> type | None:
    try:
        from peft.tuners.lora import Linear
    except ImportError:
        return None
    return Linear


def _hooked(module: nn.Module) -> str | None:
    """Why calling around `module` would skip what runs with its forward: hooks (DeepSpeed ZeRO-3 gathers a partitioned
    weight in one, and fetches it again for the backward), accelerate's device hook (an offloaded weight)."""
    if module._forward_pre_hooks or module._forward_hooks or hasattr(module, "_hf_hook"):
        return "hooks run with its forward (DeepSpeed ZeRO-3's weight gathering, accelerate's offload)"
    return None


def _base_unfit(module: nn.Module) -> str | None:
    """Why a base layer has no stand-in: not a plain Linear or tiletune's QuantLinear, a weight not all here, hooks."""
    quantized = type(module) is QuantLinear
    if not quantized and (not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward):
        return f"{type(module).__name__} is neither a plain Linear nor tiletune's QuantLinear"
    weight = module.weight
    if not quantized and not weight.is_floating_point():
        return f"its weight is {weight.dtype}"
    if weight.is_meta or hasattr(weight, "ds_id") or type(weight).__name__ == "DTensor":
        return "its weight is not all here (meta, partitioned by DeepSpeed ZeRO-3, or a sharded DTensor)"
    return _hooked(module)


def unread_unfit(module: nn.Module) -> str | None:
    """Why `module` computes its output even where nothing reads it (no stand-in for its kind or state), or None."""
    lora = _lora_linear_class()
    if lora is None or not isinstance(module, lora):
        return _base_unfit(module)
    if reason := _hooked(module):
        return reason
    if module.disable_adapters or module.merged:
        return "its adapters are disabled or merged"
    if getattr(module, "lora_variant", None) or any(getattr(module, "use_dora", {}).values()):
        return "a LoRA variant (DoRA) computes from the base output"
    reason = _base_unfit(module.base_layer)
    return f"its base layer: {reason}" if reason else None


def unread(module: nn.Module, x: Tensor) -> Tensor:
    """`module(x)` as the backward needs it where nothing reads the output (`unread_unfit(module)` is None): NaN,
    the base GEMM's backward recorded without the GEMM; a LoRA Linear's adapters computed as peft computes them."""
    lora = _lora_linear_class()
    if lora is None or not isinstance(module, lora):
        return _unread_base(module, x, module)
    result = _unread_base(module.base_layer, x, module)
    dtype = result.dtype
    cast = getattr(module, "_cast_input_dtype", lambda t, to: t.to(to))  # peft's since 0.14
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        x = cast(x, lora_a.weight.dtype)
        result = result + lora_b(lora_a(module.lora_dropout[name](x))) * module.scaling[name]
    return result.to(dtype)


class LastProjection:
    """Calls one MLP site's down projection; in a re-entrant recomputation (or a chunked MLP's backward) where the
    family's MLP output only joins the residual sum, through `unread` (module docstring)."""

    def __init__(self, output_kept: bool):
        self.output_kept = output_kept
        self.after_forward_without_grad = False  # the site's last forward ran without autograd (re-entrant's first)

    def __call__(self, projection: nn.Module, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and in_backward()):
            self.after_forward_without_grad = not torch.is_grad_enabled()
        elif self.after_forward_without_grad and not self.output_kept and unread_unfit(projection) is None:
            return unread(projection, x)
        return projection(x)
