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
from tiletune.quant import dequantize, quantize

log = logging.getLogger(__name__)


def quantized_kind(bits: int, quantization_type: str) -> str:
    """The tiletune.quant format of LLaMA-Factory's quantization_bit / quantization_type."""
    return quantization_type if bits == 4 else "int8"


def load_quantized(path: str, config, dtype: torch.dtype, kind: str, double: bool, device: torch.device,
                   model_kwargs: dict, hub_kwargs: dict) -> nn.Module:
    """The causal LM at `path` with every Linear but the output head quantized to `kind` on `device`."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    _refuse_prequantized(config, path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    head = model.get_output_embeddings()
    targets = {name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head}
    expected = set(model.state_dict())
    files = _checkpoint_files(path, hub_kwargs)
    loaded = set()
    for file in tqdm(files, desc="loading, quantizing", unit="shard", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for key in shard.keys():
                if key not in expected:
                    continue  # e.g. a rotary inv_freq buffer some checkpoints carry
                module_name, _, leaf = key.rpartition(".")
                tensor = shard.get_tensor(key)
                if module_name in targets and leaf == "weight":
                    _quantize_into(model, module_name, tensor.to(device), kind, double, dtype)
                elif module_name in targets and isinstance(model.get_submodule(module_name), QuantLinear):
                    model.get_submodule(module_name).bias = nn.Parameter(tensor.to(device, dtype), requires_grad=False)
                else:
                    set_module_tensor_to_device(model, key, device, value=tensor, dtype=dtype if tensor.is_floating_point() else None)
                loaded.add(key)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = sorted(name for name, p in model.named_parameters() if p.device.type == "meta")
    if missing:
        raise UserError(f"{path}: the checkpoint lacks {len(missing)} weights the model needs (first: {missing[0]}); "
                        "is it a complete Hugging Face checkpoint of this model?")
    return model


def _quantize_into(model: nn.Module, name: str, weight: torch.Tensor, kind: str, double: bool, dtype: torch.dtype) -> None:
    parent_name, _, child = name.rpartition(".")
    old = model.get_submodule(name)
    bias = old.bias if old.bias is not None and old.bias.device.type != "meta" else None
    quantized = QuantLinear(quantize(weight, kind, double=double, dtype=dtype), None if bias is None else bias.detach())
    if old.bias is not None and bias is None:  # the bias arrives later in the checkpoint
        quantized.bias = old.bias
    setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)


def _refuse_prequantized(config, path: str) -> None:
    method = (getattr(config, "quantization_config", None) or {})
    method = method.get("quant_method") if isinstance(method, dict) else getattr(method, "quant_method", None)
    if method:
        raise UserError(f"{path} is already quantized ({method}); quantization_bit quantizes a bf16/fp16 checkpoint "
                        "(point model_name_or_path at the original model)")


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
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
    return model
