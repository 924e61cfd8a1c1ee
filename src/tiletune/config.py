"""The run configuration: LLaMA-Factory's key names in a YAML/JSON file, plus `key=value` overrides.

Every key is one of four kinds:
- a tiletune key (the fields of `TuneConfig`, named as in LLaMA-Factory), honoured here;
- a field of transformers' `Seq2SeqTrainingArguments`, handed to the Trainer (as LLaMA-Factory does);
- a LLaMA-Factory switch naming another library's version of something tiletune does itself
  (`_MAPPED_KEYS`): read as tiletune's keys, with a one-line note;
- a LLaMA-Factory key tiletune does not implement yet: accepted at its LLaMA-Factory default (with a
  note), refused with "not supported yet" otherwise.
Anything else is refused with the closest valid key. Values are checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib.util
import json
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from tiletune.errors import UserError

log = logging.getLogger("tiletune")
SUPPORTED_STAGES = ("pt", "sft", "dpo", "kto", "rm")
KNOWN_STAGES = ("pt", "sft", "rm", "ppo", "dpo", "kto")


@dataclass
class TuneConfig:
    """Every key tiletune honours itself; Trainer keys live in `training`."""

    # -- model
    model_name_or_path: str | None = None
    adapter_name_or_path: str | None = None
    cache_dir: str | None = None
    model_revision: str = "main"
    hf_hub_token: str | None = None
    trust_remote_code: bool = False
    use_fast_tokenizer: bool = True
    resize_vocab: bool = False
    flash_attn: Literal["auto", "disabled", "sdpa", "fa2", "fa3"] = "auto"
    low_cpu_mem_usage: bool = True
    disable_gradient_checkpointing: bool = False
    # tiletune's own (it shadows the Trainer field): null follows disable_gradient_checkpointing; "auto"
    # recomputes only as much as gradient_checkpointing_budget (GiB; null: 90% of the GPU) needs
    gradient_checkpointing: bool | Literal["auto"] | None = None
    gradient_checkpointing_budget: float | None = None
    # with "auto": layers that would be recomputed may keep their activations in pinned host memory instead
    gradient_checkpointing_offload: bool = False
    # GiB of pinned host memory those activations may take (null: half of the host memory free when planning)
    gradient_checkpointing_host_budget: float | None = None
    use_reentrant_gc: bool = True
    infer_dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    print_param_status: bool = False
    # the model config's rotary scaling, set as LLaMA-Factory's configure_rope does (factor from cutoff_len)
    rope_scaling: Literal["linear", "dynamic", "yarn", "llama3"] | None = None
    # -- method
    stage: str = "sft"
    finetuning_type: Literal["lora", "full", "freeze", "oft"] = "lora"
    pure_bf16: bool = False
    lora_rank: int = 8
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    lora_target: str = "all"
    # tiletune's own: LoRA on the MoE experts' fused 3-D weights too (peft's target_parameters); never the router
    lora_target_experts: bool = False
    additional_target: str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    create_new_adapter: bool = False
    loraplus_lr_ratio: float | None = None  # LoRA+: the B matrices learn at learning_rate x this
    loraplus_lr_embedding: float = 1e-6  # LoRA+: the learning rate of LoRA's embedding adapters
    pissa_init: bool = False  # peft's PiSSA initialisation (principal singular vectors in the adapter)
    pissa_iter: int = 16  # fast-SVD iterations; -1: a full SVD
    pissa_convert: bool = False  # also write the trained adapter as a plain LoRA one in pissa_converted/
    oft_rank: int = 0  # OFT (peft): blocks per layer, or 0 to take oft_block_size
    oft_block_size: int = 32
    oft_target: str = "all"
    module_dropout: float = 0.0
    # -- quantized frozen base weights (QLoRA): LLaMA-Factory's keys, tiletune's own formats and kernels
    quantization_bit: int | None = None  # 4 (nf4 / fp4 blocks of 64) or 8 (int8 per output channel)
    quantization_method: str = "bnb"  # bitsandbytes' formats; no bitsandbytes needed at run time
    quantization_type: Literal["nf4", "fp4"] = "nf4"
    double_quantization: bool = True  # the 4-bit blocks' scales quantized too (8 bits each, per 256)
    # -- preference stages (train/preference.py): LLaMA-Factory's keys
    pref_beta: float = 0.1
    pref_ftx: float = 0.0  # the chosen answers' average log-likelihood, weighted into the loss (SFT term)
    pref_loss: Literal["sigmoid", "hinge", "ipo", "orpo", "simpo"] = "sigmoid"
    dpo_label_smoothing: float = 0.0  # conservative DPO (sigmoid only)
    simpo_gamma: float = 0.5
    ref_model: str | None = None  # null: the base with the adapters disabled (LoRA), or a copy of the model
    ref_model_adapters: str | None = None
    precompute_ref_log_probs: bool = False  # TRL's: reference log-probs computed once before training
    pref_shared_prompt: bool = False  # tiletune's (dpo): each pair's prompt runs once (train/shared_prompt.py)
    kto_chosen_weight: float = 1.0  # KTO: weight of the desirable answers' loss
    kto_rejected_weight: float = 1.0
    freeze_trainable_layers: int = 2
    freeze_trainable_modules: str = "all"
    freeze_extra_modules: str | None = None
    # -- dataset
    dataset: str | None = None
    eval_dataset: str | None = None
    dataset_dir: str = "data"
    template: str | None = None
    cutoff_len: int = 2048
    train_on_prompt: bool = False
    mask_history: bool = False
    max_samples: int | None = None
    val_size: float = 0.0
    packing: bool | None = None  # pack examples into cutoff_len sequences; default: on for pt only
    neat_packing: bool = False  # sft packing without attention across examples (implies packing)
    default_system: str | None = None
    enable_thinking: bool = True
    overwrite_cache: bool = False
    preprocessing_num_workers: int | None = None
    preprocessing_batch_size: int = 1000
    ignore_pad_token_for_loss: bool = True
    disable_shuffling: bool = False
    # -- output
    plot_loss: bool = False
    overwrite_output_dir: bool = False
    resume_from_checkpoint: bool | str | None = None
    include_effective_tokens_per_second: bool = False
    # -- generation (prediction)
    do_sample: bool = True
    temperature: float = 0.95
    top_p: float = 0.7
    top_k: int = 50
    num_beams: int = 1
    max_length: int = 1024
    max_new_tokens: int = 1024
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    # -- schedule key that transformers 5 folded into warmup_steps
    warmup_ratio: float = 0.0
    # -- export (merge adapters into a standalone model)
    export_dir: str | None = None
    export_size: float = 5
    export_device: Literal["cpu", "auto"] = "cpu"
    # -- optimizers (tiletune.train.optimizers): GaLore and APOLLO through transformers' Trainer, torch's Muon
    use_galore: bool = False
    galore_target: str = "all"
    galore_rank: int = 16
    galore_update_interval: int = 200
    galore_scale: float = 2.0
    galore_proj_type: Literal["std", "reverse_std", "right", "left", "full"] = "std"
    galore_layerwise: bool = False
    use_apollo: bool = False
    apollo_target: str = "all"
    apollo_rank: int = 16
    apollo_update_interval: int = 200
    apollo_scale: float = 32.0
    apollo_proj: Literal["svd", "random"] = "random"
    apollo_proj_type: Literal["std", "right", "left"] = "std"
    apollo_scale_type: Literal["channel", "tensor"] = "channel"
    apollo_layerwise: bool = False
    use_muon: bool = False
    # -- tiletune
    kernels: Any = None
    # a micro-batch whose loss is not finite: stop the run (naming the step and first non-finite module), or skip
    # it (no gradient from it; warned with the same names) and go on
    nonfinite_loss: Literal["stop", "skip"] = "stop"
    # -- everything handed to transformers' Seq2SeqTrainingArguments
    training: dict[str, Any] = field(default_factory=dict)

    def train_arg(self, key: str, default: Any = None) -> Any:
        """A Trainer key as the user set it, or the Trainer's own default."""
        if key in self.training:
            return self.training[key]
        return _trainer_defaults().get(key, default)

    @property
    def checkpointing(self) -> Literal["on", "off", "auto"]:
        """Activation checkpointing of the decoder layers: every layer, none, or planned on a memory budget."""
        if self.gradient_checkpointing == "auto":
            return "auto"
        if self.gradient_checkpointing is None:
            return "off" if self.disable_gradient_checkpointing else "on"
        return "on" if self.gradient_checkpointing else "off"

    @property
    def output_dir(self) -> Path:
        return Path(self.train_arg("output_dir") or "saves/tiletune")


# ---- loading -----------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: typing.Iterable[str] = ()) -> TuneConfig:
    """Read a YAML/JSON config, apply `key=value` overrides, and validate every key and value."""
    return build_config(read_raw_config(path, overrides), source=str(path))


def read_raw_config(path: str | Path, overrides: typing.Iterable[str] = ()) -> dict[str, Any]:
    """The mapping in a YAML/JSON config file with `key=value` overrides applied, not validated."""
    raw = _read_config_file(Path(path))
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise UserError(f"override {item!r} is not key=value; write e.g. learning_rate=1e-4")
        raw[key] = yaml.safe_load(value) if value.strip() else None
    return raw


def build_config(raw: dict[str, Any], source: str = "config") -> TuneConfig:
    """Validate a mapping of keys to values into a TuneConfig."""
    own_types = typing.get_type_hints(TuneConfig)
    trainer_types = _trainer_types()
    values: dict[str, Any] = {}
    training: dict[str, Any] = {}
    for key, value in _read_mapped_keys(raw, source).items():
        if key in own_types and key != "training":
            values[key] = coerce(key, value, own_types[key], source)
        elif key in trainer_types:
            training[key] = coerce(key, value, trainer_types[key], source)
        elif key in _unsupported_keys():
            _check_unsupported(key, value, source)
        else:
            raise UserError(_unknown_key_message(key, source, list(own_types) + list(trainer_types)))
    cfg = TuneConfig(**values, training=training)
    _check_values(cfg, source)
    return cfg


@dataclass(frozen=True)
class _Mapped:
    """A LLaMA-Factory switch read as tiletune's own keys: the values it sets when true, and what they do."""

    sets: dict[str, Any]
    note: str


_MAPPED_KEYS = {
    "enable_liger_kernel": _Mapped({"kernels": "all"}, "tiletune's TileLang kernels in place of Liger-Kernel's Triton "
                                   "ones (docs/kernels.md)"),
    "use_unsloth_gc": _Mapped(
        {"gradient_checkpointing": "auto", "gradient_checkpointing_offload": True, "disable_gradient_checkpointing": False},
        "tiletune's offloaded checkpointing in place of Unsloth's: the layers gradient_checkpointing_budget has no "
        "room for are recomputed with their inputs in pinned host memory (GPU only; docs/config.md)"),
}  # fmt: skip


def _read_mapped_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`raw` with each true `_MAPPED_KEYS` switch replaced by the keys it sets, in one logged line; where the
    config itself sets one of those keys otherwise, the config's value wins and the line says so."""
    read = {key: value for key, value in raw.items() if key not in _MAPPED_KEYS}
    defaults = _own_defaults()
    for key, mapped in _MAPPED_KEYS.items():
        if not coerce(key, raw.get(key, False), bool, source):
            continue
        taken = [k for k, value in mapped.sets.items() if read.get(k, value) not in (value, defaults[k])]
        if taken:
            log.warning("%s: %s=true is not applied: %s set and wins", source, key,
                        ", ".join(f"{k}={read[k]!r}" for k in taken))  # fmt: skip
            continue
        read.update(mapped.sets)
        shown = ", ".join(f"{k}={value!r}" for k, value in mapped.sets.items() if value != defaults[k])
        log.warning("%s: %s=true read as %s: %s", source, key, shown, mapped.note)
    return read


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"config file {path} not found; pass the path to a YAML or JSON config")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: malformed JSON ({err.msg}); fix the file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or "cannot parse"
        raise UserError(f"{where}: malformed YAML ({problem}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of keys to values, got {type(data).__name__}")
    return data


# ---- value checking ----------------------------------------------------------------------------


def coerce(key: str, value: Any, annotation: Any, source: str) -> Any:
    """Return `value` converted to `annotation`, or raise a UserError naming key, value and what is allowed."""
    ok, converted = _convert(value, annotation)
    if ok:
        return converted
    raise UserError(f"{source}: {key}={value!r} is not valid; allowed: {_describe(annotation)}")


def _convert(value: Any, annotation: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args):
            args = tuple(a for a in args if a is not str)  # `SomeEnum | str` means the enum's values
        if value is None:
            return type(None) in args, None
        if any(type(value) is arg for arg in args):  # an exact match wins over any conversion
            return True, value
        for arg in args:
            ok, converted = _convert(value, arg)
            if ok:
                return True, converted
        return False, None
    if origin is Literal:
        return value in typing.get_args(annotation), value
    if origin in (list, dict) or annotation in (list, dict):
        base = origin or annotation
        if isinstance(value, str) and base is list:
            return True, [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, str) and base is dict:
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                return False, None
            return isinstance(parsed, dict), parsed
        return isinstance(value, base), value
    if annotation is type(None):
        return value is None, None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = {member.value for member in annotation}
        return value in choices, value
    if annotation is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return True, value.lower() == "true"
        return isinstance(value, bool), value
    if annotation is int:
        if isinstance(value, bool):
            return False, None
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        if isinstance(value, str):
            try:
                return True, int(value)
            except ValueError:
                return False, None
        return isinstance(value, int), value
    if annotation is float:
        if isinstance(value, bool):
            return False, None
        try:
            return isinstance(value, (int, float, str)), float(value)
        except ValueError:
            return False, None
    if annotation is str:
        return isinstance(value, (str, int, float)) and not isinstance(value, bool), str(value)
    return isinstance(value, annotation) if isinstance(annotation, type) else True, value


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _check_values(cfg: TuneConfig, source: str) -> None:
    if cfg.stage not in KNOWN_STAGES:
        raise UserError(f"{source}: stage={cfg.stage!r} is not valid; allowed: {', '.join(KNOWN_STAGES)}")
    if cfg.stage not in SUPPORTED_STAGES:
        raise UserError(
            f"{source}: stage={cfg.stage!r} is not supported yet; tiletune trains stage 'sft', 'pt', 'dpo', 'kto' and "
            "'rm' (use LLaMA-Factory itself for PPO)"
        )
    positive = {"cutoff_len": cfg.cutoff_len, "lora_rank": cfg.lora_rank, "max_new_tokens": cfg.max_new_tokens}
    for key, value in positive.items():
        if value <= 0:
            raise UserError(f"{source}: {key}={value} must be a positive integer")
    if cfg.export_size <= 0:
        raise UserError(f"{source}: export_size={cfg.export_size} must be a positive number of GB per shard")
    if cfg.max_samples is not None and cfg.max_samples <= 0:
        raise UserError(f"{source}: max_samples={cfg.max_samples} must be a positive integer or null")
    if cfg.val_size < 0 or (cfg.val_size >= 1 and not float(cfg.val_size).is_integer()):
        raise UserError(f"{source}: val_size={cfg.val_size} must be a fraction in [0, 1) or a whole number of samples")
    if not 0 <= cfg.lora_dropout < 1:
        raise UserError(f"{source}: lora_dropout={cfg.lora_dropout} must be in [0, 1)")
    if not 0 <= cfg.warmup_ratio < 1:
        raise UserError(f"{source}: warmup_ratio={cfg.warmup_ratio} must be in [0, 1)")
    if cfg.gradient_checkpointing not in (None, False) and cfg.disable_gradient_checkpointing:
        raise UserError(f"{source}: gradient_checkpointing={cfg.gradient_checkpointing!r} contradicts "
                        "disable_gradient_checkpointing=true; keep one of them")  # fmt: skip
    budget = cfg.gradient_checkpointing_budget
    if budget is not None and (budget <= 0 or not math.isfinite(budget)):
        raise UserError(f"{source}: gradient_checkpointing_budget={budget} must be a positive number of GiB (or null for 90% of the GPU)")
    if budget is not None and cfg.checkpointing != "auto":
        raise UserError(f"{source}: gradient_checkpointing_budget is read only with gradient_checkpointing=auto; set that too")
    if cfg.gradient_checkpointing_offload and cfg.checkpointing != "auto":
        raise UserError(f"{source}: gradient_checkpointing_offload is read only with gradient_checkpointing=auto; set that too")
    host_budget = cfg.gradient_checkpointing_host_budget
    if host_budget is not None and (host_budget <= 0 or not math.isfinite(host_budget)):
        raise UserError(f"{source}: gradient_checkpointing_host_budget={host_budget} must be a positive number of GiB "
                        "(or null for half of the free host memory)")  # fmt: skip
    if host_budget is not None and not cfg.gradient_checkpointing_offload:
        raise UserError(f"{source}: gradient_checkpointing_host_budget is read only with gradient_checkpointing_offload=true; "
                        "set that too")  # fmt: skip
    if cfg.quantization_bit not in (None, 4, 8):
        raise UserError(f"{source}: quantization_bit={cfg.quantization_bit} is not supported; use 4 (nf4 or fp4) or 8 "
                        "(int8 per output channel)")
    if cfg.quantization_bit and cfg.quantization_method != "bnb":
        raise UserError(f"{source}: quantization_method={cfg.quantization_method!r} is not supported; tiletune quantizes "
                        "in bitsandbytes' formats with its own kernels: set quantization_method=bnb")
    if cfg.quantization_bit and cfg.finetuning_type != "lora":
        raise UserError(f"{source}: quantization_bit={cfg.quantization_bit} with finetuning_type={cfg.finetuning_type}: "
                        "quantized base weights are frozen and train through LoRA adapters; set finetuning_type=lora")
    if cfg.neat_packing and cfg.stage != "sft":
        raise UserError(f"{source}: neat_packing is for stage sft (pre-training cuts the concatenated texts into "
                        "blocks, documents attending to each other); remove it")
    if cfg.neat_packing and cfg.packing is False:
        raise UserError(f"{source}: neat_packing=true packs examples (without attention across them) but "
                        "packing=false; remove packing=false")
    if cfg.train_arg("bf16") and cfg.train_arg("fp16"):
        raise UserError(f"{source}: bf16 and fp16 are both true; choose one")
    _check_method_keys(cfg, source)
    if cfg.train_arg("do_train") and not cfg.dataset:
        raise UserError(f"{source}: do_train is true but no `dataset` is set; name one from dataset_info.json")
    if cfg.train_arg("do_predict") and not (cfg.eval_dataset or cfg.dataset):
        raise UserError(f"{source}: do_predict is true but no `eval_dataset` is set")
    if not cfg.model_name_or_path:
        raise UserError(f"{source}: model_name_or_path is missing; set it to a local model directory or a hub id")
    _check_packages(cfg, source)


# keys read only when another is on: what turns them on (as the message says it), the test, the keys
_READ_ONLY_WITH = (
    ("finetuning_type=lora", lambda cfg: cfg.finetuning_type == "lora", ("loraplus_lr_ratio", "pissa_init",
                                                                         "lora_target_experts")),
    ("finetuning_type=oft", lambda cfg: cfg.finetuning_type == "oft",
     ("oft_rank", "oft_block_size", "oft_target", "module_dropout")),
    ("pissa_init=true", lambda cfg: cfg.pissa_init, ("pissa_iter", "pissa_convert")),
    ("loraplus_lr_ratio", lambda cfg: cfg.loraplus_lr_ratio is not None, ("loraplus_lr_embedding",)),
    ("use_galore=true", lambda cfg: cfg.use_galore, ("galore_target", "galore_rank", "galore_update_interval",
                                                     "galore_scale", "galore_proj_type", "galore_layerwise")),
    ("stage=dpo or kto", lambda cfg: cfg.stage in ("dpo", "kto"),
     ("pref_beta", "pref_ftx", "ref_model", "precompute_ref_log_probs")),
    ("stage=dpo", lambda cfg: cfg.stage == "dpo", ("pref_loss", "dpo_label_smoothing", "simpo_gamma",
                                                   "pref_shared_prompt")),
    ("stage=kto", lambda cfg: cfg.stage == "kto", ("kto_chosen_weight", "kto_rejected_weight")),
    ("pref_loss=sigmoid", lambda cfg: cfg.pref_loss == "sigmoid", ("dpo_label_smoothing",)),
    ("pref_loss=simpo", lambda cfg: cfg.pref_loss == "simpo", ("simpo_gamma",)),
    ("a reference model (pref_loss sigmoid, hinge or ipo)", lambda cfg: cfg.pref_loss in ("sigmoid", "hinge", "ipo"),
     ("ref_model", "ref_model_adapters", "precompute_ref_log_probs")),
    ("ref_model", lambda cfg: cfg.ref_model is not None, ("ref_model_adapters",)),
    ("use_apollo=true", lambda cfg: cfg.use_apollo, ("apollo_target", "apollo_rank", "apollo_update_interval",
                                                     "apollo_scale", "apollo_proj", "apollo_proj_type",
                                                     "apollo_scale_type", "apollo_layerwise")),
)  # fmt: skip
# use_galore / use_apollo: transformers' Trainer optimizer for each `optim` they wrap (LLaMA-Factory's choice)
LOW_RANK_OPTIMS = {
    "use_galore": {"adamw_torch": "galore_adamw", "adamw_torch_fused": "galore_adamw", "adamw_bnb_8bit": "galore_adamw_8bit",
                   "adamw_8bit": "galore_adamw_8bit", "paged_adamw_8bit": "galore_adamw_8bit",
                   "adafactor": "galore_adafactor"},
    "use_apollo": {"adamw_torch": "apollo_adamw", "adamw_torch_fused": "apollo_adamw"},
}  # fmt: skip


def _check_method_keys(cfg: TuneConfig, source: str) -> None:
    """Refuse method and optimizer keys that would change nothing, or that cannot go together."""
    defaults = _own_defaults()
    for switch, on, keys in _READ_ONLY_WITH:
        unread = [key for key in keys if getattr(cfg, key) != defaults[key]]
        if unread and not on(cfg):
            raise UserError(f"{source}: {unread[0]} is read only with {switch}; set that too, or remove {unread[0]}")
    chosen = [key for key in ("use_galore", "use_apollo", "use_muon", "loraplus_lr_ratio") if getattr(cfg, key) not in (None, False)]
    if len(chosen) > 1:
        raise UserError(f"{source}: {chosen[0]} and {chosen[1]} each choose the optimizer; keep one")
    if cfg.finetuning_type == "oft" and (cfg.oft_rank == 0) == (cfg.oft_block_size == 0):
        raise UserError(f"{source}: OFT takes either oft_rank (blocks per layer) or oft_block_size, the other 0 "
                        f"(got oft_rank={cfg.oft_rank}, oft_block_size={cfg.oft_block_size})")
    if cfg.pissa_init and cfg.quantization_bit:
        raise UserError(f"{source}: pissa_init moves each weight's principal part into the adapter, which a quantized "
                        "base cannot give up; remove pissa_init or quantization_bit")
    if cfg.lora_target_experts:
        _check_lora_experts(cfg, source)
    low_rank = next((switch for switch in LOW_RANK_OPTIMS if getattr(cfg, switch)), None)
    if low_rank:
        _check_low_rank(cfg, low_rank, source)


def _check_lora_experts(cfg: TuneConfig, source: str) -> None:
    """lora_target_experts: peft's LoRA on parameters (ParamWrapper, peft >= 0.17), which takes no dropout, DoRA or
    PiSSA (whether the model has experts is checked when it loads: train/model.py)."""
    import peft

    if "target_parameters" not in {f.name for f in dataclasses.fields(peft.LoraConfig)}:
        raise UserError(f"{source}: lora_target_experts needs peft >= 0.17 (LoRA on parameters, target_parameters); "
                        f"peft {peft.__version__} is installed: pip install -U 'peft>=0.17', or remove lora_target_experts")
    unsupported = [(key, why) for key, why in (
        ("lora_dropout", cfg.lora_dropout != 0), ("use_dora", cfg.use_dora), ("pissa_init", cfg.pissa_init)) if why]
    if unsupported:
        key = unsupported[0][0]
        raise UserError(f"{source}: lora_target_experts with {key}={getattr(cfg, key)}: peft's LoRA on the expert weights "
                        f"(a parameter, not a Linear) takes no {key}; remove {key} or lora_target_experts")


def _check_low_rank(cfg: TuneConfig, switch: str, source: str) -> None:
    """use_galore / use_apollo: whole weights, an `optim` they have a variant of, layer-wise steps without accumulation."""
    if cfg.finetuning_type in ("lora", "oft"):
        raise UserError(f"{source}: {switch} projects the gradients of whole weight matrices, not of adapters; "
                        "set finetuning_type to full or freeze")
    if cfg.train_arg("optim") not in LOW_RANK_OPTIMS[switch]:
        raise UserError(f"{source}: {switch} has no variant of optim={cfg.train_arg('optim')}; set optim to one of "
                        + ", ".join(LOW_RANK_OPTIMS[switch]))
    layerwise = switch.removeprefix("use_") + "_layerwise"
    if getattr(cfg, layerwise) and cfg.train_arg("gradient_accumulation_steps") != 1:
        raise UserError(f"{source}: {layerwise} steps each weight as its gradient arrives; set gradient_accumulation_steps=1")


@dataclass(frozen=True)
class _Package:
    """A package tiletune does not install that a config value needs: the modules it provides, how to install it."""

    name: str
    modules: tuple[str, ...]
    install: str


_BITSANDBYTES = _Package("bitsandbytes", ("bitsandbytes",), "pip install bitsandbytes")
# transformers' optimizers (OptimizerNames) that run on bitsandbytes
_BITSANDBYTES_OPTIMIZERS = (
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "ademamix", "ademamix_8bit",
    "paged_ademamix_32bit", "paged_ademamix_8bit", "lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
)  # fmt: skip
_NEEDS_PACKAGE = {
    ("flash_attn", "fa2"): _Package("flash-attn", ("flash_attn",), "pip install flash-attn --no-build-isolation"),
    ("flash_attn", "fa3"): _Package("FlashAttention-3", ("flash_attn_interface",),
                                    "build it from the hopper/ folder of github.com/Dao-AILab/flash-attention"),
    ("report_to", "tensorboard"): _Package("tensorboard", ("tensorboard", "tensorboardX"), "pip install tensorboard"),
    ("report_to", "wandb"): _Package("wandb", ("wandb",), "pip install wandb"),
    ("report_to", "mlflow"): _Package("mlflow", ("mlflow",), "pip install mlflow"),
    ("report_to", "swanlab"): _Package("swanlab", ("swanlab",), "pip install swanlab"),
    **{("optim", name): _BITSANDBYTES for name in _BITSANDBYTES_OPTIMIZERS},
    ("use_galore", True): _Package("galore-torch", ("galore_torch",), "pip install galore-torch"),
    ("use_apollo", True): _Package("apollo-torch", ("apollo_torch",), "pip install apollo-torch"),
    ("use_muon", True): _Package("torch >= 2.9 (torch.optim.Muon)", ("torch.optim._muon",), "pip install -U 'torch>=2.9'"),
    **{("stage", stage): _Package("trl", ("trl",), "pip install 'tiletune[preference]'") for stage in ("dpo", "kto", "rm")},
}


def _check_packages(cfg: TuneConfig, source: str) -> None:
    """Refuse a value whose package is missing now, before anything loads, rather than mid-training."""
    report_to = cfg.train_arg("report_to") or []
    chosen = [("flash_attn", cfg.flash_attn), ("optim", cfg.train_arg("optim")), ("stage", cfg.stage)]
    chosen += [("report_to", name) for name in ([report_to] if isinstance(report_to, str) else report_to)]
    chosen += [(key, getattr(cfg, key)) for key in ("use_galore", "use_apollo", "use_muon")]
    for key, value in chosen:
        package = _NEEDS_PACKAGE.get((key, value))
        if package and not any(importlib.util.find_spec(module) for module in package.modules):
            what, instead = (key, f"remove {key}") if value is True else (f"{key}={value}", f"choose another {key}")
            raise UserError(f"{source}: {what} needs {package.name}, which is not installed; {package.install} "
                            f"(or {instead})")


# ---- key catalogues ----------------------------------------------------------------------------


@functools.cache
def _trainer_types() -> dict[str, Any]:
    from transformers import Seq2SeqTrainingArguments

    return typing.get_type_hints(Seq2SeqTrainingArguments)


@functools.cache
def _own_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(TuneConfig)}


@functools.cache
def _trainer_defaults() -> dict[str, Any]:
    from transformers import Seq2SeqTrainingArguments

    return {f.name: f.default for f in dataclasses.fields(Seq2SeqTrainingArguments)}


@functools.cache
def _unsupported_keys() -> dict[str, Any]:
    """LLaMA-Factory keys tiletune does not implement, with LLaMA-Factory's default for each."""
    text = resources.files("tiletune").joinpath("llamafactory_unsupported_keys.yaml").read_text()
    return yaml.safe_load(text)


# why a LLaMA-Factory key is still refused, and what to use instead, where "not supported yet" says too little
_REFUSED_BECAUSE = {
    "streaming": "datasets' streaming hands over an iterable dataset, and tiletune's data pipeline tokenises, caches "
                 "and packs a map-style one; the tokenised data is cached on disk and reused, and max_samples bounds "
                 "how much is read",
    "use_badam": "BAdam needs its own Trainer wiring: it patches accelerate's gradient clipping and the model's "
                 "checkpointing, and trains half-precision weights without float32 master copies; for a lean full "
                 "fine-tune use use_galore, use_apollo or finetuning_type: freeze",
    "apollo_scale_front": "use_apollo runs transformers' APOLLO optimizer, which takes no scale_front",
}  # fmt: skip


def _check_unsupported(key: str, value: Any, source: str) -> None:
    default = _unsupported_keys()[key]
    if value == default or (value is None and default is None):
        return
    because = f" ({_REFUSED_BECAUSE[key]})" if key in _REFUSED_BECAUSE else ""
    raise UserError(
        f"{source}: {key}={value!r} is a LLaMA-Factory option tiletune does not support yet{because}; "
        f"remove it or set it to its default ({default!r})"
    )


def _unknown_key_message(key: str, source: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid + list(_MAPPED_KEYS) + list(_unsupported_keys()), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; see docs/config.md for the keys tiletune reads"
    return f"{source}: unknown key {key!r}{hint}"
