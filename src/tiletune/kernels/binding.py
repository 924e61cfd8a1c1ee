"""Where an op goes in a model: the `Binding` record an op module declares, and the `Site` it binds to.

The engine (tiletune.patch) walks a model through its family record (tiletune.families) and yields
sites by *role*: each norm, the MLP, the attention module (for its rotary embedding and for attention
itself), every Linear, every Linear with a quantized weight, every peft LoRA Linear (over a plain or a
quantized base), the MoE experts, the
lm_head with the loss. A binding
names the role it replaces, says why a site does not fit (reported, never silent), builds the forward
it installs, and the static dimensions its compiled kernels are keyed by. The engine installs the
forward on the site's module and reverts it; it knows no op by name.

Also here: the small pieces of forward surgery bindings share (autocast, a forward with one global
replaced).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# A decoder layer's roles in the order data meets them; model-level roles are bound on the causal LM.
ROLES = ("norm", "mlp", "rotary", "attention", "linear", "quantized_linear", "lora_linear", "quantized_lora_linear",
         "experts", "lm_head")
MODEL_ROLES = ("lm_head",)


@dataclass(frozen=True)
class Site:
    """One place a binding may go: its role, decoder layer (-1: the model), path, module and family part."""

    role: str
    layer: int
    path: str  # inside the decoder layer; for model-level roles, the attribute on the causal LM
    module: nn.Module  # the module whose forward is replaced
    part: Any = None  # the family record's description of it (a Norm, Mlp, Attention, LmHead, ...)


@dataclass(frozen=True)
class Binding:
    """How one op binds to one role.

    forward(site, impl, strict, current) -> the function installed as the module's forward (it takes
    `self` first); `current` is the function behind the module's forward now (the class's, or an earlier
    binding's on the same module), for bindings that compose or keep the stock path.
    fit(site) -> why the op can never stand in at this site (not installed; the reason is reported).
    unfit_now(module) -> why the installed forward runs the stock path right now (it re-checks every call,
    as for a LoRA Linear whose adapters are disabled later); reported as the patch-time fallback.
    compile_key(site) -> the static dimensions its kernels are compiled for (None: nothing to compile);
    warm(key, impl, dtype) -> a differentiable output of the op on one token with those dimensions, on
    the GPU, so that `tiletune kernels warmup` compiles forward and backward.
    supersedes: ops whose sites at the same (layer, path) this op takes when both are selected.
    applies(site) -> whether the site is this op's at all (a SiLU op and a GELU op share the mlp role: each applies
    to its own activation's MLPs); a site it does not apply to is no candidate and gets no report entry.
    """

    op: str
    role: str
    forward: Callable[[Site, str, bool, Callable], Callable]
    fit: Callable[[Site], str | None] = lambda site: None
    unfit_now: Callable[[nn.Module], str | None] | None = None
    compile_key: Callable[[Site], tuple] | None = None
    warm: Callable[[tuple, str, torch.dtype], torch.Tensor] | None = None
    supersedes: tuple[str, ...] = ()
    applies: Callable[[Site], bool] = lambda site: True

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"binding of {self.op!r}: unknown role {self.role!r}; roles: {', '.join(ROLES)}")


# ---- forward surgery shared by bindings --------------------------------------------------------------


def autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors cast to the autocast dtype as F.linear or SDPA would (custom ops are not autocast); None stays."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None else None for t in tensors)


def head_weight(head: nn.Module) -> torch.Tensor:
    """The lm_head's weight on the device the loss runs on: a head kept in host memory
    (`tiletune.train.host_tables`) hands over the copy its forward sent ahead."""
    fetch = getattr(head, "fetch_weight", None)
    return fetch() if fetch is not None else head.weight


HEAD_READ_IN_SLICES = "_tiletune_head_read_in_slices"  # set on the lm_head while such a loss's forward runs


@contextlib.contextmanager
def head_read_in_slices(head: nn.Module):
    """Within: the loss will read `head.weight` where it lies, a slice at a time, so a head kept in host memory
    sends no whole copy ahead (`tiletune.train.host_tables`)."""
    head.__dict__[HEAD_READ_IN_SLICES] = True
    try:
        yield
    finally:
        head.__dict__.pop(HEAD_READ_IN_SLICES, None)


class SideCopy:
    """`tensor` copied to `device` on the side `stream`, so the copy runs beside the work queued on the current
    stream; `take()` hands it over once it has arrived. (Host-kept weights: the lm_head's prefetch, the streamed
    loss's vocabulary slices.)"""

    def __init__(self, tensor: torch.Tensor, device: torch.device, stream: torch.cuda.Stream):
        with torch.cuda.stream(stream):
            self.copy = tensor.to(device, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(stream)

    def take(self) -> torch.Tensor:
        """The copy, for work queued on the current stream from here on."""
        current = torch.cuda.current_stream(self.copy.device)
        current.wait_event(self.arrived)
        self.copy.record_stream(current)  # allocated on the side stream, freed after the work queued on this one
        return self.copy


def innermost(func: Callable) -> Callable:
    """The function under every functools.wraps decorator layer."""
    while hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return func


def calls_global(func: Callable, name: str) -> bool:
    """Whether `func` (under its decorators) refers to the module-level name `name`."""
    return name in innermost(func).__code__.co_names


def replacing_global(name: str, replacement: Callable[[Any, str, bool], Any]) -> Callable:
    """A Binding.forward that installs a copy of the module's current forward whose global `name` (a function
    or table transformers' forward calls) is `replacement(stock value, impl, strict)`. One copy per (forward,
    impl, strict), so bindings on the same module compose (rope and attention) and repeated applies reuse it."""

    @functools.cache
    def copy_of(func: Callable, impl: str, strict: bool) -> Callable:
        return with_global(func, name, replacement(innermost(func).__globals__[name], impl, strict))

    return lambda site, impl, strict, current: copy_of(current, impl, strict)


def with_global(func: Callable, name: str, value: Any) -> Callable:
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
        new_inner = with_global(inner, name, value)
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


def warm_tensor(*shape: int, dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    """A random GPU tensor for a binding's `warm` (compiling kernels for given dimensions)."""
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)
