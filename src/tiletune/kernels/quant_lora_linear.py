"""QLoRA Linear: ``y = x · dequant(Wq)ᵀ (+ b) + s·(x Aᵀ) Bᵀ``, peft's LoRA Linear over a QuantLinear base, in one op.

Wq is a quantized frozen weight (quant_linear.py gives the format and its arguments), A, B and s are
lora_linear.py's. Backward: dX = dY · dequant(Wq) + g A with g = s·dY B, dA = gᵀ X, dB = s·dYᵀ (X Aᵀ).
Saved for the backward: x, xa = x Aᵀ, the packed weight and the adapters; the weight is dequantized again
there, so no bf16 copy of it outlives a call. Reference: the weight dequantized by PyTorch, then
lora_linear's reference; TileLang: the weight dequantized by quant_linear's kernel, then lora_linear's
GEMMs with the rank-r epilogue. Custom ops ``tiletune::quant_lora_linear`` / ``..._backward``; binding on
role ``quantized_lora_linear`` (a LoRA Linear whose base holds a quantized weight), taking over
quant_linear's site at the same path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tiletune.kernels import _tilelang, lora_linear, quant_linear
from tiletune.kernels.binding import Binding, Site, autocast, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.quant_linear import (
    WEIGHT_SCHEMA,
    reference_weight,
    tilelang_weight,
    weight_args,
)
from tiletune.kernels.registry import Impl, Op, add, define
from tiletune.quant import QuantizedWeight

WEIGHT_ARGS = 9  # the weight's arguments in WEIGHT_SCHEMA


def _split(rest: tuple) -> tuple[tuple, Tensor | None, Tensor, Tensor, float]:
    """(weight arguments, bias, A, B, s) from the forward's arguments after x."""
    return rest[:WEIGHT_ARGS], *rest[WEIGHT_ARGS:]


def tilelang_unsupported(x: Tensor, *rest) -> str | None:
    """Why the TileLang path cannot run these inputs, or None."""
    weight, _, lora_a, lora_b, _ = _split(rest)
    return quant_linear.tilelang_unsupported(x, *weight) or lora_linear.adapter_unsupported(x, lora_a, lora_b)


def _over_dequantized(dequantized: Callable, lora_forward: Callable, lora_backward: Callable) -> tuple[Callable, Callable]:
    """(forward, backward) of this op: the weight dequantized by `dequantized`, then lora_linear's pair; the
    backward dequantizes again (nothing of the weight was kept)."""

    def forward(x: Tensor, *rest) -> tuple[Tensor, Tensor]:
        weight, bias, lora_a, lora_b, scaling = _split(rest)
        return lora_forward(x, dequantized(*weight, dtype=x.dtype), bias, lora_a, lora_b, scaling)

    def backward(dy: Tensor, x: Tensor, xa: Tensor, *rest) -> tuple[Tensor, Tensor, Tensor]:
        weight, (lora_a, lora_b, scaling) = rest[:WEIGHT_ARGS], rest[WEIGHT_ARGS:]
        return lora_backward(dy, x, xa, dequantized(*weight, dtype=dy.dtype), lora_a, lora_b, scaling)

    return forward, backward


# PyTorch: dequantize, then peft's arithmetic; TileLang: the dequantizing kernel, then the GEMM with the epilogue
reference_forward, reference_backward = _over_dequantized(reference_weight, lora_linear.reference_forward,
                                                          lora_linear.reference_backward)
tilelang_forward, tilelang_backward = _over_dequantized(tilelang_weight, lora_linear.tilelang_forward,
                                                        lora_linear.tilelang_backward)


quant_lora_linear_op = make_custom_op(Signature(
    "quant_lora_linear", f"Tensor x, {WEIGHT_SCHEMA}, Tensor? bias, Tensor lora_a, Tensor lora_b, float scaling",
    "(Tensor, Tensor)",
    backward_inputs=f"Tensor x, Tensor xa, {WEIGHT_SCHEMA}, Tensor lora_a, Tensor lora_b, float scaling",
    backward_outputs="(Tensor, Tensor, Tensor)",
    fake=lambda x, *rest: (x.new_empty(*x.shape[:-1], rest[WEIGHT_ARGS - 2]),
                           x.new_empty(*x.shape[:-1], rest[WEIGHT_ARGS + 1].shape[0])),
    backward_fake=lambda dy, x, xa, *rest: (torch.empty_like(x, memory_format=torch.contiguous_format),
                                            torch.empty_like(rest[WEIGHT_ARGS]), torch.empty_like(rest[WEIGHT_ARGS + 1])),
    # x, xa, the packed weight and the adapters: no dequantized weight, no bias
    save=lambda inputs, outputs, needs: (inputs[0], outputs[1], *inputs[1 : 1 + WEIGHT_ARGS], *inputs[2 + WEIGHT_ARGS :]),
    judged_on=lambda grads, saved: (saved[0], *saved[2 : 2 + WEIGHT_ARGS], None, *saved[2 + WEIGHT_ARGS :]),
    grad_of=(0, *(None,) * WEIGHT_ARGS, None, 1, 2, None),
))


def quant_lora_linear(x: Tensor, q: QuantizedWeight, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                      scaling: float, impl: str = "reference", strict: bool = False) -> Tensor:
    """x · dequant(q)ᵀ (+ b) + scaling·(x Aᵀ) Bᵀ through the custom op with implementation `impl`."""
    return torch.ops.tiletune.quant_lora_linear(x, *weight_args(q), bias, lora_a, lora_b, scaling, impl, strict)[0]


def _run(module: nn.Module, x: Tensor, adapter: str, impl: str, strict: bool) -> Tensor:
    base = module.base_layer
    x, bias = autocast(x, base.bias)
    return quant_lora_linear(x, base.quantized, bias, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                             module.scaling[adapter], impl, strict)


def _compile_key(site: Site) -> tuple:
    module = site.module
    return (*quant_linear.weight_key(module.base_layer), module.lora_A[lora_linear.active_adapter(module)].out_features)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    *weight_key, rank = key
    out_features, in_features = weight_key[-2:]
    return quant_lora_linear(warm_tensor(1, in_features, dtype=dtype), quant_linear.warm_weight(tuple(weight_key), dtype),
                             None, warm_tensor(rank, in_features, dtype=dtype), warm_tensor(out_features, rank, dtype=dtype),
                             2.0, impl, True)


def _forward(site: Site, impl: str, strict: bool, current: Callable) -> Callable:
    return quant_linear.tag_impl(lora_linear.lora_forward(_run)(site, impl, strict, current), impl, strict)


define(Op("quant_lora_linear", (Binding("quant_lora_linear", "quantized_lora_linear", _forward,
                                        unfit_now=lora_linear.unfit_now, compile_key=_compile_key, warm=_warm,
                                        supersedes=("quant_linear",)),),
          keeps_output=True, profile_pattern=r"dequantize_|lora_linear_(fwd|dgrad)"))
add(Impl("quant_lora_linear", "reference", reference_forward, reference_backward, accumulation="float32",
         description="PyTorch: the weight dequantized, then F.linear + peft's lora_B(lora_A(x)) * scaling"))
add(Impl("quant_lora_linear", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang: the weight dequantized in one pass, then the GEMM with a rank-r epilogue "
         "(fwd, dX); dA, dB by torch matmuls", accumulation="float32"))
