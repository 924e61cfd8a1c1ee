"""`tiletune kernels warmup`: compile ahead of training every kernel a config's model needs."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from tiletune.errors import UserError
from tiletune.kernels import _tilelang, registry
from tiletune.kernels.binding import Binding
from tiletune.kernels.registry import REFERENCE
from tiletune.patch import apply_kernels, parse_kernel_spec

log = logging.getLogger("tiletune.warmup")


def _run_once(binding: Binding, key: tuple, impl: str, dtype: torch.dtype) -> None:
    """Forward + backward of the binding's op on one token with these static dimensions: compiles its kernels."""
    binding.warm(key, impl, dtype).float().sum().backward()


def compile_ahead(model: nn.Module, spec: Any, dtype: torch.dtype) -> None:
    """Before a run on the GPU (train, verify, bench): the kernels `spec` needs, compiled side by side
    (`_tilelang.compile_jobs()`) rather than one by one at their first calls. Best effort: an op that cannot run here is left to its runtime
    fallback, and a warm-up that fails leaves its kernel to compile at its first call, with one warning line."""
    if torch.cuda.is_available():
        warmup_kernels(model, spec, dtype, strict=False)


def warmup_kernels(model: nn.Module, spec: Any, dtype: torch.dtype, jobs: int | None = None,
                   strict: bool = True) -> list[str]:  # fmt: skip
    """Compile, on this machine's GPU, every kernel `spec` needs for `model` in `dtype`; return what was done.

    `model` may live on the meta device: only its structure is read. Each (op, shape) runs once, `jobs` of them
    at a time in threads (`_tilelang.compile_jobs()` by default): their compilers run side by side. The kernels
    land in the disk cache, so training starts without compiling. Not `strict`: ops that cannot run here and
    warm-ups that fail are skipped (with a warning for the latter) instead of refused.
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
    runs = {}
    for (op, impl, key), binding in wanted.items():
        reason = None if impl == REFERENCE else registry.get(op, impl).unavailable()
        if reason and strict:
            raise UserError(f"kernels warmup: {op} implementation {impl!r} cannot run here: {reason}")
        if impl != REFERENCE and not reason:
            runs[(op, impl, key)] = binding

    def run(item) -> str | None:
        (op, impl, key), binding = item
        try:
            _run_once(binding, key, impl, dtype)
        except Exception as err:  # best effort when not strict: the kernel compiles at its first call
            if strict:
                raise
            log.warning("tiletune: warming up %s %s %s failed (%s); it compiles at its first call", op, impl, key, err)
            return None
        return f"{op} {impl} {'x'.join(str(s) for s in key)} {str(dtype).removeprefix('torch.')}"

    with ThreadPoolExecutor(max_workers=max(1, jobs or _tilelang.compile_jobs()), thread_name_prefix="tiletune-warmup") as pool:
        return [line for line in pool.map(run, runs.items()) if line]


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
