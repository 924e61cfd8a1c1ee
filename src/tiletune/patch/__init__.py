"""The engine that binds the kernel library into a Hugging Face model: apply, revert, report.

    report = apply_kernels(model, {"rms_norm": "tilelang", "linear": {"layers": "10", "modules": ["mlp.*"]}})
    print(report.summary()); report.save(output_dir)   # kernels.json
    report.revert()

The model's family record (tiletune.families, by config.model_type) gives the sites, by role; each
selected op's bindings (tiletune.kernels.binding) take the sites of their role that the spec's layers and
module globs select, and a binding that supersedes another takes its sites at the same path (lora_linear
over linear). A site a binding does not fit is reported with the reason and left alone. Patching replaces
forwards (instance attributes, behind accelerate's hooks); Parameters are never touched, so optimizers,
PEFT, ZeRO-3 hooks and FSDP see the same objects. No op or family is named here.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from tiletune.errors import UserError
from tiletune.families import family_of, known
from tiletune.kernels import registry
from tiletune.kernels.binding import MODEL_ROLES, Binding, Site
from tiletune.kernels.registry import REFERENCE
from tiletune.patch.report import PatchEntry, PatchReport
from tiletune.patch.sites import causal_lm, layer_sites, layers_of, model_sites
from tiletune.patch.spec import KernelSpec, OpSelection, parse_kernel_spec, parse_layers

__all__ = ["KernelSpec", "OpSelection", "PatchEntry", "PatchReport", "apply_kernels", "decoder_layers",
           "layer_modules", "parse_kernel_spec", "parse_layers", "revert_kernels"]


def apply_kernels(model: nn.Module, spec: Any) -> PatchReport:
    """Patch `model` per `spec` (a KernelSpec or a raw `kernels:` value); returns the PatchReport.

    A previous apply on the same model is reverted first. Raises UserError for a layer index the
    model lacks, a module pattern that matches nothing, or (strict) an implementation that cannot
    run on this machine.
    """
    spec = parse_kernel_spec(spec)
    revert_kernels(model)
    if spec.library:
        from tiletune.kernels.library import activate

        activate(spec.library)
    report = PatchReport(spec)
    model._tiletune_kernels = report
    if not spec.ops:
        return report
    causal, family, report.layers_path, layers = _locate(model)
    if family is None:
        report.unbound = {sel.op: f"{_no_record(causal)}: stock forward kept" for sel in spec.ops}
        return report
    report.family, report.num_layers = family.name, len(layers)
    # validate everything before patching anything
    sites = [site for i, layer in enumerate(layers) for site in layer_sites(family, i, layer)]
    sites += model_sites(family, causal)
    # parts of the model that only an unselected opt-in op or no op binds (MoE experts): said, not skipped silently
    covered = {b.role for sel in spec.ops for b in registry.ops()[sel.op].bindings}
    covered |= {b.role for op in registry.ops().values() if not op.opt_in for b in op.bindings}
    for site in sites:
        if site.role not in covered:
            report.unbound_roles[site.role] = report.unbound_roles.get(site.role, 0) + 1
    report.opt_in_for = {role: [name for name, op in registry.ops().items() if op.opt_in and
                                any(b.role == role for b in op.bindings)] for role in report.unbound_roles}  # fmt: skip
    plan = {sel: _select(sel, sites, len(layers)) for sel in spec.ops}
    plan = _resolve_supersession(plan)
    reasons = {sel: None if sel.impl == REFERENCE else registry.get(sel.op, sel.impl).unavailable() for sel in spec.ops}
    for sel, reason in reasons.items():
        if reason and spec.strict:
            raise UserError(f"kernels.{sel.op}: implementation {sel.impl!r} cannot run here ({reason}) and strict is true")
    for sel, chosen in plan.items():
        for binding, site in chosen:
            unfit = binding.fit(site)
            installed = unfit is None
            if installed:
                forward = binding.forward(site, sel.impl, spec.strict, _current_forward(site.module))
                report._undo.append(_set_forward(site.module, forward))
                unfit = binding.unfit_now(site.module) if binding.unfit_now else None
            entry = PatchEntry(sel.op, site.layer, site.path, sel.impl, unfit or reasons[sel], installed)
            report.entries.append(entry)
            report.bindings.append((entry, binding, site))
    return report


def _select(sel: OpSelection, sites: list[Site], num_layers: int) -> list[tuple[Binding, Site]]:
    """(binding, site) pairs `sel` chooses; UserError for a layer or module glob that matches nothing."""
    if sel.layers is not None:
        missing = [i for i in sel.layers if i >= num_layers]
        if missing:
            raise UserError(f"kernels.{sel.op}.layers: layer {missing[0]} does not exist; the model has layers 0-{num_layers - 1}")
    chosen, seen_paths, used = [], set(), set()
    for binding in registry.ops()[sel.op].bindings:
        for site in sites:
            if site.role != binding.role or not binding.applies(site) or (
                    sel.layers is not None and site.role not in MODEL_ROLES and site.layer not in sel.layers):
                continue
            seen_paths.add(site.path)
            hits = [p for p in sel.modules if fnmatch.fnmatchcase(site.path, p)]
            if sel.modules and not hits:
                continue
            used.update(hits)
            chosen.append((binding, site))
    for pattern in sel.modules:
        if pattern not in used:
            raise UserError(f"kernels.{sel.op}.modules: {pattern!r} matches no {sel.op} module; candidates in a decoder "
                            f"layer: {', '.join(sorted(seen_paths)) or 'none'}")
    return chosen


def _resolve_supersession(plan: dict) -> dict:
    """Drop from each op the sites that a selected op superseding it takes at the same (layer, path)."""
    taken = {(op, site.layer, site.path) for sel, chosen in plan.items() for binding, site in chosen for op in binding.supersedes}
    return {sel: [(b, s) for b, s in chosen if (sel.op, s.layer, s.path) not in taken] for sel, chosen in plan.items()}


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path from `model`, ModuleList) of the decoder layers, where the model's family record puts them;
    UserError for a model whose family has no record."""
    causal, family, path, layers = _locate(model)
    if family is None:
        raise UserError(f"{_no_record(causal)}: tiletune cannot find its decoder layers")
    return path, layers


def layer_modules(model: nn.Module, role: str) -> list[nn.Module]:
    """The modules of every decoder layer's sites of `role` (e.g. ``mlp``: the dense MLPs), first layer first;
    UserError for a model whose family has no record."""
    causal, family, _, layers = _locate(model)
    if family is None:
        raise UserError(f"{_no_record(causal)}: tiletune cannot find its {role} modules")
    return [site.module for i, layer in enumerate(layers) for site in layer_sites(family, i, layer) if site.role == role]


def _locate(model: nn.Module):
    """(the causal LM, its family record, the decoder layers' path from `model`, the layers); the last three
    empty-handed (None, "", None) without a record."""
    causal, prefix = causal_lm(model)
    family = family_of(causal.config)
    if family is None:
        return causal, None, "", None
    return causal, family, ".".join(filter(None, (prefix, family.layers))), layers_of(causal, family)


def _no_record(causal: nn.Module) -> str:
    return (f"no family record for model_type {getattr(causal.config, 'model_type', None)!r} "
            f"(records: {', '.join(sorted(known()))})")


def revert_kernels(model: nn.Module) -> None:
    """Undo apply_kernels on `model` (no-op if nothing is applied)."""
    report = model.__dict__.pop("_tiletune_kernels", None)
    if report is not None:
        report.revert()


# ---- forward swaps -------------------------------------------------------------------------------


def _forward_attr(module: nn.Module) -> str:
    """The attribute holding the module's own forward: accelerate's hooks keep it in `_old_forward`."""
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def _current_forward(module: nn.Module) -> Callable:
    """The function behind the module's own forward now: an earlier binding's on this instance, else the class's."""
    bound = module.__dict__.get(_forward_attr(module))
    if isinstance(bound, types.MethodType) and bound.__self__ is module:
        return bound.__func__
    return type(module).forward


def _set_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Bind `forward` as the module's forward; return the undo. Keeps accelerate's hooks in front."""
    attr = _forward_attr(module)
    had_own = attr in module.__dict__
    previous = module.__dict__.get(attr)
    setattr(module, attr, types.MethodType(forward, module))

    def undo() -> None:
        if had_own:
            setattr(module, attr, previous)
        else:
            delattr(module, attr)
    return undo
