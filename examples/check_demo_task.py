#!/usr/bin/env python
"""Validate the demo task with plain transformers + peft (no tiletune).

Trains a LoRA adapter on ``demo_train`` with the hyper-parameters of
``examples/demo.yaml`` (transformers ``Trainer``, 2 CPU threads), rendering each
example exactly as LLaMA-Factory's ``llama3`` template does:

  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{instruction}<|eot_id|>
  <|start_header_id|>assistant<|end_header_id|>\\n\\n{output}<|eot_id|>

with the prompt (everything before ``{output}``) masked to -100, then greedy-decodes
``demo_eval`` (prompt ends after ``assistant<|end_header_id|>\\n\\n``, stop at
``<|eot_id|>``) and prints exact match for the base model and for base + LoRA, plus
the training wall time.

Usage:  python examples/check_demo_task.py [--seeds 42 1 7] [--no-base]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_demo as md  # noqa: E402  (rendering helpers, greedy exact match)

# Keep in sync with examples/demo.yaml.
HPARAMS = dict(
    lora_rank=8,
    lora_alpha=16,
    learning_rate=2e-3,
    num_train_epochs=2,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=1,
    lr_scheduler_type="cosine",
    warmup_ratio=0.05,
    cutoff_len=64,
)


def load(name: str):
    return json.loads((HERE / "data" / f"{name}.json").read_text(encoding="utf-8"))


def encode(tok, ex: dict, cutoff_len: int):
    ids, labels = md.encode_example(tok, ex)
    return {"input_ids": ids[:cutoff_len], "labels": labels[:cutoff_len]}


def run(seed: int, hp: dict, eval_base: bool, model_dir: Path) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    evl = load("demo_eval")
    res = {"seed": seed}
    if eval_base:
        t = time.time()
        res["base_em"], _ = md.greedy_exact_match(model, tok, evl)
        res["predict_s"] = time.time() - t

    set_seed(seed)
    train_rows = load("demo_train")
    train = [encode(tok, ex, hp["cutoff_len"]) for ex in train_rows]
    model = get_peft_model(model, LoraConfig(
        r=hp["lora_rank"], lora_alpha=hp["lora_alpha"], lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ))
    pad = tok.pad_token_id

    def collator(batch):
        ids, att, lab = md.collate([(b["input_ids"], b["labels"]) for b in batch], pad)
        return {"input_ids": ids, "attention_mask": att, "labels": lab}

    steps_per_epoch = math.ceil(len(train) / (hp["per_device_train_batch_size"] * hp["gradient_accumulation_steps"]))
    total_steps = steps_per_epoch * hp["num_train_epochs"]
    args = TrainingArguments(
        output_dir=f"/tmp/check_demo_{seed}",
        per_device_train_batch_size=hp["per_device_train_batch_size"],
        gradient_accumulation_steps=hp["gradient_accumulation_steps"],
        learning_rate=hp["learning_rate"],
        num_train_epochs=hp["num_train_epochs"],
        lr_scheduler_type=hp["lr_scheduler_type"],
        # warmup_ratio as explicit steps (transformers 5 dropped the warmup_ratio argument)
        warmup_steps=math.ceil(hp["warmup_ratio"] * total_steps),
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    t = time.time()
    out = trainer.train()
    res["train_s"] = time.time() - t
    res["train_loss"] = out.training_loss
    res["steps"] = out.global_step
    t = time.time()
    res["lora_em"], preds = md.greedy_exact_match(model, tok, evl)
    res["predict_s_lora"] = time.time() - t
    res["wrong_examples"] = [(r["instruction"], r["output"], p)
                             for r, p in zip(evl, preds) if p != r["output"]][:5]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 7])
    ap.add_argument("--no-base", action="store_true")
    ap.add_argument("--model-dir", default=str(HERE / "tiny-llama"))
    for k, v in HPARAMS.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    a = ap.parse_args(argv)
    hp = {k: getattr(a, k) for k in HPARAMS}
    print("hparams:", hp)
    for i, seed in enumerate(a.seeds):
        r = run(seed, hp, eval_base=(i == 0 and not a.no_base), model_dir=Path(a.model_dir))
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
