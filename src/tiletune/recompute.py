"""Recomputation on a memory budget: `gradient_checkpointing: auto`.

Each decoder layer gets one of three treatments:

- ``keep``: not checkpointed; what its backward needs stays in memory from its forward.
- ``selective``: PyTorch's selective activation checkpointing; the outputs of matmuls and attention are
  kept, the cheap elementwise ops (norms, RoPE, the activation, casts) run again in the backward.
- ``recompute``: full checkpointing; only the layer's input is kept and its whole forward runs again.

A probe step on the training shape (batch x cutoff_len random tokens, the kernels already patched in)
measures what one layer holds under ``keep`` and under ``selective``, and the step's peak with every
other layer recomputed. The plan then gives as many layers as the budget allows a treatment that
recomputes no matmul (the cheaper of the two in memory), upgrades ``selective`` layers to ``keep`` with
what is left, and recomputes the rest. The layers spared are the last ones: the backward reaches them
first, so their memory is free again before any recomputed layer runs its forward a second time.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tiletune.errors import UserError

log = logging.getLogger("tiletune")

GIB = 2**30
MARGIN = 0.05  # of the budget, left for the allocator's fragmentation and what the probe cannot see
TREATMENTS = ("keep", "selective", "recompute")


@dataclass
class RecomputePlan:
    """The treatment of every decoder layer and the measurements it was chosen from (bytes)."""

    treatments: list[str]
    budget_bytes: int
    base_bytes: int  # the step's peak with every layer recomputed, optimizer state included
    keep_bytes: int  # what one layer holds between its forward and its backward, per treatment
    selective_bytes: int
    measured_on: str

    @property
    def counts(self) -> dict[str, int]:
        return {t: self.treatments.count(t) for t in TREATMENTS}

    @property
    def predicted_peak_bytes(self) -> int:
        per_layer = {"keep": self.keep_bytes, "selective": self.selective_bytes, "recompute": 0}
        return self.base_bytes + sum(per_layer[t] for t in self.treatments)

    def summary(self) -> str:
        counts = ", ".join(f"{n} {t}" for t, n in self.counts.items() if n)
        return (f"gradient_checkpointing auto: {counts} (layer holds {self.keep_bytes / GIB:.2f} GiB kept, "
                f"{self.selective_bytes / GIB:.2f} GiB selective; peak {self.predicted_peak_bytes / GIB:.1f} GiB "
                f"predicted of a {self.budget_bytes / GIB:.1f} GiB budget)")  # fmt: skip

    def to_dict(self) -> dict:
        return {**asdict(self), "counts": self.counts, "predicted_peak_bytes": self.predicted_peak_bytes}


def choose_treatments(layers: int, keep_bytes: int, selective_bytes: int, free_bytes: int) -> list[str]:
    """Treatments, first layer to last, that spare the most matmul recomputation within `free_bytes`."""
    cheaper = min(keep_bytes, selective_bytes)
    spared = layers if cheaper <= 0 else max(0, min(layers, free_bytes // cheaper))
    upgrades = 0
    if selective_bytes < keep_bytes and spared:
        left = free_bytes - spared * selective_bytes
        upgrades = max(0, min(spared, left // (keep_bytes - selective_bytes)))
    first_spared = "selective" if selective_bytes < keep_bytes else "keep"
    return ["recompute"] * (layers - spared) + [first_spared] * (spared - upgrades) + ["keep"] * upgrades


def apply_treatments(layers, treatments: list[str], use_reentrant: bool) -> None:
    """Set each decoder layer's checkpointing as its treatment says (transformers' per-layer switch)."""
    for layer, treatment in zip(layers, treatments, strict=True):
        layer.gradient_checkpointing = treatment != "keep"
        if treatment == "selective":
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False, context_fn=_selective_contexts)
        elif treatment == "recompute":
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=use_reentrant)


@functools.cache
def _saved_ops() -> frozenset:
    """Ops whose outputs a selective layer keeps: matmuls, attention and tiletune's GEMM kernels."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    from tiletune.kernels import registry

    registry.load_ops()
    ops |= {getattr(torch.ops.tiletune, name).default for name in ("linear", "lora_linear") if hasattr(torch.ops.tiletune, name)}
    return frozenset(ops)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def plan_recomputation(model, batch: int, seq: int, dtype: torch.dtype, budget_gib: float | None,
                       use_reentrant: bool) -> RecomputePlan:  # fmt: skip
    """Probe one step at (batch, seq), choose each layer's treatment within the budget, and apply it."""
    from tiletune.patch import decoder_layers

    _, layers = decoder_layers(model)
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    if budget_gib is None and not on_gpu:
        budget = None
    elif budget_gib is None:
        budget = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    else:
        budget = int(budget_gib * GIB)
    probe_treatments = ["recompute"] * len(layers)
    if len(layers) >= 2:
        probe_treatments[-2:] = ["selective", "keep"]
    apply_treatments(layers, probe_treatments, use_reentrant)
    held, peak = _probe(model, layers, batch, seq, dtype, device)
    keep_bytes = held.get(len(layers) - 1, 0)
    selective_bytes = held.get(len(layers) - 2, keep_bytes) if on_gpu else keep_bytes
    base = _optimizer_state_bytes(model) + (peak - keep_bytes - selective_bytes if on_gpu else peak)
    if budget is None:  # on the CPU, with no budget given, memory is not what limits: recompute nothing
        treatments, budget = ["keep"] * len(layers), base + len(layers) * keep_bytes
    else:
        if budget < base:
            raise UserError(
                f"gradient_checkpointing_budget={budget / GIB:.1f} GiB is below the {base / GIB:.1f} GiB this step needs "
                "with every layer recomputed; raise the budget, or lower per_device_train_batch_size or cutoff_len"
            )
        free = int(budget * (1 - MARGIN)) - base
        treatments = choose_treatments(len(layers), keep_bytes, selective_bytes, free)
    apply_treatments(layers, treatments, use_reentrant)
    plan = RecomputePlan(treatments, budget, base, keep_bytes, selective_bytes,
                         "cuda memory" if on_gpu else "saved tensors (CPU)")  # fmt: skip
    log.info("%s", plan.summary())
    return plan


def _probe(model, layers, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> tuple[dict[int, int], int]:
    """One forward + backward on random tokens: bytes each spared layer holds, and the step's peak."""
    from tiletune.model import autocast

    on_gpu = device.type == "cuda"
    held: dict[int, int] = {}
    hooks = []
    for index, layer in enumerate(layers):
        if layer.gradient_checkpointing:
            continue
        if on_gpu:
            hooks += _memory_hooks(layer, index, held, device)
        else:
            hooks += _saved_tensor_hooks(layer, index, held)
    vocab = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.train()
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.random.fork_rng(devices=[device] if on_gpu else []):
            with autocast(device, dtype):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else _parameter_bytes(model)
    for param in model.parameters():
        param.grad = None
    model.train(was_training)
    return held, peak


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


def _parameter_bytes(model) -> int:
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + trainable  # weights + gradients


def _optimizer_state_bytes(model) -> int:
    """AdamW's two moments per trainable parameter (allocated at the first optimizer step, after the probe)."""
    return sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

