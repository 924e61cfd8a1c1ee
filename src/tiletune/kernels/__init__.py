"""The kernel library: one module per op (PyTorch reference, TileLang forward/backward, custom op, bindings).

`register(op, name)` lets a plugin add its own implementation of an op; `registry.define` a new op.
"""

from tiletune.kernels.registry import register

__all__ = ["register"]
