"""PatchReport: what `apply_kernels` did — each site an op went to or could not, the reasons, the undo."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tiletune.kernels import registry
from tiletune.patch.spec import KernelSpec


@dataclass
class PatchEntry:
    """One site an op was bound to."""

    op: str
    layer: int  # decoder layer; -1 for an op on the whole model
    module: str  # path inside the decoder layer (or on the causal LM)
    impl: str
    fallback: str | None = None  # why the reference (or the stock forward) runs instead
    installed: bool = True  # False: the site does not fit the op (fallback says why); its forward is untouched


@dataclass
class PatchReport:
    """What apply_kernels did: patched modules, fallbacks with reasons; revert() undoes it.

    Run-time fallbacks are counted from the apply to the revert, so each report holds its own run's.
    """

    spec: KernelSpec
    family: str | None = None
    layers_path: str = ""
    num_layers: int = 0
    entries: list[PatchEntry] = field(default_factory=list)
    unbound: dict[str, str] = field(default_factory=dict)  # op -> why it went nowhere (e.g. no family record)
    unbound_roles: dict[str, int] = field(default_factory=dict)  # role -> sites no selected op binds
    opt_in_for: dict[str, list[str]] = field(default_factory=dict)  # role -> opt-in ops that would bind it
    bindings: list[tuple] = field(default_factory=list, repr=False)  # (entry, Binding, Site) per entry, for warmup
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _counts_at_apply: dict = field(default_factory=lambda: dict(registry.runtime_fallbacks), repr=False)
    _counts_at_revert: dict | None = field(default=None, repr=False)

    def revert(self) -> None:
        """Restore every patched forward; the run-time fallback counts stop here."""
        while self._undo:
            self._undo.pop()()
        if self._counts_at_revert is None:
            self._counts_at_revert = dict(registry.runtime_fallbacks)

    def fallbacks(self) -> dict[str, str]:
        """op -> reason, for ops whose implementation cannot run (on this machine, or at some sites)."""
        return {**self.unbound, **{e.op: e.fallback for e in self.entries if e.fallback}}

    def runtime_fallbacks(self) -> list[dict]:
        """Calls that fell back while this report's kernels were applied: op, impl, reason, calls."""
        now = self._counts_at_revert if self._counts_at_revert is not None else registry.runtime_fallbacks
        counts = {key: n - self._counts_at_apply.get(key, 0) for key, n in now.items()}
        return [{"op": op, "impl": impl, "reason": reason, "calls": n} for (op, impl, reason), n in counts.items() if n]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the spec, per-op summary, every entry, and the run-time fallbacks of this report's run."""
        ops, fallbacks, installed = {}, self.fallbacks(), {}
        for entry in self.entries:
            if entry.installed:
                installed.setdefault(entry.op, []).append(entry)
        for sel in self.spec.ops:
            mine = installed.get(sel.op, [])
            layer_text = "model" if any(e.layer < 0 for e in mine) else _ranges(sorted({e.layer for e in mine}))
            ops[sel.op] = {"impl": sel.impl, "patched": len(mine), "layers": layer_text,
                           "modules": sorted({e.module for e in mine}), "fallback": fallbacks.get(sel.op)}
        return {"spec": self.spec.to_dict(), "family": self.family,
                "decoder_layers": {"path": self.layers_path, "count": self.num_layers}, "unbound_roles": self.unbound_roles,
                "ops": ops, "entries": [asdict(e) for e in self.entries], "runtime_fallbacks": self.runtime_fallbacks(),
                "library": _library_use()}

    def save(self, output_dir: str | Path) -> Path:
        """Write kernels.json into output_dir; returns its path."""
        path = Path(output_dir) / "kernels.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def summary(self) -> str:
        """One screen: per op, the implementation, where it went, and any fallback with its reason."""
        if not self.spec.ops:
            return "kernels: none (stock PyTorch forwards)"
        lines = [f"kernels ({self.num_layers} decoder layers at {self.layers_path or 'model'}, family "
                 f"{self.family or 'without a record'}; strict: {'on' if self.spec.strict else 'off'})"]
        for op, info in self.to_dict()["ops"].items():
            modules = ", ".join(info["modules"]) or "-"
            if info["fallback"]:
                status = f"falls back to {registry.ops()[op].fallback}: {info['fallback']}"
            elif info["patched"]:
                status = "active"
            elif not registry.ops()[op].bindings:
                status = "no binding: the training stage calls it"
            else:
                status = "no module in the decoder layers fits this op"
            lines.append(f"  {op:9s} {info['impl']:10s} {info['patched']:4d} modules  layers {info['layers'] or '-':10s} "
                         f"[{_clip(modules, 48)}]  {status}")
        for role, count in self.unbound_roles.items():
            opt_in = self.opt_in_for.get(role)
            why = f"no selected op binds them (opt-in: {', '.join(opt_in)})" if opt_in else "no tiletune op binds them yet"
            lines.append(f"  {role}: {count} modules {why}: stock forwards")
        from tiletune.kernels.library import summary

        library_line = summary()
        if library_line:
            lines.append(f"  {library_line}")
        known = self.fallbacks()
        for item in self.runtime_fallbacks():
            if known.get(item["op"]) == item["reason"]:
                continue  # already said above
            lines.append(f"  {item['op']:9s} {item['impl']:10s} fell back at run time on {item['calls']} calls: {item['reason']}")
        return "\n".join(lines)


def _library_use() -> dict | None:
    """The active kernel library's folder, target and which kernels it served or lacked (None without one)."""
    from tiletune.kernels import library

    found = library.loaded()
    if found is None:
        return None
    return {"folder": str(found.folder), "target": found.manifest.target, "kernels": len(found.by_key),
            "used": sorted(found.used), "not_in_it": sorted(found.not_in_it)}


def _ranges(values: list[int]) -> str:
    parts, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(parts)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
