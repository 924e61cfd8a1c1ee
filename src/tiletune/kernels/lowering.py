"""`tiletune kernels lower`: every kernel's device source for each target, without a GPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from tiletune.errors import UserError
from tiletune.kernels import _tilelang
from tiletune.kernels import registry


def kernel_names(arch: str = "sm_90") -> list[str]:
    """The names of the kernels `lower_all` writes (for `arch`'s configs)."""
    return [name for op in registry.ops().values() for name in (op.lowering(arch) if op.lowering else {})]


def lower_all(targets: Iterable[str] | None, out_dir: str | Path, echo: Callable[[str], None] = print,
              kernels: Iterable[str] | None = None) -> list[str]:
    """Write OUT/<target with ':' as '-'>/<kernel>.cu|.hip for every kernel (or those named in `kernels`) and target;
    return failures."""
    if not _tilelang.installed():
        raise UserError("tiletune kernels lower needs TileLang: pip install tilelang")
    targets = list(targets or _tilelang.KNOWN_TARGETS)
    for target in targets:
        try:
            _tilelang.parse_target(target)
        except ValueError as err:
            raise UserError(str(err)) from None
    chosen = set(kernels or ())
    if unknown := sorted(chosen - set(kernel_names())):
        raise UserError(f"unknown kernel {unknown[0]!r} for --kernel: choose from {', '.join(kernel_names())}")
    failures = []
    for target in targets:
        folder = Path(out_dir) / target.replace(":", "-")
        folder.mkdir(parents=True, exist_ok=True)
        suffix = ".cu" if target.startswith("cuda") else ".hip"
        for op in registry.ops().values():
            builders = op.lowering(target.partition(":")[2]) if op.lowering else {}
            for name, build in builders.items():
                if chosen and name not in chosen:
                    continue
                try:
                    source = _tilelang.lower_source(build(), target)
                except Exception as err:  # noqa: BLE001 - any lowering error is reported per kernel
                    failures.append(f"{target} {name}: {type(err).__name__}: {str(err).strip().splitlines()[-1]}")
                    continue
                path = folder / f"{name}{suffix}"
                path.write_text(source)
                echo(f"{target:12s} {name:14s} {len(source):7d} chars  {path}")
    return failures
