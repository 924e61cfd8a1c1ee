"""`tiletune export`: merge LoRA adapters into the base weights and write a standalone Hugging Face model.

LLaMA-Factory's export keys: `model_name_or_path`, `adapter_name_or_path` (merged in order), `export_dir`,
`export_size` (GB per safetensors shard), `export_device` (`cpu`, or `auto` to load onto the
accelerators), and `infer_dtype` for the dtype written (`auto`: the base model's own dtype). The folder
holds the sharded safetensors, config.json, generation_config.json (stopping at the template's stop
words) and the tokenizer, and loads with `transformers.AutoModelForCausalLM.from_pretrained`.

The model is written to a temporary folder beside `export_dir` and renamed into place when complete,
so an interrupted export never leaves a folder that looks like a finished model.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from tiletune.config import TuneConfig
from tiletune.errors import UserError

log = logging.getLogger(__name__)


def check_export_dir(cfg: TuneConfig) -> Path:
    """The export folder; refuses a missing key, a file, or a folder that already holds something."""
    if not cfg.export_dir:
        raise UserError("export_dir is missing; set export_dir=path/to/merged-model (a new or empty folder)")
    target = Path(cfg.export_dir)
    if target.exists() and not target.is_dir():
        raise UserError(f"export_dir {target} is a file; choose a folder")
    if target.is_dir() and any(target.iterdir()):
        raise UserError(f"export_dir {target} is not empty; remove it or choose another export_dir")
    return target


def output_dtype(cfg: TuneConfig) -> torch.dtype:
    """The dtype written: `infer_dtype`, or with `auto` the dtype the base checkpoint was saved in (its config's
    `dtype`, `torch_dtype` before transformers 5; not the dtype it was loaded in), float32 if it names none."""
    from transformers import AutoConfig

    from tiletune.train.model import _hub_kwargs

    if cfg.infer_dtype != "auto":
        return getattr(torch, cfg.infer_dtype)
    saved = AutoConfig.from_pretrained(cfg.model_name_or_path, **_hub_kwargs(cfg)).dtype
    return getattr(torch, saved) if isinstance(saved, str) else saved or torch.float32


def run_export(cfg: TuneConfig) -> Path:
    """Merge `adapter_name_or_path` into `model_name_or_path` and write the model to `export_dir`."""
    from tiletune.data.templates import get_template
    from tiletune.train.model import load_model, load_tokenizer

    target = check_export_dir(cfg)
    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.template, tokenizer, cfg.stage, cfg.default_system)
    template.fix_tokenizer(tokenizer)  # the same tokens (and vocabulary size) as in training
    device_map = "auto" if cfg.export_device == "auto" else None
    model = load_model(cfg, tokenizer, trainable=False, device_map=device_map)  # adapters merged
    dtype = output_dtype(cfg)
    model = model.to(dtype)
    model.config.dtype = dtype
    stops = model.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    model.generation_config.eos_token_id = sorted(set(stops + template.stop_token_ids(tokenizer)))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "left"  # for generation, as LLaMA-Factory exports it

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, max_shard_size=f"{cfg.export_size}GB")
        tokenizer.save_pretrained(staging)
        if target.is_dir():
            target.rmdir()  # empty, checked above
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported %s (%s) to %s", cfg.model_name_or_path, dtype, target)
    return target
