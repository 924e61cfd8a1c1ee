"""What the engine binds where, and what it says about what it leaves: hooked models, Linear subclasses,
offset norms, MoE routers, per-apply run-time fallback counts."""

import dataclasses

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tiletune import families
from tiletune.kernels import registry
from tiletune.patch import apply_kernels


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def test_loss_op_on_a_model_with_accelerate_hooks_keeps_generation_working():
    """With a hook (device_map='auto' in chat), labels=None must reach the model's own forward, not the hook again."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_llama()
    with torch.no_grad():
        stock = model(tokens()).logits
    add_hook_to_module(model, ModelHook())
    report = apply_kernels(model, "linear_cross_entropy")
    assert [(e.module, e.installed) for e in report.entries] == [("lm_head", True)]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, stock, rtol=0, atol=0)
        ids = tokens()
        assert model(ids, labels=ids).loss is not None
    report.revert()
    assert "_old_forward" not in model.__dict__ or model._old_forward.__func__ is LlamaForCausalLM.forward


class RoutingLinear(nn.Linear):
    """A Linear subclass with its own forward, as MoE routers and quantized layers are."""

    def forward(self, x):
        return super().forward(x).softmax(-1)


def test_linear_subclass_with_its_own_forward_is_left_alone_and_named():
    model = tiny_llama()
    layer = model.model.layers[0]
    old = layer.mlp.gate_proj
    layer.mlp.gate_proj = RoutingLinear(old.in_features, old.out_features, bias=False)
    report = apply_kernels(model, "linear")
    unfit = [(e.layer, e.module, e.fallback) for e in report.entries if not e.installed]
    assert unfit == [(0, "mlp.gate_proj", "RoutingLinear has its own forward, not F.linear: stock forward kept")]
    assert "forward" not in layer.mlp.gate_proj.__dict__ and "forward" in layer.mlp.up_proj.__dict__
    assert report.to_dict()["ops"]["linear"]["patched"] == 13


@pytest.fixture
def llama_with_an_offset_norm():
    """The llama record with its input norm made Gemma's x·(1 + w), restored afterwards."""
    llama = families.family_of(tiny_llama().config)
    families.register(dataclasses.replace(llama, norms=(families.Norm("input_layernorm", offset=True),
                                                        families.Norm("post_attention_layernorm"))))
    yield
    families.register(llama)


def test_an_offset_norm_in_a_record_binds_with_the_offset_form(llama_with_an_offset_norm):
    """The record is what the engine knows of a model: a norm it calls x·(1 + w) gets rms_norm with offset 1."""
    from tiletune.kernels.rms_norm import reference_forward

    model = tiny_llama()
    report = apply_kernels(model, "rms_norm")
    assert all(e.installed for e in report.entries) and report.to_dict()["ops"]["rms_norm"]["patched"] == 4
    norm, x = model.model.layers[0].input_layernorm, torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), reference_forward(x, norm.weight, norm.variance_epsilon, 1.0), rtol=0, atol=0)


def tiny_qwen3_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2)
    return Qwen3MoeForCausalLM(config).eval()


def test_moe_router_is_not_a_linear_site_and_the_model_still_computes_the_same():
    model = tiny_qwen3_moe().requires_grad_(False)  # frozen experts (as under LoRA): moe_experts takes them
    with torch.no_grad():
        stock = model(tokens()).logits
    report = apply_kernels(model, "all")
    counts = {op: info["patched"] for op, info in report.to_dict()["ops"].items()}
    assert counts == {"rms_norm": 8, "swiglu": 0, "rope": 2, "linear": 8, "lora_linear": 0, "linear_cross_entropy": 1,
                      "quant_linear": 0, "quant_lora_linear": 0, "geglu": 0, "linear_logprobs": 0, "moe_experts": 2}
    assert not any("gate" in e.module and "proj" not in e.module for e in report.entries)
    assert report.unbound_roles == {"attention": 2}
    assert "attention: 2 modules no selected op binds them (opt-in: attention)" in report.summary()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, stock, rtol=1e-5, atol=1e-5)


def test_run_time_fallbacks_are_counted_per_apply():
    model = tiny_llama()
    registry.note_fallback("rms_norm", "tilelang", "counted before the apply")
    report = apply_kernels(model, {"rms_norm": "tilelang"})
    with torch.no_grad():
        model(tokens())
    report.revert()
    with torch.no_grad():  # after the revert: another run's calls are not this report's
        apply_kernels(model, {"rms_norm": "tilelang"})
        model(tokens())
    mine = {item["reason"]: item["calls"] for item in report.runtime_fallbacks()}
    assert "counted before the apply" not in mine
    expected = 4 if registry.get("rms_norm", "tilelang").unavailable() else 0  # 2 layers x 2 norms, one forward
    assert sum(mine.values()) == expected
