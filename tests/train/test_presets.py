"""presets: every known shape builds (on the meta device) into its family's record, at the published size."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiletune.families import family_of
from tiletune.train.presets import PRESETS, preset_config

# billions of parameters as the model cards give them (rounded), for the shapes a user would recognise
PUBLISHED = {"llama3-8b": 8.03, "llama3-70b": 70.6, "qwen3-8b": 8.19, "mistral-7b": 7.25, "qwen3-30b-a3b": 30.5,
             "mixtral-8x7b": 46.7, "phi4-mini": 3.84, "phi3-mini": 3.82, "gpt-oss-20b": 20.91,
             "deepseek-v3": 671.0, "moonlight-16b-a3b": 16.0}  # fmt: skip


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_into_its_family(name):
    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert family_of(config) is not None, f"{name}: model_type {config.model_type} has no family record"
    if name in PUBLISHED:
        billions = sum(p.numel() for p in model.parameters()) / 1e9
        assert billions == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize("name", [name for name in PRESETS if getattr(preset_config(name), "layer_types", None)])
def test_a_preset_cut_to_its_first_layers_reloads(name):
    """Its per-layer attention kinds are cut with it: a config saved and read back (as from_pretrained reads it, and
    Unsloth's bench variant loads a preset) passes transformers' check that there is one kind per layer."""
    config = preset_config(name, layers=3)
    reloaded = type(config).from_dict(config.to_dict())
    assert reloaded.num_hidden_layers == 3
    assert reloaded.layer_types == preset_config(name).layer_types[:3]
