"""The `unsloth` bench variant: the same step on Unsloth's FastLanguageModel, the peer a single-GPU user picks
instead (bf16 LoRA; with quantization_bit=4 its QLoRA).

Unsloth patches transformers and peft when it is imported, so the variant's worker imports it before them
(`tiletune.bench.worker`'s main). It loads models from a folder: a preset's random-init model (built with the seed
every other variant uses) is saved to a temporary folder with a two-token tokenizer, loaded, and the folder removed.
The config's LoRA keys become Unsloth's arguments; `gradient_checkpointing: true` is Unsloth's own ("unsloth": the
checkpointed inputs wait in host memory), the setting it recommends and LLaMA-Factory's `use_unsloth_gc` picks.
"""

from __future__ import annotations

import os
import tempfile

import torch

from tiletune.config import TuneConfig
from tiletune.errors import UserError

NAME = "unsloth"
# what Unsloth takes from the config, and the reason each other setting is refused (never silently dropped)
_REFUSED = (
    ("stage", lambda cfg: cfg.stage not in ("pt", "sft"), "Unsloth's variant times the language-model step"),
    ("finetuning_type", lambda cfg: cfg.finetuning_type != "lora", "Unsloth's variant trains LoRA adapters"),
    ("gradient_checkpointing", lambda cfg: cfg.checkpointing == "auto",
     "Unsloth plans no recomputation on a budget; use true (Unsloth's offloaded checkpoints) or false"),
    ("quantization_bit", lambda cfg: cfg.quantization_bit not in (None, 4), "Unsloth's QLoRA is 4-bit"),
    ("use_dora", lambda cfg: cfg.use_dora, "Unsloth's fast LoRA path has no DoRA"),
    ("pissa_init", lambda cfg: cfg.pissa_init, "Unsloth initialises LoRA its own way"),
    ("lora_target_experts", lambda cfg: cfg.lora_target_experts, "Unsloth's LoRA sits on Linear layers"),
    ("adapter_name_or_path", lambda cfg: cfg.adapter_name_or_path, "Unsloth's variant starts a new adapter"),
)


def unsupported(cfg: TuneConfig) -> str | None:
    """Why the `unsloth` variant cannot run this config, as one line, or None."""
    for key, refused, why in _REFUSED:
        if refused(cfg):
            return f"bench variant 'unsloth': {key}={getattr(cfg, key)} is not available there ({why})"
    return None


def unsloth_model(cfg: TuneConfig, preset: str | None, layers: int | None, seed: int, seq: int, device: torch.device):
    """A peft model from Unsloth's FastLanguageModel with the config's LoRA, set up to train at `seq` tokens (a
    preset is built on `device` before it is saved)."""
    why = unsupported(cfg)
    if why:
        raise UserError(why)
    from unsloth import FastLanguageModel

    from tiletune.train.model import compute_dtype, target_modules

    checkpointing = "unsloth" if cfg.checkpointing == "on" else False
    load = dict(max_seq_length=seq, dtype=compute_dtype(cfg), use_gradient_checkpointing=checkpointing,
                fix_tokenizer=False, load_in_4bit=cfg.quantization_bit == 4,
                load_in_16bit=cfg.quantization_bit is None)  # fmt: skip
    if preset:
        with tempfile.TemporaryDirectory(prefix="tiletune-unsloth-") as folder:
            _save_preset(cfg, preset, layers, seed, device, folder)
            model, _ = FastLanguageModel.from_pretrained(model_name=folder, local_files_only=True, **load)
    else:
        model, _ = FastLanguageModel.from_pretrained(model_name=cfg.model_name_or_path, **load)
    targets = target_modules(model, "lora_target", cfg.lora_target)
    return FastLanguageModel.get_peft_model(
        model, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank * 2, lora_dropout=cfg.lora_dropout,
        target_modules=targets, bias="none", use_rslora=cfg.use_rslora, use_gradient_checkpointing=checkpointing,
        random_state=seed)  # fmt: skip


def _save_preset(cfg: TuneConfig, preset: str, layers: int | None, seed: int, device: torch.device, folder: str) -> None:
    """The preset's random-init model (seed `seed`, built on `device` as the other variants build it) and a tokenizer,
    in `folder`."""
    from tiletune.bench.preference import bench_tokenizer
    from tiletune.train.presets import preset_model

    model = preset_model(cfg, preset, device, layers, seed)  # the worker seeded torch with `seed`, as for every variant
    model.save_pretrained(folder, max_shard_size="5GB")
    bench_tokenizer().save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def preload() -> None:
    """Import Unsloth before transformers and peft, offline (no usage statistics sent)."""
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    import unsloth  # noqa: F401
