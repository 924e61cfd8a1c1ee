"""The numerical gate the kernel tests and benchmarks apply (design.md, precision policy).

A kernel passes when, against a float64 reference, its relative L2 error is at most twice that of
PyTorch's own implementation in the same dtype (plus a small floor for near-exact cases), and
nothing is NaN or Inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FACTOR = 2.0
FLOOR = 1e-6  # relative L2 error anything may have, for references PyTorch reproduces exactly


@dataclass(frozen=True)
class Errors:
    """Errors of one tensor against the high-precision reference."""

    max_abs: float
    rel_l2: float
    cosine: float
    finite: bool


def errors(out: Tensor, ref: Tensor) -> Errors:
    """Max abs error, relative L2 error and cosine similarity of `out` against `ref`, in float64."""
    out64, ref64 = out.detach().double().flatten(), ref.detach().double().flatten()
    finite = bool(torch.isfinite(out64).all())
    if not finite:
        return Errors(float("inf"), float("inf"), float("nan"), False)
    diff = out64 - ref64
    ref_norm = ref64.norm().item()
    rel = diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()
    cos = torch.nn.functional.cosine_similarity(out64, ref64, dim=0, eps=1e-30).item() if out64.numel() else 1.0
    return Errors(diff.abs().max().item() if diff.numel() else 0.0, rel, cos, True)


@dataclass(frozen=True)
class Verdict:
    """Outcome of the gate for one tensor."""

    kernel: Errors
    torch: Errors
    passed: bool

    @property
    def ratio(self) -> float:
        return self.kernel.rel_l2 / max(self.torch.rel_l2, FLOOR)


def gate(kernel_out: Tensor, torch_out: Tensor, ref: Tensor) -> Verdict:
    """Judge `kernel_out` against `ref`, with PyTorch's `torch_out` in the same dtype as the bar."""
    k, t = errors(kernel_out, ref), errors(torch_out, ref)
    return Verdict(k, t, k.finite and k.rel_l2 <= FACTOR * t.rel_l2 + FLOOR)
