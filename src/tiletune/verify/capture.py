"""Capture what a training step computes, per layer: forward outputs, input gradients, parameter gradients.

For every decoder layer and every module named in `watch` (paths like `layers.3.mlp`), a forward hook
keeps the output and hooks the input tensor to keep its gradient. After `loss.backward()` the gradient
of every trainable parameter is kept too. Tensors are stored on the CPU in float32 (float64 for a
float64 run), keyed `<where>.output`, `<where>.input_grad`, `params.<name>.grad`, plus `loss`.
"""

from __future__ import annotations

import torch
from torch import nn

from tiletune.patch import decoder_layers
from tiletune.train.model import autocast
from tiletune.verify.losses import StepLoss, lm_loss


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _store(tensor: torch.Tensor) -> torch.Tensor:
    keep = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.detach().to("cpu", keep).clone()


def watched_modules(model: nn.Module, extra: list[str]) -> dict[str, nn.Module]:
    """`layers.<i>` for every decoder layer, plus each `layers.<i>.<path>` in `extra`, as modules."""
    _, layers = decoder_layers(model)
    found = {f"layers.{i}": layer for i, layer in enumerate(layers)}
    for name in extra:
        index, _, path = name.removeprefix("layers.").partition(".")
        found[name] = layers[int(index)].get_submodule(path)
    return found


def run_and_capture(model: nn.Module, batches: list[dict], watch: dict[str, nn.Module], dtype: torch.dtype,
                    device: torch.device, loss_of: StepLoss = lm_loss) -> dict[str, torch.Tensor]:  # fmt: skip
    """Forward + backward of `loss_of` (the causal LM loss, or a preference stage's: verify/losses.py) over
    `batches` under autocast to `dtype` (none for float32/64); the captured tensors.

    Each batch's tensors get a `b<index>.` prefix; parameter gradients are summed over batches. The forward
    outputs kept are each module's last (a preference loss runs the reference first, without gradient).
    """
    captured: dict[str, torch.Tensor] = {}
    prefix = [""]

    def hook_for(name: str):
        def hook(module, args, kwargs, output):
            out = _first_tensor(output)
            if out is not None:
                captured[f"{prefix[0]}{name}.output"] = _store(out)
            given = _first_tensor(args) if args else _first_tensor(next(iter(kwargs.values()), None))
            if given is not None and given.requires_grad:
                given.register_hook(lambda grad: captured.__setitem__(f"{prefix[0]}{name}.input_grad", _store(grad)))

        return hook

    handles = [module.register_forward_hook(hook_for(name), with_kwargs=True) for name, module in watch.items()]
    embeddings = model.get_input_embeddings()
    handles.append(embeddings.register_forward_hook(lambda module, args, output: output.requires_grad_(True)))
    model.zero_grad(set_to_none=True)
    try:
        for index, batch in enumerate(batches):
            prefix[0] = f"b{index}."
            with autocast(device, dtype):
                loss = loss_of(model, batch, device)
            loss.backward()
            captured[f"b{index}.loss"] = _store(loss.reshape(1))
    finally:
        for handle in handles:
            handle.remove()
    for name, param in model.named_parameters():
        if param.grad is not None:
            captured[f"params.{name}.grad"] = _store(param.grad)
    model.zero_grad(set_to_none=True)
    return captured
