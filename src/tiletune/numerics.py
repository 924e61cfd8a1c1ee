"""Numerics: how far a result is from a high-precision reference, and the one precision policy every
check applies (the kernel tests and `tiletune verify`).

Both the result under test (a kernel, the patched run) and the bar (PyTorch's own implementation, the
stock run, in the same dtype) are measured against a reference in higher precision. A tensor passes when
it is finite and either its relative L2 error is at most `k` (2) times the bar's, or no element is more
than FLOOR_ULPS units in the last place from the reference. The ulp floor scales with each value's
magnitude; it is for tensors the bar happens to reproduce exactly (a float32 loss summed in another
order is a rounding step or two off, while the stock error may be zero). A scalar (the loss) is one draw of
that rounding noise, so the bar's error says little about it: its floor is SCALAR_FLOOR_ULPS (a mean over
tokens summed in another order lands a few rounding steps away).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

FLOOR_ULPS = 2.0
SCALAR_FLOOR_ULPS = 2 * FLOOR_ULPS
# relative L2 error allowed per dtype against a golden file (x5 between loss curves) unless told otherwise
DTYPE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-8}


def ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of `dtype`'s numbers at each value of `x`, in float64: 2**(exponent - 1) * eps with
    torch.frexp's exponent; below the normal range, zero included, the subnormal spacing tiny * eps."""
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))
    lowest = math.frexp(info.tiny)[1]  # the smallest normal number's exponent: subnormals share its spacing
    exponent = torch.frexp(x).exponent.clamp_min(lowest)
    exponent = torch.where(x == 0, lowest, exponent)
    return torch.exp2((exponent - 1 - mantissa_bits).double())


@dataclass(frozen=True)
class Errors:
    """How far `actual` is from `reference`."""

    max_abs: float
    rel_l2: float
    cosine: float
    nonfinite: int  # NaN/Inf values in `actual`
    max_ulps: float  # the largest elementwise error, in ulps of the reference value

    @property
    def finite(self) -> bool:
        return self.nonfinite == 0

    def to_dict(self) -> dict:
        return asdict(self)


def errors(actual: Tensor, reference: Tensor, dtype: torch.dtype | None = None) -> Errors:
    """Max abs error, relative L2 error, cosine similarity, NaN/Inf count and max error in ulps of `dtype`
    (default: `actual`'s dtype) of `actual` against `reference`, computed in float64."""
    dtype = dtype or actual.dtype
    a, r = actual.detach().double().flatten(), reference.detach().double().flatten()
    nonfinite = int((~torch.isfinite(a)).sum())
    if nonfinite:
        return Errors(float("inf"), float("inf"), float("nan"), nonfinite, float("inf"))
    if not a.numel():
        return Errors(0.0, 0.0, 1.0, 0, 0.0)
    diff = (a - r).abs()
    ref_norm, diff_norm = float(r.norm()), float(diff.norm())
    if ref_norm > 0:
        rel = diff_norm / ref_norm
    else:
        rel = 0.0 if diff_norm == 0 else float("inf")
    denominator = float(a.norm()) * ref_norm
    cosine = float(a @ r) / denominator if denominator > 0 else float(torch.equal(a, r))
    return Errors(float(diff.max()), rel, cosine, 0, float((diff / ulp(r, dtype)).max()))


@dataclass
class Verdict:
    """One tensor: the bar's (stock) and the tested (patched) errors, their rel-L2 ratio, pass/fail."""

    name: str
    stock: Errors
    patched: Errors
    ratio: float
    passed: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "stock": self.stock.to_dict(), "patched": self.patched.to_dict(),
                "ratio": self.ratio, "passed": self.passed}  # fmt: skip


def judge(name: str, stock: Errors, patched: Errors, k: float = 2.0, floor_ulps: float = FLOOR_ULPS) -> Verdict:
    """Pass when patched is finite and patched.rel_l2 <= k * stock.rel_l2 or patched.max_ulps <= floor_ulps."""
    ratio = patched.rel_l2 / stock.rel_l2 if stock.rel_l2 > 0 else (0.0 if patched.rel_l2 == 0 else float("inf"))
    passed = patched.finite and (patched.rel_l2 <= k * stock.rel_l2 or patched.max_ulps <= floor_ulps)
    return Verdict(name, stock, patched, ratio, passed)


def gate(kernel_out: Tensor, torch_out: Tensor, ref: Tensor, k: float = 2.0) -> Verdict:
    """Judge `kernel_out` against `ref`, with PyTorch's `torch_out` in the same dtype as the bar (kernel tests)."""
    return judge("", errors(torch_out, ref), errors(kernel_out, ref), k)


def compare_runs(stock: dict, patched: dict, reference: dict, dtype: torch.dtype, k: float = 2.0,
                 floor_ulps: float = FLOOR_ULPS) -> list[Verdict]:  # fmt: skip
    """A verdict for every tensor the three runs captured, ulps counted in the runs' `dtype` (scalars against
    SCALAR_FLOOR_ULPS at least); worst (failures, then highest ratio) first."""
    verdicts = []
    for name, ref in reference.items():
        if name in stock and name in patched:
            floor = max(floor_ulps, SCALAR_FLOOR_ULPS) if ref.numel() == 1 else floor_ulps
            verdicts.append(judge(name, errors(stock[name], ref, dtype), errors(patched[name], ref, dtype), k, floor))
    for name in sorted(set(reference) ^ set(patched)):  # a tensor one run has and the other lacks is a failure in itself
        missing = Errors(float("inf"), float("inf"), float("nan"), 0, float("inf"))
        verdicts.append(Verdict(name, missing, missing, float("inf"), False))
    return sorted(verdicts, key=lambda v: (v.passed, -v.ratio if v.ratio == v.ratio else 0.0))
