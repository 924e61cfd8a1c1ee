"""Quantised base weights (QLoRA): NF4 and FP4 as bitsandbytes stores them, and int8 per output row.

Pure PyTorch, on any device; bitsandbytes is not needed at run time. `dequantize` is the reference that
the dequantising GEMM, the model loader and export are judged against.

The 4-bit format (bit-compatible with bitsandbytes' `quantize_4bit`, so its checkpoints load as they are):

- The weight (out, in) is flattened row-major and cut into blocks of `blocksize` consecutive elements
  (a power of two, so blocks start on byte boundaries; bitsandbytes takes 32..4096; blocks may cross
  rows). Each block keeps its absmax, max |w| over the block, in float32 (0 for a block of zeros, whose
  codes are then those of 0.0).
- Each element keeps the 4-bit index ("code") of the table value (NF4_CODE or FP4_CODE) nearest to
  x = w * (1 / absmax), the reciprocal taken in float32 as bitsandbytes does. NF4: x is compared with the
  float32 midpoints of NF4_CODE, `x > midpoint` taking the upper value, which is exactly bitsandbytes'
  quantize_nf4 decision tree (its constants are those midpoints), so a tie takes the lower value. FP4:
  sign and magnitude, as bitsandbytes' fp4 tree: code bit 3 is x < 0 (zero and tiny positive values get
  code 0, tiny negative ones code 8), the magnitude is the nearest of the 8, a tie taking the smaller.
  Measured against bitsandbytes 0.50.2 on 16.8M normal weights: NF4 codes equal on CUDA for bf16/fp16
  (2 differ for float32: its CUDA build's approximate reciprocal) and on CPU; FP4 codes differ at
  ties only (0.08% of bf16 weights on CUDA, whose fp4 tree's constants sit a few ulps off the midpoints;
  on CPU, ties of negative values and the sign of zero), each time a neighbouring code as near as ours.
- Two codes per byte, the first element in the high nibble: data[i] = code[2i] << 4 | code[2i + 1].
- Dequantised: table[code] * absmax in float32, rounded once to `dtype`; equal to bitsandbytes'
  dequantize_4bit on CUDA and CPU (up to the sign of zero).
- Double quantisation (QLoRA's, `nested`): the absmax vector, less its mean `offset`, is quantised again
  blockwise (blocks of 256 absmax values, the last may be partial) with bitsandbytes' signed 8-bit
  "dynamic" table: a float32 scale per block and a uint8 code per absmax (nearest table value to
  (absmax - offset) * (1 / scale), ties to the lower code). absmax = code[u8] * scale + offset, in float32.
  NF4 with double quantisation takes 4 + 8/64 + 32/(64*256) = 4.127 bits per weight.

int8: symmetric per output row: absmax = max |w| over the row (float32), data = round(w * (127 / absmax))
(half to even) clamped to [-127, 127]; dequantised data * (absmax / 127) in float32, rounded to `dtype`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor

# The NormalFloat4 table of QLoRA (Dettmers et al. 2023, appendix E): quantiles of N(0, 1) scaled to
# [-1, 1], with an exact zero; the 4-bit code is the index.
NF4_CODE = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)  # fmt: skip


def _fp4_code() -> Tensor:
    # bitsandbytes' fp4: bit 3 the sign, bits 2..0 an e2m1 pattern with its own exponent order
    # (0b000 = 0, 0b001 = 0.0625, 0b010 = 8, 0b011 = 12, 0b100 = 4, 0b101 = 6, 0b110 = 2, 0b111 = 3),
    # divided by 12 in float32 so that code 3 is 1.0. Code 8 is -0.0, as in bitsandbytes' kernels.
    magnitude = torch.tensor([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0]) / 12
    return torch.cat([magnitude, -magnitude])


FP4_CODE = _fp4_code()

KINDS = ("nf4", "fp4", "int8")
NESTED_BLOCKSIZE = 256
_SMALLEST_SCALE = 1e-38  # a zero absmax is divided as this (bitsandbytes' CPU path): the codes are those of 0.0


def _midpoints(sorted_values: Tensor) -> Tensor:
    return (sorted_values[:-1] + sorted_values[1:]) / 2


_NF4_MIDPOINTS = _midpoints(NF4_CODE)
_FP4_MAGNITUDE, _FP4_PATTERN = FP4_CODE[:8].sort()  # the 8 magnitudes ascending, and their 3-bit patterns
_FP4_MIDPOINTS = _midpoints(_FP4_MAGNITUDE)


def dynamic_code() -> Tensor:
    """bitsandbytes' signed 8-bit "dynamic" table (`create_dynamic_map(signed=True)`), ascending.

    For i in 0..6 the 2**i midpoints of 2**i + 1 points evenly spaced over [0.1, 1] (float32), times
    10**(i - 6), both signs; then 0 and 1. 127 negative values, 0 at index 127, 1.0 at index 255.
    """
    values = []
    for i in range(7):
        points = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = _midpoints(points) * 10.0 ** (i - 6)
        values += [means, -means]
    values.append(torch.tensor([0.0, 1.0]))
    return torch.cat(values).sort().values


@dataclass
class NestedScales:
    """Double quantisation as QLoRA/bitsandbytes does it: absmax - offset quantised with an 8-bit code
    table per block of 256 absmax values."""

    code: Tensor  # 256 float32 values: dynamic_code(), or the checkpoint's nested_quant_map
    absmax: Tensor  # float32 scale per block of `blocksize` absmax values (the last block may be partial)
    offset: float  # the mean of the absmax values, subtracted before quantising
    blocksize: int = NESTED_BLOCKSIZE


@dataclass
class QuantizedWeight:
    """A quantised (out_features, in_features) weight; the module docstring gives the format."""

    kind: str  # "nf4", "fp4" or "int8"
    shape: tuple[int, int]  # (out_features, in_features) of the original weight
    data: Tensor  # nf4/fp4: uint8, numel // 2 bytes, first element in the high nibble; int8: int8 (out, in)
    absmax: Tensor  # nf4/fp4: float32 per block, or uint8 codes when `nested`; int8: float32 per row
    blocksize: int = 64  # int8: in_features (one scale per row)
    nested: NestedScales | None = None
    dtype: torch.dtype = torch.bfloat16  # what dequantize() returns

    def nbytes(self) -> int:
        """Bytes held: data, absmax and the nested scales with their code table."""
        tensors = [self.data, self.absmax]
        if self.nested is not None:
            tensors += [self.nested.code, self.nested.absmax]
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(
    weight: Tensor, kind: str = "nf4", *, blocksize: int = 64, double: bool = True, dtype=None
) -> QuantizedWeight:
    """Quantise a 2-D weight to `kind`; `dtype` (default the weight's) is what dequantize() returns.

    nf4/fp4: blockwise absmax over `blocksize` elements (a power of two), doubly quantised scales when
    `double`. int8: one scale per row; `blocksize` and `double` do not apply. Computed in float32.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown quantisation kind {kind!r}; expected one of {KINDS}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"quantize takes a 2-D floating-point weight, got {weight.dtype} of shape {tuple(weight.shape)}"
        )
    shape = (weight.shape[0], weight.shape[1])
    dtype = dtype or weight.dtype
    w = weight.detach().float()
    if kind == "int8":
        absmax = w.abs().amax(dim=1)
        scale = torch.where(absmax > 0, 127 / absmax, 0.0)
        data = torch.round(w * scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(kind, shape, data, absmax, blocksize=shape[1], dtype=dtype)

    if blocksize < 2 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize must be a power of two >= 2, got {blocksize}")
    if w.numel() % blocksize:
        raise ValueError(
            f"cannot quantise a weight of shape {shape} to {kind}: its {w.numel()} elements are not "
            f"divisible by 2 and by blocksize {blocksize}"
        )
    blocks = w.reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=_SMALLEST_SCALE))[:, None]).reshape(-1)
    codes = _nearest_4bit(scaled, kind)
    data = codes[0::2] << 4 | codes[1::2]
    nested = None
    if double:
        absmax, nested = _nest(absmax)
    return QuantizedWeight(kind, shape, data, absmax, blocksize, nested, dtype)


def _nearest_4bit(x: Tensor, kind: str) -> Tensor:
    """The uint8 code of the table value nearest to each x in [-1, 1] (ties as the module doc says)."""
    if kind == "nf4":
        return torch.bucketize(x, _NF4_MIDPOINTS.to(x.device)).to(torch.uint8)
    pattern = _FP4_PATTERN.to(x.device)[torch.bucketize(x.abs(), _FP4_MIDPOINTS.to(x.device))]
    return (pattern | (x < 0).long() << 3).to(torch.uint8)


def _nest(absmax: Tensor) -> tuple[Tensor, NestedScales]:
    """Double quantisation of a float32 absmax vector: its uint8 codes and the NestedScales."""
    offset = absmax.mean()
    centred = absmax - offset
    padding = -centred.numel() % NESTED_BLOCKSIZE  # zeros change no block's max |x|
    blocks = torch.nn.functional.pad(centred, (0, padding)).reshape(-1, NESTED_BLOCKSIZE)
    scale = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / scale.clamp(min=_SMALLEST_SCALE))[:, None]).reshape(-1)[: centred.numel()]
    code = dynamic_code().to(absmax.device)
    codes = torch.bucketize(scaled, _midpoints(code)).to(torch.uint8)
    return codes, NestedScales(code, scale, offset.item())


def dequantize(q: QuantizedWeight) -> Tensor:
    """The (out, in) weight in q.dtype: the reference every kernel and loader is judged against."""
    return dequantize_rows(q, 0, q.shape[0])


def dequantize_rows(q: QuantizedWeight, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of dequantize(q), equal to dequantize(q)[start:stop], decoding only those rows."""
    rows, cols = q.shape
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) are not within the {rows} rows of a weight of shape {q.shape}")
    if q.kind == "int8":
        scale = q.absmax[start:stop] / 127
        return (q.data[start:stop].float() * scale[:, None]).to(q.dtype)
    first, end = start * cols, stop * cols  # the elements wanted, and the whole blocks holding them
    first_block, end_block = first // q.blocksize, -(-end // q.blocksize)
    half = q.blocksize // 2
    packed = q.data[first_block * half : end_block * half]
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1, q.blocksize).long()
    values = _table(q.kind).to(packed.device)[codes] * _block_scales(q, first_block, end_block)[:, None]
    offset = first_block * q.blocksize
    return values.reshape(-1)[first - offset : end - offset].reshape(stop - start, cols).to(q.dtype)


def _table(kind: str) -> Tensor:
    return NF4_CODE if kind == "nf4" else FP4_CODE


def _block_scales(q: QuantizedWeight, first: int, end: int) -> Tensor:
    """The float32 absmax of 4-bit blocks [first, end), dequantising the nested scales if any."""
    if q.nested is None:
        return q.absmax[first:end].float()
    n = q.nested
    which = torch.arange(first, end, device=q.absmax.device) // n.blocksize
    return n.code[q.absmax[first:end].long()] * n.absmax[which] + n.offset


_BNB_KEYS = {"absmax", "quant_map", "nested_absmax", "nested_quant_map"}


def from_bnb(weight_data: Tensor, quant_state_dict: dict[str, Tensor], shape=None, dtype=None) -> QuantizedWeight:
    """A QuantizedWeight from a transformers/bitsandbytes 4-bit checkpoint's tensors, without requantising.

    `weight_data` is the packed `weight` (uint8, or another quant_storage dtype viewed as bytes);
    `quant_state_dict` holds its `absmax`, `quant_map`, optionally `nested_absmax` and `nested_quant_map`,
    and `quant_state.bitsandbytes__nf4` (or `__fp4`): JSON in uint8 with quant_type, blocksize, dtype,
    shape and the nested blocksize and offset. Keys may keep a prefix ("model.layers.0....weight.absmax").
    `shape` and `dtype` default to the JSON's; a `shape` that disagrees with it is an error.
    """
    tensors, packed = {}, None
    for key, value in quant_state_dict.items():
        if "quant_state.bitsandbytes__" in key:
            packed = json.loads(value.cpu().numpy().tobytes().decode("utf-8"))
        elif key.rsplit(".", 1)[-1] in _BNB_KEYS:
            tensors[key.rsplit(".", 1)[-1]] = value
        else:
            raise ValueError(f"unexpected key {key!r} in a bitsandbytes 4-bit quant state")
    if packed is None or "absmax" not in tensors:
        raise ValueError(f"not a bitsandbytes 4-bit quant state: keys {sorted(quant_state_dict)}")
    kind = packed["quant_type"]
    if kind not in ("nf4", "fp4"):
        raise ValueError(f"unsupported bitsandbytes quant_type {kind!r}")
    saved_shape = tuple(packed.get("shape") or ())
    shape = tuple(shape) if shape is not None else saved_shape
    if len(shape) != 2 or (saved_shape and saved_shape != shape):
        raise ValueError(f"weight shape {shape} does not match the quant state's {saved_shape}")
    quant_map = tensors.get("quant_map")
    if quant_map is not None and not torch.allclose(quant_map.float().cpu(), _table(kind), atol=1e-6):
        raise ValueError(f"the checkpoint's quant_map is not bitsandbytes' {kind} table")
    data = weight_data.contiguous().view(torch.uint8).reshape(-1)
    if data.numel() * 2 != math.prod(shape):
        raise ValueError(f"{data.numel()} packed bytes cannot hold a weight of shape {shape}")
    nested = None
    if "nested_absmax" in tensors:
        nested = NestedScales(
            code=tensors["nested_quant_map"].float(),
            absmax=tensors["nested_absmax"].float(),
            offset=float(packed["nested_offset"]),
            blocksize=int(packed["nested_blocksize"]),
        )
    dtype = dtype or getattr(torch, packed["dtype"])
    return QuantizedWeight(kind, shape, data, tensors["absmax"], int(packed["blocksize"]), nested, dtype)


def to_bnb(q: QuantizedWeight, prefix: str = "") -> dict[str, Tensor]:
    """The tensors transformers saves for a bitsandbytes 4-bit weight (`from_bnb`'s input), keys under `prefix`
    (e.g. "model.layers.0.mlp.up_proj.weight"): the packed bytes as `prefix` itself, then its quant state."""
    if q.kind not in ("nf4", "fp4"):
        raise ValueError(f"bitsandbytes 4-bit checkpoints hold nf4 or fp4 weights, not {q.kind}")
    meta = {"quant_type": q.kind, "blocksize": q.blocksize, "dtype": str(q.dtype).removeprefix("torch."),
            "shape": list(q.shape)}
    state = {"absmax": q.absmax, "quant_map": _table(q.kind).clone()}
    if q.nested is not None:
        state |= {"nested_absmax": q.nested.absmax, "nested_quant_map": q.nested.code}
        meta |= {"nested_blocksize": q.nested.blocksize, "nested_dtype": "float32", "nested_offset": q.nested.offset}
    state[f"quant_state.bitsandbytes__{q.kind}"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return {prefix: q.data.reshape(-1, 1), **{f"{prefix}.{key}": value for key, value in state.items()}}
