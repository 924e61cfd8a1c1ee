"""Linear with a quantized frozen weight (QLoRA's base layers): ``y = x · dequant(Wq)ᵀ (+ b)``, dX = dY · dequant(Wq).

Wq is stored as tiletune.quant formats it: 4-bit NF4 / FP4 codes in blocks of 64 with an absmax per block
(itself 8-bit quantized under double quantization), or int8 per output row. The weight is frozen: no dW,
and no activation is kept for one; only the packed weight is saved for the backward, which dequantizes it
again. Reference (PyTorch: dequantize the whole weight, then one matmul, the dequantized weight dropped
right after, forward and backward alike), the TileLang path (a dequantizing kernel that decodes codes,
nested scales and the code table in one pass into a transient weight, bit-exact with the reference's
dequantization, then the platform's GEMM), the custom ops ``tiletune::quant_linear`` /
``tiletune::quant_linear_backward``, the `QuantLinear` module a quantized model holds in place of each
nn.Linear, and its binding (role ``quantized_linear``).

Why dequantize-then-GEMM and not the dequantization fused into the GEMM's main loop: at training shapes
(8192 tokens) the fused form measured 3x slower than cuBLAS on the H200 (decoding every weight tile once
per row block of the output, in the warps that feed wgmma), while the separate pass costs one read of the
packed weight and one write of the bf16 weight: 0.087 ms for a 14336 x 4096 weight, bitsandbytes' CUDA
kernel 0.076 ms, 3% of that layer's forward + backward (benchmarks/results/h200-2026-12-04/qlora).
"""

# No `from __future__ import annotations` here: TileLang reads the kernel signature's shapes from the closure.

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site, autocast, warm_tensor
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define
from tiletune.quant import (
    FP4_CODE,
    NF4_CODE,
    NestedScales,
    QuantizedWeight,
    dequantize,
    quantize,
)

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


def reference_weight(*weight, dtype: torch.dtype) -> Tensor:
    """The dequantized (out, in) weight in `dtype` (tiletune.quant.dequantize)."""
    return dequantize(weight_of(*weight, dtype=dtype))


def reference_forward(x: Tensor, *weight_and_bias) -> Tensor:
    """x · dequant(W)ᵀ (+ b): the whole weight dequantized to x's dtype, then one matmul (as peft + bitsandbytes)."""
    *weight, bias = weight_and_bias
    return F.linear(x, reference_weight(*weight, dtype=x.dtype), bias)


def reference_backward(dy: Tensor, *weight) -> Tensor:
    """dX = dY · dequant(W), the weight dequantized again (nothing was kept from the forward)."""
    return dy @ reference_weight(*weight, dtype=dy.dtype)


# ---- TileLang ------------------------------------------------------------------------------------

DEQUANT_VECTOR, DEQUANT_THREADS = 16, 256  # elements each thread writes (two 16-byte stores of bf16), threads per block


def dequantize_kernel(kind: str, out_features: int, in_features: int, blocksize: int, nested: bool, dtype: str):
    """PrimFunc writing the (out, in) weight in `dtype`, flattened, from its packed form; everything static.

    Each thread decodes DEQUANT_VECTOR consecutive elements, which share one scale (a 4-bit block holds a
    multiple of 16 elements; an int8 row too, tilelang_unsupported checks it): one vector load of their
    bytes (two 4-bit codes a byte, the first in the high nibble), one scale, one vector store. Value =
    table[code] · scale (4-bit) or code · scale (int8) in float32, rounded once, as tiletune.quant.dequantize
    computes it. A 4-bit scale is the block's absmax, decoded from its nested 8-bit code
    (code_table[u8] · nested_absmax[block // 256] + offset, the product rounded before the sum as PyTorch
    does it: no fused multiply-add) when `nested`; an int8 scale is absmax / 127 (`Scale`).
    """
    import tilelang.language as T

    fourbit = kind != "int8"
    elements = out_features * in_features
    per_scale = blocksize if fourbit else in_features  # consecutive elements sharing one scale
    per_byte = 2 if fourbit else 1
    data_dtype = "uint8" if fourbit else "int8"
    scale_dtype = "uint8" if nested else "float32"
    nested_blocks = -(-(elements // per_scale) // 256) if nested else 1
    vector, threads = DEQUANT_VECTOR, DEQUANT_THREADS

    @T.prim_func
    def dequantize_weight(Data: T.Tensor((elements // per_byte,), data_dtype),
                          Scale: T.Tensor((elements // per_scale,), scale_dtype), NestedCode: T.Tensor((256,), "float32"),
                          NestedAbsmax: T.Tensor((nested_blocks,), "float32"), offset: T.float32,
                          Table: T.Tensor((16,), "float32"), Out: T.Tensor((elements,), dtype)):
        with T.Kernel(T.ceildiv(elements, vector * threads), threads=threads) as bx:
            table = T.alloc_shared((16,), "float32")
            packed = T.alloc_local((vector // per_byte,), data_dtype)
            values = T.alloc_local((vector,), dtype)
            T.copy(Table, table)
            start = (bx * threads + T.get_thread_binding()) * vector
            if start < elements:
                group = start // per_scale
                if nested:
                    scale = T.call_extern("float32", "__fmul_rn", NestedCode[Scale[group]],
                                          NestedAbsmax[group // 256]) + offset
                else:
                    scale = Scale[group]
                for v in T.vectorized(vector // per_byte):
                    packed[v] = Data[start // per_byte + v]
                for v in T.unroll(vector):
                    if fourbit:
                        values[v] = T.cast(table[(packed[v // 2] >> (4 - 4 * (v % 2))) & T.uint8(15)] * scale, dtype)
                    else:
                        values[v] = T.cast(T.cast(packed[v], "float32") * scale, dtype)
                for v in T.vectorized(vector):
                    Out[start + v] = values[v]

    return dequantize_weight.with_attr("global_symbol", f"dequantize_{kind}")


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder of the dequantizing kernel at Llama-3-8B's gate_proj shape (NF4, nested)."""
    return {"dequantize_nf4": functools.partial(dequantize_kernel, "nf4", 14336, 4096, 64, True, "bfloat16")}


def tilelang_unsupported(x: Tensor, data: Tensor, absmax: Tensor, nested_code, nested_absmax, nested_offset,
                         kind: str, blocksize: int, out_features: int, in_features: int, *rest) -> str | None:
    """Why the TileLang path cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(x)
    if reason is None and data.device != x.device:
        reason = "the quantized weight is on another device than the input"
    if reason is None and (out_features % 8 or in_features % 8):
        reason = f"features ({out_features}, {in_features}) are not multiples of 8"
    if reason is None and kind != "int8" and (in_features % blocksize or blocksize % DEQUANT_VECTOR):
        reason = f"blocksize {blocksize} does not divide in_features {in_features} or is not a multiple of {DEQUANT_VECTOR}"
    if reason is None and kind == "int8" and in_features % DEQUANT_VECTOR:
        reason = f"in_features {in_features} is not a multiple of {DEQUANT_VECTOR} (an int8 row per vector of threads)"
    return reason


@functools.cache
def _constants(kind: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """The kind's code table, and zeros standing for the nested arguments of a kernel that does not read them,
    on `device` once (no host-to-device copy per call)."""
    table = {"nf4": NF4_CODE, "fp4": FP4_CODE}.get(kind, torch.zeros(16))
    return table.to(device), torch.zeros(256, device=device)


def tilelang_weight(data: Tensor, absmax: Tensor, nested_code, nested_absmax, nested_offset: float, kind: str,
                    blocksize: int, out_features: int, in_features: int, dtype: torch.dtype) -> Tensor:
    """The dequantized (out, in) weight in `dtype`, by the TileLang kernel: equal to reference_weight bit for bit."""
    nested = nested_code is not None
    name = _tilelang.DTYPES[dtype]
    kernel = _tilelang.compiled(("dequantize", kind, out_features, in_features, blocksize, nested, name),
                                lambda: dequantize_kernel(kind, out_features, in_features, blocksize, nested, name))
    table, no_nested = _constants(kind, data.device)
    out = torch.empty(out_features, in_features, device=data.device, dtype=dtype)
    kernel(data.view(-1), absmax / 127 if kind == "int8" else absmax, nested_code if nested else no_nested,
           nested_absmax if nested else no_nested[:1], float(nested_offset), table, out.view(-1))
    return out


def tilelang_forward(x: Tensor, *weight_and_bias) -> Tensor:
    """x · Wᵀ (+ b): W dequantized by the TileLang kernel, then the platform's GEMM (cuBLAS / hipBLASLt: the
    frozen Linear's own, faster than linear.py's TileLang GEMM at these shapes, benchmarks/results)."""
    *weight, bias = weight_and_bias
    return F.linear(x, tilelang_weight(*weight, dtype=x.dtype), bias)


def tilelang_backward(dy: Tensor, *weight) -> Tensor:
    """dX = dY · W: W dequantized again by the TileLang kernel, then the platform's GEMM."""
    return dy @ tilelang_weight(*weight, dtype=dy.dtype)


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
        self.quantization_error: float | None = None  # rel. L2 against the weight it was quantized from, if known

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


def tag_impl(forward: Callable, impl: str, strict: bool) -> Callable:
    """`forward` (a binding's) tagged with the implementation it runs its quantized base with: a recomputed layer's
    last projection, whose output nothing reads, runs only that base's backward with it (`unread_output`)."""
    forward.quantized_impl = (impl, strict)
    return forward


def _forward(site: Site, impl: str, strict: bool, current):
    def forward(self, x):
        return QuantLinear.forward(self, x, impl, strict)
    return tag_impl(forward, impl, strict)


def weight_key(module: QuantLinear) -> tuple:
    """The static dimensions of a QuantLinear's kernels: format and features."""
    return (module.kind, module.blocksize, module.nested_code is not None, module.out_features, module.in_features)


def warm_weight(key: tuple, dtype: torch.dtype) -> QuantizedWeight:
    """A random quantized weight on the GPU of the format and features `key` (weight_key) names."""
    kind, blocksize, nested, out_features, in_features = key
    return quantize(warm_tensor(out_features, in_features, dtype=dtype, grad=False), kind, blocksize=blocksize,
                    double=nested)


def _warm(key: tuple, impl: str, dtype: torch.dtype) -> Tensor:
    return quant_linear(warm_tensor(1, key[-1], dtype=dtype), warm_weight(key, dtype), None, impl, True)


define(Op("quant_linear", (Binding("quant_linear", "quantized_linear", _forward, compile_key=lambda site: weight_key(site.module), warm=_warm),),
          keeps_output=True, profile_pattern=r"dequantize_", lowering=lowering_kernels))
add(Impl("quant_linear", "reference", reference_forward, reference_backward, accumulation="float32",
         description="PyTorch: the whole weight dequantized, then F.linear (as peft + bitsandbytes)"))
add(Impl("quant_linear", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang: the weight dequantized in one pass (codes, nested scales), then the "
         "platform's GEMM (fwd, dX)", accumulation="float32"))
