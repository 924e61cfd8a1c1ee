"""Linear with a quantized frozen weight (QLoRA's base layers): ``y = x · dequant(Wq)ᵀ (+ b)``, dX = dY · dequant(Wq).

Wq is stored as tiletune.quant formats it: 4-bit NF4 / FP4 codes in blocks of 64 with an absmax per block
(itself 8-bit quantized under double quantization), or int8 per output row. The weight is frozen: no dW,
and no activation is kept for one. Reference (PyTorch: dequantize the whole weight, then one matmul, the
dequantized weight dropped right after, forward and backward alike), the custom ops
``tiletune::quant_linear`` / ``tiletune::quant_linear_backward``, the `QuantLinear` module a quantized model
holds in place of each nn.Linear, and its binding (role ``quantized_linear``). The TileLang GEMM with the
dequantization fused into its main loop is the next implementation of this op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiletune.kernels.binding import Binding, Site, autocast
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define
from tiletune.quant import NestedScales, QuantizedWeight, dequantize

# The weight as custom-op arguments: packed codes, scales, nested scales (or None) and the static format.
WEIGHT_SCHEMA = ("Tensor data, Tensor absmax, Tensor? nested_code, Tensor? nested_absmax, float nested_offset, "
                 "str kind, int blocksize, int out_features, int in_features")


def weight_args(q: QuantizedWeight) -> tuple:
    """A QuantizedWeight as the op's weight arguments (WEIGHT_SCHEMA)."""
    nested = q.nested
    return (q.data, q.absmax, nested.code if nested else None, nested.absmax if nested else None,
            nested.offset if nested else 0.0, q.kind, q.blocksize, *q.shape)


def weight_of(data, absmax, nested_code, nested_absmax, nested_offset, kind, blocksize, out_features, in_features,
              dtype: torch.dtype) -> QuantizedWeight:
    """The QuantizedWeight the op's weight arguments describe, dequantizing to `dtype`."""
    nested = None if nested_code is None else NestedScales(nested_code, nested_absmax, nested_offset)
    return QuantizedWeight(kind, (out_features, in_features), data, absmax, blocksize, nested, dtype)


# ---- reference -----------------------------------------------------------------------------------


def reference_forward(x: Tensor, *weight_and_bias) -> Tensor:
    """x · dequant(W)ᵀ (+ b): the whole weight dequantized to x's dtype, then one matmul (as peft + bitsandbytes)."""
    *weight, bias = weight_and_bias
    return F.linear(x, dequantize(weight_of(*weight, dtype=x.dtype)), bias)


def reference_backward(dy: Tensor, *weight) -> Tensor:
    """dX = dY · dequant(W), the weight dequantized again (nothing was kept from the forward)."""
    return dy @ dequantize(weight_of(*weight, dtype=dy.dtype))


# ---- custom ops and module -----------------------------------------------------------------------

quant_linear_op = make_custom_op(Signature(
    "quant_linear", f"Tensor x, {WEIGHT_SCHEMA}, Tensor? bias", "Tensor",
    backward_inputs=WEIGHT_SCHEMA, backward_outputs="Tensor",
    fake=lambda x, *weight_and_bias: x.new_empty(*x.shape[:-1], weight_and_bias[-3]),
    backward_fake=lambda dy, *weight: dy.new_empty(*dy.shape[:-1], weight[-1]),
    save=lambda inputs, outputs, needs: inputs[1:-1],  # the weight only: no dW, so no activation kept
    judged_on=lambda grads, saved: (grads[0], *saved, None),
    grad_of=(0,) + (None,) * 10,
))


def quant_linear(x: Tensor, q: QuantizedWeight, bias: Tensor | None = None, impl: str = "reference",
                 strict: bool = False) -> Tensor:
    """x · dequant(q)ᵀ (+ bias) through the custom op with implementation `impl` (falls back to the reference)."""
    return torch.ops.tiletune.quant_linear(x, *weight_args(q), bias, impl, strict)


class QuantLinear(nn.Linear):
    """An nn.Linear whose frozen weight is held quantized: `weight` is the packed codes (no gradient), the
    scales are buffers, so `.to(device)`, state dicts and peft's LoRA wrapping work as for a Linear."""

    def __init__(self, q: QuantizedWeight, bias: Tensor | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = q.shape
        self.kind, self.blocksize, self.compute_dtype = q.kind, q.blocksize, q.dtype
        self.weight = nn.Parameter(q.data, requires_grad=False)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("nested_code", q.nested.code if q.nested else None)
        self.register_buffer("nested_absmax", q.nested.absmax if q.nested else None)
        self.nested_offset = q.nested.offset if q.nested else 0.0
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def quantized(self) -> QuantizedWeight:
        """The weight, as the tensors now held (wherever the module was moved)."""
        return weight_of(self.weight, self.absmax, self.nested_code, self.nested_absmax, self.nested_offset, self.kind,
                         self.blocksize, self.out_features, self.in_features, dtype=self.compute_dtype)

    def forward(self, x: Tensor, impl: str = "reference", strict: bool = False) -> Tensor:
        x, bias = autocast(x, self.bias)
        return quant_linear(x, self.quantized, bias, impl, strict)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, blocksize={self.blocksize}"


# ---- binding -------------------------------------------------------------------------------------


def _forward(site: Site, impl: str, strict: bool, current):
    def forward(self, x):
        return QuantLinear.forward(self, x, impl, strict)
    return forward


# Opt-in until its TileLang kernel lands: the QuantLinear module's own forward already runs the reference.
define(Op("quant_linear", (Binding("quant_linear", "quantized_linear", _forward),), opt_in=True))
add(Impl("quant_linear", "reference", reference_forward, reference_backward, accumulation="float32",
         description="PyTorch: the whole weight dequantized, then F.linear (as peft + bitsandbytes)"))
