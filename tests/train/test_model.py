"""Model setup from LLaMA-Factory's keys: `rope_scaling` in the loaded config and its rotary embedding, and
PiSSA's adapter initialisation."""

import pytest
import torch
from safetensors.torch import load_file

from tiletune.config import build_config
from tiletune.errors import UserError
from tiletune.train.model import load_model, load_tokenizer, scale_rope


def loaded(model_dir, trainable=True, **keys):
    """The tiny Llama as `tiletune train` loads it with these keys, and the base model under any adapter."""
    cfg = build_config({"model_name_or_path": str(model_dir), "finetuning_type": "full", **keys})
    model = load_model(cfg, load_tokenizer(cfg), trainable=trainable)
    return model, (model.get_base_model() if hasattr(model, "get_base_model") else model)


def rotary(model, positions: int) -> torch.Tensor:
    cos, sin = model.model.rotary_emb(torch.zeros(1, positions, 1), torch.arange(positions)[None])
    return torch.cat([cos, sin], dim=-1)


@pytest.mark.parametrize("kind, extra", [
    ("linear", {}),
    ("dynamic", {"original_max_position_embeddings": 512}),
    ("yarn", {"original_max_position_embeddings": 512}),
    ("llama3", {"original_max_position_embeddings": 512, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
])  # fmt: skip
def test_rope_scaling_sets_the_config_as_llamafactory_and_changes_the_rotary_embedding(tiny_model_dir, kind, extra):
    _, stock = loaded(tiny_model_dir, cutoff_len=1200)
    _, scaled = loaded(tiny_model_dir, cutoff_len=1200, rope_scaling=kind)  # 1200 / 512 positions: factor 3
    assert {k: v for k, v in scaled.config.rope_parameters.items() if k != "rope_theta"} == {
        "rope_type": kind, "factor": 3.0, **extra}
    assert scaled.config.rope_parameters["rope_theta"] == stock.config.rope_parameters["rope_theta"]
    assert scaled.config.max_position_embeddings == 1536
    assert not torch.allclose(rotary(scaled, 2048), rotary(stock, 2048))  # dynamic: past the enlarged 1536


def test_rope_scaling_factor_is_two_for_inference_and_off_when_cutoff_len_fits(tiny_model_dir):
    _, exported = loaded(tiny_model_dir, trainable=False, rope_scaling="linear")
    assert exported.config.rope_parameters["factor"] == 2.0 and exported.config.max_position_embeddings == 1024
    _, fits = loaded(tiny_model_dir, cutoff_len=512, rope_scaling="linear")
    assert fits.config.rope_parameters["rope_type"] == "default" and fits.config.max_position_embeddings == 512


def test_rope_scaling_refuses_a_model_with_rotary_parameters_per_layer_type():
    from transformers import Gemma3TextConfig

    cfg = build_config({"model_name_or_path": "m", "rope_scaling": "linear", "cutoff_len": 200000})
    with pytest.raises(UserError, match="one per layer type"):
        scale_rope(cfg, Gemma3TextConfig(), trainable=True)


@pytest.mark.parametrize("pissa_iter", [-1, 4])
def test_pissa_init_puts_the_principal_part_in_the_adapter_and_takes_it_from_the_base(tiny_model_dir, pissa_iter):
    model, base = loaded(tiny_model_dir, finetuning_type="lora", lora_rank=4, pissa_init=True, pissa_iter=pissa_iter)
    q = base.model.layers[0].self_attn.q_proj
    assert model.peft_config["default"].init_lora_weights == ("pissa" if pissa_iter == -1 else "pissa_niter_4")
    assert q.lora_B["default"].weight.abs().sum() > 0  # LoRA's own initialisation starts B at zero
    original = load_file(tiny_model_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    residual = q.base_layer.weight
    adapter = q.lora_B["default"].weight @ q.lora_A["default"].weight * q.scaling["default"]
    assert not torch.allclose(residual, original.to(residual.dtype))
    torch.testing.assert_close(residual + adapter, original.to(residual.dtype), atol=1e-5, rtol=1e-4)
