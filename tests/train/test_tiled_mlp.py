"""Token-chunked MLP: the same loss and gradients as the whole MLP, LoRA and dropout included, and undone."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from tiletune.patch import layer_modules
from tiletune.train.tiled_mlp import _ChunkedMlp, chunks_of, mlp_chunks, tile_mlp, untile_mlp


def _model(dropout: float = 0.0):
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "gate_proj", "down_proj"])
    model = get_peft_model(LlamaForCausalLM(config), lora)
    for name, param in model.named_parameters():  # LoRA B starts at zero: give the adapters something to say
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def _loss_and_grads(model, tokens, seed=3):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _split_in_autograd(mlp, chunk):
    """The reference with dropout: the same chunks (so the same random draws), all recorded by autograd."""
    def forward(hidden):
        return torch.cat([type(mlp).forward(mlp, piece) for piece in hidden.split(chunk, dim=-2)], dim=-2)

    mlp.forward = forward


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_chunked_mlp_gives_the_whole_mlps_loss_and_gradients(dropout):
    """Without dropout the whole MLP is the reference; with it, the same chunks recorded by autograd (dropout
    draws per chunk), so the backward's replay must reproduce the forward's draws."""
    model = _model(dropout)
    model.train()
    tokens = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))  # 37: chunks of unequal size
    mlps = layer_modules(model, "mlp")
    if dropout:
        for mlp in mlps:
            _split_in_autograd(mlp, 13)
    reference_loss, reference_grads = _loss_and_grads(model, tokens)
    for mlp in mlps:
        mlp.__dict__.pop("forward", None)
    assert len(mlps) == 2
    calls = []
    original = _ChunkedMlp.apply
    _ChunkedMlp.apply = lambda *args: calls.append(args[1]) or original(*args)
    try:
        for mlp in mlps:
            tile_mlp(mlp, mlp_chunks(model.config))  # ceil(72 / 32) = 3 chunks
        loss, grads = _loss_and_grads(model, tokens)
    finally:
        _ChunkedMlp.apply = staticmethod(original)
    assert calls == [13, 13]  # both layers ran chunked, 37 tokens in chunks of 13
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    assert {n for n in grads if "mlp" in n}, "no MLP adapter trained"
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_wrong_chunk_replay_is_caught():
    """Dropout drawn afresh in the backward (no RNG replay) gives other gradients: the check above can fail."""
    model = _model(dropout=0.3)
    model.train()
    tokens = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    for mlp in layer_modules(model, "mlp"):
        _split_in_autograd(mlp, 13)
    _, reference_grads = _loss_and_grads(model, tokens)
    for mlp in layer_modules(model, "mlp"):
        mlp.__dict__.pop("forward")
        tile_mlp(mlp, 3)
    from tiletune.train import tiled_mlp

    replay = tiled_mlp._set_rng_state
    tiled_mlp._set_rng_state = lambda device, state: torch.manual_seed(1234)
    try:
        _, grads = _loss_and_grads(model, tokens)
    finally:
        tiled_mlp._set_rng_state = replay
    name = next(n for n in grads if "mlp.gate_proj.lora_A" in n)
    assert not torch.allclose(grads[name], reference_grads[name], rtol=1e-3, atol=1e-6)


def test_chunked_mlp_under_autocast_and_undo():
    model = _model()
    model.train()
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(input_ids=tokens, labels=tokens).loss
    mlp = layer_modules(model, "mlp")[0]
    tile_mlp(mlp, 4)
    assert chunks_of(mlp) == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()  # the chunks' replay runs under the forward's autocast (bf16 activations, fp32 adapters)
    torch.testing.assert_close(loss, reference, rtol=2e-2, atol=0)
    untile_mlp(mlp)
    assert chunks_of(mlp) == 0 and "forward" not in mlp.__dict__
    tile_mlp(mlp, 4)
    model.eval()
    with torch.no_grad():  # evaluation never chunks
        hidden = torch.randn(1, 40, 32)
        assert torch.equal(mlp(hidden), type(mlp).forward(mlp, hidden))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_chunked_mlp_inside_reentrant_checkpoints(dropout):
    """Under re-entrant gradient checkpointing the layer's first forward runs without autograd: it is chunked
    too (its peak is one chunk's) and draws the same dropout masks as the recomputation, so the gradients
    are the reference's (the same chunks recorded by autograd, no checkpointing)."""
    model = _model(dropout)
    model.train()
    tokens = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    mlps = layer_modules(model, "mlp")
    for mlp in mlps:
        _split_in_autograd(mlp, 13)
    reference_loss, reference_grads = _loss_and_grads(model, tokens)
    for mlp in mlps:
        mlp.__dict__.pop("forward")
        tile_mlp(mlp, 3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    pieces = []
    hook = mlps[0].down_proj.register_forward_pre_hook(lambda module, args: pieces.append(args[0].shape[-2]))
    loss, grads = _loss_and_grads(model, tokens)
    hook.remove()
    assert pieces == [13, 13, 11] * 3  # the first forward, the recomputation and its backward's replay, alike
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _gemma3(dropout: float = 0.0):
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    config = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                              sliding_window=16)  # fmt: skip
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "gate_proj", "down_proj"])
    model = get_peft_model(Gemma3ForCausalLM(config), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def _reentrant_run(model, output_kept: bool):
    """(loss, grads, the token counts down_proj saw) of a step with every MLP in 3 chunks under re-entrant
    checkpointing."""
    mlps = layer_modules(model, "mlp")
    for mlp in mlps:
        tile_mlp(mlp, 3, output_kept)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    pieces = []
    hook = mlps[0].down_proj.register_forward_pre_hook(lambda module, args: pieces.append(args[0].shape[-2]))
    try:
        loss, grads = _loss_and_grads(model, torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1)))
    finally:
        hook.remove()
    return loss, grads, pieces


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recomputation_skips_an_mlp_whose_output_nothing_keeps(family, dropout):
    """The family record says whether the recomputation may skip the chunked MLP (Llama: its output only joins the
    residual; Gemma 3: the post-feedforward norm keeps it); with LoRA dropout it never does. Either way the
    gradients are those of the same chunks without the skip."""
    from tiletune.families import family_of

    build = _model if family == "llama" else _gemma3
    output_kept = family_of(build().config).mlp.output_kept
    assert output_kept == (family == "gemma3_text")
    reference_loss, reference_grads, reference_pieces = _reentrant_run(build(dropout), output_kept=True)
    assert reference_pieces == [13, 13, 11] * 3  # the first forward, the recomputation, its backward's replay
    loss, grads, pieces = _reentrant_run(build(dropout), output_kept)
    skipped = not output_kept and not dropout
    assert pieces == [13, 13, 11] * (2 if skipped else 3)
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_skipping_an_mlp_whose_output_is_kept_is_caught():
    """Gemma 3's post-feedforward norm reads the MLP's output in its backward: told wrongly that nothing keeps it,
    the recomputation's skipped MLP shows as NaN gradients, not as stale values passing."""
    _, grads, pieces = _reentrant_run(_gemma3(), output_kept=False)
    assert pieces == [13, 13, 11] * 2
    assert any(grad.isnan().any() for grad in grads.values())
