"""Load a model with its linear layers quantized (QLoRA's frozen base), one checkpoint tensor at a time.

The model is built without memory (accelerate's empty weights); the safetensors shards are read tensor by
tensor, each Linear weight quantized on the target device as it arrives and every other tensor (embeddings,
norms, lm_head: as bitsandbytes keeps them) placed in the compute dtype. The bf16 checkpoint is never whole
in memory: a model loads where its quantized size fits. `dequantized` turns the quantized Linears back
into plain ones (for export).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from tiletune.errors import UserError
from tiletune.kernels.quant_linear import QuantLinear
from tiletune.quant import dequantize, from_bnb, quantize

log = logging.getLogger(__name__)


def quantized_kind(bits: int, quantization_type: str) -> str:
    """The tiletune.quant format of LLaMA-Factory's quantization_bit / quantization_type."""
    return quantization_type if bits == 4 else "int8"


def load_quantized(path: str, config, dtype: torch.dtype, kind: str, double: bool, device: torch.device,
                   model_kwargs: dict, hub_kwargs: dict) -> nn.Module:
    """The causal LM at `path` with every Linear but the output head quantized to `kind` on `device`; a
    bitsandbytes 4-bit checkpoint (the "-bnb-4bit" folders) keeps its own quantized weights as saved."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    prequantized = is_bnb_4bit(config)
    if not prequantized:
        _refuse_prequantized(config, path)
    config.quantization_config = None  # built plain: its Linears become QuantLinear here
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    head = model.get_output_embeddings()
    targets = {name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head}
    expected = set(model.state_dict())
    files = _checkpoint_files(path, hub_kwargs)
    saved_quantized: dict[str, dict[str, torch.Tensor]] = {}  # Linear -> its packed weight and quant state
    for file in tqdm(files, desc="loading, quantizing", unit="shard", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for key in shard.keys():
                owner = key.split(".weight")[0]
                if prequantized and owner in targets and key.startswith(owner + ".weight"):
                    saved_quantized.setdefault(owner, {})[key] = shard.get_tensor(key)
                elif key not in expected:
                    continue  # e.g. a rotary inv_freq buffer some checkpoints carry
                elif key.endswith(".weight") and owner in targets:
                    quantized = quantize(shard.get_tensor(key).to(device), kind, double=double, dtype=dtype)
                    _into_quant_linear(model, owner, quantized)
                else:
                    tensor = shard.get_tensor(key)
                    set_module_tensor_to_device(model, key, device, value=tensor, dtype=dtype if tensor.is_floating_point() else None)
    for owner, tensors in saved_quantized.items():  # as saved: no requantizing
        linear = model.get_submodule(owner)
        packed = tensors.pop(owner + ".weight")
        quantized = from_bnb(packed.to(device), {k: v.to(device) for k, v in tensors.items()},
                             (linear.out_features, linear.in_features), dtype)
        _into_quant_linear(model, owner, quantized)
    for module in model.modules():  # the quantized base is frozen, biases included
        if isinstance(module, QuantLinear) and module.bias is not None:
            module.bias.requires_grad_(False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = sorted(name for name, p in model.named_parameters() if p.device.type == "meta")
    if missing:
        raise UserError(f"{path}: the checkpoint lacks {len(missing)} weights the model needs (first: {missing[0]}); "
                        "is it a complete Hugging Face checkpoint of this model?")
    return model


def is_bnb_4bit(config) -> bool:
    """Whether a transformers config describes a bitsandbytes 4-bit checkpoint."""
    settings = _quantization_settings(config)
    return settings.get("quant_method") == "bitsandbytes" and bool(settings.get("load_in_4bit"))


def _quantization_settings(config) -> dict:
    """The checkpoint's quantization_config as a dict (empty for a plain checkpoint)."""
    settings = getattr(config, "quantization_config", None) or {}
    return settings if isinstance(settings, dict) else settings.to_dict()


def _into_quant_linear(model: nn.Module, name: str, quantized) -> None:
    """Replace the Linear `name` by a QuantLinear of `quantized`, keeping its bias Parameter (loaded already, or
    still empty and filled when its tensor arrives)."""
    module = QuantLinear(quantized)
    module.bias = model.get_submodule(name).bias
    _replace(model, name, module)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _refuse_prequantized(config, path: str) -> None:
    method = _quantization_settings(config).get("quant_method")
    if method:
        raise UserError(f"{path} is already quantized ({method}); tiletune loads bf16/fp16 checkpoints (quantizing them "
                        "with quantization_bit) and bitsandbytes 4-bit ones: point model_name_or_path at the original model")


def _checkpoint_files(path: str, hub_kwargs: dict) -> list[Path]:
    """The safetensors files of a local model folder or a hub model (downloaded to the cache)."""
    folder = Path(path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=["*.safetensors", "*.json"],
                                        cache_dir=hub_kwargs.get("cache_dir"), revision=hub_kwargs.get("revision"),
                                        token=hub_kwargs.get("token")))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} holds no .safetensors weights; quantization_bit loads safetensors checkpoints")
    return files


def dequantized(model: nn.Module) -> nn.Module:
    """`model` with every QuantLinear replaced by an nn.Linear of its dequantized weight (in its compute dtype)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=module.weight.device, dtype=module.compute_dtype)
            with torch.no_grad():
                linear.weight.copy_(dequantize(module.quantized))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            _replace(model, name, linear)
    return model
