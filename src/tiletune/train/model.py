"""Load the tokenizer and model, choose the precision, and set up LoRA / OFT / freeze / full fine-tuning.

One place decides dtype and device: `compute_dtype`. As in LLaMA-Factory, the weights load in the
compute dtype and the parameters that train are kept in float32 (mixed precision via autocast),
unless `pure_bf16`.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from tiletune.config import TuneConfig
from tiletune.errors import UserError

log = logging.getLogger(__name__)
ATTENTION = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2", "fa3": "flash_attention_3"}


def compute_dtype(cfg: TuneConfig) -> torch.dtype:
    """The dtype of the forward pass; refuses a dtype the accelerator lacks."""
    if cfg.train_arg("bf16") or cfg.pure_bf16:
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise UserError(
                f"bf16 is set but {torch.cuda.get_device_name()} has no bfloat16 support; "
                "set bf16=false fp16=true (or train in float32)"
            )
        return torch.bfloat16
    if cfg.train_arg("fp16"):
        if not torch.cuda.is_available():
            raise UserError("fp16 is set but there is no GPU; fp16 mixed precision needs one — set fp16=false")
        return torch.float16
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision to `dtype` on `device` for bf16/fp16; no autocast for float32/64 runs."""
    from contextlib import nullcontext

    return torch.autocast(device.type, dtype=dtype) if dtype in (torch.bfloat16, torch.float16) else nullcontext()


def _hub_kwargs(cfg: TuneConfig) -> dict:
    return {
        "cache_dir": cfg.cache_dir,
        "revision": cfg.model_revision,
        "token": cfg.hf_hub_token,
        "trust_remote_code": cfg.trust_remote_code,
    }


def _check_model_path(path: str) -> None:
    local = Path(path)
    looks_local = path.startswith((".", "/", "~")) or local.exists() or path.count("/") != 1
    if looks_local and not local.is_dir():
        raise UserError(
            f"model_name_or_path {path!r} is not a directory; give a local Hugging Face model folder "
            "or a hub id 'owner/name'"
        )
    if local.is_dir() and not (local / "config.json").is_file():
        raise UserError(f"model_name_or_path {path!r} has no config.json; it is not a Hugging Face model folder")


def load_tokenizer(cfg: TuneConfig):
    """The tokenizer of `model_name_or_path` (padding on the right for training)."""
    from transformers import AutoTokenizer

    _check_model_path(cfg.model_name_or_path)
    return AutoTokenizer.from_pretrained(
        cfg.model_name_or_path, use_fast=cfg.use_fast_tokenizer, padding_side="right", **_hub_kwargs(cfg)
    )


def load_model(cfg: TuneConfig, tokenizer, trainable: bool, device_map: str | None = None, keep_quantized: bool = False):
    """The causal LM, resized to the tokenizer if needed, set up for `finetuning_type` when `trainable`.

    `device_map` ("auto" spreads the weights over the accelerators) is for inference; the Trainer places
    a trainable model itself. Not trainable, adapters are merged into the weights; a quantized base is
    dequantized for that, unless `keep_quantized` (chat): then one adapter stays unmerged on the quantized
    weights, which keep their size.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiletune.train.quantized import is_bnb_4bit

    dtype = compute_dtype(cfg)
    config = AutoConfig.from_pretrained(cfg.model_name_or_path, **_hub_kwargs(cfg))
    scale_rope(cfg, config, trainable)
    if cfg.quantization_bit or is_bnb_4bit(config):
        model = _load_quantized(cfg, config, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model_name_or_path,
            config=config,  # read once, above
            dtype=dtype,
            attn_implementation=ATTENTION[cfg.flash_attn],
            low_cpu_mem_usage=cfg.low_cpu_mem_usage,
            device_map=device_map,
            **_hub_kwargs(cfg),
        )
    embeddings = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embeddings:
        if not cfg.resize_vocab and trainable and cfg.finetuning_type == "lora":
            log.warning("the template added tokens; resizing embeddings (set resize_vocab=true to train them)")
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    if not trainable:
        quantized = bool(cfg.quantization_bit or is_bnb_4bit(config))
        adapters = _adapter_paths(cfg)
        if quantized and keep_quantized and len(adapters) == 1:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapters[0], **_hub_kwargs(cfg))  # unmerged, over QuantLinear
        elif adapters:
            if quantized:  # adapters merge into weights, not into packed codes
                from tiletune.train.quantized import dequantized

                log.info("dequantizing the quantized base to %s to merge the adapters", dtype)
                model = dequantized(model)
            model = _load_adapters(cfg, model, trainable=False)
        return model.eval()
    return prepare_for_training(cfg, model)


# rope_scaling -> what LLaMA-Factory's configure_rope sets beside the type and factor (`old`: the trained length)
ROPE_EXTRAS = {
    "linear": lambda old: {},
    "dynamic": lambda old: {"original_max_position_embeddings": old},
    "yarn": lambda old: {"original_max_position_embeddings": old},
    "llama3": lambda old: {"original_max_position_embeddings": old, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


def scale_rope(cfg: TuneConfig, config, trainable: bool) -> None:
    """`rope_scaling` in the model config's rotary parameters, as LLaMA-Factory's configure_rope sets them.

    Training, the factor is ceil(cutoff_len / the trained length) and no scaling when cutoff_len fits; otherwise
    (export, chat, prediction alone) 2. The trained length is the config's original_max_position_embeddings, or
    its max_position_embeddings, which grows by the factor.
    """
    if cfg.rope_scaling is None:
        return
    rope = getattr(config, "rope_parameters", None)
    if not rope or any(isinstance(value, dict) for value in rope.values()):
        raise UserError(f"rope_scaling={cfg.rope_scaling}: {config.model_type} has no single set of rotary parameters "
                        "to scale (none, or one per layer type); remove rope_scaling")  # fmt: skip
    old = rope.get("original_max_position_embeddings") or config.max_position_embeddings
    if trainable and cfg.cutoff_len <= old:
        log.warning("rope_scaling=%s: cutoff_len %d fits the %d positions the model was trained on; no scaling "
                    "(as LLaMA-Factory)", cfg.rope_scaling, cfg.cutoff_len, old)  # fmt: skip
        return
    factor = float(math.ceil(cfg.cutoff_len / old)) if trainable else 2.0
    kept = {key: rope[key] for key in ("rope_theta", "partial_rotary_factor") if key in rope}
    config.rope_parameters = {**kept, "rope_type": cfg.rope_scaling, "factor": factor, **ROPE_EXTRAS[cfg.rope_scaling](old)}
    config.max_position_embeddings = int(old * factor)
    config.standardize_rope_params()
    log.info("rope_scaling=%s: factor %g, %d positions (from %d)", cfg.rope_scaling, factor,
             config.max_position_embeddings, old)  # fmt: skip


def _load_quantized(cfg: TuneConfig, config, dtype: torch.dtype):
    """The model with its Linears quantized as quantization_bit / quantization_type say (or as a bitsandbytes
    4-bit checkpoint holds them), on the GPU if there is one."""
    from tiletune.train.quantized import load_quantized, quantized_kind

    if cfg.finetuning_type != "lora":
        raise UserError(f"{cfg.model_name_or_path} holds quantized weights; they train through LoRA adapters only: "
                        "set finetuning_type=lora")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = quantized_kind(cfg.quantization_bit or 4, cfg.quantization_type)
    log.info("quantizing the linear layers of %s to %s as they load", cfg.model_name_or_path, kind)
    return load_quantized(cfg.model_name_or_path, config, dtype, kind, cfg.double_quantization, device,
                          {"attn_implementation": ATTENTION[cfg.flash_attn]}, _hub_kwargs(cfg))


def prepare_for_training(cfg: TuneConfig, model):
    """Gradient checkpointing, then LoRA / OFT / freeze / full as `finetuning_type` says, trainable weights in float32."""
    model.config.use_cache = False
    if cfg.checkpointing != "off" and getattr(model, "supports_gradient_checkpointing", False):
        set_checkpointing(model, enabled=True, use_reentrant=cfg.use_reentrant_gc)
        model.enable_input_require_grads()
    if cfg.finetuning_type in ADAPTERS:
        model = _setup_adapter(cfg, model)
    elif cfg.finetuning_type == "freeze":
        _setup_freeze(cfg, model)
    if not cfg.pure_bf16:
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    if cfg.print_param_status:
        for name, param in model.named_parameters():
            log.info("%s %s %s trainable=%s", name, param.dtype, tuple(param.shape), param.requires_grad)
    return model


def set_checkpointing(model, enabled: bool, use_reentrant: bool = True) -> None:
    """Turn activation (gradient) checkpointing of the decoder layers on or off, in either transformers API."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    renamed = hasattr(base, "activation_checkpointing_enable")  # transformers >= 5.2x
    if enabled and renamed:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    elif enabled:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    elif renamed:
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()


def _adapter_paths(cfg: TuneConfig) -> list[str]:
    """The adapters `adapter_name_or_path` lists (comma-separated); UserError for a folder that holds none."""
    paths = [p.strip() for p in (cfg.adapter_name_or_path or "").split(",") if p.strip()]
    for path in paths:
        if not Path(path, "adapter_config.json").is_file() and Path(path).exists():
            raise UserError(f"adapter_name_or_path {path!r} has no adapter_config.json; it is not a PEFT adapter")
    return paths


def _load_adapters(cfg: TuneConfig, model, trainable: bool):
    from peft import PeftModel

    paths = _adapter_paths(cfg)
    # All adapters but the one that keeps training are merged into the base weights.
    keep_last = trainable and not cfg.create_new_adapter
    for path in paths[:-1] if keep_last else paths:
        model = PeftModel.from_pretrained(model, path, **_hub_kwargs(cfg)).merge_and_unload()
    if keep_last:
        model = PeftModel.from_pretrained(model, paths[-1], is_trainable=True, **_hub_kwargs(cfg))
    return model


def linear_module_names(model) -> list[str]:
    """Names of the Linear layers inside the decoder (what `lora_target: all` means), lm_head excluded, and MoE
    routers (they route tokens; the family record names them), which LoRA would break (Llama 4's returns a tuple)."""
    from tiletune.families import family_of

    output = model.get_output_embeddings()
    family = family_of(model.config)
    routers = {family.experts.router.rsplit(".", 1)[-1]} if family and family.experts else set()
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output
    }
    return sorted(names - routers)


def expert_parameters(model) -> list[str]:
    """What `lora_target_experts` puts LoRA on (peft's `target_parameters`): the MoE experts' 3-D weights (transformers
    5 fuses each layer's experts into `gate_up_proj` [experts, 2·inter, hidden] and `down_proj` [experts, hidden, inter]),
    found at the family record's experts path; the router, elsewhere, never. UserError for a model without them."""
    from tiletune.families import family_of

    family = family_of(model.config)
    model_type = getattr(model.config, "model_type", None)
    if family is None or family.experts is None:
        why = "no family record names them" if family is None else f"the {family.name} family is dense"
        raise UserError(f"lora_target_experts=true: {model_type} has no MoE experts ({why}); remove lora_target_experts")
    path = family.experts.path
    names = {f"{path}.{name}" for module_path, module in model.named_modules() if module_path.endswith("." + path)
             for name, param in module.named_parameters(recurse=False) if param.dim() == 3}
    if not names:
        raise UserError(f"lora_target_experts=true: the experts of {model_type} (at {path}) hold no 3-D expert weights for "
                        "LoRA on parameters; remove lora_target_experts")
    return sorted(names)


def _lora_config(cfg: TuneConfig, targets: list[str], parameters: list[str] | None = None):
    """LoRA, initialised as peft's PiSSA with `pissa_init` (a full SVD with pissa_iter -1, else that many fast-SVD steps);
    `parameters`: peft's target_parameters (`lora_target_experts`)."""
    from peft import LoraConfig

    pissa = "pissa" if cfg.pissa_iter == -1 else f"pissa_niter_{cfg.pissa_iter}"
    extra = {"target_parameters": parameters} if parameters else {}
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha or cfg.lora_rank * 2,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        modules_to_save=_names(cfg.additional_target),
        use_rslora=cfg.use_rslora,
        use_dora=cfg.use_dora,
        init_lora_weights=pissa if cfg.pissa_init else True,
        **extra,
    )


def _oft_config(cfg: TuneConfig, targets: list[str]):
    """OFT (orthogonal fine-tuning): LLaMA-Factory's oft_rank, oft_block_size and module_dropout."""
    from peft import OFTConfig

    return OFTConfig(
        task_type="CAUSAL_LM",
        r=cfg.oft_rank,
        oft_block_size=cfg.oft_block_size,
        module_dropout=cfg.module_dropout,
        target_modules=targets,
        modules_to_save=_names(cfg.additional_target),
    )


# finetuning_type -> (the peft config builder, the key naming its target layers)
ADAPTERS = {"lora": (_lora_config, "lora_target"), "oft": (_oft_config, "oft_target")}


def _names(value: str | None) -> list[str] | None:
    return [name.strip() for name in value.split(",")] if value else None


def _setup_adapter(cfg: TuneConfig, model):
    """The adapters of adapter_name_or_path (the last one keeps training), or a new one on the target layers."""
    from peft import get_peft_model

    if cfg.adapter_name_or_path:
        model = _load_adapters(cfg, model, trainable=True)
        if not cfg.create_new_adapter:
            if cfg.pissa_init:
                raise UserError("pissa_init initialises a new adapter, and adapter_name_or_path continues training the "
                                "last one; set create_new_adapter=true or remove pissa_init")  # fmt: skip
            if cfg.lora_target_experts and not getattr(model.peft_config[model.active_adapter], "target_parameters", None):
                raise UserError("lora_target_experts=true, but the adapter adapter_name_or_path continues training has no "
                                "LoRA on the expert weights; set create_new_adapter=true or remove lora_target_experts")
            return model
    build, target_key = ADAPTERS[cfg.finetuning_type]
    targets = target_modules(model, target_key, getattr(cfg, target_key))
    if cfg.finetuning_type == "lora" and cfg.lora_target_experts:
        return get_peft_model(model, build(cfg, targets, expert_parameters(model)))
    return get_peft_model(model, build(cfg, targets))


def target_modules(model, key: str, value: str) -> list[str]:
    """The Linear layers a target key (`lora_target`, `oft_target`, `galore_target`, ...) names: comma-separated
    names, or `all` (`linear_module_names`); UserError for a name the model lacks."""
    available = linear_module_names(model)
    targets = available if value == "all" else _names(value)
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise UserError(f"{key} {unknown[0]!r} is not a linear layer of this model; available: {', '.join(available)} or all")
    return targets


def pissa_convert_callback():
    """`pissa_convert`, as LLaMA-Factory does it: the PiSSA adapter as initialised is saved in pissa_init/ when
    training starts (not when it resumes), and the trained one is written again at the end, in pissa_converted/,
    as a plain LoRA adapter (rank 2r) over the unmodified base weights."""
    from transformers import TrainerCallback

    class PissaConvert(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if args.should_save and state.global_step == 0:
                model.save_pretrained(Path(args.output_dir, "pissa_init"))

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if args.should_save:
                model.save_pretrained(Path(args.output_dir, "pissa_converted"),
                                      path_initial_model_for_weight_conversion=str(Path(args.output_dir, "pissa_init")))  # fmt: skip

    return PissaConvert()


def _setup_freeze(cfg: TuneConfig, model) -> None:
    """Train only the last (or, if negative, first) `freeze_trainable_layers` decoder layers."""
    layers = model.config.num_hidden_layers
    count = cfg.freeze_trainable_layers
    if count == 0 or abs(count) > layers:
        raise UserError(f"freeze_trainable_layers={count} must be non-zero and at most {layers} in magnitude")
    chosen = range(layers - count, layers) if count > 0 else range(-count)
    modules = [m.strip() for m in cfg.freeze_trainable_modules.split(",")]
    extra = [m.strip() for m in cfg.freeze_extra_modules.split(",")] if cfg.freeze_extra_modules else []
    layer_pattern = re.compile(r"\.layers\.(\d+)\.")
    for name, param in model.named_parameters():
        match = layer_pattern.search(name)
        in_layer = bool(match) and int(match.group(1)) in chosen
        module_ok = "all" in modules or any(f".{m}." in name for m in modules)
        param.requires_grad_((in_layer and module_ok) or any(f"{m}." in name for m in extra))
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"freeze_trainable_modules={cfg.freeze_trainable_modules!r} matches no parameter")
