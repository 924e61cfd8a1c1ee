"""`tiletune kernels warmup`: compile ahead of training every kernel a config's model needs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiletune.errors import UserError
from tiletune.kernels import registry
from tiletune.kernels.binding import Binding
from tiletune.kernels.registry import REFERENCE
from tiletune.patch import apply_kernels, parse_kernel_spec


def _run_once(binding: Binding, key: tuple, impl: str, dtype: torch.dtype) -> None:
    """Forward + backward of the binding's op on one token with these static dimensions: compiles its kernels."""
    binding.warm(key, impl, dtype).float().sum().backward()


def warmup_kernels(model: nn.Module, spec: Any, dtype: torch.dtype) -> list[str]:
    """Compile, on this machine's GPU, every kernel `spec` needs for `model` in `dtype`; return what was done.

    `model` may live on the meta device: only its structure is read. The compiled kernels land in the
    disk cache, so training starts without compiling.
    """
    from tiletune.kernels._tilelang import TESTED_DTYPES

    spec = parse_kernel_spec(spec)
    if dtype not in TESTED_DTYPES and any(sel.impl != REFERENCE for sel in spec.ops):
        raise UserError(f"kernels warmup: the TileLang kernels run in bfloat16 or float16; this config trains in "
                        f"{str(dtype).removeprefix('torch.')} (set bf16: true or fp16: true)")
    report = apply_kernels(model, spec)
    try:
        wanted = {}  # (op, impl, key) -> binding; ops with no compile key run on PyTorch: nothing to compile
        for entry, binding, site in report.bindings:
            if entry.installed and binding.compile_key is not None:
                wanted.setdefault((entry.op, entry.impl, binding.compile_key(site)), binding)
    finally:
        report.revert()
    done = []
    for (op, impl, key), binding in wanted.items():
        if impl == REFERENCE:
            continue
        reason = registry.get(op, impl).unavailable()
        if reason:
            raise UserError(f"kernels warmup: {op} implementation {impl!r} cannot run here: {reason}")
        _run_once(binding, key, impl, dtype)
        done.append(f"{op} {impl} {'x'.join(str(s) for s in key)} {str(dtype).removeprefix('torch.')}")
    return done


def record_kernels(model: nn.Module, spec: Any, dtype: torch.dtype) -> dict[tuple, Any]:
    """The TileLang kernels (key -> PrimFunc builder) `spec` needs for `model` in `dtype`: each op runs once on
    this machine's GPU as `warmup_kernels` does, and every kernel it asks for is noted (`tiletune kernels build`)."""
    from tiletune.kernels import _tilelang

    recorded = _tilelang.recording = {}
    try:
        warmup_kernels(model, spec, dtype)
    finally:
        _tilelang.recording = None
    return recorded
