"""Extending the engine without editing it: a toy op as a one-file plugin, a toy family as one record."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from _steps import adamw_losses
from transformers import LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM

from tiletune import families
from tiletune.kernels import registry
from tiletune.patch import apply_kernels

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"  # the one-file examples docs/design.md shows


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def train(model, kernels, steps: int = 3) -> list[float]:
    """Losses of a few AdamW steps on fixed tokens with `kernels` applied."""
    report = apply_kernels(model, kernels)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    losses = adamw_losses(model, ids, list(model.parameters()), steps)
    report.revert()
    return losses


@pytest.fixture
def plugins(monkeypatch):
    """examples/plugins importable; what they registered removed afterwards."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    yield
    for name in ("toy_norm", "olmo2_family"):
        sys.modules.pop(name, None)
    registry._ops.pop("toy_norm", None)
    registry._impls.pop("toy_norm", None)
    families._families.pop("olmo2", None)


def test_a_one_file_plugin_adds_an_op_that_trains(plugins, monkeypatch):
    stock = train(tiny_llama(), "none")
    model = tiny_llama()
    report = apply_kernels(model, {"toy_norm": "reference", "plugins": ["toy_norm"]})
    assert report.to_dict()["ops"]["toy_norm"]["patched"] == 4  # input and post-attention norm of 2 layers
    assert "toy_norm" in registry.OPS and "toy_norm" in registry.OPT_IN  # opt-in: `all` leaves it out
    calls = []
    impl = registry.get("toy_norm", "reference")
    monkeypatch.setitem(registry._impls["toy_norm"], "reference",
                        dataclasses.replace(impl, forward=lambda *a: calls.append(1) or impl.forward(*a)))
    patched = train(model, {"toy_norm": "reference", "plugins": ["toy_norm"]})
    assert len(calls) == 3 * 4  # every norm of every step ran the plugin's op
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(stock), rtol=1e-5, atol=1e-6)


def test_a_model_without_a_family_record_trains_with_every_fallback_named():
    model = tiny_olmo2()
    report = apply_kernels(model, "all")
    assert report.entries == [] and set(report.fallbacks()) == {s.op for s in report.spec.ops}
    assert all("no family record for model_type 'olmo2'" in reason for reason in report.fallbacks().values())
    assert "family without a record" in report.summary() and "no family record" in report.summary()
    losses = train(model, "all")
    assert losses[-1] < losses[0]


def tiny_olmo2() -> Olmo2ForCausalLM:
    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256)
    return Olmo2ForCausalLM(config)


def test_a_family_record_alone_binds_every_op_and_trains_like_stock(plugins):
    stock = train(tiny_olmo2(), "none")
    model = tiny_olmo2()
    report = apply_kernels(model, {"all": True, "plugins": ["olmo2_family"]})
    counts = {op: info["patched"] for op, info in report.to_dict()["ops"].items()}
    assert counts == {"rms_norm": 8, "swiglu": 2, "rope": 2, "linear": 14, "lora_linear": 0, "linear_cross_entropy": 1,
                      "quant_linear": 0, "quant_lora_linear": 0, "geglu": 0, "linear_logprobs": 0, "moe_experts": 0}
    assert report.family == "olmo2"
    assert all("no CUDA" in reason or "not installed" in reason for reason in report.fallbacks().values())  # the machine's
    patched = train(model, {"all": True, "plugins": ["olmo2_family"]})
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(stock), rtol=1e-5, atol=1e-6)
