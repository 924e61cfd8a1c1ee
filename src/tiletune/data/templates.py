"""Chat templates: how a conversation becomes token ids, and which of them the loss sees.

Each template writes messages exactly as LLaMA-Factory's template of the same name (which is the model
family's own chat format). A message renders to a list of pieces: text (encoded on its own, without
special tokens added) or the tokenizer's BOS/EOS. `encode_pairs` returns one (prompt ids, response ids)
pair per turn; the caller masks prompts from the loss.

Most formats give the system prompt a slot of its own before the first user message; some (gemma,
mistral, llama2: LLaMA-Factory's `Llama2Template`) write it inside the first user message instead, which
a template says with `system_in_user`. Tool descriptions are written by the template's `tool_format`
(data/tools.py), or, for a template with a `tools` slot (phi4_mini), as the dataset's JSON text in that slot.

The `tokenizer` template uses the tokenizer's own jinja chat template instead.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from tiletune.data.tools import format_function_call, format_tools
from tiletune.errors import UserError

BOS = ("bos",)  # a piece standing for tokenizer.bos_token_id
EOS = ("eos",)  # a piece standing for tokenizer.eos_token_id
Piece = str | tuple

USER, ASSISTANT, SYSTEM, FUNCTION, OBSERVATION = "user", "assistant", "system", "function", "observation"


@dataclass(frozen=True)
class Template:
    """A chat format. Slots are tuples of pieces; '{content}' in a text piece takes the message."""

    name: str
    user: tuple = ("{content}",)
    assistant: tuple = ("{content}", EOS)
    system: tuple = ("{content}",)
    function: tuple | None = None  # None: like `assistant`
    observation: tuple | None = None  # None: like `user`
    prefix: tuple = ()
    default_system: str = ""
    tool_format: str = "default"
    tools: tuple | None = None  # a slot for the dataset's tool JSON as given, instead of tool_format's prompt
    stop_words: tuple[str, ...] = ()
    replace_eos: bool = False
    thought_words: tuple[str, str] | None = None  # a reasoning template adds an empty thought to answers
    # True: the system text (system prompt + tool descriptions, written through the `system` slot, which
    # must then be text only) is put in front of the first user message's content, inside the `user`
    # slot, instead of before it (LLaMA-Factory's Llama2Template: gemma, mistral, llama2).
    system_in_user: bool = False

    def fix_tokenizer(self, tokenizer) -> int:
        """Make EOS the template's stop word and give the tokenizer a pad token; returns tokens added."""
        added = 0
        if self.replace_eos and tokenizer.eos_token != self.stop_words[0]:
            added += tokenizer.add_special_tokens({"eos_token": self.stop_words[0]})
        if tokenizer.eos_token_id is None:
            added += tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        extra = [w for w in self.stop_words[1 if self.replace_eos else 0 :] if w not in tokenizer.get_vocab()]
        if extra:
            added += tokenizer.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
        return added

    def stop_token_ids(self, tokenizer) -> list[int]:
        """Token ids that end a generated answer."""
        ids = {tokenizer.eos_token_id}
        ids.update(tokenizer.convert_tokens_to_ids(word) for word in self.stop_words)
        return sorted(i for i in ids if i is not None)

    def encode_pairs(self, tokenizer, messages, system: str = "", tools: str = "", enable_thinking: bool = True):
        """[(prompt_ids, response_ids)] per turn of `messages` (user/observation, then assistant/function)."""
        messages = self._prepare_thoughts(messages, enable_thinking)
        encoded = [self._to_ids(tokenizer, pieces) for pieces in self.render(messages, system, tools)]
        pairs = [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]
        if self.thought_words:
            empty = tokenizer.encode("".join(self.thought_words), add_special_tokens=False)
            for turn, (prompt, response) in enumerate(pairs):
                answer = messages[2 * turn + 1]["content"]
                if self.thought_words[0].strip() in answer or self.thought_words[1].strip() in answer:
                    continue
                pairs[turn] = (prompt + empty, response) if not enable_thinking else (prompt, empty + response)
        return pairs

    def render(self, messages, system: str = "", tools: str = "") -> list[list[Piece]]:
        """The pieces of each message, the first one carrying the prefix and the system prompt."""
        system = system or self.default_system
        rendered = []
        for index, message in enumerate(messages):
            pieces: list[Piece] = []
            role, content = message["role"], message["content"]
            if index == 0:
                pieces += list(self.prefix)
                tool_text = self._tool_text(tools) if tools else ""
                if (system or tool_text) and not self.system_in_user:
                    pieces += _fill(self.system, system + tool_text)
                elif (system or tool_text) and role == USER:
                    content = "".join(_fill(self.system, system + tool_text)) + content
            if role == FUNCTION:
                pieces += _fill(self.function or self.assistant, format_function_call(self.tool_format, content))
            else:
                slot = {USER: self.user, ASSISTANT: self.assistant, OBSERVATION: self.observation or self.user}[role]
                pieces += _fill(slot, content)
            rendered.append(pieces)
        return rendered

    def _tool_text(self, tools: str) -> str:
        if self.tools is None:
            return format_tools(self.tool_format, tools)
        return "".join(_fill(self.tools, tools))

    def _prepare_thoughts(self, messages, enable_thinking: bool):
        if not self.thought_words or enable_thinking:
            return messages
        pattern = re.compile(f"{re.escape(self.thought_words[0])}(.*?){re.escape(self.thought_words[1])}", re.DOTALL)
        return [
            {**m, "content": pattern.sub("", m["content"]).lstrip("\n")} if m["role"] == ASSISTANT else m
            for m in messages
        ]

    @staticmethod
    def _to_ids(tokenizer, pieces: list[Piece]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            if piece == BOS:
                ids += [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
            elif piece == EOS:
                ids += [tokenizer.eos_token_id]
            elif piece:
                ids += tokenizer.encode(piece, add_special_tokens=False)
        return ids


def _check(template: Template) -> Template:
    if template.system_in_user and not all(isinstance(p, str) for p in template.system):
        raise ValueError(f"template {template.name}: system_in_user needs a text-only system slot")
    return template


def _fill(slot: tuple, content: str) -> list[Piece]:
    return [p.replace("{content}", content) if isinstance(p, str) else p for p in slot]


@dataclass(frozen=True)
class TokenizerTemplate(Template):
    """Renders with the tokenizer's own jinja chat template (`tokenizer.apply_chat_template`).

    Prompt and response are split by rendering growing prefixes of the conversation, which needs a
    chat template whose rendering of a conversation starts with the rendering of its beginning.
    """

    name: str = "tokenizer"
    thought_words: tuple[str, str] | None = field(default=None)

    def fix_tokenizer(self, tokenizer) -> int:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "template: tokenizer needs a tokenizer with a chat_template; this one has none — "
                "choose a named template (e.g. llama3, qwen3, alpaca)"
            )
        return super().fix_tokenizer(tokenizer)

    def stop_token_ids(self, tokenizer) -> list[int]:
        return [tokenizer.eos_token_id]

    def encode_pairs(self, tokenizer, messages, system: str = "", tools: str = "", enable_thinking: bool = True):
        chat = [{"role": "system", "content": system}] if system else []
        tool_list = json.loads(tools) if tools else None
        pairs, done = [], ""
        for turn in range(0, len(messages), 2):
            chat.append(_hf_message(messages[turn]))
            prompt = self._apply(tokenizer, chat, tool_list, generation_prompt=True)
            chat.append(_hf_message(messages[turn + 1]))
            full = self._apply(tokenizer, chat, tool_list, generation_prompt=False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise UserError(
                    "template: tokenizer cannot split this conversation into turns (its chat template rewrites "
                    "earlier turns); choose a named template instead"
                )
            pairs.append(
                (
                    tokenizer.encode(prompt[len(done) :], add_special_tokens=False),
                    tokenizer.encode(full[len(prompt) :], add_special_tokens=False),
                )
            )
            done = full
        return pairs

    @staticmethod
    def _apply(tokenizer, chat, tools, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def _hf_message(message: dict) -> dict:
    """A message in the OpenAI/HF chat format that jinja chat templates read."""
    if message["role"] == FUNCTION:
        calls = json.loads(message["content"])
        calls = calls if isinstance(calls, list) else [calls]
        return {"role": "assistant", "tool_calls": [{"type": "function", "function": c} for c in calls]}
    if message["role"] == OBSERVATION:
        return {"role": "tool", "content": message["content"]}
    return {"role": message["role"], "content": message["content"]}


CHATML = {
    "user": ("<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",),
    "assistant": ("{content}<|im_end|>\n",),
    "system": ("<|im_start|>system\n{content}<|im_end|>\n",),
    "stop_words": ("<|im_end|>",),
    "replace_eos": True,
}
QWEN = dict(
    CHATML,
    observation=("<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",),
    tool_format="qwen",
)

PHI3 = {
    "user": ("<|user|>\n{content}<|end|>\n<|assistant|>\n",),
    "assistant": ("{content}<|end|>\n",),
    "system": ("<|system|>\n{content}<|end|>\n",),
    "stop_words": ("<|end|>",),
    "replace_eos": True,
}


def _headers(start: str, end: str, eot: str, eom: str) -> dict:
    """Llama 3's and Llama 4's format: a header per role, an end-of-turn token, tools and calls as llama3's."""

    def head(role: str) -> str:
        return f"{start}{role}{end}\n\n"

    return {
        "user": (head("user") + "{content}" + eot + head("assistant"),),
        "assistant": ("{content}" + eot,),
        "system": (head("system") + "{content}" + eot,),
        "observation": (head("ipython") + "{content}" + eot + head("assistant"),),
        "prefix": (BOS,),
        "tool_format": "llama3",
        "stop_words": (eot, eom),
        "replace_eos": True,
    }


GEMMA = {
    "user": ("<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n",),
    "assistant": ("{content}<end_of_turn>\n",),
    "system": ("{content}\n\n",),
    "observation": ("<start_of_turn>tool\n{content}<end_of_turn>\n<start_of_turn>model\n",),
    "prefix": (BOS,),
    "stop_words": ("<end_of_turn>",),
    "replace_eos": True,
    "system_in_user": True,
}

TEMPLATES: dict[str, Template] = {
    t.name: _check(t)
    for t in [
        Template("empty", assistant=("{content}",)),
        Template(
            "default",
            user=("Human: {content}", EOS, "\nAssistant:"),
            assistant=("{content}", EOS, "\n"),
            system=("System: {content}", EOS, "\n"),
        ),
        Template(
            "alpaca",
            user=("### Instruction:\n{content}\n\n### Response:\n",),
            assistant=("{content}", EOS, "\n\n"),
            default_system=(
                "Below is an instruction that describes a task. "
                "Write a response that appropriately completes the request.\n\n"
            ),
        ),
        Template("llama3", **_headers("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")),
        Template("llama4", **_headers("<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>")),
        Template("chatml", **CHATML),
        Template("gemma", **GEMMA),
        Template("gemma3", **GEMMA),  # Gemma 3 writes text as Gemma (1 and 2) does
        Template("gemma3n", **GEMMA),  # and so does Gemma 3n
        Template(
            "llama2",
            user=(BOS, "[INST] {content} [/INST]"),
            system=("<<SYS>>\n{content}\n<</SYS>>\n\n",),
            system_in_user=True,
        ),
        Template(
            "mistral",
            user=("[INST] {content}[/INST]",),
            assistant=(" {content}", EOS),
            system=("{content}\n\n",),
            function=("[TOOL_CALLS] {content}", EOS),
            observation=('[TOOL_RESULTS] {"content": {content}}[/TOOL_RESULTS]',),
            prefix=(BOS,),
            tool_format="mistral",
            system_in_user=True,
        ),
        # DeepSeek-V3's (and R1's, without the reasoning): LLaMA-Factory's `deepseek3`
        Template("deepseek3", user=("<｜User｜>{content}<｜Assistant｜>",), prefix=(BOS,)),
        Template("phi", **PHI3),
        # Phi-3-small's template starts with its BOS (<|endoftext|>); LLaMA-Factory's prefix {"<|endoftext|>"}
        # is a set naming neither bos_token nor eos_token, which it encodes to nothing
        Template("phi_small", prefix=(BOS,), **PHI3),
        Template(
            "phi4",
            user=("<|im_start|>user<|im_sep|>{content}<|im_end|><|im_start|>assistant<|im_sep|>",),
            assistant=("{content}<|im_end|>",),
            system=("<|im_start|>system<|im_sep|>{content}<|im_end|>",),
            stop_words=("<|im_end|>",),
            replace_eos=True,
        ),
        Template(
            "phi4_mini",
            user=("<|user|>{content}<|end|><|assistant|>",),
            assistant=("{content}<|end|>",),
            system=("<|system|>{content}<|end|>",),
            tools=("<|tool|>{content}<|/tool|>",),
            stop_words=("<|end|>",),
            replace_eos=True,
        ),
        Template("qwen", default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", **QWEN),
        Template("qwen3", thought_words=("<think>\n", "\n</think>\n\n"), **QWEN),
        Template("qwen3_nothink", **QWEN),
        TokenizerTemplate(),
    ]
}


def get_template(name: str | None, tokenizer, stage: str, default_system: str | None = None) -> Template:
    """The template named in the config; without a name, the tokenizer's own chat template, else `empty`."""
    if name is None:
        has_own = bool(getattr(tokenizer, "chat_template", None))
        template = TEMPLATES["tokenizer" if has_own and stage != "pt" else "empty"]
    elif name in TEMPLATES:
        template = TEMPLATES[name]
    else:
        raise UserError(f"template {name!r} is unknown; available: {', '.join(sorted(TEMPLATES))}")
    return template if default_system is None else dataclasses.replace(template, default_system=default_system)
