"""GeGLU as in the Gemma MLP: ``gelu_tanh(gate) * up`` (transformers' `gelu_pytorch_tanh`).

gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g³))), c = sqrt(2 / pi); its derivative
0.5 (1 + t) + 0.5 g (1 - t²) c (1 + 3 · 0.044715 g²) with t the tanh. Everything else (reference, TileLang
kernels, custom ops ``tiletune::geglu``, the binding on Gemma's MLP) is swiglu.py's `define_gated`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tiletune.kernels.swiglu import Activation, define_gated

_C = math.sqrt(2 / math.pi)
_K = 0.044715


def _gelu_tanh(g: Tensor) -> Tensor:
    return F.gelu(g, approximate="tanh")


def _gelu_tanh_grad(g: Tensor) -> Tensor:
    t = torch.tanh(_C * (g + _K * g**3))
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _C * (1 + 3 * _K * g * g)


def _tl_gelu_tanh(g):
    import tilelang.language as T

    return 0.5 * g * (1.0 + T.tanh(_C * (g + _K * g * g * g)))


def _tl_gelu_tanh_grad(g):
    import tilelang.language as T

    t = T.tanh(_C * (g + _K * g * g * g))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * g * g)


GELU_TANH = Activation("gelu_tanh", _gelu_tanh, _gelu_tanh_grad, _tl_gelu_tanh, _tl_gelu_tanh_grad,
                       ("GELUTanh", "PytorchGELUTanh"))

# In `kernels: all`: its TileLang kernels passed their GPU tests on the H200 (tests/kernels/test_swiglu.py -m gpu,
# benchmarks/results/h200-2026-12-04/qlora/levers-a29b657/gpu_tests_families_levers.txt).
geglu = define_gated(GELU_TANH)
