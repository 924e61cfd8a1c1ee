"""A frozen input embedding table kept in host memory: the lookup runs on the CPU, the rows go to the GPU.

LoRA and QLoRA never train the input embeddings, yet the table is one of the biggest tensors on the GPU
(Llama-3's 128,256 x 4,096 in bf16: 1 GiB at 8B, 2 GiB at 70B; bitsandbytes and Unsloth keep it in bf16 on
the device). Only the rows of the batch's tokens are ever read, so the table can live in pinned host
memory: each forward gathers the batch's rows on the CPU and copies them to the device (8,192 tokens x
4,096 in bf16: 64 MiB, about a millisecond over the host link, plus the gather). The module stays in the
model (state dict, export and `get_input_embeddings` see it); moving the model (`model.to`) leaves it on the
host. `gradient_checkpointing: auto` does this only when the budget needs it (`tiletune.train.recompute`).
"""

from __future__ import annotations

from torch import Tensor, nn


def why_not_on_host(model: nn.Module) -> str | None:
    """Why the input embeddings of `model` cannot move to host memory, or None when they can."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, nn.Embedding):
        return f"the input embeddings are a {type(embedding).__name__}, not an Embedding"
    if embedding.weight.requires_grad:
        return "the input embeddings train"
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() == embedding.weight.data_ptr():
        return "the input embeddings are tied to the lm_head, which the GPU needs whole"
    if embedding.weight.device.type != "cuda":
        return f"the input embeddings are on {embedding.weight.device.type}, not a GPU"
    return None


def embedding_to_host(model: nn.Module) -> None:
    """Move `model`'s frozen input embedding table to pinned host memory; lookups come back to its GPU."""
    reason = why_not_on_host(model)
    if reason is not None:
        raise ValueError(f"cannot keep the input embeddings on the host: {reason}")
    embedding = model.get_input_embeddings()
    device = embedding.weight.device
    embedding.to("cpu")
    embedding.weight.data = embedding.weight.data.pin_memory()
    lookup = embedding.forward

    def forward(ids: Tensor) -> Tensor:
        return lookup(ids.to("cpu")).to(device, non_blocking=True)

    embedding.forward = forward
    embedding._apply = _stay_on_host.__get__(embedding)
    embedding._tiletune_host_device = device


def embedding_on_host(model: nn.Module) -> bool:
    return hasattr(model.get_input_embeddings(), "_tiletune_host_device")


def embedding_to_device(model: nn.Module) -> None:
    """Undo `embedding_to_host` (generation wants the whole model on its device); no-op if the table is there."""
    embedding = model.get_input_embeddings()
    if not embedding_on_host(model):
        return
    device = embedding.__dict__.pop("_tiletune_host_device")
    del embedding.forward, embedding._apply
    embedding.to(device)


def _stay_on_host(self, fn, recurse=True):
    """`nn.Module._apply` for a table kept on the host: `model.to(device)` and dtype casts pass it by."""
    return self
