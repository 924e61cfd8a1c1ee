"""Load a model with its linear layers quantized (QLoRA's frozen base), one checkpoint tensor at a time.

The model is built without memory (accelerate's empty weights); the safetensors shards are read tensor by
tensor, each Linear weight quantized on the target device as it arrives and every other tensor (embeddings,
norms, lm_head: as bitsandbytes keeps them) placed in the compute dtype. The bf16 checkpoint is never whole
in memory: a model loads where its quantized size fits. `random_quantized` builds a randomly initialised
model the same way, tensor by tensor on the target device (bench presets up to the 70B shape, whose bf16
weights would not fit). `dequantized` turns the quantized Linears back into plain ones (for export).
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
    from safetensors import safe_open
    from tqdm import tqdm

    prequantized = is_bnb_4bit(config)
    if not prequantized:
        _refuse_prequantized(config, path)
    model, targets = _empty_model(config, dtype, model_kwargs)
    expected = set(model.state_dict())
    files = _checkpoint_files(path, hub_kwargs)
    saved_quantized: dict[str, dict[str, torch.Tensor]] = {}  # Linear -> its packed weight and quant state
    for file in tqdm(files, desc="loading, quantizing", unit="shard", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for key in shard.keys():
                owner = key.split(".weight")[0]
                if prequantized and owner in targets and key.startswith(owner + ".weight"):
                    saved_quantized.setdefault(owner, {})[key] = shard.get_tensor(key)
                elif key in expected:  # not e.g. a rotary inv_freq buffer some checkpoints carry
                    _place(model, targets, key, shard.get_tensor(key), kind, double, dtype, device)
    for owner, tensors in saved_quantized.items():  # as saved: no requantizing
        linear = model.get_submodule(owner)
        packed = tensors.pop(owner + ".weight")
        quantized = from_bnb(packed.to(device), {k: v.to(device) for k, v in tensors.items()},
                             (linear.out_features, linear.in_features), dtype)
        _into_quant_linear(model, owner, quantized)
    _finish(model, config)
    missing = sorted(name for name, p in model.named_parameters() if p.device.type == "meta")
    if missing:
        raise UserError(f"{path}: the checkpoint lacks {len(missing)} weights the model needs (first: {missing[0]}); "
                        "is it a complete Hugging Face checkpoint of this model?")
    return model


def random_quantized(config, dtype: torch.dtype, kind: str, double: bool, device: torch.device, seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM of `config` with every Linear but the output head quantized to `kind`,
    built on `device` one tensor at a time (normal(0, initializer_range) matrices, unit norms, zero biases):
    it fits where its quantized size does, never its bf16 size."""
    from tqdm import tqdm

    model, targets = _empty_model(config, dtype, {})
    generator = torch.Generator(device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    for key, param in tqdm(list(model.named_parameters()), desc="building, quantizing", unit="tensor", leave=False):
        tensor = torch.empty(param.shape, device=device, dtype=dtype)
        if key.endswith("bias"):
            tensor.zero_()
        elif param.dim() == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)
        _place(model, targets, key, tensor, kind, double, dtype, device)
    _finish(model, config)
    return model.to(device)  # the buffers built on the CPU (rotary frequencies)


def _empty_model(config, dtype: torch.dtype, model_kwargs: dict) -> tuple[nn.Module, set[str]]:
    """The model of `config` without memory, and the names of the Linears to quantize (all but the output head)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config.quantization_config = None  # built plain: its Linears become QuantLinear here
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    head = model.get_output_embeddings()
    return model, {name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head}


def _place(model: nn.Module, targets: set[str], key: str, tensor: torch.Tensor, kind: str, double: bool,
           dtype: torch.dtype, device: torch.device) -> None:
    """Put one tensor of the model in place: a target Linear's weight quantized on `device`, anything else
    on `device` in `dtype` (integer tensors as they are)."""
    from accelerate.utils import set_module_tensor_to_device

    owner = key.removesuffix(".weight")
    if owner != key and owner in targets:
        original = tensor.to(device)
        quantized = quantize(original, kind, double=double, dtype=dtype)
        _into_quant_linear(model, owner, quantized).quantization_error = _relative_error(dequantize(quantized), original)
    else:
        set_module_tensor_to_device(model, key, device, value=tensor, dtype=dtype if tensor.is_floating_point() else None)


def _relative_error(approximation: torch.Tensor, original: torch.Tensor) -> float:
    """‖approximation - original‖ / ‖original‖ in float32 (0 for an all-zero original)."""
    original = original.float()
    return float((approximation.float() - original).norm() / original.norm().clamp_min(torch.finfo(torch.float32).tiny))


def _finish(model: nn.Module, config) -> None:
    """Freeze the quantized base's biases and tie the embeddings where the config says so."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.bias is not None:
            module.bias.requires_grad_(False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()


def is_bnb_4bit(config) -> bool:
    """Whether a transformers config describes a bitsandbytes 4-bit checkpoint."""
    settings = _quantization_settings(config)
    return settings.get("quant_method") == "bitsandbytes" and bool(settings.get("load_in_4bit"))


def _quantization_settings(config) -> dict:
    """The checkpoint's quantization_config as a dict (empty for a plain checkpoint)."""
    settings = getattr(config, "quantization_config", None) or {}
    return settings if isinstance(settings, dict) else settings.to_dict()


def _into_quant_linear(model: nn.Module, name: str, quantized) -> QuantLinear:
    """Replace the Linear `name` by a QuantLinear of `quantized`, keeping its bias Parameter (loaded already, or
    still empty and filled when its tensor arrives); returns it."""
    module = QuantLinear(quantized)
    module.bias = model.get_submodule(name).bias
    _replace(model, name, module)
    return module


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
