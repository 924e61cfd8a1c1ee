"""AdamW steps on fixed tokens, shared by the engine's training-parity tests."""


def adamw_losses(model, ids, params, steps: int, lr: float = 1e-2) -> list[float]:
    """The loss of each of `steps` AdamW steps of `params` on `ids` (labels = inputs)."""
    import torch

    optimizer = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
