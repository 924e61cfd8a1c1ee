"""Recomputation on a memory budget: `gradient_checkpointing: auto`.

Each decoder layer gets one of four treatments:

- ``keep``: not checkpointed; what its backward needs stays in memory from its forward.
- ``selective``: PyTorch's selective activation checkpointing; the outputs of matmuls and attention are
  kept, the cheap elementwise ops (norms, RoPE, the activation, casts) run again in the backward. The layer runs
  marked (`registry.selective_layer`): moe_experts then keeps its input instead of its [routes, 2·intermediate]
  gate_up rows and runs that grouped GEMM again in the backward.
- ``offload``: not checkpointed; what its backward needs waits in pinned host memory (`tiletune.train.offload`)
  and comes back while a later layer's backward runs. Only with ``gradient_checkpointing_offload``.
- ``recompute``: full checkpointing; only the layer's input is kept and its whole forward runs again.
  With ``gradient_checkpointing_offload`` and re-entrant checkpointing that input waits on the host too.

A probe step on the training shape (batch x cutoff_len random tokens, the kernels already patched in)
measures what one layer holds under ``keep`` and under ``selective``, and the step's peak with every
other layer recomputed. When every decoder layer is alike (a Llama's, a Qwen's; not Gemma 3's mix of sliding and
global attention, nor DeepSeek's dense first layers) the probe runs the first PROBE_LAYERS of them and adds what
each other recomputed layer holds (its input, unless that waits on the host, and its gradients): a 70B's probes at
90k tokens take seconds, not a whole step's minutes each. The plan then gives as many layers as the budget allows a treatment that
recomputes no matmul (the cheaper of the two in memory), upgrades ``selective`` layers to ``keep`` with
what is left, and recomputes the rest. The layers spared are the last ones: the backward reaches them
first, so their memory is free again before any recomputed layer runs its forward a second time. The plan fills
the budget less a margin (MARGIN) of what the step allocates beyond its static tensors (`usable_bytes`).

Offloading costs no device memory beyond one layer in flight, but the host link must carry a layer's
tensors while the layers after it compute: the probe also times one layer's forward and the link, and
every n-th layer is offloaded, n = ceil(copy time / forward time), so the copies keep pace with the
compute in both directions (a layer's tensors go out during the forward of the n layers above it, and
come back during their backward). The other layers share the budget with that layer in flight: it is on the
device beside the spared layers below the layer whose backward brings it back, not beside the layers higher up, whose
memory is free again by then (`held_beyond_base` walks the layers to find the highest point).

When even every layer recomputed does not fit (a budget below the weights plus one layer's working set,
or a long sequence), the planner pulls `levers_for(model)`, cheapest first, and probes again after each: the
frozen input embedding table to host memory (`tiletune.train.host_tables`: a CPU gather and a 64 MiB copy per
step at 8,192 tokens), the frozen lm_head to host memory (copied back on a side stream during each forward,
held on the GPU from the forward's start to the loss; its cost hides behind the forward, so it is pulled as
soon as the budget makes any layer recompute, not only when nothing else fits), then the MLPs in 2, 4, ...
chunks of tokens (`tiletune.train.tiled_mlp`: one more MLP forward per layer, none inside a re-entrant
checkpoint where the MLP's output only joins the residual sum and it draws no dropout; the fewest chunks that fit). A
lever whose probe shows no lower peak is undone, with the rest of its kind (the peak is where it does not
reach). A probe that itself runs out of memory (its two spared layers at a long sequence) counts as not
fitting; once no lever is left it runs again with every layer recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tiletune.errors import UserError
from tiletune.train.host_tables import (embedding_to_device, embedding_to_host, head_to_device, head_to_host,
                                        why_head_not_on_host, why_not_on_host)
from tiletune.train.tiled_mlp import chunks_of, mlp_chunks, tile_mlp, untile_mlp

log = logging.getLogger("tiletune")

GIB = 2**30
# of what the step allocates beyond its static tensors (the budget less the weights on the device, their gradients and
# the optimizer state), left for the allocator's fragmentation and what the probe cannot see: the fragmentation comes
# from the step's churn, not from the weights allocated once (Qwen3-30B-A3B's 12 layers: 15.3 GiB of weights in a
# 16.3 GiB budget; 5% of the whole budget would have left no room for the 1 GiB of activations)
MARGIN = 0.05
TREATMENTS = ("keep", "selective", "offload", "recompute", "recompute_device")
HOST_SHARE = 0.5  # of the host memory available at planning time, what offloaded tensors may take by default


@dataclass
class RecomputePlan:
    """The treatment of every decoder layer and the measurements it was chosen from (bytes)."""

    treatments: list[str]
    budget_bytes: int
    base_bytes: int  # the step's peak with every layer recomputed, optimizer state included
    keep_bytes: int  # what one layer holds between its forward and its backward, per treatment
    selective_bytes: int
    measured_on: str
    input_bytes: int = 0  # one layer's input (hidden states): what a recomputed layer holds
    offload_inputs: bool = False  # recomputed layers' inputs wait in host memory
    offload_bytes: int = 0  # what one offloaded layer moves each way (its saved tensors and its input)
    offload_every: int = 0  # every n-th layer is offloaded, its tensors coming back during the n layers above
    layer_forward_ms: float = 0.0
    host_link_gb_s: float = 0.0
    levers: list[str] = field(default_factory=list)  # what else was done to fit the budget (`levers_for`)

    @property
    def counts(self) -> dict[str, int]:
        return {t: self.treatments.count(t) for t in TREATMENTS}

    @property
    def held_bytes(self) -> dict[str, int]:
        """What one layer holds on the device beyond `base_bytes`, per treatment (an offloaded layer: only in flight)."""
        extra = self.input_bytes if self.offload_inputs else 0  # a spared layer's input no longer counted in base
        return {"keep": self.keep_bytes + extra, "selective": self.selective_bytes + extra, "offload": 0, "recompute": 0,
                "recompute_device": self.input_bytes}  # fmt: skip

    @property
    def predicted_peak_bytes(self) -> int:
        return self.base_bytes + held_beyond_base(self.treatments, self.held_bytes, self.offload_bytes, self.offload_every)

    def summary(self) -> str:
        counts = ", ".join(f"{n} {t}" for t, n in self.counts.items() if n)
        offload = ""
        if self.offload_bytes:
            offload = (f"; offloaded layers move {self.offload_bytes / GIB:.2f} GiB each way over a "
                       f"{self.host_link_gb_s:.0f} GB/s host link, a layer's forward takes {self.layer_forward_ms:.1f} ms"
                       + (", recomputed layers' inputs wait on the host" if self.offload_inputs else ""))  # fmt: skip
        levers = f"; to fit: {', '.join(self.levers)}" if self.levers else ""
        return (f"gradient_checkpointing auto: {counts}{levers} (layer holds {self.keep_bytes / GIB:.2f} GiB kept, "
                f"{self.selective_bytes / GIB:.2f} GiB selective{offload}; peak {self.predicted_peak_bytes / GIB:.1f} GiB "
                f"predicted of a {self.budget_bytes / GIB:.1f} GiB budget)")  # fmt: skip

    def to_dict(self) -> dict:
        return {**asdict(self), "counts": self.counts, "predicted_peak_bytes": self.predicted_peak_bytes}


def held_beyond_base(treatments: list[str], held: dict[str, int], offload_bytes: int = 0, distance: int = 1) -> int:
    """The most the layers' treatments hold at once beyond the all-recomputed step's peak (bytes).

    At the loss every layer holds what its treatment keeps (`held`, bytes per treatment). While layer p runs its
    backward, the layers below it hold theirs, and an offloaded layer fewer than `distance` + 1 below p is on the
    host link with its `offload_bytes` on the device (it starts back when the backward reaches the layer `distance`
    above it); what p itself kept is its backward's working set, which the all-recomputed peak already holds (the
    recomputed layer's forward run again). Offloaded layers go out during the forward of the `distance` layers above
    them, before the loss. Gemma-3-12B's 16 layers with 5 offloaded (H100): 15.54 and 16.90 GiB measured, 15.42 and
    16.78 predicted this way, 16.56 and 17.61 when layer p's own bytes counted too
    (benchmarks/results/h100-2026-12-07b/gemma-budgets-0e859bb)."""
    peak = sum(held.get(treatment, 0) for treatment in treatments)
    held_below = 0
    for p, treatment in enumerate(treatments):
        in_flight = sum(offload_bytes for t in treatments[max(0, p - distance):p] if t == "offload")
        peak = max(peak, held_below + in_flight)
        held_below += held.get(treatment, 0)
    return peak


def choose_treatments(layers: int, keep_bytes: int, selective_bytes: int, free_bytes: int,
                      offload_every: int = 0, offload_bytes: int = 0, max_offloaded: int | None = None) -> list[str]:  # fmt: skip
    """Treatments, first layer to last, that spare the most matmul recomputation within `free_bytes`.

    With `offload_every` = n > 0 and room for one offloaded layer in flight (`offload_bytes`), every n-th
    layer from the first is offloaded (at most `max_offloaded`, none of the top n, which have no layer far
    enough above them to start their prefetch); the other layers are spared from the top down (the cheaper
    treatment first, then upgraded to ``keep``) while what they hold, with an offloaded layer in flight beside
    the spared layers below it, fits (`held_beyond_base`).
    """
    offloaded: list[int] = []
    if offload_every > 0 and offload_bytes <= free_bytes:
        offloaded = list(range(0, layers - offload_every, offload_every))[:max_offloaded]
    others = layers - len(offloaded)
    first_spared = "selective" if selective_bytes < keep_bytes else "keep"
    held = {"keep": keep_bytes, "selective": selective_bytes}

    def plan(spared: int, upgrades: int) -> list[str]:
        treatments = ["recompute"] * (others - spared) + [first_spared] * (spared - upgrades) + ["keep"] * upgrades
        for index in offloaded:
            treatments.insert(index, "offload")
        return treatments

    def fits(treatments: list[str]) -> bool:
        return held_beyond_base(treatments, held, offload_bytes, offload_every) <= free_bytes

    spared = next((n for n in range(others, 0, -1) if fits(plan(n, 0))), 0)
    upgrades = next((n for n in range(spared, 0, -1) if fits(plan(spared, n))), 0) if first_spared == "selective" else 0
    return plan(spared, upgrades)


def offload_limit(host_bytes: int, layers: int, input_bytes: int, offload_bytes: int) -> int:
    """How many layers may be offloaded within `host_bytes` of host memory when every layer's input (`input_bytes`,
    0 where inputs stay on the device) waits there too: the inputs come first (a copy each, where an offloaded layer
    moves all it saved), offloaded layers get what is left, each in place of its input."""
    return max(0, host_bytes - layers * input_bytes) // max(offload_bytes - input_bytes, 1)


def place_recomputed_inputs(treatments: list[str], host_room: int, free_bytes: int, held: dict[str, int],
                            offload_bytes: int = 0, offload_every: int = 0) -> list[str]:  # fmt: skip
    """With recomputed layers' inputs waiting in host memory: the host holds at most `host_room` of them (the
    lowest layers'); the others keep theirs on the device (``recompute_device``), within `free_bytes` beside the
    spared layers and the offloaded layers in flight (`held` bytes per treatment, as `held_beyond_base` counts
    them), spared layers giving way (recomputed instead, lowest first) while they do not fit. ValueError when they
    do not fit with every layer recomputed."""
    treatments = list(treatments)
    input_bytes = held["recompute_device"]
    while True:
        recomputed = [i for i, t in enumerate(treatments) if t in ("recompute", "recompute_device")]
        for rank, index in enumerate(recomputed):
            treatments[index] = "recompute" if rank < host_room else "recompute_device"
        on_device = held_beyond_base(treatments, held, offload_bytes, offload_every)
        if on_device <= max(free_bytes, 0):  # below 0: the step fits the budget, not its margin; nothing more on the GPU
            return treatments
        spared = [i for i, t in enumerate(treatments) if t in ("keep", "selective")]
        if not spared:
            raise ValueError(f"host memory holds {host_room} layers' inputs and the GPU budget "
                             f"{max(free_bytes, 0) // max(input_bytes, 1)} more; {len(recomputed)} are recomputed")  # fmt: skip
        treatments[spared[0]] = "recompute"


def apply_treatments(layers, treatments: list[str], use_reentrant: bool, offload=None, offload_inputs: bool = False,
                     prefetch_distance: int = 1) -> None:  # fmt: skip
    """Set each decoder layer's checkpointing as its treatment says (transformers' per-layer switch).

    `offload` (a `tiletune.train.offload.ActivationOffload`) runs the ``offload`` layers, and with `offload_inputs`
    the re-entrant ``recompute`` ones; an offloaded layer's tensors start back when the backward reaches the
    layer `prefetch_distance` above it (a recomputed layer's input: the layer right above). With offloaded
    layers `prefetch_distance` apart, one is in flight while the one above is in use.
    """
    prefetch_at: dict[int, list[int]] = {}
    for index, (layer, treatment) in enumerate(zip(layers, treatments, strict=True)):
        if getattr(layer, "_tiletune_prefetch_hook", None) is not None:
            layer._tiletune_prefetch_hook.remove()
            layer._tiletune_prefetch_hook = None
        layer.gradient_checkpointing = treatment != "keep"
        if treatment == "selective":
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False, context_fn=_selective_contexts)
        elif treatment == "recompute" and offload is not None and offload_inputs and use_reentrant:
            recompute = functools.partial(checkpoint, use_reentrant=True)
            layer._gradient_checkpointing_func = functools.partial(offload.run, index, recompute)
            prefetch_at.setdefault(index + 1, []).append(index)
        elif treatment in ("recompute", "recompute_device"):  # the latter: its input stays on the device
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=use_reentrant)
        elif treatment == "offload":
            if offload is None:
                raise ValueError("the offload treatment needs an ActivationOffload")
            layer._gradient_checkpointing_func = functools.partial(offload.run, index, _call)
            prefetch_at.setdefault(index + prefetch_distance, []).append(index)
    for index, targets in prefetch_at.items():
        if index < len(layers):  # the layer the backward needs first goes first on the copy stream
            hook = _prefetch_hook(offload, sorted(targets, reverse=True))
            layers[index]._tiletune_prefetch_hook = layers[index].register_forward_hook(hook)


def _call(fn, *args):
    return fn(*args)


def _prefetch_hook(offload, targets: list[int]):
    """A forward hook: when the gradient reaches this layer's output, start bringing `targets` back."""

    def start_prefetch(grad):
        for target in targets:
            offload.prefetch(target)

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if module.training and hidden.requires_grad:
            hidden.register_hook(start_prefetch)

    return hook


@functools.cache
def _saved_ops() -> frozenset:
    """Ops whose outputs a selective layer keeps: matmuls, attention and tiletune's GEMM kernels."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    from tiletune.kernels import registry

    kept = [name for op in registry.ops().values() if op.keeps_output for name in (op.name, *op.forms)]
    ops |= {getattr(torch.ops.tiletune, name).default for name in kept}
    return frozenset(ops)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _as_selective_layer(context):
    """`context` (PyTorch's selective checkpointing) with the layer marked selective for the kernels inside it."""
    from tiletune.kernels import registry

    with context, registry.selective_layer():
        yield


def _selective_contexts():
    forward, recompute = create_selective_checkpoint_contexts(_selective_policy)
    return _as_selective_layer(forward), _as_selective_layer(recompute)


def plan_recomputation(model, batch: int, seq: int, dtype: torch.dtype, budget_gib: float | None,
                       use_reentrant: bool, offload: bool = False, probe_loss: Callable | None = None,
                       host_budget_gib: float | None = None) -> RecomputePlan:  # fmt: skip
    """Probe one step at (batch, seq), choose each layer's treatment within the budget, and apply it.

    The probe's loss is the LM loss on its random tokens, or `probe_loss(model, tokens)` where the stage's step
    computes another (a preference stage's log-prob head: `train.preference.recompute_probe`).

    With `offload`, layers that would be recomputed may have their saved tensors (and, under re-entrant
    checkpointing, their inputs) wait in pinned host memory instead, at most `host_budget_gib` of it (None:
    HOST_SHARE of the host memory free now); GPU only. When the step does not fit
    the budget even with every layer recomputed, the levers of `levers_for` are pulled one by one, cheapest
    first, until it does.
    """
    from tiletune.patch import decoder_layers

    path, layers = decoder_layers(model)
    depth = probe_depth(layers)
    device = next(layers.parameters()).device  # not the model's first parameter: the embeddings may be on the host
    on_gpu = device.type == "cuda"
    if offload and not on_gpu:
        log.warning("gradient_checkpointing_offload moves activations from a GPU to host memory; on %s it is off", device.type)
        offload = False
    if budget_gib is None and not on_gpu:
        budget = None
    elif budget_gib is None:
        budget = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    else:
        budget = int(budget_gib * GIB)
    offload_inputs = offload and use_reentrant  # a non-re-entrant checkpoint holds its inputs outside autograd's hooks
    activation_offload = None
    if offload:
        from tiletune.train.offload import ActivationOffload

        activation_offload = ActivationOffload(device, model.parameters())
    levers = [lever for lever in levers_for(model) if on_gpu and budget is not None and lever.why_not(model) is None]
    pulled: dict[str, str] = {}  # lever name -> what it did (a lever pulled again replaces its entry)
    spare = min(2, len(layers))
    before = None  # a _Before: the state from before the lever just pulled
    while True:
        with _first_layers(model, path, depth) as probed:
            probe = _probe_spared(model, probed, spare, batch, seq, dtype, device, use_reentrant, activation_offload,
                                  offload_inputs, probe_loss)  # fmt: skip
        base = probe.base(model, spare * offload_inputs, layers[depth:], offload_inputs) if probe else None
        usable = None if budget is None else usable_bytes(budget, _static_bytes(model, device))
        # the peak is elsewhere (the lever only costs time), or an eager lever's measured cost is more than the
        # recomputation it spares: undone
        if before is not None and (not _lowered(before.base, base) or (
                before.lever.eager and not _paid_off(before, probe, base, usable, len(layers), offload_inputs))):
            probe, base, usable, pulled = before.probe, before.base, before.usable, before.pulled
            before.undo()
            levers = [other for other in levers if other.name != before.lever.name]  # more would not help either
        before = None
        if budget is None or (base is not None and base <= usable):
            eager = [lever for lever in levers if lever.eager and spare
                     and _pays_off(lever, model, probe, base, len(layers), usable, offload_inputs, device)]  # fmt: skip
            if not eager:
                break
            lever = eager[0]  # the budget makes some layers recompute: a lever whose copy costs less spares some
            levers.remove(lever)
        elif levers:
            lever = levers.pop(0)
        elif spare and probe is None:  # the probe's spared layers alone do not fit: recompute them too
            spare = 0
            continue
        else:
            break
        before = _Before(probe, base, usable, dict(pulled), lever, lever.pull(model))
        pulled[lever.name] = lever.summary(model)
    if probe is None:
        raise UserError(f"the step at batch {batch} x {seq} tokens runs out of GPU memory even with every layer "
                        f"recomputed{' and ' + ', '.join(pulled.values()) if pulled else ''}; lower per_device_train_batch_size "
                        "or cutoff_len")  # fmt: skip
    keep_bytes, selective_bytes = probe.spared_bytes()
    plan = RecomputePlan([], 0, base, keep_bytes, selective_bytes, "cuda memory" if on_gpu else "saved tensors (CPU)",
                         input_bytes=probe.input_bytes, layer_forward_ms=probe.forward_ms, levers=list(pulled.values()))  # fmt: skip
    if budget is None:  # on the CPU, with no budget given, memory is not what limits: recompute nothing
        plan.treatments, plan.budget_bytes = ["keep"] * len(layers), base + len(layers) * keep_bytes
        apply_treatments(layers, plan.treatments, use_reentrant)
        log.info("%s", plan.summary())
        return plan
    plan.budget_bytes = budget
    offload_every, max_offloaded = 0, 0
    if offload:
        plan.offload_inputs = offload_inputs
        plan.offload_bytes = keep_bytes + probe.input_bytes
        plan.host_link_gb_s = _host_link_bytes_per_s(device, min(plan.offload_bytes, 256 * 2**20)) / 1e9
        copy_ms = plan.offload_bytes / (plan.host_link_gb_s * 1e9) * 1e3
        offload_every = max(1, math.ceil(copy_ms / max(probe.forward_ms, 1e-3))) if spare else 0
        plan.offload_every = offload_every
        host_bytes = _host_budget_bytes(host_budget_gib)
        max_offloaded = offload_limit(host_bytes, len(layers), probe.input_bytes if offload_inputs else 0, plan.offload_bytes)
    if budget < plan.base_bytes:
        raise UserError(
            f"gradient_checkpointing_budget={budget / GIB:.1f} GiB is below the {plan.base_bytes / GIB:.1f} GiB this step "
            f"needs with every layer recomputed{' and ' + ', '.join(pulled.values()) if pulled else ''}; raise the budget, "
            "or lower per_device_train_batch_size or cutoff_len"
        )
    free = usable_bytes(budget, _static_bytes(model, device)) - plan.base_bytes
    if free < 0:
        log.warning("the step needs %.1f GiB with every layer recomputed: within gradient_checkpointing_budget=%.1f GiB "
                    "but not its margin for fragmentation (%d%% of what the step allocates beyond the weights and "
                    "optimizer state), so the peak may pass the budget", plan.base_bytes / GIB, budget / GIB,
                    round(MARGIN * 100))  # fmt: skip
    if spare:
        held = plan.held_bytes
        plan.treatments = choose_treatments(len(layers), held["keep"], held["selective"], free, offload_every,
                                            plan.offload_bytes, max_offloaded)  # fmt: skip
    else:
        plan.treatments = ["recompute"] * len(layers)
    if plan.offload_inputs:
        host_room = (host_bytes - plan.treatments.count("offload") * plan.offload_bytes) // max(probe.input_bytes, 1)
        try:
            plan.treatments = place_recomputed_inputs(plan.treatments, max(host_room, 0), free, plan.held_bytes,
                                                      plan.offload_bytes, offload_every)  # fmt: skip
        except ValueError as err:
            raise UserError(f"the step at batch {batch} x {seq} tokens does not fit gradient_checkpointing_budget="
                            f"{budget / GIB:.1f} GiB: {err}; raise the budget, free host memory, or lower "
                            "per_device_train_batch_size or cutoff_len") from None  # fmt: skip
    apply_treatments(layers, plan.treatments, use_reentrant, activation_offload, plan.offload_inputs,
                     prefetch_distance=offload_every)  # fmt: skip
    if on_gpu:  # the probes' peaks (spared layers, levers tried) stay reserved otherwise: 20.6 GiB held for a step
        torch.cuda.empty_cache()  # of 15.4 (Qwen3-30B-A3B, 12 layers, within 16.3 GiB); the step reserves its own
    log.info("%s", plan.summary())
    return plan


@dataclass(frozen=True)
class Lever:
    """A way to lower the step's memory at some cost in time, pulled when recomputation is not enough, or, when
    `eager`, as soon as the budget makes layers recompute whose forwards cost more than the lever's copy from the
    host (`copied_bytes`, `_pays_off`). One that does not lower the probed peak (the peak is where it does not
    reach) is undone."""

    name: str
    why_not: Callable  # model -> the reason it cannot be pulled, or None
    pull: Callable  # model -> a callable that undoes it
    summary: Callable  # model -> what was done, for the plan's summary
    eager: bool = False
    copied_bytes: Callable = lambda model: 0  # model -> what it copies from the host each step, once pulled


class _Before(NamedTuple):
    """The planner's state before it pulled `lever` (`undo` puts the model back)."""

    probe: "_ProbeResult | None"
    base: int | None
    usable: int | None
    pulled: dict[str, str]
    lever: Lever
    undo: Callable


def _paid_off(before: _Before, probe: "_ProbeResult | None", base: int | None, usable: int | None, layers: int,
              offload_inputs: bool) -> bool:  # fmt: skip
    """Whether the eager lever pulled since `before` (where the step fitted) spares more recomputation (a layer's
    forward each) than it measurably added to the head and loss (`loss_ms`, probe to probe): the lm_head read in
    slices from the host cost 30-38 ms a step where its copy alone predicted 11 (Qwen3-30B-A3B, 12 layers, H100,
    benchmarks/results/h100-2026-12-06/moe12-90f0313)."""
    if before.probe is None or before.base is None or before.usable is None or before.base > before.usable:
        return True  # pulled to fit the budget, not to spare recomputation
    if probe is None or base is None or usable is None:
        return False
    spared = (_recomputed(before.probe, before.base, layers, before.usable, offload_inputs)
              - _recomputed(probe, base, layers, usable, offload_inputs))
    cost_ms = probe.loss_ms - before.probe.loss_ms
    log.info("gradient_checkpointing auto: %s spares %d recomputed layers (%.1f ms) for %.1f ms more in the loss",
             before.lever.name, spared, spared * probe.forward_ms, cost_ms)
    return spared * probe.forward_ms > cost_ms


def _lowered(before: int | None, after: int | None) -> bool:
    """Whether a lever lowered the probed peak, from `before` to `after` bytes (None: the probe ran out of memory)."""
    return after is not None and (before is None or after < before - 2**20)


def _recomputed(probe: _ProbeResult, base: int, layers: int, usable: int, offload_inputs: bool, freed: int = 0) -> int:
    """How many layers the plan `choose_treatments` makes within `usable` bytes (the budget less its margin), with
    `freed` more bytes, recomputes (a spared layer also holds its input when the recomputed ones' wait on the host)."""
    keep, selective = probe.spared_bytes()
    extra = probe.input_bytes if offload_inputs else 0
    free = usable - base + freed
    return choose_treatments(layers, keep + extra, selective + extra, free).count("recompute")


def _pays_off(lever: Lever, model, probe: _ProbeResult, base: int, layers: int, usable: int, offload_inputs: bool,
              device: torch.device) -> bool:  # fmt: skip
    """Whether an eager lever spares more recomputation (a layer's forward each, in the probe's time) than its copy
    from the host costs each step (an 8-layer MoE step: the lm_head's 11 ms copy would spare one layer's 5 ms)."""
    copied = lever.copied_bytes(model)
    spared = _recomputed(probe, base, layers, usable, offload_inputs) - _recomputed(
        probe, base, layers, usable, offload_inputs, freed=copied)
    if spared <= 0:
        return False
    copy_ms = copied / _host_link_bytes_per_s(device, min(copied, 256 * 2**20)) * 1e3  # spared > 0: copied > 0
    return spared * probe.forward_ms > copy_ms


def _mlp_lever(chunks: int) -> Lever:
    """The dense MLPs in `chunks` chunks of tokens; pulled again with more chunks while the step does not fit."""

    def why_not(model) -> str | None:
        from tiletune.patch import layer_modules

        mlps = layer_modules(model, "mlp")
        if not mlps:
            return "the model has no dense MLP"
        return f"the MLPs run in {chunks} or more chunks already" if min(map(chunks_of, mlps)) >= chunks else None

    def pull(model) -> Callable:
        from tiletune.families import family_of
        from tiletune.patch import layer_modules
        from tiletune.patch.sites import causal_lm

        mlps = layer_modules(model, "mlp")
        output_kept = family_of(causal_lm(model)[0].config).mlp.output_kept
        previous = [chunks_of(mlp) for mlp in mlps]
        for mlp in mlps:
            tile_mlp(mlp, chunks, output_kept)

        def undo() -> None:
            for mlp, count in zip(mlps, previous, strict=True):
                if count:
                    tile_mlp(mlp, count, output_kept)
                else:
                    untile_mlp(mlp)

        return undo

    return Lever("chunked MLP", why_not, pull, lambda model: f"the MLPs in {chunks} chunks of tokens")


def levers_for(model) -> list[Lever]:
    """What the planner may pull for `model`, cheapest first: the input embeddings to the host (a CPU gather and
    one copy per step: a few ms), the lm_head to the host (one copy per step, read in slices beside the fused
    loss's GEMMs or sent whole beside the decoder's forward: eager where the recomputation it spares costs more
    than its copy),
    then the MLPs in 2, 4, ... chunks of tokens up to twice as many as keep a chunk's intermediate within the
    hidden states (each costs one more MLP forward per layer and step unless a re-entrant recomputation can skip it,
    `tiletune.train.tiled_mlp`, and over a quantized base one more
    dequantization of its weights per chunk: the fewest that fit)."""
    from tiletune.patch.sites import causal_lm

    most = 2 * mlp_chunks(causal_lm(model)[0].config)
    chunks = [2**i for i in range(1, most.bit_length()) if 2**i <= most]
    return [Lever("embedding on host", why_not_on_host, _undoable(embedding_to_host, embedding_to_device),
                  lambda model: "the input embeddings in host memory"),
            Lever("lm_head on host", why_head_not_on_host, _undoable(head_to_host, head_to_device),
                  lambda model: "the lm_head in host memory (copied in during each forward, in slices by the fused loss)",
                  eager=True, copied_bytes=lambda model: model.get_output_embeddings().weight.nbytes),
            *map(_mlp_lever, chunks)]


def _undoable(do: Callable, undo: Callable) -> Callable:
    """A Lever.pull from a function of the model and the one that undoes it."""

    def pull(model) -> Callable:
        do(model)
        return functools.partial(undo, model)

    return pull


PROBE_LAYERS = 4  # the decoder layers a probe step runs when every layer is alike: two recomputed, two spared


def probe_depth(layers) -> int:
    """How many of `layers` (the first) a probe step runs: PROBE_LAYERS when every layer is alike (class, attention
    kind, parameter names, shapes, dtypes and trainability), the others' memory added by arithmetic; otherwise all."""
    first = _layer_signature(layers[0])
    if len(layers) > PROBE_LAYERS and all(_layer_signature(layer) == first for layer in layers[1:]):
        return PROBE_LAYERS
    return len(layers)


KIND_ATTRIBUTES = ("attention_type", "layer_type", "sliding_window", "is_sliding")  # what tells layers' kinds apart


def _layer_signature(layer) -> tuple:
    kinds = tuple((name, attribute, getattr(module, attribute)) for name, module in layer.named_modules()
                  for attribute in KIND_ATTRIBUTES if hasattr(module, attribute))  # fmt: skip
    params = tuple((name, param.shape, param.dtype, param.requires_grad) for name, param in layer.named_parameters())
    return type(layer), kinds, params


@contextlib.contextmanager
def _first_layers(model, path: str, count: int):
    """Within: the decoder stack at `path` is its first `count` layers (the ModuleList they run in)."""
    owner_path, _, name = path.rpartition(".")
    owner = model.get_submodule(owner_path)
    every = getattr(owner, name)
    if count >= len(every):
        yield every
        return
    setattr(owner, name, every[:count])
    try:
        yield getattr(owner, name)
    finally:
        setattr(owner, name, every)


def _unprobed_bytes(layer, input_bytes: int, input_on_host: bool) -> int:
    """What a recomputed layer the probe did not run adds to the step's peak: its input, unless it waits on the host,
    and its trainable parameters' gradients."""
    grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    return grads + (0 if input_on_host else input_bytes)


def _probe_spared(model, layers, spare: int, batch, seq, dtype, device, use_reentrant, offload=None,
                  offload_inputs: bool = False, probe_loss: Callable | None = None) -> _ProbeResult | None:  # fmt: skip
    """`_probe` with the last `spare` layers spared (the last kept, the one below selective), the rest
    recomputed (their inputs on the host with `offload_inputs`); None when that step runs out of memory."""
    treatments = ["recompute"] * len(layers)
    treatments[len(layers) - spare:] = ["selective", "keep"][2 - spare:]
    apply_treatments(layers, treatments, use_reentrant, offload, offload_inputs)
    try:
        return _probe(model, layers, spare, batch, seq, dtype, device, probe_loss)
    except torch.OutOfMemoryError:
        pass  # out of the except block, so the failed step's frames (and the tensors they hold) are gone
    for param in model.parameters():
        param.grad = None
    torch.cuda.empty_cache()
    return None


@dataclass
class _ProbeResult:
    held: dict[int, int]  # bytes each spared layer holds
    peak: int  # the step's peak (bytes; GPU)
    peak_below: int  # the peak after the backward has left the spared layers (GPU)
    input_bytes: int  # one layer's input
    forward_ms: float  # the last layer's forward
    on_gpu: bool
    depth: int  # the decoder layers the probe ran
    loss_ms: float = 0.0  # from the last layer's forward to the loss: the head, the loss and its fused gradients

    def spared_bytes(self) -> tuple[int, int]:
        """What the kept and the selective layer held (0, 0 when none was spared)."""
        keep = self.held.get(self.depth - 1, 0)
        return keep, self.held.get(self.depth - 2, keep) if self.on_gpu else keep

    def base(self, model, spared_inputs_offloaded: int, unprobed_layers=(), inputs_on_host: bool = False) -> int:
        """The step's peak with every layer recomputed, optimizer state included, less the inputs of
        `spared_inputs_offloaded` spared layers (held in the probe; on the host once recomputed), plus what each of
        `unprobed_layers` (recomputed, their inputs on the host or not) adds on a GPU."""
        if self.on_gpu:  # the peak while the spared layers were held, less them, or the peak after their backward
            keep, selective = self.spared_bytes()
            peak = max(self.peak - keep - selective, self.peak_below)
            peak += sum(_unprobed_bytes(layer, self.input_bytes, inputs_on_host) for layer in unprobed_layers)
        else:  # the saved tensors are counted per layer (`held`); the step itself holds the parameters
            peak = _parameter_bytes(model)
        return _optimizer_state_bytes(model) + peak - spared_inputs_offloaded * self.input_bytes


def _probe(model, layers, spare: int, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
           probe_loss: Callable | None = None) -> _ProbeResult:  # fmt: skip
    """One forward + backward on random tokens (the LM loss, or `probe_loss(model, tokens)`): what each of the last
    `spare` layers holds, the peak, the last layer's forward and the loss after it. On a GPU an unmeasured step runs
    first, so that no first call's cost (a kernel compiled or loaded, a GEMM's heuristics) is timed: a layer's forward
    timed cold (14 ms where it takes 4) made every layer's activations go to the host (0.27 s steps where the
    recomputed plan takes 0.15; Qwen3-30B-A3B, 12 layers, H100, benchmarks/results/h100-2026-12-07/moe12-2cbdec4)."""
    from tiletune.train.model import autocast

    on_gpu = device.type == "cuda"
    held: dict[int, int] = {}
    timing: dict = {}  # the last layer's input bytes, its forward's start and end, the loss's end
    peaks: dict[str, int] = {}
    vocab = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.train()

    def step() -> None:
        with torch.random.fork_rng(devices=[device] if on_gpu else []):
            with autocast(device, dtype):
                loss = probe_loss(model, tokens) if probe_loss else model(input_ids=tokens, labels=tokens).loss
            timing["loss"] = _now(device)
            loss.backward()

    if on_gpu:
        step()  # unmeasured, before any hook: the first calls' costs stay out of the timings
        for param in model.parameters():
            param.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    hooks = _timing_hooks(layers[-1], timing, device)
    spared = range(len(layers) - spare, len(layers))
    for index in spared:
        if on_gpu:
            hooks += _memory_hooks(layers[index], index, held, device)
        elif index == len(layers) - 1:  # the kept one; a selective layer's saves happen inside its checkpoint
            hooks += _saved_tensor_hooks(layers[index], index, held)
    if on_gpu and spare:
        hooks.append(layers[spared[0]].register_forward_pre_hook(_split_peak_hook(peaks, device), with_kwargs=True))
    try:
        step()
    finally:
        for hook in hooks:
            hook.remove()
    peak = peak_below = 0  # on the CPU the base is the whole model's parameters (`base`): nothing to measure
    if on_gpu:
        peak_below = torch.cuda.max_memory_allocated(device)
        peak = max(peaks.get("above", peak_below), peak_below)
    for param in model.parameters():
        param.grad = None
    model.train(was_training)
    start, end, loss = timing["start"], timing["end"], timing["loss"]
    if on_gpu:
        loss.synchronize()  # recorded in the forward; elapsed_time needs it complete
    elapsed_ms = (lambda a, b: a.elapsed_time(b)) if on_gpu else (lambda a, b: (b - a) * 1e3)
    forward_ms, loss_ms = elapsed_ms(start, end), elapsed_ms(end, loss)
    return _ProbeResult(held, peak, peak_below, int(timing["input_bytes"]), forward_ms, on_gpu, len(layers), loss_ms)


def _split_peak_hook(peaks: dict, device):
    """A forward pre-hook: once the backward has passed this layer, note the peak so far and start a new one."""

    def passed(grad):
        if "above" in peaks:  # a selective layer's recomputation hooked the same input again
            return
        peaks["above"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def hook(module, args, kwargs):
        hidden = _layer_input(args, kwargs)
        if hidden.requires_grad:
            hidden.register_hook(passed)

    return hook


def _layer_input(args, kwargs):
    """A decoder layer's hidden-states input, from a forward hook's arguments."""
    return args[0] if args else kwargs["hidden_states"]


def _now(device: torch.device):
    """A point in time on `device`: a recorded CUDA event on a GPU, else the host's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timing_hooks(layer, timing: dict, device):
    """Hooks that note a layer's input size and the start and end of its forward (CUDA events on a GPU)."""

    def pre(module, args, kwargs):
        hidden = _layer_input(args, kwargs)
        timing["input_bytes"] = hidden.numel() * hidden.element_size()
        timing["start"] = _now(device)

    def post(module, args, kwargs, output):
        timing["end"] = _now(device)

    return [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]


def _host_link_bytes_per_s(device: torch.device, nbytes: int) -> float:
    """Pinned host <-> device copy rate, the slower direction (median of 3 copies each way)."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for destination, source in ((on_host, on_device), (on_device, on_host)):
        seconds = []
        for _ in range(4):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            destination.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        rates.append(nbytes / sorted(seconds[1:])[1])
    return min(rates)


def _host_available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def _host_budget_bytes(host_budget_gib: float | None) -> int:
    """The pinned host memory offloaded tensors may take: the user's gradient_checkpointing_host_budget, or
    HOST_SHARE of what is free now."""
    available = _host_available_bytes()
    if host_budget_gib is None:
        return int(available * HOST_SHARE)
    if host_budget_gib * GIB > available:
        raise UserError(f"gradient_checkpointing_host_budget={host_budget_gib:g} GiB is more than the {available / GIB:.1f} "
                        "GiB of host memory free now; lower it, or leave it null for half of what is free")  # fmt: skip
    return int(host_budget_gib * GIB)


def _memory_hooks(layer, index: int, held: dict[int, int], device):
    """Hooks that record the memory a layer's forward leaves allocated, less its output."""
    before = {}

    def pre(module, args, kwargs):
        before[index] = torch.cuda.memory_allocated(device)

    def post(module, args, kwargs, output):
        out = output[0] if isinstance(output, tuple) else output
        held[index] = max(0, torch.cuda.memory_allocated(device) - before[index] - out.numel() * out.element_size())

    return [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]


def _saved_tensor_hooks(layer, index: int, held: dict[int, int]):
    """Hooks that add up the distinct activation storages autograd saves inside a layer's forward."""
    held_elsewhere = {p.untyped_storage().data_ptr() for p in layer.parameters()}  # weights, and the layer's input
    storages: dict[int, int] = {}
    context = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held_elsewhere:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def pre(module, args, kwargs):
        hidden = args[0] if args else next(iter(kwargs.values()))
        held_elsewhere.add(hidden.untyped_storage().data_ptr())
        context.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
        context[-1].__enter__()

    def post(module, args, kwargs, output):
        context.pop().__exit__(None, None, None)
        held[index] = sum(storages.values())

    return [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]


def usable_bytes(budget: int, static_bytes: int) -> int:
    """What a plan may fill of `budget` bytes: all of it less MARGIN of what the step allocates beyond its
    `static_bytes` (`_static_bytes`)."""
    return budget - int(MARGIN * max(budget - static_bytes, 0))


def _static_bytes(model, device: torch.device) -> int:
    """What the step holds on `device` from start to end: the parameters there, the trainable ones' gradients, and
    the optimizer state (a table a lever moved to the host no longer counts)."""
    on_device = sum(p.numel() * p.element_size() for p in model.parameters() if p.device == device)
    return on_device + _trainable_bytes(model) + _optimizer_state_bytes(model)


def _trainable_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _parameter_bytes(model) -> int:
    """The parameters and the trainable ones' gradients."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + _trainable_bytes(model)


def _optimizer_state_bytes(model) -> int:
    """AdamW's two moments per trainable parameter (allocated at the first optimizer step, after the probe)."""
    return 2 * _trainable_bytes(model)
