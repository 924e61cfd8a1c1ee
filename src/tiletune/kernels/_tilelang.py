"""TileLang plumbing: lazy import, target detection, compile with memory + disk cache, lowering.

`import tilelang` costs seconds and imports torch, so nothing here imports it until a kernel is
actually needed. Compiled kernels persist in TileLang's own disk cache; unless the user set
TILELANG_CACHE_DIR, it lives under tiletune's cache dir (``~/.cache/tiletune/tilelang``), so a
second run of the same config loads binaries instead of compiling.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Targets `tiletune kernels lower` knows, as TileLang target dicts.
KNOWN_TARGETS = ("cuda:sm_80", "cuda:sm_90", "hip:gfx90a", "hip:gfx942", "hip:gfx1100")
# Architectures the kernels are written and tuned for; others fall back with a reason.
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "gfx90a", "gfx942", "gfx1100")


def cache_dir() -> Path:
    """tiletune's cache directory (XDG_CACHE_HOME or ~/.cache, then /tiletune)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiletune"


def tilelang_cache_dir() -> Path:
    """Where compiled kernels persist: TILELANG_CACHE_DIR if the user set it, else ours."""
    return Path(os.environ.get("TILELANG_CACHE_DIR") or cache_dir() / "tilelang")


def installed() -> bool:
    """True when the tilelang package can be found, without importing it (False where imports of it are
    blocked, sys.modules["tilelang"] = None)."""
    if "tilelang" in sys.modules:
        return sys.modules["tilelang"] is not None
    return importlib.util.find_spec("tilelang") is not None


def version() -> str | None:
    """The installed TileLang version, without importing it; None if not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tilelang")
    except PackageNotFoundError:
        return None


@functools.cache
def tilelang():
    """Import and return the tilelang module (seconds, once per process)."""
    os.environ.setdefault("TILELANG_CACHE_DIR", str(tilelang_cache_dir()))
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    import tilelang as tl

    return tl


def parse_target(name: str) -> dict[str, str]:
    """'cuda:sm_90' -> {'kind': 'cuda', 'arch': 'sm_90a'}; 'hip:gfx942' -> {'kind': 'hip', 'mcpu': 'gfx942'}.

    sm_90 becomes sm_90a: TileLang's Hopper GEMMs use wgmma and register reallocation, which only
    the architecture-specific target has.
    """
    kind, _, arch = name.partition(":")
    if kind == "cuda" and arch.startswith("sm_"):
        return {"kind": "cuda", "arch": "sm_90a" if arch == "sm_90" else arch}
    if kind == "hip" and arch.startswith("gfx"):
        return {"kind": "hip", "mcpu": arch}
    raise ValueError(f"unknown target {name!r}: expected cuda:sm_XX or hip:gfxXXX, e.g. {', '.join(KNOWN_TARGETS)}")


def device_arch(device: torch.device | int | None = None) -> str | None:
    """The GPU architecture torch sees ('sm_90', 'gfx942'), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    index = device.index if isinstance(device, torch.device) else device
    return _arch(torch.cuda.current_device() if index is None else index)


@functools.cache
def _arch(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def device_target(device: torch.device | int | None = None) -> str | None:
    """The target TileLang would compile for on this machine ('cuda:sm_90'), or None without a GPU."""
    arch = device_arch(device)
    if arch is None:
        return None
    return f"{'hip' if torch.version.hip else 'cuda'}:{arch}"


@functools.cache
def machine_unavailable_reason() -> str | None:
    """Why TileLang kernels cannot run on this machine at all, or None if they can."""
    from tiletune.kernels import library

    if not installed() and library.active() is None:
        return f"tilelang is not installed (pip install tilelang) and no kernel library is loaded ({library.LIBRARY_ENV})"
    arch = device_arch()
    if arch is None:
        return "no CUDA or ROCm GPU visible to torch"
    if arch not in SUPPORTED_ARCHS:
        return f"GPU architecture {arch} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
    return None


def compile_jobs() -> int:
    """How many kernels compile at once (warm-up threads, library build processes): TILETUNE_COMPILE_JOBS, else up to
    8 (one per CPU core)."""
    from tiletune.errors import UserError

    given = os.environ.get("TILETUNE_COMPILE_JOBS", "")
    if given and not given.isdigit():
        raise UserError(f"TILETUNE_COMPILE_JOBS={given!r}: give how many kernels may compile at once, e.g. 8 (1: one by one)")
    return int(given or 0) or min(8, os.cpu_count() or 1)


_compiled: dict[tuple, Any] = {}
_key_locks: dict[tuple, threading.Lock] = {}  # one per kernel: threads compile different kernels at once
_locks_lock = threading.Lock()


def compiled(key: tuple, build: Callable[[], Any], **compile_kwargs) -> Any:
    """Compile the PrimFunc `build()` for this machine's GPU once per process and key.

    `key` names the kernel and every static parameter (shapes, dtype, config); TileLang's disk
    cache makes the compile a load after the first run on a machine. Threads may compile different kernels
    at once (TileLang's own par_compile does; `warmup_kernels` uses it). With a kernel library active
    (`tiletune.kernels.library`) its kernel for `key` is taken instead; `recording` lists what was asked.
    """
    kernel = _compiled.get(key)
    if kernel is None:
        from tiletune.kernels import library

        with _locks_lock:
            lock = _key_locks.setdefault(key, threading.Lock())
        with lock:
            kernel = _compiled.get(key)
            if kernel is None:
                if recording is not None:
                    recording.setdefault(key, build)
                kernel = library.lookup(key)
                if kernel is None:
                    func = build()
                    kernel = tilelang().compile(func, target=parse_target(device_target()), **compile_kwargs,
                                                **({"pass_configs": configs} if (configs := pass_configs(func)) else {}))
                _compiled[key] = kernel
    return kernel


recording: dict[tuple, Callable[[], Any]] | None = None  # set by `tiletune kernels build`: key -> PrimFunc builder


PASS_CONFIGS_ATTR = "tiletune.pass_configs"  # a PrimFunc's own TileLang pass configs, set where it is built


def pass_configs(func) -> dict:
    """The TileLang pass configs a PrimFunc asks to be compiled with (its PASS_CONFIGS_ATTR), {} if none."""
    attrs = getattr(func, "attrs", None)
    configs = attrs.get(PASS_CONFIGS_ATTR) if attrs is not None else None
    return {str(name): value for name, value in dict(configs).items()} if configs is not None else {}


def lower_source(func, target: str) -> str:
    """Lower a PrimFunc for `target` ('cuda:sm_90', 'hip:gfx942') without a GPU, with its own pass configs; return
    device source."""
    tl = tilelang()
    tgt = parse_target(target)
    with tl.tvm.target.Target(tgt), tl.tvm.transform.PassContext(opt_level=3, config=pass_configs(func)):
        return tl.lower(func, target=tgt).kernel_source


@functools.cache
def sm_count(index: int = 0) -> int:
    """Number of multiprocessors (compute units) of GPU `index`: sizes persistent grids."""
    return torch.cuda.get_device_properties(index).multi_processor_count


DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half types and float32, float64 for float64: the references' internal precision."""
    return torch.promote_types(x.dtype, torch.float32)


# The dtypes the GPU tests verify against float64; float32 inputs fall back to the reference.
TESTED_DTYPES = (torch.bfloat16, torch.float16)


def unsupported_inputs(*tensors: torch.Tensor) -> str | None:
    """Why these tensors cannot go to a TileLang kernel (device, dtype, dtype mix), or None."""
    first = tensors[0]
    if first.device.type != "cuda":
        return f"inputs are on {first.device.type}, not a GPU"
    if first.dtype not in TESTED_DTYPES:
        return f"dtype {str(first.dtype).removeprefix('torch.')} is not supported (supported: {', '.join(DTYPES[d] for d in TESTED_DTYPES)})"
    for t in tensors[1:]:
        if t.dtype != first.dtype:
            return f"mixed dtypes {str(first.dtype).removeprefix('torch.')} and {str(t.dtype).removeprefix('torch.')}"
        if t.device != first.device:
            return "inputs on different devices"
    return None
