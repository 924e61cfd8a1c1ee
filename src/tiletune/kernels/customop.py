"""One op signature -> the custom ops ``tiletune::<op>`` and ``tiletune::<op>_backward``.

Both take the op's arguments plus the implementation name and ``strict``, run whichever implementation
`registry.select` picks for those inputs, and have fake kernels, so autograd works and torch.compile
treats them as opaque (TileLang itself cannot be traced). The op module says what differs between ops
in one `Signature`; everything else (schemas, selection, saving for the backward, autograd) is here.

The ops are registered through `torch.library.Library` (schema, one kernel for every backend, a fake, and an
autograd kernel: an `autograd.Function` that calls the op below autograd), not `torch.library.custom_op`, whose
Python wrappers (default filling, aliasing checks, a dynamo guard around the kernel) cost 35-125 us more host time
a forward + backward on an H100 machine (benchmarks/results/h100-2026-12-07d: both registrations in one call): time
the GPU waited in the MoE step while its host set the pace. The ops stay visible to dispatch modes (selective
checkpointing keeps their outputs) and pass `torch.library.opcheck` (tests/kernels/test_customop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tiletune.kernels.library import KernelMissing
from tiletune.kernels.registry import backward_of, fallback, note_fallback, select


@dataclass(frozen=True)
class Signature:
    """What differs between ops' custom ops.

    inputs / outputs: schema text of the forward, e.g. "Tensor x, Tensor weight, float eps" and "Tensor".
    backward_inputs / backward_outputs: the backward op's arguments after the output gradients, and its results.
    fake / backward_fake: empty outputs of the right shapes from the (backward) arguments.
    save(inputs, outputs, needs_input_grad): the backward's arguments after the output gradients.
    judged_on(grads, saved): the forward-shaped inputs the backward's implementation is selected by.
    grad_of: for each forward input, the index of its gradient among the backward's results (None: none).
    differentiable: the first n outputs take gradients; the others are marked non-differentiable.
    layout: applied to every tensor an implementation returns (default: contiguous).
    A gradient the backward does not compute (None) leaves the op as an empty tensor like the first gradient.
    """

    name: str
    inputs: str
    outputs: str
    backward_inputs: str
    backward_outputs: str
    fake: Callable
    backward_fake: Callable
    save: Callable
    judged_on: Callable
    grad_of: tuple[int | None, ...]
    differentiable: int = 1
    layout: Callable[[Tensor], Tensor] = Tensor.contiguous


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


_LIBRARY = torch.library.Library("tiletune", "FRAGMENT")  # kept alive: the registrations live as long as it does


def make_custom_op(sig: Signature):
    """Register ``tiletune::<name>`` and ``tiletune::<name>_backward`` with fakes and autograd; returns the forward op."""
    grads_schema = ", ".join(f"Tensor grad{i}" for i in range(sig.differentiable))

    def forward(*args):
        *inputs, impl, strict = args
        chosen = select(sig.name, impl, strict, *inputs)
        outputs = _run_or_fall_back(sig.name, impl, strict, chosen.forward, fallback(sig.name).forward, inputs)
        return _finish(outputs, sig.layout, None)

    def backward(*args):
        *rest, impl, strict = args
        grads, saved = rest[: sig.differentiable], rest[sig.differentiable :]
        chosen = select(sig.name, impl, strict, *sig.judged_on(grads, saved))
        outputs = _run_or_fall_back(sig.name, impl, strict, backward_of(chosen), backward_of(fallback(sig.name)),
                                    (*grads, *saved))  # fmt: skip
        return _finish(outputs, sig.layout, grads[0])

    forward_op = _define(sig.name, f"({sig.inputs}, str impl, bool strict) -> {sig.outputs}", forward,
                         lambda *args: sig.fake(*args[:-2]))  # fmt: skip
    backward_op = _define(f"{sig.name}_backward",
                          f"({grads_schema}, {sig.backward_inputs}, str impl, bool strict) -> {sig.backward_outputs}",
                          backward, lambda *args: sig.backward_fake(*args[:-2]))  # fmt: skip

    def autograd_forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = forward_op(*args)
        *inputs, ctx.impl, ctx.strict = args
        outputs = _as_tuple(output)
        ctx.mark_non_differentiable(*outputs[sig.differentiable :])
        saved = sig.save(inputs, outputs, ctx.needs_input_grad)
        ctx.tensor_slots = [i for i, value in enumerate(saved) if isinstance(value, Tensor)]
        ctx.constants = [None if isinstance(value, Tensor) else value for value in saved]
        ctx.save_for_backward(*(saved[i] for i in ctx.tensor_slots))
        return output

    def autograd_backward(ctx, *grads):
        saved = list(ctx.constants)
        for slot, tensor in zip(ctx.tensor_slots, ctx.saved_tensors, strict=True):
            saved[slot] = tensor
        results = _as_tuple(backward_op(*grads[: sig.differentiable], *saved, ctx.impl, ctx.strict))
        input_grads = tuple(None if index is None or not ctx.needs_input_grad[i] else results[index]
                            for i, index in enumerate(sig.grad_of))
        return (*input_grads, None, None)

    # named per op: its graph nodes read `tiletune_<op>Backward` in tracebacks and profiles
    autograd = type(f"tiletune_{sig.name}", (torch.autograd.Function,),
                    {"forward": staticmethod(autograd_forward), "backward": staticmethod(autograd_backward)})

    def autograd_kernel(*args):
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
            return autograd.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return forward_op(*args)

    _LIBRARY.impl(sig.name, autograd_kernel, "Autograd")
    return forward_op


def _define(name: str, schema: str, kernel: Callable, fake: Callable):
    """``tiletune::<name>`` with `schema`, `kernel` for every backend and `fake` for fake tensors: its default
    overload."""
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tiletune::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.tiletune, name).default


def _run_or_fall_back(op: str, impl: str, strict: bool, run: Callable, instead: Callable, args: tuple):
    """`run(*args)`, or the op's fallback `instead(*args)` when a kernel the loaded kernel library lacks cannot be
    compiled here (the reason counted like every fallback; raised under strict)."""
    try:
        return run(*args)
    except KernelMissing as missing:
        if strict:
            raise
        note_fallback(op, impl, str(missing))
        return instead(*args)


def _finish(outputs, layout: Callable[[Tensor], Tensor], empty_like: Tensor | None):
    """Each output tensor in the op's layout; a missing gradient (None) as an empty tensor like `empty_like`."""
    finished = tuple(empty_like.new_empty(0) if out is None else layout(out) for out in _as_tuple(outputs))
    return finished if isinstance(outputs, tuple) else finished[0]
