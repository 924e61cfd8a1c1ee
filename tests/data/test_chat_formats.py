"""gemma, gemma3, gemma3n, llama2, llama4, mistral, phi, phi_small, phi4 and phi4_mini write conversations as
LLaMA-Factory's templates of the same names do, and as the model families' own jinja chat templates do where
those agree with LLaMA-Factory.

Two kinds of reference:

* LLaMA-Factory's format, spelled out here by hand from its `register_template` definitions
  (src/llamafactory/data/template.py and tool_utils.py); every template, with tools and tool calls.
* The real jinja chat templates, read from llama.cpp as vendored in the llama-cpp-python sdist on PyPI
  (MIT; not copied into this repository): models/templates/google-gemma-2-2b-it.jinja,
  models/templates/microsoft-Phi-3.5-mini-instruct.jinja, and from tests/test-chat-template.cpp the
  "phi-4" and "Mistral-Large-Instruct-2407 (mistralai 'v3' template ...)" templates. The sdist is taken
  with `pip download` (from pip's cache when it is there) into ~/.cache/tiletune/chat-templates, or read
  from $TILETUNE_LLAMA_CPP_SDIST; the tests that need it skip when it cannot be had.

The demo tokenizer stands in for each family's tokenizer, with the family's special tokens added, so
both renderings are compared token for token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from datetime import datetime
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tiletune.data.processing import IGNORE_INDEX, encode_supervised
from tiletune.data.templates import TEMPLATES

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tiletune" / "chat-templates"
WANTED = {
    "gemma2.jinja": "vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja",
    "phi3.5.jinja": "vendor/llama.cpp/models/templates/microsoft-Phi-3.5-mini-instruct.jinja",
    "test-chat-template.cpp": "vendor/llama.cpp/tests/test-chat-template.cpp",
    "LICENSE": "vendor/llama.cpp/LICENSE",
}
SPECIAL = {  # the tokens each family's tokenizer has as single special tokens
    "gemma": ["<start_of_turn>", "<end_of_turn>"],
    "gemma3": ["<start_of_turn>", "<end_of_turn>"],
    "gemma3n": ["<start_of_turn>", "<end_of_turn>"],
    "llama2": [],
    "llama4": ["<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>"],
    "mistral": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
    "phi": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "phi_small": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "phi4": ["<|im_start|>", "<|im_sep|>", "<|im_end|>"],
    "phi4_mini": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"],
}
NEW = sorted(SPECIAL)

SYSTEM = "You are terse."
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    }
]
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "A small model."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye."},
]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "function", "content": json.dumps(CALL)},
    {"role": "observation", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
]


def tokenizer_for(name: str, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[name]}, replace_extra_special_tokens=False)
    TEMPLATES[name].fix_tokenizer(tokenizer)
    return tokenizer


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def default_tools_text() -> str:
    """LLaMA-Factory's `default` tool prompt for TOOLS."""
    return (
        "You have access to the following tools:\n"
        "> Tool Name: get_weather\nTool Description: Weather of a city\nTool Args:\n"
        "  - city (string, required): the city\n\n"
        "Use the following format if using a tool:\n```\n"
        "Action: tool name (one of [get_weather])\n"
        "Action Input: the input to the tool, in a JSON format representing the kwargs "
        '(e.g. ```{"input": "hello world", "num_beams": 5}```)\n```\n'
    )


LLAMA3_TOOLS = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}"
)
LLAMA4_HEADS = {"user": "user", "observation": "ipython"}  # the header of each prompt-side role


def lf_tool_text(name: str, tools: list) -> str:
    """The tool description LLaMA-Factory's template `name` appends to the system prompt."""
    wrapped = [{"type": "function", "function": t} for t in tools]
    if not tools:
        return ""
    if name == "mistral":
        return f"[AVAILABLE_TOOLS] {json.dumps(wrapped)}[/AVAILABLE_TOOLS]"
    if name == "phi4_mini":  # the dataset's tool JSON as given
        return f"<|tool|>{json.dumps(tools)}<|/tool|>"
    if name == "llama4":
        listing = "".join(json.dumps(w, indent=4) + "\n\n" for w in wrapped)
        return LLAMA3_TOOLS.format(date=datetime.now().strftime("%d %b %Y"), tools=listing)
    return default_tools_text()


def lf_call_text(name: str, call: dict) -> str:
    """A function-call message's content as LLaMA-Factory's template `name` writes it."""
    if name == "mistral":
        return json.dumps([call])
    if name == "llama4":
        return json.dumps({"name": call["name"], "parameters": call["arguments"]})
    return f"Action: {call['name']}\nAction Input: {json.dumps(call['arguments'])}"


def lf_turns(name: str, messages, system: str, tools: list, bos: str, eos: str) -> list[tuple[str, str]]:
    """(prompt, answer) texts per turn, written out from LLaMA-Factory's definition of `name`."""
    sys_text = system + lf_tool_text(name, tools)
    out: list[str] = []
    for i, m in enumerate(messages):
        role, c = m["role"], m["content"]
        if role == "function":
            c = lf_call_text(name, json.loads(c))
        first = bos if i == 0 and name in ("gemma", "gemma3", "gemma3n", "mistral", "phi_small", "llama4") else ""
        if name in ("gemma", "gemma3", "gemma3n"):
            if i == 0 and sys_text:
                c = f"{sys_text}\n\n{c}"
            text = {
                "user": f"<start_of_turn>user\n{c}<end_of_turn>\n<start_of_turn>model\n",
                "observation": f"<start_of_turn>tool\n{c}<end_of_turn>\n<start_of_turn>model\n",
            }.get(role, f"{c}<end_of_turn>\n")
        elif name == "llama2":
            if i == 0 and sys_text:
                c = f"<<SYS>>\n{sys_text}\n<</SYS>>\n\n{c}"
            text = f"{bos}[INST] {c} [/INST]" if role in ("user", "observation") else f"{c}{eos}"
        elif name == "llama4":
            head = f"<|header_start|>system<|header_end|>\n\n{sys_text}<|eot|>" if i == 0 and sys_text else ""
            text = head + (
                f"<|header_start|>{LLAMA4_HEADS[role]}<|header_end|>\n\n{c}<|eot|><|header_start|>assistant<|header_end|>\n\n"
                if role in LLAMA4_HEADS
                else f"{c}<|eot|>"
            )
        elif name == "mistral":
            if i == 0 and sys_text:
                c = f"{sys_text}\n\n{c}"
            text = {
                "user": f"[INST] {c}[/INST]",
                "observation": f'[TOOL_RESULTS] {{"content": {c}}}[/TOOL_RESULTS]',
                "function": f"[TOOL_CALLS] {c}{eos}",
            }.get(role, f" {c}{eos}")
        elif name in ("phi", "phi_small"):
            head = f"<|system|>\n{sys_text}<|end|>\n" if i == 0 and sys_text else ""
            text = head + (f"<|user|>\n{c}<|end|>\n<|assistant|>\n" if role in ("user", "observation") else f"{c}<|end|>\n")
        elif name == "phi4_mini":
            head = f"<|system|>{sys_text}<|end|>" if i == 0 and sys_text else ""
            text = head + (f"<|user|>{c}<|end|><|assistant|>" if role in ("user", "observation") else f"{c}<|end|>")
        else:  # phi4
            head = f"<|im_start|>system<|im_sep|>{sys_text}<|im_end|>" if i == 0 and sys_text else ""
            text = head + (
                f"<|im_start|>user<|im_sep|>{c}<|im_end|><|im_start|>assistant<|im_sep|>"
                if role in ("user", "observation")
                else f"{c}<|im_end|>"
            )
        out.append(first + text)
    return [(out[i], out[i + 1]) for i in range(0, len(out), 2)]


def end_of_turn_id(name: str, tokenizer) -> int:
    """The token that closes an answer: the template's stop word, else the tokenizer's EOS."""
    stop = TEMPLATES[name].stop_words
    return tokenizer.convert_tokens_to_ids(stop[0]) if stop else tokenizer.eos_token_id


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize(
    "system, tools, messages",
    [("", [], CHAT), (SYSTEM, [], CHAT), (SYSTEM, TOOLS, TOOL_CHAT), ("", TOOLS, TOOL_CHAT)],
    ids=["plain", "system", "system+tools", "tools"],
)
def test_renders_as_llamafactory_writes_it(tokenizer_dir, name, system, tools, messages):
    tokenizer = tokenizer_for(name, tokenizer_dir)
    pairs = TEMPLATES[name].encode_pairs(tokenizer, messages, system, json.dumps(tools) if tools else "")
    want = lf_turns(name, messages, system, tools, tokenizer.bos_token, tokenizer.eos_token)
    assert [(decode(tokenizer, p), decode(tokenizer, r)) for p, r in pairs] == want

    # the loss sees the answers, each closed by its end-of-turn token, and nothing of the prompts
    example = encode_supervised(pairs, cutoff_len=100_000, train_on_prompt=False, mask_history=False)
    assert example["input_ids"] == [t for p, r in pairs for t in p + r]
    assert example["labels"] == [t for p, r in pairs for t in [IGNORE_INDEX] * len(p) + r]
    seen = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert decode(tokenizer, seen) == "".join(answer for _, answer in want)
    end = end_of_turn_id(name, tokenizer)
    for _, response in pairs:  # each answer ends with its end-of-turn token (and the format's newline)
        assert end in response[-2:] and decode(tokenizer, response[response.index(end) + 1 :]) in ("", "\n")


def test_system_goes_into_the_first_user_message_only_where_the_template_says():
    fused = {n for n, t in TEMPLATES.items() if t.system_in_user}
    assert fused == {"gemma", "gemma3", "gemma3n", "llama2", "mistral"}
    pieces = TEMPLATES["gemma"].render(CHAT[:2], system="S")
    assert pieces[0][1] == "<start_of_turn>user\nS\n\nHi there<end_of_turn>\n<start_of_turn>model\n"


# --- the real jinja chat templates ---------------------------------------------------------------


def _cxx_template(source: str, name: str) -> str:
    """The template string of test case `name` in llama.cpp's tests/test-chat-template.cpp."""
    match = re.search(
        r'/\* \.name= \*/ "' + re.escape(name) + r'",\s*/\* \.template_str= \*/ (?:U8C\()?"((?:[^"\\]|\\.)*)"', source
    )
    assert match, f"no test case {name!r} in test-chat-template.cpp"
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), match.group(1))


@pytest.fixture(scope="session")
def real_templates() -> dict[str, str]:
    if not all((CACHE / name).is_file() for name in WANTED):
        CACHE.mkdir(parents=True, exist_ok=True)
        sdist = os.environ.get("TILETUNE_LLAMA_CPP_SDIST")
        if not sdist:
            try:
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                     LLAMA_CPP_SDIST, "-d", str(CACHE)],
                    check=True, capture_output=True, timeout=600,
                )  # fmt: skip
            except (subprocess.SubprocessError, OSError) as err:
                pytest.skip(f"real chat templates need the {LLAMA_CPP_SDIST} sdist (pip download failed: {err}); "
                            f"fetch it with pip download --no-deps --no-binary :all: {LLAMA_CPP_SDIST} -d {CACHE}")
            sdist = str(next(CACHE.glob("llama_cpp_python-*.tar.gz")))
        with tarfile.open(sdist) as tar:
            for member in tar:
                for name, tail in WANTED.items():
                    if member.name.endswith("/" + tail):
                        (CACHE / name).write_bytes(tar.extractfile(member).read())
        if not os.environ.get("TILETUNE_LLAMA_CPP_SDIST"):
            Path(sdist).unlink()
        missing = [name for name in WANTED if not (CACHE / name).is_file()]
        if missing:
            pytest.skip(f"{sdist} lacks {missing}")
    cxx = (CACHE / "test-chat-template.cpp").read_text()
    return {
        "gemma": (CACHE / "gemma2.jinja").read_text(),
        "phi": (CACHE / "phi3.5.jinja").read_text(),
        "phi_small": _cxx_template(cxx, "Phi-3-small"),
        "phi4": _cxx_template(cxx, "phi-4"),
        "mistral": _cxx_template(
            cxx, "Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have system prompt at start)"
        ),
    }


def real_render(tokenizer, template: str, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def compare_with_real(name, tokenizer, real, system: str, messages, real_messages, drop_tail: str = "", tools: str = ""):
    """tiletune's whole conversation and its last prompt equal the real template's, token for token."""
    pairs = TEMPLATES[name].encode_pairs(tokenizer, messages, system, tools)
    whole = real_render(tokenizer, real, real_messages, generation_prompt=False)
    assert whole.endswith(drop_tail)
    whole = whole[: len(whole) - len(drop_tail)]
    ours = [t for p, r in pairs for t in p + r]
    assert decode(tokenizer, ours) == whole
    assert ours == tokenizer.encode(whole, add_special_tokens=False)
    prompt = real_render(tokenizer, real, real_messages[:-1], generation_prompt=True)
    assert decode(tokenizer, ours[: len(ours) - len(pairs[-1][1])]) == prompt


@pytest.mark.parametrize("name", ["gemma", "gemma3"])
@pytest.mark.parametrize("system", ["", SYSTEM])
def test_gemma_matches_gemmas_own_template(tokenizer_dir, real_templates, name, system):
    """Gemma 2's template rejects a system message; Gemma 3's own template writes it as
    `system + "\\n\\n"` at the start of the first user message, which is what LLaMA-Factory does: here the
    real Gemma 2 template is given that first message."""
    tokenizer = tokenizer_for(name, tokenizer_dir)
    real_messages = [dict(m) for m in CHAT]
    if system:
        real_messages[0]["content"] = f"{system}\n\n{real_messages[0]['content']}"
    compare_with_real(name, tokenizer, real_templates["gemma"], system, CHAT, real_messages)


@pytest.mark.parametrize("system", ["", SYSTEM])
def test_phi_matches_phi_3_5s_own_template(tokenizer_dir, real_templates, system):
    """Phi-3.5-mini's template ends a conversation with the tokenizer's EOS (`<|endoftext|>` there) after
    the last `<|end|>\\n`; LLaMA-Factory's phi template, and so tiletune, stop at `<|end|>\\n`."""
    tokenizer = tokenizer_for("phi", tokenizer_dir)
    real_messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    compare_with_real("phi", tokenizer, real_templates["phi"], system, CHAT, real_messages, drop_tail=tokenizer.eos_token)


@pytest.mark.parametrize("system", ["", SYSTEM])
def test_phi4_matches_phi_4s_own_template(tokenizer_dir, real_templates, system):
    tokenizer = tokenizer_for("phi4", tokenizer_dir)
    real_messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    compare_with_real("phi4", tokenizer, real_templates["phi4"], system, CHAT, real_messages)


@pytest.mark.parametrize("turns", [1, 3])
def test_mistral_matches_mistrals_v3_template(tokenizer_dir, real_templates, turns):
    tokenizer = tokenizer_for("mistral", tokenizer_dir)
    messages = CHAT[: 2 * turns]
    compare_with_real("mistral", tokenizer, real_templates["mistral"], "", messages, messages)


@pytest.mark.parametrize("turns", [1, 3])
def test_mistral_system_prompt_goes_where_llamafactory_puts_it(tokenizer_dir, real_templates, turns):
    """Mistral's v3 template (Mistral-7B-Instruct-v0.3, Mistral-Large-2407) writes the system prompt only
    into the user message that is the conversation's last message (so only into a generation prompt);
    LLaMA-Factory's mistral template writes it into the FIRST user message. For one turn the prompts
    agree; for several, tiletune follows LLaMA-Factory, and this test pins the difference."""
    tokenizer = tokenizer_for("mistral", tokenizer_dir)
    messages = CHAT[: 2 * turns]
    pairs = TEMPLATES["mistral"].encode_pairs(tokenizer, messages, SYSTEM)
    ours = decode(tokenizer, [t for p, r in pairs[:-1] for t in p + r] + pairs[-1][0])
    real_messages = [{"role": "system", "content": SYSTEM}] + messages[:-1]
    real = real_render(tokenizer, real_templates["mistral"], real_messages, generation_prompt=True)
    if turns > 1:
        last_user = messages[-2]["content"]
        real = real.replace(f"{SYSTEM}\n\n{last_user}", last_user).replace("[INST] ", f"[INST] {SYSTEM}\n\n", 1)
    assert ours == real


@pytest.mark.parametrize("system", ["", SYSTEM])
def test_phi_small_matches_phi_3_smalls_own_template(tokenizer_dir, real_templates, system):
    """Phi-3-small's template starts with its BOS (<|endoftext|> there) and, like Phi-3.5's, ends a conversation
    with its EOS after the last `<|end|>\\n`, where tiletune (and LLaMA-Factory) stop. LLaMA-Factory writes no
    BOS: its phi_small prefix {"<|endoftext|>"} is a set it encodes to nothing; tiletune follows the model."""
    tokenizer = tokenizer_for("phi_small", tokenizer_dir)
    real_messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    compare_with_real(
        "phi_small", tokenizer, real_templates["phi_small"], system, CHAT, real_messages, drop_tail=tokenizer.eos_token
    )


@pytest.fixture(scope="session")
def gemma3_template() -> str:
    """Gemma 3's own chat template, as TRL stores it (trl/chat_templates/gemma3.jinja)."""
    pytest.importorskip("trl", reason="Gemma 3's template is read from TRL (the `preference` extra)")
    from importlib.resources import files

    return (files("trl") / "chat_templates" / "gemma3.jinja").read_text()


@pytest.mark.parametrize("name", ["gemma3", "gemma3n"])
@pytest.mark.parametrize("system", ["", SYSTEM])
def test_gemma3_and_3n_match_gemma_3s_own_template(tokenizer_dir, gemma3_template, name, system):
    """Gemma 3's template takes a system message and writes it as LLaMA-Factory does: `system + "\\n\\n"` at the
    start of the first user message."""
    tokenizer = tokenizer_for(name, tokenizer_dir)
    real_messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    compare_with_real(name, tokenizer, gemma3_template, system, CHAT, real_messages)


@pytest.mark.parametrize("system", ["", SYSTEM])
def test_llama4_matches_llama_4s_own_template(tokenizer_dir, system):
    """Llama 4's template as transformers' Llama4Processor carries it. Without tools the two agree; with tools
    Llama 4's template writes them into the first user message and tiletune, as LLaMA-Factory, into the system
    prompt in Llama 3's words (pinned by test_renders_as_llamafactory_writes_it)."""
    from transformers.models.llama4.processing_llama4 import chat_template

    tokenizer = tokenizer_for("llama4", tokenizer_dir)
    real_messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    compare_with_real("llama4", tokenizer, chat_template, system, CHAT, real_messages)


# microsoft/Phi-4-mini-instruct, tokenizer_config.json "chat_template" (MIT)
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is "
    "not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + "
    "'<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


@pytest.mark.parametrize("system, tools", [("", ""), (SYSTEM, ""), (SYSTEM, json.dumps(TOOLS)), ("", json.dumps(TOOLS))],
                         ids=["plain", "system", "system+tools", "tools"])
def test_phi4_mini_matches_phi_4_minis_own_template(tokenizer_dir, system, tools):
    """Phi-4-mini's template writes the tool list, as given, between <|tool|> and <|/tool|> in the system message,
    and ends a conversation with its EOS, where tiletune (and LLaMA-Factory) stop."""
    tokenizer = tokenizer_for("phi4_mini", tokenizer_dir)
    head = [{"role": "system", "content": system, **({"tools": tools} if tools else {})}] if system or tools else []
    compare_with_real("phi4_mini", tokenizer, PHI4_MINI_TEMPLATE, system, CHAT, head + CHAT,
                      drop_tail=tokenizer.eos_token, tools=tools)
