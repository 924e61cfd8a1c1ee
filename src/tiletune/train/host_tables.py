"""Frozen tables in host memory: the input embeddings and the output head (lm_head), when the GPU budget needs it.

LoRA and QLoRA train neither table, yet each is one of the biggest tensors on the GPU (Llama-3's 128,256 x
4,096 in bf16: 1 GiB each at 8B, 2 GiB each at 70B; bitsandbytes and Unsloth keep both in bf16 on the device,
and over a 4-bit base they are a fifth of the 8B's weights). Both can wait in pinned host memory:

- The input embeddings: only the rows of the batch's tokens are ever read, so each forward gathers them on
  the CPU and copies them to the device (8,192 tokens x 4,096 in bf16: 64 MiB, about a millisecond over the
  host link, plus the gather).
- The output head is read whole by the loss, once per forward (tiletune's fused losses compute their
  gradients in the forward; stock's logits keep the weight until their backward). The fused cross-entropy
  (`linear_cross_entropy`, `chunked`) reads it from the host itself, a vocabulary slice at a time beside its
  GEMMs, so the GPU never holds it whole. For the other losses (stock logits, the preference stages' log-probs),
  when the forward starts (a pre-hook on the input embeddings), a copy of it leaves on a side stream, so the copy
  (1 GiB at Llama-3-8B: about 20 ms over a 50 GB/s link) runs beside the decoder layers' forward; the loss
  takes it (`tiletune.kernels.binding.head_weight`) and drops it when done, so the GPU holds the head only from
  the forward's start to the loss, not through the backward's peak.

The modules stay in the model (state dict, export and `get_input_embeddings` see them); moving the model
(`model.to`) leaves them on the host; `tables_to_device` puts them back (generation wants the whole model on
its device). `gradient_checkpointing: auto` does this only when the budget needs it (`tiletune.train.recompute`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tiletune.kernels.binding import HEAD_READ_IN_SLICES, SideCopy

HOST_DEVICE = "_tiletune_host_device"  # where a module on the host computes; its presence marks the module


def why_not_on_host(model: nn.Module) -> str | None:
    """Why the input embeddings of `model` cannot move to host memory, or None when they can."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, nn.Embedding):
        return f"the input embeddings are a {type(embedding).__name__}, not an Embedding"
    return _why_table_stays(model, embedding, "input embeddings")


def why_head_not_on_host(model: nn.Module) -> str | None:
    """Why the output head (lm_head) of `model` cannot move to host memory, or None when it can."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return f"the lm_head is a {type(head).__name__}, not a Linear"
    if head.bias is not None:
        return "the lm_head has a bias"
    return _why_table_stays(model, head, "lm_head")


def _why_table_stays(model: nn.Module, table: nn.Module, name: str) -> str | None:
    be = "are" if name.endswith("s") else "is"
    if table.weight.requires_grad:
        return f"the {name} {be} trained"
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() == embedding.weight.data_ptr():
        other = "lm_head, which the GPU needs whole" if table is embedding else "input embeddings"
        return f"the {name} {be} tied to the {other}"
    if table.weight.device.type != "cuda":
        return f"the {name} {be} on {table.weight.device.type}, not a GPU"
    return None


def embedding_to_host(model: nn.Module) -> None:
    """Move `model`'s frozen input embedding table to pinned host memory; lookups come back to its GPU."""
    reason = why_not_on_host(model)
    if reason is not None:
        raise ValueError(f"cannot keep the input embeddings on the host: {reason}")
    embedding = model.get_input_embeddings()
    lookup = embedding.forward
    device = _to_pinned_host(embedding)

    def forward(ids: Tensor) -> Tensor:
        return lookup(ids.to("cpu")).to(device, non_blocking=True)

    embedding.forward = forward


def head_to_host(model: nn.Module) -> None:
    """Move `model`'s frozen lm_head to pinned host memory; each forward copies it back beside the decoder's work."""
    reason = why_head_not_on_host(model)
    if reason is not None:
        raise ValueError(f"cannot keep the lm_head on the host: {reason}")
    head = model.get_output_embeddings()
    device = _to_pinned_host(head)
    stream = torch.cuda.Stream(device)

    def prefetch(module, args) -> None:
        if not head.__dict__.get(HEAD_READ_IN_SLICES):
            head._tiletune_prefetched = SideCopy(head.weight, device, stream)

    def fetch_weight() -> Tensor:
        """The weight on the device: the copy the forward's start sent, or a copy now."""
        prefetched = head.__dict__.pop("_tiletune_prefetched", None)
        return head.weight.to(device, non_blocking=True) if prefetched is None else prefetched.take()

    head.fetch_weight = fetch_weight
    head.forward = lambda hidden: F.linear(hidden, fetch_weight())
    head._tiletune_prefetch_hook = model.get_input_embeddings().register_forward_pre_hook(prefetch)


def embedding_on_host(model: nn.Module) -> bool:
    return hasattr(model.get_input_embeddings(), HOST_DEVICE)


def head_on_host(model: nn.Module) -> bool:
    return hasattr(model.get_output_embeddings(), HOST_DEVICE)


def embedding_to_device(model: nn.Module) -> None:
    """Undo `embedding_to_host` (no-op when the table is on its device)."""
    embedding = model.get_input_embeddings()
    if hasattr(embedding, HOST_DEVICE):
        _back_to_device(embedding)


def head_to_device(model: nn.Module) -> None:
    """Undo `head_to_host` (no-op when the head is on its device)."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, HOST_DEVICE):
        head.__dict__.pop("_tiletune_prefetch_hook").remove()
        head.__dict__.pop("_tiletune_prefetched", None)
        del head.fetch_weight
        _back_to_device(head)


def tables_to_device(model: nn.Module) -> None:
    """Undo `embedding_to_host` and `head_to_host` (no-op for a table on its device)."""
    head_to_device(model)
    embedding_to_device(model)


def _to_pinned_host(module: nn.Module) -> torch.device:
    """Move `module`'s parameters to pinned host memory, where `model.to` leaves them; the device they left."""
    device = module.weight.device
    module.to("cpu")
    for param in module.parameters():
        param.data = param.data.pin_memory()
    module._apply = _stay_on_host.__get__(module)
    setattr(module, HOST_DEVICE, device)
    return device


def _back_to_device(module: nn.Module) -> None:
    device = module.__dict__.pop(HOST_DEVICE)
    del module.forward, module._apply
    module.to(device)


def _stay_on_host(self, fn, recurse=True):
    """`nn.Module._apply` for a table kept on the host: `model.to(device)` and dtype casts pass it by."""
    return self
