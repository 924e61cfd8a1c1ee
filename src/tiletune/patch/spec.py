"""The `kernels:` spec: which op, which implementation, on which decoder layers and module paths.

    kernels: all                                   # every op but the opt-in ones, default implementations
    kernels: {rms_norm: tilelang, linear: {impl: tilelang, layers: "0-15", modules: ["mlp.*"]}, strict: true}
    kernels: rms_norm,swiglu                       # on the command line: kernels=rms_norm,swiglu
    kernels: {all: true, library: ./kernels-lib}   # the kernels from a library `tiletune kernels build` wrote
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from tiletune.errors import UserError
from tiletune.kernels import registry
from tiletune.kernels.binding import MODEL_ROLES

_OPTIONS = ("strict", "plugins", "library")
_OP_KEYS = ("impl", "layers", "modules")

# ---- the spec -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSelection:
    """One op of the spec: which implementation, on which decoder layers and module paths."""

    op: str
    impl: str
    layers: tuple[int, ...] | None = None  # None: every decoder layer
    modules: tuple[str, ...] = ()  # globs on the path inside a decoder layer; empty: every candidate

    def to_dict(self) -> dict[str, Any]:
        return {"impl": self.impl, "layers": "all" if self.layers is None else list(self.layers),
                "modules": list(self.modules) or "all"}


@dataclass(frozen=True)
class KernelSpec:
    """The parsed `kernels:` value."""

    ops: tuple[OpSelection, ...] = ()
    strict: bool = False
    plugins: tuple[str, ...] = ()
    library: str | None = None  # a folder `tiletune kernels build` wrote (tiletune.kernels.library)

    def to_dict(self) -> dict[str, Any]:
        return {"ops": {s.op: s.to_dict() for s in self.ops}, "strict": self.strict, "plugins": list(self.plugins),
                "library": self.library}


def parse_kernel_spec(value: Any) -> KernelSpec:
    """Parse the `kernels:` config value (or `kernels=` on the command line) into a KernelSpec.

    Accepts `all`, `none`, a comma list (`rms_norm,swiglu` or `rms_norm=tilelang,linear=reference`),
    YAML/JSON text, or a mapping of op -> impl | {impl, layers, modules} plus `strict` and `plugins`.
    `all` leaves out the opt-in ops (attention); name them to add them (`all,attention`).
    Raises UserError naming the bad op, implementation, layer selector or key, with what exists.
    """
    if isinstance(value, KernelSpec):
        return value
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "none", "off", "false")):
        return KernelSpec()
    if value is True or (isinstance(value, str) and value.strip().lower() in ("all", "on", "true")):
        return _parse_mapping({"all": True})
    if isinstance(value, str):
        return _parse_mapping(_text_to_mapping(value))
    if isinstance(value, dict):
        return _parse_mapping(value)
    raise UserError(f"kernels: expected all, none, or a mapping of op -> implementation; got {type(value).__name__} {value!r}")


def _text_to_mapping(text: str) -> dict:
    if any(c in text for c in "{}:\n"):
        import yaml

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise UserError(f"kernels: cannot parse {text!r}: {err}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"kernels: expected a mapping, got {text!r}")
        return loaded
    mapping = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, _, impl = item.partition("=")
        mapping[op.strip()] = impl.strip() or True
    return mapping


def _parse_mapping(mapping: dict) -> KernelSpec:
    strict = mapping.get("strict", False)
    if not isinstance(strict, bool):
        raise UserError(f"kernels.strict: expected true or false, got {strict!r}")
    plugins = mapping.get("plugins") or ()
    plugins = (plugins,) if isinstance(plugins, str) else tuple(plugins)
    for module in plugins:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise UserError(f"kernels.plugins: cannot import {module!r}: {err}") from None
    library = mapping.get("library")
    if library is not None and not isinstance(library, str):
        raise UserError(f"kernels.library: expected the folder `tiletune kernels build` wrote, got {library!r}")
    default = mapping.get("all")
    known = registry.ops()
    ops = {op: default for op, definition in known.items() if not definition.opt_in} if default not in (None, False, "none") else {}
    for key, value in mapping.items():
        if key in _OPTIONS or key == "all":
            continue
        if key not in known:
            everyday = ", ".join(op for op, definition in known.items() if not definition.opt_in)
            opt_in = ", ".join(op for op, definition in known.items() if definition.opt_in)
            raise UserError(f"kernels: unknown op {key!r}; ops: {everyday}; opt-in: {opt_in or 'none'} "
                            f"(options: all, {', '.join(_OPTIONS)})")
        ops[key] = value
    selections = [sel for op, value in ops.items() if (sel := _parse_op(op, value)) is not None]
    return KernelSpec(tuple(selections), strict, plugins, library)


def _parse_op(op: str, value: Any) -> OpSelection | None:
    if value in (None, False, "none", "off"):
        return None
    if value is True:
        value = registry.default_impl(op)
    if isinstance(value, str):
        value = {"impl": value}
    if not isinstance(value, dict):
        raise UserError(f"kernels.{op}: expected an implementation name or {{impl, layers, modules}}, got {value!r}")
    unknown = set(value) - set(_OP_KEYS)
    if unknown:
        raise UserError(f"kernels.{op}: unknown key {sorted(unknown)[0]!r}; keys: {', '.join(_OP_KEYS)}")
    impl = value.get("impl", registry.default_impl(op))
    if not registry.ops()[op].bindings and (value.get("layers", "all") != "all" or value.get("modules")):
        raise UserError(f"kernels.{op}: binds to no module (the training stage calls it); it takes no layers or modules")
    if is_model_level(op) and (value.get("layers", "all") != "all" or value.get("modules")):
        raise UserError(f"kernels.{op}: works on the whole model ({', '.join(b.role for b in registry.ops()[op].bindings)}); "
                        "it takes no layers or modules")
    available = registry.impls(op)
    if impl not in available:
        raise UserError(f"kernels.{op}: unknown implementation {impl!r}; {op} has: {', '.join(sorted(available))}")
    modules = value.get("modules") or ()
    modules = (modules,) if isinstance(modules, str) else tuple(str(m) for m in modules)
    return OpSelection(op, impl, parse_layers(value.get("layers", "all"), f"kernels.{op}.layers"), modules)


def parse_layers(value: Any, where: str = "layers") -> tuple[int, ...] | None:
    """'all' -> None; 10, '10', '0-15', '0,4,8', '0-3,8' or a list -> sorted layer indices."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    layers: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            raise UserError(f"{where}: bad layer selector {item!r}")
        if isinstance(item, int):
            layers.add(item)
            continue
        for part in str(item).split(","):
            match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not match or (match[2] and int(match[2]) < int(match[1])):
                raise UserError(f"{where}: bad layer selector {part.strip()!r}; use an index (10), a range (0-15), "
                                "a list (0,4,8) or all")
            layers.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    return tuple(sorted(layers))


def is_model_level(op: str) -> bool:
    """Whether every binding of `op` goes on the causal LM itself (lm_head + loss) rather than into decoder layers."""
    bindings = registry.ops()[op].bindings
    return bool(bindings) and all(b.role in MODEL_ROLES for b in bindings)
