"""The demo data renders exactly as each template's chat format says: decode the token ids and compare
with the text written out here from the format's specification."""

import json
from datetime import datetime

import pytest
from transformers import AutoTokenizer

from tiletune.config import build_config
from tiletune.data.processing import IGNORE_INDEX, build_splits
from tiletune.data.templates import TEMPLATES, get_template

ALPACA_SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
QWEN_TOOLS = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
LLAMA3_TOOLS = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}"
)


def alpaca_turn(template: str, prompt: str, answer: str, eos: str) -> tuple[str, str]:
    """(prompt text, answer text) of a one-turn conversation, spelled out per chat format."""
    return {
        "llama3": (
            f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            f"{answer}<|eot_id|>",
        ),
        "qwen3_nothink": (f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n", f"{answer}<|im_end|>\n"),
        "qwen3": (
            f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
            f"<think>\n\n</think>\n\n{answer}<|im_end|>\n",
        ),
        "alpaca": (f"{ALPACA_SYSTEM}### Instruction:\n{prompt}\n\n### Response:\n", f"{answer}{eos}\n\n"),
        "default": (f"Human: {prompt}{eos}\nAssistant:", f"{answer}{eos}\n"),
    }[template]


def sharegpt_text(template: str, record: dict) -> tuple[str, str]:
    """(whole text, answers text) of a glaive tool-call conversation in the llama3 / qwen3 formats."""
    tools = json.loads(record["tools"]) if record["tools"] else []
    wrapped = [{"type": "function", "function": t} for t in tools]
    text, answers = "", ""
    if template == "llama3":
        text = "<|begin_of_text|>"
        if tools:
            listing = "".join(json.dumps(w, indent=4, ensure_ascii=False) + "\n\n" for w in wrapped)
            system = LLAMA3_TOOLS.format(date=datetime.now().strftime("%d %b %Y"), tools=listing)
            text += f"<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
    elif tools:
        listing = "".join("\n" + json.dumps(w, ensure_ascii=False) for w in wrapped)
        text = f"<|im_start|>system\n{QWEN_TOOLS.format(tools=listing)}<|im_end|>\n"
    for turn in record["conversations"]:
        role, value = turn["from"], turn["value"]
        if role == "function_call":
            call = json.loads(value)
            if template == "llama3":
                value = json.dumps({"name": call["name"], "parameters": call["arguments"]}, ensure_ascii=False)
            else:
                value = "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
        if template == "llama3":
            head = {"human": "user", "observation": "ipython"}.get(role)
            piece = (
                f"<|start_header_id|>{head}<|end_header_id|>\n\n{value}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n"
                if head
                else f"{value}<|eot_id|>"
            )
        elif role == "human":
            piece = f"<|im_start|>user\n{value}<|im_end|>\n<|im_start|>assistant\n"
        elif role == "observation":
            piece = f"<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        else:
            piece = ("<think>\n\n</think>\n\n" if template == "qwen3" else "") + f"{value}<|im_end|>\n"
        text += piece
        answers += piece if role in ("gpt", "function_call") else ""
    return text, answers


def encoded(tokenizer_dir, compat_dir, dataset: str, template: str, samples: int = 60):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = build_config(
        {
            "model_name_or_path": str(tokenizer_dir),
            "dataset": dataset,
            "dataset_dir": str(compat_dir / "data"),
            "template": template,
            "cutoff_len": 100_000,
            "max_samples": samples,
            "do_train": True,
        }
    )
    chat = get_template(template, tokenizer, "sft")
    chat.fix_tokenizer(tokenizer)
    return tokenizer, build_splits(cfg, tokenizer, chat).train


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def answer_text(tokenizer, example) -> str:
    return decode(tokenizer, [t for t in example["labels"] if t != IGNORE_INDEX])


@pytest.mark.parametrize("template", ["llama3", "qwen3", "qwen3_nothink", "alpaca", "default"])
@pytest.mark.parametrize("dataset", ["identity", "alpaca_en_demo", "alpaca_zh_demo"])
def test_alpaca_demo_data_renders_as_the_template_says(tokenizer_dir, compat_dir, dataset, template):
    tokenizer, train = encoded(tokenizer_dir, compat_dir, dataset, template)
    records = json.loads((compat_dir / "data" / f"{dataset}.json").read_text())[: len(train)]
    assert len(train) == len(records) == 60
    for example, record in zip(train, records):
        prompt = record["instruction"] + ("\n" + record["input"] if record["input"] else "")
        want_prompt, want_answer = alpaca_turn(template, prompt, record["output"], tokenizer.eos_token)
        assert decode(tokenizer, example["input_ids"]) == want_prompt + want_answer
        assert answer_text(tokenizer, example) == want_answer


@pytest.mark.parametrize("template", ["llama3", "qwen3", "qwen3_nothink"])
def test_sharegpt_tool_calls_render_as_the_template_says(tokenizer_dir, compat_dir, template):
    tokenizer, train = encoded(tokenizer_dir, compat_dir, "glaive_toolcall_en_demo", template, samples=80)
    records = json.loads((compat_dir / "data" / "glaive_toolcall_en_demo.json").read_text())[:80]
    roles = {turn["from"] for r in records for turn in r["conversations"]}
    assert {"function_call", "observation"} <= roles and any(r["tools"] for r in records)
    for example, record in zip(train, records):
        want_text, want_answers = sharegpt_text(template, record)
        assert decode(tokenizer, example["input_ids"]) == want_text
        assert answer_text(tokenizer, example) == want_answers


def test_tokenizer_template_uses_the_tokenizers_own_chat_format(tokenizer_dir, compat_dir):
    """The demo tokenizer carries the official Llama 3 jinja template: it must render as `llama3` does."""
    tokenizer, own = encoded(tokenizer_dir, compat_dir, "alpaca_en_demo", "tokenizer", samples=20)
    _, named = encoded(tokenizer_dir, compat_dir, "alpaca_en_demo", "llama3", samples=20)
    assert own["input_ids"] == named["input_ids"] and own["labels"] == named["labels"]


def test_enable_thinking_false_keeps_the_empty_thought_out_of_the_loss(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    [(prompt, answer)] = TEMPLATES["qwen3"].encode_pairs(tokenizer, messages, enable_thinking=False)
    assert decode(tokenizer, prompt).endswith("assistant\n<think>\n\n</think>\n\n")
    assert decode(tokenizer, answer) == "yo<|im_end|>\n"
