"""One bf16 training step on the GPU with its peak memory, for the memory-planning GPU tests."""

import torch


def measured_step(model, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(loss, peak bytes allocated) of one forward + backward under bf16 autocast; gradients dropped after."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return loss.detach(), torch.cuda.max_memory_allocated()
