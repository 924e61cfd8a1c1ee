"""One training step's loss and gradients, shared by the tests that compare a patched model with stock."""


def loss_and_grads(model, ids):
    """(loss, {parameter name: gradient}) of one forward and backward on `ids` (labels = inputs); the gradients are
    cleared afterwards, so the next call starts from none."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads
