"""The last projection where nothing reads its output: the stand-in's gradients equal F.linear's (autocast
included; a quantized base's, quant_linear's), and in a model the swiglu binding spares the down projection's GEMM in a re-entrant recomputation only,
with the loss and every gradient of the run without checkpointing (LoRA on the projection, dropout included); a
family whose post-feedforward norm reads the output computes it, and forcing the stand-in there shows in the
gradients."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _grads import loss_and_grads
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from tiletune import families
from tiletune.kernels import quant_linear
from tiletune.kernels.quant_linear import QuantLinear
from tiletune.kernels.unread_output import _UnreadLinear, _UnreadQuantLinear, unread, unread_unfit
from tiletune.patch import apply_kernels, layer_modules
from tiletune.quant import quantize
from tiletune.train.quantized import random_quantized
from tiletune.train.tiled_mlp import tile_mlp


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("trained", [(True, False, False), (True, True, True), (False, True, True)])
def test_the_stand_in_has_f_linears_gradients_and_a_nan_output(autocast, trained):
    """Gradients of x, W and b (each trained or not) as F.linear's, on 3-D input of awkward sizes; under bf16 autocast
    with float32 tensors the products run in bf16 and x's gradient comes back in float32."""
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=gen, dtype=torch.float64 if not autocast else torch.float32)
                       for shape in ((3, 7, 13), (11, 13), (11,)))  # fmt: skip
    for tensor, needs in zip((x, weight, bias), trained, strict=True):
        tensor.requires_grad_(needs)
    grad = torch.randn(3, 7, 11, generator=gen, dtype=x.dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stock = F.linear(x, weight, bias)
        mine = _UnreadLinear.apply(x, weight, bias)
    assert mine.shape == stock.shape and mine.dtype == stock.dtype and mine.isnan().all()
    inputs = [t for t in (x, weight, bias) if t.requires_grad]
    for theirs, ours in zip(torch.autograd.grad(stock, inputs, grad), torch.autograd.grad(mine, inputs, grad), strict=True):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


FAMILIES = {  # a gated MLP of separate gate and up projections, and Phi-3's fused gate_up_proj (the packed form)
    "llama": (LlamaConfig, LlamaForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
}


def _model(dropout: float = 0.0, lora_on=("q_proj", "down_proj"), family="llama"):
    config_class, model_class = FAMILIES[family]
    config = config_class(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config)
    if lora_on:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=list(lora_on)))
        for name, param in model.named_parameters():  # LoRA B starts at zero: give the adapters something to say
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    return model


@pytest.fixture
def base_gemms(monkeypatch):
    """`count(model)`: a list that grows by one per GEMM of a down projection's base weight (F.linear calls; a hook on
    the module would itself keep the projection computed, as DeepSpeed ZeRO-3's do)."""
    weights, calls = set(), []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, weight, *rest: (calls.append(1) if id(weight) in weights else None,
                                                               linear(x, weight, *rest))[1])

    def count(model) -> list:
        weights.clear()
        calls.clear()
        weights.update(id(getattr(mlp.down_proj, "base_layer", mlp.down_proj).weight) for mlp in layer_modules(model, "mlp"))
        return calls

    return count


def _loss_and_grads(model, tokens):
    torch.manual_seed(3)  # the same LoRA dropout draws in every run
    return loss_and_grads(model, tokens)


def _checkpointing(model, use_reentrant):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    base.enable_input_require_grads()


TOKENS = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("family", "dropout", "lora_on"), [
    ("llama", 0.0, ("q_proj", "down_proj")), ("llama", 0.2, ("q_proj", "down_proj")), ("llama", 0.0, ("q_proj",)),
    ("llama", 0.2, ("q_proj",)), ("llama", 0.0, ()), ("phi3", 0.2, ("qkv_proj", "down_proj")), ("phi3", 0.0, ()),
])
def test_a_reentrant_recomputation_spares_the_down_gemm_with_the_same_gradients(base_gemms, family, dropout, lora_on):
    """Re-entrant checkpointing: one down-projection GEMM per layer (the first forward's), not two; the loss and every
    gradient those of the run without checkpointing (LoRA dropout's draws replayed: the adapters still run)."""
    model = _model(dropout, lora_on, family)
    model.train()
    if not lora_on:
        for name, param in model.named_parameters():
            param.requires_grad_("_proj" in name and "mlp" not in name or "embed" in name)
    apply_kernels(model, {"swiglu": "reference"})
    gemms = base_gemms(model)
    plain_loss, plain_grads = _loss_and_grads(model, TOKENS)
    assert len(gemms) == 2 and plain_grads
    _checkpointing(model, use_reentrant=True)
    gemms.clear()
    loss, grads = _loss_and_grads(model, TOKENS)
    assert len(gemms) == 2  # the first forward's, one per layer; the recomputations ran none
    assert float(loss) == float(plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_non_reentrant_checkpointing_a_kept_output_and_hooks_compute_the_projection(base_gemms):
    """A non-re-entrant checkpoint matches its saved tensors one for one: computed there. With the family's MLP output
    marked kept (Gemma's post-feedforward norm reads it) computed too, and the stand-in forced on such a layer makes
    the gradients NaN, which is how a wrong `output_kept` would show; and where a hook runs with the projection."""
    model = _model()
    model.train()
    apply_kernels(model, {"swiglu": "reference"})
    gemms = base_gemms(model)
    plain_loss, plain_grads = _loss_and_grads(model, TOKENS)
    _checkpointing(model, use_reentrant=False)
    gemms.clear()
    loss, grads = _loss_and_grads(model, TOKENS)
    assert len(gemms) == 4 and float(loss) == float(plain_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)

    model = _model()
    model.train()
    family = families.family_of(model.config)
    kept = dataclasses.replace(family, mlp=dataclasses.replace(family.mlp, output_kept=True))
    original = families._families
    families._families = {**original, "llama": kept}
    try:
        apply_kernels(model, {"swiglu": "reference"})
    finally:
        families._families = original
    _checkpointing(model, use_reentrant=True)
    gemms = base_gemms(model)
    _loss_and_grads(model, TOKENS)
    assert len(gemms) == 4

    # the post-attention norm reads the residual sum the MLP output joins: unread there, it poisons the gradients
    norms = [layer.post_attention_layernorm for layer in model.base_model.model.model.layers]
    for norm in norms:
        norm.forward = lambda x, norm=norm: unread(torch.nn.Linear(x.shape[-1], x.shape[-1], bias=False), x) + type(norm).forward(norm, x)
    _, grads = _loss_and_grads(model, TOKENS)
    assert any(grad.isnan().any() for grad in grads.values())

    # a hook on the projection (DeepSpeed ZeRO-3 gathers a partitioned weight in one) runs with every forward: computed
    model = _model()
    model.train()
    apply_kernels(model, {"swiglu": "reference"})
    _checkpointing(model, use_reentrant=True)
    hooked = []
    for mlp in layer_modules(model, "mlp"):
        mlp.down_proj.register_forward_pre_hook(lambda module, args: hooked.append(module))
    gemms = base_gemms(model)
    _loss_and_grads(model, TOKENS)
    assert len(gemms) == 4 and len(hooked) == 4


def test_a_chunked_mlps_backward_spares_each_chunks_down_gemm(base_gemms):
    """A chunked MLP in a kept layer runs each chunk forward again in its backward, whose output only meets its
    gradient: its down projections there run no GEMM, and the gradients stay (no dropout: chunks draw otherwise)."""
    model = _model()
    model.train()
    apply_kernels(model, {"swiglu": "reference"})
    plain_loss, plain_grads = _loss_and_grads(model, TOKENS)
    for mlp in layer_modules(model, "mlp"):
        tile_mlp(mlp, 3)
    gemms = base_gemms(model)
    loss, grads = _loss_and_grads(model, TOKENS)
    assert len(gemms) == 2 * 3  # each chunk's first forward; the backward's replays ran none
    assert float(loss) == pytest.approx(float(plain_loss), rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_projections_without_a_stand_in_say_why():
    model = _model(lora_on=("down_proj",))
    down = layer_modules(model, "mlp")[0].down_proj
    assert unread_unfit(down) is None and unread_unfit(down.base_layer) is None
    with model.disable_adapter():
        assert "disabled" in unread_unfit(down)
    down.merge()
    assert "merged" in unread_unfit(down)
    down.unmerge()
    dora = get_peft_model(_model(lora_on=()), LoraConfig(r=4, target_modules=["down_proj"], use_dora=True))
    assert "DoRA" in unread_unfit(layer_modules(dora, "mlp")[0].down_proj)

    class Linear4bit(torch.nn.Linear):  # bitsandbytes' kind: a forward of its own
        def forward(self, x):
            return super().forward(x)

    assert "neither a plain Linear nor tiletune's QuantLinear" in unread_unfit(Linear4bit(4, 4))
    assert unread_unfit(QuantLinear(quantize(torch.randn(8, 64)))) is None
    linear = torch.nn.Linear(4, 4)
    linear.weight.ds_id = 7  # DeepSpeed ZeRO-3's mark on a partitioned parameter
    assert "not all here" in unread_unfit(linear)
    linear = torch.nn.Linear(4, 4)
    linear.register_forward_hook(lambda *args: None)
    assert "hooks" in unread_unfit(linear)
    assert "neither a plain Linear" in unread_unfit(torch.nn.Conv1d(4, 4, 1))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_quantized_stand_in_has_quant_linears_input_gradient_and_a_nan_output(autocast, kind):
    """A QuantLinear's stand-in (QLoRA's base layer): x's gradient that of quant_linear's op bit for bit, on 3-D
    input of awkward sizes, under bf16 autocast too (the products in bf16, x's gradient back in float32)."""
    gen = torch.Generator().manual_seed(0)
    module = QuantLinear(quantize(torch.randn(24, 64, generator=gen) / 8, kind, double=kind == "nf4"),
                         torch.randn(24, generator=gen))
    x = torch.randn(3, 7, 64, generator=gen, requires_grad=True)
    grad = torch.randn(3, 7, 24, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stock = module(x)
        mine = _UnreadQuantLinear.apply(x, module, "reference", False)
    assert mine.shape == stock.shape and mine.dtype == stock.dtype and mine.isnan().all()
    (theirs,), (ours,) = torch.autograd.grad(stock, [x], grad), torch.autograd.grad(mine, [x], grad)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("lora_on", [("q_proj", "down_proj"), ("q_proj",)])
def test_a_qlora_recomputation_spares_the_down_dequantization_and_gemm(monkeypatch, lora_on):
    """A 4-bit base (QLoRA) under re-entrant checkpointing: the down projections dequantize twice per layer (the first
    forward, the backward), not three times, with the loss and every gradient of the run without checkpointing; the
    stand-in's backward runs the implementation the binding chose (tagged on its forward)."""
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    model = get_peft_model(random_quantized(config, torch.float32, "nf4", True, torch.device("cpu")),
                           LoraConfig(r=4, lora_alpha=8, target_modules=list(lora_on)))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    model.train()
    report = apply_kernels(model, {"swiglu": "reference", "quant_linear": "reference", "quant_lora_linear": "reference"})
    down = layer_modules(model, "mlp")[0].down_proj
    assert unread_unfit(down) is None
    assert getattr(down.forward, "quantized_impl", None) == ("reference", False), report
    dequantized = []
    dequantize = quant_linear.dequantize
    monkeypatch.setattr(quant_linear, "dequantize", lambda q: (dequantized.append(q.shape == (32, 72)), dequantize(q))[1])
    plain_loss, plain_grads = _loss_and_grads(model, TOKENS)
    assert sum(dequantized) == 4 and plain_grads  # forward and backward of each layer's down projection
    _checkpointing(model, use_reentrant=True)
    dequantized.clear()
    loss, grads = _loss_and_grads(model, TOKENS)
    assert sum(dequantized) == 4  # the recomputations ran none
    assert float(loss) == float(plain_loss) and grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)
