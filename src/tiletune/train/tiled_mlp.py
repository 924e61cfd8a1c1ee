"""Token-chunked MLP: a dense MLP's intermediate activations exist one chunk of tokens at a time.

At long sequences the MLP's intermediates dominate a decoder layer's working set: at 65,536 tokens each
[tokens, intermediate] tensor of a Llama-3-8B is 1.75 GiB, and a layer's backward holds several. The MLP
acts on each token alone, so it can run in chunks: the forward runs chunk by chunk without recording
anything and keeps only its input; the backward runs each chunk's forward again with autograd on and
backpropagates that chunk's slice of the output gradient right away, which writes the chunk's input
gradient and adds to the MLP's trainable parameters' gradients (LoRA on gate/up/down) as they go. The
price is one more MLP forward per layer and step; `gradient_checkpointing: auto` turns it on only when the
budget needs it (`tiletune.train.recompute`).

Inside a re-entrant checkpoint that price is waived where it can be: the layer's recomputation (run by
autograd's engine during the backward) builds the graph its backward walks, and the values of the MLP's
output are read by nothing when the output only joins the residual sum (every family but Gemma's, whose
post-feedforward norm keeps it: `Mlp.output_kept`). There the chunked MLP hands the recomputation a tensor
of the output's shape filled with NaN and runs its chunks only in its own backward, so a chunked MLP
runs forward as often as a whole one. Not where the MLP draws random numbers (LoRA dropout): the
recomputation must consume them as the first forward did, for the layer's later draws to match.

The chunks wrap whatever forward the MLP has (stock or a tiletune kernel), so the kernels keep running
inside them. Gradients reach the parameters through their own accumulation: each one once per chunk, so a
hook that expects a single gradient per step (DDP's bucketing without ``static_graph``) does not fit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tiletune.kernels.registry import in_backward


class _ChunkedMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, chunk: int, unread: tuple | None, hidden: Tensor, *parameters: Tensor) -> Tensor:
        device = hidden.device
        ctx.forward, ctx.chunk = forward, chunk
        ctx.autocast = (device.type, torch.get_autocast_dtype(device.type), torch.is_autocast_enabled(device.type))
        ctx.rng = _rng_state(device)  # the backward replays the chunks' random draws (LoRA dropout) exactly
        ctx.save_for_backward(hidden)
        if unread is not None:  # nothing reads the values (module docstring): (width, dtype) of the output, NaN
            # so that a read by mistake shows in the gradients instead of passing on stale memory
            return hidden.new_full((*hidden.shape[:-1], unread[0]), float("nan"), dtype=unread[1])
        return torch.cat([forward(piece) for piece in hidden.split(chunk, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (hidden,) = ctx.saved_tensors
        device_type, dtype, enabled = ctx.autocast
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[3] else None
        devices = [hidden.device] if hidden.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            _set_rng_state(hidden.device, ctx.rng)
            for start in range(0, hidden.shape[-2], ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                piece = hidden[..., rows, :].detach().requires_grad_(grad_hidden is not None)
                with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    output = ctx.forward(piece)
                torch.autograd.backward(output, grad_output[..., rows, :])
                if grad_hidden is not None:
                    grad_hidden[..., rows, :] = piece.grad
        return None, None, None, grad_hidden, *(None for _ in ctx.needs_input_grad[4:])


def _rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def mlp_chunks(config) -> int:
    """How many chunks keep one chunk's intermediate no larger than the layer's hidden states:
    ceil(intermediate_size / hidden_size)."""
    return max(1, math.ceil(getattr(config, "intermediate_size", config.hidden_size) / config.hidden_size))


def _draws_random(mlp: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in mlp.modules())


def tile_mlp(mlp: nn.Module, chunks: int, output_kept: bool = True) -> None:
    """Make `mlp` (a dense MLP module) run in `chunks` pieces along the sequence while it trains. `output_kept`:
    a later op of the decoder layer keeps the MLP's output for its backward (the family's `Mlp.output_kept`);
    when False a re-entrant recomputation does not compute the output (module docstring)."""
    untile_mlp(mlp)
    current = mlp.forward
    trainable = tuple(p for p in mlp.parameters() if p.requires_grad)
    computed: dict[str, tuple] = {}  # "output": (width, dtype) of the last output computed

    def forward(hidden: Tensor) -> Tensor:
        if not mlp.training or hidden.dim() < 2 or hidden.shape[-2] < 2 * chunks:
            return current(hidden)
        chunk = math.ceil(hidden.shape[-2] / chunks)
        if not torch.is_grad_enabled():  # a re-entrant checkpoint's first forward: chunked too, so its peak is
            # a chunk's and its random draws are the ones the recomputation (chunked, below) replays
            output = torch.cat([current(piece) for piece in hidden.split(chunk, dim=-2)], dim=-2)
            computed["output"] = (output.shape[-1], output.dtype)
            return output
        unread = None
        if not output_kept and in_backward() and not _draws_random(mlp):
            unread = computed.get("output")
        return _ChunkedMlp.apply(current, chunk, unread, hidden, *trainable)

    mlp._tiletune_untiled = mlp.__dict__.get("forward")  # None: the class's forward
    mlp._tiletune_chunks = chunks
    mlp.forward = forward


def untile_mlp(mlp: nn.Module) -> None:
    """Undo `tile_mlp` (no-op on an MLP that is not tiled)."""
    if "_tiletune_untiled" not in mlp.__dict__:
        return
    previous = mlp.__dict__.pop("_tiletune_untiled")
    del mlp._tiletune_chunks
    if previous is None:
        del mlp.forward
    else:
        mlp.forward = previous


def chunks_of(mlp: nn.Module) -> int:
    """How many chunks `mlp` runs in (0: not chunked)."""
    return mlp.__dict__.get("_tiletune_chunks", 0)
