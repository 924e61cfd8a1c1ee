"""The kernel library: one module per op (reference + TileLang forward/backward + custom op).

`register(op, name)` lets a plugin add its own implementation of an op.
"""

from tiletune.kernels.registry import OPS, register

__all__ = ["OPS", "register"]
