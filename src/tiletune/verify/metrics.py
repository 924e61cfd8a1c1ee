"""Error metrics and verdicts (the precision policy of docs/design.md).

Both the stock and the patched run are measured against a high-precision reference. A tensor passes
when it is finite and the patched error is at most `k` times the stock error, or under a floor of
the dtype's machine epsilon (for tensors the stock run happens to reproduce exactly). Errors are
relative L2 errors, so near-zero references do not inflate them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-8}


@dataclass
class Errors:
    """How far `actual` is from `reference`."""

    max_abs: float
    rel_l2: float
    cosine: float
    nonfinite: int

    def to_dict(self) -> dict:
        return asdict(self)


def errors(actual: torch.Tensor, reference: torch.Tensor) -> Errors:
    """max abs error, relative L2 error, cosine similarity and the count of NaN/Inf values in `actual`."""
    a, r = actual.double().flatten(), reference.double().flatten()
    nonfinite = int((~torch.isfinite(a)).sum())
    if nonfinite:
        return Errors(float("inf"), float("inf"), float("nan"), nonfinite)
    diff = a - r
    ref_norm, diff_norm = float(r.norm()), float(diff.norm())
    if ref_norm > 0:
        rel = diff_norm / ref_norm
    else:
        rel = 0.0 if diff_norm == 0 else float("inf")
    denominator = float(a.norm()) * ref_norm
    cosine = float(a @ r) / denominator if denominator > 0 else float(torch.equal(a, r))
    return Errors(float(diff.abs().max()) if diff.numel() else 0.0, rel, cosine, 0)


def floor_for(dtype: torch.dtype) -> float:
    """The error under which a tensor passes whatever the stock error: the dtype's epsilon, one rounding step
    (a float32 loss summed in another order differs from the stock one by about that much)."""
    return torch.finfo(dtype).eps


@dataclass
class Verdict:
    """One captured tensor: stock and patched errors against the reference, their ratio, pass/fail."""

    name: str
    stock: Errors
    patched: Errors
    ratio: float
    passed: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "stock": self.stock.to_dict(), "patched": self.patched.to_dict(),
                "ratio": self.ratio, "passed": self.passed}  # fmt: skip


def judge(name: str, stock: Errors, patched: Errors, k: float, floor: float) -> Verdict:
    """Pass when finite and patched.rel_l2 <= max(k * stock.rel_l2, floor)."""
    ratio = patched.rel_l2 / stock.rel_l2 if stock.rel_l2 > 0 else (0.0 if patched.rel_l2 == 0 else float("inf"))
    passed = patched.nonfinite == 0 and patched.rel_l2 <= max(k * stock.rel_l2, floor)
    return Verdict(name, stock, patched, ratio, passed)


def compare_runs(stock: dict, patched: dict, reference: dict, k: float, floor: float) -> list[Verdict]:
    """A verdict for every tensor the three runs captured, worst (highest ratio, failures first) first."""
    verdicts = []
    for name, ref in reference.items():
        if name in stock and name in patched:
            verdicts.append(judge(name, errors(stock[name], ref), errors(patched[name], ref), k, floor))
    missing = sorted(set(reference) ^ set(patched))
    for name in missing:  # a tensor one run has and the other lacks is a failure in itself
        nan = Errors(float("inf"), float("inf"), float("nan"), 0)
        verdicts.append(Verdict(name, nan, nan, float("inf"), False))
    return sorted(verdicts, key=lambda v: (v.passed, -v.ratio if v.ratio == v.ratio else 0.0))
