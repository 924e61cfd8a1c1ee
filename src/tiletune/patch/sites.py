"""A model walked through its family record: the sites, by role, that bindings may take."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator

from torch import nn

from tiletune.families import Family
from tiletune.kernels.binding import Site


def causal_lm(model: nn.Module) -> tuple[nn.Module, str]:
    """The causal LM inside `model` (under a peft wrapper, if any) and its path from `model`."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = next((p for p, m in model.named_modules() if m is inner), "")
    return inner, path


def layers_of(causal: nn.Module, family: Family) -> nn.ModuleList:
    """The decoder layers where the family record says they are."""
    try:
        layers = causal.get_submodule(family.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        raise LookupError(f"the {family.name} record puts the decoder layers at {family.layers!r}; "
                          f"{type(causal).__name__} has no ModuleList there")
    return layers


def layer_sites(family: Family, index: int, layer: nn.Module) -> Iterator[Site]:
    """Every site in decoder layer `index`, by role, in the order of tiletune.kernels.binding.ROLES."""
    modules = dict(layer.named_modules())
    for norm in family.norms:
        for path in fnmatch.filter(modules, norm.path):
            yield Site("norm", index, path, modules[path], norm)
    mlp = _mlp_path(family, modules)
    if mlp is not None:
        yield Site("mlp", index, mlp, modules[mlp], family.mlp)
    attention = modules.get(family.attention.path)
    if attention is not None:
        if family.attention.rotary != "none":
            yield Site("rotary", index, family.attention.path, attention, family.attention)
        yield Site("attention", index, family.attention.path, attention, family.attention)
    yield from _linear_sites(family, index, modules)
    if family.experts is not None and family.experts.path in modules:
        yield Site("experts", index, family.experts.path, modules[family.experts.path], family.experts)


def _mlp_path(family: Family, modules: dict[str, nn.Module]) -> str | None:
    """The layer's dense MLP: the record's `mlp`, or in a MoE layer (its `mlp` path holds the experts) the shared
    expert; None where the layer has none."""
    if family.mlp is None:
        return None
    experts = family.experts
    moe_layer = experts is not None and experts.path in modules and experts.path.startswith(family.mlp.path + ".")
    path = experts.shared if moe_layer else family.mlp.path
    return path if path in modules else None


def _linear_sites(family: Family, index: int, modules: dict[str, nn.Module]) -> Iterator[Site]:
    """`linear`: every Linear (a peft wrapper's base layer, reported at the wrapper's path) but routers and
    the adapters' own; `quantized_linear`: the same for Linears holding a quantized weight (a `quantized`
    attribute); `lora_linear`: every peft LoRA Linear over a plain Linear, `quantized_lora_linear` over a quantized one."""
    routers = {family.experts.router} if family.experts else set()
    wrappers = {p for p, m in modules.items() if isinstance(getattr(m, "base_layer", None), nn.Module)}
    for path, module in modules.items():
        if path in routers or any(path.startswith(r + ".") for r in routers):
            continue
        if path in wrappers and _is_lora_linear(module):
            quantized = hasattr(module.base_layer, "quantized")
            yield Site("quantized_lora_linear" if quantized else "lora_linear", index, path, module)
        if not isinstance(module, nn.Linear):
            continue
        role = "quantized_linear" if hasattr(module, "quantized") else "linear"
        owner = next((w for w in wrappers if path.startswith(w + ".")), None)
        if owner is None:
            yield Site(role, index, path, module)
        elif path == owner + ".base_layer":
            yield Site(role, index, owner, module)  # the kernel goes on the base layer; reported at the wrapper
        # other Linears inside a wrapper are the adapter's own (lora_A, lora_B): left alone


def _is_lora_linear(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "base_layer", None), nn.Linear) and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def model_sites(family: Family, causal: nn.Module) -> Iterator[Site]:
    """The model-level sites: the lm_head (with the loss), bound on the causal LM itself."""
    if isinstance(getattr(causal, family.lm_head.path, None), nn.Module):
        yield Site("lm_head", -1, family.lm_head.path, causal, family.lm_head)
