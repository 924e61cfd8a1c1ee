#!/usr/bin/env python
"""Build the offline demo assets for ``tiletune train examples/demo.yaml``.

Everything is generated here, deterministically (seeded), with nothing downloaded:

  (a) data     examples/data/{demo_base,demo_train,demo_eval}.json + dataset_info.json
  (b) tokenizer  a small byte-level BPE (``tokenizers``) with the Llama-3 and ChatML
                 special tokens, wrapped as a ``PreTrainedTokenizerFast``
  (c) model    a tiny ``LlamaForCausalLM`` pre-trained (full fine-tune, from scratch)
               on three string skills in LLaMA-Factory's ``llama3`` chat format
  (d) output   examples/tiny-llama/ (config.json, model.safetensors,
               generation_config.json, tokenizer files)

The story of the demo
---------------------
Inputs are 3-8 *distinct* lowercase letters separated by spaces, e.g. ``q d x b``.
The base model knows three skills, each under its own instruction:

  Repeat: q d x b     ->  q d x b
  Reverse: q d x b    ->  b x d q
  Uppercase: q d x b  ->  Q D X B

The demo task (``demo_train`` / ``demo_eval``) is a NEW instruction that composes two
of them, which the base has never seen and does not solve:

  Reverse and uppercase: q d x b  ->  B X D Q

A LoRA adapter learns it in about a minute on 2 CPU cores and generalises to held-out
letter sequences (``demo_eval`` shares no input with ``demo_train``).

Usage:  python examples/make_demo.py            (3-8 minutes on 2 CPU cores)
        python examples/make_demo.py --skip-model   (data + tokenizer only)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"
MODEL_DIR = HERE / "tiny-llama"

SEED = 1234

# ----------------------------------------------------------------------------------
# Chat format: LLaMA-Factory's ``llama3`` template, no system block.
# ----------------------------------------------------------------------------------
BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|finetune_right_pad_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]
PAD = "<|finetune_right_pad_id|>"


def render_prompt(instruction: str) -> str:
    """Everything up to and including ``assistant<|end_header_id|>\\n\\n``."""
    return (
        f"{BOS}<|start_header_id|>user<|end_header_id|>\n\n{instruction}{EOT}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def render_response(output: str) -> str:
    """The supervised part: ``{output}<|eot_id|>``."""
    return f"{output}{EOT}"


# Official Meta-Llama-3-Instruct chat template.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# ----------------------------------------------------------------------------------
# (a) Data
# ----------------------------------------------------------------------------------
MIN_LEN, MAX_LEN = 3, 8
LETTERS = string.ascii_lowercase

BASE_SKILLS = {
    "Repeat": lambda xs: xs,
    "Reverse": lambda xs: xs[::-1],
    "Uppercase": lambda xs: [x.upper() for x in xs],
}
DEMO_INSTRUCTION = "Reverse and uppercase"


def demo_fn(xs):
    return [x.upper() for x in xs[::-1]]


def sample_letters(rng: random.Random) -> list[str]:
    n = rng.randint(MIN_LEN, MAX_LEN)
    return rng.sample(LETTERS, n)  # distinct letters


def make_example(instr: str, xs: list[str], fn) -> dict:
    return {"instruction": f"{instr}: {' '.join(xs)}", "input": "", "output": " ".join(fn(xs))}


def sample_base_example(rng: random.Random) -> dict:
    instr = rng.choice(list(BASE_SKILLS))
    return make_example(instr, sample_letters(rng), BASE_SKILLS[instr])


def make_demo_split(rng: random.Random, n_train: int, n_eval: int):
    seen: set[tuple[str, ...]] = set()
    rows = []
    while len(rows) < n_train + n_eval:
        xs = sample_letters(rng)
        if tuple(xs) in seen:
            continue
        seen.add(tuple(xs))
        rows.append(make_example(DEMO_INSTRUCTION, xs, demo_fn))
    return rows[:n_train], rows[n_train:]


def write_data(n_train: int = 1000, n_eval: int = 150, n_base: int = 1000) -> dict:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    train, evl = make_demo_split(rng, n_train, n_eval)
    base = [sample_base_example(rng) for _ in range(n_base)]
    files = {"demo_train": train, "demo_eval": evl, "demo_base": base}
    for name, rows in files.items():
        with open(DATA_DIR / f"{name}.json", "w", encoding="utf-8") as f:
            json.dump(rows, f, ensure_ascii=False, indent=1)
            f.write("\n")
    info = {name: {"file_name": f"{name}.json"} for name in files}
    with open(DATA_DIR / "dataset_info.json", "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    return files


# ----------------------------------------------------------------------------------
# (b) Tokenizer
# ----------------------------------------------------------------------------------
VOCAB_SIZE = 1024

_GENERIC = [
    "The quick brown fox jumps over the lazy dog.",
    "Fine-tuning adapts a pre-trained model to a new task with a few examples.",
    "A LoRA adapter adds small low-rank matrices to the linear layers of a model.",
    "Please answer the question below in one short sentence.",
    "You are a helpful assistant. Think step by step, then give the final answer.",
    "Translate the following text into English: 你好，世界！",
    "今天天气很好。我们一起去公园散步吧。模型、数据、训练、评估。",
    "def add(a, b):\n    return a + b\n",
    "The answer is 42. 3 + 4 = 7, 12 * 12 = 144, 100 - 1 = 99.",
    "system user assistant tool observation function",
    "<think>\nLet me think about it.\n</think>\n\nHere is my answer.",
]


def tokenizer_corpus(rng: random.Random, n: int = 20000):
    for _ in range(n):
        ex = sample_base_example(rng)
        yield ex["instruction"]
        yield ex["output"]
        xs = sample_letters(rng)
        yield make_example(DEMO_INSTRUCTION, xs, demo_fn)["instruction"]
        yield " ".join(x.upper() for x in xs)
    for _ in range(200):
        for line in _GENERIC:
            yield line
    for r in ("user", "assistant", "system"):
        for _ in range(200):
            yield r


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0..9, each a single token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any UTF-8 round-trips
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(random.Random(SEED + 1)), trainer=trainer)
    # Like Llama 3: encode(text) prepends <|begin_of_text|>, encode(text,
    # add_special_tokens=False) adds nothing.
    from tokenizers import processors

    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOT, PAD)],
        clean_up_tokenization_spaces=False,
        model_max_length=256,
        padding_side="right",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(tok, out_dir: Path) -> None:
    """save_pretrained, then make tokenizer_config.json readable by transformers 4.x too."""
    tok.save_pretrained(out_dir)
    p = out_dir / "tokenizer_config.json"
    cfg = json.loads(p.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # v5 calls it TokenizersBackend
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):  # v4 expects a dict there; a list is additional_special_tokens
        cfg["additional_special_tokens"] = extra
    cfg["chat_template"] = CHAT_TEMPLATE  # also in chat_template.jinja
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    p.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_tokenizer(tok) -> None:
    samples = [
        "Reverse and uppercase: q d x b",
        "你好，世界！今天天气很好。",
        "  leading spaces,\ttabs\n\nnewlines  and trailing  ",
        "emoji 🤗🚀 and accents é à ü ß, Ω≈ç√∫",
        "<think>\nhmm\n</think>\n\nok",
        "x" * 50 + " . , ! ? ' \" ` ~",
    ]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        back = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert back == s, (s, back)
    for t in SPECIAL_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t, (t, ids)
    assert tok.encode("a", add_special_tokens=False) == tok.encode("a", add_special_tokens=False)
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id
    msgs = [{"role": "user", "content": "hi"}]
    got = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert got == render_prompt("hi"), got


# ----------------------------------------------------------------------------------
# (c) Model
# ----------------------------------------------------------------------------------
MODEL_CFG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
)
PRETRAIN = dict(steps=1200, batch_size=64, lr=1e-3, warmup=100, weight_decay=0.01)


def encode_example(tok, ex: dict) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels): prompt masked to -100, loss on ``{output}<|eot_id|>``."""
    p = tok.encode(render_prompt(ex["instruction"]), add_special_tokens=False)
    r = tok.encode(render_response(ex["output"]), add_special_tokens=False)
    return p + r, [-100] * len(p) + r


def collate(batch, pad_id: int):
    import torch

    n = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), n), -100, dtype=torch.long)
    att = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        att[i, : len(x)] = 1
    return ids, att, lab


def greedy_exact_match(model, tok, rows, batch_size: int = 64, max_new_tokens: int = 16):
    """Greedy-decode each prompt (left-padded), stop at <|eot_id|>, compare stripped text."""
    import torch

    model.eval()
    tok.padding_side = "left"
    hits, preds = 0, []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        prompts = [render_prompt(r["instruction"]) for r in chunk]
        enc = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tok.convert_tokens_to_ids(EOT),
                pad_token_id=tok.pad_token_id,
            )
        for r, seq in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            text = tok.decode(seq, skip_special_tokens=True).strip()
            preds.append(text)
            hits += text == r["output"]
    tok.padding_side = "right"
    return hits / len(rows), preds


def pretrain_model(tok, log=print):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids(EOT),
        pad_token_id=tok.pad_token_id,
        **MODEL_CFG,
    )
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M params, vocab {len(tok)}")

    rng = random.Random(SEED + 2)
    steps, bs = PRETRAIN["steps"], PRETRAIN["batch_size"]
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], betas=(0.9, 0.98),
                            weight_decay=PRETRAIN["weight_decay"])

    def lr_at(s):
        if s < PRETRAIN["warmup"]:
            return (s + 1) / PRETRAIN["warmup"]
        p = (s - PRETRAIN["warmup"]) / max(1, steps - PRETRAIN["warmup"])
        return 0.5 * (1 + math.cos(math.pi * p)) * 0.95 + 0.05

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    t0 = time.time()
    for step in range(steps):
        batch = [encode_example(tok, sample_base_example(rng)) for _ in range(bs)]
        ids, att, lab = collate(batch, tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(f"  pretrain step {step:5d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}"
                f"  {time.time() - t0:6.1f}s")
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.convert_tokens_to_ids(EOT), tok.convert_tokens_to_ids("<|eom_id|>"),
                      tok.convert_tokens_to_ids("<|end_of_text|>")],
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    return model


def evaluate_base(model, tok, log=print, n: int = 150):
    rng = random.Random(SEED + 3)
    res = {}
    for name, fn in BASE_SKILLS.items():
        rows = [make_example(name, sample_letters(rng), fn) for _ in range(n)]
        res[name] = greedy_exact_match(model, tok, rows)[0]
    evl = json.loads((DATA_DIR / "demo_eval.json").read_text())
    res[DEMO_INSTRUCTION + " (demo_eval)"] = greedy_exact_match(model, tok, evl)[0]
    for k, v in res.items():
        log(f"  base exact match  {k:36s} {v:.3f}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-model", action="store_true", help="only write data and tokenizer")
    ap.add_argument("--steps", type=int, default=PRETRAIN["steps"], help="pre-training steps")
    ap.add_argument("--model-dir", default=str(MODEL_DIR), help="where to write the model")
    args = ap.parse_args(argv)
    PRETRAIN["steps"] = args.steps

    import torch

    torch.set_num_threads(2)
    random.seed(SEED)
    t0 = time.time()
    files = write_data()
    print(f"data: " + ", ".join(f"{k}={len(v)}" for k, v in files.items()) + f" -> {DATA_DIR}")
    tok = build_tokenizer()
    check_tokenizer(tok)
    print(f"tokenizer: byte-level BPE, {len(tok)} tokens (round-trip checks passed)")
    out = Path(args.model_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out)
    if args.skip_model:
        return 0
    model = pretrain_model(tok)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out)
    size = (out / "model.safetensors").stat().st_size
    print(f"saved {out} (model.safetensors {size / 1e6:.2f} MB)")

    # Reload from disk exactly as a user would, then score the base.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(out)
    check_tokenizer(tok2)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    evaluate_base(model2, tok2)
    print(f"make_demo.py done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
