"""Swap kernels into a Hugging Face model: the `kernels:` spec, selectors, apply/revert, PatchReport.

    spec = parse_kernel_spec({"rms_norm": "tilelang", "linear": {"impl": "tilelang", "layers": "10",
                                                                 "modules": ["mlp.gate_proj"]}})
    report = apply_kernels(model, spec)
    print(report.summary()); report.save(output_dir)   # kernels.json
    report.revert()

Patching replaces forwards (instance attributes) or, for rope and attention, the attention forward's
references to `apply_rotary_pos_emb` and `ALL_ATTENTION_FUNCTIONS` (in a copy of the forward bound to the
patched module only; the two compose); Parameters are never touched, so optimizers, PEFT, ZeRO-3 hooks and FSDP see the
same objects. PEFT-wrapped Linear layers get `linear` on their base layer, or `lora_linear` on the whole
wrapper (base GEMM and adapter in one op); when both ops are selected, `lora_linear` takes the LoRA wrappers
it selects and `linear` the other Linears. Kernels know nothing of models: this module maps model
structure to the ops in tiletune.kernels.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import json
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiletune.errors import UserError
from tiletune.kernels import registry
from tiletune.kernels.registry import MODEL_LEVEL_OPS, OPS, OPT_IN, REFERENCE

_OPTIONS = ("strict", "plugins")
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

    def to_dict(self) -> dict[str, Any]:
        return {"ops": {s.op: s.to_dict() for s in self.ops}, "strict": self.strict, "plugins": list(self.plugins)}


def parse_kernel_spec(value: Any) -> KernelSpec:
    """Parse the `kernels:` config value (or `kernels=` on the command line) into a KernelSpec.

    Accepts `all`, `none`, a comma list (`rms_norm,swiglu` or `rms_norm=tilelang,linear=reference`),
    YAML/JSON text, or a mapping of op -> impl | {impl, layers, modules} plus `strict` and `plugins`.
    `all` leaves out the OPT_IN ops (attention); name them to add them (`all,attention`).
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
    default = mapping.get("all")
    ops = {op: default for op in OPS if op not in OPT_IN} if default not in (None, False, "none") else {}
    for key, value in mapping.items():
        if key in _OPTIONS or key == "all":
            continue
        if key not in OPS:
            raise UserError(f"kernels: unknown op {key!r}; ops: {', '.join(OPS)} (options: all, {', '.join(_OPTIONS)})")
        ops[key] = value
    selections = [sel for op, value in ops.items() if (sel := _parse_op(op, value)) is not None]
    return KernelSpec(tuple(selections), strict, plugins)


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
    if op in MODEL_LEVEL_OPS and (value.get("layers", "all") != "all" or value.get("modules")):
        raise UserError(f"kernels.{op}: works on the whole model (lm_head + loss); it takes no layers or modules")
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


# ---- finding patchable modules --------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the model's decoder layers; UserError if it has none."""
    best = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__.endswith("DecoderLayer"):
            if best is None or len(module) > len(best[1]):
                best = (path, module)
    if best is None:
        raise UserError(f"kernels: found no decoder layers (a ModuleList of *DecoderLayer) in {type(model).__name__}")
    return best


def _adapter_paths(layer: nn.Module) -> set[str]:
    """Paths of PEFT-style wrappers (modules with a base_layer) inside a layer."""
    return {p for p, m in layer.named_modules() if isinstance(getattr(m, "base_layer", None), nn.Module)}


def _rms_norm_candidates(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for path, module in layer.named_modules():
        name = type(module).__name__
        if (name.endswith("RMSNorm") and not name.startswith("Gemma") and isinstance(getattr(module, "weight", None), torch.Tensor)
                and _eps(module) is not None):
            yield path, module


def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _swiglu_candidates(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for path, module in layer.named_modules():
        if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(module, "act_fn", None)):
            yield path, module


def _attention_modules_using(name: str) -> Callable[[nn.Module], Iterator[tuple[str, nn.Module]]]:
    """Candidates: attention modules (with a q_proj) whose forward refers to the global `name`."""
    def candidates(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        for path, module in layer.named_modules():
            if hasattr(module, "q_proj") and name in _innermost(type(module).forward).__code__.co_names:
                yield path, module
    return candidates


def _linear_candidates(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    wrappers = _adapter_paths(layer)
    for path, module in layer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        owner = next((w for w in wrappers if path.startswith(w + ".")), None)
        if owner is None:
            yield path, module
        elif path == owner + ".base_layer":
            yield owner, module  # the kernel goes on the base layer; report the wrapper's path
        # other Linears inside a wrapper are the adapter's own (lora_A, lora_B): left alone


def _lora_linear_candidates(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for path, module in layer.named_modules():
        if (isinstance(getattr(module, "base_layer", None), nn.Linear) and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
                and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)):
            yield path, module


CANDIDATES: dict[str, Callable[[nn.Module], Iterator[tuple[str, nn.Module]]]] = {
    "rms_norm": _rms_norm_candidates, "swiglu": _swiglu_candidates, "rope": _attention_modules_using("apply_rotary_pos_emb"),
    "linear": _linear_candidates, "lora_linear": _lora_linear_candidates,
    "attention": _attention_modules_using("ALL_ATTENTION_FUNCTIONS"),
}

# ---- patched forwards -----------------------------------------------------------------------------


def _rms_norm_forward(impl: str, strict: bool):
    from tiletune.kernels.rms_norm import rms_norm

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, _eps(self), impl, strict)
    return forward


def _swiglu_forward(impl: str, strict: bool):
    from tiletune.kernels.swiglu import swiglu

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), impl, strict))
    return forward


def _autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors cast to the autocast dtype as F.linear or SDPA would (custom ops are not autocast); None stays."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None else None for t in tensors)


def _linear_forward(impl: str, strict: bool):
    from tiletune.kernels.linear import linear

    def forward(self, x):
        return linear(*_autocast(x, self.weight, self.bias), impl, strict)
    return forward


def _lora_unfit(module: nn.Module) -> str | None:
    """Why lora_linear cannot stand in for this peft LoRA Linear's forward right now, or None."""
    adapters = [name for name in module.active_adapters if name in module.lora_A]
    base = module.base_layer
    if len(adapters) != 1:
        reason = f"{len(adapters)} active adapters"
    elif module.disable_adapters:
        reason = "adapters disabled"
    elif module.merged:
        reason = "adapter merged into the base weight"
    elif getattr(module, "fan_in_fan_out", False):
        reason = "fan_in_fan_out"
    elif module.use_dora.get(adapters[0]) or adapters[0] in getattr(module, "lora_variant", {}):
        reason = "DoRA or another LoRA variant"
    elif not isinstance(module.lora_dropout[adapters[0]], nn.Identity):
        reason = f"lora_dropout={module.lora_dropout[adapters[0]].p}"
    elif base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        reason = "the base layer trains"
    else:
        return None
    return f"{reason}: stock peft forward kept"


def _lora_linear_forward(impl: str, strict: bool, stock: Callable) -> Callable:
    from tiletune.kernels.lora_linear import lora_linear

    def forward(self, x, *args, **kwargs):
        if args or kwargs or _lora_unfit(self):
            return stock(x, *args, **kwargs)
        name = next(a for a in self.active_adapters if a in self.lora_A)
        x, weight, bias = _autocast(x, self.base_layer.weight, self.base_layer.bias)
        return lora_linear(x, weight, bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name],
                           impl, strict)
    return forward


def _rope_function(original: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for transformers' apply_rotary_pos_emb that runs tiletune's rope op."""
    from tiletune.kernels.rope import rope

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if args or kwargs or unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return rope(q, k, cos, sin, impl, strict)
    return apply_rotary_pos_emb


def _innermost(func: Callable) -> Callable:
    while hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return func


def _with_global(func: Callable, name: str, value: Any) -> Callable:
    """A copy of `func` whose global `name` is `value`, through functools.wraps decorator layers.

    This scopes the replacement of a function a forward calls (apply_rotary_pos_emb) to the modules
    patched with the copy, instead of changing the modeling module for everyone.
    """
    inner = getattr(func, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(func.__code__, _scoped_globals(func.__globals__, name, value), func.__name__,
                                 func.__defaults__, func.__closure__)
    else:
        cells = func.__closure__ or ()
        if not any(cell.cell_contents is inner for cell in cells):
            raise LookupError(f"cannot see through decorator {func.__qualname__}")
        new_inner = _with_global(inner, name, value)
        closure = tuple(types.CellType(new_inner) if cell.cell_contents is inner else cell for cell in cells)
        new = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, closure)
        new.__wrapped__ = new_inner
    new.__kwdefaults__ = func.__kwdefaults__
    new.__qualname__ = func.__qualname__
    return new


def _scoped_globals(base: dict, name: str, value: Any) -> dict:
    """A copy of a module's namespace with `name` set to `value`, registered as a module of its own.

    torch.compile resolves a function's globals through sys.modules[globals['__name__']], so the
    copy must be importable under its own name for compiled code to see the replacement.
    """
    scoped = types.ModuleType(f"tiletune._scoped.{base['__name__']}.{name}_{id(value):x}")
    scoped.__dict__.update({**base, "__name__": scoped.__name__, name: value})
    sys.modules[scoped.__name__] = scoped
    return scoped.__dict__


def _current_forward(module: nn.Module) -> Callable:
    """The function behind the module's forward now: an earlier rope/attention patch's copy, else the class's."""
    bound = module.__dict__.get(_forward_attr(module))
    if isinstance(bound, types.MethodType) and bound.__self__ is module:
        return bound.__func__
    return type(module).forward


@functools.cache
def _rope_forward(func: Callable, impl: str, strict: bool) -> Callable:
    stock = _innermost(func).__globals__["apply_rotary_pos_emb"]
    return _with_global(func, "apply_rotary_pos_emb", _rope_function(stock, impl, strict))


# Keyword arguments of transformers' attention functions that change what is computed; the others
# (position_ids, output_attentions, ...) do not, and SDPA ignores them as well.
_ATTENTION_VARIANTS = {"sliding_window": "sliding window", "softcap": "logit softcapping", "s_aux": "attention sinks",
                       "sinks": "attention sinks", "position_bias": "a position bias", "cu_seq_lens_q": "packed sequences"}


def _attention_unfit(module: nn.Module) -> str | None:
    """Why tiletune's attention cannot stand in for this module's attention (known when patching), or None."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if implementation == "eager":
        reason = "attn_implementation eager builds an explicit mask for every call (use sdpa, the default)"
    elif getattr(module, "sliding_window", None):
        reason = f"sliding window {module.sliding_window}"
    elif getattr(module, "attn_logit_softcapping", None):
        reason = "logit softcapping"
    elif not getattr(module, "is_causal", True):
        reason = "not causal"
    else:
        return None
    return f"{reason}: stock attention kept"


def _attention_call_unfit(module: nn.Module, query, key, value, mask, args: tuple, kwargs: dict) -> str | None:
    """Why this call is not plain causal self-attention tiletune's op computes, or None."""
    variant = next((text for name, text in _ATTENTION_VARIANTS.items() if kwargs.get(name) is not None), None)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal  # None: the module decides, as in SDPA
    if args:
        reason = "positional arguments after the mask"
    elif mask is not None:
        reason = "an attention mask (padding, packed sequences, or the eager implementation's explicit causal mask)"
    elif variant:
        reason = variant
    elif kwargs.get("dropout", 0.0):
        reason = f"attention dropout {kwargs['dropout']} in training"
    elif not causal:
        reason = "not causal"
    elif query.shape[2] != key.shape[2]:
        reason = f"{query.shape[2]} queries against {key.shape[2]} keys (KV cache)"
    elif query.shape[-1] != value.shape[-1] or query.shape[1] % key.shape[1]:
        reason = f"heads {query.shape[1]}/{key.shape[1]} or head_dim q {query.shape[-1]}, v {value.shape[-1]} do not fit GQA"
    else:
        return None
    return f"{reason}: stock attention"


class _AttentionFunctions:
    """Stands in for transformers' ALL_ATTENTION_FUNCTIONS inside a patched attention forward.

    Each lookup returns the function transformers would use (SDPA, flash, ...), wrapped so that plain
    causal self-attention runs tiletune's attention op and every other call the stock function.
    """

    def __init__(self, stock: Any, impl: str, strict: bool):
        self._stock, self._impl, self._strict = stock, impl, strict
        self._wrapped: dict[Callable, Callable] = {}

    def get_interface(self, name: str, default: Callable) -> Callable:
        return self._wrap(self._stock.get_interface(name, default))

    def __getitem__(self, name: str) -> Callable:
        return self._wrap(self._stock[name])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stock, name)

    def _wrap(self, stock: Callable) -> Callable:
        if stock not in self._wrapped:
            self._wrapped[stock] = _attention_function(stock, self._impl, self._strict)
        return self._wrapped[stock]


def _attention_function(stock: Callable, impl: str, strict: bool) -> Callable:
    """A drop-in for one of transformers' attention functions that runs tiletune's attention op when it can."""
    from tiletune.kernels.attention import attention

    @functools.wraps(stock)
    def attention_function(module, query, key, value, attention_mask, *args, **kwargs):
        reason = _attention_call_unfit(module, query, key, value, attention_mask, args, kwargs)
        if reason:
            registry.note_fallback("attention", impl, reason)
            return stock(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        query, key, value = _autocast(query, key, value)
        out = attention(query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling, impl, strict)
        return out.transpose(1, 2), None  # (batch, seq, heads, head_dim), no attention weights, as SDPA
    return attention_function


@functools.cache
def _attention_forward(func: Callable, impl: str, strict: bool) -> Callable:
    stock = _innermost(func).__globals__["ALL_ATTENTION_FUNCTIONS"]
    return _with_global(func, "ALL_ATTENTION_FUNCTIONS", _AttentionFunctions(stock, impl, strict))


def _linear_cross_entropy_forward(impl: str, strict: bool, stock: Callable) -> Callable:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from tiletune.kernels.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy

    def forward(self, input_ids=None, labels=None, **kwargs):
        if labels is None or not torch.is_grad_enabled():  # generation and evaluation want the logits
            return stock(input_ids=input_ids, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(hidden.device)
        divisor = num_items if num_items is not None else (shifted != IGNORE_INDEX).sum()
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                    shifted.reshape(-1), float(divisor), impl, strict)  # fmt: skip
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)  # fmt: skip

    return forward


def _forward_attr(module: nn.Module) -> str:
    """The attribute holding the module's own forward: accelerate's hooks keep it in `_old_forward`."""
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def _forward_for(op: str, module: nn.Module, impl: str, strict: bool) -> Callable:
    if op == "linear_cross_entropy":
        return _linear_cross_entropy_forward(impl, strict, module.forward)
    if op == "lora_linear":
        return _lora_linear_forward(impl, strict, getattr(module, _forward_attr(module)))
    if op == "rope":
        return _rope_forward(_current_forward(module), impl, strict)
    if op == "attention":
        return _attention_forward(_current_forward(module), impl, strict)
    return {"rms_norm": _rms_norm_forward, "swiglu": _swiglu_forward, "linear": _linear_forward}[op](impl, strict)


# Ops whose patched forward keeps the stock one for some modules: why, known when patching (or None)
PATCH_TIME_UNFIT: dict[str, Callable[[nn.Module], str | None]] = {"lora_linear": _lora_unfit, "attention": _attention_unfit}


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


# ---- apply / revert / report ----------------------------------------------------------------------


@dataclass
class PatchEntry:
    """One patched module."""

    op: str
    layer: int
    module: str  # path inside the decoder layer
    impl: str
    fallback: str | None = None  # why the reference (or, for lora_linear/attention, the stock forward) runs instead


@dataclass
class PatchReport:
    """What apply_kernels did: patched modules, fallbacks with reasons; revert() undoes it."""

    spec: KernelSpec
    layers_path: str = ""
    num_layers: int = 0
    entries: list[PatchEntry] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def revert(self) -> None:
        """Restore every patched forward."""
        while self._undo:
            self._undo.pop()()

    def fallbacks(self) -> dict[str, str]:
        """op -> reason, for ops whose implementation cannot run on this machine."""
        return {e.op: e.fallback for e in self.entries if e.fallback}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the spec, per-op summary, every entry, and the run-time fallbacks this process has seen."""
        ops = {}
        for sel in self.spec.ops:
            mine = [e for e in self.entries if e.op == sel.op]
            layer_text = "model" if any(e.layer < 0 for e in mine) else _ranges(sorted({e.layer for e in mine}))
            ops[sel.op] = {"impl": sel.impl, "patched": len(mine), "layers": layer_text,
                           "modules": sorted({e.module for e in mine}), "fallback": self.fallbacks().get(sel.op)}
        runtime = [{"op": op, "impl": impl, "reason": reason, "calls": n}
                   for (op, impl, reason), n in registry.runtime_fallbacks.items()]
        return {"spec": self.spec.to_dict(), "decoder_layers": {"path": self.layers_path, "count": self.num_layers},
                "ops": ops, "entries": [asdict(e) for e in self.entries], "runtime_fallbacks": runtime}

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
        lines = [f"kernels ({self.num_layers} decoder layers at {self.layers_path or 'model'}; strict: "
                 f"{'on' if self.spec.strict else 'off'})"]
        for op, info in self.to_dict()["ops"].items():
            modules = ", ".join(info["modules"]) or "-"
            status = (f"falls back to reference: {info['fallback']}" if info["fallback"]
                      else "active" if info["patched"] else "no module in the decoder layers fits this op")
            lines.append(f"  {op:9s} {info['impl']:10s} {info['patched']:4d} modules  layers {info['layers'] or '-':10s} "
                         f"[{_clip(modules, 48)}]  {status}")
        known = self.fallbacks()
        for item in self.to_dict()["runtime_fallbacks"]:
            if known.get(item["op"]) == item["reason"]:
                continue  # already said above
            lines.append(f"  {item['op']:9s} {item['impl']:10s} fell back at run time on {item['calls']} calls: {item['reason']}")
        return "\n".join(lines)


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


def apply_kernels(model: nn.Module, spec: Any) -> PatchReport:
    """Patch `model` per `spec` (a KernelSpec or a raw `kernels:` value); returns the PatchReport.

    A previous apply on the same model is reverted first. Raises UserError for a layer index the
    model lacks, a module pattern that matches nothing, or (strict) an implementation that cannot
    run on this machine.
    """
    spec = parse_kernel_spec(spec)
    revert_kernels(model)
    report = PatchReport(spec)
    model._tiletune_kernels = report
    if not spec.ops:
        return report
    report.layers_path, layers = decoder_layers(model)
    report.num_layers = len(layers)
    # validate everything before patching anything
    plan = {sel: _select_model(model) if sel.op in MODEL_LEVEL_OPS else _select(sel, layers) for sel in spec.ops}
    fused = {id(module.base_layer) for sel, chosen in plan.items() if sel.op == "lora_linear" for _, _, module in chosen}
    plan = {sel: [c for c in chosen if id(c[2]) not in fused] if sel.op == "linear" else chosen  # lora_linear has them
            for sel, chosen in plan.items()}
    reasons = {sel: None if sel.impl == REFERENCE else registry.get(sel.op, sel.impl).unavailable() for sel in spec.ops}
    for sel, reason in reasons.items():
        if reason and spec.strict:
            raise UserError(f"kernels.{sel.op}: implementation {sel.impl!r} cannot run here ({reason}) and strict is true")
    for sel, chosen in plan.items():
        for index, path, module in chosen:
            report._undo.append(_set_forward(module, _forward_for(sel.op, module, sel.impl, spec.strict)))
            unfit = PATCH_TIME_UNFIT.get(sel.op)
            fallback = (unfit(module) if unfit else None) or reasons[sel]
            report.entries.append(PatchEntry(sel.op, index, path, sel.impl, fallback))
    return report


def _select_model(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """The causal LM itself (layer -1, path lm_head) for a model-level op; UserError if there is none."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(getattr(causal, "lm_head", None), nn.Linear) or not hasattr(causal, "model"):
        raise UserError(f"kernels.linear_cross_entropy: {type(causal).__name__} has no plain lm_head Linear to fuse")
    if getattr(causal.config, "final_logit_softcapping", None):
        raise UserError("kernels.linear_cross_entropy: models with final_logit_softcapping are not supported")
    return [(-1, "lm_head", causal)]


def _select(sel: OpSelection, layers: nn.ModuleList) -> list[tuple[int, str, nn.Module]]:
    """(layer index, path in layer, module to patch) chosen by `sel`; UserError for what matches nothing."""
    if sel.layers is not None:
        missing = [i for i in sel.layers if i >= len(layers)]
        if missing:
            raise UserError(f"kernels.{sel.op}.layers: layer {missing[0]} does not exist; the model has layers 0-{len(layers) - 1}")
    indices = range(len(layers)) if sel.layers is None else sel.layers
    chosen, seen_paths, used = [], set(), set()
    for index in indices:
        for path, module in CANDIDATES[sel.op](layers[index]):
            seen_paths.add(path)
            hits = [p for p in sel.modules if fnmatch.fnmatchcase(path, p)]
            if sel.modules and not hits:
                continue
            used.update(hits)
            chosen.append((index, path, module))
    for pattern in sel.modules:
        if pattern not in used:
            raise UserError(f"kernels.{sel.op}.modules: {pattern!r} matches no {sel.op} module; candidates in a decoder "
                            f"layer: {', '.join(sorted(seen_paths)) or 'none'}")
    return chosen


def revert_kernels(model: nn.Module) -> None:
    """Undo apply_kernels on `model` (no-op if nothing is applied)."""
    report = model.__dict__.pop("_tiletune_kernels", None)
    if report is not None:
        report.revert()


# ---- warmup ---------------------------------------------------------------------------------------


def _static_shapes(op: str, module: nn.Module) -> tuple:
    """The static dimensions a kernel for `module` is compiled for."""
    if op == "rms_norm":
        return (module.weight.shape[-1], _eps(module))
    if op == "swiglu":
        return (module.gate_proj.out_features,)
    if op in ("rope", "attention"):
        head_dim = module.head_dim
        heads = (module.q_proj.out_features // head_dim, module.k_proj.out_features // head_dim, head_dim)
        return heads + ((module.scaling,) if op == "attention" else ())
    if op == "lora_linear":
        rank = module.lora_A[next(a for a in module.active_adapters if a in module.lora_A)].out_features
        return (module.base_layer.out_features, module.base_layer.in_features, rank)
    module = getattr(module, "base_layer", module)  # linear on a PEFT wrapper runs on its base layer
    return (module.out_features, module.in_features)


def _run_once(op: str, shapes: tuple, impl: str, dtype: torch.dtype) -> None:
    """Forward + backward of `op` on one token with these static shapes, strict: compiles its kernels."""
    from tiletune.kernels import attention, linear, lora_linear, rms_norm, rope, swiglu

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    if op == "rms_norm":
        out = rms_norm.rms_norm(rand(1, shapes[0]), rand(shapes[0]), shapes[1], impl, True)
    elif op == "swiglu":
        out = swiglu.swiglu(rand(1, shapes[0]), rand(1, shapes[0]), impl, True)
    elif op == "rope":
        heads_q, heads_k, d = shapes
        cos, sin = torch.randn(2, 1, 1, d, device="cuda", dtype=dtype)
        out = sum(t.sum() for t in rope.rope(rand(1, heads_q, 1, d), rand(1, heads_k, 1, d), cos, sin, impl, True))
    elif op == "attention":
        heads_q, heads_kv, d, scale = shapes
        out = attention.attention(rand(1, heads_q, 1, d), rand(1, heads_kv, 1, d), rand(1, heads_kv, 1, d), scale, impl, True)
    elif op == "lora_linear":
        out_f, in_f, rank = shapes
        out = lora_linear.lora_linear(rand(1, in_f), rand(out_f, in_f).detach(), None, rand(rank, in_f), rand(out_f, rank),
                                      2.0, impl, True)
    else:
        out = linear.linear(rand(1, shapes[1]), rand(*shapes), None, impl, True)
    out.float().sum().backward()


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
        _, layers = decoder_layers(model) if spec.ops else ("", nn.ModuleList())
        wanted = {}
        for e in report.entries:
            if e.op in MODEL_LEVEL_OPS:  # linear_cross_entropy runs on the vendor GEMMs: nothing to compile
                continue
            wanted.setdefault((e.op, e.impl, _static_shapes(e.op, layers[e.layer].get_submodule(e.module))), None)
    finally:
        report.revert()
    done = []
    for op, impl, shapes in wanted:
        if impl == REFERENCE:
            continue
        reason = registry.get(op, impl).unavailable()
        if reason:
            raise UserError(f"kernels warmup: {op} implementation {impl!r} cannot run here: {reason}")
        _run_once(op, shapes, impl, dtype)
        done.append(f"{op} {impl} {'x'.join(str(s) for s in shapes)} {str(dtype).removeprefix('torch.')}")
    return done
