"""The open set of ops: each op's definition, its implementations, availability and fallback reasons.

An op module (or a user plugin) calls `define(Op(...))` once and `add(Impl(...))` per implementation;
`load_ops()` imports every module of this package, so adding an op is adding a module. Every op has a
``reference`` implementation (PyTorch, the semantics). The custom ops call `select` on every call: it
returns the requested implementation when it can run these inputs, else the reference, and counts the
reason (``strict`` raises instead).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiletune.kernels.binding import Binding

REFERENCE = "reference"
PREFERRED = ("tilelang", "chunked")  # what `kernels: all` (or an op without `impl`) chooses, first found

log = logging.getLogger("tiletune.kernels")

# True while a decoder layer under selective activation checkpointing runs its forward or its recomputation
# (`tiletune.train.recompute`): a layer that runs its cheap work again may have an op keep its inputs for the backward
# instead of wider intermediates it can compute again (moe_experts' gate_up rows)
_SELECTIVE_LAYER = contextvars.ContextVar("tiletune_selective_layer", default=False)


@contextlib.contextmanager
def selective_layer() -> Iterator[None]:
    """Mark the code inside as a selective layer's forward or recomputation (`in_selective_layer`)."""
    token = _SELECTIVE_LAYER.set(True)
    try:
        yield
    finally:
        _SELECTIVE_LAYER.reset(token)


def in_selective_layer() -> bool:
    """Whether a selective layer's forward or recomputation is running in this context."""
    return _SELECTIVE_LAYER.get()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a checkpointed layer's recomputation runs
    there, where the values of a layer's last output are read by nothing (only the tensors its ops save are)."""
    import torch  # this module is read before torch is needed (the CLI's help)

    return torch._C._current_graph_task_id() != -1


class KernelUnavailable(RuntimeError):
    """Raised under ``strict`` when the requested implementation cannot run an input."""


@dataclass(frozen=True)
class Op:
    """What the engine and the tools know of an op, besides its implementations.

    bindings: where in a model it goes (tiletune.kernels.binding). opt_in: `kernels: all` leaves it out
    until named (an op not yet measured faster than PyTorch's own). keeps_output: selective activation
    checkpointing keeps its outputs as it keeps a matmul's (those of its `forms` too: the custom ops of its other forms,
    selected through its binding, as moe_experts' LoRA form). profile_pattern: a regex naming its device
    kernels, for `tiletune bench --profile`. lowering: arch -> {kernel name: PrimFunc builder}, for
    `tiletune kernels lower` (None: no TileLang kernels). default: the implementation `kernels: all` picks when
    it is not the first of PREFERRED (a new kernel is selected by name until a GPU run has checked it). fallback: the
    implementation that runs an input the selected one cannot (the reference, unless a form that stays lean
    everywhere exists: linear_cross_entropy's chunked loop, so no machine forms the whole logits).
    """

    name: str
    bindings: tuple[Binding, ...] = ()
    opt_in: bool = False
    keeps_output: bool = False
    forms: tuple[str, ...] = ()
    profile_pattern: str | None = None
    lowering: Callable[[str], dict[str, Callable]] | None = None
    default: str | None = None
    fallback: str = REFERENCE

    @property
    def role_rank(self) -> int:
        """Where the op's first binding sits in a decoder layer's order of roles (listing order)."""
        from tiletune.kernels.binding import ROLES

        return min((ROLES.index(b.role) for b in self.bindings), default=len(ROLES))


@dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    forward/backward take the same arguments as the op's reference (see each op module).
    backward=None means the reference backward is used (same math, so a forward-only plugin
    still trains). accumulation names the dtype its arithmetic runs in, which `tiletune verify`
    compares with the stock implementation's. unavailable() says why it cannot run on this machine at all; unsupported(*inputs)
    why it cannot run these particular inputs (dtype, shape, device); None means it can.
    """

    op: str
    name: str
    forward: Callable
    backward: Callable | None = None
    unavailable: Callable[[], str | None] = lambda: None
    unsupported: Callable[..., str | None] = lambda *inputs: None
    description: str = ""
    accumulation: str = "unknown"  # the dtype its reductions/arithmetic run in ("float32", "input dtype")


_ops: dict[str, Op] = {}
_impls: dict[str, dict[str, Impl]] = {}
# (op, impl, reason) -> number of calls that fell back (to the op's fallback implementation) for that reason.
runtime_fallbacks: dict[tuple[str, str, str], int] = {}


def define(op: Op) -> Op:
    """Add (or redefine) an op; its implementations are added with `add`."""
    _ops[op.name] = op
    _impls.setdefault(op.name, {})
    return op


def define_form(name: str) -> None:
    """Make room for the implementations of a second custom op of a defined op (moe_experts' LoRA form): it is
    selected through its op's binding and spec, so it has no Op record and is not listed among the ops."""
    _impls.setdefault(name, {})


def add(impl: Impl) -> Impl:
    """Add (or replace) an implementation of a defined op."""
    if impl.op not in _impls:
        raise ValueError(f"unknown op {impl.op!r}; ops: {', '.join(_ops)}")
    _impls[impl.op][impl.name] = impl
    return impl


def register(op: str, name: str, *, backward: Callable | None = None,
             unsupported: Callable[..., str | None] | None = None, description: str = "",
             accumulation: str = "unknown"):
    """Decorator for plugins: register `forward` as implementation `name` of `op`.

    The function takes the op's reference forward arguments and returns the same outputs, e.g.::

        @tiletune.kernels.register("rms_norm", "mine")
        def my_rms_norm(x, weight, eps, offset): ...

    Then ``kernels: {rms_norm: mine, plugins: [my_pkg.kernels]}`` uses it.
    """
    if name == REFERENCE:
        raise ValueError("the name 'reference' is reserved for the PyTorch reference implementation")
    load_ops()

    def decorate(forward: Callable) -> Callable:
        add(Impl(op, name, forward, backward, unsupported=unsupported or (lambda *inputs: None),
                 description=description or (forward.__doc__ or "").strip().split("\n")[0],
                 accumulation=accumulation))
        return forward

    return decorate


@functools.cache
def load_ops() -> None:
    """Import every module of tiletune.kernels (once): each op module defines its op and implementations."""
    import tiletune.kernels

    for module in pkgutil.iter_modules(tiletune.kernels.__path__, "tiletune.kernels."):
        importlib.import_module(module.name)


def ops() -> dict[str, Op]:
    """Every defined op by name, in a decoder layer's order of roles (norm, mlp, rotary, ...)."""
    load_ops()
    return dict(sorted(_ops.items(), key=lambda item: item[1].role_rank))


def __getattr__(name: str):
    """OPS (every op name) and OPT_IN (those `kernels: all` leaves out): computed, as plugins add ops."""
    if name == "OPS":
        return tuple(ops())
    if name == "OPT_IN":
        return tuple(n for n, op in ops().items() if op.opt_in)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def impls(op: str) -> dict[str, Impl]:
    """The implementations of `op` by name."""
    load_ops()
    return _impls[op]


def default_impl(op: str) -> str:
    """The implementation `kernels: all` picks for `op`: its record's default, else the first of PREFERRED it has,
    else the reference."""
    record = ops().get(op)  # a second form (define_form) has no record: it follows PREFERRED
    return (record and record.default) or next((name for name in PREFERRED if name in impls(op)), REFERENCE)


def get(op: str, name: str) -> Impl:
    """Implementation `name` of `op`; KeyError naming what exists."""
    found = impls(op).get(name)
    if found is None:
        raise KeyError(f"op {op!r} has no implementation {name!r}; it has: {', '.join(sorted(impls(op)))}")
    return found


def unrunnable(op: str, name: str, *inputs) -> str | None:
    """Why implementation `name` of `op` cannot run these inputs here, or None (the reference always can)."""
    impl = get(op, name)
    return None if name == REFERENCE else impl.unavailable() or impl.unsupported(*inputs)


def select(op: str, name: str, strict: bool, *inputs) -> Impl:
    """The implementation to run for these inputs: `name` if it can, else the op's fallback, the reference unless
    its record names another (reason kept)."""
    impl = get(op, name)
    reason = unrunnable(op, name, *inputs)
    if reason is None:
        return impl
    if strict:
        raise KernelUnavailable(f"{op}: implementation {name!r} cannot run here ({reason}) and strict is set")
    note_fallback(op, name, reason)
    return fallback(op)


def fallback(op: str) -> Impl:
    """The implementation `op` falls back to: its record's `fallback`, the reference for a second form
    (define_form), which has no record."""
    record = _ops.get(op)
    return _impls[op][record.fallback if record else REFERENCE]


def note_fallback(op: str, name: str, reason: str) -> None:
    """Count a call of `op` that did not run implementation `name` (the op's fallback or a stock forward ran
    instead), and log `reason` the first time."""
    key = (op, name, reason)
    if key not in runtime_fallbacks:
        log.warning("tiletune: %s falls back from %s: %s", op, name, reason)
    runtime_fallbacks[key] = runtime_fallbacks.get(key, 0) + 1


def backward_of(impl: Impl) -> Callable:
    """The backward to run for `impl` (its own, or the reference's)."""
    return impl.backward or _impls[impl.op][REFERENCE].backward
